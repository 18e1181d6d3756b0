#!/bin/sh
# check_v4_fused.sh — the measurements that go into docs/ for version 4 with the fused backward (dQ
# added by the dK/dV kernel at D <= 128, the default since commit 1309c0f; --deterministic keeps
# the separate dQ kernel) and the context's kept workspace. On the H200, from the repository root:
#   DEPS=.devdeps sh dev/cuda/check_v4_fused.sh check|peers
#   check   parity (default and --deterministic), the Python tests on CUDA, C bench timings of
#           both backward forms (version 4, and version 2 via WINATTN_CUDA=mma), run-to-run
#           bit-identity of the deterministic backward, compute-sanitizer (dev/cuda/sanitize.sh)
#   peers   winattn probe --device cuda and bench/gpu_peers.py (JSON to $OUT/gpu-peers.json)
. dev/cuda/lab_env.sh
t0=$(date +%s)
lab_build build "" build/winattn lib
echo "built in $(($(date +%s) - t0)) s"
what=${1:-check}
if [ "$what" = check ]; then
    for flag in "" --deterministic; do
        echo "== parity --device cuda $flag"
        timeout 200 build/winattn parity --device cuda --threads 16 $flag >"$OUT/parity-cuda$flag.txt" 2>&1; echo "exit $?"
        grep '^FAIL' "$OUT/parity-cuda$flag.txt" | head -10; tail -1 "$OUT/parity-cuda$flag.txt"
    done
    echo "== python tests (numpy and PyTorch bindings, CUDA tensors included)"
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python timeout 200 python3 python/tests/test_python.py >"$OUT/python.txt" 2>&1
    grep -E '^FAIL|CUDA|determin' "$OUT/python.txt" | head; tail -1 "$OUT/python.txt"
    B="timeout 90 build/winattn bench --device cuda --reps 5"
    for flag in "" --deterministic; do
        echo "== bench ${flag:-default}: (a) 8K/16K/32K; (b) 8K/32K; D=64 window 1024 16K; version 2 (b) 8K"
        $B $flag --n 8192,16384,32768 | tail -3
        $B $flag --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
        $B $flag --n 16384 --d 64 --hkv 8 --sliding-window 1024 | tail -1
        WINATTN_CUDA=mma $B $flag --n 8192 --d 128 --hkv 8 --sliding-window 4096 | tail -1
    done
    echo "== backward twice through the PyTorch binding: bit-identical? (bf16 8K)"
    python3 dev/cuda/bit_identity.py
    echo "== sanitizers"
    OUT=$OUT timeout 250 sh dev/cuda/sanitize.sh
fi
if [ "$what" = peers ]; then
    echo "== probe --device cuda"
    timeout 120 build/winattn probe --device cuda >"$OUT/probe-cuda.txt" 2>&1; cat "$OUT/probe-cuda.txt"
    echo "== gpu_peers"
    timeout 430 python3 bench/gpu_peers.py --reps 3 --json "$OUT/gpu-peers.json" >"$OUT/gpu-peers.txt" 2>"$OUT/gpu-peers.err"
    echo "exit $?"; cat "$OUT/gpu-peers.txt"; tail -3 "$OUT/gpu-peers.err"
fi
echo "total $(($(date +%s) - t0)) s"

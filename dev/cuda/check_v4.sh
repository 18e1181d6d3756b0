#!/bin/sh
# check_v4.sh — the measurements that went into docs/ for version 4 before the fused backward
# (commits 9324d8a to 71c7489), on the H200, from the repository root:
#   DEPS=.devdeps sh dev/cuda/check_v4.sh peers|check|all
#   peers   winattn probe --device cuda (memory above inputs) and bench/gpu_peers.py (the issue's
#           table against FlexAttention and SDPA, JSON to $OUT/gpu-peers.json)
#   check   compute-sanitizer (dev/cuda/sanitize.sh) and a run-to-run bit-identity check of the
#           backward through the PyTorch binding (dev/cuda/bit_identity.py --modes deterministic,
#           the only form then); check_v4_fused.sh supersedes this script from commit 1309c0f on
#   all     peers, then the Python binding's tests on CUDA tensors and the bit-identity check
OUT=${OUT:-/tmp/out}
DEPS=${DEPS:-.devdeps}
mkdir -p "$OUT"
t0=$(date +%s)
timeout 400 make -j16 JANSSON_CFLAGS=-I$DEPS/usr/include JANSSON_LIBS=$DEPS/usr/lib/x86_64-linux-gnu/libjansson.a build/winattn lib \
    >"$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
echo "built in $(($(date +%s) - t0)) s; $(git rev-parse --short HEAD 2>/dev/null)"
what=${1:-peers}
if [ "$what" = peers ] || [ "$what" = all ]; then
    echo "== probe --device cuda"
    timeout 120 build/winattn probe --device cuda >"$OUT/probe-cuda.txt" 2>&1; cat "$OUT/probe-cuda.txt"
    echo "== gpu_peers"
    timeout 420 python3 bench/gpu_peers.py --reps 3 --json "$OUT/gpu-peers.json" >"$OUT/gpu-peers.txt" 2>"$OUT/gpu-peers.err"
    echo "exit $?"; cat "$OUT/gpu-peers.txt"; tail -3 "$OUT/gpu-peers.err"
fi
if [ "$what" = check ]; then
    echo "== sanitizers"
    OUT=$OUT sh dev/cuda/sanitize.sh
fi
if [ "$what" = all ]; then
    echo "== python tests (numpy and PyTorch bindings, CUDA tensors included)"
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python timeout 200 python3 python/tests/test_python.py >"$OUT/python.txt" 2>&1
    grep -E '^FAIL|CUDA' "$OUT/python.txt" | head; tail -1 "$OUT/python.txt"
fi
if [ "$what" = check ] || [ "$what" = all ]; then
    echo "== backward twice, bit-identical (bf16, (a) at 8K and (b) at 8K, GQA)"
    python3 dev/cuda/bit_identity.py --modes deterministic
fi
echo "total $(($(date +%s) - t0)) s"

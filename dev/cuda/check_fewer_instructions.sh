#!/bin/sh
# check_fewer_instructions.sh — the checks and figures for docs/ after the instruction-count work
# on versions 4 and 5 (edge_form, wa_unmasked_key_tiles / wa_unmasked_query_tiles, desc_at, the
# folded softmax, the dK/dV kernels' heaviest-first order; commit 1ab130a). On the H200, from the
# repository root:
#   DEPS=.devdeps sh dev/cuda/check_fewer_instructions.sh check|peers
#   check   build (and .lab-base/, when carried: the tree to compare against, `git archive` of an
#           earlier commit); kernel tests; the full parity sweep in both backward modes and
#           --quick on version 2; `winattn bench` at (a), (b), D = 64 and (c), both trees, (b) twice
#   peers   the Python tests on CUDA, run-to-run bit-identity through PyTorch, compute-sanitizer
#           on a subset, winattn probe, and bench/gpu_peers.py at (a) and (b) (JSON to
#           $OUT/gpu-peers.json) in what is left of ten minutes
# `peers` reuses build/ when the machine is still warm from `check`.
LAB_KEEP=1
. dev/cuda/lab_env.sh
what=${1:-check}
if [ "$what" = check ]; then
    (lab_build build "") &
    [ -d .lab-base ] && (cd .lab-base && lab_build build-base "" build-base/winattn) &
    wait
    [ -x build/winattn ] || exit 1
    echo "built in $(($(date +%s) - t0)) s"
    timeout 120 build/tests/test_kernels >"$OUT/test_kernels.txt" 2>&1; echo "kernel tests: $(tail -1 "$OUT/test_kernels.txt")"
    for flag in "" --deterministic; do
        timeout 240 build/winattn parity --device cuda --threads 16 $flag >"$KEEP/parity-cuda$flag.txt" 2>&1
        echo "parity ${flag:-default}: $(tail -1 "$KEEP/parity-cuda$flag.txt")"; grep '^FAIL' "$KEEP/parity-cuda$flag.txt" | head -5
    done
    echo "parity --quick, version 2: $(WINATTN_CUDA=mma timeout 120 build/winattn parity --device cuda --threads 16 --quick | tail -1)"
    echo "== checks done at $(($(date +%s) - t0)) s"
    B="--device cuda --reps 5"
    for w in build/winattn .lab-base/build-base/winattn; do
        [ -x $w ] || continue
        for flag in "" --deterministic; do
            echo "== $w ${flag:-default}: (b) 8K/32K twice; (a) 8K/16K/32K; D64 16K; (c) 8K"
            timeout 90 $w bench $B $flag --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
            timeout 90 $w bench $B $flag --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
            timeout 90 $w bench $B $flag --n 8192,16384,32768 | tail -3
            timeout 60 $w bench $B $flag --n 16384 --d 64 --hkv 8 --sliding-window 1024 | tail -1
            [ -z "$flag" ] && timeout 120 $w bench $B --n 8192,16384 --d 512 --hq 32 --hkv 4 --causal | tail -2
        done
    done
fi
if [ "$what" = peers ]; then
    [ -x build/winattn ] && [ -f build/libwinattn.so ] || lab_build build "" build/winattn lib
    echo "built at $(($(date +%s) - t0)) s"
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python timeout 200 python3 python/tests/test_python.py >"$OUT/python.txt" 2>&1
    echo "python tests: $(tail -1 "$OUT/python.txt")"; grep -E '^FAIL' "$OUT/python.txt" | head -5
    echo "== bit-identity through the PyTorch binding (bf16 8K)"
    timeout 200 python3 dev/cuda/bit_identity.py
    echo "== sanitizers"
    : >"$OUT/sanitize.txt"
    lab_sanitize memcheck build/winattn 309 309:--deterministic 399:--deterministic 748 337 973
    lab_sanitize racecheck build/winattn 309 399:--deterministic 337
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize.txt" | sort | uniq -c
    cp "$OUT/sanitize.txt" "$KEEP/"
    echo "== probe at $(($(date +%s) - t0)) s"
    timeout 120 build/winattn probe --device cuda >"$KEEP/probe-cuda.txt" 2>&1; tail -6 "$KEEP/probe-cuda.txt"
    left=$((575 - ($(date +%s) - t0)))
    echo "== gpu_peers (a), (b) at $(($(date +%s) - t0)) s, $left s left"
    timeout $left python3 bench/gpu_peers.py --shapes a,b --reps 3 --json "$KEEP/gpu-peers.json" >"$KEEP/gpu-peers.txt" 2>"$OUT/gpu-peers.err"
    echo "exit $?"; cat "$KEEP/gpu-peers.txt"; tail -3 "$OUT/gpu-peers.err"
fi
echo "total $(($(date +%s) - t0)) s"

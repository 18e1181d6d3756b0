#!/bin/sh
# check_v5_d512.sh — the checks and figures for docs/ of version 5 (D = 512 on mma.sync), on the
# H200: kernel tests (CUDA table: batches at D = 64..512), the Python tests on CUDA, the full parity
# sweep in both backward modes, bit-identity through PyTorch at (a), (b), (c), C-bench timings at
# (c) and, to show versions 2-4 unchanged, (a) and (b) at 8K; then compute-sanitizer
# (dev/cuda/sanitize.sh). From the repository root: DEPS=.devdeps sh dev/cuda/check_v5_d512.sh
. dev/cuda/lab_env.sh
t0=$(date +%s)
lab_build build ""
echo "built in $(($(date +%s) - t0)) s"
echo "== test_kernels"
timeout 120 build/tests/test_kernels >"$OUT/test_kernels.txt" 2>&1
grep -E '^FAIL' "$OUT/test_kernels.txt" | head; grep -c 'PASS kernel cuda' "$OUT/test_kernels.txt" | sed 's/^/cuda table passes: /'; tail -1 "$OUT/test_kernels.txt"
echo "== python tests"
WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python timeout 200 python3 python/tests/test_python.py >"$OUT/python.txt" 2>&1
grep -E '^FAIL|CUDA' "$OUT/python.txt" | head; tail -1 "$OUT/python.txt"
for flag in "" --deterministic; do
    echo "== parity --device cuda $flag"
    timeout 200 build/winattn parity --device cuda --threads 16 $flag >"$OUT/parity-cuda$flag.txt" 2>&1; echo "exit $?"
    grep '^FAIL' "$OUT/parity-cuda$flag.txt" | head -10; tail -1 "$OUT/parity-cuda$flag.txt"
done
echo "== bit-identity through the PyTorch binding (bf16 8K)"
timeout 200 python3 dev/cuda/bit_identity.py
B="timeout 90 build/winattn bench --device cuda --reps 5"
echo "== bench: (c) 8K default and --deterministic; (a) 8K; (b) 8K"
$B --n 8192 --d 512 --hq 32 --hkv 4 --causal | tail -1
$B --n 8192 --d 512 --hq 32 --hkv 4 --causal --deterministic | tail -1
$B --n 8192 | tail -1
$B --n 8192 --d 128 --hkv 8 --sliding-window 4096 | tail -1
echo "== sanitizers"
OUT=$OUT timeout 300 sh dev/cuda/sanitize.sh
echo "total $(($(date +%s) - t0)) s"

#!/bin/sh
# v5_d512.sh — version 5: head dim 512 on mma.sync (fwd_mma_kernel split over D, bwd_wide.cu).
# Build, registers, parity on every D = 512 case (default and --deterministic), the full sweep
# once, compute-sanitizer on three small D = 512 cases, then shape (c) timed against version 1
# (WINATTN_CUDA=v1, one rep: it takes seconds). From the repository root on the H200:
#   DEPS=.devdeps sh dev/cuda/v5_d512.sh
. dev/cuda/lab_env.sh
lab_build build ""
nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -Iinclude -std=c++17 -Xptxas -v -c src/cuda/bwd_wide.cu -o /tmp/w.o 2>&1 |
    grep -E "Used|spill" | sort | uniq -c
W=build/winattn
CASES=$(lab_d512_cases $W)
echo "== parity on the f16/bf16 D = 512 cases: $CASES"
echo "== D=512, default backward"; lab_parity_each $W "$CASES"
echo "== D=512, --deterministic"; lab_parity_each $W "$CASES" --deterministic
echo "== full sweep"
timeout 200 $W parity --device cuda --threads 16 >"$OUT/parity_cuda.txt" 2>&1; grep '^FAIL' "$OUT/parity_cuda.txt" | head; tail -3 "$OUT/parity_cuda.txt"
echo "== compute-sanitizer on 337, 341, 836"
lab_sanitize memcheck $W 337 341 836
lab_sanitize racecheck $W 337 836
echo "== (c) bf16, Hq=32, Hkv=4, D=512, causal, 8K"
C="--n 8192 --d 512 --hq 32 --hkv 4 --causal"
timeout 120 $W bench --device cuda --reps 5 $C | tail -2
timeout 120 $W bench --device cuda --reps 5 $C --deterministic | tail -1
timeout 60 $W bench --device cuda --reps 5 --n 16384 --d 512 --hq 32 --hkv 4 --sliding-window 1024 | tail -1
WINATTN_CUDA=v1 timeout 120 $W bench --device cuda --reps 1 $C | tail -1

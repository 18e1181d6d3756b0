#!/bin/sh
# fwd_d512_wgmma.sh — the D = 512 forward on wgmma (fwd_wide_ws_kernel in fwd_hopper.cu) against
# version 5's mma.sync forward (WINATTN_CUDA=mma): parity on every f16/bf16 D = 512 case, the full
# sweep, compute-sanitizer on two small D = 512 cases, forward timings at (c) and at D = 512 with a
# 1024 window. From the repository root on the H200: DEPS=.devdeps sh dev/cuda/fwd_d512_wgmma.sh
. dev/cuda/lab_env.sh
lab_build build ""
W=build/winattn
echo "== parity on the f16/bf16 D = 512 cases"
lab_parity_each $W "$(lab_d512_cases $W)" || exit 1
echo "== full sweep"
timeout 200 $W parity --device cuda --threads 16 >"$OUT/parity_cuda.txt" 2>&1; grep '^FAIL' "$OUT/parity_cuda.txt" | head -5; tail -1 "$OUT/parity_cuda.txt"
lab_sanitize memcheck $W 337 973
lab_sanitize racecheck $W 337 836
C="--d 512 --hq 32 --hkv 4"
for v in default mma default mma; do
    echo "== forward, $v: (c) causal 8K / 16K; window 1024 16K"
    WINATTN_CUDA=$v timeout 60 $W bench --device cuda --reps 5 --forward-only $C --causal --n 8192,16384 | tail -2
    WINATTN_CUDA=$v timeout 60 $W bench --device cuda --reps 5 --forward-only $C --sliding-window 1024 --n 16384 | tail -1
done

#!/bin/sh
# bwd_d512_wgmma.sh — the D = 512 backward on wgmma (dkdv_wide_ws_kernel, dq_wide_ws_kernel in
# bwd_hopper.cu) against version 5's mma.sync backward (-DWA_BWD_WIDE_MMA: the same tree with
# D = 512 left to bwd_wide.cu), on the H200, in one run:
#   build   this tree and three lab builds, sm_90a only, in parallel: mma (the backward before),
#           h1 (-DWA_DKDV512_HALVES=1: Q and dO loaded and released whole), bn16 (-DWA_DQ512_BN=16:
#           the dQ kernel on 16-key tiles in two stages);
#   parity  every f16/bf16 D = 512 case alone on each wgmma build; `full` adds the whole sweep,
#           tests/test_nonfinite (its D = 512 CUDA cases), memcheck and racecheck on D = 512 cases;
#   bench   `winattn bench --device cuda` at (c) 8K / 16K causal and at D = 512 with a 1024
#           window at 16K (docs/cuda.md's shapes), each build in turn, twice.
# From the repository root on the H200 (DEPS as in scripts/cuda_check.sh):
#   sh dev/cuda/bwd_d512_wgmma.sh [full]
. dev/cuda/lab_env.sh
unset WINATTN_CUDA
FLAGS=$LAB_SM90_FLAGS
lab_summary 60
nvidia-smi -L

# a command-line NVCCFLAGS drops the Makefile's CUDA_DEFINES: the defines go inside it
(lab_build build-mma "" NVCCFLAGS="$FLAGS -DWA_BWD_WIDE_MMA" build-mma/winattn) &
(lab_build build-h1 "" NVCCFLAGS="$FLAGS -DWA_DKDV512_HALVES=1" build-h1/winattn) &
(lab_build build-bn16 "" NVCCFLAGS="$FLAGS -DWA_DQ512_BN=16" build-bn16/winattn) &
lab_build build "" NVCCFLAGS="$FLAGS" build/winattn build/tests/test_nonfinite
wait
for b in build-mma build-h1 build-bn16; do
    [ -x $b/winattn ] || { echo "build $b failed:"; tail -20 "$OUT/$b.txt"; exit 1; }
done
row "builds" "$(($(date +%s) - t0)) s"

W=build/winattn
CASES=$(lab_d512_cases $W)
for b in build build-h1 build-bn16; do
    s=$(date +%s)
    res=$(lab_parity_each $b/winattn "$CASES")
    echo "$res" | grep -v passed | head -4
    row "parity, D = 512 cases alone, $b" "$(echo "$res" | tail -1) ($(($(date +%s) - s)) s)"
done

C="--d 512 --hq 32 --hkv 4"
for round in 1 2; do
    for b in build build-mma build-h1 build-bn16; do
        r=$(timeout 90 $b/winattn bench --device cuda --reps 5 $C --causal --n 8192,16384 | tail -2 |
            awk -F'|' '{printf "%s: %s / %s  ", $2, $5, $6}')
        w=$(timeout 60 $b/winattn bench --device cuda --reps 5 $C --sliding-window 1024 --n 16384 | tail -1 |
            awk -F'|' '{printf "%s / %s", $5, $6}')
        row "bench $round, $b: fwd / bwd TFLOP/s, causal" "$r| w1024 16K: $w"
    done
done

if [ "${1:-}" = "full" ]; then
    lab_sweep "full" 300 $W parity --device cuda --threads 16
    s=$(date +%s)
    timeout 300 build/tests/test_nonfinite >"$OUT/nonfinite.txt" 2>&1
    grep '^FAIL' "$OUT/nonfinite.txt" | head -3 | cut -c1-200
    row "test_nonfinite" "$(tail -1 "$OUT/nonfinite.txt") ($(($(date +%s) - s)) s)"
    first=$(echo $CASES | cut -d' ' -f1) last=$(echo $CASES | awk '{print $NF}')
    lab_sanitize memcheck $W $first $last | while read -r l; do row "memcheck" "$l"; done
    lab_sanitize racecheck $W $first | while read -r l; do row "racecheck" "$l"; done
fi
row "total" "$(($(date +%s) - t0)) s"
echo "== summary"
cat "$TABLE"

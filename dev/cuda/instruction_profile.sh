#!/bin/sh
# instruction_profile.sh — Nsight Compute's per-instruction warp sampling of the version-4 forward
# and fused dK/dV kernel at (b) 8K, with checks and the folded-softmax comparison first; on the
# H200, from the repository root (DEPS=.devdeps):
#  1. checks: kernel tests, quick parity on the default path and on version 2 (WINATTN_CUDA=mma),
#     every f16/bf16 D = 512 case alone (first run on commit 724b3f4, whose changes had been
#     compile-checked only: row_visible_keys shared by version 2's dK/dV kernel and version 5's
#     pair tile; lab_env.sh's D = 512 helpers);
#  2. the folded softmax (softmax_scores_folded, mma_prims.cuh: exp2(s·scale2 − max) as one FFMA)
#     against -DWA_SOFTMAX_NO_FOLD, forward at (a), (b) and D = 64, two rounds alternating;
#  3. Nsight Compute with source counters (warp-stall sampling per SASS instruction) on the
#     version-4 forward and the fused dK/dV kernel at (b) 8K: src_fwd.csv.gz, src_dkdv.csv.gz
#     (analysed off the machine) and the details pages come back; other logs stay in /tmp/lab.
LAB_KEEP=1 # what comes back (at most 8 files): the profiles; the rest stays in /tmp/lab
. dev/cuda/lab_env.sh
(lab_build build "") &
(lab_build build-nofold -DWA_SOFTMAX_NO_FOLD build-nofold/winattn) &
wait
echo "built in $(($(date +%s) - t0)) s"
[ -x build/winattn ] && [ -x build-nofold/winattn ] || exit 1

echo "== checks (default build)"
timeout 120 build/tests/test_kernels >"$OUT/test_kernels.txt" 2>&1; tail -1 "$OUT/test_kernels.txt"
timeout 120 build/winattn parity --device cuda --threads 16 --quick | tail -1
WINATTN_CUDA=mma timeout 120 build/winattn parity --device cuda --threads 16 --quick | tail -1
echo "D = 512 cases one by one: $(lab_parity_each build/winattn "$(lab_d512_cases build/winattn)" | tail -1)"

B="--device cuda --reps 5 --forward-only"
for round in 1 2; do
    for v in build build-nofold; do
        echo "== $v round $round: forward (b) 8K/32K, (a) 8K, D64 16K"
        timeout 60 $v/winattn bench $B --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
        timeout 60 $v/winattn bench $B --n 8192 | tail -1
        timeout 60 $v/winattn bench $B --n 16384 --d 64 --hkv 8 --sliding-window 1024 | tail -1
    done
done
echo "== checks at $(($(date +%s) - t0)) s; Nsight Compute"

S="--device cuda --n 8192 --reps 1 --d 128 --hkv 8 --sliding-window 4096"
for k in fwd_ws_kernel dkdv_ws_kernel; do
    lab_source_profile "$(echo $k | sed 's/_ws_kernel//')" "$k" build/winattn $S
done
echo "total $(($(date +%s) - t0)) s"

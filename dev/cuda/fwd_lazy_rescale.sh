#!/bin/sh
# fwd_lazy_rescale.sh — the version-4/5 forwards with lazy rescaling (softmax_scores_as's LAZY,
# rescale_lazy in mma_prims.cuh; the default since it ran here) against the eager form
# (-DWA_FWD_LAZY_RESCALE=0), on the H200, in one run: the whole parity sweep on the lazy build,
# then `winattn bench --device cuda --forward-only` at (a) 8K / 32K, (b) 8K / 32K and (c) 8K / 16K causal and with a 1024 window at
# 16K (docs/cuda.md's shapes), the two builds alternating, twice. The summary comes back in
# summary.txt. From the repository root on the H200 (DEPS as in scripts/cuda_check.sh):
#   DEPS=.devdeps sh dev/cuda/fwd_lazy_rescale.sh
LAB_KEEP=1
. dev/cuda/lab_env.sh
unset WINATTN_CUDA
FLAGS=$LAB_SM90_FLAGS
lab_summary 40
nvidia-smi -L

# a command-line NVCCFLAGS drops the Makefile's CUDA_DEFINES: the defines go inside it
(lab_build build-lazy "" NVCCFLAGS="$FLAGS -DWA_FWD_LAZY_RESCALE=1" build-lazy/winattn) &
lab_build build-eager "" NVCCFLAGS="$FLAGS -DWA_FWD_LAZY_RESCALE=0" build-eager/winattn
wait
[ -x build-lazy/winattn ] && [ -x build-eager/winattn ] || { row "builds" "failed"; exit 1; }

lab_sweep "full, lazy" 240 build-lazy/winattn parity --device cuda --threads 16

for round in 1 2; do
    for b in build-eager build-lazy; do lab_fwd_row $round $b; done
done
row "total" "$(($(date +%s) - t0)) s"

#!/bin/sh
# fwd_variants.sh — compile-time variants of the forwards against this tree's default, on the H200,
# in one run: each variant built (sm_90a only, in parallel with the default), then
# `winattn bench --device cuda --forward-only` at docs/cuda.md's shapes (lab_fwd_row: (a), (b), (c)
# and D = 512 with a 1024 window), the default and the variants alternating, twice, then the whole
# parity sweep on each variant. The summary comes back in summary.txt.
# From the repository root on the H200 (DEPS as in scripts/cuda_check.sh):
#   DEPS=.devdeps sh dev/cuda/fwd_variants.sh NAME "DEFINES" [NAME "DEFINES" ...]
# e.g. eager "-DWA_FWD_LAZY_RESCALE=0" (the forwards before lazy rescaling), or
#      qreg0 "-DWA_FWD512_QREG=0" (the D = 512 forward with all of Q read from shared memory;
#      the default holds 14 of its 16 k steps in registers)
# Each variant builds into build-NAME. ROWS=d512 times the D = 512 shapes alone (lab_fwd512_row), for
# variants of that kernel. CHECK="build build-NAME ..." names the builds that get the parity sweep
# (every variant, not the default, unless set; CHECK=none: timings only).
[ $# -ge 2 ] && [ $(($# % 2)) -eq 0 ] || { echo "usage: sh dev/cuda/fwd_variants.sh NAME \"DEFINES\" [NAME \"DEFINES\" ...]"; exit 2; }
LAB_KEEP=1
. dev/cuda/lab_env.sh
unset WINATTN_CUDA
lab_summary 40
nvidia-smi -L

lab_build_variants "$@"

# the timings first: a run cut short by its time limit still brings them back
for round in 1 2; do
    for b in $BUILDS; do [ -x $b/winattn ] && { [ "$ROWS" = d512 ] && lab_fwd512_row $round $b || lab_fwd_row $round $b; }; done
done
for b in $BUILDS; do
    [ -x $b/winattn ] || { row "$b" "build failed"; continue; }
    lab_checked $b || continue
    lab_sweep "full, $b" 240 $b/winattn parity --device cuda --threads 16
done
row "total" "$(($(date +%s) - t0)) s"

#!/bin/sh
# fwd_d512_qregs.sh — the D = 512 forward with part of Q held in registers as A fragments
# (-DWA_FWD512_QREG=N: the first N of each consumer's 16 k steps of S formed by the register-A
# wgmma; fwd_hopper.cu) against this tree's default, on the H200, in one run: the builds qreg8
# (no spills) and qreg12 (8-32 bytes of spills in some instances), the whole parity sweep on each,
# then `winattn bench --device cuda --forward-only` at docs/cuda.md's shapes (lab_fwd_row), the
# builds alternating, twice. The summary comes back in summary.txt.
# From the repository root on the H200 (DEPS as in scripts/cuda_check.sh):
#   DEPS=.devdeps sh dev/cuda/fwd_d512_qregs.sh
LAB_KEEP=1
. dev/cuda/lab_env.sh
unset WINATTN_CUDA
FLAGS=$LAB_SM90_FLAGS
lab_summary 40
nvidia-smi -L

# a command-line NVCCFLAGS drops the Makefile's CUDA_DEFINES: the defines go inside it
(lab_build build-qreg8 "" NVCCFLAGS="$FLAGS -DWA_FWD512_QREG=8" build-qreg8/winattn) &
(lab_build build-qreg12 "" NVCCFLAGS="$FLAGS -DWA_FWD512_QREG=12" build-qreg12/winattn) &
lab_build build "" NVCCFLAGS="$FLAGS" build/winattn
wait
for b in build-qreg8 build-qreg12; do
    [ -x $b/winattn ] || { row "$b" "build failed"; continue; }
    lab_sweep "full, $b" 240 $b/winattn parity --device cuda --threads 16
done
for round in 1 2; do
    for b in build build-qreg8 build-qreg12; do [ -x $b/winattn ] && lab_fwd_row $round $b; done
done
row "total" "$(($(date +%s) - t0)) s"

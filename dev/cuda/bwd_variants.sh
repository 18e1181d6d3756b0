#!/bin/sh
# bwd_variants.sh — compile-time variants of the D ≤ 128 backward against this tree's default, on
# the H200, in one run: each variant built (sm_90a only, in parallel with the default; a carried
# .lab-prebuilt/build-NAME.tar.xz from dev/cuda/prebuild.sh is used instead), then
# `winattn bench --device cuda` backward TFLOP/s at (b) 8K / 32K, D = 64 with a 1024 window at 16K,
# causal D = 128 at 8K / 32K, (a) 8K / 32K and (c) 8K, in the default (fused) and the deterministic mode, the builds
# alternating, twice; then on each variant the whole parity sweep in both modes and
# compute-sanitizer memcheck and racecheck on D = 64 / 128 cases (309, 314, 1004 varlen, 730
# softcap; 309, 730 and for memcheck 314 deterministic too). The summary comes back in summary.txt.
# From the repository root on the H200 (DEPS as in scripts/cuda_check.sh):
#   DEPS=.devdeps sh dev/cuda/bwd_variants.sh NAME "DEFINES" [NAME "DEFINES" ...]
# e.g. overlap2 "-DWA_BWD_STEP_OVERLAP=2" (bwd_hopper.cu: the step overlap in every by-rows kernel),
#      old "-DWA_BWD_STEP_OVERLAP=0" (none: the order before it).
# CHECK="build build-NAME ..." names the builds that get the parity sweeps and the sanitizers
# (every variant, not the default, unless set). ROWS=b times the (b) 8K / 32K and D = 64 columns
# in the default mode alone, ROWS=det those and causal D = 128 in both modes (the shapes where the
# two modes run different kernels), ROWS=fused the columns of ROWS=det in the default mode alone (for
# variants of the default form only), and SANITIZE=0 leaves the sanitizers out (a short run: the
# sweeps in both modes stay). FUSED=default times the default mode on the default build alone (for
# variants of the deterministic form only). LAB_CALLS=C times runs of C calls back to back
# (`winattn bench --calls`: the steady state, where the 700 W limit sets the clock). ALTERNATE=1
# times the builds in the opposite order in the second round (a build timed after the others' heat
# in one round is timed first in the other).
[ $# -ge 2 ] && [ $(($# % 2)) -eq 0 ] || { echo "usage: sh dev/cuda/bwd_variants.sh NAME \"DEFINES\" [NAME \"DEFINES\" ...]"; exit 2; }
LAB_KEEP=1
. dev/cuda/lab_env.sh
unset WINATTN_CUDA
lab_summary 44
nvidia-smi -L

lab_build_variants "$@"

bwd_row() {
    w=$3/winattn
    bb=$(lab_tflops 6 $w $2 --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096)
    d64=$(lab_tflops 6 $w $2 --n 16384 --d 64 --hkv 8 --sliding-window 1024)
    [ "$ROWS" = b ] && { row "bwd $1 ${2:-fused}, $3" "(b) $bb| D64 w1024 16K $d64"; return; }
    c128=$(lab_tflops 6 $w $2 --n 8192,32768 --d 128 --hkv 8 --causal)
    [ "$ROWS" = det ] || [ "$ROWS" = fused ] && { row "bwd $1 ${2:-fused}, $3" "(b) $bb| D64 w1024 16K $d64| D128 causal 8K/32K $c128"; return; }
    a=$(lab_tflops 6 $w $2 --n 8192,32768)
    c=$(lab_tflops 6 $w $2 --n 8192 --d 512 --hq 32 --hkv 4 --causal)
    row "bwd $1 ${2:-fused}, $3" "(b) $bb| D64 w1024 16K $d64| D128 causal 8K/32K $c128| (a) $a| (c) 8K $c"
}

# the timings first: a run cut short by its time limit still brings them back
reversed=
for b in $BUILDS; do reversed="$b $reversed"; done
for round in 1 2; do
    order=$BUILDS
    [ "$ALTERNATE" = 1 ] && [ $round = 2 ] && order=$reversed
    for mode in "" $([ "$ROWS" = b ] || [ "$ROWS" = fused ] || echo --deterministic); do
        for b in $order; do
            [ -z "$mode" ] && [ "$FUSED" = default ] && [ $b != build ] && continue
            [ -x $b/winattn ] && bwd_row $round "$mode" $b
        done
    done
done
for b in $BUILDS; do
    [ -x $b/winattn ] || { row "$b" "build failed"; continue; }
    lab_checked $b || continue
    lab_sweep "full, $b" 240 $b/winattn parity --device cuda --threads 16
    lab_sweep "full deterministic, $b" 240 $b/winattn parity --device cuda --threads 16 --deterministic
    [ "$SANITIZE" = 0 ] && continue
    lab_sanitize memcheck $b/winattn 309 314 1004 730 309:--deterministic 314:--deterministic 730:--deterministic | while read -r l; do row "$b" "$l"; done
    lab_sanitize racecheck $b/winattn 309 314 730 309:--deterministic 730:--deterministic | while read -r l; do row "$b" "$l"; done
done
row "total" "$(($(date +%s) - t0)) s"

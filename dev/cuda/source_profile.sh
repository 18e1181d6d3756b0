#!/bin/sh
# source_profile.sh — Nsight Compute's per-instruction warp-stall sampling of one kernel in one
# `winattn bench` run, read back as the instructions where its warps stall most
# (dev/cuda/source_stalls.py). On the H200, from the repository root (DEPS as in
# scripts/cuda_check.sh; a carried .lab-prebuilt/build.tar.xz is used instead of building):
#   DEPS=.devdeps sh dev/cuda/source_profile.sh NAME KERNEL_REGEX BENCH_ARGS...
#   e.g. fwd512 fwd_wide --n 8192 --d 512 --hq 32 --hkv 4 --causal --forward-only
# Comes back: src_NAME.csv.gz (the whole source page), details_NAME.txt, stalls_NAME.txt.
# BUILD=build-X profiles a lab build packed by prebuild.sh (.lab-prebuilt/build-X.tar.xz) instead.
[ $# -ge 2 ] || { echo "usage: sh dev/cuda/source_profile.sh NAME KERNEL_REGEX BENCH_ARGS..."; exit 2; }
LAB_KEEP=1
. dev/cuda/lab_env.sh
name=$1 kernel=$2
shift 2
B=${BUILD:-build}
[ "$B" = build ] || [ -f ".lab-prebuilt/$B.tar.xz" ] || { echo "no .lab-prebuilt/$B.tar.xz (dev/cuda/prebuild.sh makes it)"; exit 2; }
lab_build "$B" "" "$B/winattn"
lab_source_profile "$name" "$kernel" "$B/winattn" --device cuda --reps 1 "$@"
python3 dev/cuda/source_stalls.py "$KEEP/src_$name.csv.gz" --top 30 | tee "$KEEP/stalls_$name.txt"
echo "total $(($(date +%s) - t0)) s"

#!/bin/sh
# harness_gap.sh — where a call through winattn.torch spends the time that `winattn bench` does
# not, on the H200, from the repository root (DEPS as in scripts/cuda_check.sh; a carried
# .lab-prebuilt/build.tar.xz is used instead of building):
#   DEPS=.devdeps sh dev/cuda/harness_gap.sh
# Runs, each into a log of its own that comes back:
#   kernel_timeline.py   the backward's kernels per call and steady, from the profiler, beside the
#                        C bench, at (b) 32K, (cw) 16K and (c) 8K             -> timeline.txt
#   data_sensitivity.py  bench bursts against sustained calls, uniform against randn data, with
#                        the SM clock and power                               -> data_sensitivity.txt
#   binding_overhead.py --profile-only: where the eager path's host time goes -> binding_profile.txt
LAB_KEEP=1
. dev/cuda/lab_env.sh
lab_summary
lab_build build "" build/winattn build/libwinattn.so
export PYTHONUNBUFFERED=1
step() {
    log=$1
    shift
    s=$(date +%s)
    timeout 170 "$@" >"$KEEP/$log" 2>&1
    row "$log" "exit $?, $(($(date +%s) - s)) s"
}
step timeline.txt python3 dev/cuda/kernel_timeline.py --cases b:32768,cw:16384,c:8192
step binding_profile.txt python3 bench/binding_overhead.py --device cuda --profile-only
step data_sensitivity.txt python3 dev/cuda/data_sensitivity.py --n 8192,16384
echo "total $(($(date +%s) - t0)) s"

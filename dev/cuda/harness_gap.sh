#!/bin/sh
# harness_gap.sh — where a call through winattn.torch spends the time that `winattn bench` does
# not, on the GPU machine, from the repository root (DEPS as in scripts/cuda_check.sh; a carried
# .lab-prebuilt/build.tar.xz is used instead of building):
#   DEPS=.devdeps [CASES=b:32768,cw:16384,c:8192] [DATA=1] sh dev/cuda/harness_gap.sh
# Builds winattn.torch's C++ eager path for the machine's torch (python/build_torch_ext.py), then
# runs, each into a log of its own that comes back:
#   kernel_timeline.py   the forward's and the backward's kernels per call and steady, from the
#                        profiler, beside the C bench, at CASES                -> timeline.txt
#   binding_overhead.py  host time per forward + backward on a tiny shape, each path beside one
#                        multiply through autograd; graph and compile identity -> binding_overhead.txt
#   call_gap.py          per call against the host hidden and steady, the host's time per call
#                        and the host operations that take it, at CASES and (b) 1024 -> call_gap.txt
#   tensor_map_cost.cu   the driver's tensor-map encoding against the bytes it maps -> tensor_map_cost.txt
#   TMC=1: the same call_gap.py on a library built with -DWA_TENSOR_MAP_CACHE=1 (build-tmc, the
#                        encoded tensor maps kept per thread), and its whole parity sweep in both
#                        modes                                       -> call_gap_tmc.txt, parity_tmc.txt
#   data_sensitivity.py  (DATA=1) bench bursts against sustained calls, uniform against randn data,
#                        with the SM clock and power                          -> data_sensitivity.txt
LAB_KEEP=1
. dev/cuda/lab_env.sh
lab_summary
lab_build build "" build/winattn build/libwinattn.so
export PYTHONUNBUFFERED=1 WINATTN_LIBRARY=build/libwinattn.so
step() {
    log=$1
    shift
    s=$(date +%s)
    timeout 170 "$@" >"$KEEP/$log" 2>&1
    row "$log" "exit $?, $(($(date +%s) - s)) s"
}
step torch_ext.txt python3 python/build_torch_ext.py --build build
step timeline.txt python3 dev/cuda/kernel_timeline.py --cases "${CASES:-b:32768,cw:16384,c:8192}" --passes fwd,bwd
step binding_overhead.txt python3 bench/binding_overhead.py --device cuda --calls 200
step call_gap.txt python3 dev/cuda/call_gap.py --cases "${CASES:-b:32768,cw:16384,c:8192},b:1024" --reps 3 --cpu-ops 12
nvcc -O2 -std=c++17 -o build/tensor_map_cost dev/cuda/tensor_map_cost.cu >"$OUT/tensor_map_cost_build.txt" 2>&1 &&
    step tensor_map_cost.txt build/tensor_map_cost
if [ "${TMC:-0}" = 1 ]; then
    lab_build build-tmc "-DWA_TENSOR_MAP_CACHE=1" build-tmc/winattn build-tmc/libwinattn.so
    step call_gap_tmc.txt env WINATTN_LIBRARY=build-tmc/libwinattn.so python3 dev/cuda/call_gap.py \
        --cases "${CASES:-b:32768,cw:16384,c:8192},b:1024" --reps 3
    step parity_tmc.txt sh -c "build-tmc/winattn parity --device cuda --threads 16 | tail -3 &&
        build-tmc/winattn parity --device cuda --threads 16 --deterministic | tail -3"
fi
[ "${DATA:-0}" = 1 ] && step data_sensitivity.txt python3 dev/cuda/data_sensitivity.py --n 8192,16384
echo "total $(($(date +%s) - t0)) s"

#!/bin/sh
# harness_gap.sh — where a call through winattn.torch spends the time that `winattn bench` does
# not, on the GPU machine, from the repository root (DEPS as in scripts/cuda_check.sh; a carried
# .lab-prebuilt/build.tar.xz is used instead of building):
#   DEPS=.devdeps [STEPS="timeline binding call_gap tensor_maps host wake"] [CASES=b:32768,cw:16384,c:8192]
#       [DATA=1] sh dev/cuda/harness_gap.sh
# Runs the STEPS named (all six by default), each into a log of its own that comes back:
#   timeline   kernel_timeline.py: the forward's and the backward's kernels per call and steady,
#              from the profiler, beside the C bench, at CASES                    -> timeline.txt
#   binding    binding_overhead.py: host time per forward + backward on a tiny shape, each path
#              beside one multiply through autograd; graph and compile identity -> binding_overhead.txt
#   call_gap   call_gap.py: per call against the host hidden and steady, the host's time per call
#              and the host operations that take it, at CASES and (b) 1024      -> call_gap.txt
#   tensor_maps  tensor_map_cost.cu: the driver's tensor-map encoding against the bytes it maps
#                                                                               -> tensor_map_cost.txt
#   host       host_call_cost.c: the library's own host time per wa_forward / wa_backward (no
#              binding), queued and from an idle GPU, at CASES and (b) 1024 and 8192 -> host_call_cost.txt
#   wake       host_wake.py: host time per call after a short wait, a long one and a long one
#              polled, for winattn at CASES and (b) 1024 and three floors    -> host_wake.txt
# (the binding's steps build winattn.torch's C++ eager path for the machine's torch first:
# python/build_torch_ext.py).
# DATA=1: data_sensitivity.py, bench bursts against sustained calls, uniform against randn data,
# with the SM clock and power                                               -> data_sensitivity.txt
LAB_KEEP=1
. dev/cuda/lab_env.sh
lab_summary
lab_build build "" build/winattn build/libwinattn.so
export PYTHONUNBUFFERED=1 WINATTN_LIBRARY=build/libwinattn.so
STEPS=${STEPS:-timeline binding call_gap tensor_maps host wake}
CASES=${CASES:-b:32768,cw:16384,c:8192}
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
step() {
    log=$1
    shift
    s=$(date +%s)
    timeout 170 "$@" >"$KEEP/$log" 2>&1
    row "$log" "exit $?, $(($(date +%s) - s)) s"
}
if has timeline || has binding || has call_gap || has wake; then step torch_ext.txt python3 python/build_torch_ext.py --build build; fi
has timeline && step timeline.txt python3 dev/cuda/kernel_timeline.py --cases "$CASES" --passes fwd,bwd
has binding && step binding_overhead.txt python3 bench/binding_overhead.py --device cuda --calls 200
has call_gap && step call_gap.txt python3 dev/cuda/call_gap.py --cases "$CASES,b:1024" --reps 3 --cpu-ops 12
if has tensor_maps; then
    if nvcc -O2 -std=c++17 -o build/tensor_map_cost dev/cuda/tensor_map_cost.cu >"$OUT/tensor_map_cost_build.txt" 2>&1; then
        step tensor_map_cost.txt build/tensor_map_cost
    else
        row tensor_map_cost.txt "not built ($OUT/tensor_map_cost_build.txt)"
    fi
fi
if has host; then
    if cc -O2 -Iinclude -o build/host_call_cost dev/cuda/host_call_cost.c -Lbuild -lwinattn >"$KEEP/host_build.txt" 2>&1; then
        ln -sf libwinattn.so build/libwinattn.so.0
        step host_call_cost.txt env LD_LIBRARY_PATH=build build/host_call_cost b:1024 b:8192 $(echo "$CASES" | tr , ' ')
    else
        row host_call_cost.txt "not built (host_build.txt)"
    fi
fi
has wake && step host_wake.txt python3 dev/cuda/host_wake.py --cases "b:1024,$CASES"
[ "${DATA:-0}" = 1 ] && step data_sensitivity.txt python3 dev/cuda/data_sensitivity.py --n 8192,16384
echo "total $(($(date +%s) - t0)) s"

#!/bin/sh
# torch_paths.sh — winattn.torch's C++ eager path (`make torch-ext`) on the H200 against its Python
# path, from the repository root (DEPS as in scripts/cuda_check.sh; a carried
# .lab-prebuilt/build.tar.xz is used instead of building the library):
#   DEPS=.devdeps sh dev/cuda/torch_paths.sh
# Builds the module for the machine's torch, then (each into a log that comes back):
#   python/tests/test_python.py on CUDA, the module required              -> python_tests.txt
#   bench/binding_overhead.py --device cuda: host time per path, graph and compile identity
#                                                                         -> binding_overhead.txt
#   bench/gpu_peers.py --systems winattn at (b) and (cw), then (b) on the Python path (WINATTN_TORCH_EXT=0)
#                                                                         -> peers_b.txt
#   dev/cuda/kernel_timeline.py at (b) 32K (event-timed and profiled)      -> timeline_b.txt
LAB_KEEP=1
. dev/cuda/lab_env.sh
lab_summary
lab_build build "" build/winattn build/libwinattn.so
export PYTHONUNBUFFERED=1 WINATTN_LIBRARY=build/libwinattn.so
python3 python/build_torch_ext.py --build build >"$KEEP/python_tests.txt" 2>&1
row "torch C++ path build" "exit $?: $(tail -1 "$KEEP/python_tests.txt")"
step() {
    log=$1
    shift
    s=$(date +%s)
    timeout 200 "$@" >>"$KEEP/$log" 2>&1
    row "$log" "exit $?, $(($(date +%s) - s)) s: $(grep -E '^[0-9]+ passed' "$KEEP/$log" | tail -1)"
}
step python_tests.txt env PYTHONPATH=python WINATTN_TORCH_EXT_REQUIRED=1 python3 python/tests/test_python.py
step binding_overhead.txt python3 bench/binding_overhead.py --device cuda --calls 200
step peers_b.txt python3 bench/gpu_peers.py --systems winattn --shapes b,cw --reps 3
echo "-- the Python path (WINATTN_TORCH_EXT=0)" >>"$KEEP/peers_b.txt"
step peers_b.txt env WINATTN_TORCH_EXT=0 python3 bench/gpu_peers.py --systems winattn --shapes b --reps 3
step timeline_b.txt python3 dev/cuda/kernel_timeline.py --cases b:32768
echo "total $(($(date +%s) - t0)) s"

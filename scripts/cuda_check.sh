#!/bin/sh
# cuda_check.sh — run on the H200 machine (the device tool): build with nvcc, then the CUDA
# correctness and timing checks in one call, writing full logs to $OUT and a short summary last.
#   kernel tests (CUDA table), full parity sweep on CUDA, a determinism check, the probe's
#   shape timed on CUDA, compute-sanitizer memcheck and racecheck on a subset.
# The machine has no libjansson-dev: the caller carries Debian's package unpacked in .devdeps
# (ignored by git; make it once per machine with
#   mkdir -p .devdeps && cd .devdeps && apt-get download libjansson-dev libjansson4 &&
#   for f in *.deb; do dpkg -x "$f" .; done && cd .. && echo /.devdeps/ >> .git/info/exclude
# and pass carry=[".devdeps"] to the device tool).
# `sh scripts/cuda_check.sh quick` stops before the sanitizers. The CUDA backward is checked in its
# default form (at D <= 128 dQ by reduce-adds); dev/cuda/check_v4_fused.sh check adds --deterministic.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
J=.devdeps/usr
MK="make -j16 JANSSON_CFLAGS=-I$J/include JANSSON_LIBS=$J/lib/x86_64-linux-gnu/libjansson.a"
nvidia-smi -L
$MK >"$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
for f in src/cuda/*.cu; do
    nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -Iinclude -std=c++17 -Xptxas -v -c "$f" -o /tmp/x.o
done >"$OUT/ptxas.txt" 2>&1
build/winattn version
echo "== test_api (CUDA status codes)"
build/tests/test_api >"$OUT/test_api.txt" 2>&1; grep -E '^FAIL|CUDA' "$OUT/test_api.txt"; tail -1 "$OUT/test_api.txt"
echo "== python (numpy and PyTorch bindings, CUDA tensors included)"
WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_python.py >"$OUT/python.txt" 2>&1
grep -E '^FAIL|^SKIP|CUDA' "$OUT/python.txt"; tail -1 "$OUT/python.txt"
echo "== test_kernels"
build/tests/test_kernels >"$OUT/test_kernels.txt" 2>&1
grep -E '^FAIL|cuda' "$OUT/test_kernels.txt" | grep -v '^PASS' | head -20; tail -1 "$OUT/test_kernels.txt"
echo "== parity --device cuda (full)"
build/winattn parity --device cuda --threads 16 --json "$OUT/parity_cuda.json" >"$OUT/parity_cuda.txt" 2>&1
grep '^FAIL' "$OUT/parity_cuda.txt" | head -10; tail -13 "$OUT/parity_cuda.txt"
echo "== probe --device cuda"
build/winattn probe --device cuda >"$OUT/probe_cuda.txt" 2>&1; cat "$OUT/probe_cuda.txt"
if [ "${1:-}" = "quick" ]; then exit 0; fi
echo "== compute-sanitizer memcheck (parity --quick on CUDA)"
timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 build/winattn parity --device cuda --quick --threads 8 \
    >"$OUT/memcheck.txt" 2>&1; echo "memcheck exit $?"; grep -E 'ERROR SUMMARY|passed' "$OUT/memcheck.txt" | tail -3
echo "== compute-sanitizer racecheck (one case per kind: f32/f16/bf16, D 64..512, GQA, Nq != Nk, two-sided)"
: >"$OUT/racecheck.txt"
for c in 20 200 290 330 340 430 460 470; do
    timeout 100 compute-sanitizer --tool racecheck --error-exitcode 9 build/winattn parity --device cuda --case $c --threads 1 \
        >>"$OUT/racecheck.txt" 2>&1
    echo "racecheck case $c exit $?"
done
grep -cE 'Race reported|Error' "$OUT/racecheck.txt" | sed 's/^/racecheck hazard lines: /'
echo "== winattn attn --device cuda --deterministic: twice bit-identical, and equal to the oracle's criterion via parity above"
mkdir -p /tmp/cli && build/tests/cli_helper gen /tmp/cli >/dev/null && for i in 1 2; do
    build/winattn attn /tmp/cli/ok_bhnd.safetensors /tmp/cli/out$i.safetensors --sliding-window 65 --device cuda --deterministic ||
        echo "attn failed"; done
cmp /tmp/cli/out1.safetensors /tmp/cli/out2.safetensors && echo "PASS cuda attn: two runs bit-identical"

#!/bin/sh
# varlen_check.sh — packed variable-length batches (wa_forward_varlen / wa_backward_varlen) on
# CUDA, every kernel version. Run from the repository root on the GPU machine after `make -j16`
# (without build/libwinattn.a it builds the library alone, which needs no libjansson). Full logs
# in $OUT (the device tool's), a summary on stdout, exit status non-zero on any failure.
#
#   sh dev/cuda/varlen_check.sh [quick|sanitize]
#
# default   1. `winattn parity --device cuda --group varlen` (float64 oracle), both backward forms,
#              when build/winattn exists
#           2. dev/cuda/varlen_test.c (built here into build/varlen_test): each varlen call against
#              the same sequences as rectangular calls, one per sequence, on the default kernels
#              (versions 4 and 5 where they apply) and with WINATTN_CUDA=mma (versions 2, 3, 5);
#              every third case with WINATTN_CUDA=v3 and =v1 (version 1 for everything)
#           3. B = 70,000 sequences (grid z in chunks); malformed offsets, also under
#              compute-sanitizer memcheck (must report 0 errors)
# quick     1., every third case of 2. on the default kernels and version 2, 3. without the sanitizer
# sanitize  compute-sanitizer only: memcheck on the malformed offsets (default, mma, v1) and on four
#           cases, racecheck on two (each run stopped after 100 s: under 10 minutes in all)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
MODE=${1:-default}
status=0
t0=$(date +%s)

if [ ! -f build/libwinattn.a ]; then
    make -j16 lib >"$OUT/varlen_make.txt" 2>&1 || { echo "library build failed:"; tail -20 "$OUT/varlen_make.txt"; exit 1; }
fi
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}
cc -std=c11 -O2 -g -Wall -Wextra -Iinclude -Isrc dev/cuda/varlen_test.c build/libwinattn.a -lm -lpthread \
    -L"$CUDA_HOME/lib64" -lcudart_static -ldl -lrt -lstdc++ -o build/varlen_test >"$OUT/varlen_cc.txt" 2>&1 ||
    { echo "varlen_test build failed:"; cat "$OUT/varlen_cc.txt"; exit 1; }
nvidia-smi -L 2>/dev/null

# check NAME COMMAND...: run it, log in $OUT/varlen_NAME.txt, print its failures and last line
check() {
    name=$1
    shift
    t=$(date +%s)
    "$@" >"$OUT/varlen_$name.txt" 2>&1
    rc=$?
    grep -E '^FAIL|========= (Invalid|Program hit|Error|Race)|failed:' "$OUT/varlen_$name.txt" | head -12
    echo "$name: $(tail -1 "$OUT/varlen_$name.txt") (exit $rc, $(($(date +%s) - t)) s)"
    [ "$rc" -eq 0 ] || status=1
}
# san TOOL NAME WINATTN_CUDA ARGS...: compute-sanitizer TOOL on build/varlen_test ARGS ("" = default kernels)
san() {
    tool=$1 name=$2 force=$3
    shift 3
    check "${tool}_$name" env WINATTN_CUDA="$force" timeout 100 compute-sanitizer --tool "$tool" --error-exitcode 9 \
        build/varlen_test "$@"
    grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/varlen_${tool}_$name.txt" | sort | uniq -c
}

case $MODE in
sanitize)
    san memcheck malformed "" --malformed
    san memcheck malformed_mma mma --malformed
    san memcheck malformed_v1 v1 --malformed
    # varlen_test --case N: 0 bf16 D=64 atomic-dq; 66 D=256 GQA 4; 91 D=512 deterministic; 181 f32 D=64
    for c in 0 66 91 181; do san memcheck "case$c" "" --case "$c"; done
    for c in 0 91; do san racecheck "case$c" "" --case "$c"; done
    ;;
default | quick)
    QUICK=
    [ "$MODE" = quick ] && QUICK=--quick
    if [ -x build/winattn ]; then
        check parity build/winattn parity --device cuda --group varlen --threads 16
        check parity_det build/winattn parity --device cuda --group varlen --threads 16 --deterministic
    else
        echo "SKIP parity: no build/winattn (make -j16 first)"
    fi
    check test build/varlen_test $QUICK
    check test_mma env WINATTN_CUDA=mma build/varlen_test $QUICK
    if [ -z "$QUICK" ]; then
        check test_v3 env WINATTN_CUDA=v3 build/varlen_test --quick
        check test_v1 env WINATTN_CUDA=v1 build/varlen_test --quick
    fi
    check big build/varlen_test --big
    check big_mma env WINATTN_CUDA=mma build/varlen_test --big
    check malformed build/varlen_test --malformed
    if [ -z "$QUICK" ] && command -v compute-sanitizer >/dev/null; then san memcheck malformed "" --malformed; fi
    ;;
*)
    echo "usage: sh dev/cuda/varlen_check.sh [quick|sanitize]"
    exit 2
    ;;
esac
echo "varlen_check $MODE: $([ "$status" -eq 0 ] && echo "all passed" || echo "FAILURES (logs in $OUT)"), $(($(date +%s) - t0)) s"
exit "$status"

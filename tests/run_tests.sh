#!/bin/sh
# run_tests.sh — `make test`: every unit test, the CLI, install and layer tests, then `winattn
# parity --quick` and `winattn probe --quick`, then the extra checks named in EXTRA (comma-separated: portability,
# sanitize, fuzz, aarch64, cuda, or all; `make test EXTRA=all` as .ci/run does; tests/extra_checks.sh). Each prints its
# own PASS/FAIL lines and an "N passed, N failed" line; this script adds them up and ends with the
# total in the same form. A program that crashes or exits non-zero without reporting a failure
# counts as one failure.
BUILD=${1:-build}
total_pass=0 total_fail=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

run() {
    name=$1; shift
    echo "== $name"
    start=$(date +%s)
    "$@" >"$log" 2>&1
    rc=$?
    cat "$log"
    summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$log" | tail -n 1)
    p=$(echo "$summary" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed.*/\1/p')
    f=$(echo "$summary" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed.*/\2/p')
    if [ -z "$p" ]; then p=0 f=1; echo "FAIL $name printed no summary (exit $rc)"; fi
    if [ $rc -ne 0 ] && [ "$f" -eq 0 ]; then f=1; echo "FAIL $name exited $rc"; fi
    echo "== $name: $p passed, $f failed ($(( $(date +%s) - start )) s)"
    total_pass=$((total_pass + p)) total_fail=$((total_fail + f))
}

for t in test_geometry test_convert test_oracle test_api test_misuse test_fork test_atomic_file test_safetensors test_kernels; do
    run "$t" "$BUILD/tests/$t"
done
run "test_nonfinite" "$BUILD/tests/test_nonfinite"
run "test_train" "$BUILD/tests/test_train" train/fixtures
run "test_train_data" "$BUILD/tests/test_train_data" train/fixtures
run "test_train_quant" "$BUILD/tests/test_train_quant" train/fixtures
run "test_train_adapters" "$BUILD/tests/test_train_adapters"
run "test_train_ckpt" "$BUILD/tests/test_train_ckpt" train/fixtures
run "test_train_cuda" "$BUILD/tests/test_train_cuda" train/fixtures
run "test_cli" sh tests/test_cli.sh "$BUILD"
run "test_install" sh tests/test_install.sh "$BUILD"
run "test_layers" sh tests/test_layers.sh "$BUILD"
# winattn.torch's C++ eager path (`make torch-ext`), built for the torch installed, when there is one:
# the Python tests then take it, and check it against the Python path (a build that is there must load)
torch_ext() {
    python3 python/build_torch_ext.py --build "$1"
    case $? in
    0) echo "1 passed, 0 failed"; torch_ext_required=1 ;;
    2) echo "SKIP torch C++ path: a prerequisite is missing (above)"; echo "0 passed, 0 failed" ;;
    *) echo "0 passed, 1 failed" ;;
    esac
}
torch_ext_required=
if python3 -c "import torch" >/dev/null 2>&1; then
    run "torch C++ path build" torch_ext "$BUILD"
fi
if python3 -c "import numpy" >/dev/null 2>&1; then
    for t in python/tests/test_*.py; do   # each SKIPs what needs torch, transformers or mlx when absent
        run "python $(basename "$t" .py)" env WINATTN_LIBRARY="$BUILD/libwinattn.so" PYTHONPATH=python \
            WINATTN_TORCH_EXT_REQUIRED=$torch_ext_required python3 "$t"
    done
else
    echo "SKIP python: numpy is not installed (pip install numpy ml_dtypes; torch, transformers, mlx, mlx-lm optional)"
fi
run "parity --quick" "$BUILD/winattn" parity --quick
run "probe --quick" "$BUILD/winattn" probe --quick
# clang -Wpedantic on the library for x86-64 and aarch64, ASan + UBSan, libFuzzer (45 s a target),
# aarch64 under qemu, the CUDA build for every target: each needs packages that `sh scripts/deps.sh --extra` installs (nvcc: the CUDA toolkit)
for x in portability sanitize fuzz aarch64 cuda; do
    case ",${EXTRA:-}," in
    *,all,* | *,"$x",*) run "$x" sh tests/extra_checks.sh "$x" ;;
    *) echo "SKIP $x: not requested (make test EXTRA=$x, or EXTRA=all as CI does)" ;;
    esac
done

echo "$total_pass passed, $total_fail failed"
[ $total_fail -eq 0 ]

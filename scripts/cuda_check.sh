#!/bin/sh
# cuda_check.sh — the checks of the shipped CUDA kernels, on a machine with an NVIDIA GPU, from the
# repository root:
#   sh scripts/cuda_check.sh [STAGE...]     (default: build parity sanitize varlen nonfinite probe)
# Stages, in the order given:
#   build      make -j (CUDA for the GPU it finds), then ptxas's register and spill report of every
#              CUDA source (find src/cuda -name '*.cu', sm_90a)
#   parity     kernel tests (test_api, test_kernels), the Python tests on CUDA tensors, the full
#              parity sweep on CUDA in both backward forms (plain and --deterministic), and
#              run-to-run bit-identity of the deterministic backward (`winattn attn --deterministic`
#              twice; through PyTorch as well when torch is installed: scripts/cuda_bit_identity.py)
#   sanitize   compute-sanitizer memcheck and racecheck on a subset of parity cases, one per kernel
#              family (D = 64, 128 in both backward forms, 256 with softcap, 512, Nq > Nk, varlen,
#              f32), picked from `winattn parity --list` by their shapes
#   varlen     the parity sweep's varlen group in both forms; scripts/cuda_varlen_test.c: each
#              packed call against the same sequences one call each, 70,000 sequences of 0 or 1
#              tokens, and malformed offsets (also under memcheck)
#   nonfinite  tests/test_nonfinite: NaN and Inf reach only what docs/design.md §1 allows
#   probe      winattn probe --device cuda (backward memory linear in N)
#   sm80       (not in the default) WINATTN_CUDA=sm80, the path GPUs of compute capability 8.x take,
#              checked on this GPU: parity --quick in both forms and the varlen test
# A machine's command time may be short: run the stages over several calls on the same machine
# (build/ stays), e.g. `build parity`, then `sanitize`, then `varlen nonfinite probe`.
# Full logs go to $OUT (default /tmp/out); the last thing printed is a summary table of the stages
# run (also in $OUT/summary.txt). Exit status 1 when any check failed.
# Machines without libjansson-dev (the command's JSON) or libyaml-dev (its config files): carry
# Debian's packages unpacked in .devdeps (ignored by git), made once with
#   mkdir -p .devdeps && cd .devdeps && apt-get download libjansson-dev libjansson4 libyaml-dev libyaml-0-2 &&
#   for f in *.deb; do dpkg -x "$f" .; done && cd ..
# and it is used when present.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
W=build/winattn
J=.devdeps/usr
MK="make -j$(nproc)"
[ -d "$J" ] && MK="$MK JANSSON_CFLAGS=-I$J/include JANSSON_LIBS=$J/lib/x86_64-linux-gnu/libjansson.a"
[ -f "$J/include/yaml.h" ] && MK="$MK YAML_CFLAGS=-I$J/include YAML_LIBS=$J/lib/x86_64-linux-gnu/libyaml.a"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}
TABLE=$OUT/summary.txt
: >"$TABLE"
failed=0
t0=$(date +%s)

# row LABEL TEXT: one line of the summary table
row() { printf '%-44s %s\n' "$1" "$2" >>"$TABLE"; }
# result LABEL STATUS TEXT: a row that says PASS or FAIL by the exit status
result() {
    if [ "$2" -eq 0 ]; then row "$1" "PASS  $3"; else row "$1" "FAIL  $3 (exit $2)"; failed=1; fi
}
# run LABEL LOG LIMIT CMD...: run CMD under `timeout LIMIT`, its output in $OUT/LOG, its first FAIL
# lines here, a row with its last line
run() {
    label=$1 log=$OUT/$2 limit=$3
    shift 3
    s=$(date +%s)
    timeout "$limit" "$@" >"$log" 2>&1
    rc=$?
    grep -E '^FAIL' "$log" | head -5 | cut -c1-200
    result "$label" $rc "$(tail -1 "$log" | cut -c1-60), $(($(date +%s) - s)) s"
}
# case_of PATTERN...: the first case of `winattn parity --list` whose line holds every PATTERN
case_of() {
    l=$($W parity --list)
    for pat in "$@"; do l=$(printf '%s\n' "$l" | grep -F -e "$pat"); done
    printf '%s\n' "$l" | head -1 | sed 's/^#\([0-9]*\).*/\1/'
}
# sanitize TOOL CASE [FLAG]: compute-sanitizer TOOL on one parity case (log appended to
# $OUT/sanitize.txt), a row with its exit status and the tool's summary
sanitize() {
    tool=$1 c=$2 flag=$3
    [ -n "$c" ] || { row "$tool (no such case)" "FAIL  pattern matched nothing"; failed=1; return; }
    timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 $W parity --device cuda --threads 1 --case "$c" $flag \
        >"$OUT/sanitize_one.txt" 2>&1
    rc=$?
    cat "$OUT/sanitize_one.txt" >>"$OUT/sanitize.txt"
    result "$tool case $c${flag:+ $flag}" $rc \
        "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_one.txt" | sed 's/^=* *//' | cut -c1-60)"
}

stage_build() {
    s=$(date +%s)
    $MK >"$OUT/build.txt" 2>&1
    result "build (make)" $? "$(($(date +%s) - s)) s"
    [ -x $W ] || { tail -30 "$OUT/build.txt"; return; }
    $W version | tee -a "$OUT/build.txt"
    : >"$OUT/ptxas.txt"
    n=0 bad=0
    for f in $(find src/cuda -name '*.cu' | sort); do
        n=$((n + 1))
        { echo "== $f"; "$NVCC" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Iinclude -Isrc -Isrc/cuda \
            -Xptxas -v -c "$f" -o /tmp/cuda_check_ptxas.o 2>&1; } >>"$OUT/ptxas.txt" || bad=$((bad + 1))
    done
    spills=$(grep -E 'bytes spill (stores|loads)' "$OUT/ptxas.txt" | grep -cvE ' 0 bytes spill stores, 0 bytes spill loads')
    result "ptxas report ($n .cu files)" $bad "$spills functions with spills (ptxas.txt)"
}

stage_parity() {
    run "test_api (CUDA status codes)" test_api.txt 120 build/tests/test_api
    run "test_kernels" test_kernels.txt 300 build/tests/test_kernels
    run "python tests (CUDA tensors)" python.txt 300 env WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python \
        python3 python/tests/test_python.py
    run "parity --device cuda" parity-cuda.txt 400 $W parity --device cuda --threads "$(nproc)"
    run "parity --device cuda --deterministic" parity-cuda-deterministic.txt 400 \
        $W parity --device cuda --threads "$(nproc)" --deterministic
    mkdir -p "$OUT/cli" && build/tests/cli_helper gen "$OUT/cli" >/dev/null
    ok=0
    for i in 1 2; do
        $W attn "$OUT/cli/ok_bhnd.safetensors" "$OUT/cli/out$i.safetensors" --sliding-window 65 --device cuda \
            --deterministic >>"$OUT/attn.txt" 2>&1 || ok=1
    done
    cmp "$OUT/cli/out1.safetensors" "$OUT/cli/out2.safetensors" >>"$OUT/attn.txt" 2>&1 || ok=1
    result "attn --deterministic twice: bit-identical" $ok ""
    if python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        run "bit-identity through PyTorch" bit_identity.txt 300 python3 scripts/cuda_bit_identity.py
    else
        row "bit-identity through PyTorch" "SKIP  no torch with CUDA"
    fi
}

stage_sanitize() {
    : >"$OUT/sanitize.txt"
    d64=$(case_of 'long (4224)' ' bf16 ' 'Nq=4224 Nk=4224 D=64 win=(1023,0)')
    d128=$(case_of 'long (4224)' ' bf16 ' 'Nq=4224 Nk=4224 D=128 win=(1023,0)')
    d256=$(case_of 'softcap' ' bf16 ' 'D=256 win=(99,0)')
    d512=$(case_of 'head dim 512' ' bf16 ' 'Nq=2081 Nk=2081 D=512 win=(1023,0)')
    gqa512=$(case_of 'head dim 512' ' f16 ' 'Hq=8 Hkv=1 Nq=1100')
    short=$(case_of 'Nq != Nk' ' bf16 ' 'Nq=1023 Nk=130 D=80 win=(-1,0)')
    vl128=$(case_of 'varlen' ' bf16 ' 'D=128 ')
    vl512=$(case_of 'varlen' ' bf16 ' 'D=512 ')
    f32=$(case_of 'window sweep' ' f32 ' 'Nq=1000 ' 'win=(63,0)')
    for c in $d64 $d128 $d256 $d512 $gqa512 $short $vl128 $vl512 $f32; do sanitize memcheck "$c"; done
    sanitize memcheck "$d128" --deterministic
    for c in $d128 $d256 $d512 $vl512; do sanitize racecheck "$c"; done
    sanitize racecheck "$d128" --deterministic
    $W parity --list | grep -E "^#($d64|$d128|$d256|$d512|$gqa512|$short|$vl128|$vl512|$f32) " >"$OUT/sanitize_cases.txt"
}

build_varlen_test() {
    [ -x build/cuda_varlen_test ] && [ build/cuda_varlen_test -nt scripts/cuda_varlen_test.c ] &&
        [ build/cuda_varlen_test -nt build/libwinattn.a ] && return 0
    cc -std=c11 -O2 -g -Wall -Wextra -Iinclude -Isrc scripts/cuda_varlen_test.c build/libwinattn.a -lm -lpthread \
        -L"$CUDA_HOME/lib64" -lcudart_static -ldl -lrt -lstdc++ -o build/cuda_varlen_test >"$OUT/varlen_cc.txt" 2>&1
}

stage_varlen() {
    run "parity --group varlen" parity-varlen.txt 200 $W parity --device cuda --group varlen --threads "$(nproc)"
    run "parity --group varlen --deterministic" parity-varlen-det.txt 200 \
        $W parity --device cuda --group varlen --threads "$(nproc)" --deterministic
    build_varlen_test
    result "cuda_varlen_test build" $? "varlen_cc.txt"
    [ -x build/cuda_varlen_test ] || return
    run "varlen against one call per sequence" varlen_test.txt 300 build/cuda_varlen_test
    run "varlen, 70,000 sequences" varlen_big.txt 120 build/cuda_varlen_test --big
    run "varlen, malformed offsets" varlen_malformed.txt 120 build/cuda_varlen_test --malformed
    run "varlen, malformed offsets under memcheck" varlen_malformed_memcheck.txt 200 \
        compute-sanitizer --tool memcheck --error-exitcode 9 build/cuda_varlen_test --malformed
}

stage_nonfinite() {
    run "test_nonfinite" nonfinite.txt 300 build/tests/test_nonfinite
}

stage_probe() {
    run "probe --device cuda" probe-cuda.txt 300 $W probe --device cuda
    grep -E '^\|' "$OUT/probe-cuda.txt"
}

stage_sm80() {
    run "parity --quick, WINATTN_CUDA=sm80" parity-sm80.txt 400 env WINATTN_CUDA=sm80 \
        $W parity --device cuda --quick --threads "$(nproc)"
    run "parity --quick --deterministic, WINATTN_CUDA=sm80" parity-sm80-det.txt 400 env WINATTN_CUDA=sm80 \
        $W parity --device cuda --quick --threads "$(nproc)" --deterministic
    build_varlen_test && run "varlen test --quick, WINATTN_CUDA=sm80" varlen_sm80.txt 300 \
        env WINATTN_CUDA=sm80 build/cuda_varlen_test --quick
}

[ $# -gt 0 ] || set -- build parity sanitize varlen nonfinite probe
for stage in "$@"; do
    case $stage in
    build | parity | sanitize | varlen | nonfinite | probe | sm80) ;;
    *) echo "cuda_check.sh: unknown stage '$stage' (build parity sanitize varlen nonfinite probe sm80)" >&2; exit 2 ;;
    esac
done
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
for stage in "$@"; do
    if [ "$stage" != build ] && [ ! -x $W ]; then
        row "$stage" "FAIL  no $W: run the build stage first"
        failed=1
        continue
    fi
    echo "== $stage"
    "stage_$stage"
done
row "total" "$(($(date +%s) - t0)) s"
echo "== summary (logs in $OUT)"
cat "$TABLE"
exit $failed

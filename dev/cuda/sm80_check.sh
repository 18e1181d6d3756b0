#!/bin/sh
# sm80_check.sh — the path GPUs of compute capability 8.x take, checked on the H200. The build carries
# SASS for sm_80, sm_86, sm_89 and compute_80 PTX beside sm_90a (Makefile); on the H200
#   WINATTN_CUDA=sm80   takes exactly an A100's path: no wgmma kernel, versions 2 and 5's mma.sync
#                       kernels where they fit 163 KB of shared memory a block, version 1 (tiles
#                       shrunk to fit) for the rest;
#   WINATTN_CUDA=sm86   the same with 99 KB (RTX 30x0 / 40x0, A10, A40, L4, L40);
#   CUDA_FORCE_PTX_JIT=1  makes the driver ignore every SASS and JIT-compile the compute_80 PTX, the
#                       code Blackwell runs and the source of sm_8x's SASS; the Hopper kernels are
#                       stubs there, so the dispatcher must notice by itself (the run without
#                       WINATTN_CUDA: a stub launched would trap and fail the sweep).
# Stages (default: all, in this order), each appending rows to build/sm80_check.txt, which stays on
# the device machine between calls; every run ends by printing that table:
#   build     make -j16 (lab_build), the architectures in libwinattn.a
#   parity    the full sweep on the H200's own path, with sm80, sm80 --deterministic; sm86 --quick
#   jit       CUDA_FORCE_PTX_JIT=1: the full sweep without WINATTN_CUDA and with sm80 (the first pays
#             the JIT, cached in /tmp/wa-jit-cache)
#   sanitize  compute-sanitizer memcheck under sm80 / sm86 on one case per kernel family; probe --quick
#   bench     (b) 8K at D = 128 and (a) 8K at D = 256, default / sm80 / sm86 / JIT
# From the repository root on the H200, DEPS as in scripts/cuda_check.sh; within the 10-minute limit
# of one call: `sh dev/cuda/sm80_check.sh build jit`, then `sh dev/cuda/sm80_check.sh parity`, then
# `sh dev/cuda/sm80_check.sh sanitize bench`.
. dev/cuda/lab_env.sh
unset WINATTN_CUDA
W=build/winattn
TABLE=build/sm80_check.txt
JIT="env CUDA_FORCE_PTX_JIT=1 CUDA_CACHE_PATH=/tmp/wa-jit-cache CUDA_CACHE_MAXSIZE=4294967296"
row() { printf '%-52s %s\n' "$1" "$2" >>"$TABLE"; }

stage_build() {
    s=$(date +%s)
    [ -f "$TABLE" ] && mv "$TABLE" "$TABLE.old"
    mkdir -p build
    lab_build build ""
    row "build (make -j16)" "$(($(date +%s) - s)) s"
    if command -v cuobjdump >/dev/null 2>&1; then
        row "SASS in libwinattn.a" "$(cuobjdump --list-elf build/libwinattn.a | sed 's/.*\.\(sm_[0-9a-z]*\)\.cubin/\1/' | sort | uniq -c | tr -s ' \n' ' ')"
        row "PTX in libwinattn.a" "$(cuobjdump --list-ptx build/libwinattn.a | sed 's/.*\.\(sm_[0-9a-z]*\)\.ptx/\1/' | sort | uniq -c | tr -s ' \n' ' ')"
    fi
    nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | sed 's/^/device: /'
}

stage_parity() {
    lab_sweep "H200 default (versions 4/5)" 300 $W parity --device cuda --threads 16
    lab_sweep "WINATTN_CUDA=sm80" 400 env WINATTN_CUDA=sm80 $W parity --device cuda --threads 16
    lab_sweep "WINATTN_CUDA=sm80 --deterministic" 400 env WINATTN_CUDA=sm80 $W parity --device cuda --threads 16 --deterministic
    lab_sweep "WINATTN_CUDA=sm86 --quick" 300 env WINATTN_CUDA=sm86 $W parity --device cuda --threads 16 --quick
}

stage_jit() {
    rm -rf /tmp/wa-jit-cache
    lab_sweep "CUDA_FORCE_PTX_JIT=1 (no WINATTN_CUDA; JIT)" 500 $JIT $W parity --device cuda --threads 16
    lab_sweep "CUDA_FORCE_PTX_JIT=1 WINATTN_CUDA=sm80" 400 $JIT WINATTN_CUDA=sm80 $W parity --device cuda --threads 16
}

# the first case of `parity --list` whose line matches every pattern given
case_of() {
    l=$($W parity --list)
    for pat in "$@"; do l=$(printf '%s\n' "$l" | grep -e "$pat"); done
    printf '%s\n' "$l" | head -1 | sed 's/^#\([0-9]*\).*/\1/'
}

stage_sanitize() {
    : >"$OUT/sanitize.txt"
    d64=$(case_of 'window sweep' ' f16 ' 'Nq=113 ' 'D=64 ' 'win=(62,0)')
    d128=$(case_of 'head dims' ' f16 ' 'D=128 ')
    d256=$(case_of 'head dims' ' bf16 ' 'D=256 ')
    d512=$(case_of 'head dims' ' bf16 ' 'D=512 ')
    vl=$(case_of 'varlen' ' bf16 ' 'D=128 ')
    for spec in "sm80 $d64" "sm80 $d128" "sm80 $d128 --deterministic" "sm80 $d256" "sm80 $vl" "sm86 $d128" "sm86 $d512"; do
        set -- $spec
        env=$1 c=$2
        shift 2
        [ -n "$c" ] || { row "memcheck $env (no such case)" "-"; continue; }
        WINATTN_CUDA=$env timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 $W parity --device cuda --threads 1 \
            --case "$c" "$@" >"$OUT/sanitize_one.txt" 2>&1
        rc=$?
        cat "$OUT/sanitize_one.txt" >>"$OUT/sanitize.txt"
        row "memcheck $env case $c $*" "exit $rc, $(grep -E '^[0-9]+ passed' "$OUT/sanitize_one.txt" | tail -1), $(grep 'ERROR SUMMARY' "$OUT/sanitize_one.txt" | sed 's/^=* *//')"
    done
    $W parity --list | grep -E "^#($d64|$d128|$d256|$d512|$vl) " | sed 's/^/  case /'
    WINATTN_CUDA=sm80 timeout 300 $W probe --device cuda --quick >"$OUT/probe_sm80.txt" 2>&1
    row "probe --quick, WINATTN_CUDA=sm80" "exit $?, $(tail -1 "$OUT/probe_sm80.txt")"
}

# bench_row LABEL CMD...: one row, fwd/bwd TFLOP/s from the bench table's last line; the forward
# TFLOP/s is left in $fwd
bench_row() {
    label=$1
    shift
    last=$(timeout 200 "$@" | tail -1)
    fwd=$(printf '%s\n' "$last" | awk -F'|' '{print $5 + 0}')
    row "bench $label" "$(printf '%s\n' "$last" | awk -F'|' 'NF >= 6 {printf "fwd %s, bwd %s TFLOP/s (%s / %s ms)", $5, $6, $3, $4}')"
}

stage_bench() {
    B128="$W bench --device cuda --reps 5 --n 8192 --d 128 --hkv 8 --sliding-window 4096"
    B256="$W bench --device cuda --reps 3 --n 8192"
    for e in default sm80 sm86; do
        v=$e
        [ $e = default ] && v= # empty: the default path
        bench_row "(b) D=128 8K, $e" env WINATTN_CUDA=$v $B128
        [ $e = default ] && fwd_v4=$fwd
        [ $e = sm80 ] && fwd_v2=$fwd
        bench_row "(a) D=256 8K, $e" env WINATTN_CUDA=$v $B256
    done
    bench_row "(b) D=128 8K, CUDA_FORCE_PTX_JIT=1" $JIT $B128
    fwd_jit=$fwd
    bench_row "(a) D=256 8K, CUDA_FORCE_PTX_JIT=1" $JIT $B256
    # version 4's forward runs about 3x version 2's at (b): by default the sm_90a kernels must be in
    # use, under the forced JIT they must not (the stubs would trap)
    row "dispatch: default uses the sm_90a kernels" "$(awk -v a="$fwd_v4" -v b="$fwd_v2" 'BEGIN {print (a > 1.5 * b ? "yes" : "NO")}') ($fwd_v4 against sm80's $fwd_v2)"
    row "dispatch: forced JIT stays on mma.sync" "$(awk -v a="$fwd_jit" -v b="$fwd_v2" 'BEGIN {print (a < 1.5 * b && a > 0 ? "yes" : "NO")}') ($fwd_jit)"
}

[ $# -gt 0 ] || set -- build parity jit sanitize bench
for stage in "$@"; do
    case $stage in
    build | parity | jit | sanitize | bench) ;;
    *) echo "sm80_check.sh: unknown stage '$stage' (build parity jit sanitize bench)" >&2; exit 2 ;;
    esac
    [ -x "$W" ] || [ "$stage" = build ] || { echo "no $W: run the build stage first" >&2; exit 1; }
    echo "== $stage"
    "stage_$stage"
done
echo "== table ($TABLE; logs in $OUT), $(($(date +%s) - t0)) s this call"
cat "$TABLE"

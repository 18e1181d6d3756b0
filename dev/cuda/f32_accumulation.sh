#!/bin/sh
# f32_accumulation.sh — version 1's long sums as compensated pairs (attn_cuda.cu: pair_add) checked
# on the H200 in one run, against the kernels before:
#   build   this tree (sm_90a, plus compute_80 PTX for the JIT check) and the tree carried in
#           .lab-base (the kernels before, sm_90a) side by side;
#   parity  the "accumulation" group, --verbose, on both (errors per case and tensor); the full
#           sweep on the default path; every case on version 1 (WINATTN_CUDA=v1 --quick); the tiles
#           of 8.6 / 8.9 (WINATTN_CUDA=sm86 --quick: dK/dV at D = 512 takes 4 rows there); the
#           accumulation group from the compute_80 PTX (CUDA_FORCE_PTX_JIT=1);
#   memcheck  compute-sanitizer on version 1's f32 kernels: D = 512 with sm86's tiles, D = 256;
#   bench   f32 forward and backward, before and after alternating, on four shapes;
#   torch   bench/f32_accuracy.py --device cuda: the errors of this tree's CUDA float32 and of
#           PyTorch's CUDA float32, both against a float64 oracle (FlashAttention's criterion).
# From the repository root on the H200 (DEPS as in scripts/cuda_check.sh); about 4 minutes.
# `sh dev/cuda/f32_accumulation.sh threads` instead builds this tree with 128, 256 and 512 threads a
# CTA (WA_V1_THREADS) beside .lab-base and runs only the accumulation group and the bench on each.
. dev/cuda/lab_env.sh
unset WINATTN_CUDA
W=build/winattn B=.lab-base/build-base/winattn
FLAGS=$LAB_SM90_FLAGS
lab_summary 58

(cd .lab-base && lab_build build-base "" NVCCFLAGS="$FLAGS" build-base/winattn) &
if [ "${1:-}" = threads ]; then
    # the define inside NVCCFLAGS: a command-line NVCCFLAGS replaces the Makefile's, CUDA_DEFINES included
    for n in 128 256 512; do lab_build build-t$n "" NVCCFLAGS="$FLAGS -DWA_V1_THREADS=$n" build-t$n/winattn & done
else
    lab_build build "" NVCCFLAGS="$FLAGS -gencode=arch=compute_80,code=compute_80" build/winattn build/libwinattn.so
fi
wait
[ -x $B ] || { echo "the base build failed:"; tail -20 "$OUT/build-base.txt"; exit 1; }
row "builds" "$(($(date +%s) - t0)) s"

# bench BINARY...: f32 forward / backward ms of each binary in turn, twice, on four shapes
bench() {
    for shape in "--n 4096 --hq 8 --hkv 4 --d 256 --sliding-window 1024" "--n 4096 --hq 8 --hkv 8 --d 128 --causal" \
        "--n 2048 --hq 4 --hkv 1 --d 512 --causal" "--n 8192 --hq 16 --hkv 2 --d 64 --sliding-window 1024"; do
        line=""
        for bin in "$@" "$@"; do
            t=$($bin bench --device cuda --dtype f32 --reps 3 $shape 2>&1 | grep '^| [0-9]' | awk -F'|' '{gsub(/ /,"",$3); gsub(/ /,"",$4); print $3 "/" $4}')
            line="$line $t"
        done
        row "bench f32 $shape" "$line"
    done
}

if [ "${1:-}" = threads ]; then
    for n in 128 256 512; do
        lab_sweep "accumulation, $n threads" 200 build-t$n/winattn parity --device cuda --group accumulation --threads 16
        lab_sweep "WINATTN_CUDA=v1 --quick, $n threads" 200 env WINATTN_CUDA=v1 build-t$n/winattn parity --device cuda --threads 16 --quick
    done
    echo "== bench (f32, ms: forward / backward; before, 128, 256, 512 threads, then again)"
    bench $B build-t128/winattn build-t256/winattn build-t512/winattn
    echo "== summary"
    cat "$TABLE"
    exit 0
fi

lab_sweep "accumulation, before" 200 $B parity --device cuda --group accumulation --threads 16 --verbose
lab_sweep "accumulation, after" 200 $W parity --device cuda --group accumulation --threads 16 --verbose
lab_sweep "full, default path" 200 $W parity --device cuda --threads 16
lab_sweep "WINATTN_CUDA=v1 --quick" 240 env WINATTN_CUDA=v1 $W parity --device cuda --threads 16 --quick
lab_sweep "WINATTN_CUDA=sm86 --quick" 200 env WINATTN_CUDA=sm86 $W parity --device cuda --threads 16 --quick
rm -rf /tmp/wa-jit-cache
lab_sweep "accumulation, CUDA_FORCE_PTX_JIT=1" 240 env CUDA_FORCE_PTX_JIT=1 CUDA_CACHE_PATH=/tmp/wa-jit-cache $W parity --device cuda \
    --group accumulation --threads 16

# the errors of the f32 cases, before and after, side by side (the --verbose lines name the tensor)
for when in before after; do
    echo "== accumulation group, $when (f32 lines)"
    grep -E ' f32 ' "$OUT/parity_accumulation__$when.txt" | head -40
done

first_case() { $W parity --list | grep ' f32 ' | grep "$1" | head -1 | sed 's/^#\([0-9]*\).*/\1/'; }
c512=$(first_case 'D=512 ') c256=$(first_case 'D=256 ')
WINATTN_CUDA=sm86 lab_sanitize memcheck $W "$c512" | sed 's/^/sm86 tiles: /' | tee -a "$TABLE"
lab_sanitize memcheck $W "$c256" | tee -a "$TABLE"

echo "== bench (f32, ms: forward / backward; before, after, before, after)"
bench $B $W
echo "== against PyTorch's CUDA float32"
timeout 240 python3 bench/f32_accuracy.py --device cuda --parity $W >"$OUT/f32_accuracy_cuda.md" 2>"$OUT/f32_accuracy_cuda.err"
grep -E 'FAIL|3x' "$OUT/f32_accuracy_cuda.md" | head
row "bench/f32_accuracy.py --device cuda" "$(tail -1 "$OUT/f32_accuracy_cuda.md")"
echo "== summary"
cat "$TABLE"

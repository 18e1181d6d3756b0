#!/bin/sh
# bench_parity.sh — build with nvcc, time the issue's shapes on CUDA (`winattn bench --device
# cuda`, both backward forms, and the mma.sync forward beside), then the CUDA parity sweep (default
# and --deterministic). Run from the repository root (or a copy of it) on the H200:
#   DEPS=path/to/.devdeps sh dev/cuda/bench_parity.sh [bench|parity|all]
# WINATTN_CUDA=v1 in the environment times version 1 instead (src/cuda/attn_mma.cu: mma_supports).
OUT=${OUT:-/tmp/out}
DEPS=${DEPS:-.devdeps}
mkdir -p "$OUT"
what=${1:-all}
make -j16 JANSSON_CFLAGS=-I$DEPS/usr/include JANSSON_LIBS=$DEPS/usr/lib/x86_64-linux-gnu/libjansson.a >"$OUT/build.txt" 2>&1 ||
    { tail -30 "$OUT/build.txt"; exit 1; }
nvidia-smi -L
B="build/winattn bench --device cuda --reps 5"
if [ "$what" = all ] || [ "$what" = bench ]; then
    echo "== (a) bf16 Hq=32 Hkv=16 D=256 window 1024"
    $B --n 8192,16384,32768
    echo "== (a) f16 at 16384"
    $B --n 16384 --dtype f16
    echo "== (b) bf16 Hq=32 Hkv=8 D=128 window 4096"
    $B --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096
    echo "== D=64 Hq=32 Hkv=8 window 1024"
    $B --n 16384 --d 64 --hkv 8 --sliding-window 1024
    echo "== deterministic backward (--deterministic): (a) 8192 16384 32768, (b) 8192 32768"
    $B --deterministic --n 8192,16384,32768 | tail -3
    $B --deterministic --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
    echo "== forward on mma.sync (WINATTN_CUDA=mma) for comparison: (a) 16384, (b) 8192, D=64"
    WINATTN_CUDA=mma $B --n 16384 --forward-only | tail -1
    WINATTN_CUDA=mma $B --n 8192 --d 128 --hkv 8 --sliding-window 4096 --forward-only | tail -1
    WINATTN_CUDA=mma $B --n 16384 --d 64 --hkv 8 --sliding-window 1024 --forward-only | tail -1
fi
if [ "$what" = all ] || [ "$what" = parity ]; then
    echo "== parity --device cuda"
    build/winattn parity --device cuda --threads 16 >"$OUT/parity_cuda.txt" 2>&1
    grep '^FAIL' "$OUT/parity_cuda.txt" | head -40
    tail -12 "$OUT/parity_cuda.txt"
    echo "== parity --device cuda --deterministic"
    build/winattn parity --device cuda --threads 16 --deterministic >"$OUT/parity_cuda_deterministic.txt" 2>&1
    grep '^FAIL' "$OUT/parity_cuda_deterministic.txt" | head -20
    tail -1 "$OUT/parity_cuda_deterministic.txt"
fi
# `bench_parity.sh variants NAME "FLAGS" [NAME "FLAGS"...]`: each variant built into build-NAME with extra
# nvcc defines, then forward and backward timed at (a) N=16384 and (b) N=8192.
if [ "$what" = variants ]; then
    shift
    while [ $# -ge 2 ]; do
        name=$1 flags=$2
        shift 2
        make -j16 BUILD=build-$name JANSSON_CFLAGS=-I$DEPS/usr/include JANSSON_LIBS=$DEPS/usr/lib/x86_64-linux-gnu/libjansson.a \
            NVCCFLAGS="-O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -Iinclude -std=c++17 $flags" \
            build-$name/winattn >"$OUT/build-$name.txt" 2>&1 || { echo "variant $name: build failed"; tail -5 "$OUT/build-$name.txt"; continue; }
        echo "== variant $name ($flags)"
        build-$name/winattn bench --device cuda --reps 5 --n 16384 | tail -1
        build-$name/winattn bench --device cuda --reps 5 --n 8192 --d 128 --hkv 8 --sliding-window 4096 | tail -1
        build-$name/winattn bench --device cuda --reps 5 --n 16384 --d 64 --hkv 8 | tail -1
    done
fi

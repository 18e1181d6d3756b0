#!/bin/sh
# v4_vs_older.sh — version 4 (src/cuda/fwd_hopper.cu, bwd_hopper.cu) against the older kernels:
# build, a quick CUDA parity sweep, timings of v4 beside v4a / v3 / mma.sync at the shapes,
# then the full CUDA parity sweep. Run from the repository root on the H200:
#   DEPS=.devdeps sh dev/cuda/v4_vs_older.sh [bench|parity|all|bwd]
# `bwd`: quick parity, forward+backward timings of v4 and v2 (WINATTN_CUDA=mma), full parity.
# Every step has a time limit, so a hung kernel costs minutes, not the whole run.
OUT=${OUT:-/tmp/out}
DEPS=${DEPS:-.devdeps}
mkdir -p "$OUT"
what=${1:-all}
t0=$(date +%s)
timeout 400 make -j16 JANSSON_CFLAGS=-I$DEPS/usr/include JANSSON_LIBS=$DEPS/usr/lib/x86_64-linux-gnu/libjansson.a build/winattn \
    >"$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
echo "built in $(($(date +%s) - t0)) s"
nvidia-smi -L
P="timeout 120 build/winattn parity --device cuda --threads 16"
if [ "$what" = all ] || [ "$what" = parity ] || [ "$what" = bwd ]; then
    for v in default; do
        echo "== parity --quick ($v)"
        WINATTN_CUDA=$v $P --quick >"$OUT/parity_quick_$v.txt" 2>&1; echo "exit $?"
        grep '^FAIL' "$OUT/parity_quick_$v.txt" | head -10; tail -1 "$OUT/parity_quick_$v.txt"
    done
fi
# the shapes, timed by the bench command $1 with WINATTN_CUDA=$2
shape_a() {
    echo "== (a) bf16 Hq=32 Hkv=16 D=256 window 1024 ($2)"
    WINATTN_CUDA=$2 $1 --n 8192,16384,32768 | tail -3
}
shapes_b_d64() {
    echo "== (b) bf16 Hq=32 Hkv=8 D=128 window 4096 ($2)"
    WINATTN_CUDA=$2 $1 --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
    echo "== D=64 Hq=32 Hkv=8 window 1024, 16K ($2)"
    WINATTN_CUDA=$2 $1 --n 16384 --d 64 --hkv 8 --sliding-window 1024 | tail -1
}
extras() {
    echo "== f16 (a) 16K; causal 8K at D=256 and D=128 (default)"
    $1 --n 16384 --dtype f16 | tail -1
    $1 --n 8192 --causal | tail -1
    $1 --n 8192 --d 128 --hkv 8 --causal | tail -1
}
if [ "$what" = bwd ]; then
    F="timeout 90 build/winattn bench --device cuda --reps 5"
    for v in default mma; do
        shape_a "$F" $v
        shapes_b_d64 "$F" $v
    done
    extras "$F"
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
    B="timeout 60 build/winattn bench --device cuda --reps 5 --forward-only"
    for v in default v4a v3; do shape_a "$B" $v; done
    for v in default v4a mma; do shapes_b_d64 "$B" $v; done
    extras "$B"
fi
if [ "$what" = all ] || [ "$what" = parity ] || [ "$what" = bwd ]; then
    echo "== parity --device cuda (full, default)"
    timeout 300 build/winattn parity --device cuda --threads 16 >"$OUT/parity_cuda.txt" 2>&1; echo "exit $?"
    grep '^FAIL' "$OUT/parity_cuda.txt" | head -20
    tail -3 "$OUT/parity_cuda.txt"
fi
echo "total $(($(date +%s) - t0)) s"

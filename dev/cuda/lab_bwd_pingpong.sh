#!/bin/sh
# lab_bwd_pingpong.sh — the dK/dV kernel at D <= 128 with its two consumer warpgroups taking turns
# to issue each batch of products (-DWA_BWD_PINGPONG, bwd_hopper.cu) against free drift, for the
# default (fused) and the --deterministic backward; quick parity of the variant in both forms
# first. From the repository root on the H200:  DEPS=.devdeps sh dev/cuda/lab_bwd_pingpong.sh
OUT=${OUT:-/tmp/out}
DEPS=${DEPS:-.devdeps}
mkdir -p "$OUT"
J="JANSSON_CFLAGS=-I$DEPS/usr/include JANSSON_LIBS=$DEPS/usr/lib/x86_64-linux-gnu/libjansson.a"
NV="-O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -Iinclude -std=c++17"
timeout 300 make -j16 $J build/winattn >"$OUT/build.txt" 2>&1 || { tail -20 "$OUT/build.txt"; exit 1; }
timeout 300 make -j16 BUILD=build-pp $J NVCCFLAGS="$NV -DWA_BWD_PINGPONG" build-pp/winattn >"$OUT/build-pp.txt" 2>&1 ||
    { tail -20 "$OUT/build-pp.txt"; exit 1; }
for flag in "" --deterministic; do
    echo "== pingpong: parity --quick $flag"
    timeout 60 build-pp/winattn parity --device cuda --threads 16 --quick $flag | tail -1
done
for round in 1 2; do
    for v in build build-pp; do
        for flag in "" --deterministic; do
            echo "== $v ${flag:-fused} (round $round): (b) 8K/32K, D=64 16K, causal D=128 8K"
            B="timeout 60 $v/winattn bench --device cuda --reps 5 $flag"
            $B --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
            $B --n 16384 --d 64 --hkv 8 --sliding-window 1024 | tail -1
            $B --n 8192 --d 128 --hkv 8 --causal | tail -1
        done
    done
done

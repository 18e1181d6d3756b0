#!/bin/sh
# fwd_key_tile_d128.sh — the version-4 forward at D = 128 with key tiles of 128 (default) against
# 160, 176 and 192 (-DWA_FWD_BN128, fwd_hopper.cu), each with the pipelined pingpong form (default)
# and without the in-warpgroup overlap (WINATTN_CUDA=v4a, which also drops pingpong). ptxas (commit
# 0b8d8e4): at 160-192 the pipelined form spills 68-128 bytes (P of the last tile stays live beside
# S and O), the other form does not. Quick parity per variant, then forward timings at (b) and
# causal D = 128. From the repository root on the H200:
#   DEPS=.devdeps sh dev/cuda/fwd_key_tile_d128.sh
. dev/cuda/lab_env.sh
for bn in 128 160 176 192; do (lab_build build-bn$bn -DWA_FWD_BN128=$bn build-bn$bn/winattn) & done
wait # the four builds side by side (16 cores; each is bound by its slowest .cu file)
for bn in 128 160 176 192; do
    [ -x build-bn$bn/winattn ] || { echo "BN=$bn did not build"; continue; }
    echo "== BN=$bn: parity --quick"
    timeout 60 build-bn$bn/winattn parity --device cuda --threads 16 --quick | tail -1
done
for bn in 128 160 176 192; do
    for v in default v4a; do
        echo "== BN=$bn ($v): forward (b) 8K/32K, causal D=128 8K"
        F="timeout 60 build-bn$bn/winattn bench --device cuda --reps 5 --forward-only"
        WINATTN_CUDA=$v $F --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
        WINATTN_CUDA=$v $F --n 8192 --d 128 --hkv 8 --causal | tail -1
    done
done

#!/bin/sh
# bwd_pingpong.sh — the dK/dV kernel at D <= 128 with its two consumer warpgroups taking turns
# to issue each batch of products (-DWA_BWD_PINGPONG, bwd_hopper.cu) against free drift, for the
# default (fused) and the --deterministic backward; quick parity of the variant in both forms
# first. From the repository root on the H200:  DEPS=.devdeps sh dev/cuda/bwd_pingpong.sh
. dev/cuda/lab_env.sh
lab_build build "" build/winattn
lab_build build-pp -DWA_BWD_PINGPONG build-pp/winattn
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

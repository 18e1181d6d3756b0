#!/bin/sh
# fwd_pingpong.sh — the version-4 forward with the consumers taking turns to issue their products
# (pingpong, fwd_hopper.cu; -DWA_FWD_PINGPONG_MAX_D=256: turns at every D, the one-item form) against
# this tree's default (free drift, persistent; turns were the default from commit 269dca8, after this
# script measured them 6 % faster at D = 128 and 0-2 % at D = 64 and 256, until the persistent form
# beat them), at the shapes (a) and (b), D = 64 and causal D = 128; quick parity of the
# variant first. From the repository root on the H200:
#   DEPS=.devdeps sh dev/cuda/fwd_pingpong.sh
. dev/cuda/lab_env.sh
lab_build build "" build/winattn
lab_build build-turns -DWA_FWD_PINGPONG_MAX_D=256 build-turns/winattn
echo "== turns: parity --quick"
timeout 100 build-turns/winattn parity --device cuda --threads 16 --quick | tail -1
for round in 1 2; do
    for v in build build-turns; do
        echo "== $v (round $round): forward (a) 8K/32K, (b) 8K/32K, D=64 16K, causal D=128 8K"
        F="timeout 60 $v/winattn bench --device cuda --reps 7 --forward-only"
        $F --n 8192,32768 | tail -2
        $F --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
        $F --n 16384 --d 64 --hkv 8 --sliding-window 1024 | tail -1
        $F --n 8192 --d 128 --hkv 8 --causal | tail -1
    done
done

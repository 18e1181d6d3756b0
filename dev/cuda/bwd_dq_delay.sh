#!/bin/sh
# bwd_dq_delay.sh — the fused backward with each warpgroup forming step n's dQ during step n + 1
# (mbarriers on three dSᵀ buffers instead of a named barrier every step), the change kept in
# dev/cuda/dq_delay.patch and applied here to the device's copy of the tree; checked and timed:
# quick and full parity, memcheck and racecheck on D = 128 cases, then the backward at (b) and
# D = 64 beside the deterministic form. The patch applies to the tree of commit 65d589e (and back to
# b27bf16's parent), not to later ones; from the root of such a tree on the H200:
#   DEPS=.devdeps sh dev/cuda/bwd_dq_delay.sh
# Measured on b27bf16 (recorded in 65d589e): parity 962/962, sanitizers clean, but no faster: (b)
# bwd 366 / 410 TFLOP/s against 371 / 421 for the named-barrier form in an earlier run (the
# deterministic form, unchanged, read 327 / 342 against 327 / 360 in the same two runs), so the
# simpler form stayed.
. dev/cuda/lab_env.sh
git apply dev/cuda/dq_delay.patch || { echo "dq_delay.patch does not apply"; exit 1; }
lab_build build "" build/winattn lib
echo "== parity --quick"
timeout 60 build/winattn parity --device cuda --threads 16 --quick | tail -1 || exit 1
B="timeout 60 build/winattn bench --device cuda --reps 7"
for flag in "" --deterministic; do
    echo "== bench ${flag:-default}: (b) 8K/32K, D=64 window 1024 16K, causal D=128 8K"
    $B $flag --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
    $B $flag --n 16384 --d 64 --hkv 8 --sliding-window 1024 | tail -1
    $B $flag --n 8192 --d 128 --hkv 8 --causal | tail -1
done
echo "== parity (full)"
timeout 120 build/winattn parity --device cuda --threads 16 >"$OUT/parity-cuda.txt" 2>&1; echo "exit $?"
grep '^FAIL' "$OUT/parity-cuda.txt" | head; tail -1 "$OUT/parity-cuda.txt"
lab_sanitize memcheck build/winattn 309 314
lab_sanitize racecheck build/winattn 309 314

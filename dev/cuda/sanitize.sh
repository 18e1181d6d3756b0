#!/bin/sh
# sanitize.sh — compute-sanitizer memcheck and racecheck on parity cases that reach the
# tensor-core kernels (f16/bf16, D = 64/128/256: windows, two-sided windows, GQA, Nq < Nk, softcap,
# bnhd layout): version 4's forward and both backward forms (the default, which at D <= 128 adds
# dQ inside the dK/dV kernel with bulk reduce-adds, and --deterministic); and version 5 at D = 512
# (337 causal bnhd, 836 GQA 8 with Nq < Nk, 973 Nq > Nk with empty rows).
# Needs build/ (lab.sh). Full logs in $OUT.
OUT=${OUT:-/tmp/out}
: >"$OUT/sanitize.txt"
for run in 120 309 314 327 399 719 748 "309 --deterministic" "399 --deterministic" 337 836 973; do
    timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 build/winattn parity --device cuda --threads 1 --case $run \
        >>"$OUT/sanitize.txt" 2>&1
    echo "memcheck case $run: exit $?"
done
for run in 309 314 327 748 399 "309 --deterministic" 337 836; do
    timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 build/winattn parity --device cuda --case $run --threads 1 \
        >>"$OUT/sanitize.txt" 2>&1
    echo "racecheck case $run: exit $?"
done
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard" "$OUT/sanitize.txt" | sort | uniq -c

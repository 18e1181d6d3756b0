#!/bin/sh
# sanitize.sh — compute-sanitizer memcheck and racecheck on parity cases that reach the
# tensor-core kernels (f16/bf16, D = 64/128/256: windows, two-sided windows, GQA, Nq < Nk, softcap,
# bnhd layout): version 4's forward and both backward forms (the default, which at D <= 128 adds
# dQ inside the dK/dV kernel with bulk reduce-adds, and --deterministic); and version 5 at D = 512
# (337 causal bnhd, 836 GQA 8 with Nq < Nk, 973 Nq > Nk with empty rows).
# Needs build/ (bench_parity.sh). Full logs in $OUT.
. dev/cuda/lab_env.sh
: >"$OUT/sanitize.txt"
lab_sanitize memcheck build/winattn 120 309 314 327 399 719 748 309:--deterministic 399:--deterministic 337 836 973
lab_sanitize racecheck build/winattn 309 314 327 748 399 309:--deterministic 337 836
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard" "$OUT/sanitize.txt" | sort | uniq -c

#!/bin/sh
# bwd_fused.sh — the fused backward (dQ added by the dK/dV kernel with bulk f32 reduce-adds at
# D <= 128, bwd_hopper.cu; the default since commit 1309c0f; this script first ran it behind the
# then opt-in flag --atomic-dq, since renamed: --deterministic now selects the other form):
# build, parity of the fused form, timings of both forms at the shape (b) and at D = 64,
# sanitizers on the fused kernel, and the binding's per-call gap (dev/cuda/binding_gap.py --host-only).
# Run from the repository root on the H200:  DEPS=.devdeps sh dev/cuda/bwd_fused.sh [full]
. dev/cuda/lab_env.sh
t0=$(date +%s)
lab_build build "" build/winattn lib
echo "built in $(($(date +%s) - t0)) s"
P="timeout 200 build/winattn parity --device cuda --threads 16"
echo "== parity (full, fused)"
$P >"$OUT/parity_atomic.txt" 2>&1; echo "exit $?"
grep '^FAIL' "$OUT/parity_atomic.txt" | head -10; tail -1 "$OUT/parity_atomic.txt"
B="timeout 90 build/winattn bench --device cuda --reps 5"
for flag in --deterministic ""; do
    echo "== (b) bf16 Hq=32 Hkv=8 D=128 window 4096 ${flag:-fused}"
    $B $flag --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
    echo "== D=64 Hq=32 Hkv=8 window 1024, 16K ${flag:-fused}"
    $B $flag --n 16384 --d 64 --hkv 8 --sliding-window 1024 | tail -1
    echo "== D=128 causal 8K f16 ${flag:-fused}"
    $B $flag --n 8192 --d 128 --hkv 8 --causal --dtype f16 | tail -1
done
echo "== compute-sanitizer on the fused kernel"
lab_sanitize memcheck build/winattn 120 309 314 399 719
lab_sanitize racecheck build/winattn 309 314 399
echo "== binding gap"
timeout 120 python3 dev/cuda/binding_gap.py --host-only
if [ "${1:-}" = full ]; then
    echo "== parity (full, default)"
    $P >"$OUT/parity_cuda.txt" 2>&1; echo "exit $?"; grep '^FAIL' "$OUT/parity_cuda.txt" | head; tail -1 "$OUT/parity_cuda.txt"
fi

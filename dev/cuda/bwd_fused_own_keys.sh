#!/bin/sh
# bwd_fused_own_keys.sh — the fused backward (the default at D <= 128 since commit 1309c0f; before
# it, the opt-in --atomic-dq, since renamed to the opposite --deterministic) with dQ split by columns
# between the warpgroups (default) against each warpgroup forming dQ over its own keys
# (-DWA_DQ_OWN_KEYS), beside the deterministic backward; then the binding's per-call host time.
# Run from the repository root on the H200:  DEPS=.devdeps sh dev/cuda/bwd_fused_own_keys.sh
. dev/cuda/lab_env.sh
lab_build build "" build/winattn lib
lab_build build-own -DWA_DQ_OWN_KEYS build-own/winattn
for v in build build-own; do
    echo "== $v: parity --quick"
    timeout 100 $v/winattn parity --device cuda --threads 16 --quick | tail -1
done
run() { # $1 label, $2 winattn binary, $3 flags
    echo "== $1"
    B="timeout 90 $2 bench --device cuda --reps 7 $3"
    $B --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
    $B --n 16384 --d 64 --hkv 8 --sliding-window 1024 | tail -1
}
run "deterministic" build/winattn --deterministic
run "fused, split columns" build/winattn ""
run "fused, own keys" build-own/winattn ""
echo "== binding gap (context keeps its workspace now)"
timeout 120 python3 dev/cuda/binding_gap.py --host-only

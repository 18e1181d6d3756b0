#!/bin/sh
# bwd_dq_red.sh — the fused backward's dQ share added from registers by vector reductions
# (-DWA_DQ_RED; since it measured slower the variant lives in dev/cuda/dq_red.patch, applied here to
# the device's copy of the tree) against the staged bulk reduce-add (default), `winattn bench` at
# (b) and D = 64, two rounds; for the variant also the full parity sweep, compute-sanitizer on case
# 309 (fused D = 128) and bench/gpu_peers.py at (b) against FlexAttention, so that one run holds
# the evidence it would need to become the default. On the H200 (DEPS=.devdeps).
LAB_KEEP=1
. dev/cuda/lab_env.sh
git apply dev/cuda/dq_red.patch || { echo "dq_red.patch does not apply"; exit 1; }
(lab_build build "" build/winattn lib) &
(lab_build build-red -DWA_DQ_RED build-red/winattn lib) &
wait
[ -x build/winattn ] && [ -x build-red/winattn ] || exit 1
echo "built in $(($(date +%s) - t0)) s"
B="--device cuda --reps 5"
for round in 1 2; do
    for w in build build-red; do
        echo "== $w round $round: (b) 8K/32K; D64 16K"
        timeout 90 $w/winattn bench $B --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
        timeout 60 $w/winattn bench $B --n 16384 --d 64 --hkv 8 --sliding-window 1024 | tail -1
    done
done
timeout 240 build-red/winattn parity --device cuda --threads 16 >"$KEEP/parity-red.txt" 2>&1
echo "build-red parity: $(tail -1 "$KEEP/parity-red.txt")"; grep '^FAIL' "$KEEP/parity-red.txt" | head -5
for tool in memcheck racecheck; do lab_sanitize $tool build-red/winattn 309; done
left=$((560 - ($(date +%s) - t0)))
echo "== gpu_peers (b), build-red, at $(($(date +%s) - t0)) s, $left s left"
WINATTN_LIBRARY=build-red/libwinattn.so timeout $left python3 bench/gpu_peers.py --shapes b --systems flex,winattn --reps 3 \
    --json "$KEEP/gpu-peers-red.json" >"$KEEP/gpu-peers-red.txt" 2>"$OUT/gpu-peers.err"
echo "exit $?"; cat "$KEEP/gpu-peers-red.txt"; tail -2 "$OUT/gpu-peers.err"
echo "total $(($(date +%s) - t0)) s"

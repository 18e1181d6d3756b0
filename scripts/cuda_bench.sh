#!/bin/sh
# cuda_bench.sh — `winattn bench --device cuda` at the GPU shapes of docs/design.md §5, in both
# backward forms, per call and in the steady state, from the repository root on a CUDA machine
# after `make`:
#   sh scripts/cuda_bench.sh [BUILD...]      (default: build)
# Each BUILD folder's winattn in turn, twice over (rounds alternate the order, so that no build is
# always timed first or after the others' heat): (a) 8K / 16K / 32K, (b) 8K / 32K, D64 16K,
# (c) 8K / 16K, (cw) 16K; the default backward, then --deterministic; then (with CALLS, default 10)
# runs of that many calls back to back (`--calls`, the power-limited steady state). Prints one
# row per build, shape and form: forward / backward TFLOP/s at each length. REPS (default 5) is
# `--reps`. A change is judged against a baseline built and timed in the same run.
[ $# -gt 0 ] || set -- build
REPS=${REPS:-5}
CALLS=${CALLS:-10}
# shape label and bench arguments
SHAPES='a|--n 8192,16384,32768
b|--n 8192,32768 --d 128 --hkv 8 --sliding-window 4096
D64|--n 16384 --d 64 --hkv 8 --sliding-window 1024
c|--n 8192,16384 --d 512 --hq 32 --hkv 4 --causal
cw|--n 16384 --d 512 --hq 32 --hkv 4 --sliding-window 1024'
# line BUILD LABEL FORM ARGS...: one row, "fwd / bwd" TFLOP/s for each length of the bench table
line() {
    b=$1 label=$2 form=$3
    shift 3
    r=$(timeout 200 "$b/winattn" bench --device cuda --reps "$REPS" "$@" |
        awk -F'|' '$2 ~ /[0-9]/ {printf "%s: %s / %s   ", $2 + 0, $5 + 0, $6 + 0}')
    printf '%-8s %-4s %-22s %s\n' "$b" "$label" "$form" "${r:-failed}"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
echo "rows: N: forward / backward TFLOP/s (visible pairs, docs/design.md §5), median of $REPS"
for round in 1 2; do
    builds=$*
    if [ $round = 2 ]; then builds=; for b in "$@"; do builds="$b $builds"; done; fi
    echo "== round $round"
    for b in $builds; do
        [ -x "$b/winattn" ] || { echo "$b: no winattn (make BUILD=$b)"; continue; }
        printf '%s\n' "$SHAPES" | while IFS='|' read -r label args; do
            # shellcheck disable=SC2086 # args is a word list
            line "$b" "$label" "per call" $args
            line "$b" "$label" "per call, determ." $args --deterministic
            line "$b" "$label" "steady x$CALLS" $args --calls "$CALLS"
        done
    done
done

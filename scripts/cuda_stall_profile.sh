#!/bin/sh
# cuda_stall_profile.sh — Nsight Compute's per-instruction warp-stall sampling of one kernel in one
# `winattn bench --device cuda` run, read back by scripts/cuda_stalls.py as the SASS instructions
# where its warps stall most (with their reasons, the mbarrier a wait loop polls, excess
# shared-memory wavefronts, samples by opcode). From the repository root on a CUDA machine, after
# `make`:
#   sh scripts/cuda_stall_profile.sh NAME KERNEL_REGEX BENCH_ARGS...
#   e.g. sh scripts/cuda_stall_profile.sh fwd512 fwd --n 8192 --d 512 --hq 32 --hkv 4 --causal --forward-only
# The first launch of a kernel whose name matches KERNEL_REGEX is profiled. Written to $OUT
# (default /tmp/out): src_NAME.csv.gz (the whole source page), details_NAME.txt (the details
# page) and stalls_NAME.txt (cuda_stalls.py's reading). WINATTN: the binary (default build/winattn).
[ $# -ge 2 ] || { echo "usage: sh scripts/cuda_stall_profile.sh NAME KERNEL_REGEX BENCH_ARGS..." >&2; exit 2; }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
name=$1 kernel=$2
shift 2
rep=${TMPDIR:-/tmp}/cuda_stall_$name
timeout 300 ncu --clock-control none --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    --import-source no -k "regex:$kernel" --launch-count 1 -o "$rep" -f "${WINATTN:-build/winattn}" bench --device cuda \
    --reps 1 "$@" >"$OUT/ncu_$name.log" 2>&1 || { tail -5 "$OUT/ncu_$name.log"; exit 1; }
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$rep.csv" 2>"$OUT/src_$name.err" ||
    { head -3 "$OUT/src_$name.err"; exit 1; }
gzip -c "$rep.csv" >"$OUT/src_$name.csv.gz"
ncu -i "$rep.ncu-rep" --page details >"$OUT/details_$name.txt" 2>&1
grep -E "Duration|Tensor|Stall|stall|Issue|Warp Cycles" "$OUT/details_$name.txt" | head -20
python3 scripts/cuda_stalls.py "$OUT/src_$name.csv.gz" --top 30 | tee "$OUT/stalls_$name.txt"

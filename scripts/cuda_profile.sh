#!/bin/sh
# cuda_profile.sh — Nsight Compute on the kernels of one `winattn bench --device cuda` run: per
# kernel launch its duration, tensor-pipe, issue and occupancy figures, shared-memory bank
# conflicts, registers, L2 and DRAM traffic, and the stall reasons that matter (warps per issued
# instruction). From the repository root on a CUDA machine, after `make`:
#   sh scripts/cuda_profile.sh [BENCH_ARGS...]
#   e.g. sh scripts/cuda_profile.sh --n 8192 --d 128 --hkv 8 --sliding-window 4096
# BENCH_ARGS go to `winattn bench` after `--device cuda --n 8192 --reps 1` (the write-up's shape by
# default). KERNELS: a regular expression on kernel names (default: every kernel); LAUNCHES: how
# many launches to profile (default 4: a forward and the backward's kernels); WINATTN: the binary
# (default build/winattn). CMD replaces the whole profiled command (any program, e.g. a PyTorch
# script; NCU_ARGS="--profile-from-start off" with one that marks what to profile by
# cudaProfilerStart / Stop). The raw CSV stays in $OUT/ncu.csv (OUT defaults to /tmp/out).
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
M="gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
M="$M,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active"
M="$M,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,launch__registers_per_thread"
M="$M,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed"
M="$M,sm__cycles_elapsed.avg,sm__cycles_elapsed.avg.per_second,smsp__inst_executed.sum,lts__t_bytes.sum,dram__bytes.sum"
M="$M,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
# shellcheck disable=SC2086 # CMD and NCU_ARGS are word lists
if [ -n "$CMD" ]; then set -- $CMD; else set -- "${WINATTN:-build/winattn}" bench --device cuda --n 8192 --reps 1 "$@"; fi
ncu --clock-control none --csv --page raw --metrics "$M" -k "regex:${KERNELS:-.}" --launch-count "${LAUNCHES:-4}" \
    $NCU_ARGS "$@" >"$OUT/ncu.csv" 2>"$OUT/ncu.err" || { tail -5 "$OUT/ncu.err"; exit 1; }
python3 - "$OUT/ncu.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
if len(rows) < 3:
    sys.exit("cuda_profile.sh: Nsight Compute profiled no kernel (see ncu.err)")
head, data = rows[0], rows[2:]
name = head.index("Kernel Name")
for r in data:
    print("--", r[name][:60])
    vals = []
    for h, v in zip(head, r):
        if "stalled" in h:
            try: x = float(v.replace(",", ""))
            except ValueError: continue
            if x >= 0.05: vals.append((x, h.replace("smsp__average_warps_issue_stalled_", "").replace("_per_issue_active.ratio", "")))
        elif h.startswith(("gpu__", "sm__", "smsp__issue", "smsp__inst", "l1tex", "launch__reg", "lts__", "dram__")) and not h.endswith((".max", ".min", ".sum.pct_of_peak_sustained_active")):
            print("  %-70s %s" % (h, v))
    print("  stalls (warps per issued instruction):", ", ".join("%s %.2f" % (n, x) for x, n in sorted(vals, reverse=True)))
PY

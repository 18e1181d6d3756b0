#!/bin/sh
# profile.sh — Nsight Compute on the tensor-core kernels (one launch each of forward, prep/delta,
# dK/dV, dQ) at the write-up's shape, N=8192: duration, tensor-pipe and issue utilisation, and the
# stall reasons that matter. Needs build/ from bench_parity.sh. Extra arguments go to `winattn bench`;
# KERNELS overrides the name filter (default: version 4's kernels; "mma" for version 2's).
# LAUNCHES: how many launches to profile (default 4); WINATTN: the binary (default build/winattn).
# CMD replaces the whole profiled command (dev/cuda/peer_profile.sh: a PyTorch script that marks
# what to profile with cudaProfilerStart / Stop; NCU_ARGS="--profile-from-start off" for that).
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
ncu --clock-control none --csv --page raw --metrics "$M" -k "regex:${KERNELS:-_ws_kernel|prep_kernel}" --launch-count ${LAUNCHES:-4} \
    $NCU_ARGS "$@" >"$OUT/ncu.csv" 2>"$OUT/ncu.err" || tail -5 "$OUT/ncu.err"
python3 - "$OUT/ncu.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
head, data = rows[0], [r for r in rows[2:]]
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

#!/bin/sh
# bwd_small_kernels.sh — how long the backward's small kernels take beside the main ones (Nsight
# Compute, speed-of-light section: duration, DRAM throughput; the first launches of `winattn
# bench`, forward included): at (b) 32K the prep (δ, lse2, zeroing the f32 dQ accumulator) and
# convert kernels of the fused backward; at (a) 8K every backward kernel (prep, dK/dV split by
# output, dQ). On the H200 (DEPS=.devdeps).
LAB_KEEP=1
. dev/cuda/lab_env.sh
[ -x build/winattn ] || lab_build build "" build/winattn
M="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum"
run() {
    label=$1; shift
    timeout 150 ncu --clock-control none --metrics "$M" -k "regex:prep_kernel|dq_convert|_ws_kernel" --launch-count 10 --csv --page raw \
        build/winattn bench --device cuda --reps 1 "$@" >"$KEEP/ncu_$label.csv" 2>"$OUT/ncu_$label.err" || tail -3 "$OUT/ncu_$label.err"
    python3 - "$KEEP/ncu_$label.csv" "$label" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
if not rows: sys.exit("no rows")
head = rows[0]; data = rows[2:]
k = head.index("Kernel Name"); t = [i for i, h in enumerate(head) if h.startswith("gpu__time_duration")][0]
d = [i for i, h in enumerate(head) if h.startswith("dram__throughput")][0]; byt = [i for i, h in enumerate(head) if h.startswith("dram__bytes")][0]
for r in data:
    print("%-6s %-44s %10s ns  DRAM %5s %%  %s bytes" % (sys.argv[2], r[k][:44], r[t], r[d], r[byt]))
PY
}
run b32k --n 32768 --d 128 --hkv 8 --sliding-window 4096
run a8k --n 8192

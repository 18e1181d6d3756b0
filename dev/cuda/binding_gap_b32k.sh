#!/bin/sh
# binding_gap_b32k.sh — why the backward at (b) 32K runs at 431-440 TFLOP/s through the PyTorch
# binding (bench/gpu_peers.py, `check_fewer_instructions.sh peers`) but 508 in `winattn bench`
# (`check_fewer_instructions.sh check`), both on commit 1ab130a; on the H200 (DEPS=.devdeps).
# dev/cuda/binding_gap.py times the binding with randn and uniform data, one and ten calls per
# timing, beside the C bench, while nvidia-smi samples the SM clock and the power every 100 ms
# ($OUT/smi.csv; phases marked in $OUT/phases.txt). Then Nsight Compute's per-instruction sampling
# of the fused dK/dV kernel at (b) 32K ($OUT/src_dkdv32k.csv.gz).
LAB_KEEP=1
. dev/cuda/lab_env.sh
lab_build build "" build/winattn lib
echo "built in $(($(date +%s) - t0)) s"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 100 >"$KEEP/smi.csv" &
smi=$!
phase() { echo "$(date +%H:%M:%S.%N) $1" >>"$KEEP/phases.txt"; }
phase "binding_gap.py"
timeout 200 python3 dev/cuda/binding_gap.py --no-host --cases=b:8192,b:32768
phase "C bench"
timeout 90 build/winattn bench --device cuda --reps 5 --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
phase "end"
kill $smi
S="--device cuda --n 32768 --reps 1 --d 128 --hkv 8 --sliding-window 4096"
timeout 200 ncu --clock-control none --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    --import-source no -k "regex:dkdv_ws_kernel" --launch-count 1 -o /tmp/prof_dkdv -f build/winattn bench $S >"$OUT/ncu.log" 2>&1 ||
    tail -3 "$OUT/ncu.log"
ncu -i /tmp/prof_dkdv.ncu-rep --page source --csv --print-source sass | gzip >"$KEEP/src_dkdv32k.csv.gz"
ncu -i /tmp/prof_dkdv.ncu-rep --page details >"$KEEP/details_dkdv32k.txt" 2>&1
grep -E "Duration|SM Active|Elapsed Cycles|Warp Cycles Per Issued" "$KEEP/details_dkdv32k.txt"
echo "total $(($(date +%s) - t0)) s"

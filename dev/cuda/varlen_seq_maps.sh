#!/bin/sh
# varlen_seq_maps.sh — the varlen TMA kernels loading through per-sequence tensor maps (rows past a
# sequence's end arrive as zeros: hopper_prims.cuh, seq_maps_kernel), checked on the H200 in one
# run against the kernels before:
#   build     this tree (sm_90a) and the tree carried in .lab-base (the kernels before), both with
#             this tree's tests/test_nonfinite.c;
#   nonfinite build/tests/test_nonfinite on both: its varlen cases must fail before (a NaN or an
#             infinity at a sequence's edge reached the neighbouring sequence) and pass now, with
#             every rectangular case passing on both;
#   parity    the varlen group in both backward forms, `--quick` on the default kernels;
#   varlen    dev/cuda/varlen_check.sh quick (each varlen call against per-sequence calls, B =
#             70,000 sequences, malformed offsets); compute-sanitizer memcheck on malformed offsets
#             and two cases, racecheck on one;
#   bench     `winattn bench --varlen` on both trees, alternating: 8 long sequences at D = 128 and
#             64 short ones at D = 256 (the per-sequence maps cost one small kernel a call).
# From the repository root on the H200 (DEPS as in scripts/cuda_check.sh); about 6 minutes.
. dev/cuda/lab_env.sh
unset WINATTN_CUDA
W=build/winattn B=.lab-base/build-base/winattn
FLAGS=$LAB_SM90_FLAGS
lab_summary 52

cp tests/test_nonfinite.c .lab-base/tests/test_nonfinite.c
(cd .lab-base && lab_build build-base "" NVCCFLAGS="$FLAGS" build-base/winattn build-base/tests/test_nonfinite) &
lab_build build "" NVCCFLAGS="$FLAGS" build/winattn build/libwinattn.a build/tests/test_nonfinite
wait
[ -x $B ] || { echo "the base build failed:"; tail -20 "$OUT/build-base.txt"; exit 1; }
row "builds" "$(($(date +%s) - t0)) s"

for tree in base this; do
    bin=build/tests/test_nonfinite
    [ $tree = base ] && bin=.lab-base/build-base/tests/test_nonfinite
    log="$OUT/nonfinite_$tree.txt"
    s=$(date +%s)
    timeout 300 $bin >"$log" 2>&1
    row "nonfinite, $tree: varlen cuda failed" "$(grep -c '^FAIL nonfinite varlen cuda' "$log") of $(grep -c 'nonfinite varlen cuda' "$log")"
    row "nonfinite, $tree: other failures" "$(grep '^FAIL' "$log" | grep -vc 'varlen cuda')"
    row "nonfinite, $tree" "$(tail -1 "$log") ($(($(date +%s) - s)) s)"
    grep '^FAIL' "$log" | head -3 | cut -c1-230
done

lab_sweep "varlen group" 300 $W parity --device cuda --group varlen --threads 16
lab_sweep "varlen group --deterministic" 300 $W parity --device cuda --group varlen --threads 16 --deterministic
lab_sweep "--quick" 400 $W parity --device cuda --quick --threads 16

s=$(date +%s)
OUT=$OUT sh dev/cuda/varlen_check.sh quick >"$OUT/varlen_check.txt" 2>&1
row "varlen_check.sh quick" "$(tail -1 "$OUT/varlen_check.txt") ($(($(date +%s) - s)) s)"
grep -E '^FAIL|: .*exit [1-9]' "$OUT/varlen_check.txt" | head -5
for c in "--malformed" "--case 0" "--case 66"; do
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 build/varlen_test $c >"$OUT/memcheck.txt" 2>&1
    row "memcheck varlen_test $c" "exit $?, $(grep 'ERROR SUMMARY' "$OUT/memcheck.txt" | sed 's/^=* *//')"
done
timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 build/varlen_test --case 0 >"$OUT/racecheck.txt" 2>&1
row "racecheck varlen_test --case 0" "exit $?, $(grep 'RACECHECK SUMMARY' "$OUT/racecheck.txt" | sed 's/^=* *//')"

# bench: the varlen arm's forward / backward ms of each tree, alternating
short=$(python3 -c 'print(",".join(["300"] * 64))')
for shape in "--varlen 8192,6000,4096,3000,2048,1500,1024,777 --d 128 --hq 32 --hkv 8 --sliding-window 4096" \
    "--varlen $short --d 256 --hq 16 --hkv 8 --causal"; do
    for bin in $B $W $B $W; do
        line=$($bin bench --device cuda --reps 5 $shape 2>&1 | grep -i 'varlen, one call' | head -1 | tr -s ' ')
        row "bench $(echo "$shape" | cut -c1-30)… $( [ $bin = $W ] && echo this || echo base)" "$line"
    done
done
row "total" "$(($(date +%s) - t0)) s"

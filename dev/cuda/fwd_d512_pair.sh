#!/bin/sh
# fwd_d512_pair.sh — the D = 512 forward in clusters of two CTAs sharing each K/V tile load
# (-DWA_FWD512_CLUSTER: fwd_wide_ws_kernel's PAIR form, kv_ring::produce_pair; two query heads of
# one K/V head at the same query tile) against this tree's single-CTA form, on the H200, in one
# run: the builds (sm_90a only, in parallel: this tree, the pair form, and the pair form with waits
# that give up, -DWA_LAB_WAIT_TIMEOUT); on the last, the f16/bf16 D = 512 parity cases alone (27 of
# the 29 have an even GQA group and take the pair form; each under a timeout) and the waits that
# gave up; if they passed, `winattn bench --device cuda` at (c) 8K / 16K causal and D = 512 with a
# 1024 window at 16K, this tree and the pair build alternating, twice; then on the pair build the
# whole sweep, memcheck on cases 336 and 1016 (pairs, rectangular and varlen) and racecheck on 336
# (each hazard's lines in racecheck.txt). The summary comes back in summary.txt. Modes: `bench`
# stops after the bench rows, `check` runs only the sweep and the sanitizers on the pair build;
# neither, both.
# From the repository root on the H200 (DEPS as in scripts/cuda_check.sh):
#   DEPS=.devdeps sh dev/cuda/fwd_d512_pair.sh [bench | check]
LAB_KEEP=1
. dev/cuda/lab_env.sh
unset WINATTN_CUDA
FLAGS=$LAB_SM90_FLAGS
lab_summary 58
BENCH=1 CHECK=1
case ${1:-} in bench) CHECK=0 ;; check) BENCH=0 ;; esac
nvidia-smi -L

# a command-line NVCCFLAGS drops the Makefile's CUDA_DEFINES: the defines go inside it
(lab_build build-pair "" NVCCFLAGS="$FLAGS -DWA_FWD512_CLUSTER" build-pair/winattn) &
(lab_build build-pair-wt "" NVCCFLAGS="$FLAGS -DWA_FWD512_CLUSTER -DWA_LAB_WAIT_TIMEOUT" build-pair-wt/winattn) &
lab_build build "" NVCCFLAGS="$FLAGS" build/winattn
wait
[ -x build-pair/winattn ] && [ -x build-pair-wt/winattn ] || { row "pair builds" "failed"; exit 1; }
row "builds" "$(($(date +%s) - t0)) s"

P=build-pair/winattn
if [ $BENCH = 1 ]; then
    s=$(date +%s)
    LAB_CASE_TIMEOUT=60 lab_parity_each build-pair-wt/winattn "$(lab_d512_cases $P)" >"$OUT/each_pair.txt"
    ok=$?
    grep -v passed "$OUT/each_pair.txt" | head -4
    row "parity, D = 512 f16/bf16 cases alone, pair (timeouts)" "$(tail -1 "$OUT/each_pair.txt") ($(($(date +%s) - s)) s)"
    grep -h 'gave up' "$OUT"/p_*.txt 2>/dev/null | awk '{print $4, $6, $14}' | sort | uniq -c | sort -rn | head -5
    [ $ok -eq 0 ] || { row "total" "$(($(date +%s) - t0)) s (stopped: the pair form failed)"; exit 1; }

    for round in 1 2; do
        for b in build build-pair; do lab_d512_bench $round $b; done
    done
fi
[ $CHECK = 1 ] || { row "total" "$(($(date +%s) - t0)) s"; exit 0; }

lab_sweep "full, pair" 240 $P parity --device cuda --threads 16
lab_sanitize memcheck $P 336 1016 | while read -r l; do row "memcheck, pair" "$l"; done
: >"$KEEP/racecheck.txt"
lab_race_lines "case 336, pair" $P parity --device cuda --threads 1 --case 336
row "total" "$(($(date +%s) - t0)) s"

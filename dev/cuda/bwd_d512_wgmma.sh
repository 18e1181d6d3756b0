#!/bin/sh
# bwd_d512_wgmma.sh — the D = 512 backward on wgmma (dkdv_wide_ws_kernel, dq_wide_ws_kernel in
# bwd_hopper.cu) against version 5's mma.sync backward (-DWA_BWD_WIDE_MMA: the same tree with
# D = 512 left to bwd_wide.cu), on the H200, in one run. Modes (any of them, in this order):
#   bench    (the default) build this tree and the mma build (sm_90a only, in parallel); the
#            "head dim 512" parity group, then every other f16/bf16 D = 512 case alone (each under
#            a timeout); `winattn bench --device cuda` at (c) 8K / 16K causal and at D = 512 with a
#            1024 window at 16K (docs/cuda.md's shapes), each build in turn, twice;
#   variants the lab builds build-pN for N in VARIANT_PARTS ("1 2 8"; -DWA_DKDV512_PARTS=N: the
#            dK/dV kernel's Q and dO loaded, waited for and released in N parts along D, so that the
#            next step's first parts land while this step's last products still read the last ones;
#            1 loads them whole), and the builds named in VARIANT_PREBUILT, which come only from
#            .lab-prebuilt (another commit's tree, named in their PREBUILT); then their D = 512
#            parity and bench rows, alternating with this tree's (the default, 4); VARIANTS_STEADY=C
#            adds rows of C calls back to back (`bench --calls`); `build-variants` only builds them
#            (make leaves them be in a later run on the same machine). bn16 (the dQ kernel on
#            16-key tiles in two stages) is measured by `variants` at f050d6d, the dQ kernel's K
#            in parts (-DWA_DQ512_KPARTS=N, build-kN) at 2fd558d;
#   check    this tree only: the varlen group, the D = 512 varlen cases, the whole sweep in both
#            backward modes (their logs come back), memcheck on a rectangular and a varlen D = 512
#            case, a varlen D = 128 one and case 309 (D = 128, the fused dK/dV kernel), racecheck on
#            the two D = 512 ones and 309 (each hazard's pair of source lines, counted over the
#            first 5000, in racecheck.txt), then nonfinite;
#   nonfinite tests/test_nonfinite (D = 64 to 512 on CUDA);
#   racecheck racecheck on dev/cuda/racecheck_exchange.cu's forms of the handshakes the D = 512
#            kernels use, and the lab build ds-named (-DWA_LAB_DS_NAMED: the dQ kernel's dS handed
#            back behind named barriers, the default until racecheck passed the mbarrier form):
#            its D = 512 parity cases, bench rows alternating with this tree's, racecheck on cases
#            336 and 1016 (each hazard's lines in racecheck.txt);
#   varlen   a lab build whose mbarrier waits give up and say where (-DWA_LAB_WAIT_TIMEOUT): the
#            D = 512 varlen cases alone, the `varlen` group, and the waits that gave up
#            (diag_waits.txt), if any;
#   python   the Python tests on CUDA, winattn.torch's C++ path built for the machine's torch
#            first, and dev/cuda/bit_identity.py (this tree's libwinattn.so);
#   torch    `bench/gpu_peers.py --systems winattn --shapes c,cw` (through PyTorch, per call and
#            steady) on this tree's library and each variant's (unpacked from .lab-prebuilt or
#            built here), the builds alternating, TORCH_ROUNDS rounds (2), one
#            row per shape and build; the tables in torch_peers.txt.
# From the repository root on the H200 (DEPS as in scripts/cuda_check.sh):
#   sh dev/cuda/bwd_d512_wgmma.sh [bench] [variants | build-variants] [check] [racecheck] [varlen] [nonfinite] [python] [torch]
LAB_KEEP=1
. dev/cuda/lab_env.sh
unset WINATTN_CUDA
# the lab values of WA_DKDV512_PARTS beside the default (4), each built into build-pN;
# build_variants TARGET makes build-pN/TARGET of each, in the background, and unpacks the
# prebuilt-only ones
MADE=$(for n in ${VARIANT_PARTS-1 2 8}; do printf 'build-p%s ' "$n"; done)
build_variants() {
    for b in $MADE; do (lab_build $b "" NVCCFLAGS="$FLAGS -DWA_DKDV512_PARTS=${b#build-p}" $b/$1) & done
    for b in ${VARIANT_PREBUILT-}; do
        tar xJf ".lab-prebuilt/$b.tar.xz" 2>/dev/null && row "prebuilt $b" "$(cat $b/PREBUILT)" || row "$b" "no .lab-prebuilt/$b.tar.xz"
    done
}
VBUILDS="$MADE ${VARIANT_PREBUILT-}" # every variant

FLAGS=$LAB_SM90_FLAGS
lab_summary 58
BENCH=0 VARIANTS=0 BUILD_VARIANTS=0 CHECK=0 RACE=0 DIAG=0 NONFINITE=0 PYTHON=0 TORCH=0
[ $# -eq 0 ] && BENCH=1
for a in "$@"; do
    case $a in bench) BENCH=1 ;; variants) VARIANTS=1 BUILD_VARIANTS=1 ;; build-variants) BUILD_VARIANTS=1 ;; check) CHECK=1 NONFINITE=1 ;;
        nonfinite) NONFINITE=1 ;;
        racecheck) RACE=1 ;; varlen) DIAG=1 ;; python) PYTHON=1 ;; torch) TORCH=1 ;; esac
done
nvidia-smi -L

# a command-line NVCCFLAGS drops the Makefile's CUDA_DEFINES: the defines go inside it
[ $BENCH = 1 ] && (lab_build build-mma "" NVCCFLAGS="$FLAGS -DWA_BWD_WIDE_MMA" build-mma/winattn) &
[ $DIAG = 1 ] && (lab_build build-vl "" NVCCFLAGS="$FLAGS -DWA_LAB_WAIT_TIMEOUT" build-vl/winattn) &
[ $RACE = 1 ] && (lab_build build-dsn "" NVCCFLAGS="$FLAGS -DWA_LAB_DS_NAMED" build-dsn/winattn) &
[ $RACE = 1 ] && nvcc -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -o "$OUT/racecheck_exchange" dev/cuda/racecheck_exchange.cu &
lab_build build "" NVCCFLAGS="$FLAGS" build/winattn build/tests/test_nonfinite lib
wait
row "builds" "$(($(date +%s) - t0)) s"
if [ $BUILD_VARIANTS = 1 ]; then # while the GPU runs what follows
    build_variants winattn
fi

W=build/winattn
# the f16/bf16 D = 512 parity cases outside the "head dim 512" group, and the varlen ones among them
d512_cases() { $W parity --list | grep 'D=512' | grep -v ' f32 ' | grep "$@" | sed 's/^#\([0-9]*\).*/\1/' | tr '\n' ' '; }
CASES=$(d512_cases -v 'head dim 512') VL=$(d512_cases varlen)
parity_d512() { # W TAG: the group, then the other cases alone
    lab_sweep "head dim 512 group, $2" 200 $1 parity --device cuda --group "head dim 512" --threads 16
    s=$(date +%s)
    LAB_CASE_TIMEOUT=60 lab_parity_each $1 "$CASES" >"$OUT/each_$2.txt"
    grep -v passed "$OUT/each_$2.txt" | head -4
    row "parity, other D = 512 cases alone, $2" "$(tail -1 "$OUT/each_$2.txt") ($(($(date +%s) - s)) s)"
}
[ $BENCH = 1 ] && parity_d512 $W this

if [ $BENCH = 1 ]; then
    for round in 1 2; do
        for b in build build-mma; do lab_d512_bench $round $b; done
    done
fi

if [ $VARIANTS = 1 ]; then
    wait
    for b in $VBUILDS; do
        [ -x $b/winattn ] || { row "$b" "build failed"; continue; }
        parity_d512 $b/winattn $b
    done
    for round in 1 2; do
        for b in build $VBUILDS; do [ -x $b/winattn ] && lab_d512_bench $round $b; done
    done
    if [ -n "$VARIANTS_STEADY" ]; then
        for b in build $VBUILDS build; do
            [ -x $b/winattn ] && LAB_CALLS=$VARIANTS_STEADY lab_d512_bench "steady x$VARIANTS_STEADY" $b
        done
    fi
fi
[ $RACE = 1 ] || [ $CHECK = 1 ] && : >"$KEEP/racecheck.txt"
if [ $RACE = 1 ]; then
    for f in p pds pds-low pds-mbar mbar; do lab_race_lines "racecheck_exchange $f" "$OUT/racecheck_exchange" $f; done
    if [ -x build-dsn/winattn ]; then
        row "parity, D = 512 f16/bf16 cases alone, ds-named" "$(LAB_CASE_TIMEOUT=60 lab_parity_each build-dsn/winattn "$(lab_d512_cases $W)" | tail -1)"
        for round in 1 2; do
            for b in build build-dsn; do lab_d512_bench $round $b; done
        done
        for c in 336 1016; do lab_race_lines "case $c, ds-named" build-dsn/winattn parity --device cuda --threads 1 --case $c; done
    else
        row "build-dsn" "build failed"
    fi
fi
if [ $CHECK = 1 ]; then
    # the varlen group first: every varlen call on the Hopper forwards goes through release_workspace()
    lab_sweep "varlen group" 120 $W parity --device cuda --group varlen --threads 16
    row "parity, D = 512 varlen cases alone" "$(LAB_CASE_TIMEOUT=60 lab_parity_each $W "$VL" | tail -1)"
fi
if [ $DIAG = 1 ]; then
    row "parity, D = 512 varlen cases alone (wait timeouts)" "$(LAB_CASE_TIMEOUT=60 lab_parity_each build-vl/winattn "$VL" | tail -1)"
    lab_sweep "varlen group (wait timeouts)" 200 build-vl/winattn parity --device cuda --group varlen --threads 16
    cat "$OUT"/p_*.txt "$OUT"/parity_varlen*.txt 2>/dev/null | grep 'gave up' | awk '{print $4, $6, $8, $9, $14}' | sort | uniq -c |
        sort -rn | head -20 >"$KEEP/diag_waits.txt"
    row "waits that gave up (diag_waits.txt)" "$(wc -l <"$KEEP/diag_waits.txt") distinct"
fi
if [ $CHECK = 1 ]; then
    lab_sweep "full" 240 $W parity --device cuda --threads 16
    lab_sweep "full, deterministic" 240 $W parity --device cuda --threads 16 --deterministic
    cp "$OUT/parity_full.txt" "$KEEP/parity-cuda.txt"
    cp "$OUT/parity_full__deterministic.txt" "$KEEP/parity-cuda-deterministic.txt"
    VL128=$($W parity --list | grep varlen | grep -v ' f32 ' | grep 'D=128' | head -1 | sed 's/^#\([0-9]*\).*/\1/')
    VL512=${VL%% *}
    lab_sanitize memcheck $W 336 $VL512 $VL128 309 | while read -r l; do row "memcheck" "$l"; done
    for c in 336 $VL512 309; do lab_race_lines "case $c" $W parity --device cuda --threads 1 --case $c; done
fi
if [ $NONFINITE = 1 ]; then
    s=$(date +%s)
    timeout 200 build/tests/test_nonfinite >"$OUT/nonfinite.txt" 2>&1
    grep '^FAIL' "$OUT/nonfinite.txt" | head -3 | cut -c1-200
    row "test_nonfinite" "$(tail -1 "$OUT/nonfinite.txt") ($(($(date +%s) - s)) s)"
fi
if [ $PYTHON = 1 ]; then
    s=$(date +%s)
    # winattn.torch's C++ eager path for this machine's torch (without it its tests are one skip)
    timeout 240 python3 python/build_torch_ext.py --build build --quiet >"$OUT/torch_ext.txt" 2>&1 ||
        row "torch C++ path" "not built: $(tail -1 "$OUT/torch_ext.txt" | cut -c1-120)"
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python timeout 150 python3 python/tests/test_python.py >"$OUT/python.txt" 2>&1
    grep -E '^FAIL' "$OUT/python.txt" | head -3 | cut -c1-200
    grep -E '^SKIP' "$OUT/python.txt" | head -3 | cut -c1-120 | while read -r l; do row "python" "$l"; done
    row "python tests on CUDA" "$(tail -1 "$OUT/python.txt") ($(($(date +%s) - s)) s)"
    timeout 120 python3 dev/cuda/bit_identity.py >"$OUT/bit_identity.txt" 2>&1
    cat "$OUT/bit_identity.txt" | tail -8 | while read -r l; do row "bit identity" "$l"; done
fi
if [ $TORCH = 1 ]; then
    wait
    # the variants' libraries (unpacked, or built here, as each needs)
    build_variants libwinattn.so
    wait
    # the C++ eager path, built once beside this tree's library, serves every build's library
    timeout 240 python3 python/build_torch_ext.py --build build --quiet >"$OUT/torch_ext.txt" 2>&1 ||
        row "torch C++ path" "not built: $(tail -1 "$OUT/torch_ext.txt" | cut -c1-120)"
    EXT=$(ls build/torch_ext/torch-*/_torch_ext*.so 2>/dev/null | head -1)
    : >"$KEEP/torch_peers.txt"
    for round in $(seq "${TORCH_ROUNDS:-2}"); do
        for b in build $VBUILDS; do
            [ -f $b/libwinattn.so ] || continue
            WINATTN_LIBRARY=$b/libwinattn.so WINATTN_TORCH_EXT=$EXT PYTHONPATH=python timeout 200 python3 bench/gpu_peers.py \
                --systems winattn --baseline winattn --shapes c,cw --reps 3 >"$OUT/torch_$b.txt" 2>&1
            { echo "round $round, $b"; cat "$OUT/torch_$b.txt"; } >>"$KEEP/torch_peers.txt"
            grep '| winattn |' "$OUT/torch_$b.txt" | awk -F'|' -v r="$round" -v b="$b" '{
                printf "torch %s, %-9s %-3s %-6s fwd %s / %s steady, bwd %s / %s steady\n", r, b, $2, $3, $6, substr($9, 1, index($9, "/") - 1), $8, substr($9, index($9, "/") + 1) }' |
                tee -a "$TABLE"
        done
    done
fi
row "total" "$(($(date +%s) - t0)) s"

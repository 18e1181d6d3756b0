# lab_env.sh — sourced (`. dev/cuda/lab_env.sh`) by the lab scripts, from the repository
# root: sets OUT (where logs go, the device tool's $OUT) and DEPS (the unpacked libjansson, see
# scripts/cuda_check.sh), and defines the lab_* functions below.
# A script that sets LAB_KEEP=1 first gets KEEP = the device tool's $OUT (which returns at most 8
# files) for what must come back, and OUT = /tmp/lab for the other logs. DEPS is made absolute, so
# that a build in another tree (.lab-base/, carried for same-run comparisons) finds it; t0 starts
# the script's clock.
if [ -n "$LAB_KEEP" ]; then
    KEEP=${OUT:-/tmp/out}
    OUT=/tmp/lab
    mkdir -p "$KEEP"
fi
OUT=${OUT:-/tmp/out}
DEPS=${DEPS:-.devdeps}
case $DEPS in /*) ;; *) DEPS=$(pwd)/$DEPS ;; esac
mkdir -p "$OUT"
t0=$(date +%s)

# the nvcc flags of a Hopper-only lab build (the Makefile's, sm_90a alone: faster to build)
LAB_SM90_FLAGS="-O3 -lineinfo -Xcompiler -fPIC -Iinclude -std=c++17 -gencode=arch=compute_90a,code=sm_90a"

# lab_summary [WIDTH]: start the script's summary, $OUT/summary.txt (TABLE; $KEEP/summary.txt
# under LAB_KEEP, so that it comes back even when the run is cut short), empty; then
# `row LABEL TEXT` prints a line of it (the label padded to WIDTH, 52 by default) and appends it
lab_summary() {
    TABLE=${KEEP:-$OUT}/summary.txt
    LAB_ROW_WIDTH=${1:-52}
    : >"$TABLE"
}
row() { printf "%-${LAB_ROW_WIDTH:-52}s %s\n" "$1" "$2" | tee -a "${TABLE:-/dev/null}"; }

# lab_build DIR "DEFINES" TARGET...: make the targets with BUILD=DIR and the nvcc defines (e.g.
# -DWA_FWD_NO_PINGPONG; the Makefile's CUDA_DEFINES); log in $OUT/DIR.txt; on failure print its
# tail and exit the script
# When the tree carries .lab-prebuilt/DIR.tar.xz (dev/cuda/prebuild.sh made it on a CPU machine
# with the same nvcc), lab_build unpacks it instead of building: the GPU machine's minutes go to
# the GPU. The archive's DIR/PREBUILT names the flags it was built with; the summary row
# "prebuilt DIR" shows them. A target missing from the archive falls back to make.
lab_build() {
    dir=$1 defines=$2
    shift 2
    if [ -f ".lab-prebuilt/$dir.tar.xz" ] && tar xJf ".lab-prebuilt/$dir.tar.xz"; then
        missing=0
        for t in "$@"; do case $t in */*) [ -e "$t" ] || missing=1 ;; esac; done
        if [ $missing = 0 ]; then
            row "prebuilt $dir" "$(cat "$dir/PREBUILT" 2>/dev/null)"
            return 0
        fi
    fi
    timeout 400 make -j16 BUILD="$dir" CUDA_DEFINES="$defines" JANSSON_CFLAGS="-I$DEPS/usr/include" \
        JANSSON_LIBS="$DEPS/usr/lib/x86_64-linux-gnu/libjansson.a" "$@" >"$OUT/$dir.txt" 2>&1 ||
        { echo "build of $dir failed:"; tail -20 "$OUT/$dir.txt"; exit 1; }
}

# lab_build_variants NAME "DEFINES" ...: this tree's default into build/ and each variant, with its
# nvcc defines, into build-NAME/ (winattn only, sm_90a, in parallel; a command-line NVCCFLAGS drops
# the Makefile's CUDA_DEFINES, so the defines go inside it); BUILDS lists the folders, default first
lab_build_variants() {
    BUILDS=build
    while [ $# -ge 2 ]; do
        (lab_build "build-$1" "" NVCCFLAGS="$LAB_SM90_FLAGS $2" "build-$1/winattn") &
        BUILDS="$BUILDS build-$1"
        shift 2
    done
    lab_build build "" NVCCFLAGS="$LAB_SM90_FLAGS" build/winattn
    wait
}

# lab_checked BUILD: whether BUILD gets the variant scripts' checks: the builds CHECK names
# ("build build-NAME ..."; CHECK=none: none), or, CHECK unset, every variant but the default
lab_checked() {
    if [ -n "$CHECK" ]; then case " $CHECK " in *" $1 "*) return 0 ;; *) return 1 ;; esac; fi
    [ "$1" != build ]
}

# lab_d512_bench ROUND BUILD: a summary row of `BUILD/winattn bench --device cuda` at (c) 8K / 16K
# causal and at D = 512 with a 1024 window at 16K (docs/cuda.md's shapes), forward / backward TFLOP/s;
# LAB_CALLS=C times runs of C calls back to back, as lab_tflops does
lab_d512_bench() {
    d512_shape="--d 512 --hq 32 --hkv 4 ${LAB_CALLS:+--calls $LAB_CALLS}"
    r=$(timeout 150 $2/winattn bench --device cuda --reps 5 $d512_shape --causal --n 8192,16384 | tail -2 |
        awk -F'|' '{printf "%s: %s / %s  ", $2, $5, $6}')
    w=$(timeout 120 $2/winattn bench --device cuda --reps 5 $d512_shape --sliding-window 1024 --n 16384 | tail -1 |
        awk -F'|' '{printf "%s / %s", $5, $6}')
    row "bench $1, $2: fwd / bwd TFLOP/s, causal" "$r| w1024 16K: $w"
}

# lab_fwd_row ROUND BUILD: a summary row of `BUILD/winattn bench --device cuda --forward-only`, forward
# TFLOP/s at (a) 8K / 32K, (b) 8K / 32K, (c) 8K / 16K causal, D = 512 with a 1024 window at 16K and
# D = 64 (Hq 32, Hkv 8, window 1024) at 16K
lab_fwd_row() {
    w=$2/winattn
    a=$(lab_fwd_tflops $w --n 8192,32768)
    bb=$(lab_fwd_tflops $w --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096)
    c=$(lab_fwd_tflops $w --n 8192,16384 --d 512 --hq 32 --hkv 4 --causal)
    cw=$(lab_fwd_tflops $w --n 16384 --d 512 --hq 32 --hkv 4 --sliding-window 1024)
    d64=$(lab_fwd_tflops $w --n 16384 --d 64 --hkv 8 --sliding-window 1024)
    row "fwd $1, $2" "(a) $a| (b) $bb| (c) $c| (cw) $cw| (D64) $d64"
}
# lab_fwd512_row ROUND BUILD: lab_fwd_row's D = 512 columns alone ((c) 8K / 16K causal, D = 512 with
# a 1024 window at 16K), for variants of that kernel only
lab_fwd512_row() {
    w=$2/winattn
    c=$(lab_fwd_tflops $w --n 8192,16384 --d 512 --hq 32 --hkv 4 --causal)
    cw=$(lab_fwd_tflops $w --n 16384 --d 512 --hq 32 --hkv 4 --sliding-window 1024)
    row "fwd $1, $2" "(c) $c| (cw) $cw"
}
# lab_tflops COLUMN W BENCH_ARGS...: one TFLOP/s column of `W bench --device cuda` (5: forward, 6:
# backward), one value a length; LAB_CALLS=C times runs of C calls back to back (`bench --calls`,
# the steady state, at the clock a sustained load leaves the GPU)
lab_tflops() {
    col=$1 w=$2
    shift 2
    timeout 90 $w bench --device cuda --reps 5 ${LAB_CALLS:+--calls $LAB_CALLS} "$@" | awk -F'|' -v c="$col" '$2 ~ /[0-9]/ {printf "%s ", $c + 0}'
}
# lab_fwd_tflops W BENCH_ARGS...: the forward TFLOP/s of `W bench --device cuda --forward-only`
lab_fwd_tflops() {
    w=$1
    shift
    lab_tflops 5 $w --forward-only "$@"
}

# lab_d512_cases W: the f16/bf16 parity cases at D = 512 of the winattn binary W (the ones that
# reach the tensor-core kernels), as a space-separated list
lab_d512_cases() {
    $1 parity --list | grep 'D=512' | grep -v ' f32 ' | sed 's/^#\([0-9]*\).*/\1/' | tr '\n' ' '
}

# lab_parity_each W "CASES" [FLAGS...]: `W parity --device cuda` on each case alone (logs in
# $OUT/p_CASE.txt, or p_CASE_FLAGS.txt; each under `timeout LAB_CASE_TIMEOUT`, 120 s unless set,
# so that a kernel that hangs costs one case), the first FAIL lines of any that fail or time out,
# then "N passed, M failed"; returns non-zero when one failed
lab_parity_each() {
    w=$1 cases=$2
    shift 2
    pass=0 fail=0 tag=$(echo "$*" | tr -c 'a-z0-9\n' '_' | sed 's/^_*//')
    for c in $cases; do
        log="$OUT/p_$c${tag:+_$tag}.txt"
        timeout "${LAB_CASE_TIMEOUT:-120}" $w parity --device cuda --case "$c" --threads 4 "$@" >"$log" 2>&1
        rc=$?
        if [ $rc -eq 0 ] && grep -q '^1 passed' "$log"; then
            pass=$((pass + 1))
        else
            fail=$((fail + 1))
            [ $rc -eq 124 ] && echo "case $c: timed out"
            grep -E '^FAIL|error' "$log" | head -3
        fi
    done
    echo "$pass passed, $fail failed"
    [ "$fail" -eq 0 ]
}

# lab_sanitize TOOL W CASE...: compute-sanitizer --tool TOOL (memcheck or racecheck) on
# `W parity --device cuda --case N` for each CASE, N or N:FLAG (309:--deterministic); the logs
# are appended to $OUT/sanitize.txt; one line per case: the exit status (0: clean, 9: errors or
# hazards, 124: timed out) and the tool's summary
lab_sanitize() {
    tool=$1 w=$2
    shift 2
    for c in "$@"; do
        n=${c%%:*} flag=
        [ "$n" = "$c" ] || flag=${c#*:}
        timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 9 "$w" parity --device cuda --threads 1 --case "$n" $flag \
            >"$OUT/sanitize_one.txt" 2>&1
        rc=$?
        cat "$OUT/sanitize_one.txt" >>"$OUT/sanitize.txt"
        echo "$tool case $n${flag:+ $flag}: exit $rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_one.txt" | sed 's/^=* *//')"
    done
}

# lab_race_lines NAME CMD...: racecheck on CMD (under LAB_KEEP), a summary row, and the hazards'
# (first, second) access source lines, counted over the first 5000, appended to $KEEP/racecheck.txt
lab_race_lines() {
    name=$1
    shift
    timeout 150 compute-sanitizer --tool racecheck --racecheck-report hazard --show-backtrace no --print-limit 5000 "$@" \
        >"$OUT/race_one.txt" 2>&1
    row "racecheck, $name" "exit $?, $(grep -E 'wrong values|RACECHECK SUMMARY' "$OUT/race_one.txt" | sed 's/^=* *//' | tr '\n' ' ')"
    { echo "$name: the first 5000 hazards by (first, second) access, source line"; grep -E '(Write|Read) Thread' "$OUT/race_one.txt" |
        sed 's/.*\(Write\|Read\) Thread.* in \([^ ]*\)$/\1 \2/' | paste - - | sort | uniq -c; } >>"$KEEP/racecheck.txt"
}

# lab_sweep LABEL LIMIT CMD...: a parity run (CMD is the whole command line, env assignments first)
# under `timeout LIMIT`; its log in $OUT/parity_LABEL.txt, the first FAIL lines here, and a row with
# its closing count and seconds through the caller's `row LABEL TEXT`
lab_sweep() {
    label=$1 limit=$2
    shift 2
    log="$OUT/parity_$(echo "$label" | tr -c 'a-z0-9\n' '_').txt"
    s=$(date +%s)
    timeout "$limit" "$@" >"$log" 2>&1
    rc=$?
    grep '^FAIL' "$log" | head -5
    row "parity, $label" "$(tail -1 "$log" | grep -E 'passed|failed' || echo "no summary, exit $rc") ($(($(date +%s) - s)) s)"
}

# lab_source_profile NAME KERNEL_REGEX W BENCH_ARGS...: Nsight Compute with source counters (warp-stall
# sampling per SASS instruction) on the first launch of the kernels matching KERNEL_REGEX in
# `W bench BENCH_ARGS`; the source page as $KEEP/src_NAME.csv.gz and the details page as
# $KEEP/details_NAME.txt (under LAB_KEEP), the details' headline lines printed
lab_source_profile() {
    name=$1 kernel=$2 w=$3
    shift 3
    timeout 150 ncu --clock-control none --section SourceCounters --section WarpStateStats --section SpeedOfLight \
        --import-source no -k "regex:$kernel" --launch-count 1 -o "/tmp/prof_$name" -f "$w" bench "$@" \
        >"$OUT/ncu_$name.log" 2>&1 || tail -3 "$OUT/ncu_$name.log"
    ncu -i "/tmp/prof_$name.ncu-rep" --page source --csv --print-source sass >"$OUT/src_$name.csv" 2>"$OUT/src_$name.err" ||
        head -3 "$OUT/src_$name.err"
    gzip -c "$OUT/src_$name.csv" >"$KEEP/src_$name.csv.gz"
    ncu -i "/tmp/prof_$name.ncu-rep" --page details >"$KEEP/details_$name.txt" 2>&1
    grep -E "Duration|Tensor|Stall|stall|Issue|Warp Cycles" "$KEEP/details_$name.txt" | head -20
    wc -c "$OUT/src_$name.csv"
}

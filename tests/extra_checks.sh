#!/bin/sh
# extra_checks.sh — the checks `make test EXTRA=...` adds (CI runs EXTRA=all), each needing more
# than a C compiler. Each prints the lines of what it runs and closes with "N passed, N failed".
#
#   aarch64   the library, the command and the C tests cross-compiled with Debian's aarch64
#             toolchain and run under qemu-user: test_geometry, test_convert, test_oracle, test_api,
#             test_safetensors, test_misuse, test_kernels with the NEON kernels, and the
#             `parity --quick` cases of at most 2^24 B*Hq*Nq*Nk*D (141 of 327, every group but
#             "head dim 512"), two at a time. Left out: test_train (the trainer, not the library: over
#             15 minutes under qemu), test_kernels' generic build (the same source runs natively),
#             test_cli and test_install (shell scripts that start the binaries themselves).
#             Needs gcc-aarch64-linux-gnu, qemu-user, libjansson-dev:arm64, libyaml-dev:arm64.
#   sanitize  `make sanitize` (ASan + UBSan, build-san): the unit tests, test_misuse included,
#             test_cli, and `parity --quick`. Needs only the compiler's sanitizer runtimes.
#   portability  clang -std=c11 -Wall -Wextra -Wpedantic -Werror on every library source for
#             x86-64 and aarch64 (the kernels once per ISA), the headers alone (and winattn.h as
#             C++17), and the command's sources with the Linux and the generic platform layer
#             (-DWA_PLATFORM_GENERIC, what a macOS build compiles). Needs clang and the aarch64
#             cross headers (libc6-dev-arm64-cross).
#   fuzz      `make fuzz-check` (libFuzzer + ASan + UBSan, build-fuzz): the safetensors reader, the
#             config.json parser, the JSONL data reader and the adapter/optimizer state readers,
#             each for FUZZ_SECONDS (45) from its corpus in tests/fuzz/. Needs clang and
#             libclang-rt-*-dev. docs/fuzzing.md has the long runs.
#   cuda      the CUDA kernels and the trainer's CUDA backend compiled for every target
#             (CUDA_ARCHS=all, build-cuda; about 7 minutes on two cores) with no compiler warning
#             from the project's sources, and that build run on a machine without a GPU: `winattn
#             version` says CUDA is not available, test_api passes, and a --device cuda command
#             fails with one line and exit 1. Needs nvcc (the kernels run only on a GPU:
#             scripts/cuda_check.sh).
#
# scripts/deps.sh --extra installs what they need (.ci/run does).
# usage: sh tests/extra_checks.sh aarch64|sanitize|fuzz|portability|cuda
check=$1
pass=0 fail=0
out=$(mktemp)
trap 'rm -f "$out" "$out".*' EXIT

ok() { echo "PASS $*"; pass=$((pass + 1)); }
bad() { echo "FAIL $*"; fail=$((fail + 1)); }
# sub NAME CMD...: run a test program, show its lines, add its closing "N passed, N failed" (a
# crash or a non-zero exit without a reported failure counts as one failure)
sub() {
    name=$1; shift
    start=$(date +%s)
    "$@" >"$out" 2>&1
    rc=$?
    add "$name" "$rc" "$out" "$start"
}
add() {
    grep -E '^(PASS|FAIL|SKIP)' "$3" | grep -v '^PASS' | head -n 40
    s=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$3" | tail -n 1)
    p=$(echo "$s" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed.*/\1/p')
    f=$(echo "$s" | sed -n 's/^\([0-9]*\) passed, \([0-9]*\) failed.*/\2/p')
    if [ -z "$p" ]; then p=0 f=1; tail -n 5 "$3"; echo "FAIL $1 printed no summary (exit $2)"; fi
    if [ "$2" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; echo "FAIL $1 exited $2"; fi
    echo "-- $1: $p passed, $f failed ($(( $(date +%s) - $4 )) s)"
    pass=$((pass + p)) fail=$((fail + f))
}
build() { # build NAME MAKE-ARGS...: one PASS or FAIL line, the make output only on failure
    name=$1; shift
    start=$(date +%s)
    if make -s "$@" >"$out" 2>&1; then ok "$name ($(( $(date +%s) - start )) s)"; return 0; fi
    tail -n 20 "$out"
    bad "$name"
    return 1
}
need() { # need WHAT COMMAND: the tool is there, or one FAIL line saying what to install
    if command -v "$2" >/dev/null 2>&1; then return 0; fi
    bad "$check: $1 not found (sh scripts/deps.sh --extra installs it)"
    return 1
}

case $check in
aarch64)
    B=build-aarch64
    # No -L: the multiarch libc6:arm64 that libjansson4:arm64 brings is the one its ld.so finds
    # through /etc/ld.so.cache. `-L /usr/aarch64-linux-gnu` would pair the cross package's ld.so
    # with that libc.so.6, two glibc builds that hang in pthread_create.
    run_arm() { env -u QEMU_LD_PREFIX qemu-aarch64 "$@"; }
    if need "aarch64-linux-gnu-gcc" aarch64-linux-gnu-gcc && need "qemu-aarch64 (qemu-user)" qemu-aarch64 &&
        build "aarch64 cross build (make CC=aarch64-linux-gnu-gcc BUILD=$B)" CC=aarch64-linux-gnu-gcc BUILD=$B NO_CUDA=1 all; then
        isa=$(run_arm $B/winattn version 2>&1)
        case $isa in *"CPU kernels: neon"*) ok "aarch64 dispatch picks NEON: $isa" ;; *) bad "aarch64 dispatch: $isa" ;; esac
        isa=$(run_arm -E WINATTN_ISA=generic $B/winattn version 2>&1)
        case $isa in *"CPU kernels: generic"*) ok "aarch64 WINATTN_ISA=generic: $isa" ;; *) bad "aarch64 WINATTN_ISA=generic: $isa" ;; esac
        for t in test_geometry test_convert test_oracle test_api test_safetensors test_misuse; do
            sub "$t (aarch64)" run_arm $B/tests/$t
        done
        sub "test_kernels neon (aarch64)" run_arm -E WINATTN_ISA=neon $B/tests/test_kernels
        # parity: the --quick cases up to 2^24 B*Hq*Nq*Nk*D, one process each, two at a time
        start=$(date +%s)
        run_arm $B/winattn parity --quick --list >"$out.list" 2>&1
        awk '{ c = 1; for (i = 1; i <= NF; i++) if ($i ~ /^(B|Hq|Nq|Nk|D)=[0-9]+$/) { split($i, kv, "="); c *= kv[2] }
               if (c <= 16777216) print substr($1, 2) }' "$out.list" >"$out.ids"
        n=$(wc -l <"$out.ids")
        xargs -P 2 -I % sh -c 'env -u QEMU_LD_PREFIX qemu-aarch64 "$1"/winattn parity --case % >"$2".case.% 2>&1; echo "rc=$?" >>"$2".case.%' \
            sh "$B" "$out" <"$out.ids"
        cat "$out".case.* >"$out.all"
        grep -E '^(FAIL|PASS)' "$out.all" | grep -v '^PASS' | head -n 20
        p=$(grep -c '^1 passed, 0 failed' "$out.all")
        crashed=$(grep -c '^rc=[1-9]' "$out.all")
        f=$((n - p))
        [ "$crashed" -gt 0 ] && echo "($crashed of them exited non-zero)"
        echo "-- parity --quick, $n cases of at most 2^24 B*Hq*Nq*Nk*D (aarch64): $p passed, $f failed ($(( $(date +%s) - start )) s)"
        pass=$((pass + p)) fail=$((fail + f))
    fi
    ;;
sanitize)
    B=${SAN_BUILD:-build-san}
    if build "sanitizer build (make sanitize: ASan + UBSan, $B)" sanitize SAN_BUILD="$B"; then
        for t in test_geometry test_convert test_oracle test_api test_safetensors test_misuse test_fork test_atomic_file test_kernels; do
            sub "$t (ASan+UBSan)" $B/tests/$t
        done
        sub "test_cli (ASan+UBSan)" sh tests/test_cli.sh "$B"
        sub "parity --quick (ASan+UBSan)" $B/winattn parity --quick
    fi
    ;;
fuzz)
    B=build-fuzz
    secs=${FUZZ_SECONDS:-45}
    if need "clang" clang && build "libFuzzer build (make fuzz BUILD=$B)" fuzz BUILD=$B NO_CUDA=1; then
        # one PASS/FAIL line per target; new inputs go to $B/fuzz/found-NAME (kept between runs),
        # the corpora are read only
        make -s fuzz-check BUILD=$B NO_CUDA=1 FUZZ_SECONDS="$secs" >"$out" 2>&1
        rc=$?
        grep -vE '^(PASS|FAIL|run:) ' "$out" | head -n 20
        grep -E '^(PASS|FAIL) ' "$out" >"$out.lines"
        while read -r word rest; do
            if [ "$word" = PASS ]; then ok "$rest"; else bad "$rest"; fi
        done <"$out.lines"
        if [ $rc -ne 0 ] && ! grep -q '^FAIL ' "$out.lines"; then bad "make fuzz-check exited $rc"; fi
    fi
    ;;
cuda)
    B=build-cuda
    if need "nvcc (the CUDA toolkit)" nvcc; then
        start=$(date +%s)
        if make -j"$(nproc)" BUILD=$B CUDA_ARCHS=all all >"$out" 2>&1; then
            ok "CUDA build for every target (make CUDA_ARCHS=all BUILD=$B) ($(( $(date +%s) - start )) s)"
            # nvcc's diagnostics read 'FILE(LINE): warning #N-D: ...'; gcc's 'FILE:LINE:COL: warning: ...'
            grep -E '^(src|train|tools|formats|include)/[^ ]*(\([0-9]+\)|:[0-9]+:[0-9]+): warning' "$out" | sort -u >"$out.warn"
            if [ -s "$out.warn" ]; then head -n 10 "$out.warn"; bad "CUDA build: $(wc -l <"$out.warn") warnings from the project's sources"
            else ok "CUDA build: no warning from the project's sources"; fi
            v=$($B/winattn version 2>&1)
            case $v in *"CUDA: not available"*) ok "CUDA build without a GPU: $v" ;; *) bad "CUDA build without a GPU: winattn version says: $v" ;; esac
            sub "test_api (CUDA build, no GPU)" $B/tests/test_api
            $B/winattn bench --device cuda --n 256 >"$out" 2>&1
            rc=$?
            if [ $rc -eq 1 ] && [ "$(wc -l <"$out")" -eq 1 ]; then ok "CUDA build without a GPU: bench --device cuda: $(cat "$out")"
            else bad "CUDA build without a GPU: bench --device cuda exited $rc with: $(head -c 300 "$out")"; fi
        else
            grep -E 'error' "$out" | head -n 20
            bad "CUDA build (make CUDA_ARCHS=all BUILD=$B)"
        fi
    fi
    ;;
portability)
    # one compile: PASS, or FAIL with the first diagnostics
    cc_check() {
        name=$1; shift
        if "$@" >"$out" 2>&1; then ok "clang $name"; else head -n 6 "$out"; bad "clang $name"; fi
    }
    W="-std=c11 -Wall -Wextra -Wpedantic -Werror -ffp-contract=off -Iinclude -Isrc"
    if need "clang" clang; then
        for t in x86_64-linux-gnu aarch64-linux-gnu; do
            for f in src/winattn.c src/status.c src/overlap.c src/cpu/pool.c src/cpu/dense.c src/cuda/stub.c; do
                cc_check "$t $f" clang --target=$t $W -c $f -o /dev/null
            done
        done
        cc_check "x86_64-linux-gnu src/cpu/dispatch.c" clang --target=x86_64-linux-gnu $W -DWA_HAVE_X86_KERNELS -c src/cpu/dispatch.c -o /dev/null
        cc_check "aarch64-linux-gnu src/cpu/dispatch.c" clang --target=aarch64-linux-gnu $W -DWA_HAVE_NEON_KERNELS -c src/cpu/dispatch.c -o /dev/null
        cc_check "any target src/cpu/dispatch.c (generic only)" clang $W -c src/cpu/dispatch.c -o /dev/null
        for v in "x86_64-linux-gnu -DWA_ISA_AVX512 -DWA_BF16_DOT -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma" \
            "x86_64-linux-gnu -DWA_ISA_AVX512 -mavx512f -mavx512bw -mavx512vl -mfma" "x86_64-linux-gnu -DWA_ISA_AVX2 -mavx2 -mfma" \
            "x86_64-linux-gnu -DWA_ISA_GENERIC" "aarch64-linux-gnu -DWA_ISA_NEON" "aarch64-linux-gnu -DWA_ISA_GENERIC"; do
            set -- $v
            t=$1; shift
            cc_check "$t src/cpu/attn_cpu.c $1 $2" clang --target=$t $W "$@" -c src/cpu/attn_cpu.c -o /dev/null
        done
        for h in include/winattn.h src/status.h src/internal.h src/tile_geometry.h src/convert.h src/cpu/cpu.h; do
            echo "#include \"$h\"" >"$out.c"
            cc_check "$h alone" clang $W -I. -fsyntax-only "$out.c"
        done
        echo '#include "winattn.h"' >"$out.cpp"
        cc_check "include/winattn.h as C++17" clang++ -std=c++17 -Wall -Wextra -Wpedantic -Werror -Iinclude -fsyntax-only "$out.cpp"
        for plat in "" -DWA_PLATFORM_GENERIC; do
            for f in formats/*.c tools/*.c; do
                cc_check "$f ${plat:-(Linux platform layer)}" clang $W -Iformats -Itrain $plat -c $f -o /dev/null
            done
        done
    fi
    ;;
*)
    echo "usage: sh tests/extra_checks.sh aarch64|sanitize|fuzz|portability" >&2
    exit 2
    ;;
esac
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]

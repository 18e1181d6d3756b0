#!/bin/sh
# test_cli.sh — `winattn attn` end to end: valid inputs give the library's exact results in
# OUT; every kind of bad input gives one line on stderr, a non-zero exit, and no OUT file.
# usage: tests/test_cli.sh BUILD_DIR
BUILD=${1:-build}
W=$BUILD/winattn
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
pass=0 fail=0
ok() { echo "PASS cli $1"; pass=$((pass + 1)); }
no() { echo "FAIL cli $1"; fail=$((fail + 1)); }

"$BUILD/tests/cli_helper" gen "$T" || { echo "FAIL cli: cannot generate inputs"; echo "0 passed, 1 failed"; exit 1; }

# expect_error NAME ARGS...: non-zero exit, exactly one stderr line, no output file
expect_error() {
    name=$1; shift
    rm -f "$T/out.safetensors"
    "$W" "$@" >"$T/stdout" 2>"$T/stderr"
    rc=$?
    lines=$(wc -l <"$T/stderr")
    if [ $rc -ne 0 ] && [ $rc -lt 128 ] && [ "$lines" -eq 1 ] && [ ! -e "$T/out.safetensors" ] &&
        [ -z "$(ls "$T" | grep '\.tmp\.')" ]; then
        ok "$name -> exit $rc: $(cat "$T/stderr")"
    else
        no "$name -> exit $rc, $lines stderr lines, out exists: $([ -e "$T/out.safetensors" ] && echo yes || echo no): $(head -c 300 "$T/stderr")"
    fi
}

expect_ok() {
    name=$1 left=$2 right=$3 layout=$4; shift 4
    rm -f "$T/out.safetensors"
    if "$W" attn "$@" "$T/out.safetensors" 2>"$T/stderr" &&
        "$BUILD/tests/cli_helper" verify "$1" "$T/out.safetensors" "$left" "$right" "$layout" 2>>"$T/stderr"; then
        ok "$name"
    else
        no "$name: $(cat "$T/stderr")"
    fi
}

expect_ok "sliding window 65, bhnd, forward and backward" 64 0 bhnd "$T/ok_bhnd.safetensors" --sliding-window 65
expect_ok "window flags (30, 7), bnhd layout" 30 7 bnhd "$T/ok_bnhd.safetensors" --window-left 30 --window-right 7 --layout bnhd
expect_ok "causal, forward only (no dq in OUT)" -1 0 bhnd "$T/ok_fwd_only.safetensors" --causal
expect_ok "causal with a left window = sliding" 99 0 bhnd "$T/ok_bhnd.safetensors" --causal --window-left 99 --threads 1
expect_ok "--deterministic (a CUDA choice; the CPU backward is deterministic anyway)" 64 0 bhnd "$T/ok_bhnd.safetensors" \
    --sliding-window 65 --deterministic

expect_ok "--window-left INT64_MAX is unbounded, as in the library" -1 -1 bhnd "$T/ok_bhnd.safetensors" \
    --window-left 9223372036854775807

# OUT naming a descriptor the shell opened: written through it, so | and >> do what they say
rm -f "$T/file.safetensors"
"$W" attn "$T/ok_bhnd.safetensors" "$T/file.safetensors" --sliding-window 65 2>/dev/null
size=$(wc -c <"$T/file.safetensors")
piped=$("$W" attn "$T/ok_bhnd.safetensors" /dev/stdout --sliding-window 65 2>"$T/stderr" | wc -c)
if [ "$piped" -eq "$size" ] && [ "$size" -gt 0 ]; then ok "OUT /dev/stdout into a pipe: $piped bytes, as written to a file"
else no "OUT /dev/stdout into a pipe: $piped bytes against $size: $(cat "$T/stderr")"; fi
"$W" attn "$T/ok_bhnd.safetensors" /dev/stdout --sliding-window 65 >"$T/redirected.safetensors" 2>"$T/stderr" &&
    "$BUILD/tests/cli_helper" verify "$T/ok_bhnd.safetensors" "$T/redirected.safetensors" 64 0 bhnd 2>>"$T/stderr" &&
    ok "OUT /dev/stdout redirected to a file: the right results" || no "OUT /dev/stdout redirected: $(cat "$T/stderr")"
printf 'kept\n' >"$T/appended"
"$W" attn "$T/ok_bhnd.safetensors" /dev/stdout --sliding-window 65 >>"$T/appended" 2>"$T/stderr"
if [ "$(head -n 1 "$T/appended")" = kept ] && [ "$(wc -c <"$T/appended")" -eq $((size + 5)) ]; then
    ok "OUT /dev/stdout under >>: appended after the file's earlier line"
else no "OUT /dev/stdout under >>: $(wc -c <"$T/appended") bytes, first line '$(head -n 1 "$T/appended")'"; fi
"$W" attn "$T/ok_bhnd.safetensors" /dev/fd/9 --sliding-window 65 9>"$T/fd9.safetensors" 2>"$T/stderr" &&
    [ "$(wc -c <"$T/fd9.safetensors")" -eq "$size" ] && ok "OUT /dev/fd/9 opened by the shell" ||
    no "OUT /dev/fd/9: $(cat "$T/stderr")"

for f in bad_rank bad_dtype_mix bad_dtype_i32 bad_gqa bad_headdim bad_do_shape bad_extra_tensor bad_missing_v \
    bad_truncated bad_lying_header bad_short bad_zero_huge bad_zero_overflow; do
    expect_error "$f" attn "$T/$f.safetensors" "$T/out.safetensors"
done
expect_error "missing input file" attn "$T/nope.safetensors" "$T/out.safetensors"
expect_error "unknown flag" attn "$T/ok_bhnd.safetensors" "$T/out.safetensors" --windowleft 3
expect_error "window -2" attn "$T/ok_bhnd.safetensors" "$T/out.safetensors" --window-left -2
expect_error "window 2^63 (past INT64_MAX)" attn "$T/ok_bhnd.safetensors" "$T/out.safetensors" --window-left 9223372036854775808
grep -q 'from -1 (unbounded) to 9223372036854775807' "$T/stderr" && ok "the window's range error states the real range" ||
    no "the window's range error: $(cat "$T/stderr")"
expect_error "window not a number" attn "$T/ok_bhnd.safetensors" "$T/out.safetensors" --window-right 5x
expect_error "sliding window 0" attn "$T/ok_bhnd.safetensors" "$T/out.safetensors" --sliding-window 0
expect_error "sliding window with window-left" attn "$T/ok_bhnd.safetensors" "$T/out.safetensors" --sliding-window 8 --window-left 3
expect_error "causal with window-right 4" attn "$T/ok_bhnd.safetensors" "$T/out.safetensors" --causal --window-right 4
expect_error "bad layout" attn "$T/ok_bhnd.safetensors" "$T/out.safetensors" --layout nhd
expect_error "negative softcap" attn "$T/ok_bhnd.safetensors" "$T/out.safetensors" --softcap -3
expect_error "scale nan" attn "$T/ok_bhnd.safetensors" "$T/out.safetensors" --scale nan
expect_error "missing OUT" attn "$T/ok_bhnd.safetensors"
expect_error "OUT in a missing directory" attn "$T/ok_bhnd.safetensors" "$T/no/such/dir/out.safetensors"
expect_error "unknown command" frobnicate
expect_error "parity: unknown flag" parity --fast
expect_error "probe: unknown flag" probe --slow
expect_error "bench: unknown flag" bench --fast
expect_error "bench: bad dtype" bench --dtype f64
expect_error "bench: head dim 513" bench --d 513
expect_error "bench: GQA mismatch" bench --hq 3 --hkv 2 --n 16
expect_error "bench: --calls 0" bench --n 16 --calls 0
expect_error "bench: --calls not a number" bench --n 16 --calls many
# --calls C: each timed run makes C calls back to back; the header says so, the JSON records it
if "$W" bench --n 64 --hq 2 --hkv 1 --d 16 --reps 2 --calls 3 --json "$T/bench.json" >"$T/stdout" 2>"$T/stderr" &&
    grep -q "per call of 3 back to back" "$T/stdout" && grep -q '^| 64 |' "$T/stdout" && grep -q '"calls": 3' "$T/bench.json"; then
    ok "bench --calls 3: per-call figures of runs of three calls, recorded in the JSON"
else
    no "bench --calls 3: $(cat "$T/stdout" "$T/stderr" | head -c 300)"
fi
expect_error "parity: bad case number" parity --case -4
if "$W" version | grep -q "CUDA: available"; then
    echo "SKIP cli --device cuda without CUDA: this build has CUDA"
else
    expect_error "--device cuda without CUDA" attn "$T/ok_bhnd.safetensors" "$T/out.safetensors" --device cuda
fi

# What OUT (and a --json path) may name: a file is replaced through a temporary and rename; a
# symlink's target is replaced the same way and the link stays a link; a FIFO or a device node is
# written directly (never replaced by a file); a directory is refused with one line. Each kind for
# `attn` OUT and for `parity --case 0 --json` (the cheapest command with --json).
# leftovers DIR...: the temporaries left in DIRs (none expected)
leftovers() { for d in "$@"; do ls -a "$d" | grep '\.tmp\.'; done; }
IN=$T/ok_fwd_only.safetensors
attn_to() { "$W" attn "$IN" "$1" --causal >/dev/null 2>"$T/stderr"; }
attn_check() { "$BUILD/tests/cli_helper" verify "$IN" "$1" -1 0 bhnd 2>>"$T/stderr"; }
json_to() { "$W" parity --case 0 --json "$1" >/dev/null 2>"$T/stderr"; }
json_check() { grep -q '"passed": 1' "$1" 2>>"$T/stderr"; }
for kind in attn json; do
    mkdir -p "$T/k_$kind/tgt" "$T/k_$kind/lnk"
    K=$T/k_$kind
    # a regular file, replaced; its permission bits are kept
    echo old >"$K/file" && chmod 600 "$K/file"
    if ${kind}_to "$K/file" && ${kind}_check "$K/file" && [ "$(stat -c %a "$K/file")" = 600 ] && [ -z "$(leftovers "$K")" ]; then
        ok "$kind: an existing 0600 file is replaced and stays 0600"
    else
        no "$kind: existing file: mode $(stat -c %a "$K/file"), $(cat "$T/stderr")"
    fi
    # a relative symlink in another directory: the target is replaced, the link stays
    echo old >"$K/tgt/out" && ln -s ../tgt/out "$K/lnk/out"
    if ${kind}_to "$K/lnk/out" && [ -L "$K/lnk/out" ] && [ "$(readlink "$K/lnk/out")" = ../tgt/out ] &&
        [ -f "$K/tgt/out" ] && [ ! -L "$K/tgt/out" ] && ${kind}_check "$K/tgt/out" && [ -z "$(leftovers "$K/tgt" "$K/lnk")" ]; then
        ok "$kind: OUT a symlink -> the link stays a link, its target gets the bytes"
    else
        no "$kind: symlink: $(ls -l "$K/lnk" "$K/tgt" | tr '\n' ' ') $(cat "$T/stderr")"
    fi
    # a chain of two links ending in a missing file: the file is created, both links stay
    ln -s new "$K/tgt/mid" && ln -s ../tgt/mid "$K/lnk/chain"
    if ${kind}_to "$K/lnk/chain" && [ -L "$K/lnk/chain" ] && [ -L "$K/tgt/mid" ] && [ -f "$K/tgt/new" ] &&
        ${kind}_check "$K/tgt/new" && [ -z "$(leftovers "$K/tgt" "$K/lnk")" ]; then
        ok "$kind: OUT a dangling symlink chain -> its final target is created, the links stay"
    else
        no "$kind: dangling chain: $(ls -l "$K/lnk" "$K/tgt" | tr '\n' ' ') $(cat "$T/stderr")"
    fi
    # a FIFO: a reader gets the bytes, the FIFO stays a FIFO
    mkfifo "$K/fifo"
    cat "$K/fifo" >"$K/from_fifo" &
    reader=$!
    ${kind}_to "$K/fifo"
    wrote=$?
    # never hang: a writer that failed before opening the FIFO, or replaced it, leaves the reader waiting
    if [ $wrote -ne 0 ] && [ -p "$K/fifo" ]; then timeout 5 sh -c ': >"$1"' _ "$K/fifo" 2>/dev/null; fi
    [ -p "$K/fifo" ] || kill $reader 2>/dev/null
    if [ $wrote -eq 0 ] && wait $reader && [ -p "$K/fifo" ] && ${kind}_check "$K/from_fifo" && [ -z "$(leftovers "$K")" ]; then
        ok "$kind: OUT a FIFO -> a reader gets the bytes, the FIFO stays"
    else
        no "$kind: FIFO: $(ls -l "$K/fifo") $(cat "$T/stderr")"
    fi
    # a directory: one line, non-zero exit, the directory untouched
    mkdir "$K/dir"
    ${kind}_to "$K/dir"
    rc=$?
    if [ $rc -ne 0 ] && [ $rc -lt 128 ] && [ "$(wc -l <"$T/stderr")" -eq 1 ] && grep -q "is a directory" "$T/stderr" &&
        [ -d "$K/dir" ] && [ -z "$(ls -A "$K/dir")" ] && [ -z "$(leftovers "$K")" ]; then
        ok "$kind: OUT a directory -> exit $rc: $(cat "$T/stderr")"
    else
        no "$kind: OUT a directory -> exit $rc: $(cat "$T/stderr")"
    fi
    # a character device (the null device, made here so a regression cannot replace /dev/null)
    if [ "$(id -u)" -ne 0 ]; then
        echo "SKIP cli $kind: OUT a device node: mknod needs root"
    elif ! mknod "$K/null" c 1 3 2>/dev/null || ! (echo probe >"$K/null") 2>/dev/null; then
        echo "SKIP cli $kind: OUT a device node: cannot make or open one in $K (nodev?)"
    elif ${kind}_to "$K/null" && [ -c "$K/null" ] && [ -z "$(leftovers "$K")" ]; then
        ok "$kind: OUT a character device (null, 1:3) -> written to, stays a device"
    else
        no "$kind: OUT a device node: $(ls -l "$K/null") $(cat "$T/stderr")"
    fi
done

# train and init-model: a tiny run end to end, then bad input
FX=train/fixtures/gemma4_smoke
mkdir -p "$T/data" "$T/nodata" "$T/ple" "$T/short"
python3 - "$T/data" <<'PY' 2>/dev/null || awk 'BEGIN { for (r = 0; r < 4; r++) { printf "{\"tokens\": [2"; for (t = 0; t < 30; t++) printf ", %d", 10 + (t * 7 + r) % 23; print "]}" } }' >"$T/data/train.jsonl"
import sys
with open(sys.argv[1] + "/train.jsonl", "w") as f:
    for r in range(4):
        f.write('{"tokens": [2, ' + ", ".join(str(10 + (t * 7 + r) % 23) for t in range(30)) + "]}\n")
PY
cp "$T/data/train.jsonl" "$T/data/valid.jsonl"
if "$W" train --model $FX --data "$T/data" --iters 2 --batch-size 2 --lora-rank 4 --threads 1 --eval --out "$T/run" \
        >"$T/stdout" 2>"$T/stderr" && grep -q "^step 2/2" "$T/stdout" && grep -q "^eval after training: held-out loss" "$T/stdout" &&
    [ -s "$T/run/adapters.safetensors" ] && [ -s "$T/run/adapter_config.json" ] && [ -s "$T/run/log.jsonl" ]; then
    ok "train: 2 steps, eval, adapters + adapter_config.json + log written"
else
    no "train: $(tail -3 "$T/stdout") $(cat "$T/stderr")"
fi
if "$W" train --model $FX --data "$T/data" --eval-only --batch-size 2 --lora-rank 4 --adapters "$T/run/adapters.safetensors" \
        >"$T/stdout" 2>"$T/stderr" && grep -q "^eval: held-out loss" "$T/stdout"; then
    ok "train --eval-only from saved adapters"
else
    no "train --eval-only: $(cat "$T/stderr")"
fi
# peft's layout: its file names and config; --adapters takes the folder and reads it back
if "$W" train --model $FX --data "$T/data" --iters 2 --batch-size 2 --lora-rank 4 --threads 1 --eval \
        --adapter-format peft --out "$T/peft" >"$T/stdout" 2>"$T/stderr" && [ -s "$T/peft/adapter_model.safetensors" ] &&
    [ ! -e "$T/peft/adapters.safetensors" ] && grep -q '"peft_type": "LORA"' "$T/peft/adapter_config.json" &&
    grep -q "^saved: $T/peft/adapter_model.safetensors, adapter_config.json" "$T/stdout" &&
    want=$(sed -n 's/^eval after training: held-out loss \([0-9.]*\) .*/\1/p' "$T/stdout") &&
    "$W" train --model $FX --data "$T/data" --eval-only --batch-size 2 --adapters "$T/peft" >"$T/stdout" 2>"$T/stderr" &&
    grep -q "^eval: held-out loss $want " "$T/stdout"; then
    ok "train --adapter-format peft: adapter_model.safetensors + peft's adapter_config.json; --adapters DIR reads them back"
else
    no "train --adapter-format peft: $(tail -2 "$T/stdout") $(cat "$T/stderr")"
fi
expect_error "train: --adapter-format bogus" train --model $FX --data "$T/data" --adapter-format bogus
expect_error "train: --adapters folder without adapters" train --model $FX --data "$T/data" --eval-only --adapters "$T/data"
if "$W" init-model train/configs/demo-gemma4.json "$T/demo" --seed 3 >"$T/stdout" 2>"$T/stderr" &&
    [ -s "$T/demo/model.safetensors" ] && cmp -s train/configs/demo-gemma4.json "$T/demo/config.json"; then
    ok "init-model: seeded random checkpoint with its config"
else
    no "init-model: $(cat "$T/stderr")"
fi
sed 's/"hidden_size_per_layer_input": 0/"hidden_size_per_layer_input": 256/' train/configs/demo-gemma4.json >"$T/ple/config.json"
head -c 100 "$FX/model.safetensors" >"$T/short/model.safetensors"
cp "$FX/config.json" "$T/short/config.json"
echo '{"tokens": [2, 99999]}' >"$T/nodata/train.jsonl"
expect_error "train: no --model" train --data "$T/data"
expect_error "train: --attn bogus" train --model $FX --data "$T/data" --attn bogus
expect_error "train: model dir missing" train --model "$T/nope" --data "$T/data"
expect_error "train: --epochs with --iters" train --model $FX --data "$T/data" --epochs 1 --iters 3
expect_error "train: --lora-keys x" train --model $FX --data "$T/data" --lora-keys q,x
expect_error "train: config enables per-layer embeddings" train --model "$T/ple" --data "$T/data"
expect_error "train: truncated checkpoint" train --model "$T/short" --data "$T/data"
expect_error "train: token outside the vocabulary" train --model $FX --data "$T/nodata"
expect_error "train: no valid.jsonl for --eval" train --model $FX --data "$T/nodata" --eval-only
expect_error "train: adapters of another rank" train --model $FX --data "$T/data" --eval-only --batch-size 2 --adapters "$T/run/adapters.safetensors"
# a learning rate that blows the adapters up: one line naming the step, the last good state kept
expect_error "train: a non-finite loss stops the run" train --model $FX --data "$T/data" --iters 6 --batch-size 2 \
    --lora-rank 4 --threads 1 --lr 1e30 --out "$T/blowup"
if grep -q "^winattn train: step [0-9]*: the loss is not finite .*; stopped, the adapters and optimizer state after step [0-9]* are in $T/blowup\$" "$T/stderr" &&
    [ -s "$T/blowup/adapters.safetensors" ] && [ -s "$T/blowup/optimizer.safetensors" ]; then
    ok "train: the non-finite step named, adapters and optimizer state of the step before saved"
else
    no "train: non-finite loss: $(cat "$T/stderr"); $(ls "$T/blowup")"
fi
expect_error "init-model: config refused" init-model "$T/ple/config.json" "$T/x"
expect_error "init-model: missing OUT_DIR" init-model train/configs/demo-gemma4.json

# Every subcommand: --help and -h print its usage on stdout and exit 0; an unknown option exits 2
# with one line worded the same in each (tools/tool.c: unknown_option)
for c in attn probe probe-child parity bench train init-model version; do
    for h in --help -h; do
        "$W" $c $h >"$T/stdout" 2>"$T/stderr"
        rc=$?
        if [ $rc -eq 0 ] && head -n 1 "$T/stdout" | grep -q "^usage: winattn $c" && [ ! -s "$T/stderr" ]; then
            ok "$c $h -> exit 0, usage on stdout ($(wc -l <"$T/stdout") lines)"
        else
            no "$c $h -> exit $rc: $(head -c 200 "$T/stdout") / $(head -c 200 "$T/stderr")"
        fi
    done
    "$W" $c --no-such-option >"$T/stdout" 2>"$T/stderr"
    rc=$?
    want="winattn $c: unknown option '--no-such-option' (winattn $c --help lists the options)"
    if [ $rc -eq 2 ] && [ "$(cat "$T/stderr")" = "$want" ] && [ ! -s "$T/stdout" ]; then
        ok "$c: unknown option -> exit 2: $want"
    else
        no "$c: unknown option -> exit $rc: $(head -c 300 "$T/stderr")"
    fi
done
for h in --help -h help; do
    "$W" $h >"$T/stdout" 2>"$T/stderr"
    rc=$?
    missing=
    for c in attn probe parity bench train init-model version help; do
        grep -q "^  $c\b" "$T/stdout" || missing="$missing $c"
    done
    if [ $rc -eq 0 ] && [ -z "$missing" ] && [ ! -s "$T/stderr" ]; then
        ok "winattn $h -> exit 0, lists every command"
    else
        no "winattn $h -> exit $rc, missing:$missing"
    fi
done
"$W" help bench >"$T/help_bench" 2>&1 && "$W" bench --help >"$T/bench_help" 2>&1 && cmp -s "$T/help_bench" "$T/bench_help" &&
    ok "winattn help bench = winattn bench --help" || no "winattn help bench differs from winattn bench --help"
expect_error "help: unknown command" help frobnicate
"$W" >"$T/stdout" 2>"$T/stderr"
rc=$?
[ $rc -eq 2 ] && grep -q '^usage: winattn' "$T/stderr" && [ ! -s "$T/stdout" ] &&
    ok "no command -> exit 2, usage on stderr" || no "no command -> exit $rc"

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]

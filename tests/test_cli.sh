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
expect_error "train: --base-dtype bogus" train --model $FX --data "$T/data" --base-dtype bogus
expect_error "train: --deterministic on the CPU" train --model $FX --data "$T/data" --deterministic
expect_error "train: --precision on the CPU" train --model $FX --data "$T/data" --precision f32
expect_error "train: --base-dtype mlx4 on rows of 32 (gemma4_smoke)" train --model $FX --data "$T/data" --base-dtype mlx4
# on cuda the same refusal (or, in a build without CUDA, the missing device), in one line
expect_error "train: --base-dtype mlx4 --device cuda on rows of 32 (gemma4_smoke)" train --model $FX --data "$T/data" \
    --base-dtype mlx4 --device cuda
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

# train's mlx-lm flag names and config file (tools/train_yaml.c). --print-config shows the options
# after the file and the flags, as a config file, without loading anything: each alias must print
# what its mlx-lm name prints.
pc() { "$W" train --model $FX --data "$T/data" --print-config "$@" 2>"$T/stderr"; }
for pair in "--learning-rate --lr 3e-4 learning_rate: 0.0003" "--adapter-path --out $T/ap adapter_path: \"$T/ap\"" \
    "--steps-per-eval --eval-every 7 steps_per_eval: 7" "--num-layers --lora-layers 2 num_layers: 2" \
    "--resume-adapter-file --adapters $T/a.safetensors resume_adapter_file: \"$T/a.safetensors\"" \
    "--grad-accumulation-steps --grad-accum 3 grad_accumulation_steps: 3"; do
    set -- $pair
    new=$1 old=$2 val=$3
    shift 3
    want="$*"
    a=$(pc $new $val) && b=$(pc $old $val) && [ "$a" = "$b" ] && echo "$a" | grep -qxF "$want" &&
        ok "train: $new and its alias $old both set '$want'" || no "train: $new vs $old: $(cat "$T/stderr")"
done
for flag in "--val-batches 5|val_batches: 5" "--val-batches -1|val_batches: -1" "--save-every 10|save_every: 10" \
    "--iters 4|iters: 4" "--max-seq-length 64|max_seq_length: 64" "--mask-prompt|mask_prompt: true" "--test|test: true" \
    "--byte-tokens|byte_tokens: true" "--adapter-format peft|adapter_format: peft" "--grad-clip 1.5|grad_clip: 1.5" \
    "--base-dtype mlx4|base_dtype: mlx4" "|base_dtype: bf16" "--base-dtype nf4|base_dtype: nf4" \
    "--base-dtype fp8|base_dtype: fp8" \
    "--batch-size 2|batch_size: 2" "--seed 9|seed: 9" "--num-layers -1|num_layers: -1" "--eval-only|train: false" \
    "--optimizer adamw --weight-decay 0.05|    weight_decay: 0.05" "--lora-keys q,down|  keys: [\"self_attn.q_proj\", \"mlp.down_proj\"]" \
    "--lr-schedule cosine --warmup 3 --warmup-init 1e-7 --decay-steps 20 --lr-end 1e-6|  arguments: [1e-05, 20, 1e-06]" \
    "--lr-schedule linear --lr-end 1e-6|  name: linear_schedule" "--warmup 5|  warmup: 5"; do
    args=${flag%%|*} want=${flag#*|}
    pc $args | grep -qxF "$want" && ok "train: $args -> '$want'" || no "train: $args: $(pc $args | head -c 300) $(cat "$T/stderr")"
done
if "$W" train --model train/fixtures/gemma4_tiny --data "$T/data" --iters 1 --batch-size 2 --lora-rank 2 --threads 1 \
        --base-dtype mlx4 --out "$T/mlx4" >"$T/stdout" 2>"$T/stderr" && grep -q "^base: .*MLX's affine 4-bit" "$T/stdout" &&
    grep -q "^step 1/1" "$T/stdout"; then
    ok "train --base-dtype mlx4: one step on gemma4_tiny, the base line printed"
else
    no "train --base-dtype mlx4: $(tail -2 "$T/stdout") $(cat "$T/stderr")"
fi
for b in "nf4|bitsandbytes' NF4" "fp8|FP8 e4m3"; do
    name=${b%%|*} line=${b#*|}
    if "$W" train --model train/fixtures/gemma4_tiny --data "$T/data" --iters 1 --batch-size 2 --lora-rank 2 \
            --threads 1 --base-dtype $name --out "$T/$name" >"$T/stdout" 2>"$T/stderr" &&
        grep -q "^base: .*$line" "$T/stdout" && grep -q "^step 1/1" "$T/stdout"; then
        ok "train --base-dtype $name: one step on gemma4_tiny, the base line printed"
    else
        no "train --base-dtype $name: $(tail -2 "$T/stdout") $(cat "$T/stderr")"
    fi
done
printf 'base_dtype: mlx4\n' >"$T/base.yaml"
pc -c "$T/base.yaml" | grep -qxF "base_dtype: mlx4" && ok "train: base_dtype: mlx4 in a config file" ||
    no "train: base_dtype in a config file: $(cat "$T/stderr")"
printf 'base_dtype: nf4\n' >"$T/base-nf4.yaml"
pc -c "$T/base-nf4.yaml" | grep -qxF "base_dtype: nf4" && ok "train: base_dtype: nf4 in a config file" ||
    no "train: base_dtype: nf4 in a config file: $(cat "$T/stderr")"
printf 'base_dtype: nf8\n' >"$T/base-bad.yaml"
expect_error "train: base_dtype: nf8 in a config file" train --model $FX --data "$T/data" -c "$T/base-bad.yaml"
[ "$(pc --grad-checkpoint --steps-per-report 5 --train --fine-tune-type lora)" = "$(pc)" ] &&
    ok "train: --grad-checkpoint, --steps-per-report, --train, --fine-tune-type lora accepted, changing nothing" ||
    no "train: mlx-lm's no-op flags: $(cat "$T/stderr")"
# the learning rate as the trainer prints it, under either name
for f in --learning-rate --lr; do
    "$W" train --model $FX --data "$T/data" --iters 1 --batch-size 2 --lora-rank 4 --threads 1 --adapter-path "$T/lr-out$f" $f 3e-4 >"$T/lr$f" 2>"$T/stderr" ||
        no "train $f 3e-4: $(cat "$T/stderr")"
done
grep '^data:' "$T/lr--lr" | grep -q 'lr 0.0003 (constant)$' && [ "$(grep '^data:' "$T/lr--lr")" = "$(grep '^data:' "$T/lr--learning-rate")" ] &&
    ok "train: --learning-rate 3e-4 and --lr 3e-4 print the same data line (lr 0.0003, constant)" ||
    no "train: data lines: $(grep '^data:' "$T/lr--lr") / $(grep '^data:' "$T/lr--learning-rate")"

# SIGTERM stops a run with a checkpoint, one line and the shell's 128 + 15; --resume DIR without
# an output folder continues in DIR
"$W" train --model $FX --data "$T/data" --iters 1000000 --batch-size 2 --lora-rank 4 --threads 1 --out "$T/stopped" \
    >"$T/stop.out" 2>"$T/stop.err" &
pid=$!
for _ in $(seq 200); do grep -q "^step" "$T/stop.out" 2>/dev/null && break; sleep 0.05; done
kill -TERM $pid
wait $pid
rc=$?
[ $rc -eq 143 ] && [ "$(wc -l <"$T/stop.err")" -eq 1 ] && grep -q "^winattn train: interrupted by SIGTERM after step [0-9]* of 1000000: the checkpoint is in $T/stopped; --resume $T/stopped continues$" "$T/stop.err" &&
    [ -s "$T/stopped/trainer_state.json" ] &&
    ok "train: SIGTERM -> exit 143, one line naming the checkpoint, trainer_state.json written" ||
    no "train SIGTERM: exit $rc: $(cat "$T/stop.err")"
"$W" train --model $FX --data "$T/data" --iters 3 --batch-size 2 --lora-rank 4 --threads 1 --save-every 1 --out "$T/ck" >/dev/null 2>"$T/stderr" &&
    (wabs=$(cd "$BUILD" && pwd)/winattn && fx=$(pwd)/$FX && cd "$T" && "$wabs" train --model "$fx" --data "$T/data" --iters 3 --batch-size 2 --lora-rank 4 --threads 1 \
        --save-every 1 --resume "$T/ck" >"$T/stdout" 2>"$T/stderr") && grep -q "^saved: $T/ck/adapters.safetensors" "$T/stdout" &&
    [ ! -e "$T/adapters" ] && [ -s "$T/ck/0000003_adapters.safetensors" ] &&
    ok "train --resume DIR: continues in DIR (no ./adapters), numbered checkpoints kept (--save-every 1)" ||
    no "train --resume DIR: $(tail -2 "$T/stdout") $(cat "$T/stderr")"

# a config file with mlx-lm's keys drives a run; model and data from the file satisfy the flags
cat >"$T/run.yaml" <<EOF
# mlx-lm's keys, PyYAML's types
model: $FX
data: "$T/data"
train: true
fine_tune_type: lora
optimizer: adamw
optimizer_config:
  adamw: {betas: [0.9, 0.99], eps: 1e-6, weight_decay: 0.1}
  sgd: {}
seed: 3
num_layers: 1
batch_size: 2
iters: 1
val_batches: -1
learning_rate: 1e-5
steps_per_report: 10
steps_per_eval: 200
resume_adapter_file: null
adapter_path: $T/yrun
save_every: 100
test_batches: 100
max_seq_length: 2048
grad_checkpoint: false
lora_parameters:
  keys: ["self_attn.q_proj", v_proj]
  rank: 4
  scale: 10.0
  dropout: 0.0
lr_schedule:
  name: cosine_decay
  warmup: 0
  arguments: [3e-4, 100, 1e-7]
EOF
if "$W" train -c "$T/run.yaml" --threads 1 >"$T/stdout" 2>"$T/stderr" && grep -q "^step 1/1" "$T/stdout" &&
    grep '^data:' "$T/stdout" | grep -q 'optimizer AdamW, lr 0.0003 (cosine decay to 1e-07 over 100 updates)$' && grep -q '"rank": 4' "$T/yrun/adapter_config.json" &&
    grep -q '"self_attn.v_proj"' "$T/yrun/adapter_config.json" && ! grep -q '"self_attn.k_proj"' "$T/yrun/adapter_config.json"; then
    ok "train -c FILE: a 1-step run from mlx-lm's keys (AdamW, the schedule's lr, rank 4 on q and v, adapter_path)"
else
    no "train -c FILE: $(tail -3 "$T/stdout") $(cat "$T/stderr")"
fi
out=$("$W" train -c "$T/run.yaml" --print-config 2>"$T/stderr")
for want in "    betas: [0.9, 0.99]" "    eps: 1e-06" "    weight_decay: 0.1" "num_layers: 1" "seed: 3" "  scale: 10.0" \
    "max_seq_length: 2048" "save_every: 100"; do
    echo "$out" | grep -qxF "$want" && ok "train -c FILE: '$want'" || no "train -c FILE: no '$want': $(cat "$T/stderr")"
done
out=$("$W" train -c "$T/run.yaml" --learning-rate 5e-4 --iters 2 --adapter-path "$T/other" --optimizer adam --print-config 2>"$T/stderr")
echo "$out" | grep -qx "learning_rate: 0.0005" && echo "$out" | grep -qx "iters: 2" && echo "$out" | grep -qx "optimizer: adam" &&
    echo "$out" | grep -qxF "adapter_path: \"$T/other\"" && ! echo "$out" | grep -q "weight_decay" &&
    ok "train -c FILE: flags override the file (lr, iters, adapter path, optimizer)" || no "train -c FILE overridden: $out $(cat "$T/stderr")"
out=$("$W" train -c "$T/run.yaml" --epochs 1 --print-config 2>"$T/stderr")
echo "$out" | grep -qx "epochs: 1.0" && ! echo "$out" | grep -q "^iters" &&
    ok "train -c FILE --epochs 1: the flag replaces the file's iters" || no "train -c FILE --epochs: $out $(cat "$T/stderr")"
"$W" train -c "$T/run.yaml" --print-config >"$T/printed.yaml" 2>"$T/stderr" &&
    "$W" train -c "$T/printed.yaml" --print-config 2>>"$T/stderr" | cmp -s - "$T/printed.yaml" &&
    "$W" train -c train/configs/lora_config.yaml --print-config >"$T/sample.yaml" 2>>"$T/stderr" &&
    "$W" train -c "$T/sample.yaml" --print-config 2>>"$T/stderr" | cmp -s - "$T/sample.yaml" &&
    ok "train --print-config: what it prints reads back to the same options (and train/configs/lora_config.yaml loads)" ||
    no "train --print-config round trip: $(cat "$T/stderr")"
# the values as mlx-lm's own loader reads them (PyYAML's SafeLoader with mlx-lm's float resolver)
# equal the options the command took from the same file, key by key
if python3 -c "import yaml" 2>/dev/null; then
    for f in train/configs/lora_config.yaml "$T/run.yaml"; do
        "$W" train -c "$f" --print-config >"$T/took.yaml" 2>"$T/stderr"
        if python3 - "$f" "$T/took.yaml" >"$T/stdout" 2>&1 <<'PY'; then
import re, sys, yaml
loader = yaml.SafeLoader
loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"""^(?:
     [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))
given, took = (yaml.load(open(p), loader) for p in sys.argv[1:3])
bad = []
def same(name, a, b):
    if a != b and not (isinstance(a, (int, float)) and isinstance(b, (int, float)) and float(a) == float(b)):
        bad.append(f"{name}: mlx-lm reads {a!r}, winattn took {b!r}")
for k in ("model", "data", "seed", "batch_size", "iters", "val_batches", "steps_per_eval", "save_every", "test",
          "max_seq_length", "mask_prompt", "optimizer", "adapter_path", "resume_adapter_file", "num_layers", "grad_clip"):
    if given.get(k) is not None:
        same(k, given[k], took[k])
if "lr_schedule" not in given:
    same("learning_rate", given["learning_rate"], took["learning_rate"])
else:
    for k in ("name", "warmup", "warmup_init", "arguments"):
        same("lr_schedule." + k, given["lr_schedule"].get(k, 0), took["lr_schedule"][k])
    same("learning_rate (the schedule's first argument)", given["lr_schedule"]["arguments"][0], took["learning_rate"])
for k in ("rank", "scale"):
    same("lora_parameters." + k, given["lora_parameters"][k], took["lora_parameters"][k])
same("lora_parameters.keys", sorted(k if "." in k else ("mlp." if k in ("gate_proj", "up_proj", "down_proj") else "self_attn.") + k
                                    for k in given["lora_parameters"]["keys"]), sorted(took["lora_parameters"]["keys"]))
opt = given["optimizer"]
for k, v in given.get("optimizer_config", {}).get(opt, {}).items():
    same(f"optimizer_config.{opt}.{k}", v, took["optimizer_config"][opt][k])
print("; ".join(bad) if bad else "ok")
sys.exit(1 if bad else 0)
PY
            ok "train -c $(basename "$f"): each value as mlx-lm's YAML loader reads it"
        else
            no "train -c $f against mlx-lm's loader: $(cat "$T/stdout" "$T/stderr" | tail -3)"
        fi
    done
else
    echo "SKIP cli train -c against mlx-lm's YAML loader: no PyYAML"
fi
# train: false evaluates, as mlx-lm does without --train
printf 'model: %s\ndata: %s\ntrain: false\nbatch_size: 2\nresume_adapter_file: %s\nlora_parameters: {rank: 4}\n' \
    "$FX" "$T/data" "$T/run/adapters.safetensors" >"$T/eval.yaml"
"$W" train -c "$T/eval.yaml" >"$T/stdout" 2>"$T/stderr" && grep -q "^eval: held-out loss" "$T/stdout" && ! grep -q "^step" "$T/stdout" &&
    ok "train -c FILE with train: false: evaluation only" || no "train: false: $(cat "$T/stdout" "$T/stderr" | tail -3)"

# a config file's refusals: exit 2, one line naming the file and the key
# expect_config_error NAME WANT YAML_TEXT [FLAGS...]
expect_config_error() {
    name=$1 want=$2 text=$3
    shift 3
    if [ -n "$text" ]; then printf '%s\n' "$text" >"$T/bad.yaml"; else rm -f "$T/bad.yaml"; fi
    "$W" train -c "$T/bad.yaml" --model $FX --data "$T/data" "$@" >"$T/stdout" 2>"$T/stderr"
    rc=$?
    if [ $rc -eq 2 ] && [ "$(wc -l <"$T/stderr")" -eq 1 ] && grep -qF "$T/bad.yaml" "$T/stderr" && grep -qF -- "$want" "$T/stderr" &&
        [ ! -s "$T/stdout" ]; then
        ok "train -c: $name -> exit 2: $(cat "$T/stderr")"
    else
        no "train -c: $name -> exit $rc: $(head -c 300 "$T/stderr")"
    fi
}
expect_config_error "unknown key" "unknown key 'lerning_rate'" "lerning_rate: 1e-4"
grep -q "did you mean 'learning_rate'" "$T/stderr" && ok "train -c: the unknown key's nearest known key suggested" ||
    no "train -c: no suggestion: $(cat "$T/stderr")"
expect_config_error "unknown nested key" "unknown key 'lora_parameters.rnak'" "lora_parameters: {rnak: 4}"
expect_config_error "wrong type (string for an integer)" "batch_size: an integer" "batch_size: four"
expect_config_error "wrong type (quoted number)" "learning_rate: a number" 'learning_rate: "1e-4"'
expect_config_error "wrong type (list for a boolean)" "mask_prompt: true or false" "mask_prompt: [1]"
expect_config_error "wrong type (mapping for a path)" "data: a non-empty string" "data: {a: 1}"
expect_config_error "bad schedule name" "lr_schedule.name: 'exponential_decay'" "lr_schedule: {name: exponential_decay, arguments: [1e-4, 0.9]}"
expect_config_error "bad schedule arguments" "lr_schedule.arguments: linear_schedule takes" "lr_schedule: {name: linear_schedule, arguments: [1e-4, 100]}"
expect_config_error "schedule without arguments" "lr_schedule: needs arguments" "lr_schedule: {name: cosine_decay}"
expect_config_error "fractional decay steps" "not a whole number" "lr_schedule: {name: cosine_decay, arguments: [1e-4, 10.5]}"
expect_config_error "LoRA dropout" "lora_parameters.dropout" "lora_parameters: {dropout: 0.05}"
expect_config_error "an unknown projection" "lora_parameters.keys: 'self_attn.q_norm'" "lora_parameters: {keys: [self_attn.q_norm]}"
expect_config_error "full fine-tuning" "fine_tune_type: 'full'" "fine_tune_type: full"
expect_config_error "another optimizer" "optimizer: 'sgd'" "optimizer: sgd"
expect_config_error "weight decay under Adam" "optimizer_config.adam.weight_decay" "optimizer_config: {adam: {weight_decay: 0.1}}"
expect_config_error "report_to" "report_to: 'wandb'" "report_to: wandb"
expect_config_error "a key twice" "iters: given twice" "iters: 3
iters: 4"
expect_config_error "iters and epochs" "iters and epochs exclude each other" "iters: 3
epochs: 2"
expect_config_error "not YAML" "not YAML" "iters: [3"
expect_config_error "not a mapping" "must be a mapping" "- iters"
expect_config_error "a missing file" "cannot open the config file" ""
expect_config_error "a key with a line break, kept to one line" "unknown key 'a?b'" '"a\nb": 1'
expect_config_error "a NUL in a path" "model: the string holds a NUL character" 'model: "a\x00b"'
# flags of the schedule and the formats
expect_error "train: --lr-schedule bogus" train --model $FX --data "$T/data" --lr-schedule step
expect_error "train: --lr-end without a decay" train --model $FX --data "$T/data" --lr-end 1e-6
expect_error "train: --adapter-format bogus" train --model $FX --data "$T/data" --adapter-format gguf
expect_error "train: --fine-tune-type full" train --model $FX --data "$T/data" --fine-tune-type full
expect_error "train: --num-layers -2" train --model $FX --data "$T/data" --num-layers -2
expect_error "train: --train with --eval-only" train --model $FX --data "$T/data" --train --eval-only
"$W" train --help >"$T/stdout"
missing=
for f in -c --config --model --data --train --learning-rate --adapter-path --steps-per-eval --val-batches --save-every --iters \
    --max-seq-length --mask-prompt --grad-checkpoint --test --resume-adapter-file --num-layers --batch-size --seed \
    --grad-accumulation-steps --fine-tune-type --adapter-format --byte-tokens --grad-clip --lr-schedule --warmup --warmup-init \
    --lr-end --decay-steps --print-config; do
    grep -qe "^  $f \|, $f \| \[$f\]\| $f " "$T/stdout" || missing="$missing $f"
done
[ -z "$missing" ] && ok "train --help lists mlx-lm's flag names and the new ones" || no "train --help lacks:$missing"
# without libyaml the build stops with one line naming the package
if command -v make >/dev/null 2>&1; then
    make -s BUILD="$T/noyaml" NO_CUDA=1 YAML_LIBS=-lwinattn_no_such_yaml "$T/noyaml/tools/train_yaml.o" >"$T/stdout" 2>"$T/stderr"
    rc=$?
    [ $rc -ne 0 ] && grep -q "libyaml-dev" "$T/stderr" && [ ! -e "$T/noyaml/tools/train_yaml.o" ] &&
        ok "make without libyaml: stops, naming libyaml-dev" || no "make without libyaml -> exit $rc: $(head -c 300 "$T/stderr")"
fi

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

#!/bin/sh
# train_cuda_check.sh — the GPU trainer's checks on a CUDA machine (the H200), in one command:
#   1. build the command and tests/test_train_cuda (nvcc, cuBLAS opened at run time);
#   2. test_train_cuda: logits, loss and LoRA gradients of `--device cuda` in f32 and bf16 against
#      transformers' float64 references (train/fixtures), with the CPU model's errors beside;
#   3. training: a few steps of `winattn train` on the CPU and with `--device cuda --precision f32`
#      from the same start must print the same losses to 1e-5 relative, and lower them; the same
#      with `--base-dtype nf4` on both (the GPU keeping the base packed);
#   4. the 31B's shape, one record per step at 8,192 / 16,384 / 30,553 tokens (LENGTHS=...), with the
#      device time by phase (bench/train_gpu.py with --peers adds transformers beside it).
#   In step 2 also: the device's optimizer against the host's; in step 3 also: AdamW with clipping,
#   bias correction and gradient accumulation on both, a --device cuda run stopped by SIGTERM and
#   resumed must end with the uninterrupted run's adapters and optimizer state, byte for byte, and a
#   record longer than the device holds must be refused before the first step, nothing written.
# Usage: sh scripts/train_cuda_check.sh [quick|batch]   (quick: steps 1-3; batch: and the job-shaped
# batch). Logs go to $OUT; a PASS/FAIL summary ends the output, and the exit status is 1 on any FAIL.
# Machines without libjansson-dev or libyaml-dev: carry Debian's package unpacked in .devdeps (see
# scripts/cuda_check.sh). SM=90a (default) builds the CUDA code for that GPU only, to save time;
# SM=all builds what `make` ships; PREBUILT=1 uses the binaries already in $BUILD.
set -e
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
J=.devdeps/usr
MK="make -j16 BUILD=$BUILD"
[ -d "$J" ] && MK="$MK JANSSON_CFLAGS=-I$J/include JANSSON_LIBS=$J/lib/x86_64-linux-gnu/libjansson.a"
[ -f "$J/include/yaml.h" ] && MK="$MK YAML_CFLAGS=-I$J/include YAML_LIBS=$J/lib/x86_64-linux-gnu/libyaml.a"
# PREBUILT=1: $BUILD/winattn and $BUILD/tests/test_train_cuda were built elsewhere (make BUILD=...
# CUDA_ARCHS=90a on a machine with nvcc), which saves the GPU machine the build
if [ -n "${PREBUILT:-}" ]; then
    [ -x "$BUILD/winattn" ] && [ -x "$BUILD/tests/test_train_cuda" ] || { echo "PREBUILT: no binaries in $BUILD"; exit 1; }
# the trainer's objects are cheap: rebuild them always (a copied tree's times may predate them)
elif ! rm -rf "$BUILD/train" "$BUILD/tools" "$BUILD/tests"; then exit 1
elif [ "${SM:-90a}" != all ]; then
    $MK NVCCFLAGS="-O3 -lineinfo -gencode=arch=compute_${SM:-90a},code=sm_${SM:-90a} -Xcompiler -fPIC -Iinclude -std=c++17" \
        "$BUILD/winattn" "$BUILD/tests/test_train_cuda" >"$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
else
    $MK "$BUILD/winattn" "$BUILD/tests/test_train_cuda" >"$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
fi
nvidia-smi -L

# every check ends in one PASS or FAIL line, gathered in $OUT/summary.txt and printed at the end
: >"$OUT/summary.txt"
result() { echo "$*" | tee -a "$OUT/summary.txt"; }
summary() {
    echo "== summary"
    cat "$OUT/summary.txt"
    if grep -q '^FAIL' "$OUT/summary.txt"; then echo "FAIL: $(grep -c '^FAIL' "$OUT/summary.txt") check(s)"; exit 1; fi
    echo "PASS: all $(grep -c '^PASS' "$OUT/summary.txt") checks"
    exit 0
}
# train NAME ARGS...: winattn train, its output in $OUT/steps_NAME.txt; a failure is a FAIL line
train() {
    name=$1
    shift
    if "$BUILD/winattn" train "$@" >"$OUT/steps_$name.txt" 2>&1; then return 0; fi
    result "FAIL training run $name: $(tail -1 "$OUT/steps_$name.txt")"
    return 1
}

# losses_agree HEADER MESSAGE TABLE RUN_A RUN_B [RUN...]: the losses of steps_RUN_A.txt and
# steps_RUN_B.txt equal to 1e-5 relative at every step and RUN_B's falling, over 4 steps or more;
# further runs are shown beside them. The table goes to $OUT/TABLE, its last line to the summary.
losses_agree() {
    header=$1 msg=$2 table=$3
    shift 3
    files=""
    for f in "$@"; do
        grep -o 'loss [0-9.]*' "$OUT/steps_$f.txt" | awk '{print $2}' >"$OUT/loss_$f.txt"
        files="$files $OUT/loss_$f.txt"
    done
    # shellcheck disable=SC2086 # one argument per run
    paste $files | awk -v header="$header" -v msg="$msg" '
        BEGIN { ok = 1; print header }
        { d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > 1e-5) ok = 0
          line = sprintf("%-5d", NR)
          for (i = 1; i <= NF; i++) line = line sprintf(i < NF ? " %-9s" : " %s", $i)
          print line
          if (NR > 1 && !($2 < prev)) ok = 0; prev = $2 }
        END { if (NR < 4) ok = 0
              print (ok ? "PASS" : "FAIL") msg NR " steps" }' |
        tee "$OUT/$table" | sed '$d'
    result "$(tail -1 "$OUT/$table")"
}
echo "== test_train_cuda (GPU model vs transformers float64, CPU float beside; the device's optimizer vs the host's)"
if "$BUILD/tests/test_train_cuda" train/fixtures >"$OUT/test_train_cuda.txt" 2>&1 &&
    ! grep -q skipped "$OUT/test_train_cuda.txt"; then
    cat "$OUT/test_train_cuda.txt"
    result "PASS test_train_cuda: $(tail -1 "$OUT/test_train_cuda.txt")"
else
    cat "$OUT/test_train_cuda.txt"
    result "FAIL test_train_cuda: $(tail -1 "$OUT/test_train_cuda.txt")"
fi
echo "== transformers in bf16 on the same fixtures (the yardstick of the bf16 bounds)"
python3 train/fixtures/bf16_reference.py 2>&1 | tail -3

echo "== a few training steps: CPU vs --device cuda --precision f32"
data=$(mktemp -d)
# four records, batch 4: every step trains the same batch, so the loss must fall
python3 - "$data" <<'EOF'
import json, random, sys
random.seed(3)
for name, n in (("train", 4), ("valid", 4)):
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"tokens": [2] + [random.randrange(3, 256) for _ in range(random.randint(40, 200))]}) + "\n")
EOF
common="--model train/fixtures/gemma4_smoke --data $data --iters 4 --batch-size 4 --lr 5e-4 --lora-rank 4 --seed 5"
if train cpu $common --device cpu --adapter-path "$OUT/run_cpu" &&
    train cuda_f32 $common --device cuda --precision f32 --adapter-path "$OUT/run_cuda_f32" &&
    train cuda_bf16 $common --device cuda --adapter-path "$OUT/run_cuda_bf16"; then
    losses_agree "step  cpu       cuda f32  cuda bf16" " f32 losses equal to 1e-5 relative and falling at every one of " \
        loss_table.txt cpu cuda_f32 cuda_bf16
fi

echo "== a few training steps on an nf4 base: --device cpu vs --device cuda --precision f32, both --base-dtype nf4"
# the CPU dequantizes the NF4 codes to f32 at load, the GPU keeps them packed and dequantizes a layer
# at a time; from the same codes (train/quant.c quantizes for both) the f32 losses agree as above
if train nf4_cpu $common --device cpu --base-dtype nf4 --adapter-path "$OUT/run_nf4_cpu" &&
    train nf4_cuda_f32 $common --device cuda --precision f32 --base-dtype nf4 --adapter-path "$OUT/run_nf4_cuda_f32"
then
    losses_agree "step  cpu nf4   cuda f32 nf4" \
        " nf4 base: the GPU f32 losses equal to the CPU ones to 1e-5 relative and falling at every one of " \
        loss_table_nf4.txt nf4_cpu nf4_cuda_f32
fi

echo "== AdamW with clipping, bias correction and gradient accumulation: CPU vs --device cuda --precision f32"
# --grad-clip 1e-4 sits below these gradients' norm, so every update clips; the losses must agree
# as in the check above (1e-5) and the logged norms (log.jsonl, 9 digits) to 1e-4: f32 gradients
# of two devices, a few updates apart from the start
opts="--model train/fixtures/gemma4_smoke --data $data --iters 6 --batch-size 2 --grad-accumulation-steps 2 --lr 5e-4
      --lora-rank 4 --seed 7 --optimizer adamw --weight-decay 0.1 --bias-correction --grad-clip 1e-4"
if train adamw_cpu $opts --device cpu --adapter-path "$OUT/adamw_cpu" &&
    train adamw_cuda_f32 $opts --device cuda --precision f32 --adapter-path "$OUT/adamw_cuda_f32"; then
    result "$(python3 - "$OUT/adamw_cpu/log.jsonl" "$OUT/adamw_cuda_f32/log.jsonl" <<'EOF'
import json, sys
runs = [[json.loads(l) for l in open(p) if '"step"' in l] for p in sys.argv[1:]]
cpu, gpu = runs
worst_loss = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(cpu, gpu))
norms = [(a["grad_norm"], b["grad_norm"]) for a, b in zip(cpu, gpu) if "grad_norm" in a and "grad_norm" in b]
worst_norm = max(abs(a - b) / a for a, b in norms) if norms else float("inf")
clipped = all(a > 1e-4 for a, _ in norms)
ok = len(cpu) == len(gpu) == 6 and len(norms) == 3 and worst_loss <= 1e-5 and worst_norm <= 1e-4 and clipped
print(f"{'PASS' if ok else 'FAIL'} AdamW, clipped, bias-corrected, 2 batches per update: {len(gpu)} steps, "
      f"{len(norms)} updates; losses agree to {worst_loss:.1e} (tol 1e-5), grad norms to {worst_norm:.1e} (tol 1e-4)"
      f"{'' if clipped else '; a norm was below the clip: lower --grad-clip'}")
EOF
)"
fi

echo "== --device cuda stopped by SIGTERM and resumed: the same final adapters as an uninterrupted run"
# the device holds the adapters and Adam's moments: the checkpoint of the stop must carry them
# whole. f32: its attention (the portable kernels) and products are bit-identical run to run; bf16's
# backward adds dQ atomically by default (wa_context_params.cuda_deterministic), so two bf16 runs
# may differ in the last bits whether or not one was stopped
resume_opts="--model train/fixtures/gemma4_smoke --data $data --iters ${RESUME_ITERS:-60} --batch-size 2
             --grad-accumulation-steps 2 --lr 5e-4 --lora-rank 4 --seed 11 --optimizer adamw --grad-clip 1e-4
             --save-every 5 --device cuda --precision f32"
if train whole $resume_opts --adapter-path "$OUT/resume_whole"; then
    "$BUILD/winattn" train $resume_opts --adapter-path "$OUT/resume_cut" >"$OUT/steps_cut.txt" 2>&1 &
    pid=$!
    # SIGTERM once the run has trained a few steps (the stop handlers are in place by then)
    while kill -0 $pid 2>/dev/null && ! grep -q '^step 3/' "$OUT/steps_cut.txt"; do sleep 0.02; done
    kill -TERM $pid 2>/dev/null || true
    rc=0
    wait $pid || rc=$?
    if [ $rc -ne 143 ]; then
        result "FAIL resume: the run to stop exited $rc, not 143 (SIGTERM) ($(tail -1 "$OUT/steps_cut.txt")): it may" \
               "have finished before the signal; raise RESUME_ITERS"
    elif train resumed $resume_opts --adapter-path "$OUT/resume_cut" --resume "$OUT/resume_cut"; then
        stopped=$(grep -o 'interrupted by SIGTERM [a-z]* step [0-9]*' "$OUT/steps_cut.txt" | head -1)
        if cmp "$OUT/resume_whole/adapters.safetensors" "$OUT/resume_cut/adapters.safetensors" &&
            cmp "$OUT/resume_whole/optimizer.safetensors" "$OUT/resume_cut/optimizer.safetensors"; then
            result "PASS resume: stopped by SIGTERM ($stopped), resumed: adapters.safetensors and" \
                   "optimizer.safetensors equal to the uninterrupted run's, byte for byte"
        else
            result "FAIL resume: stopped by SIGTERM ($stopped), resumed: the final adapters or optimizer state" \
                   "differ from the uninterrupted run's"
        fi
    fi
fi
rm -rf "$data"

echo "== a record longer than the device holds: refused before the first step, nothing written"
# one layer with a 262,144-wide MLP (0.4 GB of weights, drawn on the device): some 3 MB of
# activations a token, so the 200,001-token record, the second of the batch, needs several hundred
# GB, more than one GPU has; the 4-token record beside it fits
big=$(mktemp -d)
python3 - "$big" <<'EOF'
import json, os, sys
cfg = json.load(open("train/configs/demo-gemma4.json"))
cfg.update(hidden_size=256, intermediate_size=262144, num_hidden_layers=1, layer_types=["full_attention"])
os.makedirs(f"{sys.argv[1]}/model")
os.makedirs(f"{sys.argv[1]}/data")
json.dump(cfg, open(f"{sys.argv[1]}/model/config.json", "w"))
with open(f"{sys.argv[1]}/data/train.jsonl", "w") as f:
    f.write(json.dumps({"tokens": [2, 5, 6, 7]}) + "\n")
    f.write(json.dumps({"tokens": [2] + [3 + i % 250 for i in range(200000)]}) + "\n")
EOF
rc=0
"$BUILD/winattn" train --model "$big/model" --data "$big/data" --init-random 0 --device cuda --iters 1 \
    --batch-size 2 --adapter-path "$big/adapters" >"$OUT/steps_too_long.txt" 2>&1 || rc=$?
refusal=$(tail -1 "$OUT/steps_too_long.txt")
want="winattn train: the longest record (200001 tokens, record 2 of $big/data/train.jsonl) needs more device memory"
if [ $rc -eq 1 ] && [ "${refusal#"$want"}" != "$refusal" ] && [ ! -e "$big/adapters" ] &&
    ! grep -q '^step ' "$OUT/steps_too_long.txt"; then
    result "PASS a record longer than the device holds: exit $rc before the first step, no output folder: $refusal"
else
    result "FAIL a record longer than the device holds: exit $rc, output folder $(ls -d "$big/adapters" 2>/dev/null ||
        echo absent), last line: $refusal"
fi
rm -rf "$big"
[ "${1:-}" = quick ] && summary

echo "== a batch of the job's shape: 31B, records of 30,553 + 9,000 + 4,000 + 1,200 tokens, batch 4"
python3 bench/train_gpu.py --winattn "$BUILD/winattn" --batch 30553,9000,4000,1200 --steps 2 --peers none
[ "${1:-}" = batch ] && summary
echo "== the 31B's shape, --device cuda alone, device time by phase (bench/train_gpu.py runs the peers too)"
WINATTN_TRAIN_PROFILE=1 python3 bench/train_gpu.py --winattn "$BUILD/winattn" --lengths ${LENGTHS:-8192,16384,30553} \
    --steps 3 --peers none
summary

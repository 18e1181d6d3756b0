#!/bin/sh
# train_cuda_check.sh — the GPU trainer's checks on a CUDA machine (the H200), in one command:
#   1. build the command and tests/test_train_cuda (nvcc, cuBLAS opened at run time);
#   2. test_train_cuda: logits, loss and LoRA gradients of `--device cuda` in f32 and bf16 against
#      transformers' float64 references (train/fixtures), with the CPU model's errors beside;
#   3. training: a few steps of `winattn train` on the CPU and with `--device cuda --precision f32`
#      from the same start must print the same losses to 1e-5 relative, and lower them;
#   4. the 31B's shape, one record per step at 8,192 / 16,384 / 30,553 tokens (LENGTHS=...), with the
#      device time by phase (bench/train_gpu.py with --peers adds transformers beside it).
# Usage: sh scripts/train_cuda_check.sh [quick|batch]   (quick: steps 1-3; batch: and the job-shaped
# batch). Logs go to $OUT.
# Machines without libjansson-dev or libyaml-dev: carry Debian's package unpacked in .devdeps (see
# scripts/cuda_check.sh). SM=90a (default) builds the CUDA code for that GPU only, to save time;
# SM=all builds what `make` ships.
set -e
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
J=.devdeps/usr
MK="make -j16 BUILD=$BUILD"
[ -d "$J" ] && MK="$MK JANSSON_CFLAGS=-I$J/include JANSSON_LIBS=$J/lib/x86_64-linux-gnu/libjansson.a"
[ -f "$J/include/yaml.h" ] && MK="$MK YAML_CFLAGS=-I$J/include YAML_LIBS=$J/lib/x86_64-linux-gnu/libyaml.a"
# the trainer's objects are cheap: rebuild them always (a copied tree's times may predate them)
rm -rf "$BUILD/train" "$BUILD/tools" "$BUILD/tests"
if [ "${SM:-90a}" != all ]; then
    $MK NVCCFLAGS="-O3 -lineinfo -gencode=arch=compute_${SM:-90a},code=sm_${SM:-90a} -Xcompiler -fPIC -Iinclude -std=c++17" \
        "$BUILD/winattn" "$BUILD/tests/test_train_cuda" >"$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
else
    $MK "$BUILD/winattn" "$BUILD/tests/test_train_cuda" >"$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
fi
nvidia-smi -L

echo "== test_train_cuda (GPU model vs transformers float64, CPU float beside)"
"$BUILD/tests/test_train_cuda" train/fixtures 2>&1 | tee "$OUT/test_train_cuda.txt"
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
"$BUILD/winattn" train $common --device cpu --adapter-path "$OUT/run_cpu" >"$OUT/steps_cpu.txt" 2>&1
"$BUILD/winattn" train $common --device cuda --precision f32 --adapter-path "$OUT/run_cuda_f32" >"$OUT/steps_cuda_f32.txt" 2>&1
"$BUILD/winattn" train $common --device cuda --adapter-path "$OUT/run_cuda_bf16" >"$OUT/steps_cuda_bf16.txt" 2>&1
for f in cpu cuda_f32 cuda_bf16; do grep -o 'loss [0-9.]*' "$OUT/steps_$f.txt" | awk '{print $2}' >"$OUT/loss_$f.txt"; done
paste "$OUT/loss_cpu.txt" "$OUT/loss_cuda_f32.txt" "$OUT/loss_cuda_bf16.txt" | awk '
    BEGIN { ok = 1; print "step  cpu       cuda f32  cuda bf16" }
    { d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > 1e-5) ok = 0
      printf "%-5d %-9s %-9s %s\n", NR, $1, $2, $3; if (NR > 1 && !($2 < prev)) ok = 0; prev = $2 }
    END { if (NR < 4) ok = 0
          print (ok ? "PASS" : "FAIL") " f32 losses equal to 1e-5 relative and falling at every one of " NR " steps" }'
rm -rf "$data"
[ "${1:-}" = quick ] && exit 0

echo "== a batch of the job's shape: 31B, records of 30,553 + 9,000 + 4,000 + 1,200 tokens, batch 4"
python3 bench/train_gpu.py --winattn "$BUILD/winattn" --batch 30553,9000,4000,1200 --steps 2 --peers none
[ "${1:-}" = batch ] && exit 0
echo "== the 31B's shape, --device cuda alone, device time by phase (bench/train_gpu.py runs the peers too)"
WINATTN_TRAIN_PROFILE=1 python3 bench/train_gpu.py --winattn "$BUILD/winattn" --lengths ${LENGTHS:-8192,16384,30553} \
    --steps 3 --peers none

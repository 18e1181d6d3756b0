#!/bin/sh
# demo.sh — `make demo`: build the long-document corpus (Debian's python3.11-doc, see
# train/corpus), make a small random Gemma-4-shaped checkpoint (no pretrained weights are
# reachable offline), and fine-tune LoRA adapters on it through winattn's kernels for a few
# minutes, with the held-out loss before, during and after. The full comparison of the three
# attention arms is in docs/train.md.
set -e
BUILD=${1:-build}
python3 train/corpus/build_corpus.py --out data/corpus
[ -f data/demo-model/model.safetensors ] ||
    "$BUILD/winattn" init-model train/configs/demo-gemma4.json data/demo-model --seed 1
"$BUILD/winattn" train --model data/demo-model --data data/corpus --attn fused --iters 16 --max-seq-length 4096 \
    --lora-rank 8 --lr 2e-4 --eval-every 8 --eval --out data/demo-run

#!/bin/sh
# forms_agree.sh — whether builds of the forward agree bit for bit on shapes far larger than the
# parity sweep's (whose cases fit one work item per CTA, so a persistent CTA's later items, the
# ring's phases across them and the staged epilogue's reuse are not reached there), on the GPU
# machine, from the repository root, after the builds exist (fwd_variants.sh or prebuild.sh):
#   sh dev/cuda/forms_agree.sh build build-NAME ...
# Each shape's q, k, v (torch.randn, bf16, seed 0) go to one safetensors file; every build runs
# `winattn attn IN OUT --device cuda` on it, and each build's o and lse are compared with the first
# build's: "identical", or the largest difference. Shapes: (a) 8K (Hq 32, Hkv 16, D 256, window
# 1024), 16 times the SMs' count of items; a ragged causal one (B 2, N 3000, Hq 8, Hkv 2, D 256);
# (b) 8K (Hq 32, Hkv 8, D 128, window 4096); D = 64 with a two-sided window (B 3, N 2500); three
# small ones (D = 256, 128 and 64) that still have more items than a H200's 132 SMs (N 1100, Hq
# 20: 180), which also run under compute-sanitizer's memcheck and racecheck in the builds SANITIZE
# names ("build build-NAME").
[ $# -ge 2 ] || { echo "usage: sh dev/cuda/forms_agree.sh BUILD BUILD..."; exit 2; }
dir=${TMPDIR:-/tmp}/forms_agree
mkdir -p "$dir"
while read -r name b n hq hkv d opts; do
    [ -n "$name" ] || continue
    python3 - "$dir/$name.in" "$b" "$n" "$hq" "$hkv" "$d" <<'PY' || exit 1
import sys, torch
from safetensors.torch import save_file
path, b, n, hq, hkv, d = sys.argv[1], *map(int, sys.argv[2:])
g = torch.Generator().manual_seed(0)
t = {x: torch.randn(b, h, n, d, generator=g).to(torch.bfloat16) for x, h in (("q", hq), ("k", hkv), ("v", hkv))}
save_file(t, path)
PY
    first=
    for build in "$@"; do
        out="$dir/$name.$(basename "$build").out"
        "$build/winattn" attn "$dir/$name.in" "$out" --device cuda $opts </dev/null >/dev/null || { echo "$name $build: winattn attn failed"; continue; }
        case "$name ${SANITIZE:-} " in small*" $build "*)
            for tool in memcheck racecheck; do
                echo "$name $build $tool: $(compute-sanitizer --tool $tool --error-exitcode 9 "$build/winattn" attn "$dir/$name.in" \
                    "$dir/$name.san" --device cuda $opts </dev/null 2>&1 | grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' | sed 's/^=* *//')"
            done ;;
        esac
        if [ -z "$first" ]; then first=$out; continue; fi
        python3 - "$first" "$out" "$name" "$build" <<'PY'
import sys
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
res = []
for key in ("o", "lse"):
    x, y = a[key].float(), b[key].float()
    res.append("%s %s" % (key, "identical" if a[key].equal(b[key]) else "max diff %.3g" % (x - y).abs().nan_to_num().max().item()))
print("%-8s %-16s %s" % (sys.argv[3], sys.argv[4], ", ".join(res)))
PY
    done
    rm -f "$dir/$name".*
done <<'SHAPES'
a8k 1 8192 32 16 256 --sliding-window 1024
ragged 2 3000 8 2 256 --causal
b8k 1 8192 32 8 128 --sliding-window 4096
d64 3 2500 8 4 64 --window-left 300 --window-right 40
small256 1 1100 20 4 256 --sliding-window 300
small128 1 1100 20 4 128 --window-left 500 --window-right 30
small64 1 1100 20 4 64 --window-left 200 --window-right 20
SHAPES

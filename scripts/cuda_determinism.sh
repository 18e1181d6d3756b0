#!/bin/sh
# cuda_determinism.sh — whether the deterministic backward is deterministic, and whether two builds
# compute the same bits. On a CUDA machine, from the repository root, after each build exists
# (`make BUILD=DIR`; needs torch and safetensors for the inputs and the comparison):
#   sh scripts/cuda_determinism.sh BUILD [BUILD...]
# Each shape's q, k, v and do (torch.randn, bf16, seed 0) go to one safetensors file; each build
# runs `winattn attn IN OUT --device cuda --deterministic` three times and once without
# --deterministic (the fused form, dQ added in whatever order the adds land). Per shape and build:
# whether the three deterministic runs' dq, dk, dv are bit-identical, and the largest difference of
# the deterministic dq from the fused form's (both are sums of the same bf16 products in another
# order: a few ulps of f32 before the rounding to bf16). Shapes at D = 64 and 128, where the default
# form adds dQ by reduce-adds: (b) 8K (Hq 32, Hkv 8, window 4096), causal with a ragged last tile
# (B 2, N 3000, Hq 8, Hkv 2), D = 64 with a two-sided window (B 3, N 2500, Hq 8, Hkv 4), and a
# rectangular one with more keys than queries (Nq 1000, Nk 2600, window 700 left, 20 right).
# With more than one build, each later build's outputs are also compared with the first's: the
# deterministic form's o, dq, dk, dv and the fused form's o, dk, dv (its dq varies run to run)
# bit for bit, for a change meant to leave the arithmetic alone (a refactoring: build the tree
# before it into one folder and after it into another).
[ $# -ge 1 ] || { echo "usage: sh scripts/cuda_determinism.sh BUILD [BUILD...]"; exit 2; }
dir=${TMPDIR:-/tmp}/cuda_determinism
mkdir -p "$dir"
while read -r name b nq nk hq hkv d opts; do
    [ -n "$name" ] || continue
    python3 - "$dir/$name.in" "$b" "$nq" "$nk" "$hq" "$hkv" "$d" <<'PY' || exit 1
import sys, torch
from safetensors.torch import save_file
path, b, nq, nk, hq, hkv, d = sys.argv[1], *map(int, sys.argv[2:])
g = torch.Generator().manual_seed(0)
shapes = {"q": (b, hq, nq, d), "k": (b, hkv, nk, d), "v": (b, hkv, nk, d), "do": (b, hq, nq, d)}
save_file({x: torch.randn(*s, generator=g).to(torch.bfloat16) for x, s in shapes.items()}, path)
PY
    rm -f "$dir/$name".first.*
    for build in "$@"; do
        ok=1
        for r in 1 2 3; do
            "$build/winattn" attn "$dir/$name.in" "$dir/$name.det$r" --device cuda --deterministic $opts </dev/null >/dev/null || ok=0
        done
        "$build/winattn" attn "$dir/$name.in" "$dir/$name.fused" --device cuda $opts </dev/null >/dev/null || ok=0
        [ $ok = 1 ] || { echo "$name $build: winattn attn failed"; continue; }
        python3 - "$dir/$name" "$name" "$build" "$1" <<'PY'
import os, sys
from safetensors.torch import load_file
base, name, build, first = sys.argv[1:]
runs = [load_file("%s.det%d" % (base, r)) for r in (1, 2, 3)]
fused = load_file(base + ".fused")
same = all(runs[0][k].equal(x[k]) for x in runs[1:] for k in ("dq", "dk", "dv"))
dq = (runs[0]["dq"].float() - fused["dq"].float()).abs().max().item()
scale = fused["dq"].float().abs().max().item()
against = ""
if build != first and not os.path.exists(base + ".first.det"):
    against = "; against %s: not compared (its runs failed)" % first
elif build != first:
    f_det, f_fused = load_file(base + ".first.det"), load_file(base + ".first.fused")
    keys = [k for k in ("o", "dq", "dk", "dv") if k in f_det]
    det_same = all(f_det[k].equal(runs[0][k]) for k in keys)
    fused_same = all(f_fused[k].equal(fused[k]) for k in keys if k != "dq")
    against = "; against %s: deterministic %s, fused (no dq) %s" % (
        first, "bit-identical" if det_same else "DIFFERENT", "bit-identical" if fused_same else "DIFFERENT")
print("%-10s %-12s deterministic x3: %s; dq vs the fused form: max diff %.3g (max |dq| %.3g)%s"
      % (name, build, "bit-identical" if same else "DIFFERENT", dq, scale, against))
PY
        if [ "$build" = "$1" ]; then
            cp "$dir/$name.det1" "$dir/$name.first.det" && cp "$dir/$name.fused" "$dir/$name.first.fused"
        fi
    done
    rm -f "$dir/$name".*
done <<'SHAPES'
b8k 1 8192 8192 32 8 128 --sliding-window 4096
causal128 2 3000 3000 8 2 128 --causal
d64 3 2500 2500 8 4 64 --window-left 300 --window-right 40
rect128 2 1000 2600 8 2 128 --window-left 700 --window-right 20
SHAPES

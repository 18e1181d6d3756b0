#!/bin/sh
# instruction_ablations.sh — the instruction-count changes to versions 4 and 5 against the tree
# before them, and one build per change undone; on the H200, from the repository root
# (DEPS=.devdeps; .lab-base carried: `git archive` of the base commit, 724b3f4, made by the caller):
#   build       this tree: the masked and unmasked softmax/probability steps compiled apart
#               (edge_form), the unmasked key tiles worked out once per warpgroup
#               (wa_unmasked_key_tiles), descriptors moved on by constant offsets (desc_at), the
#               folded softmax (FFMA), CTAs in heaviest-first order across heads (heaviest_first);
#   build-base  commit 724b3f4, for the same-run comparison;
#   build-nosplit / -headmajor / -nofold   this tree with one change undone each
#               (-DWA_NO_EDGE_SPLIT, -DWA_HEAD_MAJOR_ORDER, -DWA_SOFTMAX_NO_FOLD).
# Ran on the tree committed as e17e04c, before the forward's grid order was settled (docs/cuda.md,
# "Instruction issue"); since then the order is a template argument of heaviest_first and
# -DWA_HEAD_MAJOR_ORDER no longer exists.
# Checks on `build`: kernel tests, the full parity sweep, --quick with --deterministic and on
# version 2. Then `winattn bench` at (b) 8K/32K (two rounds), (a) 8K, D = 64 16K and (c) 8K.
LAB_KEEP=1
. dev/cuda/lab_env.sh
(lab_build build "") &
(cd .lab-base && OUT=$OUT lab_build build-base "" build-base/winattn) &
wait
[ -x build/winattn ] && [ -x .lab-base/build-base/winattn ] || exit 1
for v in nosplit:-DWA_NO_EDGE_SPLIT headmajor:-DWA_HEAD_MAJOR_ORDER nofold:-DWA_SOFTMAX_NO_FOLD; do
    name=build-${v%%:*} def=${v#*:}
    rm -rf "$name" && cp -r build "$name" && rm -f "$name"/src/cuda/*.o "$name"/libwinattn.* "$name"/winattn
    (lab_build "$name" "$def" "$name/winattn") &
done
wait
echo "built in $(($(date +%s) - t0)) s"

echo "== checks (build)"
timeout 120 build/tests/test_kernels >"$OUT/test_kernels.txt" 2>&1; tail -1 "$OUT/test_kernels.txt"
timeout 300 build/winattn parity --device cuda --threads 16 >"$OUT/parity.txt" 2>&1; grep '^FAIL' "$OUT/parity.txt" | head -5; tail -1 "$OUT/parity.txt"
timeout 120 build/winattn parity --device cuda --threads 16 --quick --deterministic | tail -1
WINATTN_CUDA=mma timeout 120 build/winattn parity --device cuda --threads 16 --quick | tail -1
echo "== checks done at $(($(date +%s) - t0)) s"

W="build/winattn .lab-base/build-base/winattn build-nosplit/winattn build-headmajor/winattn build-nofold/winattn"
B="--device cuda --reps 5"
for round in 1 2; do
    for w in $W; do
        echo "== $w round $round: (b) 8K / 32K (fwd, bwd TFLOP/s)"
        timeout 90 $w bench $B --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
    done
done
for w in build/winattn .lab-base/build-base/winattn build-nofold/winattn build-headmajor/winattn; do
    echo "== $w: (a) 8K, D64 16K, (c) 8K"
    timeout 60 $w bench $B --n 8192 | tail -1
    timeout 60 $w bench $B --n 16384 --d 64 --hkv 8 --sliding-window 1024 | tail -1
    timeout 120 $w bench $B --n 8192 --d 512 --hq 32 --hkv 4 --causal | tail -1
done
cp "$OUT/parity.txt" "$KEEP/" 2>/dev/null
echo "total $(($(date +%s) - t0)) s"

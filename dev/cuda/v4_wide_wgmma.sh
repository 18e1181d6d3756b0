#!/bin/sh
# v4_wide_wgmma.sh — version 4 with one wide wgmma per 16 rows of the MN-major operand (default)
# against the narrow per-column-block form (-DWA_NARROW_MN): quick parity on the default, forward
# and backward timings of both at (a), (b) and D = 64, then the full parity sweep of the default.
# -DWA_NARROW_MN was last honoured by commit 724b3f4 (e17e04c moved the products to desc_at, and
# 44c8ed2 removed the narrow form): run it in a worktree of 724b3f4, where it is lab_wide.sh.
#   DEPS=.devdeps sh dev/cuda/v4_wide_wgmma.sh
OUT=${OUT:-/tmp/out}
DEPS=${DEPS:-.devdeps}
J="JANSSON_CFLAGS=-I$DEPS/usr/include JANSSON_LIBS=$DEPS/usr/lib/x86_64-linux-gnu/libjansson.a"
mkdir -p "$OUT"
t0=$(date +%s)
eval timeout 400 make -j16 $J build/winattn >"$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
eval timeout 400 make -j16 $J BUILD=build-narrow \
    NVCCFLAGS=\"-O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -Iinclude -std=c++17 -DWA_NARROW_MN\" \
    build-narrow/winattn >"$OUT/build-narrow.txt" 2>&1 || { tail -30 "$OUT/build-narrow.txt"; exit 1; }
echo "built in $(($(date +%s) - t0)) s"
echo "== parity --quick (wide)"
timeout 120 build/winattn parity --device cuda --threads 16 --quick >"$OUT/parity_quick.txt" 2>&1; echo "exit $?"
grep '^FAIL' "$OUT/parity_quick.txt" | head -10; tail -1 "$OUT/parity_quick.txt"
for bin in build build-narrow; do
    B="timeout 90 $bin/winattn bench --device cuda --reps 5"
    echo "== $bin: (a) 8K 16K 32K; (b) 8K 32K; D=64 16K"
    $B --n 8192,16384,32768 | tail -3
    $B --n 8192,32768 --d 128 --hkv 8 --sliding-window 4096 | tail -2
    $B --n 16384 --d 64 --hkv 8 --sliding-window 1024 | tail -1
done
echo "== parity --device cuda (full, wide)"
timeout 300 build/winattn parity --device cuda --threads 16 >"$OUT/parity_cuda.txt" 2>&1; echo "exit $?"
grep '^FAIL' "$OUT/parity_cuda.txt" | head -20; tail -1 "$OUT/parity_cuda.txt"
echo "total $(($(date +%s) - t0)) s"

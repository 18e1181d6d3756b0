#!/bin/sh
# peer_profile.sh — Nsight Compute on one backward (or forward) of a peer and one of winattn, through
# PyTorch (dev/cuda/peer_kernels.py), at a shape of bench/gpu_peers.py, every kernel of each:
# duration, SM clock, cycles, tensor-pipe and issue utilisation, instructions, L2 and DRAM bytes
# and the stall reasons (dev/cuda/profile.sh's metrics and table), so that the kernels are compared
# per cycle and per byte, apart from the clocks the 700 W limit sets in a sustained run. From the
# repository root on the H200, with the peers installed (bench/peer_wheels.py) and WINATTN_LIBRARY
# pointing at the library:
#   sh dev/cuda/peer_profile.sh [SHAPE [N [--fwd]]]   (default: b 8192, the backward)
# SYSTEMS: the systems (default fa4,winattn; ffpa,winattn at (c)). The table goes to stdout and
# $OUT/peer_SHAPE_N[_fwd].txt, Nsight Compute's CSV to the same name with .csv.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
shape=${1:-b} n=${2:-8192} what=$3
name=$OUT/peer_${shape}_$n${what:+_fwd}
CMD="python3 dev/cuda/peer_kernels.py --peers-dir ${PEERS_DIR:-/tmp/winattn-peers} --systems ${SYSTEMS:-fa4,winattn} --shape $shape --n $n $what" \
    NCU_ARGS="--profile-from-start off" KERNELS="." LAUNCHES=40 sh dev/cuda/profile.sh | tee "$name.txt"
mv "$OUT/ncu.csv" "$name.csv"
grep -h "peer_kernels:" "$name.csv" | tee -a "$name.txt"

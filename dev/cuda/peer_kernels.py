#!/usr/bin/env python3
"""peer_kernels.py — one backward (or forward) of each system at one of bench/gpu_peers.py's shapes,
each between cudaProfilerStart and cudaProfilerStop after two warm-up calls, so that a profiler
started with `--profile-from-start off` (Nsight Compute) sees exactly those calls' kernels, and
each system's after the others' warm-up (FA4 compiles its kernels on the first call). Run by
dev/cuda/peer_profile.sh; from the repository root on the GPU machine:
    python3 dev/cuda/peer_kernels.py --peers-dir /tmp/winattn-peers --systems fa4,winattn --shape b --n 8192 [--fwd]
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

import gpu_peers  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    gpu_peers.one_shape_args(ap, 8192)
    ap.add_argument("--fwd", action="store_true", help="profile the forward instead of the backward")
    a = ap.parse_args()
    if a.peers_dir:
        from peer_wheels import add_to_path

        add_to_path(a.peers_dir, "peer_kernels")
    trials = gpu_peers.warmed_trials("peer_kernels", a.systems.split(","), a.shape, a.n)
    for t in trials:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        t.fwd() if a.fwd else t.bwd()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print("peer_kernels: profiled one %s of %s at (%s) %d" % ("forward" if a.fwd else "backward", t.name, a.shape, a.n))


if __name__ == "__main__":
    main()

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
    ap.add_argument("--peers-dir", help="where bench/peer_wheels.py installed the peers")
    ap.add_argument("--systems", default="fa4,winattn")
    ap.add_argument("--shape", default="b", help="a shape of bench/gpu_peers.py (a, b, c, cw)")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--fwd", action="store_true", help="profile the forward instead of the backward")
    a = ap.parse_args()
    if a.peers_dir:
        from peer_wheels import add_to_path

        add_to_path(a.peers_dir, "peer_kernels")
    shape = [s for s in gpu_peers.SHAPES if s[0] == a.shape]
    if not shape:
        sys.exit("peer_kernels: --shape %s: not one of %s" % (a.shape, ", ".join(s[0] for s in gpu_peers.SHAPES)))
    _, hq, hkv, d, window, _ = shape[0]
    trials = []
    for name in a.systems.split(","):
        try:
            t = gpu_peers.Trial(name, a.n, hq, hkv, d, window)
        except Exception as e:  # an unknown system, or a peer that cannot run this shape
            sys.exit("peer_kernels: %s at (%s) %d: %s" % (name, a.shape, a.n, gpu_peers.short_error(e)))
        t.warm_up()
        trials.append(t)
    for t in trials:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        t.fwd() if a.fwd else t.bwd()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print("peer_kernels: profiled one %s of %s at (%s) %d" % ("forward" if a.fwd else "backward", t.name, a.shape, a.n))


if __name__ == "__main__":
    main()

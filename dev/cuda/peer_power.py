#!/usr/bin/env python3
"""peer_power.py — is a system's steady-state figure set by its cycles or by its watts? At one of
bench/gpu_peers.py's shapes, each system's forward, then its backward, called back to back for
--seconds while nvidia-smi samples the SM clock and the board power (data_sensitivity.py's
sampler), the systems alternating for --rounds rounds. Per system and pass: ms per call, TFLOP/s,
median MHz and W, and from them the energy (J) and the SM cycles (M) per call. Under the 700 W
limit two kernels with the same cycles per call run at clocks in inverse proportion to their
energy per cycle; Nsight Compute (peer_profile.sh) counts the cycles at a fixed clock. From the
repository root on the GPU machine, the peers installed (bench/peer_wheels.py), after a build:
    python3 dev/cuda/peer_power.py --peers-dir /tmp/winattn-peers [--systems fa4,winattn] [--shape b]
        [--n 32768] [--seconds 4] [--rounds 2]
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import gpu_peers  # noqa: E402
from data_sensitivity import sampled  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    gpu_peers.one_shape_args(ap, 32768)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if a.seconds <= 0 or a.rounds < 1:
        ap.error("--seconds above 0 and --rounds 1 or more")
    if a.peers_dir:
        from peer_wheels import add_to_path

        add_to_path(a.peers_dir, "peer_power")
    trials = gpu_peers.warmed_trials("peer_power", a.systems.split(","), a.shape, a.n)
    print("peer_power: %s, (%s) N %d, %.1f s a pass" % (torch.cuda.get_device_name(), a.shape, a.n, a.seconds))
    print("| round | system | pass | ms | TFLOP/s | MHz | W | J per call | M cycles per call |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in range(a.rounds):
        for t in gpu_peers.rotated(trials, r):
            for label, fn, work in (("fwd", t.fwd, t.flops()), ("bwd", t.bwd, 2.5 * t.flops())):
                ms, mhz, watts = sampled(fn, a.seconds)
                print("| %d | %s | %s | %.3f | %.1f | %.0f | %.0f | %.3f | %.2f |" % (
                    r + 1, t.name, label, ms, work / ms / 1e9, mhz, watts, watts * ms / 1e3, mhz * ms / 1e3), flush=True)


if __name__ == "__main__":
    main()

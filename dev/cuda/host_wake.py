#!/usr/bin/env python3
"""host_wake.py — does a call's host time depend on its shape, or on how long the host waited
before it? call_gap.py reads a (b) 32K backward's host time at 0.5-0.7 ms against 0.14-0.2 ms at
(b) 1024, while host_call_cost.c reads the library's own part at about 20 µs at both: the rest is
around the library. Every call there follows a synchronisation that waited for the previous call's
kernels, as long as those kernels run. Here each function's host time (wall time of the Python call,
no synchronisation inside) is read after three preludes, each starting from a drained GPU and a
host kept busy for 3 ms:
  short wait   0.05 ms of GPU spinning, then torch.cuda.synchronize()
  long wait    10 ms of GPU spinning, then torch.cuda.synchronize()
  long, polled 10 ms of GPU spinning, then an event polled in a busy loop (the thread never sleeps)
The functions: winattn's forward and backward at each case (as bench/gpu_peers.py calls them),
the floor any op pays (one multiply and its backward through autograd, on a small tensor; the
backward runs on autograd's device thread, which sleeps between calls), the multiply alone with no
graph, and a 512 MB torch.empty (from the caching allocator) with its free. Medians over --reps, µs. If the long
wait's column grows for the small functions too, the host's time follows the wait, not the shape.
From the repository root on the GPU machine, after a build and python/build_torch_ext.py:
    python3 dev/cuda/host_wake.py [--cases b:1024,b:32768,cw:16384] [--systems winattn[,fa4]]
        [--reps 15] [--peers-dir /tmp/winattn-peers]
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))

import torch  # noqa: E402

import gpu_peers  # noqa: E402


def host_busy(ms):
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def prelude(kind):
    torch.cuda.synchronize()
    host_busy(3.0)
    gpu_peers.spin_gpu(0.05 if kind == "short" else 10.0)
    if kind == "polled":
        e = torch.cuda.Event()
        e.record()
        while not e.query():
            pass
    else:
        torch.cuda.synchronize()


def host_us(fn, kind):
    prelude(kind)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=gpu_peers.shape_cases, default="b:1024,b:32768,cw:16384",
                    help="SHAPE:N of bench/gpu_peers.py's shapes")
    ap.add_argument("--systems", default="winattn")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--peers-dir", help="where bench/peer_wheels.py installed the peers")
    a = ap.parse_args()
    if a.reps < 1:
        ap.error("--reps is 1 or more")
    if a.peers_dir:
        from peer_wheels import add_to_path

        add_to_path(a.peers_dir, "host_wake")
    x = torch.randn(1024, device="cuda", requires_grad=True)
    gx = torch.ones(1024, device="cuda")

    def floor():
        return torch.autograd.grad(x * 2, (x,), gx)

    def floor_forward():
        with torch.no_grad():
            return x * 2

    def empty_512mb():
        torch.empty(256 << 20, device="cuda", dtype=torch.bfloat16)  # freed on return: nothing holds it

    fns = [("floor: multiply + backward through autograd", floor), ("multiply alone, no graph", floor_forward),
           ("torch.empty 512 MB and its free", empty_512mb)]
    for label, n in a.cases:
        for t in gpu_peers.trials_at(a.systems.split(","), n, gpu_peers.SHAPE_OF[label],
                                     lambda name, error: print("(%s) %d %s: %s" % (label, n, name, error))):
            fns += [("(%s) %d %s fwd" % (label, n, t.name), t.fwd), ("(%s) %d %s bwd" % (label, n, t.name), t.bwd)]
    kinds = ("short", "long", "polled")
    print("host_wake: %s, torch %s; host µs per call, median of %d" % (torch.cuda.get_device_name(), torch.__version__, a.reps))
    print("| function | after a 0.05 ms wait | after a 10 ms wait | after 10 ms, polled |\n|---|---|---|---|")
    for name, fn in fns:
        for kind in kinds:  # warm each path once
            host_us(fn, kind)
        got = {k: [] for k in kinds}
        for _ in range(a.reps):
            for kind in kinds:  # interleaved, so that a drift touches the three alike
                got[kind].append(host_us(fn, kind))
        print("| %s | %s |" % (name, " | ".join("%.1f" % statistics.median(got[k]) for k in kinds)), flush=True)


if __name__ == "__main__":
    main()

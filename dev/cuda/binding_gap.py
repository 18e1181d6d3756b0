#!/usr/bin/env python3
"""binding_gap.py — where the time between `winattn bench` (C, uniform data) and bench/gpu_peers.py
(through the PyTorch binding, randn data) goes. For shapes (a) and (b) (at 8K unless --cases), times winattn's
forward and backward through winattn.torch four ways: one call per CUDA-event pair with randn
inputs (gpu_peers' method), the same with uniform(-1, 1) inputs (the C bench's distribution), and
ten calls per event pair (launch gaps amortised) for both. Then, for the backward at (a): the host
time spent inside wa_backward (ctypes call, no sync; after a sync, as in the per-call timing), and
the per-call timing again after the driver's default memory pool (where the library's workspace
comes from, cudaMallocAsync) is told to keep freed memory (release threshold = max) instead of
unmapping it at every synchronisation. Run on the H200 from the repository root after `make`:
    python3 dev/cuda/binding_gap.py [--host-only | --no-host] [--cases=a:8192,b:32768]
(--cases: which shapes and lengths the first part times; (a) and (b) at 8K by default)."""
import ctypes
import os
import sys
import time

SHAPES = {"a": (32, 16, 256, 1024), "b": (32, 8, 128, 4096)}


def parse_cases(argv):
    """--cases=SHAPE:N,... (e.g. b:8192,b:32768); (a) and (b) at 8K without it"""
    cases = [("a", 8192), ("b", 8192)]
    for arg in argv:
        if arg.startswith("--cases="):
            cases = []
            for c in arg[len("--cases="):].split(","):
                label, _, n = c.partition(":")
                if label not in SHAPES or not n.isdigit() or int(n) <= 0:
                    sys.exit("binding_gap.py: --cases takes SHAPE:N pairs, SHAPE a or b and N a positive length, not %r" % c)
                cases.append((label, int(n)))
    return cases


CASES = parse_cases(sys.argv[1:])  # before torch loads, so that a bad argument fails at once

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
os.environ.setdefault("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))
import winattn.torch as wt  # noqa: E402
from gpu_peers import timed  # noqa: E402  (median seconds per call over reps timings of `calls` calls)


def main(cases):
    print("| shape | data | calls per timing | fwd TFLOP/s | bwd TFLOP/s |")
    print("|---|---|---|---|---|")
    for label, n in cases:
        hq, hkv, d, w = SHAPES[label]
        flops = 4.0 * d * hq * (n * w - w * (w - 1) // 2)
        for data in ("randn", "uniform"):
            g = torch.Generator(device="cuda").manual_seed(1)

            def make(h):
                if data == "randn":
                    return torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                return torch.rand(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) * 2 - 1

            q, k, v, do = make(hq).requires_grad_(), make(hkv).requires_grad_(), make(hkv).requires_grad_(), make(hq)
            for per in (1, 10):
                with torch.no_grad():
                    f = timed(lambda: wt.attention(q, k, v, window=(w - 1, 0)), 5, per)
                o = wt.attention(q, k, v, window=(w - 1, 0))
                bw = timed(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), 5, per)
                print("| %s %d | %s | %d | %.1f | %.1f |" % (label, n, data, per, flops / f / 1e12, 2.5 * flops / bw / 1e12), flush=True)


class HostTimed:
    """wraps the binding's ctypes library: records wall time of each wa_backward call"""

    def __init__(self, lib):
        self.lib, self.times = lib, []

    def __getattr__(self, name):
        fn = getattr(self.lib, name)
        if name != "wa_backward":
            return fn

        def timed_call(*a):
            t0 = time.perf_counter()
            r = fn(*a)
            self.times.append(time.perf_counter() - t0)
            return r

        return timed_call


def keep_pool_memory():
    cu = ctypes.CDLL("libcuda.so.1")
    dev, pool = ctypes.c_int(), ctypes.c_void_p()
    assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cu.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev) == 0
    big = ctypes.c_uint64(2**63)
    assert cu.cuMemPoolSetAttribute(pool, 4, ctypes.byref(big)) == 0  # CU_MEMPOOL_ATTR_RELEASE_THRESHOLD


def host_side():
    n, hq, hkv, d, w = 8192, 32, 16, 256, 1024
    flops = 4.0 * d * hq * (n * w - w * (w - 1) // 2)
    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    do = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16)
    o = wt.attention(q, k, v, window=(w - 1, 0))
    wrapped = HostTimed(wt.lib)
    wt.lib = wrapped
    for label in ("default pool", "pool keeps memory"):
        if label != "default pool":
            keep_pool_memory()
        wrapped.times.clear()
        bw = timed(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), 7, 1)
        host = sorted(wrapped.times)[len(wrapped.times) // 2]
        print("(a) 8192 backward, %s: %.1f TFLOP/s one call per timing; host time in wa_backward %.0f us (median)" % (
            label, 2.5 * flops / bw / 1e12, host * 1e6), flush=True)
    wt.lib = wrapped.lib


if __name__ == "__main__":
    if "--host-only" not in sys.argv:
        main(CASES)
    if "--no-host" not in sys.argv:
        host_side()

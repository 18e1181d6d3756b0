#!/usr/bin/env python3
"""binding_overhead.py — the Python-side cost of winattn.torch.attention: forward and backward
calls on tiny CPU tensors (so the kernels cost next to nothing), mean over --calls after a
warm-up. Run from the repository root after `make lib`:
    python3 bench/binding_overhead.py [--calls 200]
Needs torch. docs/gpu-peers.md and docs/cuda.md quote its result."""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))

import torch  # noqa: E402
import winattn.torch as wt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    if a.calls < 1:
        sys.exit("binding_overhead: --calls must be at least 1")
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 1, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 1, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    for _ in range(20):
        o = wt.attention(q, k, v, window=(7, 0))
        torch.autograd.grad(o, (q, k, v), do)
    t0 = time.perf_counter()
    for _ in range(a.calls):
        o = wt.attention(q, k, v, window=(7, 0))
    t1 = time.perf_counter()
    for _ in range(a.calls):
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    t2 = time.perf_counter()
    print("binding overhead (CPU, 1x2x16x64 bf16, %d calls): forward %.0f us, backward %.0f us per call"
          % (a.calls, (t1 - t0) / a.calls * 1e6, (t2 - t1) / a.calls * 1e6))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""cuda_bit_identity.py — runs winattn's forward and backward twice through the PyTorch binding on the
same bf16 inputs at shapes (a) (D = 256, window 1024), (b) (D = 128, window 4096) and (c) (D = 512,
causal), N = 8192, and says which of o, dq, dk, dv came out bit-identical. --modes picks the backward forms:
`deterministic` (deterministic=True, which must give four Trues) and `default` (where dq, added
with f32 atomics at D <= 128, may differ). On a CUDA machine from the repository root after `make lib` (scripts/cuda_check.sh runs it):
    python3 scripts/cuda_bit_identity.py [--modes default,deterministic]"""
import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))
import winattn.torch as wt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="default,deterministic")
    modes = ap.parse_args().modes.split(",")
    if not set(modes) <= {"default", "deterministic"}:
        sys.exit("cuda_bit_identity: --modes takes default and/or deterministic")
    bad = 0
    for hq, hkv, d, w in ((32, 16, 256, 1024), (32, 8, 128, 4096), (32, 4, 512, None)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(1, h, 8192, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv, hq))
        for mode in modes:
            outs = []
            for _ in range(2):
                qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                o = wt.attention(qq, kk, vv, window=(w - 1, 0) if w else (-1, 0), deterministic=mode == "deterministic")
                o.backward(do)
                outs.append((o.detach(), qq.grad, kk.grad, vv.grad))
            same = [torch.equal(a, b) for a, b in zip(*outs)]
            print(f"D={d} Hq={hq} Hkv={hkv} window {w or 'causal'} {mode}: o, dq, dk, dv bit-identical across two runs: {same}")
            # the deterministic form: all four; the default: all but dq
            if not all(same[i] for i in range(4) if mode == "deterministic" or i != 1):
                bad += 1
    print("FAIL: outputs that must repeat bit for bit did not" if bad else "PASS: every output that must repeat did")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

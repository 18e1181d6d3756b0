#!/usr/bin/env python3
"""data_sensitivity.py — is the gap between `winattn bench` and the PyTorch harness at (c) (D = 512,
Hq 32, Hkv 4, causal, bf16: 488-503 TFLOP/s forward against 428-457, docs/gpu-peers.md) the data,
the clocks or the path? Per length, alternating, with the SM clock and board power sampled by
nvidia-smi during each: `build/winattn bench --forward-only` (short bursts, uniform data in
[-2, 2)); then winattn.torch.attention called back to back for --seconds with that data and with
torch.randn (what bench/gpu_peers.py feeds), forward alone and forward + backward. (binding_gap.py
put 3 % of (b)'s gap on the data, with clocks at 1845-1980 MHz under the 700 W limit.) From the
repository root on the GPU machine, after a build:
    python3 dev/cuda/data_sensitivity.py [--n 8192,16384] [--rounds 2] [--seconds 4]
"""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))

import torch  # noqa: E402
import winattn.torch as wt  # noqa: E402


def smi_sampler():
    return subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                             "-lms", "50"], stdout=subprocess.PIPE, text=True)


def smi_medians(smi):
    """(median SM clock MHz, median power W) of what the sampler printed, once stopped"""
    smi.terminate()
    rows = []
    for line in smi.communicate()[0].splitlines():
        try:
            clock, power = (float(x) for x in line.split(","))
            rows.append((clock, power))
        except ValueError:
            pass
    rows = rows[2:] or rows  # the first samples may predate the load
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    return med([r[0] for r in rows]), med([r[1] for r in rows])


def sampled_bench(n):
    """`winattn bench --forward-only` at (c) and length n: (TFLOP/s, SM MHz, W)"""
    smi = smi_sampler()
    try:
        out = subprocess.run([os.path.join(ROOT, "build", "winattn"), "bench", "--device", "cuda", "--reps", "5",
                              "--forward-only", "--d", "512", "--hq", "32", "--hkv", "4", "--causal", "--n", str(n)],
                             capture_output=True, text=True, timeout=120).stdout
    finally:
        clock, power = smi_medians(smi)
    cols = [c.strip() for c in out.strip().splitlines()[-1].split("|")] if out.strip() else []
    return (float(cols[4]) if len(cols) > 4 else float("nan")), clock, power


def sampled(fn, seconds):
    """fn() called back to back for about `seconds`, nvidia-smi sampling every 50 ms meanwhile:
    (ms per call, median SM clock MHz, median power W)"""
    smi = smi_sampler()
    try:
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        calls, t0 = 0, time.perf_counter()
        a.record()
        while time.perf_counter() - t0 < seconds:
            fn()
            calls += 1
            if calls % 4 == 0:
                torch.cuda.synchronize()
        b.record()
        torch.cuda.synchronize()
        ms = a.elapsed_time(b) / calls
    finally:
        clock, power = smi_medians(smi)
    return ms, clock, power


def lengths(text):
    """--n: positive sequence lengths, comma-separated"""
    try:
        ns = [int(x) for x in text.split(",")]
    except ValueError:
        ns = []
    if not ns or min(ns) < 1:
        raise argparse.ArgumentTypeError("%r is not a comma-separated list of positive lengths" % text)
    return ns


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="8192,16384", type=lengths, help="lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    a = ap.parse_args()
    hq, hkv, d = 32, 4, 512
    print("| N | data | round | fwd TFLOP/s | SM MHz | W | fwd+bwd TFLOP/s | SM MHz | W |")
    print("|---|---|---|---|---|---|---|---|---|")
    if a.rounds < 1 or a.seconds <= 0:
        ap.error("--rounds must be at least 1 and --seconds positive")
    for n in a.n:
        flops_f = 4.0 * hq * d * (n * (n + 1) // 2)
        g = torch.Generator(device="cuda").manual_seed(0)
        data = {}
        for name in ("uniform", "randn"):
            def make(h, name=name):
                if name == "randn":
                    return torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                return (torch.rand(1, h, n, d, device="cuda", generator=g) * 4 - 2).to(torch.bfloat16)
            data[name] = [make(hq).requires_grad_(), make(hkv).requires_grad_(), make(hkv).requires_grad_(), make(hq)]
        for r in range(a.rounds):
            tf, clk, w = sampled_bench(n)
            print("| %d | winattn bench (uniform, bursts) | %d | %.1f | %.0f | %.0f | - | - | - |" % (n, r + 1, tf, clk, w),
                  flush=True)
            for name, (q, k, v, do) in data.items():
                def fwd():
                    with torch.no_grad():
                        wt.attention(q, k, v, causal=True)

                def both():
                    o = wt.attention(q, k, v, causal=True)
                    torch.autograd.grad(o, (q, k, v), do)

                ms_f, clk_f, w_f = sampled(fwd, a.seconds)
                ms_b, clk_b, w_b = sampled(both, a.seconds)
                print("| %d | %s | %d | %.1f | %.0f | %.0f | %.1f | %.0f | %.0f |" % (
                    n, name, r + 1, flops_f / ms_f / 1e9, clk_f, w_f, 3.5 * flops_f / ms_b / 1e9, clk_b, w_b),
                    flush=True)


if __name__ == "__main__":
    main()

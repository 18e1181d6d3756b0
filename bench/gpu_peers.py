#!/usr/bin/env python3
"""gpu_peers.py — winattn on CUDA against the GPU attention a PyTorch user could run instead, in one
run on one GPU, printing one table (markdown) and optionally writing JSON.

Needs torch (2.5 or later, for FlexAttention and enable_gqa) with CUDA, and winattn built with
nvcc (`make`). Run from the repository root on the GPU machine:
    python3 bench/gpu_peers.py [--quick] [--reps R] [--json docs/gpu-peers.json]
        [--systems S,...] [--shapes a,b,c,cw] [--baseline SYSTEM] [--peers-dir /tmp/winattn-peers]
FlashAttention 4 and ffpa-attn come as wheels installed by bench/peer_wheels.py (the GPU machine
reaches no registry); --peers-dir names where it installed them.

Systems (each forward and backward through autograd, bf16):
  winattn      winattn.torch.attention (python/winattn, the library's own kernels) with the window;
               its default backward (at D = 64 and 128 dQ is added with f32 atomics)
  winattn-det  the same with deterministic=True (bit-identical backward, dQ in its own kernel)
  flex         torch.compile(flex_attention) with a sliding-window block mask and enable_gqa=True
  sdpa-flash   F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) on the FLASH backend:
               causal without a window, so it does more work than the window needs (its TFLOP/s
               count its own causal pairs)
  sdpa-mask    F.scaled_dot_product_attention with a dense [N, N] boolean mask of the window
               (whatever backend SDPA picks for a mask; it builds scores of size N x N)
  fa4          FlashAttention 4 (flash-attn-4, CuTe DSL; its SM90 kernels on Hopper):
               flash_attn.cute.flash_attn_func on its own [B, N, H, D] layout, window_size=(W-1, 0)
               or causal=True; GQA native. D up to 256 on Hopper.
  fa4-det      the same with deterministic=True
  ffpa         ffpa-attn's ffpa_attn_func(backend="cutedsl", is_causal=True, enable_gqa=True): large
               head dims (D > 256); causal only (no sliding window), so it runs shape (c) alone

Shapes (the issue's): (a) B=1, Hq=32, Hkv=16, D=256, sliding window 1024, N = 8K, 16K, 32K;
(b) Hq=32, Hkv=8, D=128, window 4096, N = 8K, 32K; (c) Hq=32, Hkv=4, D=512, causal, N = 8K, 16K;
(cw) as (c) with a window of 1024, N = 16K.

TFLOP/s counts visible (query, key) pairs of the mask each system computes (DESIGN.md section 5:
forward 4*D*pairs per query head, backward 2.5x forward). Each time is the median of --reps runs
after two warm-ups, timed with CUDA events, two ways: one call per event pair with a synchronise
after it ("per call": the GPU also waits for the host's work before the first kernel, Python and
launch overhead included), and 10 calls back to back per event pair ("steady": as in a training
step, where the host runs ahead of the GPU; taken as the per-call time where one call takes 0.1 s
or more). Backward peak memory above inputs: PyTorch's
max_memory_allocated during one backward minus what was allocated before it (q, k, v, dO and the
forward's output and saved tensors), so it counts dQ, dK, dV and the system's scratch; winattn's
own workspace (delta and lse*log2(e), 2*B*Hq*N floats with N rounded up to 64, plus for its
default backward at D <= 128 an f32 dQ accumulator of B*Hq*N*D floats) comes from the CUDA
stream-ordered pool, outside PyTorch's allocator, and is added explicitly.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))

SHAPES = [  # label, Hq, Hkv, D, window (None = causal), lengths
    ("a", 32, 16, 256, 1024, [8192, 16384, 32768]),
    ("b", 32, 8, 128, 4096, [8192, 32768]),
    ("c", 32, 4, 512, None, [8192, 16384]),
    ("cw", 32, 4, 512, 1024, [16384]),
]


def pairs(n, window):
    """Visible pairs for Nq = Nk = n: a causal window of `window` keys including self, or causal."""
    w = n if window is None else min(window, n)
    return n * w - w * (w - 1) // 2


def timed(fn, reps, calls=1):
    """median seconds per call over reps timings of `calls` back-to-back calls each"""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3 / calls)
    return statistics.median(ts)


def make_system(name, n, hq, hkv, d, window):
    """Returns (attn(q, k, v) -> o, note, extra scratch bytes outside torch's allocator, layout of
    q, k, v: "bhnd" ([B, H, N, D]) or "bnhd")."""
    if name in ("fa4", "fa4-det"):
        from flash_attn.cute import flash_attn_func

        det = name == "fa4-det"
        kw = {"causal": True} if window is None else {"window_size": (window - 1, 0)}

        def run(q, k, v):
            r = flash_attn_func(q, k, v, deterministic=det, **kw)
            return r[0] if isinstance(r, tuple) else r

        return run, "", 0, "bnhd"
    if name == "ffpa":
        if window is not None:
            raise ValueError("ffpa has no sliding window (causal only)")
        from ffpa_attn import ffpa_attn_func

        return (lambda q, k, v: ffpa_attn_func(q, k, v, is_causal=True, enable_gqa=True, backend="cutedsl")), "", 0, "bhnd"
    if name in ("winattn", "winattn-det"):
        import winattn.torch as wt

        win = (n - 1 if window is None else window - 1, 0)
        det = name == "winattn-det"
        rows = hq * ((n + 63) // 64 * 64)
        scratch = 2 * 4 * rows + (4 * rows * d if d <= 128 and not det else 0)
        return (lambda q, k, v: wt.attention(q, k, v, window=win, deterministic=det)), "", scratch, "bhnd"
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # a fresh compile per shape: past dynamo's recompile limit flex_attention silently runs
        # eagerly (scores of size N x N), which is not the peer this table means
        torch._dynamo.reset()
        w = n if window is None else window

        def sliding(b, h, qi, ki):
            return (qi >= ki) & (qi - ki < w)

        bm = create_block_mask(sliding, None, None, n, n, device="cuda")
        flex = torch.compile(flex_attention, dynamic=False)
        return (lambda q, k, v: flex(q, k, v, block_mask=bm, enable_gqa=True)), "", 0, "bhnd"
    if name == "sdpa-flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        return run, "causal, no window", 0, "bhnd"
    if name == "sdpa-mask":
        idx = torch.arange(n, device="cuda")
        diff = idx[:, None] - idx[None, :]
        mask = (diff >= 0) if window is None else ((diff >= 0) & (diff < window))
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)), "", 0, "bhnd"
    raise ValueError(name)


def measure(name, n, hq, hkv, d, window, reps, ref=None):
    """Times one system; ref: the first system's o, dq, dk, dv at this shape ([B, H, N, D]), to which
    this one's are compared (max |difference| over max |ref value|, the largest of the four), or an
    empty list that this call fills."""
    torch.manual_seed(0)
    attn, note, extra, layout = make_system(name, n, hq, hkv, d, window)
    g = torch.Generator(device="cuda").manual_seed(1)

    def randn(h):  # the same values in either layout; contiguous in the system's own
        x = torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        return x.transpose(1, 2).contiguous() if layout == "bnhd" else x

    q, k, v = randn(hq).requires_grad_(), randn(hkv).requires_grad_(), randn(hkv).requires_grad_()
    do = randn(hq)
    with torch.no_grad():
        fwd = timed(lambda: attn(q, k, v), reps)
        fwd_steady = timed(lambda: attn(q, k, v), reps, 10) if fwd < 0.1 else fwd
    o = attn(q, k, v)
    bwd = timed(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), reps)
    bwd_steady = timed(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), reps, 10) if bwd < 0.1 else bwd
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base + extra
    outs = [x.transpose(1, 2) if layout == "bnhd" else x for x in [o.detach()] + list(grads)]
    agree = None
    if ref is not None and not ref:
        ref.extend(x.clone() for x in outs)
    elif ref:
        agree = max(((x.float() - r.float()).abs().max() / r.float().abs().max()).item() for x, r in zip(outs, ref))
    del grads, o, outs
    npairs = pairs(n, None if name == "sdpa-flash" else window)
    flops = 4.0 * d * npairs * hq
    return {"fwd_s": fwd, "bwd_s": bwd, "fwd_tflops": flops / fwd / 1e12, "bwd_tflops": 2.5 * flops / bwd / 1e12,
            "fwd_steady_s": fwd_steady, "bwd_steady_s": bwd_steady, "fwd_steady_tflops": flops / fwd_steady / 1e12,
            "bwd_steady_tflops": 2.5 * flops / bwd_steady / 1e12, "bwd_peak_gb": peak / 1e9, "note": note,
            "max_rel_diff_vs_first": agree}


def short_error(e):
    text = str(e).strip().splitlines()
    line = next((t for t in text if "Error" in t or "error" in t), text[0] if text else type(e).__name__)
    return (type(e).__name__ + ": " + line)[:90]


def main():
    torch._dynamo.config.recompile_limit = 64
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="first length of each shape only")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--systems", default="flex,winattn,winattn-det,sdpa-flash,sdpa-mask",
                    help="the first that runs gives the outputs the others' are compared with (sdpa-flash, "
                         "without the window, is not compared)")
    ap.add_argument("--shapes", default="a,b,c")
    ap.add_argument("--json")
    ap.add_argument("--baseline", default="flex", help="the system the ratio columns divide by (first in --systems)")
    ap.add_argument("--peers-dir", help="where bench/peer_wheels.py installed flash-attn-4 and ffpa-attn")
    args = ap.parse_args()
    if args.peers_dir:
        from peer_wheels import add_to_path

        add_to_path(args.peers_dir, "gpu_peers")
    print("gpu_peers: %s, torch %s, %s" % (torch.cuda.get_device_name(), torch.__version__, time.strftime("%Y-%m-%d")))
    print("| shape | N | system | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | steady fwd / bwd TFLOP/s "
          "| bwd peak above inputs GB | fwd / bwd vs %s | steady vs %s | note |" % (args.baseline, args.baseline))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for label, hq, hkv, d, window, lens in SHAPES:
        if label not in args.shapes.split(","):
            continue
        for n in lens[:1] if args.quick else lens:
            base, ref, ref_name = None, [], None
            for name in args.systems.split(","):
                if name == "winattn-det" and d > 256:
                    continue  # D = 512: version 5's backward is deterministic either way
                try:
                    r = measure(name, n, hq, hkv, d, window, args.reps, ref if name != "sdpa-flash" else None)
                    ref_name = ref_name or (name if ref else None)
                except Exception as e:  # a peer that cannot run this shape says why in the table
                    r = {"error": short_error(e)}
                torch.cuda.empty_cache()
                r.update({"shape": label, "n": n, "system": name, "Hq": hq, "Hkv": hkv, "D": d,
                          "window": window if window else "causal"})
                results.append(r)
                if args.json:  # after every row: a run stopped by a time limit keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results}, f,
                                  indent=1)
                if "error" in r:
                    print("| %s | %d | %s | - | - | - | - | - | - | - | - | %s |" % (label, n, name, r["error"].replace("|", "/")),
                          flush=True)
                    continue
                if name == args.baseline:
                    base = r
                ratio = "%.2f / %.2f" % (base["fwd_s"] / r["fwd_s"], base["bwd_s"] / r["bwd_s"]) if base else "-"
                steady = "%.2f / %.2f" % (base["fwd_steady_s"] / r["fwd_steady_s"], base["bwd_steady_s"] / r["bwd_steady_s"]) if base else "-"
                if r["max_rel_diff_vs_first"] is not None:
                    r["compared_with"] = ref_name
                    r["note"] = ("%s; " % r["note"] if r["note"] else "") + "outputs vs %s: %.1e" % (
                        ref_name, r["max_rel_diff_vs_first"])
                print("| %s | %d | %s | %.2f | %.1f | %.2f | %.1f | %.1f / %.1f | %.2f | %s | %s | %s |" % (
                    label, n, name, r["fwd_s"] * 1e3, r["fwd_tflops"], r["bwd_s"] * 1e3, r["bwd_tflops"],
                    r["fwd_steady_tflops"], r["bwd_steady_tflops"], r["bwd_peak_gb"], ratio, steady, r["note"]), flush=True)


if __name__ == "__main__":
    main()

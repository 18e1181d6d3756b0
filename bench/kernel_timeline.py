#!/usr/bin/env python3
"""kernel_timeline.py — what the GPU runs during one forward or backward through winattn.torch, read
from PyTorch's profiler (CUPTI's kernel records) instead of inferred from event pairs. For each case
and pass it times the call as bench/gpu_peers.py does, one call per timing ("per call") and ten back
to back ("steady"), with randn data, and prints per mode: every kernel and memset with its mean
duration, the GPU's busy time per call (the sum of those), its span (first kernel's start to the
last one's end; span minus busy is the idle time between the call's kernels) and the delay from the
call's start on the host to its first kernel. Then the same shape's `build/winattn bench` beside it. What it answers: whether the gap between the C bench and
the harness is in the kernels themselves (longer durations: data, clocks), in work the binding adds
(extra kernels) or in idle time (host, launch gaps). Before the profiled runs, the same backward
timed with CUDA events exactly as bench/gpu_peers.py does, for comparison with its tables.
From the repository root on the GPU machine, after a build:
    python3 bench/kernel_timeline.py [--cases b:32768,cw:16384] [--passes fwd,bwd] [--calls 6]
                                        [--after-fa4 /tmp/winattn-peers]
Cases are bench/gpu_peers.py's shapes (a, b, c, cw) at a length. --after-fa4 runs FlashAttention 4 at
the shape first, as bench/gpu_peers.py does, to see what that changes for winattn's calls after it.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))

sys.path.insert(0, os.path.join(ROOT, "bench"))
from gpu_peers import SHAPE_OF as SHAPES, shape_cases as cases  # noqa: E402  (label: Hq, Hkv, D, window; --cases)


def bench_row(label, n):
    """`build/winattn bench --device cuda` at this shape: its table's columns and last line"""
    hq, hkv, d, window = SHAPES[label]
    args = [os.path.join(ROOT, "build", "winattn"), "bench", "--device", "cuda", "--reps", "5", "--n", str(n),
            "--d", str(d), "--hq", str(hq), "--hkv", str(hkv)] + (["--causal"] if window is None else
                                                                  ["--sliding-window", str(window)])
    out = subprocess.run(args, capture_output=True, text=True, timeout=180).stdout.strip().splitlines()
    header = [c.strip() for c in out[-3].split("|")] if len(out) >= 3 else []
    cols = [c.strip() for c in out[-1].split("|")] if out else []
    return dict(zip(header, cols)), out[-1] if out else "(no output)"


def profile(fn, calls, per_timing, torch):
    """runs fn `calls` times (per_timing calls between synchronisations) under the profiler, each call
    inside a record_function range; returns (kernel rows, per-call rows) from the exported trace"""
    from torch.profiler import ProfilerActivity, profile as tprofile, record_function

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            with record_function("winattn_call_%d" % i):
                fn()
            if (i + 1) % per_timing == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                 key=lambda e: e["ts"])
    calls_ = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                     and str(e.get("name", "")).startswith("winattn_call_")), key=lambda e: e["ts"])
    # a call's GPU work: the records launched from inside its host range (their correlation ids
    # link them to the runtime calls made there)
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")]
    by_corr = {}
    for r in runtime:
        corr = r.get("args", {}).get("correlation")
        for c in calls_:
            if c["ts"] <= r["ts"] <= c["ts"] + c["dur"]:
                by_corr[corr] = c["name"]
                break
    per_call = {c["name"]: [] for c in calls_}
    for g in gpu:
        owner = by_corr.get(g.get("args", {}).get("correlation"))
        if owner is not None:
            per_call[owner].append(g)
    kernels = {}
    rows = []
    for c in calls_:
        work = per_call[c["name"]]
        if not work:
            continue
        for g in work:
            kernels.setdefault(g["name"], []).append(g["dur"])
        busy = sum(g["dur"] for g in work)
        span = max(g["ts"] + g["dur"] for g in work) - work[0]["ts"]
        rows.append((busy, span, work[0]["ts"] - c["ts"], c["dur"]))
    if not rows:
        print("    (no GPU records attributed to the calls: %d GPU records, %d runtime calls, %d ranges)"
              % (len(gpu), len(runtime), len(calls_)))
    return kernels, rows


def short(name, width=70):
    name = name.replace("void ", "")
    return name if len(name) <= width else name[:width - 3] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=cases, default=cases("b:32768,cw:16384"))
    ap.add_argument("--after-fa4", metavar="PEERS_DIR", help="first run FlashAttention 4's forward and backward at "
                    "each case's shape, as bench/gpu_peers.py does before winattn (installed by bench/peer_wheels.py)")
    ap.add_argument("--passes", default="bwd", help="fwd, bwd or fwd,bwd: which calls to time and profile (the "
                    "forward under torch.no_grad, as bench/gpu_peers.py times it)")
    ap.add_argument("--calls", type=int, default=6, help="calls profiled per mode (a multiple of 10 in steady mode is "
                                                         "rounded up)")
    args = ap.parse_args()
    if args.calls < 1:
        sys.exit("kernel_timeline.py: --calls must be at least 1")
    passes = args.passes.split(",")
    if not passes or any(x not in ("fwd", "bwd") for x in passes):
        sys.exit("kernel_timeline.py: --passes takes fwd, bwd or fwd,bwd, not %r" % args.passes)
    import torch

    if not torch.cuda.is_available():
        sys.exit("kernel_timeline.py: needs a CUDA GPU and torch built with CUDA")
    import winattn.torch as wt

    for label, n in args.cases:
        hq, hkv, d, window = SHAPES[label]
        g = torch.Generator(device="cuda").manual_seed(1)
        randn = lambda h: torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v = randn(hq).requires_grad_(), randn(hkv).requires_grad_(), randn(hkv).requires_grad_()
        do = randn(hq)
        win = (n - 1 if window is None else window - 1, 0)
        if args.after_fa4:
            from gpu_peers import measure_shape
            from peer_wheels import add_to_path

            add_to_path(args.after_fa4, "kernel_timeline")
            r = measure_shape(["fa4"], n, hq, hkv, d, window, 3)[0][0][1]
            print("FlashAttention 4 first, as in bench/gpu_peers.py: bwd %.3f ms per call, %.3f steady"
                  % (r["bwd_s"] * 1e3, r["bwd_steady_s"] * 1e3))
            torch.cuda.empty_cache()
        o = wt.attention(q, k, v, window=win)

        def forward():
            with torch.no_grad():
                return wt.attention(q, k, v, window=win)

        steps = {"fwd": ("forward", forward),
                 "bwd": ("backward", lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))}
        print("## (%s) %dK: Hq %d, Hkv %d, D %d, %s" % (label, n // 1024, hq, hkv, d,
                                                      "causal" if window is None else "window %d" % window))
        # first as bench/gpu_peers.py times it, with CUDA events and no profiler attached
        from gpu_peers import timed

        for which in passes:
            name, step = steps[which]
            print("%s, CUDA events as bench/gpu_peers.py: per call %.3f ms, steady %.3f ms (medians of 5)"
                  % (name, timed(step, 5) * 1e3, timed(step, 5, 10) * 1e3))
            for mode, per_timing, calls in (("per call", 1, args.calls), ("steady", 10, 10 * ((args.calls + 9) // 10))):
                kernels, rows = profile(step, calls, per_timing, torch)
                if not rows:
                    continue
                med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
                print("%s %s (%d calls): GPU busy %.3f ms, span %.3f ms (idle between kernels %.0f us), first kernel "
                      "%.0f us after the call starts, host range %.0f us (medians)"
                      % (name, mode, len(rows), med([r[0] for r in rows]) / 1e3, med([r[1] for r in rows]) / 1e3,
                         med([r[1] - r[0] for r in rows]), med([r[2] for r in rows]), med([r[3] for r in rows])))
                for kname, durs in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
                    print("    %8.3f ms x %.1f  %s" % (sum(durs) / len(durs) / 1e3, len(durs) / max(1, len(rows)),
                                                      short(kname)))
        cols, line = bench_row(label, n)
        print("winattn bench: %s" % line)
        print(flush=True)


if __name__ == "__main__":
    main()

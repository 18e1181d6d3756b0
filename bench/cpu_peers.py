#!/usr/bin/env python3
"""cpu_peers.py — winattn against the CPU attention a user could run instead, in one run on one
machine, printing one table.

Needs (installs nothing itself):
    pip install 'mlx[cpu]==0.32.4' mlx-lm torch numpy matplotlib
and a built winattn (`make`). Run from the repository root:
    python3 bench/cpu_peers.py [--quick] [--json docs/cpu-peers.json] [--plot docs/cpu-peers.png]
                               [--winattn PATH] [--compare PATH] [--skip mlx,...]

Systems:
  winattn          build/winattn bench (tiled kernels)
  winattn-compare  with --compare PATH: PATH bench, another build, right after winattn
  mlx              mx.fast.scaled_dot_product_attention with mlx-lm's sliding-window mask
                   (create_causal_mask(N, window_size=W)): what mlx-lm's Gemma trains through;
                   on CPU MLX always builds the full score matrix
  torch-mask       F.scaled_dot_product_attention with the same boolean mask (dense path), enable_gqa
  torch-flash      F.scaled_dot_product_attention(is_causal=True) without a mask: PyTorch's CPU
                   flash kernel (causal only: it has no window and no GQA)
  gemm             the machine's GEMM rate (torch.matmul; numpy's BLAS for f32) as the ceiling

Every peer runs in its own child process with an address-space limit below the free memory, so
one that would not fit fails with an allocation error (reported as OOM) instead of taking the
machine down; the parent reads the child's peak RSS from wait4(). Peak above inputs = peak RSS
minus the child's own peak after it created its inputs. TFLOP/s counts visible pairs
(docs/design.md §5: forward 4*D*pairs per query head, backward 2.5x forward); for the dense
peers that is the work a windowed kernel needs, not the work they do, so it measures
usefulness, not their arithmetic rate.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WINATTN = os.path.join(ROOT, "build", "winattn")


def visible_pairs(n, left, right):
    """Exact visible (query, key) pairs for Nq = Nk = n (bottom-right aligned window)."""
    total = 0
    for i in range(n):
        lo = 0 if left < 0 else max(0, i - left)
        hi = n - 1 if right < 0 else min(n - 1, i + right)
        total += max(0, hi - lo + 1)
    return total


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# ---- the child side: one peer, one shape, one length ----

CHILD = r'''
import json, resource, sys, time
cfg = json.loads(sys.argv[1])
sys_name, dt, B, Hq, Hkv, N, D, left, right = (cfg[k] for k in ("system", "dtype", "B", "Hq", "Hkv", "N", "D", "left", "right"))
reps = cfg["reps"]

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]

out = {}
if sys_name == "mlx":
    import mlx.core as mx
    from mlx_lm.models.base import create_causal_mask
    mx.set_default_device(mx.cpu)
    dtype = {"bf16": mx.bfloat16, "f16": mx.float16, "f32": mx.float32}[dt]
    mx.random.seed(0)
    q = mx.random.normal((B, Hq, N, D)).astype(dtype)
    k = mx.random.normal((B, Hkv, N, D)).astype(dtype)
    v = mx.random.normal((B, Hkv, N, D)).astype(dtype)
    g = mx.random.normal((B, Hq, N, D)).astype(dtype)
    if left < 0 and right < 0:
        mask = None
    else:
        mask = create_causal_mask(N, window_size=(left + 1) if left >= 0 else None)
    mx.eval(q, k, v, g, *( [mask] if mask is not None else []))
    base = peak()
    scale = D ** -0.5
    def fwd():
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        mx.eval(o)
    def fwdbwd():
        def f(q, k, v):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        o, grads = mx.vjp(f, [q, k, v], [g])
        mx.eval(o, grads)
    run_fwd, run_both = fwd, fwdbwd
elif sys_name in ("torch-mask", "torch-flash"):
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dt]
    q = torch.randn(B, Hq, N, D, dtype=dtype)
    k = torch.randn(B, Hkv, N, D, dtype=dtype)
    v = torch.randn(B, Hkv, N, D, dtype=dtype)
    g = torch.randn(B, Hq, N, D, dtype=dtype)
    mask = None
    if sys_name == "torch-mask":
        i = torch.arange(N)[:, None]
        j = torch.arange(N)[None, :]
        mask = torch.ones(N, N, dtype=torch.bool)
        if left >= 0: mask &= j >= i - left
        if right >= 0: mask &= j <= i + right
    base = peak()
    gqa = Hq != Hkv
    def call(q, k, v):
        if sys_name == "torch-flash":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    def fwd():
        with torch.no_grad():
            call(q, k, v)
    def fwdbwd():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = call(qq, kk, vv)
        o.backward(g)
    run_fwd, run_both = fwd, fwdbwd
elif sys_name == "gemm":
    import torch
    n = cfg["N"]
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dt]
    a = torch.randn(n, n, dtype=dtype); b = torch.randn(n, n, dtype=dtype)
    torch.matmul(a, b)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); torch.matmul(a, b); ts.append(time.perf_counter() - t0)
    out["torch_tflops"] = 2 * n ** 3 / median(ts) / 1e12
    if dt == "f32":
        import numpy as np
        x = np.random.rand(n, n).astype(np.float32); y = np.random.rand(n, n).astype(np.float32)
        x @ y
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter(); x @ y; ts.append(time.perf_counter() - t0)
        out["numpy_tflops"] = 2 * n ** 3 / median(ts) / 1e12
    print(json.dumps(out)); sys.exit(0)

t0 = time.perf_counter(); run_fwd(); warm = time.perf_counter() - t0  # warm-up
# a peer that needs more than 10 s per call is measured once, and its warm-up counts as the
# forward measurement (start-up costs are negligible at that scale); the table says so
slow = warm > 10.0
tf = [warm] if slow else []
for _ in range(0 if slow else reps):
    t0 = time.perf_counter(); run_fwd(); tf.append(time.perf_counter() - t0)
tb = []
for _ in range(1 if slow else reps):
    t0 = time.perf_counter(); run_both(); tb.append(time.perf_counter() - t0)
out.update(fwd_s=median(tf), fwdbwd_s=median(tb), base=base, single_run=slow)
print(json.dumps(out))
'''


def run_child(cfg):
    """Run one peer measurement in a child with an address-space cap; returns (result, peak_rss)."""
    limit = int(mem_available() * 0.85)

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    p = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, preexec_fn=cap, text=True)
    out, err = p.stdout.read(), p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        tail = (err.strip().splitlines() or ["exit %d" % p.returncode])[-1]
        oom = any(s in err for s in ("MemoryError", "out of memory", "Cannot allocate", "std::bad_alloc",
                                      "DefaultCPUAllocator", "[enforce fail", "Unable to allocate"))
        return {"error": "OOM" if oom else tail[:120]}, ru.ru_maxrss * 1024
    res = json.loads(out.strip().splitlines()[-1])
    return res, ru.ru_maxrss * 1024


def run_winattn(shape, n, reps, winattn=WINATTN):
    args = [winattn, "bench", "--n", str(n), "--dtype", shape["dtype"], "--hq", str(shape["Hq"]), "--hkv",
            str(shape["Hkv"]), "--d", str(shape["D"]), "--window-left", str(shape["left"]), "--window-right",
            str(shape["right"]), "--reps", str(reps), "--json", "/tmp/winattn-bench.json"]
    t0 = time.time()
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": p.stderr.strip()[:120]}
    row = json.load(open("/tmp/winattn-bench.json"))["rows"][0]
    return {"fwd_s": row["fwd_s"], "fwdbwd_s": row["fwd_s"] + row["bwd_s"], "peak_gb": row["rss_growth_gb"],
            "wall": time.time() - t0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small lengths only (a smoke test)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--skip", default="", help="comma-separated systems to leave out")
    ap.add_argument("--winattn", default=WINATTN, help="the winattn command to measure (default build/winattn)")
    ap.add_argument("--compare", default=None, metavar="PATH",
                    help="another winattn command (another build of the kernels), measured right after winattn at every "
                         "point as system winattn-compare; its time ratios are against winattn")
    ap.add_argument("--budget", type=float, default=400.0,
                    help="seconds: a peer whose next length is predicted (quadratically) to take longer is not run")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    for path in filter(None, (args.winattn, args.compare)):
        if not os.path.exists(path):
            sys.exit("cpu_peers.py: %s not found: run `make` first" % path)

    gemma = dict(B=1, Hq=32, Hkv=16, D=256, left=1023, right=0)
    causal = dict(B=1, Hq=8, Hkv=8, D=128, left=-1, right=0)
    ns_a = [1024, 2048] if args.quick else [4096, 8192, 16384]
    ns_b = [1024] if args.quick else [4096]
    plan = []
    for dt in ("bf16", "f32"):
        for n in ns_a:
            plan.append((dict(gemma, dtype=dt, name="(a) Gemma sliding W=1024"), n, ["winattn", "mlx", "torch-mask"]))
        for n in ns_b:
            plan.append((dict(causal, dtype=dt, name="(b) causal D=128"), n, ["winattn", "torch-flash", "mlx"]))

    if args.compare:
        plan = [(shape, n, systems[:1] + ["winattn-compare"] + systems[1:]) for shape, n, systems in plan]
    rows = []
    last = {}  # (shape, dtype, system) -> (N, fwd+bwd seconds): to skip runs predicted to take too long
    for shape, n, systems in plan:
        pairs = visible_pairs(n, shape["left"], shape["right"]) * shape["B"] * shape["Hq"]
        fwd_flops = 4.0 * shape["D"] * pairs
        ref = None
        for system in systems:
            if system in skip:
                continue
            if system in ("winattn", "winattn-compare"):
                r = run_winattn(shape, n, args.reps, args.winattn if system == "winattn" else args.compare)
                peak_gb = r.get("peak_gb")
            else:
                key = (shape["name"], shape["dtype"], system)
                if key in last and last[key][1] * (n / last[key][0]) ** 2 > args.budget:
                    predicted = last[key][1] * (n / last[key][0]) ** 2
                    r, peak_gb = {"error": "not run: ~%.0f s predicted (quadratic from N=%d)" % (predicted, last[key][0])}, None
                else:
                    cfg = dict(shape, system=system, N=n, reps=args.reps)
                    r, peak = run_child(cfg)
                    peak_gb = (peak - r["base"]) / 1e9 if "base" in r else None
                    if "fwdbwd_s" in r:
                        last[key] = (n, r["fwdbwd_s"] + r["fwd_s"])
            r.pop("peak_gb", None)
            row = dict(shape=shape["name"], dtype=shape["dtype"], N=n, system=system, peak_gb=peak_gb, **r)
            if "fwd_s" in r:
                row["fwd_tflops"] = fwd_flops / r["fwd_s"] / 1e12
                bwd_s = r["fwdbwd_s"] - r["fwd_s"]
                row["bwd_tflops"] = 2.5 * fwd_flops / bwd_s / 1e12 if bwd_s > 0 else None
            if system == "winattn" and "fwd_s" in r:
                ref = row
            if ref and "fwd_s" in row and system != "winattn":
                row["fwd_ratio"] = row["fwd_s"] / ref["fwd_s"]
                row["fwdbwd_ratio"] = row["fwdbwd_s"] / ref["fwdbwd_s"]
            rows.append(row)
            print_row(row, flush=True)
    gemm = {}
    for dt in ("bf16", "f32"):
        r, _ = run_child(dict(system="gemm", dtype=dt, B=1, Hq=1, Hkv=1, N=2048 if args.quick else 4096, D=1, left=0,
                              right=0, reps=args.reps))
        gemm[dt] = r
    print_table(rows, gemm)
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(dict(rows=rows, gemm=gemm, cpu=cpu_name(), command=" ".join(sys.argv)), f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    if args.plot:
        plot(rows, args.plot)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + " x%d" % os.cpu_count()
    except OSError:
        pass
    return "unknown"


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_row(r, flush=False):
    print("  %-26s %-4s N=%-6d %-12s %s" % (r["shape"], r["dtype"], r["N"], r["system"],
                                             r.get("error") or "fwd %.3fs fwd+bwd %.3fs" % (r["fwd_s"], r["fwdbwd_s"])),
          file=sys.stderr, flush=flush)


def print_table(rows, gemm):
    print("CPU: %s" % cpu_name())
    print("| shape | dtype | N | system | fwd s | fwd+bwd s | fwd TFLOP/s | bwd TFLOP/s | peak above inputs GB | fwd time / winattn | fwd+bwd time / winattn |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print("| %s | %s | %d | %s | %s | | | | | | |" % (r["shape"], r["dtype"], r["N"], r["system"], r["error"]))
            continue
        print("| %s | %s | %d | %s | %.3f%s | %.3f | %s | %s | %s | %s | %s |" % (
            r["shape"], r["dtype"], r["N"], r["system"], r["fwd_s"], " (1 run)" if r.get("single_run") else "", r["fwdbwd_s"], fmt(r.get("fwd_tflops"), ".3f"),
            fmt(r.get("bwd_tflops"), ".3f"), fmt(r.get("peak_gb"), ".2f"), fmt(r.get("fwd_ratio"), ".1f"),
            fmt(r.get("fwdbwd_ratio"), ".1f")))
    for dt, g in gemm.items():
        print("GEMM ceiling %s: %s" % (dt, ", ".join("%s %.3f TFLOP/s" % (k.replace("_tflops", ""), v)
                                                   for k, v in g.items() if k.endswith("tflops")) or g.get("error")))


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    sel = [r for r in rows if r["shape"].startswith("(a)") and r["dtype"] == "bf16"]
    for system in sorted(set(r["system"] for r in sel)):
        pts = [r for r in sel if r["system"] == system and "fwdbwd_s" in r]
        if not pts:
            continue
        ns = [r["N"] for r in pts]
        axes[0].plot(ns, [r["fwdbwd_s"] for r in pts], "o-", label=system)
        axes[1].plot(ns, [r["peak_gb"] for r in pts], "o-", label=system)
    for ax, title in zip(axes, ("forward + backward time (s)", "peak memory above inputs (GB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("bf16, Hq=32, Hkv=16, D=256, sliding window 1024 (Gemma 4 sliding layer), CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

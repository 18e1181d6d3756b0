"""cp_scaling.py — context parallelism on several GPUs against one: a Gemma-4-31B-shaped attention
stack, forward and backward, through winattn.distributed, with the alternatives measured in the
same run (K and V all-gathered, then FlexAttention or SDPA with each rank's mask).

    python3 bench/cp_scaling.py                      # every GPU here (spawns one process per GPU)
    torchrun --nproc-per-node 2 bench/cp_scaling.py  # the same under torchrun
    python3 bench/cp_scaling.py --device cpu --tiny  # 2 CPU processes, gloo, tiny sizes (a smoke run)
    python3 bench/cp_scaling.py --split-calls --tokens 16384   # one GPU: what cutting a layer into calls costs

The stack: 5 sliding layers (Hq 32, Hkv 16, D 256, window 1024 keys) and 1 global layer (Hq 32,
Hkv 4, D 512, causal), repeated (--repeat, 2), bf16, B = 1. Each layer's K and V depend on the
previous layer's output (a scalar from it), so no layer's communication can start before the
layer before it has finished, as in a model. Measured with only the attention in the layers
(projections and MLPs are token-local: they scale perfectly and would only dilute the figures).

Per method and stack (sliding layers alone, global layers alone, the whole stack): milliseconds
per forward+backward, tokens/s per GPU, attention TFLOP/s per GPU (the visible (query, key)
pairs x 4 D Hq FLOPs forward, x 3.5 with the backward), and each rank's peak memory (PyTorch's
max_memory_allocated, and the device memory in use after the run, which includes winattn's
backward workspace and PyTorch's cache). Runs: --tokens (32K) on 1 GPU, the same on 1 GPU at
world x --tokens (where it fits), and world x --tokens on world GPUs in the load-balanced layout
(a model with global layers uses it for all layers). Efficiencies:
- weak: tokens/s per GPU on world GPUs (world x tokens) over tokens/s on 1 GPU (tokens); for
  sliding layers, whose work per token does not grow with N, the ideal is 1. For global layers
  it is not: their work per token doubles with N; the FLOP-rate ratio is given beside it.
- strong: the time of world x tokens on 1 GPU over world x the time on world GPUs.
Before timing, a small case checks every method's output and gradients against one GPU (PASS/FAIL
lines). Prints a table; writes JSON to $OUT/cp_scaling.json when OUT is set (or --json PATH).
Needs only torch (and this repository's winattn, WINATTN_LIBRARY pointing at libwinattn.so).
"""
import argparse
import datetime
import json
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--nproc", type=int, default=0, help="processes to spawn (default: GPUs, or 2 on cpu)")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per GPU")
    p.add_argument("--repeat", type=int, default=2, help="copies of the 5 sliding + 1 global pattern")
    p.add_argument("--window", type=int, default=1024, help="sliding window in keys (Gemma's sliding_window)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--methods", default="winattn,gather-flex,gather-sdpa")
    p.add_argument("--no-single-large", action="store_true", help="skip world x tokens on 1 GPU")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run): 256 tokens per rank, "
                                                       "window 32, heads 4/2 and 4/1, head dims 32 and 64")
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="skip a measurement whose probe predicts more seconds than this")
    p.add_argument("--split-calls", action="store_true",
                   help="instead: on one GPU, one sliding layer as one call against the calls a rank makes of it")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.tiny:
        a.tokens, a.window = min(a.tokens, 256), min(a.window, 32)
    return a


def shapes(args):
    """(kind, Hq, Hkv, D, window) per layer"""
    if args.tiny:
        slide, glob = ("sliding", 4, 2, 32, args.window), ("global", 4, 1, 64, None)
    else:
        slide, glob = ("sliding", 32, 16, 256, args.window), ("global", 32, 4, 512, None)
    return ([slide] * 5 + [glob]) * args.repeat


def visible_pairs(n, window):
    if window is None:
        return n * (n + 1) // 2
    w = min(window, n)
    return w * (w + 1) // 2 + (n - w) * w


# ---- the methods: attention of one layer over this rank's tokens ----

class _GatherKV(torch.autograd.Function):
    """All-gather along the token dim (dim 2) in rank order; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group):
        world = dist.get_world_size(group)
        x = x.movedim(2, 0).contiguous()
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        ctx.group = group
        return out.movedim(0, 2)

    @staticmethod
    def backward(ctx, g):
        g = g.movedim(2, 0).contiguous()
        world = dist.get_world_size(ctx.group)
        out = g.new_empty((g.shape[0] // world,) + tuple(g.shape[1:]))
        dist.reduce_scatter_tensor(out, g, group=ctx.group)
        return out.movedim(0, 2), None


class Method:
    """attention(q, k, v, layer) for this rank's tokens of `layout` (None: one process, the whole
    sequence)."""

    def __init__(self, name, layout, rank, device, group=None):
        self.name, self.layout, self.rank, self.device, self.group = name, layout, rank, device, group
        n = layout.n if layout else None
        self.n = n
        self._masks = {}
        if layout is not None:
            pos = layout.positions(rank)
            # gathered K/V arrive in rank order: key row -> global position
            order = torch.cat([layout.positions(r) for r in range(layout.world)])
            self.qpos, self.kpos = pos.to(device), order.to(device)
        if name == "gather-flex":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            self._flex = torch.compile(flex_attention, dynamic=False)
            self._create_block_mask = create_block_mask

    def positions(self, nq):
        if self.layout is None:
            p = torch.arange(nq, device=self.device)
            return p, p
        return self.qpos, self.kpos

    def __call__(self, q, k, v, layer):
        kind, hq, hkv, d, window = layer
        left = -1 if window is None else window - 1
        if self.name == "winattn":
            if self.layout is None:
                import winattn.torch as wt
                return wt.attention(q, k, v, window=(left, 0), scale=1.0)
            import winattn.distributed as cp
            return cp.attention(q, k, v, self.layout, window=(left, 0), scale=1.0, group=self.group)
        if self.layout is not None:
            k, v = _GatherKV.apply(k, self.group), _GatherKV.apply(v, self.group)
        qpos, kpos = self.positions(q.shape[2])
        if self.name == "gather-sdpa":
            key = ("sdpa", left)
            if key not in self._masks:
                m = kpos[None, :] <= qpos[:, None]
                if left >= 0:
                    m &= kpos[None, :] >= qpos[:, None] - left
                self._masks[key] = m
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self._masks[key], scale=1.0,
                                                                    enable_gqa=True)
        if self.name == "gather-flex":
            key = ("flex", left, q.shape[2], k.shape[2])
            if key not in self._masks:
                def mask_mod(b, h, qi, ki):
                    qp, kp = qpos[qi], kpos[ki]
                    ok = kp <= qp
                    return ok & (kp >= qp - left) if left >= 0 else ok
                self._masks[key] = self._create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2],
                                                           device=self.device)
            return self._flex(q, k, v, block_mask=self._masks[key], scale=1.0, enable_gqa=True)
        raise ValueError("unknown method %s" % self.name)


# ---- one stack, forward and backward ----

def make_inputs(layers, n, device, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for kind, hq, hkv, d, _ in layers:
        t = [torch.randn(1, h, n, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
             for h in (hq, hkv, hkv)]
        out.append(t)
    return out


def run_stack(method, layers, inputs, weights=None):
    """Every layer in order, K and V of each depending on the previous output; returns the
    outputs (for the checks) after the backward of sum(o * weight) over the layers (weights: one
    tensor like each output, or None for a constant 1/1000)."""
    dep = None
    outs = []
    for layer, (q, k, v) in zip(layers, inputs):
        if dep is not None:
            k, v = k + dep, v + dep
        o = method(q, k, v, layer)
        outs.append(o)
        dep = o[:, :1, :1, :1].float().mean().to(o.dtype) * 0  # a dependency, not a value
    if weights is None:
        loss = sum(o.float().sum() for o in outs) * 1e-3
    else:
        loss = sum((o.float() * w).sum() for o, w in zip(outs, weights))
    loss.backward()
    return outs


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(method, layers, n_local, device, dtype, args, together):
    """Milliseconds per forward+backward of the stack (median of --iters after --warmup) and peak
    memory. A probe times the first layer alone once; when the whole measurement would exceed
    --budget-s, it stops there and says so (SDPA with a dense mask at 64K tokens, say). together:
    every rank runs it (collectives keep them in step), else this process alone."""
    if device.type == "cuda":  # what the last measurement left in PyTorch's cache (an OOM's, too)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    probe_in = make_inputs(layers[:1], n_local, device, dtype, seed=2)
    for _ in range(2 if method.name == "gather-flex" else 1):  # FlexAttention's first call compiles
        sync(device)
        t0 = time.perf_counter()
        run_stack(method, layers[:1], probe_in)
        sync(device)
        probe = time.perf_counter() - t0
    del probe_in
    t = torch.tensor([probe], device=device)
    if together:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    estimate = t.item() * len(layers) * (args.warmup + args.iters)
    if estimate > args.budget_s:
        return {"skipped": "one layer took %.1f s; the measurement would take ~%.0f s, "
                           "over --budget-s %g" % (t.item(), estimate, args.budget_s), "probe_layer_ms": 1e3 * t.item()}
    inputs = make_inputs(layers, n_local, device, dtype, seed=1)
    for _ in range(args.warmup):
        run_stack(method, layers, inputs)
    times = []
    for _ in range(args.iters):
        for t in (x for trip in inputs for x in trip):
            t.grad = None
        if together:
            dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        run_stack(method, layers, inputs)
        sync(device)
        times.append(time.perf_counter() - t0)
    out = {"ms": 1e3 * sorted(times)[len(times) // 2], "ms_all": [1e3 * t for t in times]}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out["peak_alloc_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
        out["device_used_gib"] = (total - free) / 2 ** 30
    del inputs
    return out


# ---- the check: every method on world ranks against winattn on one ----

def check(methods, layers_small, n, world, rank, device, dtype, group):
    import winattn.distributed as cp
    layout = cp.Layout.load_balanced(n, world)
    ref_inputs = make_inputs(layers_small, n, device, dtype, seed=3)
    g = torch.Generator(device="cpu").manual_seed(4)
    weights = [torch.randn(1, hq, n, d, generator=g).to(device) for _, hq, _, d, _ in layers_small]
    ref_outs = run_stack(Method("winattn", None, 0, device), layers_small, ref_inputs, weights)
    results = []
    for name in methods:
        try:
            inputs = [[layout.shard(t.detach(), rank).requires_grad_() for t in trip] for trip in ref_inputs]
            outs = run_stack(Method(name, layout, rank, device, group), layers_small, inputs,
                             [layout.shard(w, rank) for w in weights])
            worst = 0.0
            for o, ro, trip, rtrip in zip(outs, ref_outs, inputs, ref_inputs):
                pairs = [(o, layout.shard(ro.detach(), rank))]
                pairs += [(t.grad, layout.shard(rt.grad, rank)) for t, rt in zip(trip, rtrip)]
                for a, b in pairs:
                    e = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                    worst = max(worst, e)
            results.append((name, worst, None))
        except Exception as e:
            results.append((name, None, "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")))
    return results


# ---- driver ----

def worker(rank, world, args, port):
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl"
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        device = torch.device("cpu")
        backend = "gloo"
    if port is not None:
        dist.init_process_group(backend, init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=30))
    else:
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    dist.barrier()
    import winattn.distributed as cp
    dtype = torch.bfloat16
    layers = shapes(args)
    methods = [m for m in args.methods.split(",") if m]
    say = print if rank == 0 else (lambda *a, **k: None)
    say("cp_scaling: %d x %s, torch %s, %s, %d tokens per GPU, layers %s" % (
        world, torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", torch.__version__, backend,
        args.tokens, "+".join("%s(Hq %d Hkv %d D %d%s)" % (k, hq, hkv, d, "" if w is None else " W %d" % w)
                              for k, hq, hkv, d, w in layers[:6])), flush=True)

    # correctness first, at a size where every method runs
    small = [(k, min(hq, 4), min(hkv, 2), d, None if w is None else min(w, 48)) for k, hq, hkv, d, w in layers[:6]]
    n_check = 512 * 2 * world  # equal shards (the alternatives gather equal pieces), chunks with edges and interiors
    for name, err, why in check(methods, small, n_check, world, rank, device, dtype, None):
        t = torch.tensor([err if err is not None else float("inf")], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        err = t.item()
        if why:
            say("SKIP check %s: %s" % (name, why))
        else:
            say("%s check %s vs winattn on one GPU: bf16, %d tokens over %d ranks, worst rel err %.1e (tol 3e-2)"
                % ("PASS" if err <= 3e-2 else "FAIL", name, n_check, world, err), flush=True)

    stacks = {"sliding": [x for x in layers if x[0] == "sliding"], "global": [x for x in layers if x[0] == "global"],
              "all": layers}
    n1, nw = args.tokens, args.tokens * world
    runs = [("1 GPU", 1, n1)]
    if not args.no_single_large and world > 1:
        runs.append(("1 GPU", 1, nw))
    if world > 1:
        runs.append(("%d GPUs" % world, world, nw))
    results = []
    for method in methods:
        for label, gpus, n in runs:
            for stack, ls in stacks.items():
                if method != "winattn" and stack == "all":
                    continue  # the alternatives: sliding and global alone (all = their sum, plus noise)
                rec = {"method": method, "stack": stack, "gpus": gpus, "tokens": n, "layers": len(ls)}
                err = None
                try:
                    if gpus == 1:
                        if rank == 0:
                            rec.update(measure(Method(method, None, 0, device), ls, n, device, dtype, args, False))
                    else:
                        layout = cp.Layout.load_balanced(n, world)
                        m = Method(method, layout, rank, device)
                        rec.update(measure(m, ls, layout.local_length(rank), device, dtype, args, True))
                except Exception as e:
                    err = "%s: %s" % (type(e).__name__, (str(e).splitlines() or [""])[0][:160])
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                # every rank agrees on the outcome (a failure on one rank fails the run)
                flag = torch.tensor([1.0 if err else 0.0], device=device)
                dist.all_reduce(flag)
                if gpus > 1 and not flag.item():
                    vals = torch.tensor([rec.get("ms", 0.0), rec.get("peak_alloc_gib", 0.0),
                                         rec.get("device_used_gib", 0.0)], device=device)
                    gathered = [torch.zeros_like(vals) for _ in range(world)]
                    dist.all_gather(gathered, vals)
                    if "ms" in rec:
                        rec["ms"] = max(g[0].item() for g in gathered)  # the slowest rank's median
                        if device.type == "cuda":
                            rec["per_rank_peak_alloc_gib"] = [g[1].item() for g in gathered]
                            rec["per_rank_device_used_gib"] = [g[2].item() for g in gathered]
                if flag.item():
                    rec = {k: rec[k] for k in ("method", "stack", "gpus", "tokens", "layers")}
                    rec["error"] = err or "failed on another rank"
                elif "skipped" in rec:
                    rec["error"] = "skipped: " + rec.pop("skipped")
                elif "ms" in rec:
                    flops = 3.5 * sum(4 * hq * d * visible_pairs(n, w) for _, hq, _, d, w in ls)
                    rec["tokens_per_s_per_gpu"] = n / (rec["ms"] / 1e3) / gpus
                    rec["tflops_per_gpu"] = flops / (rec["ms"] / 1e3) / gpus / 1e12
                results.append(rec)
                say("  %-12s %-8s %-7s %6d tokens: %s" % (method, stack, label, n, (
                    "%.1f ms" % rec["ms"]) if "ms" in rec else rec.get("error")), flush=True)
                dist.barrier()

    if rank == 0:
        summary = summarize(results, world, n1, nw)
        table(results, summary, world)
        doc = {"world": world, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "backend": backend, "tokens_per_gpu": args.tokens,
               "layers": [list(x) for x in layers], "warmup": args.warmup, "iters": args.iters,
               "command": " ".join(sys.argv), "results": results, "efficiency": summary}
        path = args.json or (os.path.join(os.environ["OUT"], "cp_scaling.json") if os.environ.get("OUT") else None)
        if path:
            with open(path, "w") as f:
                json.dump(doc, f, indent=1)
            print("wrote %s" % path)
    dist.barrier()
    dist.destroy_process_group()


def summarize(results, world, n1, nw):
    def get(method, stack, gpus, n):
        for r in results:
            if (r["method"], r["stack"], r["gpus"], r["tokens"]) == (method, stack, gpus, n) and "ms" in r:
                return r
        return None
    out = []
    for method in sorted({r["method"] for r in results}):
        for stack in ("sliding", "global", "all"):
            one, big, many = get(method, stack, 1, n1), get(method, stack, 1, nw), get(method, stack, world, nw)
            if many is None:
                continue
            row = {"method": method, "stack": stack}
            if one:
                row["weak_tokens"] = many["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
                row["weak_flops"] = many["tflops_per_gpu"] / one["tflops_per_gpu"]
            if big:
                row["strong"] = big["ms"] / (world * many["ms"])
            ref = get("winattn", stack, world, nw)
            if ref and method != "winattn":
                row["time_vs_winattn"] = many["ms"] / ref["ms"]
            out.append(row)
    return out


def table(results, summary, world):
    print("\n%-12s %-8s %-4s %7s %10s %12s %11s  %s" % ("method", "stack", "GPUs", "tokens", "ms", "tok/s/GPU",
                                                        "TFLOP/s/GPU", "peak GiB per rank (torch;device)"))
    for r in results:
        if "ms" not in r:
            print("%-12s %-8s %-4d %7d %s" % (r["method"], r["stack"], r["gpus"], r["tokens"], r["error"]))
            continue
        mem = "-"
        if "per_rank_peak_alloc_gib" in r:
            pairs = zip(r["per_rank_peak_alloc_gib"], r["per_rank_device_used_gib"])
            mem = " ".join("%.1f;%.1f" % p for p in pairs)
        elif "peak_alloc_gib" in r:
            mem = "%.1f;%.1f" % (r["peak_alloc_gib"], r["device_used_gib"])
        print("%-12s %-8s %-4d %7d %10.1f %12.0f %11.3g  %s" % (
            r["method"], r["stack"], r["gpus"], r["tokens"], r["ms"], r["tokens_per_s_per_gpu"], r["tflops_per_gpu"],
            mem))
    print("\nefficiency on {w} GPUs: weak = tokens/s per GPU (or TFLOP/s per GPU) at {w} x tokens on {w} GPUs over "
          "tokens on 1; strong = time on 1 GPU / ({w} x time on {w} GPUs), same tokens".format(w=world))
    for s in summary:
        print("  %-12s %-8s weak %s (FLOP rate %s), strong %s%s" % (
            s["method"], s["stack"], "%.3f" % s["weak_tokens"] if "weak_tokens" in s else "-",
            "%.3f" % s["weak_flops"] if "weak_flops" in s else "-",
            "%.3f" % s["strong"] if "strong" in s else "-",
            ", time %.2fx winattn's" % s["time_vs_winattn"] if "time_vs_winattn" in s else ""))


def split_calls(args):
    """One sliding layer of --tokens queries on one device, forward and backward, as one call and as
    the calls context parallelism cuts it into (no communication): two chunks (the load-balanced
    layout's two runs), and the second run cut into a left edge and an interior reading its keys
    in place, with the interior's key offset at window - 1 and rounded up to 128."""
    import winattn.torch  # noqa: F401  (torch.ops.winattn)
    dev = torch.device(args.device)
    n, hq, hkv, d, w = args.tokens, 32, 16, 256, args.window
    if args.tiny:
        hq, hkv, d = 4, 2, 32
    L, c = w - 1, args.tokens // 2
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, d, generator=g).to(dev, torch.bfloat16).transpose(0, 1).unsqueeze(0)
               for h in (hq, hkv, hkv))  # transformers' [N, H, D] memory as [1, H, N, D]
    up = -(-L // 128) * 128
    variants = [
        ("one call", [(0, n, 0, n)]),
        ("two chunks", [(0, c, 0, c), (c, n, c - L, n)]),
        ("chunk, edge %d, interior (offset %d)" % (L, L), [(0, c, 0, c), (c, c + L, c - L, c + L), (c + L, n, c, n)]),
        ("chunk, edge %d, interior (offset %d)" % (up, up),
         [(0, c, 0, c), (c, c + up, c - L, c + up), (c + up, n, c, n)])]

    def fwd(calls):
        out = []
        for q0, q1, k0, k1 in calls:
            o, lse = torch.ops.winattn.forward(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], L, 0, 1.0, 0.0, False)
            out.append((q0, q1, k0, k1, o, lse))
        return out

    def bwd(outs):
        for q0, q1, k0, k1, o, lse in outs:
            torch.ops.winattn.backward(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], o, lse, o, L, 0, 1.0, 0.0,
                                       False)

    def ms(f, reps=10):
        for _ in range(3):
            f()
        ts = []
        for _ in range(reps):
            sync(dev)
            t0 = time.perf_counter()
            f()
            sync(dev)
            ts.append(1e3 * (time.perf_counter() - t0))
        return sorted(ts)[reps // 2]
    print("split-calls: one sliding layer (Hq %d, Hkv %d, D %d, window %d), %d tokens, bf16, %s" % (
        hq, hkv, d, w, n, torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"))
    rows = []
    for name, calls in variants:
        outs = fwd(calls)
        tf, tb = ms(lambda: fwd(calls)), ms(lambda: bwd(outs))
        rows.append({"variant": name, "forward_ms": tf, "backward_ms": tb})
        print("  %-40s forward %.3f ms, backward %.3f ms, total %.3f ms" % (name, tf, tb, tf + tb))
    buf = torch.empty(2, 1, hkv, n + L, d, device=dev, dtype=torch.bfloat16)

    def copy_kv():
        buf[0, :, :, L:] = k
        buf[1, :, :, L:] = v
    t = ms(copy_kv)
    rows.append({"variant": "copy K and V into a buffer with a halo", "ms": t})
    print("  %-40s %.3f ms" % ("copy K and V into a buffer with a halo", t))
    path = args.json or (os.path.join(os.environ["OUT"], "cp_split_calls.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump({"command": " ".join(sys.argv), "tokens": n, "window": w, "results": rows}, f, indent=1)


def main():
    args = parse()
    if args.split_calls:
        split_calls(args)
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return
    world = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if world < 1:
        sys.exit("cp_scaling: no GPU found; --device cpu runs on the CPU")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp
    try:
        mp.spawn(worker, args=(world, args, port), nprocs=world, join=True)
    except Exception:
        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""gpu_peers.py — winattn on CUDA against the GPU attention a PyTorch user could run instead, in one
run on one GPU, printing one table (markdown) and optionally writing JSON.

Needs torch (2.5 or later, for FlexAttention and enable_gqa) with CUDA, and winattn built with
nvcc (`make`). Run from the repository root on the GPU machine:
    python3 bench/gpu_peers.py [--quick] [--lengths N,...] [--reps R] [--json docs/gpu-peers.json]
        [--systems S,...] [--shapes a,b,c,cw] [--baseline SYSTEM] [--peers-dir /tmp/winattn-peers]
FlashAttention 4, ffpa-attn and cuDNN's frontend come as wheels installed by bench/peer_wheels.py
(the GPU machine reaches no registry); --peers-dir names where it installed them. A system that
cannot be imported or set up at a shape gets a row with its error in one line; the others run.

The cuDNN row on the GPU machine, from a checkout where PyPI is reachable
(`python3 bench/peer_wheels.py fetch --dir .peer-wheels` writes groups 1 to 3), one group carried
per command while the machine stays warm:
    python3 bench/peer_wheels.py stash .peer-wheels/1
    python3 bench/peer_wheels.py stash .peer-wheels/2
    python3 bench/peer_wheels.py stash .peer-wheels/3 && python3 bench/peer_wheels.py install
    make -j16 lib && python3 bench/gpu_peers.py --peers-dir /tmp/winattn-peers --systems winattn,fa4,cudnn \
        --baseline winattn --shapes a,b --lengths 8192,32768 --reps 3 --json docs/gpu-peers-cudnn.json

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
  cudnn        cuDNN's fused SDPA (the library's own engines, cuDNN 9.19 as torch 2.11's
               nvidia-cudnn-cu13 brings it) through the graph API of nvidia-cudnn-frontend 1.32.0:
               forward and backward graphs built once per shape with the diagonal band, right
               bound 0 and left bound W (key j seen by query i iff i - W < j <= i, winattn's
               (W - 1, 0)), executed per call with one workspace on torch's stream, on its own
               [B, N, H, D] layout; GQA native. The frontend's own CuTe-DSL kernels, which it also
               ranks, are not built (cudnn_sdpa). PyTorch's cuDNN backend of
               scaled_dot_product_attention is not this peer: SDPA takes no window, only
               is_causal or an attn_mask that cuDNN applies as a dense bias (work of sdpa-mask)

Shapes (the issue's): (a) B=1, Hq=32, Hkv=16, D=256, sliding window 1024, N = 8K, 16K, 32K;
(b) Hq=32, Hkv=8, D=128, window 4096, N = 8K, 32K; (c) Hq=32, Hkv=4, D=512, causal, N = 8K, 16K;
(cw) as (c) with a window of 1024, N = 16K.

Correctness, in the note column: every system's o, dq, dk and dv against the first system's in
--systems at that shape (the largest difference over the four, relative to the reference's largest
magnitude and absolute), and every system's o against attention in fp32 at the window's edge rows
(rows 0, 1, W - 2 to W + 1, N/2 and N - 1, all heads: the rows a band one key off changes), as the
largest absolute error ("o vs fp32"; sdpa-flash, without the window, is in neither).

TFLOP/s counts visible (query, key) pairs of the mask each system computes (docs/design.md §5:
forward 4*D*pairs per query head, backward 2.5x forward). The systems of a shape are set up together,
warmed up (two calls each), then timed in --reps rounds of one timing each, the order rotating
every round: the GPU runs hotter and, under its 700 W limit, at lower clocks after a system's
sustained calls, so timing one system after another favoured whichever ran first (FA4's steady
backward at (b) 32K: 540 TFLOP/s timed first, 490 timed after winattn, in two runs of the same
kernels, one in each order; docs/gpu-peers.md). Each time is the median
of its rounds, timed with CUDA events, two ways: one call per event pair with a synchronise
after it ("per call": the GPU also waits for the host's work before the first kernel, Python and
launch overhead included), and 10 calls back to back per event pair ("steady": as in a training
step, where the host runs ahead of the GPU; taken as the per-call time where one call takes 0.1 s
or more); beside the medians, each time's spread over the rounds, (slowest - fastest) / median, in
the table's spread column and the JSON's *_spread keys. Backward peak memory above inputs: PyTorch's
max_memory_allocated during one backward minus what was allocated before it (q, k, v, dO and the
forward's output and saved tensors), so it counts dQ, dK, dV and the system's scratch; winattn's
own workspace (delta and lse*log2(e), 2*B*Hq*N floats with N rounded up to 64, plus for its
default backward at D <= 128 an f32 dQ accumulator of B*Hq*N*D floats) comes from the CUDA
stream-ordered pool, outside PyTorch's allocator, and is added explicitly; so is the backward
workspace cuDNN's plan asks for, allocated once with its graphs.
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


# label -> (Hq, Hkv, D, window)
SHAPE_OF = {label: (hq, hkv, d, window) for label, hq, hkv, d, window, _ in SHAPES}


def shape_cases(text):
    """argparse type of bench/kernel_timeline.py's and bench/call_gap.py's --cases: SHAPE:N pairs of SHAPES, comma-separated"""
    out = []
    for c in text.split(","):
        label, _, n = c.partition(":")
        if label not in SHAPE_OF or not n.isdigit() or int(n) <= 0:
            raise argparse.ArgumentTypeError("--cases takes SHAPE:N pairs (SHAPE one of %s, N a positive length), not %r"
                                             % (", ".join(SHAPE_OF), c))
        out.append((label, int(n)))
    return out


def lengths_arg(text):
    """argparse type of --lengths: comma-separated positive lengths"""
    out = [int(t) for t in text.split(",") if t.isdigit() and int(t) > 0]
    if len(out) != len(text.split(",")):
        raise argparse.ArgumentTypeError("--lengths takes positive lengths separated by commas, not %r" % text)
    return out


def pairs(n, window):
    """Visible pairs for Nq = Nk = n: a causal window of `window` keys including self, or causal."""
    w = n if window is None else min(window, n)
    return n * w - w * (w - 1) // 2


def time_once(fn, calls=1):
    """seconds per call of `calls` back-to-back calls of fn, between one pair of CUDA events"""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / calls


def timed(fn, reps, calls=1):
    """median seconds per call over reps timings of `calls` back-to-back calls each, after two
    warm-up calls (one system alone; main() interleaves the systems instead)"""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    return statistics.median(time_once(fn, calls) for _ in range(reps))


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
    if name == "cudnn":
        return cudnn_sdpa(n, hq, hkv, d, window)
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


CUDNN_HANDLE = None  # one cuDNN handle for every shape's graphs (cudnn_sdpa)


def cudnn_sdpa(n, hq, hkv, d, window):
    """make_system's "cudnn": cuDNN's fused SDPA through the cudnn-frontend graph API, forward and
    backward graphs built once for this shape and executed per call on torch's current stream with
    one workspace. The band is cuDNN's diagonal band, TOP_LEFT aligned (the same as winattn's
    bottom-right alignment here, Nq = Nk): right bound 0 (causal) and left bound W, which keeps key j
    for query i iff i - W < j <= i, winattn's window (W - 1, 0). Only plans of the cuDNN library's
    own engines are built: the frontend also ranks its own CuTe-DSL kernels and open-source engines,
    which are not the library's."""
    import cudnn
    from cudnn.engines.engine_ids import is_backend_engine

    global CUDNN_HANDLE
    if CUDNN_HANDLE is None:
        CUDNN_HANDLE = cudnn.create_handle()
    handle = CUDNN_HANDLE
    bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    band = {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "diagonal_band_right_bound": 0}
    if window is not None:
        band["diagonal_band_left_bound"] = window
    scale = d ** -0.5

    def bnhd(h):  # cuDNN describes [B, H, N, D]; the buffers are contiguous [B, N, H, D]
        return {"dim": [1, h, n, d], "stride": [n * h * d, d, h * d, 1], "data_type": bf16}

    def new_graph():
        return cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    fwd = new_graph()
    fq, fk, fv = fwd.tensor(name="q", **bnhd(hq)), fwd.tensor(name="k", **bnhd(hkv)), fwd.tensor(name="v", **bnhd(hkv))
    fo, fstats = fwd.sdpa(name="sdpa", q=fq, k=fk, v=fv, generate_stats=True, attn_scale=scale, **band)
    fo.set_output(True).set_dim(bnhd(hq)["dim"]).set_stride(bnhd(hq)["stride"]).set_data_type(bf16)
    fstats.set_output(True).set_dim([1, hq, n, 1]).set_stride([hq * n, n, 1, 1]).set_data_type(f32)

    bwd = new_graph()
    bq, bk, bv = bwd.tensor(name="q", **bnhd(hq)), bwd.tensor(name="k", **bnhd(hkv)), bwd.tensor(name="v", **bnhd(hkv))
    bo, bdo = bwd.tensor(name="o", **bnhd(hq)), bwd.tensor(name="dO", **bnhd(hq))
    bstats = bwd.tensor(name="stats", dim=[1, hq, n, 1], stride=[hq * n, n, 1, 1], data_type=f32)
    bdq, bdk, bdv = bwd.sdpa_backward(name="sdpa_backward", q=bq, k=bk, v=bv, o=bo, dO=bdo, stats=bstats,
                                      attn_scale=scale, **band)
    for t, h in ((bdq, hq), (bdk, hkv), (bdv, hkv)):
        t.set_output(True).set_dim(bnhd(h)["dim"]).set_stride(bnhd(h)["stride"]).set_data_type(bf16)

    def build_on_library(graph, what):
        """builds the best-ranked plan of the cuDNN library's engines that builds; returns its name"""
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        declined = []
        for index, plan in enumerate(graph.plans):
            if not is_backend_engine(plan.engine_id):
                continue
            try:
                graph.select_plan(index)
                graph.check_support()
                graph.build_plans()
                return graph.get_plan_name_at_index(index)
            except (cudnn.cudnnGraphNotSupportedError, NotImplementedError, RuntimeError) as e:
                declined.append(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        raise RuntimeError("cuDNN %s: no library plan builds (%d declined%s)"
                           % (what, len(declined), ": " + declined[0] if declined else ""))

    fwd.validate()  # both graphs' arguments checked before either is planned
    bwd.validate()
    fwd_plan, bwd_plan = build_on_library(fwd, "forward"), build_on_library(bwd, "backward")
    bwd_workspace = bwd.get_workspace_size()
    workspace = torch.empty(max(fwd.get_workspace_size(), bwd_workspace, 1), dtype=torch.uint8, device="cuda")

    def on_current_stream():
        cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)

    def as_bhnd(x):  # the [B, H, N, D] view cuDNN's descriptors state, on the same memory
        return x.transpose(1, 2)

    class CudnnAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            o = torch.empty_like(q)
            stats = torch.empty(1, hq, n, 1, dtype=torch.float32, device=q.device)
            on_current_stream()
            fwd.execute({fq: as_bhnd(q), fk: as_bhnd(k), fv: as_bhnd(v), fo: as_bhnd(o), fstats: stats}, workspace,
                        handle=handle)
            ctx.save_for_backward(q, k, v, o, stats)
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, stats = ctx.saved_tensors
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            on_current_stream()
            bwd.execute({bq: as_bhnd(q), bk: as_bhnd(k), bv: as_bhnd(v), bo: as_bhnd(o), bdo: as_bhnd(do.contiguous()),
                         bstats: stats, bdq: as_bhnd(dq), bdk: as_bhnd(dk), bdv: as_bhnd(dv)}, workspace, handle=handle)
            return dq, dk, dv

    note = "cuDNN %s, plans %s / %s" % (cudnn.backend_version_string(), fwd_plan[:24], bwd_plan[:24])
    return CudnnAttention.apply, note, bwd_workspace, "bnhd"


class Trial:
    """one system set up at one shape: its inputs, a forward output to differentiate, and the
    timings main() collects into it"""

    def __init__(self, name, n, hq, hkv, d, window):
        torch.manual_seed(0)
        self.name, self.n, self.hq, self.d, self.window = name, n, hq, d, window
        self.attn, self.note, self.extra, self.layout = make_system(name, n, hq, hkv, d, window)
        g = torch.Generator(device="cuda").manual_seed(1)

        def randn(h):  # the same values in either layout; contiguous in the system's own
            x = torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
            return x.transpose(1, 2).contiguous() if self.layout == "bnhd" else x

        self.q, self.k, self.v = randn(hq).requires_grad_(), randn(hkv).requires_grad_(), randn(hkv).requires_grad_()
        self.do = randn(hq)
        self.o = self.attn(self.q, self.k, self.v)
        self.times = {"fwd_s": [], "fwd_steady_s": [], "bwd_s": [], "bwd_steady_s": []}

    def flops(self):
        """the forward's FLOPs on the visible pairs this system computes (sdpa-flash: all causal
        pairs, having no window)"""
        return 4.0 * self.d * pairs(self.n, None if self.name == "sdpa-flash" else self.window) * self.hq

    def fwd(self):
        with torch.no_grad():
            return self.attn(self.q, self.k, self.v)

    def bwd(self):
        return torch.autograd.grad(self.o, (self.q, self.k, self.v), self.do, retain_graph=True)

    def warm_up(self):
        for _ in range(2):
            self.fwd()
            self.bwd()
        torch.cuda.synchronize()

    def time_one_rep(self):
        """one timing of each: a call per event pair, then 10 back to back (that one skipped, and
        the single call's time taken, where a call lasts 0.1 s or more)"""
        for key, fn in (("fwd", self.fwd), ("bwd", self.bwd)):
            once = time_once(fn)
            self.times[key + "_s"].append(once)
            self.times[key + "_steady_s"].append(time_once(fn, 10) if once < 0.1 else once)

    def result(self, ref=None):
        """the medians, the backward's peak memory and the outputs' agreement with ref (the first
        system's o, dq, dk, dv at this shape, [B, H, N, D]; an empty list is filled instead)"""
        r = {key: statistics.median(ts) for key, ts in self.times.items()}
        # each time's spread over the rounds: (slowest - fastest) / median
        r.update({key + "_spread": (max(ts) - min(ts)) / statistics.median(ts) for key, ts in self.times.items()})
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = self.bwd()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base + self.extra
        outs = [x.transpose(1, 2) if self.layout == "bnhd" else x for x in [self.o.detach()] + list(grads)]
        agree = agree_abs = None
        if ref is not None and not ref:
            ref.extend(x.clone() for x in outs)
        elif ref:
            diffs = [((x.float() - r_.float()).abs().max().item(), r_.float().abs().max().item())
                     for x, r_ in zip(outs, ref)]
            agree, agree_abs = max(dx / mx for dx, mx in diffs), max(dx for dx, _ in diffs)
        fp32_err = None
        if self.name != "sdpa-flash":  # without the window its rows are not the window's
            qkv = [x.detach().transpose(1, 2) if self.layout == "bnhd" else x.detach()
                   for x in (self.q, self.k, self.v)]
            rows = band_edge_rows(self.n, self.window)
            fp32_err = (outs[0][0, :, rows].float() - reference_rows(*qkv, self.window, rows)).abs().max().item()
        del grads, outs
        flops = self.flops()
        r.update({"fwd_tflops": flops / r["fwd_s"] / 1e12, "bwd_tflops": 2.5 * flops / r["bwd_s"] / 1e12,
                  "fwd_steady_tflops": flops / r["fwd_steady_s"] / 1e12,
                  "bwd_steady_tflops": 2.5 * flops / r["bwd_steady_s"] / 1e12, "bwd_peak_gb": peak / 1e9,
                  "note": self.note, "max_rel_diff_vs_first": agree, "max_abs_diff_vs_first": agree_abs,
                  "o_max_abs_err_vs_fp32_rows": fp32_err})
        return r


def band_edge_rows(n, window):
    """the query rows reference_rows checks: the first two, the last two before row W - 1 (the first
    to see W keys), row W (the first to drop key 0) and W + 1, the middle and the last row; a band
    one key wider or narrower than the window changes rows from W - 1 on"""
    w = n if window is None else window
    return sorted({i for i in (0, 1, w - 2, w - 1, w, w + 1, n // 2, n - 1) if 0 <= i < n})


def reference_rows(q, k, v, window, rows):
    """attention in fp32 at the given query rows of [1, H, N, D] tensors (GQA: query head h reads
    kv head h // (Hq / Hkv)), query i seeing keys j with i - W < j <= i (every j <= i when window is
    None): [Hq, len(rows), D]"""
    hkv, d = k.shape[1], k.shape[-1]
    out = []
    for i in rows:
        lo = 0 if window is None else max(0, i - window + 1)
        keys, values = k[0, :, lo:i + 1].float(), v[0, :, lo:i + 1].float()  # [Hkv, m, D]
        query = q[0, :, i].float().view(hkv, -1, d)  # [Hkv, group, D]: the heads sharing a kv head
        scores = torch.einsum("hgd,hmd->hgm", query, keys) * d ** -0.5
        out.append(torch.einsum("hgm,hmd->hgd", scores.softmax(-1), values).reshape(-1, d))
    return torch.stack(out, 1)


def measure_shape(names, n, hq, hkv, d, window, reps):
    """every system in names at one shape, interleaved: set up all, warm all up, then reps rounds
    that time each system once, the order rotating every round, so that no system always runs in
    the heat (and lower clocks, under the 700 W limit) the one before it left. Returns
    ([(name, result or {"error": ...})] in the order of names, the name whose outputs the others'
    were compared with)"""
    out = {}

    def skipped(name, error):  # a peer that cannot run this shape says why in the table
        out[name] = {"error": error}

    trials = trials_at(names, n, (hq, hkv, d, window), skipped)
    for rep in range(reps):
        for t in rotated(trials, rep):
            if t.name in out:
                continue
            try:
                t.time_one_rep()
            except Exception as e:
                out[t.name] = {"error": short_error(e)}
    ref, ref_name = [], None  # the first system with outputs gives the reference
    for t in trials:
        if t.name in out:
            continue
        try:
            out[t.name] = t.result(ref if t.name != "sdpa-flash" else None)
            ref_name = ref_name or (t.name if ref else None)
        except Exception as e:
            out[t.name] = {"error": short_error(e)}
    del trials
    torch.cuda.empty_cache()
    return [(name, out[name]) for name in names if name in out], ref_name


def one_shape_args(ap, n):
    """the arguments of the tools that measure one shape (bench/call_gap.py): --peers-dir, --systems, --shape,
    --n (default n)"""
    ap.add_argument("--peers-dir", help="where bench/peer_wheels.py installed the peers")
    ap.add_argument("--systems", default="fa4,winattn")
    ap.add_argument("--shape", default="b", help="a shape of bench/gpu_peers.py (a, b, c, cw)")
    ap.add_argument("--n", type=int, default=n)


def trials_at(names, n, shape, skipped):
    """the systems `names` set up and warmed up at length n and shape (Hq, Hkv, D, window), a
    value of SHAPE_OF; skipped(name, error text) for each that cannot run it (an unknown system, or
    a peer without this shape), which is left out"""
    trials = []
    for name in names:
        try:
            t = Trial(name, n, *shape)
            t.warm_up()
        except Exception as e:
            skipped(name, short_error(e))
            continue
        trials.append(t)
    return trials


def rotated(items, r):
    """items starting at r modulo their count: round r of an interleaved timing, so that no system
    always runs in the heat the one before it left"""
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def spin_gpu(ms):
    """queue ms of GPU spinning on the current stream (torch.cuda._sleep's cycles at the H200's
    highest SM clock, 1.98 GHz: at a lower clock the spin lasts longer)"""
    torch.cuda._sleep(int(ms * 1.98e6))


def warmed_trials(tool, names, label, n):
    """trials_at for the tools that measure one shape (tool names them in errors): exits
    on an unknown shape or a system that cannot run it"""
    if label not in SHAPE_OF:
        sys.exit("%s: --shape %s: not one of %s" % (tool, label, ", ".join(SHAPE_OF)))

    def stop(name, error):
        sys.exit("%s: %s at (%s) %d: %s" % (tool, name, label, n, error))

    return trials_at(names, n, SHAPE_OF[label], stop)


def short_error(e):
    text = str(e).strip().splitlines()
    line = next((t for t in text if "Error" in t or "error" in t), text[0] if text else type(e).__name__)
    return (type(e).__name__ + ": " + line)[:90]


def main():
    torch._dynamo.config.recompile_limit = 64
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="first length of each shape only")
    ap.add_argument("--lengths", type=lengths_arg, help="only these of each shape's lengths (N,...)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--systems", default="flex,winattn,winattn-det,sdpa-flash,sdpa-mask",
                    help="the first that runs gives the outputs the others' are compared with (sdpa-flash, "
                         "without the window, is not compared)")
    ap.add_argument("--shapes", default="a,b,c")
    ap.add_argument("--json")
    ap.add_argument("--baseline", default="flex", help="the system the ratio columns divide by (first in --systems)")
    ap.add_argument("--peers-dir",
                    help="where bench/peer_wheels.py installed flash-attn-4, ffpa-attn and cudnn-frontend")
    args = ap.parse_args()
    if args.peers_dir:
        from peer_wheels import add_to_path

        add_to_path(args.peers_dir, "gpu_peers")
    eager = None
    if any(name.startswith("winattn") for name in args.systems.split(",")):
        import winattn.torch as wt

        eager = wt.eager_path()  # which autograd path winattn's rows take (the kernels are the same)
    print("gpu_peers: %s, torch %s, %s%s" % (torch.cuda.get_device_name(), torch.__version__, time.strftime("%Y-%m-%d"),
                                            ", winattn.torch's eager path: %s" % eager if eager else ""))
    print("| shape | N | system | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | steady fwd / bwd TFLOP/s "
          "| spread fwd / bwd, per call / steady | bwd peak above inputs GB | fwd / bwd vs %s | steady vs %s | note |"
          % (args.baseline, args.baseline))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for label, hq, hkv, d, window, lens in SHAPES:
        if label not in args.shapes.split(","):
            continue
        for n in [n for n in (lens[:1] if args.quick else lens) if not args.lengths or n in args.lengths]:
            # D = 512: version 5's backward is deterministic either way, so no winattn-det row
            names = [name for name in args.systems.split(",") if not (name == "winattn-det" and d > 256)]
            rows, ref_name = measure_shape(names, n, hq, hkv, d, window, args.reps)
            base = next((r for name, r in rows if name == args.baseline and "error" not in r), None)
            for name, r in rows:
                r.update({"shape": label, "n": n, "system": name, "Hq": hq, "Hkv": hkv, "D": d,
                          "window": window if window else "causal"})
                results.append(r)
                if args.json:  # after every row: a run stopped by a time limit keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                   "winattn_eager_path": eager, "rows": results}, f, indent=1)
                if "error" in r:
                    print("| %s | %d | %s | - | - | - | - | - | - | - | - | - | %s |"
                          % (label, n, name, r["error"].replace("|", "/")), flush=True)
                    continue
                ratio = "%.2f / %.2f" % (base["fwd_s"] / r["fwd_s"], base["bwd_s"] / r["bwd_s"]) if base else "-"
                steady = "%.2f / %.2f" % (base["fwd_steady_s"] / r["fwd_steady_s"], base["bwd_steady_s"] / r["bwd_steady_s"]) if base else "-"
                if r["max_rel_diff_vs_first"] is not None:
                    r["compared_with"] = ref_name
                    r["note"] = ("%s; " % r["note"] if r["note"] else "") + "outputs vs %s: %.1e (abs %.1e)" % (
                        ref_name, r["max_rel_diff_vs_first"], r["max_abs_diff_vs_first"])
                if r["o_max_abs_err_vs_fp32_rows"] is not None:
                    r["note"] = ("%s; " % r["note"] if r["note"] else "") + "o vs fp32: %.1e" % (
                        r["o_max_abs_err_vs_fp32_rows"])
                spread = "%.0f / %.0f %%, %.0f / %.0f %%" % tuple(
                    100 * r[k + "_spread"] for k in ("fwd_s", "bwd_s", "fwd_steady_s", "bwd_steady_s"))
                print("| %s | %d | %s | %.2f | %.1f | %.2f | %.1f | %.1f / %.1f | %s | %.2f | %s | %s | %s |" % (
                    label, n, name, r["fwd_s"] * 1e3, r["fwd_tflops"], r["bwd_s"] * 1e3, r["bwd_tflops"],
                    r["fwd_steady_tflops"], r["bwd_steady_tflops"], spread, r["bwd_peak_gb"], ratio, steady,
                    r["note"]), flush=True)


if __name__ == "__main__":
    main()

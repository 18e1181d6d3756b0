"""test_context_parallel.py — winattn.distributed (context parallelism) on CPU with gloo: 2 and 4
processes on 127.0.0.1, each holding its shard of one sequence, against single-process
winattn.torch.attention on the whole sequence. SKIPs without torch (and the transformers cases
without transformers). Run from the repository root after `make`:
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_context_parallel.py

Attention cases: the output and dq, dk, dv of every rank's shard, float32 held to 1e-5 of each
tensor's largest element (outputs come out bit-identical; dk and dv differ by the rounding of
adding a halo's partial gradient to its owner's), bf16 to 1e-2. They cover windows narrower and
wider than a shard (halos from several ranks), shards shorter than the window, two-sided windows,
one side unbounded, full attention, runs long enough to be cut into edge and interior calls
(edges are multiples of 128 queries), causal global layers in the load-balanced order, sliding
layers in that order (two halos per rank), uneven and empty shards, GQA, softcap, scale, head dim
512. Traffic: the bytes every rank sends in a sliding layer's forward and backward (counted by
wrapping torch.distributed's send calls) equal its halo, counted here from the window and the
shard boundaries alone. transformers: tiny random Gemma 4 and Gemma 3 (as test_transformers.py
builds them) trained one step on a sequence sharded over 2 ranks with "winattn_cp", against the
same model on the whole sequence with "eager": loss, logits and every parameter gradient (summed
over ranks), to 1e-4 of each tensor's largest element.

WINATTN_TEST_CP_DEVICE=cuda runs the same cases on CUDA tensors with NCCL, one GPU per process
(the worlds with more processes than GPUs SKIP).
"""
import os
import socket
import sys
import traceback
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import finish, report, skip  # noqa: E402

TOL = {"float32": 1e-5, "bfloat16": 1e-2}
TOL_MODEL = 1e-4

# (name, layout, N, window, Hq, Hkv, D, dtype, exchange, extra)
# layout: "c" contiguous even, "lb" load-balanced, or a list of contiguous shard sizes
CASES = {
    2: [
        ("sliding (5,0) contiguous", "c", 40, (5, 0), 4, 2, 16, "float32", "auto", {}),
        ("sliding (100,0) contiguous: edge and interior calls", "c", 700, (100, 0), 4, 2, 16, "float32", "auto", {}),
        ("two-sided (40,30) load-balanced: edges and interiors", "lb", 1100, (40, 30), 4, 2, 16, "float32", "auto",
         {"softcap": 3.0}),
        ("sliding (24,0) wider than a shard", "c", 40, (24, 0), 4, 2, 16, "float32", "auto", {}),
        ("two-sided (3,6) GQA 8:1 softcap scale", "c", 41, (3, 6), 8, 1, 32, "float32", "auto",
         {"softcap": 2.0, "scale": 0.3}),
        ("causal global load-balanced", "lb", 43, (-1, 0), 4, 1, 32, "float32", "auto", {}),
        ("sliding (6,0) load-balanced", "lb", 44, (6, 0), 4, 2, 16, "float32", "auto", {}),
        ("full (-1,-1) load-balanced", "lb", 40, (-1, -1), 4, 2, 16, "float32", "auto", {}),
        ("(-1,3) left unbounded", "c", 37, (-1, 3), 4, 2, 16, "float32", "auto", {}),
        ("(4,-1) right unbounded", "lb", 37, (4, -1), 4, 2, 16, "float32", "auto", {}),
        ("sliding uneven shards [7,33]", [7, 33], 40, (9, 2), 4, 2, 16, "float32", "auto", {}),
        ("sliding by all-gather", "c", 40, (5, 0), 4, 2, 16, "float32", "gather", {}),
        ("head dim 512 causal load-balanced", "lb", 24, (-1, 0), 2, 1, 512, "float32", "auto", {}),
        ("head dim 512 sliding", "c", 24, (5, 0), 2, 1, 512, "float32", "auto", {}),
        ("bf16 sliding (7,0)", "c", 64, (7, 0), 4, 2, 64, "bfloat16", "auto", {}),
        ("bf16 causal global load-balanced", "lb", 64, (-1, 0), 4, 1, 64, "bfloat16", "auto", {}),
    ],
    4: [
        ("sliding (25,0) over 3 ranks' shards", "c", 40, (25, 0), 4, 2, 16, "float32", "halo", {}),
        ("two-sided (12,17) shards shorter than the window", "c", 41, (12, 17), 4, 2, 16, "float32", "halo", {}),
        ("causal global load-balanced", "lb", 45, (-1, 0), 4, 2, 16, "float32", "auto", {}),
        ("sliding (8,0) load-balanced, chunks of 5-6", "lb", 45, (8, 0), 4, 2, 16, "float32", "halo", {}),
        ("sliding (130,0) load-balanced: edges and interiors", "lb", 2100, (130, 0), 4, 1, 16, "float32", "halo", {}),
        ("two-sided (3,2) load-balanced", "lb", 40, (3, 2), 4, 1, 16, "float32", "auto", {}),
        ("sliding uneven shards [3,0,30,7] (one empty)", [3, 0, 30, 7], 40, (9, 2), 4, 2, 16, "float32",
         "halo", {}),
        ("causal uneven shards [3,0,30,7]", [3, 0, 30, 7], 40, (-1, 0), 4, 2, 16, "float32", "auto", {}),
    ],
}
# sliding layers whose bytes sent are counted: (name, layout, N, window, Hkv, D), B = 2, float32
TRAFFIC = {
    2: [("contiguous (5,0)", "c", 40, (5, 0), 2, 16), ("load-balanced (6,2)", "lb", 44, (6, 2), 2, 16),
        ("contiguous (100,0), edge and interior calls", "c", 700, (100, 0), 2, 16)],
    4: [("contiguous (25,3) over 3 ranks", "c", 40, (25, 3), 2, 16),
        ("load-balanced (8,0)", "lb", 45, (8, 0), 2, 16),
        ("uneven [3,0,30,7] (9,2)", [3, 0, 30, 7], 40, (9, 2), 2, 16)],
}
MODELS = {2: ["Gemma 4", "Gemma 3", "Gemma 4, gradient checkpointing"], 4: []}


def names(world):
    out = ["world %d: %s" % (world, c[0]) for c in CASES[world]]
    out += ["world %d: traffic of sliding layer %s is its halo" % (world, t[0]) for t in TRAFFIC[world]]
    out += ["world %d: %s context-parallel training step vs one process" % (world, m) for m in MODELS[world]]
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- in each worker ----

def make_layout(cp, spec, n, world):
    if spec == "c":
        return cp.Layout.contiguous(n, world)
    if spec == "lb":
        return cp.Layout.load_balanced(n, world)
    return cp.Layout.contiguous(n, world, spec)


def rel(a, b):
    import torch
    if b.numel() == 0:
        return torch.tensor(0.0)
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def attention_case(torch, dist, cp, wt, rank, world, spec, device):
    name, lay, n, window, hq, hkv, d, dtype, exchange, extra = spec
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # the same on every rank
    q, k, v, do = (torch.randn(2, h, n, d, generator=g).to(device=device, dtype=dt) for h in (hq, hkv, hkv, hq))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    o = wt.attention(*full, window=window, **extra)
    o.backward(do)
    layout = make_layout(cp, lay, n, world)
    mine = [layout.shard(t, rank).requires_grad_() for t in (q, k, v)]
    o_cp = cp.attention(*mine, layout, window=window, exchange=exchange, **extra)
    o_cp.backward(layout.shard(do, rank))
    errs = torch.stack([rel(a, layout.shard(b, rank)) for a, b in
                        [(o_cp, o)] + [(m.grad, f.grad) for m, f in zip(mine, full)]])
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    tol = TOL[dtype]
    return (bool((errs <= tol).all()),
            "N=%d %s window=%s Hq=%d Hkv=%d D=%d %s: rel err o %.1e dq %.1e dk %.1e dv %.1e (tol %g)"
            % (n, layout.runs if lay in ("c", "lb") else list(lay), window, hq, hkv, d, dtype,
               *errs.tolist(), tol))


class Counter:
    """Wraps torch.distributed's sending calls (in torch.distributed and in distributed_c10d, where
    batch_isend_irecv checks and calls them); bytes[name] counts what this rank sends."""
    SENDS = ("isend", "send", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "reduce_scatter",
             "all_reduce", "broadcast", "all_to_all_single", "all_to_all")

    def __init__(self, dist):
        self.modules = [dist, dist.distributed_c10d]
        self.bytes, self.saved = {}, []

    def __enter__(self):
        for fname in self.SENDS:
            f = getattr(self.modules[1], fname)

            def call(tensor, *args, _f=f, _name=fname, **kwargs):
                t = tensor[0] if isinstance(tensor, (list, tuple)) else tensor
                self.bytes[_name] = self.bytes.get(_name, 0) + t.numel() * t.element_size()
                return _f(tensor, *args, **kwargs)
            for m in self.modules:
                self.saved.append((m, fname, getattr(m, fname)))
                setattr(m, fname, call)
        return self

    def __exit__(self, *exc):
        for m, fname, f in self.saved:
            setattr(m, fname, f)


def expected_halo(layout_positions, rank, n, window, world):
    """Tokens rank sends in the forward and in the backward of a sliding layer, from the window
    and the positions each rank holds alone: forward, the keys of rank's that another rank's
    queries see; backward, the keys of other ranks that rank's queries see."""
    left, right = window
    mine = set(layout_positions[rank])

    def seen(positions):
        out = set()
        for i in positions:
            out.update(range(max(0, i - left), min(n, i + right + 1)))
        return out
    fwd = sum(len(seen(layout_positions[p]) & mine) for p in range(world) if p != rank)
    bwd = sum(len(seen(mine) & set(layout_positions[p])) for p in range(world) if p != rank)
    return fwd, bwd


def traffic_case(torch, dist, cp, rank, world, spec, device):
    name, lay, n, window, hkv, d = spec
    layout = make_layout(cp, lay, n, world)
    positions = [layout.positions(r).tolist() for r in range(world)]
    g = torch.Generator().manual_seed(7)
    nl = layout.local_length(rank)
    q = torch.randn(2, 2 * hkv, nl, d, generator=g).to(device).requires_grad_()
    k, v = (torch.randn(2, hkv, nl, d, generator=g).to(device).requires_grad_() for _ in range(2))
    with Counter(dist) as fwd:
        o = cp.attention(q, k, v, layout, window=window)
    with Counter(dist) as bwd:
        o.backward(torch.randn_like(o))
    token = 2 * 2 * hkv * d * 4  # K and V (or dK and dV), B = 2, float32
    want_f, want_b = expected_halo(positions, rank, n, window, world)
    ok = fwd.bytes == ({"isend": want_f * token} if want_f else {}) and \
        bwd.bytes == ({"isend": want_b * token} if want_b else {})
    detail = "rank %d sent forward %s, backward %s; halo %d and %d tokens x %d bytes" % (
        rank, fwd.bytes or "{}", bwd.bytes or "{}", want_f, want_b, token)
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag)
    return flag.item() == 0, detail


def tiny_model(label):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Gemma4ForCausalLM, Gemma4TextConfig
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=8, head_dim=16,
                  sliding_window=8, attention_dropout=0.0)
    if label == "Gemma 4":  # shaped like 31B: k = v on full layers, one global KV head of twice the head dim
        return Gemma4ForCausalLM, Gemma4TextConfig(
            num_hidden_layers=6, num_key_value_heads=4, global_head_dim=32, num_global_key_value_heads=1,
            attention_k_eq_v=True, layer_types=["sliding_attention"] * 5 + ["full_attention"],
            hidden_size_per_layer_input=0, num_kv_shared_layers=0, final_logit_softcapping=30.0, **common)
    return Gemma3ForCausalLM, Gemma3TextConfig(
        num_hidden_layers=3, num_key_value_heads=2, query_pre_attn_scalar=40,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], **common)


def model_case(torch, dist, cp, rank, world, label, device):
    """One training step's loss and parameter gradients: the whole sequence on one process
    ("eager") against the sequence sharded over the ranks ("winattn_cp")."""
    checkpointing = label.endswith(", gradient checkpointing")  # the backward runs each layer's forward again
    label = label.split(",")[0]
    cls, config = tiny_model(label)
    torch.manual_seed(0)
    model = cls(config).float().to(device)
    with torch.no_grad():  # larger than the default init, as in test_transformers.py
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            else:
                p.copy_(p + torch.empty_like(p).uniform_(-0.5, 0.5))
    n = 45  # windows of 8 keys; Gemma 4 in load-balanced chunks of 11-12, Gemma 3 in uneven contiguous shards
    ids = torch.randint(0, config.vocab_size, (2, n), generator=torch.Generator().manual_seed(1)).to(device)
    layout = cp.Layout.load_balanced(n, world) if label == "Gemma 4" else cp.Layout.contiguous(n, world, [17, 28])
    names = [k for k, p in model.named_parameters()]

    ref = None
    if rank == 0:
        model.set_attn_implementation("eager")
        out = model(ids, use_cache=False)
        loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        ref = (loss.detach(), out.logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters()})
        model.zero_grad()

    model.set_attn_implementation("winattn_cp")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    batch = cp.shard_causal_lm_batch(ids, layout, rank)
    num_tokens = int((ids[:, 1:] >= 0).sum())  # every label but the last of each row
    with cp.use_layout(layout):  # the backward inside too: checkpointing runs the forward (and its exchange) again
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        loss = cp.causal_lm_loss(out.logits, batch["labels"], num_tokens)
        loss.backward()
    grads = [model.get_parameter(k).grad for k in names]
    missing = [k for k, gr in zip(names, grads) if gr is None]
    flat = torch.cat([(torch.zeros_like(p) if gr is None else gr).flatten()
                      for gr, p in zip(grads, model.parameters())] + [loss.detach().reshape(1)])
    dist.all_reduce(flat)
    logits = layout.gather(out.logits.detach(), dim=1)
    if rank != 0:
        return None, ""
    ref_loss, ref_logits, ref_grads = ref
    worst, at, pos = 0.0, "-", 0
    floor = 1e-3 * max(g.abs().max().item() for g in ref_grads.values())
    for k in names:
        r = ref_grads[k]
        got = flat[pos:pos + r.numel()].view_as(r)
        pos += r.numel()
        e = ((got - r).abs().max() / r.abs().max().clamp_min(floor)).item()
        if e > worst:
            worst, at = e, k
    e_loss = abs(flat[-1].item() - ref_loss.item()) / abs(ref_loss.item())
    e_logits = rel(logits, ref_logits).item()
    ok = max(worst, e_loss, e_logits) <= TOL_MODEL and not missing and len(names) > 10
    return ok, "N=%d %s: loss %.6f vs %.6f (rel %.1e), logits rel %.1e, worst of %d gradients %.1e (%s) (tol %g)%s" % (
        n, layout.runs, flat[-1].item(), ref_loss.item(), e_loss, e_logits, len(names), worst, at, TOL_MODEL,
        ", no gradient: %s" % missing if missing else "")


def worker(rank, world, port, queue, with_models, device):
    import datetime
    import warnings
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="tcp://127.0.0.1:%d" % port,
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    import winattn.distributed as cp
    import winattn.torch as wt
    jobs = [("world %d: %s" % (world, c[0]), lambda c=c: attention_case(torch, dist, cp, wt, rank, world, c, device))
            for c in CASES[world]]
    jobs += [("world %d: traffic of sliding layer %s is its halo" % (world, t[0]),
              lambda t=t: traffic_case(torch, dist, cp, rank, world, t, device)) for t in TRAFFIC[world]]
    if with_models:
        import transformers
        transformers.logging.set_verbosity_error()
        cp.register()
        jobs += [("world %d: %s context-parallel training step vs one process" % (world, m),
                  lambda m=m: model_case(torch, dist, cp, rank, world, m, device)) for m in MODELS[world]]
    for name, job in jobs:
        try:
            ok, detail = job()
        except Exception:
            # a rank that fails leaves the others waiting in a collective: report and end them all
            queue.put((False, name, "rank %d: %s" % (rank, traceback.format_exc().strip().splitlines()[-1])))
            raise
        if rank == 0:
            queue.put((ok, name, detail))
    dist.destroy_process_group()


def main():
    try:
        import torch
        import torch.distributed as dist
        import torch.multiprocessing as mp
    except ImportError as e:
        skip("context-parallel", "torch is not installed (%s)" % e)
        return
    if not dist.is_available() or not dist.is_gloo_available():
        skip("context-parallel", "this torch has no torch.distributed with gloo")
        return
    try:
        import winattn.distributed  # noqa: F401
    except ImportError as e:
        skip("context-parallel", "winattn.torch needs a newer torch (%s)" % e)
        return
    try:
        import transformers  # noqa: F401
        tiny_model("Gemma 4")
        tiny_model("Gemma 3")
        with_models = True
    except (ImportError, TypeError) as e:
        with_models = False
        for m in MODELS[2]:
            skip("world 2: %s context-parallel training step" % m, "transformers with Gemma 4 and 3 is needed (%s)" % e)
    device = os.environ.get("WINATTN_TEST_CP_DEVICE", "cpu")
    if device == "cuda" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        skip("context-parallel on cuda", "no CUDA device or no NCCL")
        return
    print("torch %s, %s on 127.0.0.1" % (torch.__version__, "nccl" if device == "cuda" else "gloo"), flush=True)
    ctx = mp.get_context("spawn")
    for world in (2, 4):
        if device == "cuda" and torch.cuda.device_count() < world:
            skip("world %d" % world, "%d GPUs here" % torch.cuda.device_count())
            continue
        queue = ctx.SimpleQueue()
        models = with_models and bool(MODELS[world])
        expected = [x for x in names(world) if models or "training step" not in x]
        why = ""
        try:
            mp.spawn(worker, args=(world, free_port(), queue, models, device), nprocs=world, join=True)
        except Exception as e:
            why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        seen = set()
        while not queue.empty():
            ok, name, detail = queue.get()
            if name not in seen:
                seen.add(name)
                report(ok, name, detail)
        for name in expected:
            if name not in seen:
                report(False, name, "not run: the workers stopped (%s)" % (why or "no result"))


if __name__ == "__main__":
    main()
    finish()

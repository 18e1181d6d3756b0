#!/usr/bin/env python3
"""cp_train.py — the longest sequence a Gemma-4-31B-shaped LoRA training step runs at on W GPUs
against one: transformers with winattn's attention ("winattn" on one GPU, "winattn_cp" with the
sequence sharded over W ranks by winattn.distributed's load-balanced layout, NCCL), random bf16
weights (train/configs/gemma4-31b.json, or its first --layers layers), LoRA r32 on q, k, v, o,
gradient checkpointing, the next-token loss over the vocabulary in chunks of rows (recomputed in
the backward, so the [N, 262144] logits never exist at once), one record per step.

For each world size, each length runs in its own process tree (a rank that runs out of memory
cannot leave the others waiting in a collective: the tree is killed at --timeout-s), one warm-up
step and --steps timed ones. With --search the lengths double from --start until one does not
run, then bisect to --resolution tokens. Prints per length and world: seconds per step, tokens
per second, every rank's peak memory, or what stopped it; then the longest that ran per world and
the ratio to one GPU (the target: >= 1.9 on 2 GPUs). --check first runs both worlds at
--start and compares the loss (the sharded step must give the one-device loss).

  python3 bench/cp_train.py [--world 2] [--search | --lengths 16384,32768] [--layers 60]
                            [--steps 2] [--json FILE]
  python3 bench/cp_train.py --tiny --world 2 --lengths 256,512 --check   (CPU, gloo: a smoke run)
"""
import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, HERE)

TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
        "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 32,
        "final_logit_softcapping": 30.0, "tie_word_embeddings": True, "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0, "enable_moe_block": False, "use_double_wide_mlp": False,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}


def chunked_loss(model, hidden, labels, num_tokens, rows=4096):
    """sum over this rank's tokens of the cross-entropy of softcap(lm_head(hidden)), over
    num_tokens, in chunks of `rows` recomputed in the backward (torch.utils.checkpoint)"""
    import torch
    from torch.utils.checkpoint import checkpoint
    cap = getattr(model.config, "final_logit_softcapping", None)
    h, y = hidden.flatten(0, -2), labels.flatten()

    def piece(hc, yc):
        logits = model.lm_head(hc).float()
        if cap:
            logits = cap * torch.tanh(logits / cap)
        return torch.nn.functional.cross_entropy(logits, yc, reduction="sum", ignore_index=-100)

    total = hidden.new_zeros((), dtype=torch.float32)
    for r0 in range(0, h.shape[0], rows):
        total = total + checkpoint(piece, h[r0:r0 + rows], y[r0:r0 + rows], use_reentrant=False)
    return total / num_tokens


def rank_main(rank, world, port, args, out):
    """one rank of one (world, length) run; rank 0 writes the result as JSON to `out`"""
    import datetime
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers_lora import add_lora, gemma4_config
    import winattn.distributed as cp
    import winattn.transformers
    cuda = not args["tiny"]
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=args["timeout_s"]))
    winattn.transformers.register()
    cp.register()
    n = args["length"]
    cfg = gemma4_config(args["config"], "winattn" if world == 1 else "winattn_cp")
    torch.manual_seed(0)  # the same weights and adapters on every rank and in every world
    with device:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if cuda else torch.float32)
    params = add_lora(model, rank=32, scale=20.0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    opt = torch.optim.Adam(params, lr=1e-5)
    layout = cp.Layout.load_balanced(n, world)
    times, losses, result = [], [], {}
    try:
        for s in range(1 + args["steps"]):
            g = torch.Generator().manual_seed(s)
            ids = torch.randint(3, cfg.vocab_size, (1, n), generator=g).to(device)
            batch = cp.shard_causal_lm_batch(ids, layout, rank)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            # the backward inside the layout too: gradient checkpointing runs each layer's forward
            # (and its halo exchange) again there
            with cp.use_layout(layout) if world > 1 else contextlib.nullcontext():
                hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
                loss = chunked_loss(model, hidden, batch["labels"], n - 1)
                loss.backward()
            for p in params:  # each rank's gradients are its tokens' share: their sum is the step's
                dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item())
            if s > 0:
                times.append(elapsed)
        peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 1e9 if cuda else 0.0], device=device)
        peaks = [torch.zeros_like(peak) for _ in range(world)]
        dist.all_gather(peaks, peak)
        t = sorted(times)[len(times) // 2]
        result = {"seconds": t, "tokens_per_s": n / t, "peak_gb": [round(p.item(), 2) for p in peaks], "losses": losses}
    except torch.OutOfMemoryError as e:  # the other ranks may be waiting in a collective: the parent kills the tree
        result = {"error": "out of memory on rank %d: %s" % (rank, str(e).splitlines()[0][:120])}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    if "error" in result:  # torch.multiprocessing then stops the other ranks
        os._exit(3)
    dist.destroy_process_group()


def run_one(world, length, a, cfg):
    """one (world, length) in its own process tree; its result, or what stopped it"""
    import tempfile
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = {"world": world, "port": port, "length": length, "steps": a.steps, "tiny": a.tiny, "config": cfg,
            "timeout_s": a.timeout_s}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec), out]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = p.communicate(timeout=a.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            stdout, stderr = p.communicate()
            if not os.path.exists(out):
                return {"error": "no result in %d s (a rank stopped, the others waited)" % a.timeout_s}
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        lines = [l for l in stdout.splitlines() if l.startswith("{")]
        if lines:
            return json.loads(lines[-1])
        tail = (stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]
        return {"error": tail[:200]}


def worker(spec_json, out):
    import torch.multiprocessing as mp
    spec = json.loads(spec_json)
    args = dict(spec)
    mp.start_processes(rank_main, args=(spec["world"], spec["port"], args, out), nprocs=spec["world"], join=True,
                       start_method="spawn")


def longest_that_runs(runs, start, step):
    """the longest multiple of `step` for which runs(n) is true, from `start` doubling until one
    is not, then bisecting; 0 if start does not run"""
    ok, bad, n = 0, None, start
    while True:
        if runs(n):
            ok = n
        else:
            bad = n
        if bad is None:
            n *= 2
            continue
        n = (ok + bad) // 2 // step * step
        if n <= ok:
            return ok


def row(world, n, r):
    if "error" in r:
        print("world %d %7d tokens  %s" % (world, n, r["error"]), flush=True)
    else:
        print("world %d %7d tokens  %7.2f s/step  %7.0f tok/s  peak per rank %s GB  loss %.4f" % (
            world, n, r["seconds"], r["tokens_per_s"], r["peak_gb"], r["losses"][0]), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, help="GPUs (or CPU ranks with --tiny) against one")
    ap.add_argument("--lengths", default=None, help="tokens per step to run, e.g. 16384,32768")
    ap.add_argument("--search", action="store_true", help="the longest that runs, per world (doubling, then bisection)")
    ap.add_argument("--start", type=int, default=16384)
    ap.add_argument("--resolution", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=0, help="the first N layers of the 31B's pattern (default: all 60)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    ap.add_argument("--timeout-s", type=int, default=900, help="per (world, length) run")
    ap.add_argument("--tiny", action="store_true", help="a tiny Gemma 4 on the CPU with gloo (a smoke run)")
    ap.add_argument("--check", action="store_true", help="both worlds at --start first: the losses must agree")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(*a.worker)
    if a.world < 2:
        ap.error("--world must be 2 or more (it is compared with one GPU)")
    if bool(a.lengths) == a.search:
        ap.error("give either --lengths or --search")
    try:
        lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else []
    except ValueError:
        ap.error("--lengths takes integers separated by commas, got %r" % a.lengths)
    if min(lengths + [a.start, a.resolution, a.steps]) < 1:
        ap.error("lengths, --start, --resolution and --steps must be positive")
    if a.tiny:
        cfg = dict(TINY)
        a.start, a.resolution = min(a.start, 256), min(a.resolution, 64)
    else:
        from train_gpu import config
        cfg = config(a.layers)
    worlds = [1, a.world]
    rows = []
    if a.check:
        r1, rw = run_one(1, a.start, a, cfg), run_one(a.world, a.start, a, cfg)
        row(1, a.start, r1), row(a.world, a.start, rw)
        if "error" in r1 or "error" in rw:
            sys.exit("cp_train: the check did not run")
        # every step's loss: the later ones follow the earlier steps' gradients through Adam
        rel = max(abs(x - y) / abs(x) for x, y in zip(r1["losses"], rw["losses"]))
        tol = 1e-4 if a.tiny else 2e-2  # f32 on the CPU; bf16 weights and activations on the GPUs
        print("check: losses of %d steps on 1 and %d ranks %s / %s, largest relative difference %.1e (tol %g)" % (
            len(r1["losses"]), a.world, ["%.6f" % x for x in r1["losses"]], ["%.6f" % x for x in rw["losses"]], rel,
            tol), flush=True)
        if rel > tol:
            sys.exit("cp_train: the sharded step's loss differs from one device's")
    longest = {}
    for world in worlds:
        if lengths:
            for n in lengths:
                r = run_one(world, n, a, cfg)
                rows.append({"world": world, "tokens": n, **r})
                row(world, n, r)
                if "error" not in r:
                    longest[world] = max(longest.get(world, 0), n)
            continue
        def runs(n, world=world):
            r = run_one(world, n, a, cfg)
            rows.append({"world": world, "tokens": n, **r})
            row(world, n, r)
            return "error" not in r

        ok = longest_that_runs(runs, a.start * world, a.resolution * world)
        if ok:
            longest[world] = ok
    print("longest step that ran: %s" % ", ".join("%d tokens on %d" % (longest[w], w) for w in worlds if w in longest))
    if 1 in longest and a.world in longest:
        print("ratio %d GPUs : 1 = %.2f" % (a.world, longest[a.world] / longest[1]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "longest": longest}, f, indent=1)


if __name__ == "__main__":
    main()

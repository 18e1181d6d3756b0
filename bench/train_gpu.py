#!/usr/bin/env python3
"""train_gpu.py — the write-up's job at its real shape on one GPU: Gemma 4 31B's text config,
random bf16 weights, LoRA rank 32 on q, k, v, o, one record per step at each length.

Runs, in one process tree and one sitting:
  * `winattn train --device cuda --init-random 0 --base-dtype B` (the C trainer: bf16, cuBLAS,
    winattn's kernels, per-layer recomputation, the head in chunks; B, default bf16, is its frozen
    base: nf4, mlx4 or fp8 keep the projections packed on the device);
  * with --peers, transformers (the machine's own) with attn_implementation "winattn" and
    "sdpa": bf16 weights, gradient checkpointing, a hand-written LoRA of the same rank, targets
    and scale, each in its own process so one's memory never counts against another's;
  * the peer "qlora": transformers + peft + bitsandbytes QLoRA (bench/qlora_peer.py): the
    projections bitsandbytes NF4 with double quantization (bf16 compute), the embedding and norms
    bf16, peft's LoRA of the same rank, targets and scale (lora_alpha = scale * rank), gradient
    checkpointing, attn_implementation "winattn". bitsandbytes comes from --peers-dir (the GPU
    machine has none: bench/peer_wheels.py --set qlora carries it). The peer the C trainer's
    --base-dtype nf4 is measured against.
Per length: the median step time after the first (warm-up) step (with two or more timed steps, their
spread: (slowest - fastest) / median), tokens/s, peak device memory
(the C trainer's own count: weights, adapters, the stream-ordered pool's high-water mark; torch's
max_memory_allocated for transformers), or what stopped it (out of memory). Prints a table and,
with --json, writes the numbers.

  python3 bench/train_gpu.py --winattn build/winattn [--layers 60] [--lengths 8192,16384,30553]
                             [--steps 3] [--base-dtype bf16|nf4|mlx4|fp8[,...]] [--peers winattn,sdpa,qlora]
                             [--peers-dir DIR] [--peer-lengths L,...] [--skip-c] [--device-gib G] [--json FILE]
--layers N keeps the first N layers of the 31B's pattern (5 sliding, 1 full, repeated): a quick
look at the per-layer cost; the job itself is 60.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIG = os.path.join(ROOT, "train", "configs", "gemma4-31b.json")
# the adapters every trainer here trains: the C trainer's flags, and the peers' LoRA
LORA_RANK = 32
LORA_SCALE = 20.0
LORA_KEYS = "q,k,v,o"


def config(layers):
    with open(CONFIG) as f:
        c = json.load(f)
    if layers:
        c["num_hidden_layers"] = layers
        c["layer_types"] = c["layer_types"][:layers]
    return c


def record_tokens(lengths, vocab, seed):
    """The records' token ids: BOS, then uniform ids from 3 up, one generator seeded by `seed`."""
    import random
    rng = random.Random(seed)
    return [[2] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in lengths]


def write_records(path, lengths, vocab, seed):
    with open(path, "w") as f:
        for tokens in record_tokens(lengths, vocab, seed):
            f.write(json.dumps({"tokens": tokens}) + "\n")


# the trainer's step line: "step 2/3  loss 12.0104  [lr 2.000e-04  grad norm 3.1]  tokens 8192  longest 8192
# 3.42 s  2392 tok/s  peak RSS 1.20 GB  device peak 77.40 GB  ETA 0s" (the device peak only with --device cuda)
STEP = re.compile(r"^step (\d+)/\d+ +loss ([0-9.naif]+) .*?tokens (\d+) .* ([0-9.]+) s +(\d+) tok/s"
                  r"(?:.*device peak ([0-9.]+) GB)?")

# the device line after the base is on the GPU: how long it took and what it holds
LOADED = re.compile(r"base weights .* in ([0-9.]+) s, ([0-9.]+) GB on the device")


def parse_c_output(stdout, stderr, returncode, tokens):
    """The C trainer's run as a row: the median step after the first, tokens/s for `tokens` a step, the
    largest device peak, the losses; or {"error": its one-line message} when it failed or trained no step."""
    times, peak, losses = [], 0.0, []
    for line in stdout.splitlines():
        m = STEP.match(line)
        if m:
            times.append(float(m.group(4)))
            losses.append(m.group(2))
            peak = max(peak, float(m.group(6) or 0))
    if returncode != 0 or not times:
        # the trainer's own message ("winattn train: ..."), not the profile lines it prints on stderr too
        lines = [l for l in stderr.strip().splitlines() if not l.startswith("profile")]
        lines = [l for l in lines if l.startswith("winattn")] or lines or stdout.strip().splitlines() or ["?"]
        return {"error": lines[-1] if returncode != 0 else "no step line in the trainer's output: " + lines[-1]}
    t = statistics.median(times[1:]) if len(times) > 1 else times[0]
    r = {"seconds": t, "tokens_per_s": tokens / t, "peak_gb": peak, "losses": losses, "all_seconds": times}
    if len(times) > 2:  # the timed steps' spread: (slowest - fastest) / median
        r["spread"] = (max(times[1:]) - min(times[1:])) / t
    passes = [l for l in stdout.splitlines() if l.startswith("device: up to")]
    if passes:
        r["pass_tokens"] = passes[0]
    for line in stdout.splitlines():  # "device: ...; base weights drawn on the GPU in 41.2 s, 61.40 GB on the device"
        m = LOADED.search(line)
        if line.startswith("device:") and m:
            r["load_seconds"], r["base_gb"] = float(m.group(1)), float(m.group(2))
    profile = [l for l in stderr.splitlines() if l.startswith("profile")]
    if profile:  # WINATTN_TRAIN_PROFILE=1: the last step's device time by phase
        r["profile"] = profile[-1]
    return r


def c_command(winattn, model, data, adapters, batch_size, steps, base_dtype):
    """The C trainer's command line: random weights on the GPU, LORA_RANK on LORA_KEYS scaled by LORA_SCALE."""
    return [winattn, "train", "--model", model, "--data", data, "--device", "cuda", "--init-random", "0",
            "--base-dtype", base_dtype, "--batch-size", str(batch_size), "--iters", str(steps),
            "--lora-rank", str(LORA_RANK), "--lora-scale", "%g" % LORA_SCALE, "--lora-keys", LORA_KEYS,
            "--adapter-path", adapters]


def run_c(winattn, cfg, length, steps, batch=None, base_dtype="bf16"):
    """One record of `length` tokens per step, or with batch = [lengths] those records as one batch."""
    records = list(batch) if batch else [length]
    with tempfile.TemporaryDirectory() as tmp:
        model, data = os.path.join(tmp, "model"), os.path.join(tmp, "data")
        os.makedirs(model)
        os.makedirs(data)
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(cfg, f)
        write_records(os.path.join(data, "train.jsonl"), records * steps, cfg["vocab_size"], length)
        cmd = c_command(winattn, model, data, os.path.join(tmp, "adapters"), len(records), steps, base_dtype)
        p = subprocess.run(cmd, capture_output=True, text=True)
        return parse_c_output(p.stdout, p.stderr, p.returncode, sum(records))


PEER = r'''
import json, math, sys, time, torch
cfg_json, peer, length, steps = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rank, scale = int(sys.argv[5]), float(sys.argv[6])
with open(sys.argv[7]) as f:  # the records the C trainer trains on (it visits them in its own order)
    records = json.load(f)
from transformers import AutoModelForCausalLM
from transformers_lora import add_lora, gemma4_config
attn = "winattn" if peer == "qlora" else peer
if attn == "winattn":
    import winattn.transformers
    winattn.transformers.register()
cfg = gemma4_config(cfg_json, attn)
torch.manual_seed(0)
if peer == "qlora":
    from qlora_peer import qlora_model
    model, params = qlora_model(cfg, "cuda", rank, scale)
    torch.cuda.empty_cache()
else:
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    params = add_lora(model, rank=rank, scale=scale)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
model.train()
opt = torch.optim.Adam(params, lr=1e-5)
times = []
try:
    for s in range(steps):
        ids = torch.tensor([records[s]], device="cuda")
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    print(json.dumps({"seconds": t, "tokens_per_s": length / t, "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
                      "all_seconds": times}))
except torch.OutOfMemoryError as e:
    print(json.dumps({"error": "out of memory: " + str(e).splitlines()[0][:160]}))
'''


def run_peer(cfg, peer, length, steps, winattn_lib, peers_dir=None):
    env = dict(os.environ)
    path = ([peers_dir] if peers_dir else []) + [os.path.join(ROOT, "python"), HERE, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(path)
    if winattn_lib:
        env["WINATTN_LIBRARY"] = winattn_lib
    with tempfile.NamedTemporaryFile("w", suffix=".json") as records:
        # the records run_c writes for this length: every trainer sees the same tokens
        json.dump(record_tokens([length] * steps, cfg["vocab_size"], length), records)
        records.flush()
        p = subprocess.run([sys.executable, "-c", PEER, json.dumps(cfg), peer, str(length), str(steps),
                            str(LORA_RANK), repr(LORA_SCALE), records.name], capture_output=True, text=True, env=env)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (p.stderr.strip().splitlines() or ["?"])[-1]
    return {"error": tail[:200]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--winattn", default=os.path.join(ROOT, "build", "winattn"))
    ap.add_argument("--library", default=None, help="libwinattn.so for the transformers 'winattn' peer")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--lengths", default="8192,16384,30553")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--base-dtype", default="bf16",
                    help="the C trainer's frozen base (--base-dtype: bf16, nf4, mlx4, fp8), or several, one C row "
                         "each (bf16,fp8: fp8 against bf16 on one machine); the qlora peer is always nf4")
    ap.add_argument("--peers", default="winattn,sdpa",
                    help="qlora, or transformers' attn_implementation names (winattn, sdpa, ...); none")
    ap.add_argument("--peers-dir", default=None,
                    help="first on the peers' path (bench/peer_wheels.py install --set qlora puts bitsandbytes there)")
    ap.add_argument("--peer-lengths", default=None, help="lengths the peers run (default: --lengths)")
    ap.add_argument("--skip-c", action="store_true", help="run the peers only")
    ap.add_argument("--batch", default=None,
                    help="LENS: the C trainer alone on batches of these records (e.g. 30553,9000,4000,1200)")
    ap.add_argument("--device-gib", type=float, default=None,
                    help="run every trainer on a card of this many GiB: the rest of the GPU's memory is held by "
                         "this process while they run (a 48 GiB card on an 80 GiB one)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cfg = config(a.layers)
    lengths = [int(x) for x in a.lengths.split(",")]
    peers = [p for p in a.peers.split(",") if p and p != "none"]
    lib = a.library or os.path.join(os.path.dirname(os.path.abspath(a.winattn)), "libwinattn.so")
    peer_lengths = [int(x) for x in a.peer_lengths.split(",")] if a.peer_lengths else lengths
    if a.peers_dir and not os.path.isdir(a.peers_dir):
        sys.exit("train_gpu: --peers-dir %s: no such folder (bench/peer_wheels.py install --set qlora fills it)"
                 % a.peers_dir)
    bases = a.base_dtype.split(",")
    for b in bases:
        if b not in ("bf16", "nf4", "mlx4", "fp8"):
            sys.exit("train_gpu: --base-dtype %s: not one of bf16, nf4, mlx4, fp8" % b)
    labels = {b: "winattn train --device cuda" + ("" if b == "bf16" else " " + b) for b in bases}
    held = hold_device_memory(a.device_gib) if a.device_gib else None  # noqa: F841 (held while the trainers run)
    rows = []
    if a.batch:
        recs = [int(x) for x in a.batch.split(",")]
        for b in bases:
            rows.append((f"{labels[b]}, batch of {len(recs)}", sum(recs),
                         run_c(a.winattn, cfg, sum(recs), a.steps, recs, b)))
            print_row(*rows[-1])
        lengths = []
    for n in lengths:
        for b in bases if not a.skip_c else []:
            rows.append((labels[b], n, run_c(a.winattn, cfg, n, a.steps, base_dtype=b)))
            print_row(*rows[-1])
        for p in peers if n in peer_lengths else []:
            name = "transformers+peft+bnb qlora" if p == "qlora" else f"transformers {p}"
            rows.append((name, n, run_peer(cfg, p, n, a.steps, lib, a.peers_dir)))
            print_row(*rows[-1])
        for b in bases:
            compare(rows, labels[b], n)
    print(f"(config {os.path.relpath(CONFIG, ROOT)}, {cfg['num_hidden_layers']} layers; median step after the first "
          f"of {a.steps}; LoRA r{LORA_RANK} on {LORA_KEYS}, scale {LORA_SCALE:g}; C base {', '.join(bases)})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"trainer": t, "tokens": n, **r} for t, n, r in rows], f, indent=1)


def hold_device_memory(gib):
    """Allocates what the GPU has beyond `gib` GiB and returns it: held by this process, it is gone from every
    trainer's cudaMemGetInfo and allocator, as on a card of that size (this process's own CUDA context, about
    0.5 GB, comes off the card as a trainer's would)."""
    import torch
    free, total = torch.cuda.mem_get_info()
    hold = total - int(gib * (1 << 30))
    if hold <= 0 or hold > free:
        sys.exit("train_gpu: --device-gib %g: the GPU has %.1f GiB, %.1f GiB free" % (gib, total / 2**30, free / 2**30))
    block = torch.empty(hold, dtype=torch.uint8, device="cuda")
    free, _ = torch.cuda.mem_get_info()
    print(f"device: {hold / 2**30:.1f} GiB held, {free / 2**30:.1f} GiB left for the trainers (--device-gib {gib:g})",
          flush=True)
    return block


def compare(rows, c_label, n):
    """The C trainer's step time and peak memory as fractions of the qlora peer's at length n, when
    both ran there."""
    mine = [r for t, m, r in rows if t == c_label and m == n and "error" not in r]
    theirs = [r for t, m, r in rows if t.endswith(" qlora") and m == n and "error" not in r]
    if mine and theirs:
        print(f"    {c_label} / qlora at {n}: step {mine[0]['seconds'] / theirs[0]['seconds']:.2f}x, "
              f"peak {mine[0]['peak_gb'] / theirs[0]['peak_gb']:.2f}x", flush=True)


def print_row(trainer, n, r):
    if "error" in r:
        print(f"{trainer:32s} {n:6d} tokens  {r['error']}", flush=True)
    else:
        loaded = f"  base {r['base_gb']:.1f} GB, loaded in {r['load_seconds']:.1f} s" if "load_seconds" in r else ""
        spread = f" (spread {100 * r['spread']:.1f} %)" if "spread" in r else ""
        print(f"{trainer:32s} {n:6d} tokens  {r['seconds']:7.2f} s/step{spread}  {r['tokens_per_s']:7.0f} tok/s  "
              f"peak {r['peak_gb']:6.1f} GB{loaded}", flush=True)
        if "pass_tokens" in r:
            print("    " + r["pass_tokens"], flush=True)
        if "profile" in r:
            print("    " + r["profile"], flush=True)


if __name__ == "__main__":
    main()

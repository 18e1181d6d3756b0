#!/usr/bin/env python3
"""plot_runs.py — step-loss curves, held-out loss and per-step time of `winattn train` runs, from
the log.jsonl each run writes (--out DIR or --log FILE), as one PNG; and a Markdown table of the
runs on stdout.

    python3 train/plot_runs.py --out docs/train-arms.png fused=RUN1/log.jsonl chunked=RUN2/log.jsonl ...

Needs matplotlib (pip install matplotlib); the table needs nothing beyond the standard library.
"""
import argparse
import json
import sys


def read_log(path):
    steps, evals, done = [], [], None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if "step" in rec:
                steps.append(rec)
            elif "eval" in rec:
                evals.append(rec)
            elif "done" in rec:
                done = rec
    return steps, evals, done


def table(runs):
    rows = ["| arm | steps | wall time | tokens/s | peak RSS | longest step (tokens, s, peak RSS) | held-out loss | next-token agreement |",
            "|---|---|---|---|---|---|---|---|"]
    for name, (steps, evals, done) in runs.items():
        if not steps:
            rows.append(f"| {name} | 0 | – | – | – | – | – | – |")
            continue
        wall = done["seconds"] if done else sum(s["seconds"] for s in steps)
        tokens = done["tokens"] if done else sum(s["tokens"] for s in steps)
        peak = max(s["peak_rss"] for s in steps)
        longest = max(steps, key=lambda s: (s["longest"], s["seconds"]))
        last = evals[-1] if evals else None
        rows.append(
            f"| {name} | {len(steps)}{'' if done else ' (stopped)'} | {wall / 60:.1f} min | {tokens / wall:.0f} | "
            f"{peak / 1e9:.2f} GB | step {longest['step']}: {longest['longest']:,}, {longest['seconds']:.1f} s, "
            f"{longest['peak_rss'] / 1e9:.2f} GB | {last['loss']:.4f} (after step {last['eval']}) | "
            f"{100 * last['agreement']:.2f}% |" if last else
            f"| {name} | {len(steps)} | {wall / 60:.1f} min | {tokens / wall:.0f} | {peak / 1e9:.2f} GB | "
            f"step {longest['step']}: {longest['longest']:,}, {longest['seconds']:.1f} s | – | – |")
    return "\n".join(rows)


def plot(runs, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, (steps, evals, _) in runs.items():
        if not steps:
            continue
        line, = ax_loss.plot([s["step"] for s in steps], [s["loss"] for s in steps], label=f"{name}: train (per batch)",
                             linewidth=1)
        if evals:
            ax_loss.plot([e["eval"] for e in evals], [e["loss"] for e in evals], "o--", color=line.get_color(),
                         label=f"{name}: held-out")
        ax_time.plot([s["step"] for s in steps], [s["seconds"] for s in steps], ".-", color=line.get_color(),
                     label=name, linewidth=0.8)
    ax_loss.set_xlabel("step (batch of 4 records)")
    ax_loss.set_ylabel("cross-entropy (nats/token)")
    ax_loss.set_title("loss")
    ax_loss.legend(fontsize=8)
    ax_time.set_xlabel("step")
    ax_time.set_ylabel("seconds")
    ax_time.set_yscale("log")
    ax_time.set_title("time per step (the spikes hold the ~30K-token records)")
    ax_time.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="NAME=path/to/log.jsonl")
    ap.add_argument("--out", help="PNG to write (needs matplotlib)")
    args = ap.parse_args()
    runs = {}
    for spec in args.runs:
        if "=" not in spec:
            sys.exit(f"plot_runs.py: '{spec}' is not NAME=LOG")
        name, path = spec.split("=", 1)
        runs[name] = read_log(path)
    print(table(runs))
    if args.out:
        plot(runs, args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

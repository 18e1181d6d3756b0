#!/usr/bin/env python3
"""plot_runs.py — step-loss curves, held-out loss, per-step time (and the learning rate, where the
log has it) of `winattn train` runs, from the log.jsonl each run writes (--out DIR or --log FILE),
as one PNG; and a Markdown table of the runs on stdout.

    python3 train/plot_runs.py --out docs/train-arms.png fused=RUN1/log.jsonl chunked=RUN2/log.jsonl ...

The PNG needs matplotlib (without it --out stops at once, saying `pip install matplotlib`, exit
status 2); the table needs nothing beyond the standard library. A log that cannot be read is one
line naming it, exit status 1.
"""
import argparse
import json
import sys

MATPLOTLIB_MISSING = 2


class LogError(Exception):
    """A one-line problem with a log, naming it."""


def read_log(path):
    steps, evals, done = [], [], None
    try:
        f = open(path)
    except OSError as e:
        raise LogError("%s: cannot open (%s)" % (path, e.strerror))
    with f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise LogError("%s:%d: not valid JSON (%s)" % (path, lineno, e))
            if not isinstance(rec, dict):
                raise LogError("%s:%d: not a JSON object" % (path, lineno))
            if "step" in rec:
                steps.append(rec)
            elif "eval" in rec:
                evals.append(rec)
            elif "done" in rec:
                done = rec
    return steps, evals, done


def peak(rec):
    """The step's peak memory in bytes: the device's on the GPU, the process's resident set on the CPU."""
    return rec.get("device_peak") or rec.get("peak_rss", 0)


def need_matplotlib():
    """pyplot, or None after one line saying what to install."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_runs.py: --out needs matplotlib, which is not installed: pip install matplotlib",
              file=sys.stderr)
        return None
    return plt


def table(runs):
    rows = ["| run | steps | wall time | tokens/s | peak memory | longest step (tokens, s, peak memory) | held-out loss | next-token agreement |",
            "|---|---|---|---|---|---|---|---|"]
    for name, (steps, evals, done) in runs.items():
        if not steps:
            rows.append(f"| {name} | 0 | – | – | – | – | – | – |")
            continue
        wall = done["seconds"] if done else sum(s["seconds"] for s in steps)
        tokens = done["tokens"] if done else sum(s["tokens"] for s in steps)
        top = max(peak(s) for s in steps)
        longest = max(steps, key=lambda s: (s.get("longest", 0), s["seconds"]))
        last = evals[-1] if evals else None
        rows.append(
            f"| {name} | {len(steps)}{'' if done else ' (stopped)'} | {wall / 60:.1f} min | {tokens / wall:.0f} | "
            f"{top / 1e9:.2f} GB | step {longest['step']}: {longest.get('longest', 0):,}, {longest['seconds']:.1f} s, "
            f"{peak(longest) / 1e9:.2f} GB | "
            + (f"{last['loss']:.4f} (after step {last['eval']}) | {100 * last.get('agreement', 0):.2f}% |" if last else
               "– | – |"))
    return "\n".join(rows)


def plot(plt, runs, out):
    with_lr = any("lr" in s for steps, _, _ in runs.values() for s in steps)
    fig, axes = plt.subplots(1, 3 if with_lr else 2, figsize=(18 if with_lr else 12, 4.5))
    ax_loss, ax_time = axes[0], axes[1]
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
        if with_lr:
            axes[2].plot([s["step"] for s in steps if "lr" in s], [s["lr"] for s in steps if "lr" in s],
                         color=line.get_color(), label=name, linewidth=1)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (nats/token)")
    ax_loss.set_title("loss")
    ax_loss.legend(fontsize=8)
    ax_time.set_xlabel("step")
    ax_time.set_ylabel("seconds")
    ax_time.set_yscale("log")
    ax_time.set_title("time per step (the spikes hold the longest records)")
    ax_time.legend(fontsize=8)
    if with_lr:
        axes[2].set_xlabel("step")
        axes[2].set_ylabel("learning rate")
        axes[2].set_title("learning rate")
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="NAME=path/to/log.jsonl")
    ap.add_argument("--out", help="PNG to write (needs matplotlib)")
    args = ap.parse_args(argv)
    plt = None
    if args.out:  # before any work: what to install, at once
        plt = need_matplotlib()
        if plt is None:
            return MATPLOTLIB_MISSING
    runs = {}
    try:
        for spec in args.runs:
            if "=" not in spec:
                raise LogError("'%s' is not NAME=LOG" % spec)
            name, path = spec.split("=", 1)
            runs[name] = read_log(path)
        print(table(runs))
    except (LogError, KeyError, TypeError, ValueError) as e:
        what = "a step or eval record lacks %s" % e if isinstance(e, KeyError) else str(e)
        print("plot_runs.py: %s" % what, file=sys.stderr)
        return 1
    if args.out:
        plot(plt, runs, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

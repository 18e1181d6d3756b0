"""test_plot_runs.py — train/plot_runs.py on two logs written here: the Markdown table; the PNG when
matplotlib is installed (run as `python3 train/plot_runs.py`, which puts train/ first on sys.path,
where a file named after a standard-library module would be imported in its place); one line
saying what to install, exit status 2, when matplotlib is missing; one line naming a bad log; and
that no script in train/ shares its name with a standard-library module.
    PYTHONPATH=python python3 python/tests/test_plot_runs.py
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import finish, report, skip  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "train", "plot_runs.py")


def write_log(path, lr):
    """Three steps, an evaluation and the closing record, as winattn train writes them."""
    with open(path, "w") as f:
        for step in (1, 2, 3):
            rec = {"step": step, "loss": 3.0 / step, "targets": 100, "tokens": 128, "longest": 64 * step,
                   "seconds": 0.5 * step, "peak_rss": 2_000_000_000, "device_peak": 0, "arm": "fused", "packed": 1}
            if lr:
                rec["lr"] = 1e-4 * step / 3
            f.write(json.dumps(rec) + "\n")
        f.write(json.dumps({"eval": 3, "loss": 1.25, "agreement": 0.5, "tokens": 300}) + "\n")
        f.write(json.dumps({"done": 3, "seconds": 3.0, "peak_rss": 2_000_000_000, "tokens": 384, "arm": "fused",
                            "packed": 1}) + "\n")


def run(*args, env=None):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT, env=env)


def main():
    tmp = tempfile.TemporaryDirectory(prefix="winattn-plot-runs-")
    a, b = os.path.join(tmp.name, "a.jsonl"), os.path.join(tmp.name, "b.jsonl")
    write_log(a, lr=False)
    write_log(b, lr=True)

    r = run("first=" + a, "second=" + b)
    rows = [line for line in r.stdout.splitlines() if line.startswith("| first") or line.startswith("| second")]
    report(r.returncode == 0 and len(rows) == 2 and "| 3 | 0.1 min | 128 | 2.00 GB |" in rows[0] and
           "1.2500 (after step 3) | 50.00% |" in rows[0], "plot_runs table", (rows[0] if rows else r.stderr)[-200:])

    png = os.path.join(tmp.name, "runs.png")
    if importlib.util.find_spec("matplotlib") is None:
        skip("plot_runs PNG", "matplotlib is not installed (pip install matplotlib)")
    else:
        r = run("--out", png, "first=" + a, "second=" + b)
        with open(png, "rb") if os.path.exists(png) else open(os.devnull, "rb") as f:
            magic = f.read(8)
        report(r.returncode == 0 and magic == b"\x89PNG\r\n\x1a\n" and "wrote " + png in r.stdout,
               "plot_runs PNG with matplotlib installed", r.stderr.strip()[-300:])

    # matplotlib missing: a package of that name that fails to import, first on the path
    fake = os.path.join(tmp.name, "fake")
    os.makedirs(os.path.join(fake, "matplotlib"))
    with open(os.path.join(fake, "matplotlib", "__init__.py"), "w") as f:
        f.write("raise ImportError(\"No module named 'matplotlib'\")\n")
    env = dict(os.environ, PYTHONPATH=fake + os.pathsep + os.environ.get("PYTHONPATH", ""))
    missing = os.path.join(tmp.name, "missing.png")
    r = run("--out", missing, "first=" + a, env=env)
    err = r.stderr.strip()
    report(r.returncode == 2 and len(err.splitlines()) == 1 and err.endswith("pip install matplotlib") and
           not os.path.exists(missing) and r.stdout == "", "plot_runs without matplotlib: what to install, exit 2", err)

    bad = os.path.join(tmp.name, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"step": 1, "loss": 2.0}\n{oops\n')
    r = run("x=" + bad)
    err = r.stderr.strip()
    report(r.returncode == 1 and len(err.splitlines()) == 1 and bad + ":2: not valid JSON" in err,
           "plot_runs refuses a bad log in one line", err)
    r = run("x=" + os.path.join(tmp.name, "nope.jsonl"))
    report(r.returncode == 1 and "nope.jsonl: cannot open" in r.stderr and len(r.stderr.strip().splitlines()) == 1,
           "plot_runs refuses a missing log in one line", r.stderr.strip())

    names = getattr(sys, "stdlib_module_names", None)
    if names is None:
        skip("train/ shadows no standard-library module", "needs Python 3.10 (sys.stdlib_module_names)")
    else:
        train = os.path.join(ROOT, "train")
        clash = sorted(n for n in os.listdir(train) if n.endswith(".py") and n[:-3] in names)
        report(not clash, "train/ shadows no standard-library module", ", ".join(clash))
    tmp.cleanup()


if __name__ == "__main__":
    main()
    finish()

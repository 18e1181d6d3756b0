"""test_train_gpu_parse.py — bench/train_gpu.py reads the C trainer's own output: its step lines (with
and without the optimizer's lr and grad-norm fields, with and without the device peak), and its
one-line error rather than the profile lines it also prints. The CPU trainer's real output on
train/fixtures/gemma4_smoke is parsed and held against the run's log.jsonl. Run from the repository
root after `make` (SKIPs without the winattn binary):
    WINATTN_LIBRARY=build/libwinattn.so python3 python/tests/test_train_gpu_parse.py
"""
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import finish, report, skip  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from train_gpu import parse_c_output  # noqa: E402

MODEL = os.path.join(ROOT, "train", "fixtures", "gemma4_smoke")


def winattn_binary():
    lib = os.environ.get("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))
    exe = os.path.join(os.path.dirname(os.path.abspath(lib)), "winattn")
    return exe if os.access(exe, os.X_OK) else None


def main():
    gpu_line = ("step 2/3  loss 12.0104  lr 2.000e-04  grad norm 3.127  tokens 8192  longest 8192  3.42 s  2392 tok/s"
                "  peak RSS 1.20 GB  device peak 77.40 GB  ETA 3s")
    loaded = ("device: NVIDIA H100 80GB HBM3, bf16, projections nf4, dequantized per layer; base weights drawn and "
              "quantized on the GPU in 41.5 s, 19.93 GB on the device\n")
    r = parse_c_output(loaded + "step 1/3  loss 12.3  tokens 8192  longest 8192  9.00 s  910 tok/s  device peak 70.00 GB\n"
                       + gpu_line + "\n", "profile forward + backward (8192 tokens): 3000 ms\n", 0, 8192)
    report(r.get("seconds") == 3.42 and r.get("peak_gb") == 77.4 and r.get("losses") == ["12.3", "12.0104"]
           and "profile" in r, "train_gpu parses the device's step lines (lr and grad norm fields, device peak)",
           json.dumps(r)[:200])
    report("spread" not in r, "train_gpu gives no spread for one timed step", json.dumps(r)[:200])
    steps = "".join("step %d/4  loss 12.0  tokens 8192  longest 8192  %.2f s  2392 tok/s  device peak 70.00 GB  ETA 1s\n"
                    % (i + 1, t) for i, t in enumerate((9.0, 3.0, 3.3, 3.1)))
    r3 = parse_c_output(steps, "", 0, 8192)
    report(r3.get("seconds") == 3.1 and abs(r3.get("spread", 0) - 0.3 / 3.1) < 1e-12,
           "train_gpu: the timed steps' median (3.1 s of 3.0, 3.3, 3.1) and spread ((3.3 - 3.0) / 3.1)",
           json.dumps(r3)[:200])
    report(r.get("load_seconds") == 41.5 and r.get("base_gb") == 19.93,
           "train_gpu reads the base's load time and device size from the device line", json.dumps(r)[:200])
    r = parse_c_output("", "profile forward + backward (30553 tokens): 13021.2 ms\nwinattn train: batch 1: out of memory\n"
                       "profile forward + backward (30553 tokens): 13021.2 ms\n", 1, 30553)
    report(r == {"error": "winattn train: batch 1: out of memory"},
           "train_gpu reports the trainer's error line, not its profile line", json.dumps(r))
    exe = winattn_binary()
    if not exe:
        skip("train_gpu parse of a real run", "no winattn binary beside WINATTN_LIBRARY (run make first)")
        finish()
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        os.makedirs(data)
        rng = random.Random(3)
        with open(os.path.join(data, "train.jsonl"), "w") as f:
            for _ in range(3):
                f.write(json.dumps({"tokens": [2] + [rng.randrange(3, 512) for _ in range(300)]}) + "\n")
        out = os.path.join(tmp, "out")
        p = subprocess.run([exe, "train", "--model", MODEL, "--data", data, "--iters", "3", "--batch-size", "1",
                            "--lora-rank", "4", "--threads", "1", "--out", out], capture_output=True, text=True,
                           timeout=120)
        r = parse_c_output(p.stdout, p.stderr, p.returncode, 301)
        with open(os.path.join(out, "log.jsonl")) as f:
            logged = [json.loads(l) for l in f if '"loss"' in l and '"step"' in l]
        want = ["%.4f" % e["loss"] for e in logged]
        report(p.returncode == 0 and len(r.get("all_seconds", [])) == 3 and r.get("losses") == want,
               "train_gpu parses every step line of a real CPU run, losses as its log.jsonl has them",
               "parsed %s, log %s" % (r.get("losses", r), want))
        p = subprocess.run([exe, "train", "--model", MODEL, "--data", data, "--iters", "0"], capture_output=True,
                           text=True, timeout=60)
        r = parse_c_output(p.stdout, p.stderr, p.returncode, 301)
        report(p.returncode != 0 and r.get("error", "").startswith("winattn"),
               "train_gpu gives a refused run's own one-line error", json.dumps(r)[:200])
    finish()


main()

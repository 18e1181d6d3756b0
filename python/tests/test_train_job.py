"""test_train_job.py — bench/train_job.py's segments on the CPU: a small job stopped by SIGTERM
every ~1.5 s and resumed from its checkpoint until it finishes, against the same job run in one
piece. Run from the repository root after `make` (SKIPs without the winattn binary):
    WINATTN_LIBRARY=build/libwinattn.so python3 python/tests/test_train_job.py

The job: train/fixtures/gemma4_smoke, a synthetic corpus of 24 training records (200 to 1,500
tokens) and 8 held-out ones (1,000 to 1,500), --epochs 2 --batch-size 4 (12 steps), an evaluation every 3 steps
and at the end, a checkpoint every 2 updates, one thread. Checked: the segmented job takes more
than one segment, each exits 3 but the last (0); all five evaluations are there; `report
--reference` PASSes (every step's loss, the evaluations, adapters.safetensors and
optimizer.safetensors byte for byte) and FAILs on another job; an evaluation cut off by a SIGTERM
(--stop-after-step) is made by the resumed trainer before its first step, to the uninterrupted
run's value; another option on the same folder, a segment too short for one step and a missing
corpus are refused with one line. The report's phases against the FLOP floor, from device profiles
written into a finished job's log.jsonl as the GPU trainer writes them (WINATTN_TRAIN_PROFILE=1),
with the parameter count the segment read off the trainer's output.
"""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import case, finish, report, skip  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "train_job.py")
MODEL = os.path.join(ROOT, "train", "fixtures", "gemma4_smoke")
EVERY, STEPS, SEGMENT_S = 3, 12, 1.5


def winattn_binary():
    lib = os.environ.get("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))
    exe = os.path.join(os.path.dirname(os.path.abspath(lib)), "winattn")
    return exe if os.access(exe, os.X_OK) else None


def write_corpus(path):
    rng = random.Random(1)
    os.makedirs(path)
    for name, n, shortest in (("train", 24, 200), ("valid", 8, 1000)):
        with open(os.path.join(path, name + ".jsonl"), "w") as f:
            for _ in range(n):
                n_tokens = rng.randrange(shortest, 1500)
                f.write(json.dumps({"tokens": [2] + [rng.randrange(3, 512) for _ in range(n_tokens)]}) + "\n")


def job(exe, out, data, segment_s, *extra):
    cmd = [sys.executable, SCRIPT, "run", "--winattn", exe, "--out", out, "--device", "cpu", "--model", MODEL,
           "--data", data, "--segment-seconds", str(segment_s), "--steps-per-eval", str(EVERY), "--save-every", "2",
           "--lora-rank", "4", "--threads", "1"] + list(extra)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def main():
    exe = winattn_binary()
    if not exe:
        skip("train_job", "no winattn binary beside WINATTN_LIBRARY (run make first)")
        finish()
    tmp = tempfile.TemporaryDirectory()
    data, ref, seg = (os.path.join(tmp.name, d) for d in ("data", "ref", "seg"))
    write_corpus(data)

    @case("train_job uninterrupted")
    def _():
        p = job(exe, ref, data, 0)
        report(p.returncode == 0, "train_job uninterrupted run finishes in one segment (exit 0)",
               p.stderr.strip()[-300:])

    @case("train_job segments")
    def _():
        codes = []
        while len(codes) < 40:
            p = job(exe, seg, data, SEGMENT_S)
            codes.append(p.returncode)
            if p.returncode != 3:
                break
        with open(os.path.join(seg, "segments.json")) as f:
            segments = json.load(f)
        report(codes[-1] == 0 and set(codes[:-1]) <= {3} and len(segments) == len(codes) > 1,
               "train_job segments: exit 3 until the job is done, then 0; more than one segment",
               f"exits {codes}; {len(segments)} segments; {p.stderr.strip()[-200:]}")
        # a segment may end in a step an evaluation follows: the next segment's trainer makes it
        # first, so every evaluation during training is made exactly once
        stopped_at = [s["steps"][-1]["step"] for s in segments[:-1] if s["steps"]]
        last = max(t["step"] for s in segments for t in s["steps"])
        made = [e["label"] for s in segments for e in s["evals"] if e["label"] != "after training"]
        want = ["before training"] + [f"after step {k}" for k in range(EVERY, STEPS, EVERY)]
        report(sorted(made) == sorted(want) and last == STEPS,
               "train_job: every evaluation during training made once, wherever the segments end",
               f"segments end at steps {stopped_at}; evaluations {made}")
        report(all(s.get("sigterm") and s["trainer_exit"] == 143 for s in segments[:-1]),
               "train_job stops each segment with SIGTERM (the trainer exits 143 after its checkpoint)",
               str([s["trainer_exit"] for s in segments]))

    @case("train_job report --reference")
    def _():
        out_json = os.path.join(tmp.name, "report.json")
        p = subprocess.run([sys.executable, SCRIPT, "report", "--out", seg, "--reference", ref, "--json", out_json],
                           capture_output=True, text=True, timeout=60)
        with open(out_json) as f:
            r = json.load(f)
        report(p.returncode == 0 and "\nPASS" in p.stdout and r["reference"]["pass"],
               "train_job report --reference PASS: losses, evaluations and adapters identical to the uninterrupted run",
               p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr.strip())
        report(sorted(r["evals"], key=int) == [str(k) for k in range(0, STEPS + 1, EVERY)] and len(r["losses"]) == STEPS
               and r["segments"] > 1 and r["tokens"] > 0,
               "train_job report: every evaluation and step, tokens, the segment count",
               f"evals {sorted(r['evals'], key=int)}, {len(r['losses'])} steps, {r['segments']} segments")
        # the check can fail: another job's adapters are not this one's
        other = os.path.join(tmp.name, "other")
        job(exe, other, data, 0, "--learning-rate", "1e-3")
        p = subprocess.run([sys.executable, SCRIPT, "report", "--out", other, "--reference", ref],
                           capture_output=True, text=True, timeout=60)
        report(p.returncode == 1 and "\nFAIL" in p.stdout, "train_job report --reference FAILs on another job",
               p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr.strip())

    @case("train_job phases against the FLOP floor")
    def _():
        # the GPU trainer's fields, with numbers whose sums are known: a step's frozen products take
        # 100 + step ms at 1e12 operations a ms (1 PFLOP/s), the other phases fixed times
        prof = os.path.join(tmp.name, "prof")
        shutil.copytree(ref, prof)
        log_path = os.path.join(prof, "adapters", "log.jsonl")
        with open(log_path) as f:
            records = [json.loads(line) for line in f]
        fixed = {"lora": 10.0, "attention": 20.0, "elementwise": 5.0, "head": 8.0, "fp8_quant": 0.0,
                 "copy_waits": 0.5, "optimizer": 1.0}
        for r in records:
            if "step" in r:
                r["device_ms"] = dict(products=100.0 + r["step"], **fixed)
                r["device_flop"] = {"products": 1e12 * (100 + r["step"]), "lora": 1e9, "head": 2e9}
        with open(log_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        out_json = os.path.join(tmp.name, "prof.json")
        p = subprocess.run([sys.executable, SCRIPT, "report", "--out", prof, "--json", out_json],
                           capture_output=True, text=True, timeout=60)
        with open(out_json) as f:
            ph = json.load(f)["phases"]
        with open(os.path.join(ref, "segments.json")) as f:
            params = json.load(f)[0].get("parameters")
        steps = [r for r in records if "step" in r]
        tokens = sum(r["tokens"] for r in steps)
        products_s = sum(100.0 + r["step"] for r in steps) / 1e3
        device_s = products_s + len(steps) * sum(fixed.values()) / 1e3
        step_s = sum(r["seconds"] for r in steps)
        p_all = params["frozen"] + params["trainable"] if params else 0
        floor = 6 * p_all * tokens / 1e15
        close = lambda x, y: abs(x - y) <= 1e-9 * max(abs(x), abs(y), 1)  # noqa: E731
        report(params is not None and params["frozen"] > params["trainable"] > 0,
               "train_job reads the parameter count off the trainer's \"lora: ...\" line", str(params))
        report(p.returncode == 0 and ph and ph["steps"] == STEPS and close(ph["seconds"]["products"], products_s)
               and close(ph["products_flop_per_s"], 1e15) and close(ph["host_and_gaps_s"], step_s - device_s)
               and ph["parameters"] == p_all and close(ph["floor_s"], floor),
               "train_job report: the profiled steps' phases, the products' rate and the floor 6·P·T at that rate",
               f"{json.dumps(ph)[:400]}; expected products {products_s} s, floor {floor} s; {p.stderr.strip()}")
        lines = p.stdout.splitlines()
        report(any(l.startswith("FLOP floor: 6 * P * T") for l in lines) and any("products" in l and "1,000 TFLOP/s" in l
                                                                                 for l in lines)
               and not any("FP8 quantization" in l for l in lines),
               "train_job report prints the phases (those that ran) and the floor line",
               "\n".join(l for l in lines if "floor" in l or "TFLOP" in l))
        p = subprocess.run([sys.executable, SCRIPT, "report", "--out", ref], capture_output=True, text=True,
                           timeout=60)
        report(p.returncode == 0 and "phases:" not in p.stdout and "FLOP floor" not in p.stdout,
               "train_job report: no phase lines for a job run without profiles", p.stdout.strip()[-300:])

    @case("train_job evaluation cut off")
    def _():
        # SIGTERM as step 3 ends: the trainer stops before the evaluation that follows it, or
        # abandons it (~0.2 s here), and the next segment's trainer makes it before its first step
        cut = os.path.join(tmp.name, "cut")
        first = job(exe, cut, data, 0, "--stop-after-step", str(EVERY))
        rest = job(exe, cut, data, 0)
        with open(os.path.join(cut, "segments.json")) as f:
            segments = json.load(f)
        owed = [e["label"] for e in segments[1]["evals"]][:1] if len(segments) > 1 else []
        first_evals = [e["label"] for e in segments[0]["evals"]]
        report(first.returncode == 3 and rest.returncode == 0 and segments[0]["steps"][-1]["step"] == EVERY
               and f"after step {EVERY}" not in first_evals and owed == [f"after step {EVERY}"],
               "train_job: the evaluation a segment's SIGTERM cut off is made first by the next segment's trainer",
               f"exits {first.returncode}, {rest.returncode}; first segment ends at step "
               f"{segments[0]['steps'][-1]['step'] if segments[0]['steps'] else None}, evaluations {first_evals}; the next "
               f"segment's first {owed}; {rest.stderr.strip()[-200:]}")
        p = subprocess.run([sys.executable, SCRIPT, "report", "--out", cut, "--reference", ref],
                           capture_output=True, text=True, timeout=60)
        report(p.returncode == 0 and "\nPASS" in p.stdout,
               "train_job report --reference PASS: the owed evaluation equals the uninterrupted run's",
               p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr.strip())

    @case("train_job refusals")
    def _():
        p = job(exe, seg, data, 0, "--learning-rate", "1e-3")
        lines = p.stderr.strip().splitlines()
        report(p.returncode == 2 and len(lines) == 1 and "other options" in lines[0],
               "train_job refuses another option on a started job, one line", p.stderr.strip())
        p = job(exe, os.path.join(tmp.name, "short"), data, 0.05)
        lines = p.stderr.strip().splitlines()
        report(p.returncode == 1 and len(lines) == 1 and "before its first step" in lines[0],
               "train_job says when a segment is too short to train a step, one line", p.stderr.strip())
        p = job(exe, os.path.join(tmp.name, "none"), os.path.join(tmp.name, "missing"), 0)
        lines = p.stderr.strip().splitlines()
        report(p.returncode == 2 and len(lines) == 1 and "build_corpus.py" in lines[0],
               "train_job refuses a folder without the corpus, naming the command that builds it", p.stderr.strip())

    tmp.cleanup()
    finish()


if __name__ == "__main__":
    main()

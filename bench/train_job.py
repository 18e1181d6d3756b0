#!/usr/bin/env python3
"""train_job.py — the write-up's corpus job at Gemma 4 31B's shape on one GPU, run in segments
that each fit a machine's per-command time limit.

The job (docs/train.md §7): `train/configs/gemma4-31b.json` (60 layers, or its first --layers),
random bf16 weights drawn on the GPU (`--init-random 0`), LoRA rank 32 on q, k, v, o, the corpus
of train/corpus/build_corpus.py (171 training and 21 held-out records), `--epochs 2 --batch-size 4`
(86 steps), the held-out loss before training, after step 43 (`--steps-per-eval 43`) and after
step 86 (`--eval`), learning rate 2e-4, seed 0, a checkpoint every 10 updates.

  python3 bench/train_job.py run --winattn build/winattn --out DIR [--segment-seconds 540]
          [--layers N] [--device cuda|cpu] [--model DIR] [--data DIR] [--threads T] [--profile] [...]
  python3 bench/train_job.py report --out DIR [--reference DIR2] [--json FILE]

`run` is one segment: it starts the job in DIR (the adapters and checkpoints in DIR/adapters), or
resumes it from DIR/adapters' checkpoint with the options it was started with, and sends SIGTERM
to `winattn train` early enough that the step in hand and the checkpoint it then writes end
within --segment-seconds (estimated from the longest step, evaluation and checkpoint write seen
so far). A segment stopped in a step that an evaluation follows (or in that evaluation) leaves
it to the next: the resumed trainer makes an evaluation it owes before its first step.
--segment-seconds 0: no limit (one uninterrupted run).
Each segment's wall time, start-up, tokens, peak memory, step losses and evaluations go into
DIR/segments.json, its output into DIR/logs/. Exit status 0: the job is finished; 3: more
remains; 1 or 2: an error (one line). So `until python3 bench/train_job.py run ...; do :; done`,
or one `run` per command on a machine that limits each, finishes it.

`report` prints the job's time (the segments' time after start-up, and with it), tokens/s, peak
host and device memory, the held-out losses and the segment count, beside the write-up's
8,228 s. Where the segments ran with --profile (the trainer's WINATTN_TRAIN_PROFILE=1 on the GPU:
each step's device time by phase and its products' operations in log.jsonl), it also prints the
steps' time per phase against the FLOP floor: 6·P·T (P the model's parameters, frozen and
trainable, T the tokens trained) at the rate the frozen products reached in the same steps. With
--reference (an uninterrupted run of the same job) it compares every step's loss and evaluation
(the trainer's log.jsonl) and the final adapters.safetensors and optimizer.safetensors byte for
byte (SHA-256), and prints PASS or FAIL (exit 1).

Needs only Python's standard library and the winattn binary. The corpus is built where there is
network (`python3 train/corpus/build_corpus.py --out data/corpus` runs `apt-get download
python3.11-doc`) and carried, as a folder, to a machine without network: --data points at it.
DIR must survive from one segment to the next (where only the repository's folder is kept between
commands: a git-ignored folder in it, such as build-gpu/job).
"""
import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIG = os.path.join(ROOT, "train", "configs", "gemma4-31b.json")
WRITEUP_SECONDS = 8228  # the write-up's job on its Mac Studio (docs/train.md §7: 137 min; DGX Spark 615 min)
EXIT_MORE = 3

STEP = re.compile(r"^step (\d+)/(\d+) +loss (\S+) +.*?tokens (\d+) +longest \d+ +([0-9.]+) s +\d+ tok/s +"
                  r"peak RSS ([0-9.]+) GB(?: +device peak ([0-9.]+) GB)?")
EVAL = re.compile(r"^eval(?: (.*?))?: held-out loss (\S+) over (\d+) tokens.*\(([0-9.]+) s\)")
CHECKPOINT = re.compile(r"^checkpoint: ")
LORA = re.compile(r"^lora: .*? (\d+) trainable parameters; base (\d+) parameters frozen")
# log.jsonl's device phases (WINATTN_TRAIN_PROFILE=1), in the trainer's order, and their names here
PHASES = [("products", "products"), ("lora", "LoRA products"), ("attention", "attention"),
          ("elementwise", "elementwise"), ("head", "head"), ("fp8_quant", "FP8 quantization"),
          ("copy_waits", "layer-input copy waits"), ("optimizer", "optimizer")]
DATA = re.compile(r"^data: ")


def fail(msg, code=1):
    print("train_job: " + msg, file=sys.stderr)
    sys.exit(code)


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as e:
        fail(f"{path}: cannot read: {e}")


def write_json(path, obj):
    """Written to a temporary beside it, then renamed: a reader never sees half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def make_model(out, layers):
    """DIR/model/config.json: the 31B text config, cut to its first `layers` layers when given."""
    with open(CONFIG) as f:
        cfg = json.load(f)
    if layers:
        cfg["num_hidden_layers"] = layers
        cfg["layer_types"] = cfg["layer_types"][:layers]
    model = os.path.join(out, "model")
    os.makedirs(model, exist_ok=True)
    write_json(os.path.join(model, "config.json"), cfg)


def job_args(a, model):
    """The trainer's options for the job, without where its checkpoint goes."""
    args = ["--model", model, "--data", a.data, "--device", a.device]
    if a.init_random is not None:
        args += ["--init-random", str(a.init_random)]
    args += ["--epochs", str(a.epochs), "--batch-size", str(a.batch_size), "--lora-rank", str(a.lora_rank),
             "--lora-keys", a.lora_keys, "--learning-rate", str(a.learning_rate), "--seed", str(a.seed),
             "--steps-per-eval", str(a.steps_per_eval), "--eval", "--save-every", str(a.save_every)]
    if a.max_seq_length:
        args += ["--max-seq-length", str(a.max_seq_length)]
    if a.deterministic:
        args += ["--deterministic"]
    return args


def comparable(args):
    """The options that make the job, without the folders they are read from (which may move)."""
    return [x for i, x in enumerate(args) if i == 0 or args[i - 1] not in ("--model", "--data")]


class Estimates:
    """The longest step, evaluation and checkpoint write seen in this job so far (seconds)."""

    def __init__(self, segments, device):
        self.step = max([s.get("longest_step_s", 0) for s in segments] + [0])
        self.eval = max([s.get("longest_eval_s", 0) for s in segments] + [0])
        self.ckpt = max([s.get("longest_checkpoint_s", 0) for s in segments] + [0])
        self.ckpt_default = 30.0 if device == "cuda" else 1.0

    def checkpoint(self):
        return self.ckpt if self.ckpt > 0 else self.ckpt_default


def die_with_parent():
    """In the trainer's process, before exec: SIGTERM when this script dies (even by SIGKILL), so
    the trainer checkpoints and exits rather than running on alone (Linux; elsewhere nothing)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def cmd_run(a):
    out = os.path.abspath(a.out)
    if not os.access(a.winattn, os.X_OK):
        fail(f"--winattn {a.winattn}: not an executable (build it with make)", 2)
    for split in ("train.jsonl", "valid.jsonl"):
        if not os.path.isfile(os.path.join(a.data, split)):
            fail(f"--data {a.data}: no {split}; build the corpus with `python3 train/corpus/build_corpus.py --out "
                 f"{a.data}` where apt-get can download python3.11-doc, and carry the folder to this machine", 2)
    if not a.model:
        with open(CONFIG) as f:
            most = json.load(f)["num_hidden_layers"]
        if not 0 <= a.layers <= most:
            fail(f"--layers {a.layers}: {os.path.relpath(CONFIG, ROOT)} has {most} layers", 2)
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    if a.model:
        model = a.model
    else:
        if a.device != "cuda":
            fail("--device cpu needs --model DIR (--init-random draws the weights on the GPU only)", 2)
        model = os.path.join(out, "model")
        if a.init_random is None:
            a.init_random = 0
    adapters = os.path.join(out, "adapters")
    args = job_args(a, model)
    job_path, seg_path = os.path.join(out, "job.json"), os.path.join(out, "segments.json")
    job = read_json(job_path)
    resume = os.path.isfile(os.path.join(adapters, "trainer_state.json"))
    if job is not None and not resume and not job.get("finished"):
        job = None  # no checkpoint yet: nothing to continue, the job starts afresh with these options
        write_json(seg_path, [])
    shape = None if a.model else f"gemma4-31b.json, {a.layers or 60} layers, random bf16 weights"
    if job is None:
        job = {"trainer_args": args, "shape": shape, "steps_per_eval": a.steps_per_eval, "finished": False,
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        write_json(job_path, job)
    elif comparable(job["trainer_args"]) != comparable(args):
        was, now = comparable(job["trainer_args"]), comparable(args)
        i = next((i for i, (x, y) in enumerate(zip(was, now)) if x != y), min(len(was), len(now)))
        diff = f"{' '.join(was[max(i - 1, 0):i + 1])} (now {' '.join(now[max(i - 1, 0):i + 1])})"
        fail(f"{out} holds a job started with other options: {diff}; run it with the options it was started with", 2)
    elif job.get("shape") != shape:
        was = job.get("shape") or "the --model folder"
        fail(f"{out} holds a job of another model: {was} (now {shape or 'the --model folder'})", 2)
    if not a.model:
        make_model(out, a.layers)
    segments = read_json(seg_path, [])
    if job.get("finished"):
        print(f"train_job: {out}: the job is finished ({len(segments)} segments); see `report`")
        return 0
    cmd = [a.winattn, "train"] + args + (["--resume", adapters] if resume else ["--adapter-path", adapters])
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    env = dict(os.environ)
    env.pop("WINATTN_TRAIN_PROFILE", None)
    if a.profile:
        env["WINATTN_TRAIN_PROFILE"] = "1"
    index = len(segments) + 1
    est = Estimates(segments, a.device)
    budget = a.segment_seconds
    margin = a.margin if a.margin is not None else 0.05 * budget
    out_path = os.path.join(out, "logs", f"segment-{index:02d}.out")
    err_path = os.path.join(out, "logs", f"segment-{index:02d}.err")
    print(f"segment {index}: {'resume' if resume else 'start'}: {' '.join(cmd)}", flush=True)

    stop_request = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: stop_request.append(s))
    t0 = time.monotonic()
    # the trainer writes to files, read here as they grow: it never meets a closed pipe, whatever
    # becomes of this script
    with open(out_path, "w") as out_file, open(err_path, "w") as err_file:
        proc = subprocess.Popen(cmd, stdout=out_file, stderr=err_file, start_new_session=True,
                                preexec_fn=die_with_parent, env=env)
    reader = open(out_path, errors="replace")

    seg = {"segment": index, "resumed": resume, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "segment_seconds": budget, "steps": [], "evals": [], "checkpoints": []}
    iters, last_step_at, startup, sigterm_at, second_at = None, None, None, None, None
    pending, exited = "", None

    def send_stop(why):
        nonlocal sigterm_at, second_at
        now = time.monotonic() - t0
        if sigterm_at is None:
            sigterm_at = now
            seg["sigterm"] = {"at_s": round(now, 3), "why": why}
        else:
            second_at = now
            seg["second_signal"] = {"at_s": round(now, 3), "why": why}
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        print(f"train_job: SIGTERM to the trainer at {now:.1f} s ({why})", flush=True)

    while True:
        chunk = reader.readline()
        if not chunk and exited is not None:
            break
        pending += chunk
        now = time.monotonic() - t0
        if pending.endswith("\n"):
            line, pending = pending, ""
            sys.stdout.write(line)
            sys.stdout.flush()
            text = line.rstrip("\n")
            moved = False  # a step or an evaluation after one has just ended
            if DATA.match(text) and startup is None:
                startup = now
            m = LORA.match(text)
            if m:
                seg["parameters"] = {"trainable": int(m.group(1)), "frozen": int(m.group(2))}
            m = STEP.match(text)
            if m:
                step, iters = int(m.group(1)), int(m.group(2))
                seg["iters"] = iters
                secs = float(m.group(5))
                est.step = max(est.step, secs)
                seg["steps"].append({"step": step, "loss": m.group(3), "tokens": int(m.group(4)), "seconds": secs,
                                     "peak_rss_gb": float(m.group(6)),
                                     "device_peak_gb": float(m.group(7)) if m.group(7) else None})
                last_step_at = now
                # a SIGTERM now stops the trainer after step + 1, before any evaluation that follows it
                in_flight, moved = step + 1, True
            m = EVAL.match(text)
            if m:
                secs = float(m.group(4))
                est.eval = max(est.eval, secs)
                seg["evals"].append({"label": m.group(1) or "", "loss": m.group(2), "tokens": int(m.group(3)),
                                     "seconds": secs})
                if seg["steps"]:
                    in_flight, moved = seg["steps"][-1]["step"] + 1, True
            if CHECKPOINT.match(text) and last_step_at is not None:
                took = now - last_step_at
                est.ckpt = max(est.ckpt, took)
                seg["checkpoints"].append({"after_step": seg["steps"][-1]["step"], "seconds": round(took, 3)})
            if moved and a.stop_after_step and sigterm_at is None and a.stop_after_step < in_flight <= iters:
                send_stop(f"--stop-after-step {a.stop_after_step}")
            if moved and budget > 0 and sigterm_at is None and iters and in_flight <= iters:
                # stop now unless the end of the step in hand still leaves another step and a
                # checkpoint in the budget (after the last step: unless the checkpoint and the
                # evaluation after training fit)
                if in_flight == iters:
                    later = now + est.step + est.checkpoint() + est.eval
                else:
                    later = now + est.step + est.step + est.checkpoint()
                if later + margin > budget:
                    send_stop(f"step {in_flight} is the last that fits: longest step {est.step:.1f} s, "
                              f"checkpoint {est.checkpoint():.1f} s, evaluation {est.eval:.1f} s")
        if chunk:
            continue  # read on while there is output
        if exited is None:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                exited = (status, usage)
                continue  # what it wrote last is read before the loop ends
            time.sleep(0.05)
            if stop_request and sigterm_at is None:
                send_stop(f"this script got signal {stop_request[0]}")
            elif budget > 0 and sigterm_at is None and now > budget:
                send_stop("the segment's time is up")
            elif budget > 0 and sigterm_at is not None and second_at is None and now > budget + a.kill_after:
                send_stop(f"still running {a.kill_after:g} s after the segment's time: the last checkpoint stands")
    status, usage = exited
    rc = proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - t0
    reader.close()
    if pending:
        sys.stdout.write(pending + "\n")
    with open(err_path) as f:
        stderr_tail = [line.rstrip() for line in f if line.strip()][-5:]
    seg.update({"wall_s": round(wall, 3), "startup_s": round(startup, 3) if startup is not None else None,
                "trainer_exit": rc, "max_rss_gb": usage.ru_maxrss * 1024 / 1e9,
                "tokens": sum(s["tokens"] for s in seg["steps"]),
                "step_seconds": round(sum(s["seconds"] for s in seg["steps"]), 3),
                "eval_seconds": round(sum(e["seconds"] for e in seg["evals"]), 3),
                "longest_step_s": max([s["seconds"] for s in seg["steps"]] + [0]),
                "longest_eval_s": max([e["seconds"] for e in seg["evals"]] + [0]),
                "longest_checkpoint_s": max([c["seconds"] for c in seg["checkpoints"]] + [0])})
    if rc != 0 and sigterm_at is None:
        seg["error"] = stderr_tail[-1] if stderr_tail else f"exit status {rc}"
    segments.append(seg)
    write_json(seg_path, segments)
    if rc == 0:
        job["finished"] = True
        write_json(job_path, job)
        print(f"train_job: the job is finished after {index} segment(s); "
              f"python3 bench/train_job.py report --out {a.out}")
        return 0
    if sigterm_at is not None and not seg["steps"]:
        before = "start-up" if resume else "start-up and the evaluation before training"
        fail(f"segment {index} was stopped before its first step ({wall:.1f} s): {before} take longer than "
             f"--segment-seconds {budget:g}")
    if sigterm_at is not None:
        print(f"train_job: segment {index} stopped ({wall:.1f} s, trainer exit {rc}); run again to continue")
        return EXIT_MORE
    fail(f"the trainer failed (exit {rc}): {seg['error']}")


def job_log(out):
    """Per-step losses, tokens, seconds and the evaluations of the job, from the trainer's log.jsonl:
    the steps a resume repeats (after a second signal) count once, as the resumed run made them."""
    path = os.path.join(out, "adapters", "log.jsonl")
    steps, evals = {}, {}
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as e:
        fail(f"{path}: cannot read: {e.strerror}")
    for n, line in enumerate(lines, 1):
        try:
            r = json.loads(line)
        except ValueError:
            fail(f"{path}:{n}: not JSON")
        if "resume" in r:
            steps = {k: v for k, v in steps.items() if k <= r["resume"]}
            evals = {k: v for k, v in evals.items() if k <= r["resume"]}
        elif "step" in r:
            steps[r["step"]] = r
        elif "eval" in r:
            evals[r["eval"]] = r
    return steps, evals


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def phase_times(steps, segments):
    """The profiled steps' device time by phase (log.jsonl's device_ms and device_flop, from a run
    with --profile), the rate of their frozen products, and the FLOP floor 6·P·T at that rate:
    None where no step was profiled."""
    prof = [r for r in steps.values() if "device_ms" in r]
    if not prof:
        return None
    ms = {k: sum(r["device_ms"].get(k, 0.0) for r in prof) for k, _ in PHASES}
    flop = {k: sum(r.get("device_flop", {}).get(k, 0) for r in prof) for k, _ in PHASES}
    step_s = sum(r["seconds"] for r in prof)
    tokens = sum(r["tokens"] for r in prof)
    seconds = {k: v / 1e3 for k, v in ms.items()}
    rate = flop["products"] / seconds["products"] if seconds["products"] > 0 else None
    r = {"steps": len(prof), "step_seconds": step_s, "tokens": tokens, "seconds": seconds, "flop": flop,
         "products_flop_per_s": rate, "host_and_gaps_s": step_s - sum(seconds.values())}
    params = next((s["parameters"] for s in reversed(segments) if s.get("parameters")), None)
    if params and rate:
        p = params["frozen"] + params["trainable"]
        r.update(parameters=p, floor_flop=6 * p * tokens, floor_s=6 * p * tokens / rate)
    return r


def summarize(out):
    job = read_json(os.path.join(out, "job.json"))
    if job is None:
        fail(f"{out}: no job.json (not a train_job.py folder)")
    segments = read_json(os.path.join(out, "segments.json"), [])
    steps, logged = job_log(out)
    evals = {k: v["loss"] for k, v in logged.items()}
    wall = sum(s["wall_s"] for s in segments)
    after_startup = sum(s["wall_s"] - (s["startup_s"] or 0) for s in segments)
    step_s = sum(r["seconds"] for r in steps.values())
    tokens = sum(r["tokens"] for r in steps.values())
    files = {}
    for name in ("adapters.safetensors", "optimizer.safetensors"):
        p = os.path.join(out, "adapters", name)
        files[name] = sha256(p) if os.path.isfile(p) else None
    dev = [r["device_peak"] for r in steps.values() if r.get("device_peak")]
    return {
        "out": out, "finished": bool(job.get("finished")), "shape": job.get("shape"),
        "trainer_args": job["trainer_args"],
        "segments": len(segments), "steps": len(steps), "segment_list": segments,
        "wall_s": wall, "after_startup_s": after_startup, "startup_s": wall - after_startup,
        "step_seconds": step_s,
        "eval_seconds": sum(s["eval_seconds"] for s in segments),
        "tokens": tokens, "tokens_per_s_steps": tokens / step_s if step_s else None,
        "tokens_per_s_after_startup": tokens / after_startup if after_startup else None,
        "peak_rss_gb": max([s["max_rss_gb"] for s in segments] + [0]),
        "device_peak_gb": max(dev) / 1e9 if dev else None,
        "evals": {str(k): v for k, v in sorted(evals.items())},
        "phases": phase_times(steps, segments),
        "losses": {str(k): v["loss"] for k, v in sorted(steps.items())},
        "sha256": files,
    }


def cmd_report(a):
    r = summarize(os.path.abspath(a.out))
    args = r["trainer_args"]
    print(f"job: winattn train {' '.join(args)}")
    print(f"{'finished' if r['finished'] else 'NOT finished'}: {r['steps']} steps in {r['segments']} segment(s)")
    for s in r["segment_list"]:
        steps = [t["step"] for t in s["steps"]]
        span = f"steps {steps[0]}-{steps[-1]}" if steps else "no steps"
        end = (f"SIGTERM at {s['sigterm']['at_s']:.1f} s, exit {s['trainer_exit']}" if s.get("sigterm")
               else f"exit {s['trainer_exit']}")
        startup = f"{s['startup_s']:.1f} s" if s["startup_s"] is not None else "?"
        print(f"  segment {s['segment']}: {s['wall_s']:.1f} s (start-up {startup}), {span}, {s['tokens']:,} tokens, "
              f"{len(s['evals'])} evaluation(s); {end}")
    print(f"time: {r['after_startup_s']:.1f} s after start-up, summed over the segments ({r['wall_s']:.1f} s with "
          f"start-up); steps {r['step_seconds']:.1f} s, evaluations {r['eval_seconds']:.1f} s")
    if r["tokens_per_s_steps"]:
        print(f"tokens: {r['tokens']:,} trained, {r['tokens_per_s_steps']:,.0f} tok/s over the steps, "
              f"{r['tokens_per_s_after_startup']:,.0f} tok/s over the time after start-up")
    dev = f", device peak {r['device_peak_gb']:.1f} GB" if r["device_peak_gb"] else ""
    print(f"memory: host peak {r['peak_rss_gb']:.2f} GB (the trainer process's max RSS){dev}")
    print("held-out loss: " + ", ".join(
        f"{'before training' if k == '0' else 'after step ' + k} {v:.4f}" for k, v in r["evals"].items()))
    if r["finished"] and r["shape"]:
        print(f"the job ({r['shape']}): {r['wall_s']:,.0f} s with start-up, beside the write-up's "
              f"{WRITEUP_SECONDS:,} s "
              f"(137 min on its Mac Studio, docs/train.md §7): {WRITEUP_SECONDS / r['wall_s']:.1f}x")
    ph = r["phases"]
    if ph:
        floor = ph.get("floor_s")
        print(f"phases: the device time of {ph['steps']} of the {r['steps']} steps (run --profile), whose step time "
              f"is {ph['step_seconds']:.1f} s" + (f"; against the FLOP floor of {floor:.1f} s (below)" if floor else ""))
        rows = [(name, ph["seconds"][key], key) for key, name in PHASES if ph["seconds"][key] > 0 or key == "products"]
        rows.append(("host and gaps (step time - device phases)", ph["host_and_gaps_s"], None))
        for name, secs, key in rows:
            rate = ""
            if key in ("products", "lora") and secs > 0 and ph["flop"][key]:
                rate = f"  {ph['flop'][key] / secs / 1e12:,.0f} TFLOP/s"
            against = f"  {secs / floor:5.2f}x the floor" if floor else ""
            print(f"  {name:<44} {secs:9.1f} s  {100 * secs / ph['step_seconds']:5.1f} %{against}{rate}")
        if floor:
            print(f"FLOP floor: 6 * P * T = 6 x {ph['parameters']:,} parameters x {ph['tokens']:,} tokens = "
                  f"{ph['floor_flop'] / 1e15:,.2f} PFLOP, {floor:.1f} s at the frozen products' measured "
                  f"{ph['products_flop_per_s'] / 1e12:,.0f} TFLOP/s; the steps take {ph['step_seconds'] / floor:.2f}x it")
        else:
            print("FLOP floor: not known (no parameter count in the segments' output, or no frozen products timed)")
    ok = True
    if a.reference:
        ref = summarize(os.path.abspath(a.reference))
        checks = []
        checks.append(("same job options", comparable(ref["trainer_args"]) == comparable(args)))
        checks.append(("both finished", r["finished"] and ref["finished"]))
        diff = [k for k in set(r["losses"]) | set(ref["losses"]) if r["losses"].get(k) != ref["losses"].get(k)]
        checks.append((f"{len(r['losses'])} step losses equal (log.jsonl, 6 decimals)"
                       + (f"; first difference at step {min(diff, key=int)}" if diff else ""), not diff))
        same = r["evals"] == ref["evals"]
        checks.append((f"{len(r['evals'])} held-out losses equal (log.jsonl, 6 decimals)", same))
        for name, h in r["sha256"].items():
            checks.append((f"{name} identical byte for byte (SHA-256 {str(h)[:16]}...)",
                           h is not None and h == ref["sha256"][name]))
        checks.append((f"this run in {r['segments']} segments, the reference in {ref['segments']}", True))
        for what, good in checks:
            print(f"  {'ok  ' if good else 'FAIL'} {what}")
        ok = all(g for _, g in checks)
        print(("PASS" if ok else "FAIL") + f": resumed job against the uninterrupted run in {a.reference}")
        r["reference"] = {"out": ref["out"], "pass": ok, "checks": [{"check": w, "ok": g} for w, g in checks]}
    if a.json:
        write_json(a.json, r)
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one segment of the job")
    run.add_argument("--winattn", default=os.path.join(ROOT, "build", "winattn"))
    run.add_argument("--out", required=True)
    run.add_argument("--segment-seconds", type=float, default=540,
                     help="the segment's time, the checkpoint included (0: no limit)")
    run.add_argument("--margin", type=float, default=None, help="seconds kept spare (default 5%% of the segment)")
    run.add_argument("--kill-after", type=float, default=20,
                     help="a second SIGTERM (exit at once) this long after the segment's time")
    run.add_argument("--stop-after-step", type=int, default=0,
                     help="SIGTERM once step N has ended, even in an evaluation (a check that none is lost)")
    run.add_argument("--layers", type=int, default=0, help="the 31B config's first N layers (default all 60)")
    run.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    run.add_argument("--model", default=None, help="a model folder instead of the 31B config with random weights")
    run.add_argument("--init-random", type=int, default=None)
    run.add_argument("--data", default=os.path.join(ROOT, "data", "corpus"))
    run.add_argument("--epochs", type=int, default=2)
    run.add_argument("--batch-size", type=int, default=4)
    run.add_argument("--lora-rank", type=int, default=32)
    run.add_argument("--lora-keys", default="q,k,v,o")
    run.add_argument("--learning-rate", default="2e-4")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--steps-per-eval", type=int, default=43)
    run.add_argument("--save-every", type=int, default=10)
    run.add_argument("--max-seq-length", type=int, default=0)
    run.add_argument("--threads", type=int, default=0)
    run.add_argument("--deterministic", action="store_true",
                     help="the trainer's --deterministic (GPU): needed for a bit-for-bit --reference check there")
    run.add_argument("--profile", action="store_true",
                     help="the trainer's WINATTN_TRAIN_PROFILE=1 (GPU): each step's device time by phase, for report")
    rep = sub.add_parser("report", help="the job's numbers; --reference checks it against an uninterrupted run")
    rep.add_argument("--out", required=True)
    rep.add_argument("--reference", default=None)
    rep.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.command == "run":
        a.data = os.path.abspath(a.data)
        if a.model:
            a.model = os.path.abspath(a.model)
        sys.exit(cmd_run(a))
    sys.exit(cmd_report(a))


if __name__ == "__main__":
    main()

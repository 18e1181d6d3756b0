"""test_peft.py — `winattn train`'s adapters loaded where their users load them, on tiny Gemma 4
checkpoints built and saved by transformers (one text-only, Gemma4ForCausalLM; one multimodal,
Gemma4ForConditionalGeneration, whose text model sits under model.language_model and beside a
vision tower with q_proj modules of its own). SKIPs without torch, transformers or peft (and the
mlx-lm cases without mlx-lm). Run from the repository root after `make`:
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_peft.py

For each checkpoint the trainer runs a few CPU (float32) steps on random tokens with
--adapter-format peft, adapting every projection of the last 4 of 6 layers (layers_to_transform
for the text-only checkpoint, an expression naming the language model's layers for the multimodal
one). Then:
  - PeftModel.from_pretrained loads the folder onto the transformers model of the same checkpoint
    with nothing missing or left over, and its held-out loss (float32, eager attention) equals the
    trainer's own evaluation within 1e-5 relative;
  - `winattn train --eval-only --adapters FOLDER` reads the peft folder back: the same loss;
  - the mlx-lm layout of the same run reads back the same way.
With mlx-lm (text-only checkpoint): mlx_lm's load_adapters reads our mlx-lm folder and gives our
loss, and adapters made and saved by mlx-lm itself (mx.save_safetensors, whose header says
"__metadata__": null) are evaluated by the trainer to mlx-lm's loss (1e-4 relative: MLX's CPU
kernels sum in another order).
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import case, finish, report, skip  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-5
MLX_TOL = 1e-4
LAYERS, LORA_LAYERS, RANK, SCALE = 6, 4, 4, 2.0
KEYS = "q,k,v,o,gate,up,down"


def winattn_binary():
    lib = os.environ.get("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))
    exe = os.path.join(os.path.dirname(os.path.abspath(lib)), "winattn")
    return exe if os.access(exe, os.X_OK) else None


def text_config():
    from transformers import Gemma4TextConfig
    # test_transformers.py's Gemma 4, shaped like 31B: k = v on the full layer, one global KV head
    return Gemma4TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=8, head_dim=16,
                            sliding_window=8, attention_dropout=0.0, num_hidden_layers=LAYERS, num_key_value_heads=4,
                            global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                            layer_types=["sliding_attention"] * 5 + ["full_attention"], hidden_size_per_layer_input=0,
                            num_kv_shared_layers=0, final_logit_softcapping=30.0)


def make_checkpoint(kind, path, seed):
    """A float32 checkpoint saved by transformers; returns the model class that loads it."""
    import torch
    from test_transformers import build
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4VisionConfig
    if kind == "text":
        cls, config = Gemma4ForCausalLM, text_config()
    else:
        vision = Gemma4VisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, head_dim=4)
        cls, config = Gemma4ForConditionalGeneration, Gemma4Config(text_config=text_config().to_dict(),
                                                                   vision_config=vision.to_dict(), audio_config=None)
    model = build(cls, config, seed)
    with torch.no_grad():  # the layer scalars near 1 and the final norm neutral, so 6 layers stay in range
        for name, p in model.named_parameters():
            if name.endswith("layer_scalar"):
                p.fill_(1.0)
    model.save_pretrained(path)
    # mlx-lm 0.32.2 reads these, not the per_layer_config transformers 5.x writes instead (and a
    # multimodal model's vocabulary size from the top level)
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    (saved["text_config"] if kind == "multimodal" else saved).update(global_head_dim=32, num_global_key_value_heads=1)
    if kind == "multimodal":
        saved["vocab_size"] = saved["text_config"]["vocab_size"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    return cls


def write_data(path, seed):
    rng = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    for split, lengths in (("train", [40, 40, 36, 40]), ("valid", [40, 29, 17, 40])):
        with open(os.path.join(path, split + ".jsonl"), "w") as f:
            for n in lengths:
                f.write(json.dumps({"tokens": [int(t) for t in rng.integers(3, 256, n)]}) + "\n")


def read_records(path):
    with open(path) as f:
        return [json.loads(line)["tokens"] for line in f]


def winattn(*args):
    r = subprocess.run([winattn_binary(), "train", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("winattn train %s: %s" % (" ".join(args), r.stderr.strip()))
    return r.stdout


def logged_eval(out):
    """The evaluation after training in out/log.jsonl (6 decimals)."""
    evals = [json.loads(line) for line in open(os.path.join(out, "log.jsonl")) if '"eval"' in line]
    return evals[-1]["loss"]


def eval_only(ck, data, adapters):
    """`winattn train --eval-only --adapters ...`: the printed loss (4 decimals)."""
    out = winattn("--model", ck, "--data", data, "--eval-only", "--batch-size", "2", "--threads", "2",
                  "--adapters", adapters)
    return float(re.search(r"^eval: held-out loss ([0-9.]+)", out, re.M).group(1))


def torch_loss(model, records):
    """Token-weighted mean next-token cross-entropy over the records, each run alone in float32."""
    import torch
    total, count = 0.0, 0
    with torch.no_grad():
        for toks in records:
            ids = torch.tensor([toks])
            logits = model(input_ids=ids).logits[0, :-1].double()
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += len(toks) - 1
    return total / count


def peft_case(kind, tmp, seed):
    import torch
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    ck, data = os.path.join(tmp, kind), os.path.join(tmp, "data-" + kind)
    out_peft, out_mlx = os.path.join(tmp, kind + "-peft"), os.path.join(tmp, kind + "-mlx")
    cls = make_checkpoint(kind, ck, seed)
    write_data(data, seed)
    train = ["--model", ck, "--data", data, "--iters", "4", "--batch-size", "2", "--lora-rank", str(RANK),
             "--lora-scale", str(SCALE), "--lora-keys", KEYS, "--lora-layers", str(LORA_LAYERS), "--lr", "0.02",
             "--threads", "2", "--eval"]
    winattn(*train, "--adapter-format", "peft", "--out", out_peft)
    ours = logged_eval(out_peft)
    records = read_records(os.path.join(data, "valid.jsonl"))

    cfg = json.load(open(os.path.join(out_peft, "adapter_config.json")))
    from transformers import AutoModelForCausalLM  # docs/train.md's snippet: the class the checkpoint names
    base = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32, attn_implementation="eager").eval()
    if type(base) is not cls:
        raise TypeError("AutoModelForCausalLM gave %s for a %s checkpoint" % (type(base).__name__, cls.__name__))
    base_loss = torch_loss(base, records)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, out_peft).eval()
    loaded = get_peft_model_state_dict(model)
    saved = load_file(os.path.join(out_peft, "adapter_model.safetensors"))
    same = sorted(loaded) == sorted(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
    vision = [n for n, _ in model.named_modules() if "vision_tower" in n and n.endswith("lora_A")]
    lora_layers = sorted({int(m.group(1)) for n in saved for m in [re.search(r"layers\.(\d+)\.", n)]})
    report(same and not vision and lora_layers == list(range(LAYERS - LORA_LAYERS, LAYERS)) and
           not [w for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()],
           "peft %s: PeftModel.from_pretrained loads every adapter of %s, nothing missing or left over" % (
               kind, os.path.basename(out_peft)),
           "%d tensors, layers %s, target_modules %s, layers_to_transform %s, vision LoRA modules %d" % (
               len(saved), lora_layers, json.dumps(cfg["target_modules"]), cfg["layers_to_transform"], len(vision)))
    theirs = torch_loss(model, records)
    rel = abs(theirs - ours) / ours
    report(rel <= TOL and abs(theirs - base_loss) > 100 * TOL * ours,
           "peft %s: held-out loss through transformers + peft equals the trainer's evaluation" % kind,
           "peft %.6f, trainer %.6f, rel %.1e (tol %g); without adapters %.6f" % (theirs, ours, rel, TOL, base_loss))
    back = eval_only(ck, data, out_peft)
    report(abs(back - ours) <= 6e-5, "peft %s: winattn train --eval-only --adapters reads the peft folder back" % kind,
           "%.4f vs %.6f" % (back, ours))

    winattn(*train, "--out", out_mlx)
    ours_mlx = logged_eval(out_mlx)
    back = eval_only(ck, data, out_mlx)
    report(abs(ours_mlx - ours) <= 2e-6 and abs(back - ours) <= 6e-5,  # the log's 6 decimals; the printed 4
           "mlx %s: the same run in mlx-lm's layout evaluates the same, and reads back" % kind,
           "%.6f (peft run %.6f), --eval-only %.4f" % (ours_mlx, ours, back))
    return ck, data, out_mlx, ours_mlx


def mlx_loss(mx, nn, model, records):
    total, count = 0.0, 0
    for toks in records:
        logits = model(mx.array([toks]))[0, :-1].astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, mx.array(toks[1:]), reduction="sum")
        total += ce.item()
        count += len(toks) - 1
    return total / count


def mlx_cases(runs, tmp):
    try:
        import mlx.core as mx
        import mlx.nn as nn
        from mlx.utils import tree_flatten
        from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters
        from mlx_lm.utils import load_model
    except ImportError as e:
        skip("mlx-lm adapters both ways", "mlx or mlx-lm is not installed (%s)" % e)
        return
    from pathlib import Path
    for kind, (ck, data, out_mlx, ours) in runs.items():
        @case("mlx-lm %s loads our adapters" % kind)
        def _():
            model, _ = load_model(Path(ck))
            load_adapters(model, out_mlx)
            theirs = mlx_loss(mx, nn, model, read_records(os.path.join(data, "valid.jsonl")))
            rel = abs(theirs - ours) / ours
            report(rel <= MLX_TOL, "mlx-lm %s: load_adapters reads the trainer's mlx-lm folder, same held-out loss" % kind,
                   "mlx-lm %.6f, trainer %.6f, rel %.1e (tol %g)" % (theirs, ours, rel, MLX_TOL))

    ck, data, out_mlx, ours = runs["text"]
    records = read_records(os.path.join(data, "valid.jsonl"))

    @case("the trainer reads mlx-lm's adapters")
    def _():
        model, _ = load_model(Path(ck))
        model.freeze()  # as mlx_lm.lora does: only the adapters are trainable, and saved
        params = {"rank": 8, "dropout": 0.0, "scale": 10.0}  # mlx_lm.lora's defaults: no keys, every projection
        linear_to_lora_layers(model, 3, params)
        rng = np.random.default_rng(7)
        model.update(tree_unflatten_like(model, rng, mx))
        theirs = mlx_loss(mx, nn, model, records)
        folder = os.path.join(tmp, "by-mlx-lm")
        os.makedirs(folder, exist_ok=True)
        weights = dict(tree_flatten(model.trainable_parameters()))
        mx.save_safetensors(os.path.join(folder, "adapters.safetensors"), weights)  # mlx_lm's trainer's call
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:  # mlx_lm.lora's: every argument
            json.dump({"model": ck, "train": True, "fine_tune_type": "lora", "data": data, "num_layers": 3,
                       "batch_size": 2, "iters": 1, "learning_rate": 1e-5, "lora_parameters": params,
                       "adapter_path": folder, "seed": 0}, f, indent=4)
        with open(os.path.join(folder, "adapters.safetensors"), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        back = eval_only(ck, data, folder)
        rel = abs(back - theirs) / theirs
        report("__metadata__" in header and header["__metadata__"] is None and rel <= MLX_TOL,
               "mlx-lm: adapters saved by mlx-lm (\"__metadata__\": null, no keys, %d tensors) evaluated by the "
               "trainer to mlx-lm's loss" % len(weights),
               "header __metadata__ %s; trainer %.4f, mlx-lm %.6f, rel %.1e (tol %g)" % (
                   json.dumps(header.get("__metadata__", "absent")), back, theirs, rel, MLX_TOL))


def tree_unflatten_like(model, rng, mx):
    """Random values for every trainable parameter (B is zero after mlx-lm's initialisation)."""
    from mlx.utils import tree_flatten, tree_unflatten
    flat = tree_flatten(model.trainable_parameters())
    return tree_unflatten([(k, mx.array(rng.normal(0, 0.1, v.shape).astype(np.float32))) for k, v in flat])


def main():
    try:
        import peft
        import torch
        import transformers
        from transformers import Gemma4ForConditionalGeneration  # noqa: F401
    except ImportError as e:
        skip("peft adapters", "torch, transformers (with Gemma 4) or peft is not installed (%s)" % e)
        return
    if not winattn_binary():
        skip("peft adapters", "no winattn beside WINATTN_LIBRARY (run make)")
        return
    print("torch %s, transformers %s, peft %s" % (torch.__version__, transformers.__version__, peft.__version__))
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(min(4, torch.get_num_threads()))
    tmp = tempfile.TemporaryDirectory(prefix="winattn-peft-")
    runs = {}
    for seed, kind in enumerate(("text", "multimodal")):
        @case("peft %s checkpoint" % kind)
        def _():
            runs[kind] = peft_case(kind, tmp.name, seed)
    if "text" in runs:
        mlx_cases(runs, tmp.name)


if __name__ == "__main__":
    main()
    finish()

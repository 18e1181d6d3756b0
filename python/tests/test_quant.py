"""test_quant.py — `winattn train --base-dtype mlx4` and folders written by `mlx_lm.convert -q`,
against MLX itself, on a tiny Gemma 4 checkpoint saved by transformers (test_peft.py's):
  - the trainer's mlx4 projections (dumped by test_train_quant --dump) equal
    mx.dequantize(mx.quantize(w, 64, 4)) bit for bit, for the float32 checkpoint and a bfloat16 copy,
    and the held-out loss of `winattn train --base-dtype mlx4` is mlx-lm's after nn.quantize of the
    same projections;
  - folders from the real mlx_lm.convert(quantize=True, q_group_size=64, q_bits=4) of both load:
    their projections equal mx.dequantize of the saved weights, scales and biases bit for bit, and
    on the float32 one the trainer's held-out loss (before training) is mlx-lm's on that folder;
  - a transposed projection under --base-dtype mlx4, a packed weight without its scales and a folder
    saying bits 8 are refused in one line.
Needs mlx, mlx-lm, torch and transformers with Gemma 4 (SKIP otherwise), and the build's
tests/test_train_quant and winattn beside WINATTN_LIBRARY:
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_quant.py
The loss tolerance: both sides run float32 on the same dequantized weights (mlx-lm's
quantized_matmul computes scale · q + bias in float32, as the trainer's load does), so only the
order of the sums differs; 1e-5 relative, the printed 6 decimals of log.jsonl included.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import case, finish, report, skip  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOSS_TOL = 1e-5
PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"]


def build_dir():
    lib = os.environ.get("WINATTN_LIBRARY", os.path.join(ROOT, "build", "libwinattn.so"))
    return os.path.dirname(os.path.abspath(lib))


def dump(model_dir, base, out):
    """The decoder projections as the trainer loads them, in its order (layer, then q..down)."""
    exe = os.path.join(build_dir(), "tests", "test_train_quant")
    r = subprocess.run([exe, "--dump", model_dir, base, out], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("test_train_quant --dump: %s" % r.stderr.strip())
    return np.fromfile(out, dtype=np.float32)


def expected_projections(mx, prefix, layers, convert):
    """The same order through convert(name) -> mx array or None (float32, bfloat16 or float16:
    widened to float32 exactly)."""
    parts = []
    for l in range(layers):
        for p in PROJ:
            w = convert("%slayers.%d.%s" % (prefix, l, p))
            if w is not None:
                parts.append(np.array(w.astype(mx.float32)).ravel())
    return np.concatenate(parts)


def add_tokenizer(folder):
    """mlx_lm.convert loads a tokenizer: a byte-level word list of the model's 256 ids, saved as a
    fast tokenizer (the records here are token ids, so the trainer never uses it)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({"t%d" % i: i for i in range(4, 256)})
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "bos_token": "<bos>",
                   "pad_token": "<pad>", "unk_token": "<unk>"}, f)


def prefix_of(names):
    for pre in ("model.", "model.language_model.", "language_model.model."):
        if pre + "embed_tokens.weight" in names:
            return pre
    raise RuntimeError("no embed_tokens.weight in %s" % sorted(names)[:4])


def winattn_eval(model_dir, data, out, *extra):
    """The held-out loss of the base (the adapters' B starts at zero) from the evaluation before
    training, as out/log.jsonl logs it with 6 decimals (--eval-only prints 4)."""
    exe = os.path.join(build_dir(), "winattn")
    r = subprocess.run([exe, "train", "--model", model_dir, "--data", data, "--iters", "1", "--steps-per-eval", "1000",
                        "--batch-size", "2", "--threads", "2", "--out", out, *extra], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("winattn train: %s" % r.stderr.strip())
    evals = [json.loads(line) for line in open(os.path.join(out, "log.jsonl")) if '"eval": 0' in line]
    return evals[0]["loss"]


def main():
    try:
        import mlx.core as mx
        import mlx.nn as nn
        import torch  # noqa: F401
        from mlx_lm import convert
        from mlx_lm.utils import load_model
        from transformers import Gemma4ForCausalLM  # noqa: F401
    except ImportError as e:
        skip("mlx4 base", "mlx, mlx-lm, torch or transformers (with Gemma 4) is not installed (%s)" % e)
        return
    if not os.access(os.path.join(build_dir(), "tests", "test_train_quant"), os.X_OK):
        skip("mlx4 base", "no tests/test_train_quant beside WINATTN_LIBRARY (run make)")
        return
    from test_peft import LAYERS, make_checkpoint, mlx_loss, read_records, write_data
    from pathlib import Path
    tmp = tempfile.TemporaryDirectory(prefix="winattn-quant-")
    ck = os.path.join(tmp.name, "f32")
    data = os.path.join(tmp.name, "data")
    make_checkpoint("text", ck, 0)
    write_data(data, 1)

    # a bfloat16 copy: the same config, every tensor cast
    ck16 = os.path.join(tmp.name, "bf16")
    os.makedirs(ck16)
    shutil.copy(os.path.join(ck, "config.json"), ck16)
    mx.save_safetensors(os.path.join(ck16, "model.safetensors"),
                        {k: v.astype(mx.bfloat16) for k, v in mx.load(os.path.join(ck, "model.safetensors")).items()})

    for name, folder in (("float32", ck), ("bfloat16", ck16)):
        @case("mlx4 round trip %s" % name)
        def _():
            w = mx.load(os.path.join(folder, "model.safetensors"))
            pre = prefix_of(w)
            ours = dump(folder, "mlx4", os.path.join(tmp.name, "dump.f32"))

            def round_trip(stem):
                t = w.get(stem + ".weight")
                if t is None:
                    return None
                return mx.dequantize(*mx.quantize(t, group_size=64, bits=4), group_size=64, bits=4)
            theirs = expected_projections(mx, pre, LAYERS, round_trip)
            same = ours.shape == theirs.shape and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
            plain = dump(folder, "bf16", os.path.join(tmp.name, "plain.f32"))
            report(same and not np.array_equal(plain, ours),
                   "--base-dtype mlx4 on a %s checkpoint: every projection equals mx.dequantize(mx.quantize(w, 64, 4)) "
                   "bit for bit" % name,
                   "%d values, %d differ" % (theirs.size, int(np.sum(ours != theirs)) if ours.shape == theirs.shape
                                             else -1))

    @case("--base-dtype mlx4 loss")
    def _():
        model, _ = load_model(Path(ck))
        # the decoder projections only, as --base-dtype mlx4 quantizes them
        nn.quantize(model, group_size=64, bits=4,
                    class_predicate=lambda path, m: isinstance(m, nn.Linear) and path.endswith(tuple(PROJ)))
        theirs = mlx_loss(mx, nn, model, read_records(os.path.join(data, "valid.jsonl")))
        ours = winattn_eval(ck, data, os.path.join(tmp.name, "eval-mlx4"), "--base-dtype", "mlx4")
        plain = winattn_eval(ck, data, os.path.join(tmp.name, "eval-plain"))
        rel = abs(ours - theirs) / theirs
        report(rel <= LOSS_TOL and ours != plain,
               "winattn train --base-dtype mlx4: the base's held-out loss is mlx-lm's with nn.quantize(64, 4) on the "
               "same projections", "trainer %.6f, mlx-lm %.6f, rel %.1e (tol %g); unquantized %.6f" % (
                   ours, theirs, rel, LOSS_TOL, plain))

    q = os.path.join(tmp.name, "mlx4")
    for name, folder, out in (("float32", ck, q), ("bfloat16", ck16, os.path.join(tmp.name, "mlx4-bf16"))):
        @case("mlx_lm.convert -q folder %s" % name)
        def _():
            src = os.path.join(tmp.name, "with-tokenizer-" + name)
            shutil.copytree(folder, src)
            add_tokenizer(src)
            convert(hf_path=src, mlx_path=out, quantize=True, q_group_size=64, q_bits=4)
            cfg = json.load(open(os.path.join(out, "config.json")))
            w = mx.load(os.path.join(out, "model.safetensors"))
            pre = prefix_of(w)

            def saved(stem):
                if stem + ".scales" not in w:
                    return w.get(stem + ".weight")
                return mx.dequantize(w[stem + ".weight"], w[stem + ".scales"], w[stem + ".biases"], group_size=64,
                                     bits=4)
            theirs = expected_projections(mx, pre, LAYERS, saved)
            ours = dump(out, "bf16", os.path.join(tmp.name, "dump.f32"))
            same = ours.shape == theirs.shape and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
            scales = w[pre + "layers.0.self_attn.q_proj.scales"].dtype
            report(same and cfg.get("quantization", {}).get("bits") == 4,
                   "mlx_lm.convert -q folder from %s (%s, %s scales): every projection equals mx.dequantize of the "
                   "saved packed weight bit for bit" % (name, json.dumps(cfg.get("quantization")), scales),
                   "%d values" % theirs.size)
            if name != "float32":
                return  # mlx-lm runs a bfloat16 model in bfloat16: its loss is no float32 reference
            model, _ = load_model(Path(out))
            theirs_loss = mlx_loss(mx, nn, model, read_records(os.path.join(data, "valid.jsonl")))
            ours_loss = winattn_eval(out, data, os.path.join(tmp.name, "eval"))
            rel = abs(ours_loss - theirs_loss) / theirs_loss
            report(rel <= LOSS_TOL, "mlx_lm.convert -q folder: the trainer's held-out loss of the base is mlx-lm's",
                   "trainer %.6f, mlx-lm %.6f, rel %.1e (tol %g)" % (ours_loss, theirs_loss, rel, LOSS_TOL))

    @case("mis-shaped tensors refused")
    def _():
        exe = os.path.join(build_dir(), "winattn")
        cases = []
        w = mx.load(os.path.join(ck, "model.safetensors"))
        name = prefix_of(w) + "layers.0.self_attn.q_proj.weight"
        wrong = os.path.join(tmp.name, "wrong-shape")
        os.makedirs(wrong)
        shutil.copy(os.path.join(ck, "config.json"), wrong)
        mx.save_safetensors(os.path.join(wrong, "model.safetensors"), {**w, name: w[name].T})
        cases.append(("a transposed q_proj under --base-dtype mlx4", wrong, ["--base-dtype", "mlx4"], "has shape"))
        w = mx.load(os.path.join(q, "model.safetensors"))
        name = prefix_of(w) + "layers.0.mlp.down_proj.scales"
        noscales = os.path.join(tmp.name, "no-scales")
        shutil.copytree(q, noscales)
        mx.save_safetensors(os.path.join(noscales, "model.safetensors"), {k: v for k, v in w.items() if k != name})
        index = os.path.join(noscales, "model.safetensors.index.json")
        if os.path.exists(index):  # mlx_lm.convert writes one beside a single shard
            saved = json.load(open(index))
            del saved["weight_map"][name]
            json.dump(saved, open(index, "w"))
        cases.append(("a packed down_proj without its scales", noscales, [], "scales are missing"))
        for what, folder, extra, text in cases:
            r = subprocess.run([exe, "train", "--model", folder, "--data", data, "--eval-only", *extra],
                               capture_output=True, text=True)
            msg = r.stderr.strip()
            report(r.returncode == 1 and text in msg and len(msg.splitlines()) == 1, "%s is refused in one line" % what,
                   msg)

    @case("8-bit folder refused")
    def _():
        bad = os.path.join(tmp.name, "mlx8")
        shutil.copytree(q, bad)
        cfg = json.load(open(os.path.join(bad, "config.json")))
        cfg["quantization"] = {"group_size": 64, "bits": 8}
        json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
        exe = os.path.join(build_dir(), "winattn")
        r = subprocess.run([exe, "train", "--model", bad, "--data", data, "--eval-only"], capture_output=True,
                           text=True)
        msg = r.stderr.strip()
        report(r.returncode != 0 and "bits 8" in msg and len(msg.splitlines()) == 1,
               "a folder quantized to 8 bits is refused in one line", msg)


if __name__ == "__main__":
    main()
    finish()

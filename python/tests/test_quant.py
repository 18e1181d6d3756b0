"""test_quant.py — `winattn train --base-dtype mlx4|nf4|fp8` and quantized checkpoints, against the
tools that define the formats, on a tiny Gemma 4 checkpoint saved by transformers (test_peft.py's).

mlx4 (needs mlx, mlx-lm, torch and transformers with Gemma 4; SKIP otherwise):
  - the trainer's mlx4 projections (dumped by test_train_quant --dump) equal
    mx.dequantize(mx.quantize(w, 64, 4)) bit for bit, for the float32 checkpoint and a bfloat16 copy,
    and the held-out loss of `winattn train --base-dtype mlx4` is mlx-lm's after nn.quantize of the
    same projections;
  - folders from the real mlx_lm.convert(quantize=True, q_group_size=64, q_bits=4) of both load:
    their projections equal mx.dequantize of the saved weights, scales and biases bit for bit, and
    on the float32 one the trainer's held-out loss (before training) is mlx-lm's on that folder;
  - LoRA adapters the trainer trains on the float32 folder, loaded by mlx-lm's load_adapters onto that
    quantized model, give the trainer's held-out loss after training (within test_peft.py's 1e-4);
  - a transposed projection under --base-dtype mlx4, a packed weight without its scales and a folder
    saying bits 8 are refused in one line.
nf4 (needs bitsandbytes, torch and transformers with Gemma 4; SKIP otherwise):
  - the trainer's tables (test_train_quant --tables) are bitsandbytes' NF4 values and
    create_dynamic_map() bit for bit;
  - the codes, the 8-bit absmax codes, the nested absmax and the offset (test_train_quant --nf4) equal
    bitsandbytes.functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    on the CPU bit for bit, for bf16 tensors of several shapes (blocks cut short and all-zero blocks
    included) and, with torch at 1 and at 2 threads, one of 4M weights (torch splits that mean);
  - --base-dtype nf4 projections equal the weight bitsandbytes' matmul_4bit multiplies a float32
    input by (gemm_4bit: the nested absmax dequantized plus the offset, then dequantize_4bit into
    float32) after quantize_4bit(w), bit for bit;
  - a checkpoint transformers saved with BitsAndBytesConfig(load_in_4bit, nf4, double quant) from the
    bfloat16 copy loads to the same projections as --base-dtype nf4 on that copy, bit for bit, and so
    the same held-out loss; that loss is transformers' own (float32 forward of the saved model)
    within 1e-5; one saved without double quantization equals the weights of the model that saved
    it bit for bit; an fp4 one and one missing a nested_absmax are refused in one line;
  - LoRA adapters the trainer trains on that saved nf4 checkpoint in peft's layout, loaded by
    PeftModel.from_pretrained onto the bitsandbytes-quantized transformers model, give the trainer's
    held-out loss after training within 1e-5.
fp8 (needs torch and transformers with Gemma 4):
  - codes, scales and values (test_train_quant --fp8) equal torch's (w / scale).to(float8_e4m3fn)
    with scale = amax / 448 a row, bit for bit, rows with amax 448 (scale 1) carrying every e4m3
    midpoint included; --base-dtype fp8 projections equal torch's bit for bit.
Needs the build's tests/test_train_quant and winattn beside WINATTN_LIBRARY:
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_quant.py
The loss tolerance: both sides run float32 on the same dequantized weights (mlx-lm's
quantized_matmul computes scale · q + bias in float32, as the trainer's load does; transformers
multiplies by bitsandbytes' dequantized weight), so only the order of the sums differs; 1e-5
relative, the printed 6 decimals of log.jsonl included.
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


def trained_eval(model_dir, data, out, *extra):
    """Four steps of LoRA (test_peft.py's rank, scale, keys and layers) and the held-out loss after
    training, as out/log.jsonl logs it."""
    from test_peft import KEYS, LORA_LAYERS, RANK, SCALE, logged_eval, winattn
    winattn("--model", model_dir, "--data", data, "--iters", "4", "--batch-size", "2", "--lora-rank", str(RANK),
            "--lora-scale", str(SCALE), "--lora-keys", KEYS, "--lora-layers", str(LORA_LAYERS), "--lr", "0.02",
            "--threads", "2", "--eval", "--out", out, *extra)
    return logged_eval(out)


def main():
    if not os.access(os.path.join(build_dir(), "tests", "test_train_quant"), os.X_OK):
        skip("quantized bases", "no tests/test_train_quant beside WINATTN_LIBRARY (run make)")
        return
    mlx4_cases()
    nf4_fp8_cases()


def mlx4_cases():
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

    @case("adapters on an mlx4 base in mlx-lm")
    def _():
        # LoRA trained on the mlx_lm.convert -q folder (float32 scales), in mlx-lm's layout: mlx-lm's
        # load_adapters on the same quantized model (LoRA over its QuantizedLinear) gives the loss of
        # the trainer's evaluation after training
        from mlx_lm.tuner.utils import load_adapters
        from test_peft import MLX_TOL
        out = os.path.join(tmp.name, "mlx4-adapters")
        ours = trained_eval(q, data, out)
        model, _ = load_model(Path(q))
        load_adapters(model, out)
        theirs = mlx_loss(mx, nn, model, read_records(os.path.join(data, "valid.jsonl")))
        base = winattn_eval(q, data, os.path.join(tmp.name, "eval-base"))
        rel = abs(theirs - ours) / ours
        report(rel <= MLX_TOL and abs(ours - base) > 100 * MLX_TOL * ours,
               "adapters trained on an mlx_lm.convert -q folder: mlx-lm's load_adapters on that quantized model "
               "gives the trainer's held-out loss", "mlx-lm %.6f, trainer %.6f, rel %.1e (tol %g); base %.6f" % (
                   theirs, ours, rel, MLX_TOL, base))

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


def quant_run(*args):
    """test_train_quant with args; its output file's bytes."""
    exe = os.path.join(build_dir(), "tests", "test_train_quant")
    r = subprocess.run([exe, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("test_train_quant %s: %s" % (args[0], r.stderr.strip()))
    with open(args[-1], "rb") as f:
        return f.read()


def bnb_codes(F, w):
    """bitsandbytes' quantize_4bit on the CPU: the codes (high nibble first), absmax codes, nested
    absmax and offset."""
    packed, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    p = packed.numpy().ravel()
    codes = np.empty(p.size * 2, np.uint8)
    codes[0::2], codes[1::2] = p >> 4, p & 15
    return (codes[:w.numel()], st.absmax.numpy(), st.state2.absmax.numpy(), np.float32(st.offset.item()),
            st.state2.code.numpy())


def ours_codes(tmp, w, threads):
    src, out = os.path.join(tmp, "w.f32"), os.path.join(tmp, "codes.bin")
    w.float().numpy().astype(np.float32).tofile(src)
    b = quant_run("--nf4", src, str(threads), out)
    n = w.numel()
    blocks = -(-n // 64)
    nested = -(-blocks // 256)
    return (np.frombuffer(b[:n], np.uint8), np.frombuffer(b[n:n + blocks], np.uint8),
            np.frombuffer(b[n + blocks:n + blocks + 4 * nested], np.float32),
            np.frombuffer(b[n + blocks + 4 * nested:], np.float32)[0])


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def projections_of(model_dir_weights, prefix, convert):
    """The decoder projections in the trainer's dump order through convert(name, tensor)."""
    from test_peft import LAYERS
    parts = []
    for l in range(LAYERS):
        for p in PROJ:
            name = "%slayers.%d.%s.weight" % (prefix, l, p)
            if name in model_dir_weights:
                parts.append(np.asarray(convert(name, model_dir_weights[name]), np.float32).ravel())
    return np.concatenate(parts)


def fp8_reference(torch, w):
    """torch's e4m3 with a scale a row: (codes, scales, values), f32."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    q = (w / scale).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).numpy(), scale.numpy().ravel(), (q.float() * scale).numpy()


def fp8_cases(torch, tmp, checkpoints):
    @case("fp8 codes")
    def _():
        rng = np.random.default_rng(11)
        # rows with amax 448 have scale 1: their codes are torch's e4m3 of the values themselves, here every
        # midpoint between neighbouring e4m3 values (ties), the floats either side, and random magnitudes
        grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
        mids = (grid[:-1] + grid[1:]) / 2
        ties = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 1000), -mids])
        spread = (rng.standard_normal(4000) * np.exp2(rng.integers(-16, 9, 4000))).clip(-448, 448)
        special = np.concatenate([ties, spread]).astype(np.float32)
        special = np.concatenate([special, np.zeros(-special.size % 500, np.float32)]).reshape(-1, 500)
        special[:, 0] = 448
        tensors = [special, (rng.standard_normal((64, 256)) * 0.02).astype(np.float32),
                   (rng.standard_normal((33, 70)) * 3e3).astype(np.float32), np.zeros((2, 64), np.float32)]
        compared = bad = 0
        for w in tensors:
            src, out = os.path.join(tmp, "fp8.f32"), os.path.join(tmp, "fp8.bin")
            w.tofile(src)
            b = quant_run("--fp8", src, str(w.shape[0]), out)
            n, r = w.size, w.shape[0]
            codes, scales, values = fp8_reference(torch, torch.from_numpy(w))
            ours = (np.frombuffer(b[:n], np.uint8), np.frombuffer(b[n:n + 4 * r], np.float32),
                    np.frombuffer(b[n + 4 * r:], np.float32))
            bad += int(np.sum(ours[0] != codes.ravel()))
            bad += int(np.sum(ours[1].view(np.uint32) != scales.view(np.uint32)))
            bad += int(np.sum(ours[2].view(np.uint32) != values.ravel().view(np.uint32)))
            compared += n
        report(bad == 0, "fp8: codes, scales and values equal torch's (w / (amax / 448)).to(float8_e4m3fn) bit for "
               "bit, ties and a zero row included", "%d weights, %d mismatches" % (compared, bad))

    for name, folder in checkpoints:
        @case("fp8 projections %s" % name)
        def _():
            from safetensors.torch import load_file
            w = load_file(os.path.join(folder, "model.safetensors"))
            pre = prefix_of(w)
            ours = dump(folder, "fp8", os.path.join(tmp, "dump.f32"))
            theirs = projections_of(w, pre, lambda _, t: fp8_reference(torch, t)[2])
            report(same_bits(ours, theirs), "--base-dtype fp8 on a %s checkpoint: every projection equals torch's "
                   "e4m3 with a scale a row bit for bit" % name,
                   "%d values, %d differ" % (theirs.size, int(np.sum(ours != theirs)) if ours.shape == theirs.shape
                                             else -1))


def nf4_fp8_cases():
    try:
        import torch
        from safetensors.torch import load_file, save_file
        from transformers import Gemma4ForCausalLM  # noqa: F401
    except ImportError as e:
        skip("nf4 and fp8 bases", "torch or transformers (with Gemma 4) is not installed (%s)" % e)
        return
    from test_peft import make_checkpoint, read_records, torch_loss, write_data
    tmp = tempfile.TemporaryDirectory(prefix="winattn-nf4-")
    ck, ck16, data = (os.path.join(tmp.name, d) for d in ("f32", "bf16", "data"))
    make_checkpoint("text", ck, 0)
    write_data(data, 1)
    os.makedirs(ck16)
    cfg = json.load(open(os.path.join(ck, "config.json")))
    cfg["dtype"] = "bfloat16"
    json.dump(cfg, open(os.path.join(ck16, "config.json"), "w"), indent=2)
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(os.path.join(ck, "model.safetensors")).items()},
              os.path.join(ck16, "model.safetensors"), metadata={"format": "pt"})
    fp8_cases(torch, tmp.name, (("float32", ck), ("bfloat16", ck16)))

    try:
        import bitsandbytes.functional as F
        from transformers import BitsAndBytesConfig
    except ImportError as e:
        skip("nf4 base", "bitsandbytes is not installed (%s)" % e)
        return

    @case("nf4 tables")
    def _():
        b = quant_run("--tables", os.path.join(tmp.name, "tables.bin"))
        nf4, dynamic = np.frombuffer(b[:64], np.float32), np.frombuffer(b[64:], np.float32)
        theirs = F.get_4bit_type("nf4", device="cpu").numpy(), F.create_dynamic_map().numpy()
        report(same_bits(nf4, theirs[0]) and same_bits(dynamic, theirs[1]),
               "nf4: the trainer's NF4 values and dynamic code are bitsandbytes' get_4bit_type('nf4') and "
               "create_dynamic_map() bit for bit")

    @case("nf4 codes")
    def _():
        rng = np.random.default_rng(0)
        shapes = [(4, 256), (128, 576), (300, 640), (3, 100), (5, 13), (1, 64 * 300), (2048, 1088)]
        compared = bad = 0
        saved_threads = torch.get_num_threads()
        runs = [(s, 1) for s in shapes] + [((4096, 1024), 1), ((4096, 1024), 2)]
        try:
            for shape, threads in runs:
                torch.set_num_threads(threads)
                scale = rng.choice([0.02, 1.0, 3e-3])
                w = torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32)).to(torch.bfloat16)
                if shape == (300, 640):
                    w[7] = 0  # all-zero blocks
                theirs = bnb_codes(F, w)
                ours = ours_codes(tmp.name, w, threads)
                bad += sum(int(np.sum(a.view(np.uint8) != b.view(np.uint8))) for a, b in zip(ours[:3], theirs[:3]))
                bad += int(ours[3].view(np.uint32) != theirs[3].view(np.uint32))
                compared += w.numel()
        finally:
            torch.set_num_threads(saved_threads)
        report(bad == 0, "nf4: codes, absmax codes, nested absmax and offset equal bitsandbytes' quantize_4bit(nf4, "
               "64, compress_statistics=True) on the CPU bit for bit (torch at 1 and 2 threads for 4M weights)",
               "%d weights in %d tensors, %d mismatches" % (compared, len(runs), bad))

    def bnb_weight(packed, st):
        """The weight bitsandbytes' matmul_4bit multiplies a float32 input by: its gemm_4bit's absmax
        (dequantize_blockwise + offset) and dequantize_4bit into float32."""
        absmax = F.dequantize_blockwise(st.absmax, st.state2) + st.offset if st.nested else st.absmax
        return torch.ops.bitsandbytes.dequantize_4bit.default(packed, absmax, st.blocksize, st.quant_type, st.shape,
                                                              torch.float32).numpy()

    def bnb_round_trip(name, t):
        return bnb_weight(*F.quantize_4bit(t, blocksize=64, quant_type="nf4", compress_statistics=True))

    for name, folder in (("float32", ck), ("bfloat16", ck16)):
        @case("nf4 projections %s" % name)
        def _():
            w = load_file(os.path.join(folder, "model.safetensors"))
            ours = dump(folder, "nf4", os.path.join(tmp.name, "dump.f32"))
            theirs = projections_of(w, prefix_of(w), bnb_round_trip)
            report(same_bits(ours, theirs), "--base-dtype nf4 on a %s checkpoint: every projection equals the "
                   "weight bitsandbytes' matmul_4bit multiplies float32 inputs by, bit for bit" % name,
                   "%d values, %d differ" % (theirs.size, int(np.sum(ours != theirs)) if ours.shape == theirs.shape
                                             else -1))

    def save_quantized(src, out, dtype, double_quant=True, quant_type="nf4"):
        qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.float32)
        model = Gemma4ForCausalLM.from_pretrained(src, quantization_config=qc, device_map="cpu", dtype=dtype)
        model.save_pretrained(out)
        return model

    q16 = os.path.join(tmp.name, "nf4-bf16")

    @case("transformers nf4 checkpoint")
    def _():
        save_quantized(ck16, q16, torch.bfloat16)
        saved = load_file(os.path.join(q16, "model.safetensors"))
        state = bytes(saved[prefix_of(saved) + "layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4"]
                      .numpy()).decode()
        ours = dump(q16, "bf16", os.path.join(tmp.name, "saved.f32"))
        quantized_here = dump(ck16, "nf4", os.path.join(tmp.name, "here.f32"))
        report(same_bits(ours, quantized_here), "a checkpoint transformers saved with BitsAndBytesConfig(nf4, double "
               "quant) from the bfloat16 copy loads to --base-dtype nf4's projections on that copy bit for bit",
               "%d values; quant state %s" % (ours.size, state))
        records = read_records(os.path.join(data, "valid.jsonl"))
        loss_saved = winattn_eval(q16, data, os.path.join(tmp.name, "eval-saved"))
        loss_here = winattn_eval(ck16, data, os.path.join(tmp.name, "eval-here"), "--base-dtype", "nf4")
        model = Gemma4ForCausalLM.from_pretrained(q16, device_map="cpu", dtype=torch.float32)
        with torch.no_grad():  # transformers keeps a quantized checkpoint's other tensors bfloat16
            for p in model.parameters():
                if p.dtype == torch.bfloat16:
                    p.data = p.data.float()
        theirs = torch_loss(model, records)
        rel = abs(loss_saved - theirs) / theirs
        report(loss_saved == loss_here and rel <= LOSS_TOL,
               "the saved nf4 checkpoint's held-out loss equals --base-dtype nf4's on the bfloat16 copy and "
               "transformers' float32 forward of the saved model",
               "trainer %.6f (--base-dtype nf4 %.6f), transformers %.6f, rel %.1e (tol %g)" % (
                   loss_saved, loss_here, theirs, rel, LOSS_TOL))

    @case("adapters on an nf4 base in peft")
    def _():
        # LoRA trained on the saved nf4 checkpoint, in peft's layout: PeftModel.from_pretrained on the
        # bitsandbytes-quantized model transformers loads from that folder gives the trainer's loss
        try:
            from peft import PeftModel
        except ImportError as e:
            skip("adapters on an nf4 base in peft", "peft is not installed (%s)" % e)
            return
        out = os.path.join(tmp.name, "nf4-adapters")
        ours = trained_eval(q16, data, out, "--adapter-format", "peft")
        model = Gemma4ForCausalLM.from_pretrained(q16, device_map="cpu", dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype == torch.bfloat16:
                    p.data = p.data.float()
        base = torch_loss(model, read_records(os.path.join(data, "valid.jsonl")))
        model = PeftModel.from_pretrained(model, out).eval()
        theirs = torch_loss(model, read_records(os.path.join(data, "valid.jsonl")))
        rel = abs(theirs - ours) / ours
        report(rel <= LOSS_TOL and abs(theirs - base) > 100 * LOSS_TOL * ours,
               "adapters trained on a bitsandbytes nf4 checkpoint: PeftModel.from_pretrained on the quantized "
               "transformers model gives the trainer's held-out loss",
               "peft %.6f, trainer %.6f, rel %.1e (tol %g); base %.6f" % (theirs, ours, rel, LOSS_TOL, base))

    @case("transformers nf4 checkpoint without double quantization")
    def _():
        out = os.path.join(tmp.name, "nf4-plain")
        model = save_quantized(ck, out, torch.float32, double_quant=False)
        ours = dump(out, "bf16", os.path.join(tmp.name, "plain.f32"))
        parts = []
        for layer in model.model.layers:
            for p in PROJ:
                mod = layer
                for attr in p.split("."):
                    mod = getattr(mod, attr, None)
                if mod is not None:
                    parts.append(bnb_weight(mod.weight.data, mod.weight.quant_state).ravel())
        theirs = np.concatenate(parts)
        report(same_bits(ours, theirs), "a checkpoint saved with nf4 and float32 absmax (no double quantization) "
               "loads to the weights of the model that saved it bit for bit", "%d values" % theirs.size)

    @case("nf4 checkpoints refused")
    def _():
        exe = os.path.join(build_dir(), "winattn")
        cases = []
        fp4 = os.path.join(tmp.name, "fp4")
        save_quantized(ck, fp4, torch.float32, quant_type="fp4")
        cases.append(("a checkpoint saved with fp4", fp4, "fp4"))
        broken = os.path.join(tmp.name, "no-nested")
        shutil.copytree(q16, broken)
        w = load_file(os.path.join(q16, "model.safetensors"))
        name = prefix_of(w) + "layers.1.mlp.up_proj.weight.nested_absmax"
        save_file({k: v for k, v in w.items() if k != name}, os.path.join(broken, "model.safetensors"),
                  metadata={"format": "pt"})
        cases.append(("an up_proj without its nested_absmax", broken, "up_proj.weight"))
        for what, folder, text in cases:
            r = subprocess.run([exe, "train", "--model", folder, "--data", data, "--eval-only"], capture_output=True,
                               text=True)
            msg = r.stderr.strip()
            report(r.returncode == 1 and text in msg and len(msg.splitlines()) == 1, "%s is refused in one line" % what,
                   msg)


if __name__ == "__main__":
    main()
    finish()


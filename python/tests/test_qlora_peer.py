"""test_qlora_peer.py — bench/train_gpu.py's "qlora" peer (bench/qlora_peer.py) built on the CPU on
train/fixtures/gemma4_tiny's config (31B-shaped: k = v full layers without v_proj, window 16).
SKIPs without torch, transformers (with Gemma 4), peft or bitsandbytes, or without libwinattn.
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_qlora_peer.py

Checks:
  - every decoder projection the config has (q, k, v where it exists, o, gate, up, down) is a
    bitsandbytes Linear4bit: nf4, blocks of 64, double quantization, bf16 compute; its codes and
    quant state equal bitsandbytes' quantize_4bit(w, 64, nf4, compress_statistics=True) of the
    bf16 weight the builder was handed for that name, and so its dequantized weight, bit for bit;
  - no tensor is left on the meta device; the embedding and norms are bf16, the head is the
    embedding (tied); the tensors that are not random (norms, layer scalars, embedding scale,
    rotary tables) equal those of the model AutoModelForCausalLM.from_config builds;
  - peft's LoRA sits on exactly the layers' q, k, v, o projections, of train_gpu.py's rank, and is
    what trains; its scale is the --lora-scale train_gpu.py gives the C trainer: one LoRA layer,
    B made nonzero, returns base(x) + scale * B(A(x));
  - gradient checkpointing is on; one forward + backward with attn_implementation "winattn" runs
    on the CPU: its logits equal those of the plain bf16 model given the dequantized weights (same
    attention: B starts at zero, so LoRA adds exactly 0), the loss and gradients are finite, every
    B gets a nonzero gradient and no base tensor gets one.
The projections are drawn larger than the default (std 0.15, not 0.02) so that the logits are not
near-uniform, which would hide a misplaced weight.
"""
import json
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import case, finish, report, skip  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
CONFIG = os.path.join(ROOT, "train", "fixtures", "gemma4_tiny", "config.json")
STD = 0.15
N = 40


class KnownWeights:
    """A weight source for qlora_peer.nf4_model: bf16 N(0, STD) seeded by the name, remembered."""
    def __init__(self, torch):
        self.torch, self.given = torch, {}

    def __call__(self, name, shape):
        torch = self.torch
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        w = (torch.randn(shape, generator=gen) * STD).to(torch.bfloat16)
        self.given[name] = w.clone()
        return w


def main():
    try:
        import torch
        from transformers import AutoModelForCausalLM, Gemma4ForCausalLM  # noqa: F401
        import peft  # noqa: F401
        import bitsandbytes as bnb
        import bitsandbytes.functional as F
    except ImportError as e:
        skip("qlora peer", "torch, transformers (with Gemma 4), peft or bitsandbytes is not installed (%s)" % e)
        return
    try:
        import winattn.transformers
        winattn.transformers.register()
    except (ImportError, OSError) as e:
        skip("qlora peer", "libwinattn does not load (run make; WINATTN_LIBRARY): %s" % e)
        return
    import qlora_peer
    import train_gpu
    from transformers_lora import gemma4_config

    with open(CONFIG) as f:
        cfg = gemma4_config(json.load(f), "winattn")
    torch.manual_seed(0)
    weights = KnownWeights(torch)
    try:
        model, params = qlora_peer.qlora_model(cfg, "cpu", train_gpu.LORA_RANK, train_gpu.LORA_SCALE, weights)
    except Exception as e:
        report(False, "qlora peer: the model builds on the CPU", "%s: %s" % (type(e).__name__, str(e)[:200]))
        return
    base = model.get_base_model()
    layers = base.model.layers

    @case("qlora projections")
    def _():
        checked = bad = 0
        for i, layer in enumerate(layers):
            for path in qlora_peer.PROJECTIONS:
                name = "model.layers.%d.%s" % (i, path)
                parent, attr = path.split(".")
                mod = getattr(getattr(layer, parent), attr, None)
                mod = getattr(mod, "base_layer", mod)  # peft's LoRA wraps q, k, v, o
                if name not in weights.given:
                    bad += mod is not None and not (path.endswith("v_proj") and cfg.attention_k_eq_v)
                    continue
                st = mod.weight.quant_state
                ok = (isinstance(mod, bnb.nn.Linear4bit) and mod.compute_dtype == torch.bfloat16
                      and st.quant_type == "nf4" and st.blocksize == 64 and st.nested and st.dtype == torch.bfloat16)
                packed, theirs = F.quantize_4bit(weights.given[name], blocksize=64, quant_type="nf4",
                                                 compress_statistics=True)
                ok = ok and torch.equal(mod.weight.data, packed) and torch.equal(st.absmax, theirs.absmax)
                ok = ok and torch.equal(st.state2.absmax, theirs.state2.absmax) and st.offset.item() == theirs.offset.item()
                deq = F.dequantize_4bit(mod.weight.data, st)
                ok = ok and tuple(deq.shape) == tuple(weights.given[name].shape)
                ok = ok and torch.equal(deq.view(torch.int16), F.dequantize_4bit(packed, theirs).view(torch.int16))
                checked += 1
                bad += not ok
        expected = sum(1 for t in cfg.layer_types if t == "sliding_attention") * 7 + \
            sum(1 for t in cfg.layer_types if t == "full_attention") * (6 if cfg.attention_k_eq_v else 7)
        report(bad == 0 and checked == expected == len(weights.given),
               "qlora peer: every decoder projection is a Linear4bit (nf4, blocks of 64, double quantization, bf16 "
               "compute) whose codes, quant state and dequantized weight equal bitsandbytes' quantize_4bit of the "
               "bf16 weight it was given, bit for bit", "%d projections of %d, %d wrong" % (checked, expected, bad))

    @case("qlora other tensors")
    def _():
        plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        mine = dict(base.named_parameters(remove_duplicate=False))
        mine.update(base.named_buffers())
        theirs = dict(plain.named_parameters(remove_duplicate=False))
        theirs.update(plain.named_buffers())
        meta = [n for n, t in mine.items() if t.is_meta]
        wrong = []
        for n, t in theirs.items():
            if any(n.endswith(p + ".weight") for p in qlora_peer.PROJECTIONS) or "embed_tokens.weight" in n \
                    or n == "lm_head.weight":
                continue
            m = mine.get(n)
            if m is None or m.dtype != t.dtype or not torch.equal(m, t):
                wrong.append(n)
        emb = base.get_input_embeddings().weight
        norms = [t for n, t in mine.items() if "norm" in n]
        ok = not meta and not wrong and emb.dtype == torch.bfloat16 and base.lm_head.weight is emb
        ok = ok and norms and all(t.dtype == torch.bfloat16 for t in norms)
        report(ok, "qlora peer: nothing on the meta device, embedding and norms bf16, head tied to the embedding, "
               "and the non-random tensors equal from_config's",
               "%d tensors compared, %d norms; meta %s; differ %s" % (len(theirs), len(norms), meta[:2], wrong[:3]))

    @case("qlora LoRA")
    def _():
        from peft.tuners.lora import LoraLayer
        lora = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
        want = set()
        for i, layer in enumerate(layers):
            for t in qlora_peer.LORA_TARGETS:
                if getattr(layer.self_attn, t, None) is not None:
                    want.add("layers.%d.self_attn.%s" % (i, t))
        got = {n[n.index("layers."):] for n in lora}
        keys = train_gpu.c_command("winattn", "M", "D", "A", 1, 1, "nf4")
        c_scale = float(keys[keys.index("--lora-scale") + 1])
        c_rank = int(keys[keys.index("--lora-rank") + 1])
        c_targets = {k + "_proj" for k in keys[keys.index("--lora-keys") + 1].split(",")}
        scales = {m.scaling["default"] for m in lora.values()}
        ranks = {m.r["default"] for m in lora.values()}
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        lora_params = {n for n in trainable if ".lora_A." in n or ".lora_B." in n}
        ok = got == want and scales == {c_scale} and ranks == {c_rank} and c_targets == set(qlora_peer.LORA_TARGETS)
        ok = ok and trainable == lora_params and len(lora_params) == 2 * len(want)
        # behaviour: one layer with B nonzero returns base(x) + scale * B(A(x))
        q = layers[0].self_attn.q_proj
        x = torch.randn(3, q.in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        saved = q.lora_B["default"].weight.detach().clone()
        with torch.no_grad():
            q.lora_B["default"].weight.normal_(0.0, 0.1)
            got_y = q(x).float()
            a, b = q.lora_A["default"].weight.float(), q.lora_B["default"].weight.float()
            want_y = q.base_layer(x).float() + c_scale * ((x.float() @ a.t()) @ b.t())
            q.lora_B["default"].weight.copy_(saved)
        err = ((got_y - want_y).abs().max() / want_y.abs().max()).item()
        ok = ok and err <= 1e-2
        report(ok, "qlora peer: peft's LoRA on exactly q, k, v, o of every layer, rank and scale as the C trainer's "
               "flags (lora_alpha / r = --lora-scale), the only trainable tensors; y = base(x) + scale B(A(x))",
               "%d LoRA layers (want %d), rank %s, scale %s (C %g), %d trainable; layer check rel err %.1e" % (
                   len(got), len(want), sorted(ranks), sorted(scales), c_scale, len(trainable), err))

    @case("qlora forward and backward")
    def _():
        ids = torch.randint(3, cfg.vocab_size, (1, N), generator=torch.Generator().manual_seed(2))
        model.train()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        # the plain bf16 model with the dequantized weights, the same embedding and norms, the same attention
        plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        state = {}
        for n, t in base.named_parameters():
            if ".lora_" not in n:
                state[n.replace(".base_layer", "")] = t
        with torch.no_grad():
            for n, t in plain.named_parameters():
                src = state[n]
                if isinstance(src, bnb.nn.Params4bit):
                    src = F.dequantize_4bit(src.data, src.quant_state)
                t.copy_(src)
        plain.config.use_cache = False
        with torch.no_grad():
            ref = plain(input_ids=ids).logits.float()
        got = out.logits.detach().float()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        grads_a = [p.grad for n, p in model.named_parameters() if ".lora_A." in n]
        grads_b = [p.grad for n, p in model.named_parameters() if ".lora_B." in n]
        base_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        finite = all(g is not None and bool(torch.isfinite(g).all()) for g in grads_a + grads_b)
        nonzero_b = all(g is not None and bool((g != 0).any()) for g in grads_b)
        spread = (ref.std() / ref.abs().max()).item()
        ok = (base.is_gradient_checkpointing and bool(torch.isfinite(out.loss)) and err <= 1e-3 and finite
              and nonzero_b and not base_grads and len(grads_b) > 0)
        report(ok, "qlora peer: with gradient checkpointing, one forward + backward (attn 'winattn') on the CPU: "
               "logits equal the plain bf16 model's on the dequantized weights, finite gradients, every B's nonzero, "
               "none on the base", "loss %.4f, logits rel err %.1e (tol 1e-3), logit std / max %.2f, %d B grads"
               % (out.loss.item(), err, spread, len(grads_b)))


if __name__ == "__main__":
    main()
    finish()

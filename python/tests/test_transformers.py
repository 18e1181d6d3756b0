"""test_transformers.py — attn_implementation="winattn" against the same model's "eager"
attention on tiny random Gemma 4, Gemma 3 and Gemma 2 models in float32: logits, and the gradient
of a cross-entropy loss with respect to every parameter. SKIPs without torch or transformers.
Run from the repository root after `make`:
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_transformers.py

The sequence (40 tokens) is five times the sliding window (8), so every sliding layer masks, and
a control case checks that the window changes the logits (a test that ran every layer causal
would fail it). Padded batches (left and right, one row padded by more than two windows) and
packed rows (position_ids restarting, no attention_mask) go through winattn's varlen path and are
compared with eager given the same attention_mask or position_ids: logits of real tokens, and
gradients of a loss over real tokens only. Weights are re-initialised larger than the models' default (std 0.02), which
leaves attention nearly uniform and the comparison weak. Tolerance: float32 eager and winattn
differ only in summation order; relative errors are ~1e-6, held to 1e-4 of each tensor's
largest element.
"""
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import case, expect_error, finish, report, skip  # noqa: E402

TOL = 1e-4
N, WINDOW = 40, 8


def tiny_models():
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=8, head_dim=16,
                  sliding_window=WINDOW, attention_dropout=0.0)
    # Gemma 4 shaped like 31B: k = v on full layers, one global KV head of twice the head dim, scale 1.
    g4 = Gemma4TextConfig(num_hidden_layers=6, num_key_value_heads=4, global_head_dim=32,
                          num_global_key_value_heads=1, attention_k_eq_v=True,
                          layer_types=["sliding_attention"] * 5 + ["full_attention"], hidden_size_per_layer_input=0,
                          num_kv_shared_layers=0, final_logit_softcapping=30.0, **common)
    # Gemma 3: scale from query_pre_attn_scalar (not 1/sqrt(head_dim)), GQA 4:1.
    g3 = Gemma3TextConfig(num_hidden_layers=3, num_key_value_heads=2, query_pre_attn_scalar=40,
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"], **common)
    # Gemma 2: attention logit softcap, small enough to bind at these logit sizes.
    g2 = Gemma2Config(num_hidden_layers=2, num_key_value_heads=4, query_pre_attn_scalar=16,
                      attn_logit_softcapping=3.0, final_logit_softcapping=30.0,
                      layer_types=["sliding_attention", "full_attention"], **common)
    return [("Gemma 4", Gemma4ForCausalLM, g4), ("Gemma 3", Gemma3ForCausalLM, g3), ("Gemma 2", Gemma2ForCausalLM, g2)]


def build(cls, config, seed):
    import torch
    torch.manual_seed(seed)
    model = cls(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # std 1/sqrt(fan_in); the embedding too, as Gemma multiplies it by sqrt(hidden)
                p.normal_(0.0, p.shape[1] ** -0.5)
            else:  # norm weights and layer scalars: around their neutral value, never all equal
                p.copy_(p + torch.empty_like(p).uniform_(-0.5, 0.5))
    return model


def run(model, impl, ids, real=None, **kw):
    """Logits and {parameter name: gradient} of the next-token loss with implementation impl; with
    real (a [B, N] boolean tensor), only the logits of real tokens, and the loss over real tokens
    whose next token is real too, so that nothing the padding computes can reach either."""
    import torch
    model.set_attn_implementation(impl)
    model.zero_grad()
    out = model(ids, **kw)
    labels = ids[:, 1:].clone()
    if real is not None:
        labels[~(real[:, 1:] & real[:, :-1])] = -100
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels.flatten())
    loss.backward()
    logits = out.logits.detach() if real is None else out.logits.detach()[real]
    return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_err(a, b, floor=1e-30):
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


def worst_of(got, ref):
    """The largest error over a model's tensors, each relative to its own largest element but
    never to less than 1e-3 of the largest in the model: a gradient that is zero in exact
    arithmetic (Gemma 4's last layer_scalar, which the final RMSNorm makes irrelevant to the
    loss) holds only rounding noise."""
    floor = 1e-3 * max(r.abs().max().item() for r in ref.values())
    return max(((rel_err(got[n], ref[n], floor), n) for n in ref if n in got), default=(0.0, "-"))


def main():
    try:
        import torch
        import transformers
        import winattn.transformers as wtf
        wtf.register()  # ImportError from a transformers without the attention interfaces
    except ImportError as e:
        skip("transformers", "torch or transformers is not installed or too old (%s)" % e)
        return
    print("torch %s, transformers %s" % (torch.__version__, transformers.__version__))
    transformers.logging.set_verbosity_error()  # the cache case's past_key_values deprecation notice
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(min(4, torch.get_num_threads()))
    try:
        models = tiny_models()
    except (ImportError, TypeError) as e:  # a transformers without Gemma 2/3/4 or with other config fields
        skip("transformers Gemma models", str(e))
        return

    masks = []  # the masks that reach winattn's attention function (which checks them)
    keys_used = wtf._keys_used

    def count(mask, *args):
        masks.append(tuple(mask.shape))
        return keys_used(mask, *args)
    wtf._keys_used = count

    for seed, (label, cls, config) in enumerate(models):
        @case("transformers %s winattn vs eager" % label)
        def _():
            model = build(cls, config, seed)
            ids = torch.randint(0, config.vocab_size, (2, N), generator=torch.Generator().manual_seed(seed))
            masks.clear()
            logits, grads = run(model, "winattn", ids)
            report(not masks, "transformers %s training: no dense mask built for the winattn layers" % label,
                   "%d masks arrived" % len(masks))
            ref_logits, ref_grads = run(model, "eager", ids)
            missing = sorted(set(ref_grads) ^ set(grads))
            worst = worst_of(grads, ref_grads)
            e = rel_err(logits, ref_logits)
            report(e <= TOL and worst[0] <= TOL and not missing and len(grads) > 10,
                   "transformers %s N=%d window=%d: attn_implementation=winattn vs eager, logits and %d "
                   "parameter gradients" % (label, N, config.sliding_window, len(grads)),
                   "logits rel err %.1e, worst gradient %.1e (%s) (tol %g)%s" % (
                       e, worst[0], worst[1], TOL, ", gradients missing: %s" % missing if missing else ""))

            # The same model with a window covering the whole sequence must give other logits,
            # else the comparison above did not exercise the sliding layers.
            wide = build(cls, type(config).from_dict({**config.to_dict(), "sliding_window": N}), seed)
            wide.set_attn_implementation("winattn")
            with torch.no_grad():
                d = rel_err(wide(ids).logits, ref_logits)
            report(d > 100 * TOL, "transformers %s control: window %d vs %d changes the logits" % (label, N, WINDOW),
                   "rel difference %.1e" % d)

    varlen_calls = []
    varlen_forward = wtf._varlen_forward

    def count_varlen(query, key, value, plan, *args):
        varlen_calls.append(len(plan.cu_q) - 1)
        return varlen_forward(query, key, value, plan, *args)
    wtf._varlen_forward = count_varlen

    def padding(kind, B=3):
        """[B, N] attention_mask: row 0 padded by 5, row 1 not at all, row 2 by 17 (more than two
        windows), on the left or the right"""
        mask = torch.ones(B, N, dtype=torch.long)
        for row, n in ((0, 5), (2, 17)):
            if kind == "left":
                mask[row, :n] = 0
            else:
                mask[row, N - n:] = 0
        return mask

    from winattn._lib import HAS_VARLEN
    if not HAS_VARLEN:
        skip("transformers padded and packed batches", "this libwinattn has no wa_forward_varlen")
    for seed, (label, cls, config) in enumerate(models if HAS_VARLEN else []):
        for kind in ("left", "right"):
            @case("transformers %s %s-padded batch" % (label, kind))
            def _():
                model = build(cls, config, seed)
                mask = padding(kind)
                ids = torch.randint(1, config.vocab_size, (3, N), generator=torch.Generator().manual_seed(20 + seed))
                masks.clear()
                varlen_calls.clear()
                logits, grads = run(model, "winattn", ids, real=mask.bool(), attention_mask=mask, use_cache=False)
                ref_logits, ref_grads = run(model, "eager", ids, real=mask.bool(), attention_mask=mask,
                                            use_cache=False)
                missing = sorted(set(ref_grads) ^ set(grads))
                worst = worst_of(grads, ref_grads)
                e = rel_err(logits, ref_logits)
                layers = config.num_hidden_layers
                report(e <= TOL and worst[0] <= TOL and not missing and len(grads) > 10 and not masks
                       and varlen_calls == [3] * layers,
                       "transformers %s %s padding (5, 0, 17 of %d tokens): winattn (unpadded to varlen) vs eager, "
                       "logits of real tokens and %d parameter gradients" % (label, kind, N, len(grads)),
                       "logits rel err %.1e, worst gradient %.1e (%s) (tol %g); %d varlen calls of %d layers, "
                       "%d dense masks%s" % (e, worst[0], worst[1], TOL, len(varlen_calls), layers, len(masks),
                                             ", gradients missing: %s" % missing if missing else ""))

        @case("transformers %s packed sequences" % label)
        def _():
            # DataCollatorWithFlattening's batches: sequences end to end in one row, position_ids
            # restarting at 0, no attention_mask
            model = build(cls, config, seed)
            lens = [13, 1, 20, 6]
            position_ids = torch.cat([torch.arange(n) for n in lens])[None]
            ids = torch.randint(1, config.vocab_size, (1, N), generator=torch.Generator().manual_seed(30 + seed))
            masks.clear()
            varlen_calls.clear()
            logits, grads = run(model, "winattn", ids, position_ids=position_ids, use_cache=False)
            ref_logits, ref_grads = run(model, "eager", ids, position_ids=position_ids, use_cache=False)
            missing = sorted(set(ref_grads) ^ set(grads))
            worst = worst_of(grads, ref_grads)
            e = rel_err(logits, ref_logits)
            # the control: the same row as one sequence gives other logits
            model.set_attn_implementation("winattn")
            with torch.no_grad():
                d = rel_err(model(ids, use_cache=False).logits, ref_logits)
            layers = config.num_hidden_layers
            report(e <= TOL and worst[0] <= TOL and not missing and not masks and d > 100 * TOL
                   and varlen_calls == [len(lens)] * layers,
                   "transformers %s packed %s (position_ids restarting, no attention_mask): winattn varlen vs eager, "
                   "logits and %d parameter gradients" % (label, lens, len(grads)),
                   "logits rel err %.1e, worst gradient %.1e (%s) (tol %g); %d varlen calls; unpacked differs by "
                   "%.1e%s" % (e, worst[0], worst[1], TOL, len(varlen_calls), d,
                               ", gradients missing: %s" % missing if missing else ""))

    @case("transformers Gemma 4 two packed rows")
    def _():
        if not HAS_VARLEN:
            return
        label, cls, config = models[0]
        model = build(cls, config, 4)
        position_ids = torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in ([3, 30, 7], [40])])
        ids = torch.randint(1, config.vocab_size, (2, N), generator=torch.Generator().manual_seed(40))
        varlen_calls.clear()
        logits, grads = run(model, "winattn", ids, position_ids=position_ids, use_cache=False)
        ref_logits, ref_grads = run(model, "eager", ids, position_ids=position_ids, use_cache=False)
        worst = worst_of(grads, ref_grads)
        e = rel_err(logits, ref_logits)
        report(e <= TOL and worst[0] <= TOL and varlen_calls == [4] * config.num_hidden_layers,
               "transformers Gemma 4 packed rows [3, 30, 7] and [40]: winattn varlen vs eager",
               "logits rel err %.1e, worst gradient %.1e (%s) (tol %g)" % (e, worst[0], worst[1], TOL))

    for label, cls, config in models[:2]:
        @case("transformers %s generate from a left-padded batch" % label)
        def _():
            if not HAS_VARLEN:
                return
            model = build(cls, config, 5)
            ids = torch.randint(1, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(8))
            mask = torch.ones(2, 12, dtype=torch.long)
            mask[1, :4] = 0
            outs = {}
            varlen_calls.clear()
            for impl in ("winattn", "eager"):
                model.set_attn_implementation(impl)
                with torch.no_grad():
                    g = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                       output_logits=True, return_dict_in_generate=True, pad_token_id=0)
                outs[impl] = torch.stack(g.logits)
            e = rel_err(outs["winattn"], outs["eager"])
            report(e <= TOL and len(varlen_calls) == 6 * config.num_hidden_layers,
                   "transformers %s generate, prompts of 12 and 8 tokens (left-padded) + 6 new tokens, dynamic "
                   "cache (sliding layers full)" % label,
                   "logits rel err %.1e (tol %g), %d varlen calls" % (e, TOL, len(varlen_calls)))

    if HAS_VARLEN and torch.cuda.is_available():
        @case("transformers CUDA padded and packed")
        def _():
            label, cls, config = models[0]
            model = build(cls, config, 7).cuda()
            mask = padding("left").cuda()
            ids = torch.randint(1, config.vocab_size, (3, N), generator=torch.Generator().manual_seed(50)).cuda()
            position_ids = torch.cat([torch.arange(n) for n in (13, 1, 20, 6)])[None].cuda()
            for what, kw, real in (("left-padded", dict(attention_mask=mask), mask.bool()),
                                   ("packed", dict(position_ids=position_ids.expand(3, N)), None)):
                varlen_calls.clear()
                logits, grads = run(model, "winattn", ids, real=real, use_cache=False, **kw)
                ref_logits, ref_grads = run(model, "eager", ids, real=real, use_cache=False, **kw)
                worst = worst_of(grads, ref_grads)
                e = rel_err(logits, ref_logits)
                report(e <= TOL and worst[0] <= TOL and len(varlen_calls) == config.num_hidden_layers,
                       "transformers Gemma 4 on CUDA, float32, %s batch of 3: winattn vs eager" % what,
                       "logits rel err %.1e, worst gradient %.1e (%s) (tol %g)" % (e, worst[0], worst[1], TOL))
    else:
        skip("transformers CUDA padded and packed", "no CUDA device")

    @case("transformers Gemma 4 prefill then decode with a cache")
    def _():
        label, cls, config = models[0]
        model = build(cls, config, 0)
        ids = torch.randint(0, config.vocab_size, (1, N + 3), generator=torch.Generator().manual_seed(7))
        outs = {}
        masks.clear()
        for impl in ("winattn", "eager"):
            model.set_attn_implementation(impl)
            with torch.no_grad():
                first = model(ids[:, :N], use_cache=True)
                second = model(ids[:, N:], past_key_values=first.past_key_values, use_cache=True)
                third = model(ids[:, N + 2:], past_key_values=second.past_key_values, use_cache=True)
            outs[impl] = torch.cat([first.logits, second.logits[:, :2], third.logits], 1)
        e = rel_err(outs["winattn"], outs["eager"])
        report(e <= TOL and masks, "transformers Gemma 4 cache: prefill %d, then 2 tokens, then 1 (masks with "
               "Nq < Nk)" % N, "logits rel err %.1e (tol %g), %d masks checked" % (e, TOL, len(masks)))

    for label, cls, config in models[:2]:
        @case("transformers %s generate with a static cache" % label)
        def _():
            # A static cache hands over masks whose band ends before the cache does (empty slots).
            model = build(cls, config, 1)
            # no token 0: generate() would take it for padding (pad_token_id 0) and mask it
            ids = torch.randint(1, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
            outs = {}
            for impl in ("winattn", "eager"):
                model.set_attn_implementation(impl)
                with torch.no_grad():
                    g = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static",
                                       output_logits=True, return_dict_in_generate=True)
                outs[impl] = torch.stack(g.logits)
            e = rel_err(outs["winattn"], outs["eager"])
            report(e <= TOL, "transformers %s generate(cache_implementation='static'), 12 + 4 tokens" % label,
                   "logits rel err %.1e (tol %g)" % (e, TOL))

    @case("transformers refusals")
    def _():
        label, cls, config = models[0]
        model = build(cls, config, 0)
        model.set_attn_implementation("winattn")
        ids = torch.randint(0, config.vocab_size, (2, N))
        pad = torch.ones(2, N, dtype=torch.long)
        pad[0, 10:13] = 0  # padding between real tokens: not one sequence once unpadded
        expect_error("transformers padding inside a row", lambda: model(ids, attention_mask=pad, use_cache=False),
                     ValueError, "padding between real tokens" if HAS_VARLEN else "differs from this layer's")
        attn = model.model.layers[0].self_attn
        if HAS_VARLEN:
            # PackedMask (a mask transformers would not skip, without attention_mask) on layer 0, a sliding
            # layer of 8 keys, with 12 tokens: accepted when it is the band, refused with anything else in it
            from transformers.masking_utils import and_masks, sliding_window_causal_mask_function
            band = sliding_window_causal_mask_function(WINDOW)
            q12, kv12 = torch.randn(1, 8, 12, 16), torch.randn(1, 4, 12, 16)
            plain = wtf.mask_builder(1, 12, 12, mask_function=band, allow_is_causal_skip=False)
            o, _ = wtf.attention_forward(attn, q12, kv12, kv12, plain, position_ids=torch.arange(12)[None])
            want = wtf._attention(q12, kv12, kv12, window=(WINDOW - 1, 0), scale=attn.scaling).transpose(1, 2)
            report(isinstance(plain, wtf.PackedMask) and torch.equal(o, want),
                   "transformers PackedMask of the band alone, one sequence: the plain sliding-window result")
            extra = wtf.mask_builder(1, 12, 12, mask_function=and_masks(band, lambda b, h, q, kv: kv != 3),
                                     allow_is_causal_skip=False)
            one = torch.arange(12)[None]
            two = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]])
            expect_error("transformers PackedMask with a key hidden besides the band",
                         lambda: wtf.attention_forward(attn, q12, kv12, kv12, extra, position_ids=one),
                         ValueError, "differs from this layer's")
            expect_error("transformers PackedMask whose position_ids disagree with the mask",
                         lambda: wtf.attention_forward(attn, q12, kv12, kv12, plain, position_ids=two),
                         ValueError, "differs from this layer's")
        q = torch.randn(1, 8, 5, 16)
        kv = torch.randn(1, 4, 5, 16)
        expect_error("transformers attention dropout",
                     lambda: wtf.attention_forward(attn, q, kv, kv, None, dropout=0.1), ValueError, "dropout")
        expect_error("transformers float64 query",
                     lambda: wtf.attention_forward(attn, q.double(), kv.double(), kv.double(), None), TypeError,
                     "dtype")
        expect_error("transformers 3-d mask", lambda: wtf.attention_forward(attn, q, kv, kv, torch.ones(1, 5, 5)),
                     ValueError, "4-d")
        # an all-ones padding mask is the plain causal mask: accepted, same logits as none
        with torch.no_grad():
            a, b = model(ids, attention_mask=torch.ones(2, N, dtype=torch.long)).logits, model(ids).logits
        report(torch.equal(a, b), "transformers all-ones attention_mask is accepted and changes nothing")


if __name__ == "__main__":
    main()
    finish()

"""test_mlx.py — winattn.mlx against MLX's own attention, and patch_mlx_lm() on tiny mlx-lm
Gemma models. SKIPs without mlx (and the model cases without mlx-lm). Run from the repository
root after `make`:
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_mlx.py

Reference: mx.fast.scaled_dot_product_attention (on the CPU: MLX's unfused fallback and autodiff
through it) on float32 copies of the inputs, with the boolean mask mlx-lm's
create_causal_mask(Nq, offset=Nk-Nq, window_size=W) builds, so the window convention is checked
against the code Gemma training uses, not against our reading of it. Tolerances as in
test_python.py (inputs N(0, 1), outputs and gradients O(1)): float32 2e-4, float16 4e-3, bfloat16
3e-2, absolute, or relative to the reference's largest element where that exceeds 1. The model cases run float32 on both sides and differ only in summation order:
1e-4 of each tensor's largest element.
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import case, expect_error, finish, report, skip  # noqa: E402

TOL = {"float32": 2e-4, "float16": 4e-3, "bfloat16": 3e-2}
MODEL_TOL = 1e-4


def run_sdpa_grid(mx, wm):
    from mlx_lm.models.base import create_causal_mask
    shapes = [(37, 37), (64, 64), (20, 53), (1, 40), (100, 100)]  # (Nq, Nk); mlx-lm never has Nq > Nk
    windows = [1, 8, 16, 33, None]  # window_size; None: plain causal
    gqa = [(2, 2), (4, 2), (8, 2), (4, 1)]  # (Hq, Hkv)
    dtypes = [mx.float32, mx.float16, mx.bfloat16]
    n = 0
    for dt in dtypes:
        for Nq, Nk in shapes:
            for W in windows:
                n += 1
                Hq, Hkv = gqa[n % len(gqa)]
                B, D = 1 + n % 2, (16, 32, 24)[n % 3]
                mx.random.seed(n)
                q, k, v = (mx.random.normal((B, H, N, D)) for H, N in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))
                do = mx.random.normal((B, Hq, Nq, D))
                scale = D ** -0.5
                mask = create_causal_mask(Nq, offset=Nk - Nq, window_size=W)
                window = (W - 1, 0) if W else (-1, 0)
                name = "mlx %s B=%d Hq=%d Hkv=%d Nq=%d Nk=%d D=%d window_size=%s" % (
                    str(dt).split(".")[-1], B, Hq, Hkv, Nq, Nk, D, W)

                if dt == mx.bfloat16 and wm._BF16 is None:
                    skip(name, "bfloat16 MLX arrays need ml_dtypes, which is not installed")
                    continue

                @case(name)
                def _():
                    o, vjp = mx.vjp(lambda q, k, v: wm.attention(q, k, v, window=window, scale=scale),
                                    [x.astype(dt) for x in (q, k, v)], [do.astype(dt)])
                    ro, rvjp = mx.vjp(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                                           mask=mask),
                                      [q, k, v], [do])
                    got = [o[0]] + list(vjp)
                    # relative to the reference's scale where that exceeds 1: with GQA, dk and dv
                    # sum Hq/Hkv heads and grow past the O(1) the absolute tolerance assumes
                    errs = [mx.abs(a.astype(mx.float32) - b).max().item() / max(1.0, mx.abs(b).max().item())
                            for a, b in zip(got, [ro[0]] + list(rvjp))]
                    ok = max(errs) <= TOL[str(dt).split(".")[-1]] and all(a.dtype == dt for a in got)
                    report(ok, name + " vs mx.fast SDPA with create_causal_mask, forward and VJP",
                           "max err o/dq/dk/dv %s (tol %g)" % ("/".join("%.1e" % e for e in errs),
                                                               TOL[str(dt).split(".")[-1]]))


def run_mask_recognition(mx, wm):
    from mlx_lm.models.base import create_causal_mask

    @case("mlx mask recognition")
    def _():
        wrong = []
        for Nq, Nk in ((9, 9), (5, 30), (1, 12), (40, 40)):
            for W in (1, 2, 7, Nk - 1, Nk, Nk + 3, None):
                got = wm._window_of(create_causal_mask(Nq, offset=Nk - Nq, window_size=W), Nq, Nk)
                # a window of Nk or more keys is the causal mask, and either spelling computes it
                want = (W - 1, 0) if W and W < Nk else (-1, 0)
                if got != want:
                    wrong.append("Nq=%d Nk=%d W=%s: %s" % (Nq, Nk, W, got))
        report(not wrong, "mlx create_causal_mask(N, offset, window_size=W) is recognised as window (W-1, 0)",
               "; ".join(wrong))
        pad = create_causal_mask(10, window_size=4, right_padding=mx.array([0, 3]))
        left = create_causal_mask(10, left_padding=mx.array([2]))
        report(wm._window_of(pad, 10, 10) is None and wm._window_of(left, 10, 10) is None
               and wm._window_of(mx.zeros((10, 10)), 10, 10) is None and wm._window_of("other", 10, 10) is None,
               "mlx padding, additive and unknown masks are not taken for a window (they go to MLX)")

    @case("mlx patched attention with a padding mask")
    def _():
        from mlx_lm.models import gemma4_text
        mx.random.seed(3)
        q, k, v = (mx.random.normal((2, 4, 12, 16)) for _ in range(3))
        pad = create_causal_mask(12, window_size=5, right_padding=mx.array([0, 4]))
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=pad)
        for strict in (False, True):
            wm.patch_mlx_lm(models=("gemma4_text",), strict=strict, disable_compile=False)
            try:
                if strict:
                    expect_error("mlx patch_mlx_lm(strict=True) padding mask",
                                 lambda: gemma4_text.scaled_dot_product_attention(q, k, v, None, 0.25, pad),
                                 ValueError, "strict")
                else:
                    o = gemma4_text.scaled_dot_product_attention(q, k, v, None, 0.25, pad)
                    report(mx.array_equal(o, ref).item(),
                           "mlx patch_mlx_lm() hands a padding mask to mx.fast SDPA unchanged")
            finally:
                wm.unpatch_mlx_lm()

    @case("mlx bad input")
    def _():
        x = mx.zeros((1, 2, 8, 4))
        for name, call, exc, text in [
            ("int32", lambda: wm.attention(x.astype(mx.int32), x, x), TypeError, "dtype"),
            ("numpy input", lambda: wm.attention(__import__("numpy").zeros((1, 2, 8, 4)), x, x), TypeError, "mlx"),
            ("rank 3", lambda: wm.attention(x[0], x[0], x[0]), ValueError, "4-d"),
            ("mixed dtypes", lambda: wm.attention(x, x.astype(mx.float16), x), TypeError, "one dtype"),
            ("Hq % Hkv", lambda: wm.attention(mx.zeros((1, 3, 8, 4)), x, x), ValueError, "multiple"),
            ("k and v shapes", lambda: wm.attention(x, x, mx.zeros((1, 2, 9, 4))), ValueError, "shapes"),
            ("window -2", lambda: wm.attention(x, x, x, window=(-2, 0)), ValueError, "window"),
            ("window 2**64", lambda: wm.attention(x, x, x, window=(2 ** 64, 0)), ValueError, "outside"),
            ("scale 1e300", lambda: wm.attention(x, x, x, scale=1e300), ValueError, "float32"),
        ]:
            expect_error("mlx bad input: %s" % name, call, exc, text)


def tiny_gemma(mx, nn, module, seed):
    """A tiny mlx-lm model with weights large enough that attention patterns matter (the
    default init leaves attention nearly uniform)."""
    from mlx.utils import tree_flatten, tree_unflatten
    if module.__name__.endswith("gemma4_text"):
        args = module.ModelArgs(hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=8,
                                head_dim=16, global_head_dim=32, num_key_value_heads=4, num_global_key_value_heads=1,
                                attention_k_eq_v=True, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
                                vocab_size=256, vocab_size_per_layer_input=256, sliding_window=8,
                                sliding_window_pattern=6, use_double_wide_mlp=False)
    else:
        args = module.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
                                num_attention_heads=8, head_dim=16, num_key_value_heads=2, vocab_size=256,
                                query_pre_attn_scalar=40, sliding_window=8, sliding_window_pattern=3)
    mx.random.seed(seed)
    model = module.Model(args)
    params = []
    for name, p in tree_flatten(model.parameters()):
        if p.ndim >= 2:
            std = p.shape[1] ** -0.5  # the embedding too: Gemma multiplies it by sqrt(hidden)
            params.append((name, std * mx.random.normal(p.shape)))
        else:
            params.append((name, p + mx.random.uniform(-0.5, 0.5, p.shape)))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def loss_fn(mx, nn):
    def loss(model, tokens):
        logits = model(tokens[:, :-1])
        return nn.losses.cross_entropy(logits.astype(mx.float32), tokens[:, 1:]).mean()
    return loss


def rel_err(mx, a, b, floor=1e-30):
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), floor)).item()


def worst_of(mx, got, ref):
    """The largest error over a model's tensors, each relative to its own largest element but
    never to less than 1e-3 of the largest in the model: a gradient that is zero in exact
    arithmetic (the last layer's layer_scalar, which the final RMSNorm makes irrelevant to the
    loss) holds only rounding noise."""
    floor = 1e-3 * max(mx.abs(r).max().item() for r in ref.values())
    return max((rel_err(mx, got[n], ref[n], floor), n) for n in ref)


def run_mlx_lm(mx, nn, wm):
    try:
        import mlx_lm
        from mlx_lm.models import gemma3_text, gemma4_text
    except ImportError as e:
        skip("mlx-lm models", "mlx-lm is not installed (%s)" % e)
        return
    from mlx.utils import tree_flatten
    print("mlx-lm %s" % mlx_lm.__version__)
    N = 40  # five windows of 8
    routed = []  # the windows of the attention calls that reached winattn, to show the sliding layers did

    def spy(*a, **kw):
        routed.append(kw.get("window"))
        return real_attention(*a, **kw)
    real_attention = wm.attention

    for seed, module in enumerate((gemma4_text, gemma3_text)):
        label = "Gemma 4" if module is gemma4_text else "Gemma 3"

        @case("mlx-lm %s patched vs unpatched" % label)
        def _():
            model = tiny_gemma(mx, nn, module, seed)
            tokens = mx.random.randint(0, 256, (2, N + 1), key=mx.random.key(seed))
            vg = nn.value_and_grad(model, loss_fn(mx, nn))
            ref_loss, ref_grads = vg(model, tokens)
            mx.eval(ref_loss, ref_grads)
            wm.patch_mlx_lm(disable_compile=False)
            wm.attention = spy
            try:
                routed.clear()
                loss, grads = vg(model, tokens)
                mx.eval(loss, grads)
            finally:
                wm.attention = real_attention
                wm.unpatch_mlx_lm()
            ref, got = dict(tree_flatten(ref_grads)), dict(tree_flatten(grads))
            worst = worst_of(mx, got, ref)
            e = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            sliding = routed.count((7, 0))
            report(e <= MODEL_TOL and worst[0] <= MODEL_TOL and set(ref) == set(got) and sliding > 0
                   and (-1, 0) in routed,
                   "mlx-lm %s N=%d window 8: patch_mlx_lm() loss and %d parameter gradients vs unpatched"
                   % (label, N, len(ref)),
                   "loss %.6f vs %.6f rel err %.1e, worst gradient %.1e (%s) (tol %g); winattn calls: %d sliding, "
                   "%d causal" % (loss.item(), ref_loss.item(), e, worst[0], worst[1], MODEL_TOL, sliding,
                                  routed.count((-1, 0))))

    @case("mlx-lm Gemma 4 generation with a cache")
    def _():
        from mlx_lm.models.cache import make_prompt_cache
        model = tiny_gemma(mx, nn, gemma4_text, 0)
        tokens = mx.random.randint(0, 256, (1, N + 2), key=mx.random.key(5))

        def logits():
            cache = make_prompt_cache(model)
            first = model(tokens[:, :N], cache=cache)
            return mx.concatenate([first, model(tokens[:, N:N + 1], cache=cache),
                                   model(tokens[:, N + 1:], cache=cache)], axis=1)
        ref = logits()
        wm.patch_mlx_lm(disable_compile=False)
        try:
            got = logits()
        finally:
            wm.unpatch_mlx_lm()
        e = rel_err(mx, got, ref)
        report(e <= MODEL_TOL, "mlx-lm Gemma 4 prefill %d then decode 2 with mlx-lm's caches: logits patched vs "
               "unpatched (rotating-cache masks go to MLX)" % N, "rel err %.1e (tol %g)" % (e, MODEL_TOL))

    @case("mlx-lm Gemma 4 trainer")
    def _():
        # mlx-lm's own LoRA-free training loop, which compiles its step: patch_mlx_lm() must make
        # it run, and its updates must match the unpatched run.
        import mlx.optimizers as optim
        import numpy as np
        from mlx_lm.tuner.trainer import TrainingArgs, train
        data = [(list(range(s, s + N)), 0) for s in (3, 50, 100, 150)]
        finals = {}
        for patched in (False, True):
            model = tiny_gemma(mx, nn, gemma4_text, 3)
            np.random.seed(0)  # the trainer shuffles its batches with numpy's global generator
            if patched:
                wm.patch_mlx_lm()
                wm.attention = spy
                routed.clear()
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    args = TrainingArgs(batch_size=2, iters=3, steps_per_report=100, steps_per_eval=100,
                                        steps_per_save=100, max_seq_length=64,
                                        adapter_file=os.path.join(tmp, "adapters.safetensors"))
                    with open(os.devnull, "w") as quiet:
                        stdout, sys.stdout = sys.stdout, quiet
                        try:
                            train(model, optim.SGD(learning_rate=0.05), data, args=args)
                        finally:
                            sys.stdout = stdout
            finally:
                if patched:
                    wm.attention = real_attention
                    wm.unpatch_mlx_lm()
                    mx.enable_compile()
            finals[patched] = dict(tree_flatten(model.trainable_parameters()))
        start = dict(tree_flatten(tiny_gemma(mx, nn, gemma4_text, 3).trainable_parameters()))
        moved = max(rel_err(mx, finals[False][n], start[n]) for n in start)
        worst = worst_of(mx, finals[True], finals[False])
        report(worst[0] <= MODEL_TOL and moved > 100 * MODEL_TOL and routed.count((7, 0)) >= 15,
               "mlx-lm Gemma 4: mlx_lm.tuner.trainer.train, 3 SGD steps, patched vs unpatched parameters",
               "worst rel difference %.1e (%s) (tol %g); the steps moved parameters by up to %.1e; %d sliding "
               "attention calls went to winattn" % (worst[0], worst[1], MODEL_TOL, moved, routed.count((7, 0))))


def main():
    try:
        import mlx.core as mx
        import mlx.nn as nn
        import winattn.mlx as wm
    except ImportError as e:
        skip("mlx", "MLX is not installed (%s)" % e)
        return
    print("mlx %s on %s" % (mx.__version__, mx.default_device()))
    try:
        import mlx_lm.models.base  # noqa: F401  (the reference masks)
    except ImportError as e:
        skip("mlx SDPA grid", "mlx-lm is not installed (%s)" % e)
        return
    run_sdpa_grid(mx, wm)
    run_mask_recognition(mx, wm)
    run_mlx_lm(mx, nn, wm)


if __name__ == "__main__":
    main()
    finish()

"""test_mlx.py — winattn.mlx (attention, attention_varlen, and the padding masks patch_mlx_lm()
takes) against MLX's own attention, and patch_mlx_lm() on tiny mlx-lm Gemma models: gradients,
caches, mlx-lm's trainer on padded batches, batched decoding from merged caches. SKIPs without
mlx (and the model cases without mlx-lm). Run from the repository root after `make`:
    WINATTN_LIBRARY=build/libwinattn.so PYTHONPATH=python python3 python/tests/test_mlx.py

Reference: mx.fast.scaled_dot_product_attention (on the CPU: MLX's unfused fallback and autodiff
through it) on float32 copies of the inputs, with the boolean mask mlx-lm's
create_causal_mask(Nq, offset=Nk-Nq, window_size=W) builds, so the window convention is checked
against the code Gemma training uses, not against our reading of it. Tolerances as in
test_python.py (inputs N(0, 1), outputs and gradients O(1)): float32 2e-4, float16 4e-3, bfloat16
3e-2, absolute, or relative to the reference's largest element where that exceeds 1. The model
cases run float32 on both sides and differ only in summation order:
1e-4 of each tensor's largest element.
"""
import os
import sys
import tempfile

import numpy as np

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

    @case("mlx patched attention with a mask it cannot take")
    def _():
        from mlx_lm.models import gemma4_text
        mx.random.seed(3)
        q, k, v = (mx.random.normal((2, 4, 12, 16)) for _ in range(3))
        pad = create_causal_mask(12, window_size=5, right_padding=mx.array([0, 4]))
        holey = mx.array(np.asarray(pad) & (np.arange(12) != 2))  # padding between real tokens
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=holey)
        for strict in (False, True):
            wm.patch_mlx_lm(models=("gemma4_text",), strict=strict, disable_compile=False)
            try:
                if strict:
                    expect_error("mlx patch_mlx_lm(strict=True) mask with a hole",
                                 lambda: gemma4_text.scaled_dot_product_attention(q, k, v, None, 0.25, holey),
                                 ValueError, "strict")
                else:
                    o = gemma4_text.scaled_dot_product_attention(q, k, v, None, 0.25, holey)
                    report(mx.array_equal(o, ref).item(),
                           "mlx patch_mlx_lm() hands a mask with a hole among the real keys to mx.fast SDPA unchanged")
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


def run_varlen(mx, wm):
    """winattn.mlx.attention_varlen against mx.fast SDPA on each sequence alone, forward and VJP"""
    from mlx_lm.models.base import create_causal_mask
    mixes = [([5, 0, 1, 33, 17], [5, 0, 1, 33, 17]), ([1, 20, 3, 0], [4, 53, 3, 6])]  # Nq_b <= Nk_b, as in mlx-lm
    n = 0
    for dt in (mx.float32, mx.float16, mx.bfloat16):
        for lq, lk in mixes:
            for W in (None, 8):
                n += 1
                Hq, Hkv, D = ((4, 2, 16), (8, 1, 32), (2, 2, 24))[n % 3]
                name = "mlx varlen %s Hq=%d Hkv=%d D=%d lens q %s k %s window_size=%s" % (
                    str(dt).split(".")[-1], Hq, Hkv, D, lq, lk, W)
                if dt == mx.bfloat16 and wm._BF16 is None:
                    skip(name, "bfloat16 MLX arrays need ml_dtypes, which is not installed")
                    continue

                @case(name)
                def _():
                    mx.random.seed(100 + n)
                    cu_q, cu_k = ([0] + np.cumsum(x).tolist() for x in (lq, lk))
                    q, do = (mx.random.normal((cu_q[-1], Hq, D)) for _ in range(2))
                    k, v = (mx.random.normal((cu_k[-1], Hkv, D)) for _ in range(2))
                    window = (W - 1, 0) if W else (-1, 0)
                    o, vjp = mx.vjp(lambda q, k, v: wm.attention_varlen(q, k, v, mx.array(cu_q), cu_k, window=window),
                                    [x.astype(dt) for x in (q, k, v)], [do.astype(dt)])

                    def reference(q, k, v):
                        outs = []
                        for b in range(len(lq)):
                            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
                            if lq[b] == 0:
                                continue
                            if lk[b] == 0:
                                outs.append(mx.zeros((lq[b], Hq, D)))
                                continue
                            mask = create_causal_mask(lq[b], offset=lk[b] - lq[b], window_size=W)
                            r = mx.fast.scaled_dot_product_attention(*(x[s].transpose(1, 0, 2)[None] for x, s in
                                                                       ((q, qs), (k, ks), (v, ks))),
                                                                     scale=D ** -0.5, mask=mask)
                            outs.append(r[0].transpose(1, 0, 2))
                        return mx.concatenate(outs, axis=0)
                    ro, rvjp = mx.vjp(reference, [q, k, v], [do])
                    errs = [mx.abs(a.astype(mx.float32) - b).max().item() / max(1.0, mx.abs(b).max().item())
                            for a, b in zip([o[0]] + list(vjp), [ro[0]] + list(rvjp))]
                    tol = TOL[str(dt).split(".")[-1]]
                    report(max(errs) <= tol and o[0].dtype == dt,
                           name + " vs mx.fast SDPA per sequence, forward and VJP",
                           "max err o/dq/dk/dv %s (tol %g)" % ("/".join("%.1e" % e for e in errs), tol))

    @case("mlx varlen bad input")
    def _():
        x = mx.zeros((10, 2, 8))
        for name, call, exc, text in [
            ("float offsets", lambda: wm.attention_varlen(x, x, x, [0.0, 10.0], [0, 10]), TypeError, "integers"),
            ("offsets past T", lambda: wm.attention_varlen(x, x, x, [0, 11], [0, 10]), ValueError, "token rows"),
            ("decreasing", lambda: wm.attention_varlen(x, x, x, [0, 6, 4, 10], [0, 3, 4, 10]), ValueError,
             "decreases"),
            ("4-d q", lambda: wm.attention_varlen(x[None], x, x, [0, 10], [0, 10]), ValueError, "3-d"),
            ("B differs", lambda: wm.attention_varlen(x, x, x, [0, 10], [0, 5, 10]), ValueError, "B + 1"),
        ]:
            expect_error("mlx varlen bad input: %s" % name, call, exc, text)


def run_padded_masks(mx, wm):
    """Padded batches' masks (mlx-lm's create_causal_mask with left_padding / right_padding, as
    its batched caches build them) through the patched attention, against MLX on the real rows."""
    from mlx_lm.models import gemma4_text
    from mlx_lm.models.base import create_causal_mask
    n = 0
    for Nq, off in ((12, 0), (1, 20), (5, 9)):
        for side in ("left", "right"):
            for W in (None, 4):
                n += 1
                B, Hq, Hkv, D = 3, 4, 2, 16
                Nk = Nq + off
                pad = mx.array([0, 3, Nk - 1] if side == "left" else [0, 2, min(Nq, 5)])
                mask = create_causal_mask(Nq, offset=off, window_size=W, **{side + "_padding": pad})
                name = "mlx padded mask B=3 Nq=%d Nk=%d %s padding %s window_size=%s" % (
                    Nq, Nk, side, pad.tolist(), W)

                @case(name)
                def _():
                    mx.random.seed(200 + n)
                    q, do = (mx.random.normal((B, Hq, Nq, D)) for _ in range(2))
                    k, v = (mx.random.normal((B, Hkv, Nk, D)) for _ in range(2))
                    m = np.asarray(mask)[:, 0]
                    # a real query sees its own position; padded query rows are left out of the loss
                    real = mx.array(m[:, np.arange(Nq), np.arange(Nq) + off])[:, None, :, None]
                    do = do * real
                    wm.patch_mlx_lm(models=("gemma4_text",), strict=True, disable_compile=False)
                    try:
                        o, vjp = mx.vjp(lambda q, k, v: gemma4_text.scaled_dot_product_attention(
                            q, k, v, None, 0.25, mask), [q, k, v], [do])
                    finally:
                        wm.unpatch_mlx_lm()
                    ro, rvjp = mx.vjp(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25,
                                                                                           mask=mask),
                                      [q, k, v], [do])
                    errs = [mx.abs(mx.where(real, a - b, 0) if i == 0 else a - b).max().item()
                            for i, (a, b) in enumerate(zip([o[0]] + list(vjp), [ro[0]] + list(rvjp)))]
                    report(max(errs) <= 2e-4, name + ": patch_mlx_lm(strict=True) runs it through winattn varlen, "
                           "real rows and VJP match mx.fast SDPA", "max err o/dq/dk/dv %s" % "/".join(
                               "%.1e" % e for e in errs))

    @case("mlx padded masks that are not band and padding")
    def _():
        holey = create_causal_mask(10, left_padding=mx.array([0, 2]))
        holey = mx.array(np.asarray(holey) & (np.arange(10) != 6))  # a key hidden inside the run of real keys
        per_row = mx.concatenate([create_causal_mask(10, window_size=3)[None, None],
                                  create_causal_mask(10, window_size=5)[None, None]])  # two windows
        report(wm._padded_plan(holey, 10, 10) is None and wm._padded_plan(per_row, 10, 10) is None
               and wm._padded_plan(mx.zeros((2, 1, 10, 10)), 10, 10) is None,
               "mlx a hole among the real keys, a window per row, an additive mask: no varlen plan (they go to MLX)")


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
        # it run, and its updates must match the unpatched run. Its batches are padded: it sorts
        # the sequences by length, right-pads each batch with zeros to 1 + a multiple of 32 and
        # calls the model without any mask (causality keeps the padding from real tokens; the
        # loss masks it with the lengths), so every attention call is a plain causal or sliding
        # one and none may fall back to MLX.
        import mlx.optimizers as optim
        from mlx_lm.tuner.trainer import TrainingArgs, train
        data = [(list(range(s, s + n)), 0) for s, n in ((3, 17), (50, 40), (100, 9), (150, 33))]
        finals = {}
        real_fast = mx.fast.scaled_dot_product_attention
        fallbacks = []

        def count_fallback(*a, **kw):
            fallbacks.append(kw.get("mask"))
            return real_fast(*a, **kw)
        for patched in (False, True):
            model = tiny_gemma(mx, nn, gemma4_text, 3)
            np.random.seed(0)  # the trainer shuffles its batches with numpy's global generator
            if patched:
                wm.patch_mlx_lm()
                wm.attention = spy
                mx.fast.scaled_dot_product_attention = count_fallback
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
                    mx.fast.scaled_dot_product_attention = real_fast
                    wm.unpatch_mlx_lm()
                    mx.enable_compile()
            finals[patched] = dict(tree_flatten(model.trainable_parameters()))
        start = dict(tree_flatten(tiny_gemma(mx, nn, gemma4_text, 3).trainable_parameters()))
        moved = max(rel_err(mx, finals[False][n], start[n]) for n in start)
        worst = worst_of(mx, finals[True], finals[False])
        report(worst[0] <= MODEL_TOL and moved > 100 * MODEL_TOL and routed.count((7, 0)) >= 15 and not fallbacks,
               "mlx-lm Gemma 4: mlx_lm.tuner.trainer.train on padded batches (lengths 9, 17, 33, 40), 3 SGD steps, "
               "patched vs unpatched parameters",
               "worst rel difference %.1e (%s) (tol %g); the steps moved parameters by up to %.1e; %d sliding and %d "
               "causal attention calls went to winattn, %d to MLX" % (
                   worst[0], worst[1], MODEL_TOL, moved, routed.count((7, 0)), routed.count((-1, 0)), len(fallbacks)))

    for module in (gemma4_text, gemma3_text):
        label = "Gemma 4" if module is gemma4_text else "Gemma 3"

        if not wm.HAS_VARLEN:
            skip("mlx-lm %s batched decoding" % label, "this libwinattn has no wa_forward_varlen")
            continue

        @case("mlx-lm %s batched decoding" % label)
        def _():
            # mlx-lm's batched generation: prompts of different lengths prefilled one by one, their
            # caches merged into left-padded BatchKVCache / BatchRotatingKVCache, then decoded together
            from mlx_lm.models.cache import make_prompt_cache
            model = tiny_gemma(mx, nn, module, 6)
            prompts = [mx.random.randint(1, 256, (n,), key=mx.random.key(n)) for n in (12, 5, 9)]
            steps = mx.random.randint(1, 256, (3, 3), key=mx.random.key(99))

            def logits():
                caches = []
                for p in prompts:
                    c = make_prompt_cache(model)
                    model(p[None], cache=c)
                    caches.append(c)
                merged = [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]
                return mx.concatenate([model(steps[:, t:t + 1], cache=merged) for t in range(3)], axis=1)
            ref = logits()
            plans = []
            real_padded = wm._padded_attention

            def count_padded(*a, **kw):
                plans.append(a[3].cu_q.tolist())
                return real_padded(*a, **kw)
            wm.patch_mlx_lm(disable_compile=False)
            wm._padded_attention = count_padded
            try:
                got = logits()
            finally:
                wm._padded_attention = real_padded
                wm.unpatch_mlx_lm()
            e = rel_err(mx, got, ref)
            report(e <= MODEL_TOL and plans, "mlx-lm %s prompts of 12, 5, 9 tokens, caches merged, 3 batched decode "
                   "steps: logits patched vs unpatched" % label,
                   "rel err %.1e (tol %g); %d padded-mask calls went to winattn varlen (the rest: rotating caches' "
                   "rolled masks, to MLX)" % (e, MODEL_TOL, len(plans)))


def run_empty(mx, wm):
    """Zero-size arrays through MLX, as include/winattn.h documents them for the C API: no keys
    (Nk = 0) gives o = 0 and zero dq; no queries give empty results (test_python.py covers numpy
    and torch)."""
    @case("mlx Nk = 0")
    def _():
        q = mx.random.normal((1, 4, 5, 16))
        k0 = mx.zeros((1, 2, 0, 16))
        o, vjp = mx.vjp(lambda q, k, v: wm.attention(q, k, v, window=(3, 0)), [q, k0, k0],
                        [mx.random.normal((1, 4, 5, 16))])
        report(not mx.any(o[0]).item() and not mx.any(vjp[0]).item() and vjp[1].shape == k0.shape,
               "mlx Nk = 0 through mx.vjp: o = 0, dq = 0, empty dk")

    @case("mlx Nq = 0")
    def _():
        q0 = mx.zeros((1, 4, 0, 16))
        k = mx.random.normal((1, 2, 7, 16))
        o, vjp = mx.vjp(lambda q, k, v: wm.attention(q, k, v), [q0, k, k], [mx.zeros((1, 4, 0, 16))])
        report(o[0].shape == q0.shape and not mx.any(vjp[1]).item() and not mx.any(vjp[2]).item(),
               "mlx Nq = 0 through mx.vjp: empty o, dk = dv = 0")


def main():
    try:
        import mlx.core as mx
        import mlx.nn as nn
        import winattn.mlx as wm
    except ImportError as e:
        skip("mlx", "MLX is not installed (%s)" % e)
        return
    print("mlx %s on %s" % (mx.__version__, mx.default_device()))
    run_empty(mx, wm)
    try:
        import mlx_lm.models.base  # noqa: F401  (the reference masks)
    except ImportError as e:
        skip("mlx SDPA grid", "mlx-lm is not installed (%s)" % e)
        return
    run_sdpa_grid(mx, wm)
    run_mask_recognition(mx, wm)
    if wm.HAS_VARLEN:
        run_varlen(mx, wm)
        run_padded_masks(mx, wm)
    else:
        skip("mlx varlen and padded masks", "this libwinattn has no wa_forward_varlen")
    run_mlx_lm(mx, nn, wm)


if __name__ == "__main__":
    main()
    finish()

"""winattn for MLX: `winattn.mlx.attention(q, k, v, window=..., causal=..., scale=..., softcap=...)`,
an `mx.custom_function` whose VJP is winattn's backward, and `patch_mlx_lm()`, which makes mlx-lm's
Gemma 3 and Gemma 4 text models run (and train) their attention through it.

q [B, Hq, Nq, D], k and v [B, Hkv, Nk, D] (the layout of mx.fast.scaled_dot_product_attention),
float32, float16 or bfloat16 (bfloat16 needs ml_dtypes); Hq % Hkv == 0 with the same head grouping
as mx.fast.scaled_dot_product_attention. window=(left, right) is bottom-right aligned like MLX's
mask="causal" and mlx-lm's create_causal_mask: mlx-lm's window_size=W is window=(W-1, 0).

The kernels run on the CPU through numpy views of the MLX arrays (no copy in; one copy of each
result back into MLX). The forward's logsumexp is kept as a second output of the custom function
so that the backward needs no recomputation of the forward, and the backward never forms an
Nq x Nk matrix: memory stays linear in the sequence length where MLX's own backward on the CPU
(autodiff through its unfused fallback) keeps score-sized tensors.

One limit follows from calling out to numpy: the op evaluates its inputs, which mx.compile and
mx.vmap do not allow inside a traced function. Call it uncompiled (patch_mlx_lm turns compilation
off for that reason).
"""
import functools
import importlib

import mlx.core as mx
import numpy as np

from . import attention as _np_attention
from . import attention_backward as _np_attention_backward
from ._lib import window_args

__all__ = ["attention", "patch_mlx_lm", "unpatch_mlx_lm", "SlidingWindowMask"]

try:
    import ml_dtypes
    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    _BF16 = None

_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _to_numpy(x):
    """A numpy view of x (evaluating it). numpy has no bfloat16, so bf16 goes through its bits."""
    if x.dtype == mx.bfloat16:
        if _BF16 is None:
            raise TypeError("winattn: bfloat16 MLX arrays need ml_dtypes (pip install ml_dtypes)")
        return np.asarray(x.view(mx.uint16)).view(_BF16)
    return np.asarray(x)


def _to_mlx(a):
    if _BF16 is not None and a.dtype == _BF16:
        return mx.array(a.view(np.uint16)).view(mx.bfloat16)
    return mx.array(a)


@functools.lru_cache(maxsize=None)
def _op(left, right, scale, softcap):
    """The custom function for one set of attention parameters. They are baked in, not passed,
    because a custom function's arguments are what its VJP differentiates."""
    params = dict(window=(left, right), scale=scale, softcap=softcap)

    @mx.custom_function
    def forward(q, k, v):
        o, lse = _np_attention(_to_numpy(q), _to_numpy(k), _to_numpy(v), return_lse=True, **params)
        return _to_mlx(o), mx.array(lse)

    @forward.vjp
    def backward(primals, cotangents, outputs):
        q, k, v = primals
        o, lse = outputs
        do = cotangents[0].astype(q.dtype)  # the lse output is not differentiable: its cotangent is ignored
        grads = _np_attention_backward(*(_to_numpy(x) for x in (q, k, v, o)), _to_numpy(lse), _to_numpy(do),
                                       **params)
        return tuple(_to_mlx(g) for g in grads)

    return forward


def _check(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, mx.array):
            raise TypeError("winattn: %s must be an mlx.core.array, got %s" % (name, type(x).__name__))
        if x.dtype not in _DTYPES:
            raise TypeError("winattn: %s has dtype %s; float32, float16 or bfloat16 are supported" % (name, x.dtype))
        if x.ndim != 4:
            raise ValueError("winattn: %s must be 4-d [B, H, N, D], got shape %s" % (name, tuple(x.shape)))
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError("winattn: q, k, v must share one dtype, got %s, %s, %s" % (q.dtype, k.dtype, v.dtype))
    B, Hq, Nq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError("winattn: shapes q %s, k %s, v %s: k and v must be [B, Hkv, Nk, D] with q's B and D"
                         % (tuple(q.shape), tuple(k.shape), tuple(v.shape)))
    if Hq % k.shape[1]:
        raise ValueError("winattn: q's %d heads are not a multiple of k's %d" % (Hq, k.shape[1]))


def attention(q, k, v, window=(-1, -1), causal=False, scale=None, softcap=0.0, return_lse=False):
    """Exact attention with a (left, right) window, differentiable in q, k and v through mx.grad,
    mx.vjp and nn.value_and_grad. scale None = 1/sqrt(D). Returns o (like q), and with return_lse
    also the float32 logsumexp [B, Hq, Nq] (natural log; -inf for a row that sees no key)."""
    _check(q, k, v)
    left, right, scale, softcap = window_args(window, causal, scale, softcap)
    o, lse = _op(left, right, scale, softcap)(q, k, v)
    return (o, lse) if return_lse else o


class SlidingWindowMask:
    """What the patched create_attention_mask returns instead of a dense [N, N] boolean mask: just
    the window size. Deliberately not an array or a string, so that any code other than the
    patched attention that is handed one fails loudly instead of attending causally; that is why
    patch_mlx_lm replaces both names in each model module together."""

    def __init__(self, window_size):
        self.window_size = int(window_size)

    def __repr__(self):
        return "SlidingWindowMask(%d)" % self.window_size


def _window_of(mask, Nq, Nk):
    """winattn's (left, right) for an mlx-lm mask, or None when it is not a plain causal or
    sliding mask (padding, a rotating cache's layout, an additive mask): those go to MLX."""
    if mask is None:
        return (-1, -1)
    if isinstance(mask, SlidingWindowMask):
        return (mask.window_size - 1, 0)
    if isinstance(mask, str):
        return (-1, 0) if mask == "causal" else None
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_ or mask.ndim < 2 or Nq > Nk:
        return None
    if tuple(mask.shape[-2:]) != (Nq, Nk) or any(s != 1 for s in mask.shape[:-2]):
        return None
    # create_causal_mask(Nq, offset=Nk-Nq, window_size=W): the last row sees min(W, Nk) keys.
    seen = int(mask[..., -1, :].sum().item())
    if seen < 1:
        return None
    window = (-1, 0) if seen == Nk else (seen - 1, 0)
    i = mx.arange(Nk - Nq, Nk)[:, None]
    j = mx.arange(Nk)[None]
    band = (j <= i) & (j >= i - window[0]) if window[0] >= 0 else j <= i
    return window if mx.array_equal(mask.reshape(Nq, Nk), band).item() else None


_patched = {}  # module name -> (scaled_dot_product_attention, create_attention_mask) it had before


def _dense(mask, Nq, Nk):
    from mlx_lm.models.base import create_causal_mask
    return create_causal_mask(Nq, offset=Nk - Nq, window_size=mask.window_size)


def _make_sdpa(original, strict):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        Nq, Nk = queries.shape[2], keys.shape[2]
        window = None
        if sinks is None and not hasattr(cache, "bits"):  # a quantized cache holds no plain keys
            window = _window_of(mask, Nq, Nk)
        if window is None:
            if strict:
                raise ValueError("winattn: patch_mlx_lm(strict=True): this attention call has a mask, attention "
                                 "sinks or a quantized cache that winattn does not handle")
            if isinstance(mask, SlidingWindowMask):
                mask = _dense(mask, Nq, Nk)
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        return attention(queries, keys, values, window=window, scale=scale)

    scaled_dot_product_attention.winattn_original = original
    return scaled_dot_product_attention


def _make_mask_builder(original):
    def create_attention_mask(h, cache=None, window_size=None, return_array=False):
        # Training calls the model without a cache: there the sliding mask would be a dense
        # [N, N] array (0.93 GB at 30K tokens) that winattn does not need.
        if window_size and not return_array and h.shape[1] > 1 and not (cache and hasattr(cache, "make_mask")):
            return SlidingWindowMask(window_size)
        return original(h, cache, window_size=window_size, return_array=return_array)

    return create_attention_mask


def patch_mlx_lm(models=("gemma4_text", "gemma3_text"), strict=False, disable_compile=True):
    """Routes the attention of mlx-lm's Gemma 4 and Gemma 3 text models (mlx_lm.models.<name> for
    each name in models) through winattn.mlx.attention, in place, for models built before or
    after the call. Other mlx-lm model modules that take both names below from mlx_lm.models.base
    can be listed too; base itself is left alone, since each model module holds its own
    reference to base's functions.

    In each module it replaces scaled_dot_product_attention, which then sends plain causal and
    sliding-window masks (the strings mlx-lm uses, the masks create_causal_mask builds, and the
    window-carrying mask below) to winattn with the layer's window and scale, and everything else
    (padding masks, a rotating cache's rolled layout, attention sinks, a quantized cache) to the
    original mx.fast.scaled_dot_product_attention, or raises with strict=True. It also replaces
    create_attention_mask so that, without a cache (training), a sliding layer's mask is a small
    SlidingWindowMask instead of a dense [N, N] array.

    mlx-lm's trainer compiles its step with mx.compile, which cannot trace a call out to numpy;
    disable_compile=True calls mx.disable_compile() so the trainer runs (uncompiled). Pass False
    if you call the model only outside compiled functions. A module already patched is left as
    it is; unpatch_mlx_lm() undoes the patch (not the compile switch: mx.enable_compile() does)."""
    for name in models:
        module = importlib.import_module("mlx_lm.models." + name)
        if name in _patched:
            continue
        for attr in ("scaled_dot_product_attention", "create_attention_mask"):
            if not hasattr(module, attr):
                raise AttributeError("winattn: mlx_lm.models.%s has no %s; this mlx-lm is not supported" % (name, attr))
        _patched[name] = (module.scaled_dot_product_attention, module.create_attention_mask)
        module.scaled_dot_product_attention = _make_sdpa(module.scaled_dot_product_attention, strict)
        module.create_attention_mask = _make_mask_builder(module.create_attention_mask)
    if disable_compile:
        mx.disable_compile()


def unpatch_mlx_lm():
    """Restores what patch_mlx_lm replaced."""
    for name, (sdpa, mask) in list(_patched.items()):
        module = importlib.import_module("mlx_lm.models." + name)
        module.scaled_dot_product_attention, module.create_attention_mask = sdpa, mask
        del _patched[name]

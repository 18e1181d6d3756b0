"""winattn for MLX: `winattn.mlx.attention(q, k, v, window=..., causal=..., scale=..., softcap=...)`,
an `mx.custom_function` whose VJP is winattn's backward, its packed-batch form
`winattn.mlx.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)` ([T, H, D] arrays, as
flash_attn_varlen_func), and `patch_mlx_lm()`, which makes mlx-lm's Gemma 3 and Gemma 4 text
models run (and train) their attention through them.

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
from . import attention_varlen as _np_attention_varlen
from . import attention_varlen_backward as _np_attention_varlen_backward
from . import cu_seqlens_arg
from ._lib import HAS_VARLEN, int_arg, window_args

__all__ = ["attention", "attention_varlen", "patch_mlx_lm", "unpatch_mlx_lm", "SlidingWindowMask"]

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


def _varlen_op(left, right, scale, softcap, cu_q, cu_k, max_q, max_k):
    """The custom function of one varlen call: the offsets are baked in like the parameters,
    since a custom function's arguments are what its VJP differentiates."""
    params = dict(window=(left, right), scale=scale, softcap=softcap, max_seqlen_q=max_q, max_seqlen_k=max_k)

    @mx.custom_function
    def forward(q, k, v):
        o, lse = _np_attention_varlen(_to_numpy(q), _to_numpy(k), _to_numpy(v), cu_q, cu_k, return_lse=True,
                                      **params)
        return _to_mlx(o), mx.array(lse)

    @forward.vjp
    def backward(primals, cotangents, outputs):
        q, k, v = primals
        o, lse = outputs
        do = cotangents[0].astype(q.dtype)
        grads = _np_attention_varlen_backward(*(_to_numpy(x) for x in (q, k, v, o)), _to_numpy(lse), _to_numpy(do),
                                              cu_q, cu_k, **params)
        return tuple(_to_mlx(g) for g in grads)

    return forward


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, window=(-1, -1),
                     causal=False, scale=None, softcap=0.0, return_lse=False):
    """Attention over a packed batch of sequences of different lengths (flash_attn_varlen_func's
    layout), differentiable in q, k and v: q [Tq, Hq, D], k and v [Tk, Hkv, D] hold the sequences
    end to end; cu_seqlens_q and cu_seqlens_k (B + 1 integer offsets each, as an mx.array, a numpy
    array or a list) say which rows each sequence owns. Each sequence attends only within itself,
    its window bottom-right aligned. Returns o like q, and with return_lse the float32 lse
    [Hq, Tq]. The offsets are read on the host and checked (ValueError)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, mx.array):
            raise TypeError("winattn: %s must be an mlx.core.array, got %s" % (name, type(x).__name__))
        if x.dtype not in _DTYPES:
            raise TypeError("winattn: %s has dtype %s; float32, float16 or bfloat16 are supported" % (name, x.dtype))
        if x.ndim != 3:
            raise ValueError("winattn: %s must be 3-d [T, H, D], got shape %s" % (name, tuple(x.shape)))
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError("winattn: q, k, v must share one dtype, got %s, %s, %s" % (q.dtype, k.dtype, v.dtype))
    cu_q, lens_q = cu_seqlens_arg(np.asarray(cu_seqlens_q), "cu_seqlens_q", q.shape[0])
    cu_k, lens_k = cu_seqlens_arg(np.asarray(cu_seqlens_k), "cu_seqlens_k", k.shape[0])
    if cu_q.size != cu_k.size:
        raise ValueError("winattn: cu_seqlens_q has %d entries and cu_seqlens_k %d; both must be B + 1"
                         % (cu_q.size, cu_k.size))
    max_q = int(lens_q.max()) if lens_q.size else 0
    max_k = int(lens_k.max()) if lens_k.size else 0
    if max_seqlen_q is not None:
        max_q = max(max_q, int_arg(max_seqlen_q, "max_seqlen_q", 0, 2 ** 31 - 1))
    if max_seqlen_k is not None:
        max_k = max(max_k, int_arg(max_seqlen_k, "max_seqlen_k", 0, 2 ** 31 - 1))
    left, right, scale, softcap = window_args(window, causal, scale, softcap)
    o, lse = _varlen_op(left, right, scale, softcap, cu_q, cu_k, max_q, max_k)(q, k, v)
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
    sliding mask (padding: see _padded_plan; a rotating cache's layout, an additive mask: MLX)."""
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


class _PaddedPlan:
    """A padded batch as varlen: per row the run of real keys [s, e) and the queries among them,
    the flat rows of [B * N] they occupy, and the window the mask was checked to hold."""

    def __init__(self, window, lens_q, lens_k, rows_q, rows_k):
        self.window = window
        self.cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
        self.cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
        self.rows_q, self.rows_k = mx.array(rows_q.astype(np.int32)), mx.array(rows_k.astype(np.int32))


def _padded_plan(mask, Nq, Nk):
    """The varlen plan of a boolean [B, 1, Nq, Nk] mask that is a causal or sliding band, bottom-right
    aligned (query i at position i + Nk - Nq), over each row's one run of real keys: what mlx-lm's
    create_causal_mask(..., left_padding=, right_padding=) builds. The mask is compared element by
    element with the band the plan stands for, so anything else returns None. Queries outside
    their row's run of keys are padding: they get 0 where MLX computes values no real token reads."""
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_ or mask.ndim != 4 or mask.shape[1] != 1:
        return None
    if tuple(mask.shape[-2:]) != (Nq, Nk) or Nq > Nk:
        return None
    m = np.asarray(mask)[:, 0]
    B = m.shape[0]
    keys = m.any(1)
    runs = keys[:, 0].astype(np.int64) + (keys[:, 1:] & ~keys[:, :-1]).sum(1)
    if (runs > 1).any():
        return None
    n = keys.sum(1)
    s = np.where(n > 0, keys.argmax(1), 0)
    e = s + n
    P = np.arange(Nq) + (Nk - Nq)
    j = np.arange(Nk)
    band = (j[None, None, :] <= P[None, :, None]) & (j >= s[:, None, None]) & (j < e[:, None, None])
    widest = int(m.sum(2).max()) if m.size else 0
    for left in [-1] + ([widest - 1] if widest > 0 else []):
        if np.array_equal(m, band if left < 0 else band & (j[None, None, :] >= P[None, :, None] - left)):
            break
    else:
        return None
    q0 = np.maximum(s, Nk - Nq)
    lens_q, lens_k = np.maximum(e - q0, 0), n
    rows_q = np.concatenate([b * Nq + np.arange(q0[b], q0[b] + lens_q[b]) - (Nk - Nq) for b in range(B)])
    rows_k = np.concatenate([b * Nk + np.arange(s[b], e[b]) for b in range(B)])
    return _PaddedPlan((left, 0), lens_q, lens_k, rows_q, rows_k)


def _padded_attention(queries, keys, values, plan, scale):
    """[B, H, N, D] gathered into packed rows, winattn's varlen attention, scattered back with
    zeros in the padded query rows."""
    B, Hq, Nq, D = queries.shape
    Hkv, Nk, Dv = keys.shape[1], keys.shape[2], values.shape[3]
    q = mx.take(queries.transpose(0, 2, 1, 3).reshape(B * Nq, Hq, D), plan.rows_q, axis=0)
    k = mx.take(keys.transpose(0, 2, 1, 3).reshape(B * Nk, Hkv, D), plan.rows_k, axis=0)
    v = mx.take(values.transpose(0, 2, 1, 3).reshape(B * Nk, Hkv, Dv), plan.rows_k, axis=0)
    o = attention_varlen(q, k, v, plan.cu_q, plan.cu_k, window=plan.window, scale=scale)
    out = mx.zeros((B * Nq, Hq, Dv), dtype=o.dtype).at[plan.rows_q].add(o)
    return out.reshape(B, Nq, Hq, Dv).transpose(0, 2, 1, 3)


_patched = {}  # module name -> (scaled_dot_product_attention, create_attention_mask) it had before


def _dense(mask, Nq, Nk):
    from mlx_lm.models.base import create_causal_mask
    return create_causal_mask(Nq, offset=Nk - Nq, window_size=mask.window_size)


def _make_sdpa(original, strict):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        Nq, Nk = queries.shape[2], keys.shape[2]
        window = plan = None
        if sinks is None and not hasattr(cache, "bits"):  # a quantized cache holds no plain keys
            window = _window_of(mask, Nq, Nk)
            if window is None and HAS_VARLEN:
                plan = _padded_plan(mask, Nq, Nk)
        if plan is not None:
            return _padded_attention(queries, keys, values, plan, scale)
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
    window-carrying mask below) to winattn with the layer's window and scale; padding masks of a
    batch (create_causal_mask with left_padding or right_padding, what mlx-lm's batched caches
    build) to winattn's varlen path once the mask is checked to be the band over one run of real
    keys per row (padded query rows then get 0, where MLX computes values no real token reads);
    and everything else (a hole among the real keys, a rotating cache's rolled layout, attention
    sinks, a quantized cache) to the original mx.fast.scaled_dot_product_attention, or raises with
    strict=True. It also replaces create_attention_mask so that, without a cache (training), a
    sliding layer's mask is a small SlidingWindowMask instead of a dense [N, N] array.

    mlx-lm's trainer (mlx_lm.tuner.trainer, 0.32) pads its batches on the right and passes no mask
    at all (causality keeps the padding away from real tokens; the loss masks it with the
    lengths), so its padded batches are plain causal and sliding calls and all go to winattn.

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

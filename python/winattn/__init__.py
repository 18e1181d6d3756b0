"""winattn for Python: exact attention with sliding windows, forward and backward, on numpy
arrays (this module), PyTorch tensors (winattn.torch) and more.

Arrays are [B, H, N, D] (layout="bhnd", default) or [B, N, H, D] (layout="bnhd"), or for packed
batches of sequences of different lengths (attention_varlen) [T, H, D]; q has Hq heads, k and v
Hkv heads with Hq % Hkv == 0 (grouped-query attention). window=(left, right) is FlashAttention's
convention, bottom-right aligned, -1 = unbounded: (-1, -1) full, (-1, 0) causal, (W-1, 0) a
sliding window of W keys including self (Gemma's sliding_window=W). See the README's table for
other libraries' conventions.
"""
import ctypes
import threading

import numpy as np

from ._lib import (WA_BF16, WA_DEVICE_CPU, WA_F16, WA_F32, Context, Tensor, Varlen, WinattnError, desc, int_arg, lib,
                   require_varlen)

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "cu_seqlens_arg",
           "WinattnError", "version"]

try:
    import ml_dtypes
    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # bf16 arrays need ml_dtypes; f32/f16 work without it
    _BF16 = None


def version():
    """the library's version (wa_version(), from include/winattn.h), which is the package's"""
    return lib.wa_version().decode()


# one source: include/winattn.h's WINATTN_VERSION_*, which python/setup.py also reads for the
# package's metadata (python/tests/test_version.py checks that they agree)
__version__ = version()


_ctx = None
_ctx_lock = threading.Lock()


def _context():
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            _ctx = Context()
        return _ctx


def _dtype_code(dt):
    if dt == np.float32:
        return WA_F32
    if dt == np.float16:
        return WA_F16
    if _BF16 is not None and dt == _BF16:
        return WA_BF16
    raise TypeError("winattn: dtype %s not supported (float32, float16, or bfloat16 via ml_dtypes)" % dt)


def _view(a, name, layout):
    """A wa_tensor describing array a without copying (only a head dim that is not unit-stride
    forces a copy)."""
    if not isinstance(a, np.ndarray):
        raise TypeError("winattn: %s must be a numpy array, got %s" % (name, type(a).__name__))
    if a.ndim != 4:
        raise ValueError("winattn: %s must be 4-d (%s), got shape %s" % (name, layout, a.shape))
    if a.strides[3] != a.itemsize or any(s % a.itemsize or s < 0 for s in a.strides):
        a = np.ascontiguousarray(a)
    t = Tensor()
    t.data = a.ctypes.data
    t.dtype = _dtype_code(a.dtype)
    t.device = WA_DEVICE_CPU
    st = [s // a.itemsize for s in a.strides]
    if layout == "bhnd":
        order = (0, 1, 2, 3)
    elif layout == "bnhd":
        order = (0, 2, 1, 3)
    else:
        raise ValueError("winattn: layout must be 'bhnd' or 'bnhd', got %r" % (layout,))
    for i, ax in enumerate(order):
        t.shape[i] = a.shape[ax]
        t.stride[i] = st[ax]
    return t, a


def _lse_tensor(lse):
    t = Tensor()
    t.data = lse.ctypes.data
    t.dtype = WA_F32
    t.device = WA_DEVICE_CPU
    t.shape[:] = [lse.shape[0], lse.shape[1], lse.shape[2], 1]
    t.stride[:] = [lse.strides[0] // 4, lse.strides[1] // 4, lse.strides[2] // 4, 1]
    return t


def attention(q, k, v, window=(-1, -1), causal=False, scale=None, softcap=0.0, return_lse=False, layout="bhnd"):
    """o = softmax(scale * q k^T, masked to the window) v, computed by winattn's tiled kernels.
    Returns o (like q), and lse (float32 [B, Hq, Nq], natural log) when return_lse."""
    d = desc(window, causal, scale, softcap)
    tq, q = _view(q, "q", layout)
    tk, k = _view(k, "k", layout)
    tv, v = _view(v, "v", layout)
    o = np.empty(q.shape, dtype=q.dtype)
    to, _ = _view(o, "o", layout)
    lse = np.empty((tq.shape[0], tq.shape[1], tq.shape[2]), dtype=np.float32)
    tl = _lse_tensor(lse)
    _context().call(lib.wa_forward, ctypes.byref(d), ctypes.byref(tq), ctypes.byref(tk), ctypes.byref(tv),
                    ctypes.byref(to), ctypes.byref(tl))
    return (o, lse) if return_lse else o


def attention_backward(q, k, v, o, lse, do, window=(-1, -1), causal=False, scale=None, softcap=0.0, layout="bhnd"):
    """Gradients (dq, dk, dv) of attention() given its output o, its lse and the incoming
    gradient do. With GQA, dk and dv sum over each group's query heads."""
    d = desc(window, causal, scale, softcap)
    tq, q = _view(q, "q", layout)
    tk, k = _view(k, "k", layout)
    tv, v = _view(v, "v", layout)
    to, o = _view(o, "o", layout)
    tg, do = _view(do, "do", layout)
    lse = np.ascontiguousarray(lse, dtype=np.float32)
    if lse.ndim != 3:
        raise ValueError("winattn: lse must be 3-d [B, Hq, Nq], got shape %s" % (lse.shape,))
    tl = _lse_tensor(lse)
    dq, dk, dv = np.empty(q.shape, q.dtype), np.empty(k.shape, k.dtype), np.empty(v.shape, v.dtype)
    tdq, _ = _view(dq, "dq", layout)
    tdk, _ = _view(dk, "dk", layout)
    tdv, _ = _view(dv, "dv", layout)
    _context().call(lib.wa_backward, ctypes.byref(d), ctypes.byref(tq), ctypes.byref(tk), ctypes.byref(tv),
                    ctypes.byref(to), ctypes.byref(tl), ctypes.byref(tg), ctypes.byref(tdq), ctypes.byref(tdk),
                    ctypes.byref(tdv))
    return dq, dk, dv


# ---- packed variable-length batches ----

_INT32_MAX = 2 ** 31 - 1


def cu_seqlens_arg(cu, name, T):
    """cu as a contiguous int32 array of B + 1 offsets that start at 0, never decrease and end at T
    (the token rows of the tensors it indexes), with a ValueError (TypeError for a non-integer
    dtype) that names what is wrong. Returns (array, per-sequence lengths as int64)."""
    a = np.asarray(cu)
    if a.dtype.kind not in "iu":
        raise TypeError("winattn: %s must hold integers (int32, as flash_attn_varlen_func takes), got dtype %s"
                        % (name, a.dtype))
    if a.ndim != 1 or a.size < 1:
        raise ValueError("winattn: %s must be 1-d with B + 1 >= 1 entries, got shape %s" % (name, a.shape))
    if a.min() < 0 or a.max() > _INT32_MAX:
        raise ValueError("winattn: %s holds %d, outside the int32 offsets 0..%d"
                         % (name, a.min() if a.min() < 0 else a.max(), _INT32_MAX))
    a = np.ascontiguousarray(a, dtype=np.int32)
    lens = np.diff(a.astype(np.int64))
    if a[0] != 0:
        raise ValueError("winattn: %s[0] = %d, must be 0" % (name, a[0]))
    if (lens < 0).any():
        b = int(np.argmax(lens < 0))
        raise ValueError("winattn: %s decreases at entry %d (%d after %d)" % (name, b + 1, a[b + 1], a[b]))
    if a[-1] != T:
        raise ValueError("winattn: %s[-1] = %d, must equal the %d token rows of the tensors" % (name, a[-1], T))
    return a, lens


def _max_seqlen(given, lens, name):
    longest = int(lens.max()) if lens.size else 0
    if given is None:
        return longest
    given = int_arg(given, name, 0, _INT32_MAX)
    if given < longest:
        raise ValueError("winattn: %s = %d, but a sequence has %d rows" % (name, given, longest))
    return given


def _thd(a, name):
    """A varlen wa_tensor [1, H, T, D] describing array a [T, H, D] without copying."""
    if not isinstance(a, np.ndarray):
        raise TypeError("winattn: %s must be a numpy array, got %s" % (name, type(a).__name__))
    if a.ndim != 3:
        raise ValueError("winattn: %s must be 3-d [T, H, D] (tokens of all sequences, heads, head dim), got shape %s"
                         % (name, a.shape))
    if a.strides[2] != a.itemsize or any(s % a.itemsize or s < 0 for s in a.strides):
        a = np.ascontiguousarray(a)
    t = Tensor()
    t.data = a.ctypes.data
    t.dtype = _dtype_code(a.dtype)
    t.device = WA_DEVICE_CPU
    st = [s // a.itemsize for s in a.strides]
    t.shape[:] = [1, a.shape[1], a.shape[0], a.shape[2]]
    t.stride[:] = [0, st[1], st[0], 1]  # the batch of one is never stepped over
    return t, a


def _lse_varlen(lse):
    """lse [Hq, Tq] float32 as [1, Hq, Tq, 1]"""
    t = Tensor()
    t.data = lse.ctypes.data
    t.dtype = WA_F32
    t.device = WA_DEVICE_CPU
    t.shape[:] = [1, lse.shape[0], lse.shape[1], 1]
    t.stride[:] = [0, lse.strides[0] // 4, lse.strides[1] // 4, 1]
    return t


def _varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    require_varlen()
    cq, lq = cu_seqlens_arg(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    ck, lk = cu_seqlens_arg(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    if cq.size != ck.size:
        raise ValueError("winattn: cu_seqlens_q has %d entries and cu_seqlens_k %d; both must be B + 1"
                         % (cq.size, ck.size))
    seqs = Varlen()
    seqs.batch = cq.size - 1
    seqs.cu_seqlens_q, seqs.cu_seqlens_k = cq.ctypes.data, ck.ctypes.data
    seqs.max_seqlen_q = _max_seqlen(max_seqlen_q, lq, "max_seqlen_q")
    seqs.max_seqlen_k = _max_seqlen(max_seqlen_k, lk, "max_seqlen_k")
    return seqs, (cq, ck)  # the arrays must outlive the call


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, window=(-1, -1),
                     causal=False, scale=None, softcap=0.0, return_lse=False):
    """Attention over a packed batch of sequences of different lengths (FlashAttention's
    flash_attn_varlen_func layout): q [Tq, Hq, D] and k, v [Tk, Hkv, D] hold the B sequences end to
    end; sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and key rows
    cu_seqlens_k[b]:cu_seqlens_k[b+1] (B + 1 integer offsets each, starting at 0, ending at Tq and
    Tk) and attends only within itself, with the window bottom-right aligned per sequence, as if it
    were called alone. max_seqlen_q/_k: the longest sequence (computed from the offsets if None; an
    upper bound is fine). Returns o like q, and lse (float32 [Hq, Tq]) when return_lse."""
    d = desc(window, causal, scale, softcap)
    tq, q = _thd(q, "q")
    tk, k = _thd(k, "k")
    tv, v = _thd(v, "v")
    seqs, keep = _varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o = np.empty(q.shape, dtype=q.dtype)
    to, _ = _thd(o, "o")
    lse = np.empty((q.shape[1], q.shape[0]), dtype=np.float32)
    tl = _lse_varlen(lse)
    _context().call(lib.wa_forward_varlen, ctypes.byref(d), ctypes.byref(seqs), ctypes.byref(tq), ctypes.byref(tk),
                    ctypes.byref(tv), ctypes.byref(to), ctypes.byref(tl))
    return (o, lse) if return_lse else o


def attention_varlen_backward(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                              window=(-1, -1), causal=False, scale=None, softcap=0.0):
    """Gradients (dq, dk, dv) of attention_varlen() given its o, its lse [Hq, Tq] and the incoming
    gradient do [Tq, Hq, D]."""
    d = desc(window, causal, scale, softcap)
    tq, q = _thd(q, "q")
    tk, k = _thd(k, "k")
    tv, v = _thd(v, "v")
    to, o = _thd(o, "o")
    tg, do = _thd(do, "do")
    lse = np.ascontiguousarray(lse, dtype=np.float32)
    if lse.ndim != 2:
        raise ValueError("winattn: lse must be 2-d [Hq, Tq], got shape %s" % (lse.shape,))
    tl = _lse_varlen(lse)
    seqs, keep = _varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dq, dk, dv = np.empty(q.shape, q.dtype), np.empty(k.shape, k.dtype), np.empty(v.shape, v.dtype)
    tdq, _ = _thd(dq, "dq")
    tdk, _ = _thd(dk, "dk")
    tdv, _ = _thd(dv, "dv")
    _context().call(lib.wa_backward_varlen, ctypes.byref(d), ctypes.byref(seqs), ctypes.byref(tq), ctypes.byref(tk),
                    ctypes.byref(tv), ctypes.byref(to), ctypes.byref(tl), ctypes.byref(tg), ctypes.byref(tdq),
                    ctypes.byref(tdk), ctypes.byref(tdv))
    return dq, dk, dv

"""winattn for Python: exact attention with sliding windows, forward and backward, on numpy
arrays (this module), PyTorch tensors (winattn.torch) and more.

Arrays are [B, H, N, D] (layout="bhnd", default) or [B, N, H, D] (layout="bnhd"); q has Hq
heads, k and v Hkv heads with Hq % Hkv == 0 (grouped-query attention). window=(left, right) is
FlashAttention's convention, bottom-right aligned, -1 = unbounded: (-1, -1) full, (-1, 0) causal,
(W-1, 0) a sliding window of W keys including self (Gemma's sliding_window=W). See the README's
table for other libraries' conventions.
"""
import ctypes
import threading

import numpy as np

from ._lib import WA_BF16, WA_DEVICE_CPU, WA_F16, WA_F32, Context, Tensor, WinattnError, desc, lib

__all__ = ["attention", "attention_backward", "WinattnError", "version"]

try:
    import ml_dtypes
    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # bf16 arrays need ml_dtypes; f32/f16 work without it
    _BF16 = None


def version():
    return lib.wa_version().decode()


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
    if a.strides[3] != a.itemsize or any(s % a.itemsize for s in a.strides):
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

"""ctypes view of include/winattn.h: the structs, the entry points, and the loaded library.

The shared library ships inside the package (copied by setup.py from the repository's
`make lib`); WINATTN_LIBRARY in the environment points elsewhere (a build tree, say).
"""
import ctypes
import math
import operator
import os
import threading

WA_F32, WA_F16, WA_BF16 = 0, 1, 2
WA_DEVICE_CPU, WA_DEVICE_CUDA = 0, 1
WA_ALGO_TILED, WA_ALGO_DENSE = 0, 1
STATUS_NAMES = ["ok", "invalid argument", "bad shape", "bad stride", "bad dtype", "bad device", "unsupported",
                "out of memory", "CUDA error"]


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int), ("device", ctypes.c_int),
                ("shape", ctypes.c_int64 * 4), ("stride", ctypes.c_int64 * 4)]


class AttnDesc(ctypes.Structure):
    _fields_ = [("scale", ctypes.c_float), ("softcap", ctypes.c_float), ("window_left", ctypes.c_int64),
                ("window_right", ctypes.c_int64)]


class Varlen(ctypes.Structure):
    """wa_varlen: the offsets are device pointers for CUDA tensors, so plain addresses here."""
    _fields_ = [("batch", ctypes.c_int64), ("cu_seqlens_q", ctypes.c_void_p), ("cu_seqlens_k", ctypes.c_void_p),
                ("max_seqlen_q", ctypes.c_int64), ("max_seqlen_k", ctypes.c_int64)]


class ContextParams(ctypes.Structure):
    _fields_ = [("threads", ctypes.c_int), ("tile_q", ctypes.c_int), ("tile_k", ctypes.c_int),
                ("algorithm", ctypes.c_int), ("cuda_stream", ctypes.c_void_p), ("alloc", ctypes.c_void_p),
                ("free", ctypes.c_void_p), ("alloc_user", ctypes.c_void_p), ("cuda_deterministic", ctypes.c_int)]


def _find_library():
    env = os.environ.get("WINATTN_LIBRARY")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(here, "libwinattn.so"),
                 os.path.join(here, "..", "..", "build", "libwinattn.so")):  # a source checkout
        if os.path.exists(cand):
            return cand
    raise ImportError("winattn: libwinattn.so not found; install with `pip install ./python` from a clone, "
                      "or set WINATTN_LIBRARY")


path = _find_library()  # the library loaded, where winattn.torch also looks for its C++ module
lib = ctypes.CDLL(path)
P = ctypes.POINTER
lib.wa_context_create.argtypes = [P(ContextParams), P(ctypes.c_void_p)]
lib.wa_context_create.restype = ctypes.c_int
lib.wa_context_destroy.argtypes = [ctypes.c_void_p]
lib.wa_context_destroy.restype = None
lib.wa_forward.argtypes = [ctypes.c_void_p, P(AttnDesc), P(Tensor), P(Tensor), P(Tensor), P(Tensor), P(Tensor)]
lib.wa_forward.restype = ctypes.c_int
lib.wa_backward.argtypes = [ctypes.c_void_p, P(AttnDesc)] + [P(Tensor)] * 9
lib.wa_backward.restype = ctypes.c_int
# A library older than 0.3 has no varlen entry points; the varlen bindings then raise WinattnError.
HAS_VARLEN = hasattr(lib, "wa_forward_varlen") and hasattr(lib, "wa_backward_varlen")
if HAS_VARLEN:
    lib.wa_forward_varlen.argtypes = [ctypes.c_void_p, P(AttnDesc), P(Varlen)] + [P(Tensor)] * 5
    lib.wa_forward_varlen.restype = ctypes.c_int
    lib.wa_backward_varlen.argtypes = [ctypes.c_void_p, P(AttnDesc), P(Varlen)] + [P(Tensor)] * 9
    lib.wa_backward_varlen.restype = ctypes.c_int
lib.wa_last_error.restype = ctypes.c_char_p
lib.wa_version.restype = ctypes.c_char_p
lib.wa_cpu_kernels.restype = ctypes.c_char_p
lib.wa_device_available.argtypes = [ctypes.c_int]
lib.wa_device_available.restype = ctypes.c_int


class WinattnError(RuntimeError):
    """A winattn call failed; the message is the library's one-line explanation."""


def require_varlen():
    if not HAS_VARLEN:
        raise WinattnError("winattn: this libwinattn (%s) has no wa_forward_varlen; rebuild it from a newer checkout"
                           % lib.wa_version().decode())


def check(status):
    if status != 0:
        name = STATUS_NAMES[status] if 0 <= status < len(STATUS_NAMES) else "status %d" % status
        raise WinattnError("winattn: %s: %s" % (name, lib.wa_last_error().decode()))


class Context:
    """A wa_context: the CPU thread pool, or a CUDA stream and the backward workspace the library
    keeps for it. Reused across calls. The C library lets one thread use a context at a time and
    ctypes releases the GIL during a call, so calls go through call(), which holds a lock."""

    def __init__(self, threads=0, cuda_stream=None, cuda_deterministic=False):
        params = ContextParams()
        params.threads = int_arg(threads, "threads", 0, 2 ** 31 - 1)
        params.cuda_stream = cuda_stream
        params.cuda_deterministic = int(bool(cuda_deterministic))
        self.lock = threading.Lock()
        self.ptr = ctypes.c_void_p()
        check(lib.wa_context_create(ctypes.byref(params), ctypes.byref(self.ptr)))

    def call(self, fn, *args):
        """check(fn(context, *args)) with the context to itself; False if it was closed meanwhile"""
        with self.lock:
            if not self.ptr:
                return False
            check(fn(self.ptr, *args))
            return True

    def close(self):
        """destroy the wa_context (its thread pool, its GPU workspace) once no call is using it"""
        with self.lock:
            if self.ptr and lib is not None:
                lib.wa_context_destroy(self.ptr)
            self.ptr = None

    def __del__(self):
        if getattr(self, "ptr", None) and lib is not None:
            lib.wa_context_destroy(self.ptr)
            self.ptr = None


INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1


def int_arg(x, what, lo=INT64_MIN, hi=INT64_MAX):
    """x as a Python int in [lo, hi] (by default int64, what ctypes' c_int64 holds without
    wrapping); TypeError for a non-integer (a float is not truncated, a bool is not a number),
    ValueError outside the range."""
    if isinstance(x, bool) or not hasattr(type(x), "__index__"):
        raise TypeError("winattn: %s must be an integer, got %r" % (what, x))
    v = operator.index(x)
    if not lo <= v <= hi:
        raise ValueError("winattn: %s = %d is outside [%d, %d]" % (what, v, lo, hi))
    return v


def float32_arg(x, what):
    """x as a Python float that a C float holds: finite, not overflowing to inf and, if nonzero,
    not underflowing to 0 (for scale and softcap 0 means "default" or "off", so a tiny value
    rounding to 0 would silently change the computation)."""
    try:
        v = float(x)
    except OverflowError:
        v = math.inf
    # plain comparisons (torch.compile traces them): |v| < 2^128 - 2^103 rounds to a finite
    # float32, |v| > 2^-150 to a nonzero one
    if not (abs(v) < 2.0 ** 128 - 2.0 ** 103 and (v == 0 or abs(v) > 2.0 ** -150)):
        raise ValueError("winattn: %s = %.6g is not 0 or a finite float32 that does not round to 0" % (what, v))
    return v


def window_args(window, causal, scale, softcap):
    """Validated (left, right, scale, softcap) as plain Python numbers (scale 0.0 = 1/sqrt(D));
    plain values so torch.compile can trace the callers."""
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError("winattn: window must be a pair (left, right), got %r" % (window,)) from None
    left, right = int_arg(left, "window left"), int_arg(right, "window right")
    if causal:
        if right not in (-1, 0):
            raise ValueError("causal=True means window right = 0, but window=%r" % (window,))
        right = 0
    if left < -1 or right < -1:
        raise ValueError("window %r: each side must be -1 (unbounded) or >= 0" % (window,))
    scale = 0.0 if scale is None else float32_arg(scale, "scale")
    softcap = float32_arg(softcap, "softcap")
    if softcap < 0:
        raise ValueError("winattn: softcap = %r must be 0 (off) or positive" % (softcap,))
    return left, right, scale, softcap


def desc(window, causal, scale, softcap):
    d = AttnDesc()
    d.window_left, d.window_right, d.scale, d.softcap = window_args(window, causal, scale, softcap)
    return d

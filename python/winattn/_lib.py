"""ctypes view of include/winattn.h: the structs, the entry points, and the loaded library.

The shared library ships inside the package (copied by setup.py from the repository's
`make lib`); WINATTN_LIBRARY in the environment points elsewhere (a build tree, say).
"""
import ctypes
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


lib = ctypes.CDLL(_find_library())
P = ctypes.POINTER
lib.wa_context_create.argtypes = [P(ContextParams), P(ctypes.c_void_p)]
lib.wa_context_create.restype = ctypes.c_int
lib.wa_context_destroy.argtypes = [ctypes.c_void_p]
lib.wa_context_destroy.restype = None
lib.wa_forward.argtypes = [ctypes.c_void_p, P(AttnDesc), P(Tensor), P(Tensor), P(Tensor), P(Tensor), P(Tensor)]
lib.wa_forward.restype = ctypes.c_int
lib.wa_backward.argtypes = [ctypes.c_void_p, P(AttnDesc)] + [P(Tensor)] * 9
lib.wa_backward.restype = ctypes.c_int
lib.wa_last_error.restype = ctypes.c_char_p
lib.wa_version.restype = ctypes.c_char_p
lib.wa_cpu_kernels.restype = ctypes.c_char_p
lib.wa_device_available.argtypes = [ctypes.c_int]
lib.wa_device_available.restype = ctypes.c_int


class WinattnError(RuntimeError):
    """A winattn call failed; the message is the library's one-line explanation."""


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
        params.threads = threads
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


def window_args(window, causal, scale, softcap):
    """Validated (left, right, scale, softcap) as plain Python numbers (scale 0.0 = 1/sqrt(D));
    plain values so torch.compile can trace the callers."""
    left, right = window
    if causal:
        if right not in (-1, 0):
            raise ValueError("causal=True means window right = 0, but window=%r" % (window,))
        right = 0
    if left < -1 or right < -1:
        raise ValueError("window %r: each side must be -1 (unbounded) or >= 0" % (window,))
    return int(left), int(right), 0.0 if scale is None else float(scale), float(softcap)


def desc(window, causal, scale, softcap):
    d = AttnDesc()
    d.window_left, d.window_right, d.scale, d.softcap = window_args(window, causal, scale, softcap)
    return d

"""winattn for PyTorch: `winattn.torch.attention(q, k, v, window=..., causal=..., scale=..., softcap=...)`,
a torch.library custom op with autograd, for CPU tensors and CUDA tensors (on the current
stream), with fake implementations so torch.compile can trace it.

q [B, Hq, N, D], k and v [B, Hkv, N, D] (SDPA's layout; any strides with a unit head-dim stride);
Hq % Hkv == 0 with the same head grouping as F.scaled_dot_product_attention(..., enable_gqa=True).
window=(left, right) is bottom-right aligned (FlashAttention's rule); note that SDPA's is_causal
is top-left aligned, which differs when Nq != Nk.

`winattn.torch.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`
takes packed batches of sequences of different lengths in flash_attn_varlen_func's layout and
argument order: q [Tq, Hq, D], k and v [Tk, Hkv, D], int32 offsets on the tensors' device.
"""
import ctypes
import glob
import os
import struct
import threading
import warnings

import torch

if not hasattr(torch.library, "custom_op"):  # ImportError, so that callers treat it like a missing torch
    raise ImportError("winattn.torch needs PyTorch >= 2.4 (torch.library.custom_op); this is %s" % torch.__version__)

from . import _lib  # noqa: E402
from ._lib import WA_BF16, WA_DEVICE_CPU, WA_DEVICE_CUDA, WA_F16, WA_F32, Context, Tensor, lib  # noqa: E402
from ._lib import STATUS_NAMES, WinattnError  # noqa: E402
from ._ext_files import module_path as _ext_module_path, source_hash as _ext_source_hash  # noqa: E402

__all__ = ["attention", "attention_varlen", "release_workspace", "eager_path"]

_DTYPES = {torch.float32: WA_F32, torch.float16: WA_F16, torch.bfloat16: WA_BF16}
_contexts = {}  # one per CPU, or per (GPU, stream, deterministic): the library's contexts
_contexts_lock = threading.Lock()


# the current stream's handle as an int: torch's own raw accessor (what its compiled code calls) when
# it has one, a fifth of the cost of building a torch.cuda.Stream object each call
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _context_for(t, deterministic=False):
    device = t.device
    if device.type == "cpu":
        key = ("cpu",)
    elif device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = _raw_stream(index) if _raw_stream else torch.cuda.current_stream(device).cuda_stream
        key = ("cuda", index, stream, deterministic)
    else:
        raise ValueError("winattn: tensors on %s are not supported (cpu or cuda)" % device)
    c = _contexts.get(key)  # the common case without the lock (a dict read is atomic)
    if c is not None:
        return c
    with _contexts_lock:
        if key not in _contexts:
            if key[0] == "cpu":
                _contexts[key] = Context(threads=torch.get_num_threads())
            else:
                with torch.cuda.device(t.device):
                    _contexts[key] = Context(threads=1, cuda_stream=key[2], cuda_deterministic=deterministic)
        return _contexts[key]


def _call(t, deterministic, fn, *args):
    """fn(context, *args) on t's context (made again if release_workspace closed it meanwhile)"""
    while not _context_for(t, deterministic).call(fn, *args):
        pass


def release_workspace():
    """Frees the GPU memory winattn keeps between calls: on CUDA each (device, stream) context keeps
    the backward's workspace (the largest so far; at head dims 64 and 128 it includes an f32 dQ
    accumulator, B*Hq*N*D floats) outside PyTorch's allocator, so torch.cuda.empty_cache() does not
    free it. The contexts are made again by the next call."""
    with _contexts_lock:
        contexts = list(_contexts.values())
        _contexts.clear()
    for c in contexts:
        c.close()
    if _ext is not None:
        _ext.release_workspace()


# wa_tensor's bytes (data, dtype, device, shape[4], stride[4]) packed in one call and copied into the
# struct: a third of the host time of filling its fields and arrays one by one, and this runs 14
# times a forward + backward
_WA_TENSOR = struct.Struct("@Pii4q4q")
assert _WA_TENSOR.size == ctypes.sizeof(Tensor), "struct wa_tensor's layout"
_pack_tensor, _tensor_from_bytes = _WA_TENSOR.pack, Tensor.from_buffer_copy


def _wa(t, name):
    """q, k, v, o, do or a gradient [B, H, N, D] as the library's tensor"""
    dt = _DTYPES.get(t.dtype)
    if dt is None:
        raise TypeError("winattn: %s has dtype %s; float32, float16 or bfloat16 are supported" % (name, t.dtype))
    if t.dim() != 4:
        raise ValueError("winattn: %s must be [B, H, N, D], got shape %s" % (name, tuple(t.shape)))
    device = WA_DEVICE_CUDA if t.is_cuda else WA_DEVICE_CPU  # _context_for refuses other devices
    return _tensor_from_bytes(_pack_tensor(t.data_ptr(), dt, device, *t.shape, *t.stride()))


def _wa_lse(t):
    """lse, float32 [B, H, N] (made here, never the caller's), as the library's [B, H, N, 1]"""
    device = WA_DEVICE_CUDA if t.is_cuda else WA_DEVICE_CPU
    return _tensor_from_bytes(_pack_tensor(t.data_ptr(), WA_F32, device, *t.shape, 1, *t.stride(), 1))


def _forward_args(q, k, v, o, lse):
    """wa_forward's tensors, in its order, as the library's"""
    return [_wa(q, "q"), _wa(k, "k"), _wa(v, "v"), _wa(o, "o"), _wa_lse(lse)]


def _backward_args(q, k, v, o, lse, do, dq, dk, dv):
    """wa_backward's tensors, in its order, as the library's"""
    return _forward_args(q, k, v, o, lse) + [_wa(do, "do"), _wa(dq, "dq"), _wa(dk, "dk"), _wa(dv, "dv")]


def _unit_stride(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _desc(left, right, scale, softcap):
    d = _lib.AttnDesc()
    d.scale, d.softcap, d.window_left, d.window_right = scale, softcap, left, right
    return d


# The ops go onto the dispatcher directly (Library.define, one Python kernel for CPU and for CUDA
# tensors, register_fake for tracing, register_autograd): torch.library.custom_op wraps every call
# in more Python. On the H200 machine a forward + backward through the two ops took 358-384 us of
# host time this way against 412-449 us as custom_op (bench/binding_overhead.py --device cuda,
# docs/gpu-peers.md); the library's own host work is 30-45 us of it.
_LIB = torch.library.Library("winattn", "DEF")


def _define(name, schema, kernel, fake):
    _LIB.define(name + schema)
    for key in ("CPU", "CUDA"):
        _LIB.impl(name, kernel, key)
    torch.library.register_fake("winattn::" + name, fake, lib=_LIB)
    return getattr(torch.ops.winattn, name).default


def _forward_kernel(q, k, v, left, right, scale, softcap, deterministic):
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    args = _forward_args(q, k, v, o, lse)
    d = _desc(left, right, scale, softcap)
    _call(q, False, lib.wa_forward, ctypes.byref(d), *[ctypes.byref(a) for a in args])
    return o, lse


def _forward_fake(q, k, v, left, right, scale, softcap, deterministic):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=torch.float32)


_forward = _define("forward", "(Tensor q, Tensor k, Tensor v, int left, int right, float scale, float softcap, "
                   "bool deterministic) -> (Tensor, Tensor)", _forward_kernel, _forward_fake)


def _backward_kernel(q, k, v, o, lse, do, left, right, scale, softcap, deterministic):
    q, k, v, o, do = (_unit_stride(t) for t in (q, k, v, o, do))
    lse = lse.contiguous()
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    args = _backward_args(q, k, v, o, lse, do, dq, dk, dv)
    d = _desc(left, right, scale, softcap)
    _call(q, deterministic, lib.wa_backward, ctypes.byref(d), *[ctypes.byref(a) for a in args])
    return dq, dk, dv


def _backward_fake(q, k, v, o, lse, do, left, right, scale, softcap, deterministic):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


_backward_op = _define("backward", "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, int left, "
                       "int right, float scale, float softcap, bool deterministic) -> (Tensor, Tensor, Tensor)",
                       _backward_kernel, _backward_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, left, right, scale, softcap, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.params = (left, right, scale, softcap, deterministic)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _backward_op(q, k, v, o, lse, do, *ctx.params)
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd("winattn::forward", _backward, setup_context=_setup_context, lib=_LIB)


# ---- the C++ eager path ----
# python/winattn/_torch_ext.cpp: the eager path's autograd functions in C++, less than half its host
# time per call (docs/gpu-peers.md). Optional: built by `make torch-ext` for the torch it runs with,
# into BUILD/torch_ext/torch-VERSION/ beside the library, and used only when it was built for the
# torch running now; otherwise the Python eager path below does the same work. WINATTN_TORCH_EXT=0
# turns it off; WINATTN_TORCH_EXT=PATH names the module file (then failing to load it is an error).

def _load_ext():
    setting = os.environ.get("WINATTN_TORCH_EXT", "")
    if setting == "0":
        return None
    if setting:
        path = setting
    else:
        # beside the library loaded first (a build folder's fresh module before an installed copy)
        homes = [os.path.dirname(os.path.abspath(_lib.path)), os.path.dirname(os.path.abspath(__file__))]
        found = [f for f in (_ext_module_path(h, torch.__version__) for h in homes) if os.path.exists(f)]
        if not found:
            others = sorted(set(os.path.basename(os.path.dirname(f)) for h in homes
                                for f in glob.glob(_ext_module_path(h, "*"))))
            if others:
                warnings.warn("winattn: the C++ path was built for %s, not torch %s; `make torch-ext` builds it "
                              "for this one. Using the Python path." % (", ".join(others), torch.__version__))
            return None
        path = found[0]
    import importlib.machinery
    import importlib.util
    try:
        spec = importlib.util.spec_from_file_location(
            __package__ + "._torch_ext", path, loader=importlib.machinery.ExtensionFileLoader(__package__ + "._torch_ext",
                                                                                              path))
        ext = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ext)
        if ext.torch_version != torch.__version__:
            raise ImportError("built for torch %s, running %s" % (ext.torch_version, torch.__version__))
        layout = tuple(ctypes.sizeof(c) for c in (Tensor, _lib.AttnDesc, _lib.ContextParams, _lib.Varlen))
        if tuple(ext.layout) != layout:
            raise ImportError("built against another winattn.h (struct sizes %s, the library's %s); `make torch-ext` "
                              "rebuilds it" % (tuple(ext.layout), layout))
        source = _ext_source_hash()
        if source is not None and ext.source_hash != source:
            raise ImportError("built from other sources than this checkout's winattn.h and _torch_ext.cpp; "
                              "`make torch-ext` rebuilds it")
        names = ["wa_context_create", "wa_context_destroy", "wa_forward", "wa_backward", "wa_last_error"]
        names += ["wa_forward_varlen", "wa_backward_varlen"] if _lib.HAS_VARLEN else []
        ext.bind({n: ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names}, WinattnError,
                 STATUS_NAMES)
    except Exception as e:  # anything: the Python path does the same work
        if setting:
            raise ImportError("winattn: WINATTN_TORCH_EXT=%s: %s" % (setting, e)) from None
        warnings.warn("winattn: %s does not load (%s); using the Python path" % (path, e))
        return None
    return ext


_ext = _load_ext()


def eager_path():
    """"C++" when eager calls take the C++ autograd functions (`make torch-ext`), else "Python"."""
    return "C++" if _ext is not None else "Python"


# ---- the eager path ----
# Called eagerly on plain tensors, attention() skips the dispatcher: an autograd.Function calls the
# same kernels (_forward_kernel, _backward_kernel) directly. Through the ops, autograd costs two
# trips from the dispatcher into Python per call plus register_autograd's wrapper, about twice the
# host time of this path (bench/binding_overhead.py, docs/gpu-peers.md). The ops stay the path
# whenever something must see them: torch.compile's tracing, tensor subclasses (FakeTensor,
# DTensor), dispatch or function modes (FlopCounterMode, `with torch.device(...)`), and torch.func
# transforms; the kernels and so the results are the same either way.

def _is_plain_eager(*tensors):
    """True when nothing but autograd needs to see the call: not tracing, no modes, no transforms,
    plain tensors on the CPU or a GPU (meta tensors take the ops, whose fake kernels give their
    shapes); the tensors are on one device (the callers check)"""
    return (not torch.compiler.is_compiling() and not _modes_active() and
            all(type(t) is torch.Tensor for t in tensors) and (tensors[0].is_cuda or tensors[0].is_cpu))


if all(hasattr(torch._C, f) for f in ("_len_torch_dispatch_stack", "_len_torch_function_stack",
                                        "_are_functorch_transforms_active")):
    def _modes_active():
        return bool(torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack() or
                    torch._C._are_functorch_transforms_active())
else:  # a torch without these probes: always through the ops
    def _modes_active():
        return True


def _eager_function(name, forward_kernel, setup_context, backward_kernel, n_inputs):
    """an autograd.Function that calls forward_kernel and, for the gradients of q, k and v,
    backward_kernel(q, k, v, o, lse, do, *saved offsets, *params) directly (setup_context saves
    q, k, v, o, lse and any offsets, and the parameters as ctx.params)"""
    class EagerFunction(torch.autograd.Function):
        # forward(ctx, ...) rather than a separate setup_context: with one, Function.apply binds its
        # arguments through inspect.signature on every call (a fifth of this path's host time)
        @staticmethod
        def forward(ctx, *inputs):
            output = forward_kernel(*inputs)
            setup_context(ctx, inputs, output)
            # no zero tensor filled for lse's gradient before every backward (it is not
            # differentiable and nothing reads it; the C++ path's run_backward says what it cost)
            ctx.set_materialize_grads(False)
            return output

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, do, dlse):
            if do is None:  # no gradient reached o: none for q, k, v
                return (None,) * n_inputs
            q, k, v, o, lse, *offsets = ctx.saved_tensors
            return tuple(backward_kernel(q, k, v, o, lse, do, *offsets, *ctx.params)) + (None,) * (n_inputs - 3)

    EagerFunction.__name__ = EagerFunction.__qualname__ = name
    return EagerFunction


_Attention = _eager_function("_Attention", _forward_kernel, _setup_context, _backward_kernel, 8)


def _run(op, eager_function, forward_kernel, ext_name, tensors, *params):
    """a forward (tensors, then params) on the path it needs: the registered op when something
    must see it; else the C++ module's function ext_name when it is loaded; else the eager
    autograd.Function when q, k or v want gradients, the kernel otherwise"""
    if not _is_plain_eager(*tensors):
        return op(*tensors, *params)
    ext = _ext
    if ext is not None:
        return getattr(ext, ext_name)(*tensors, *params)
    q, k, v = tensors[:3]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return eager_function.apply(*tensors, *params)
    return forward_kernel(*tensors, *params)


def attention(q, k, v, window=(-1, -1), causal=False, scale=None, softcap=0.0, return_lse=False,
              deterministic=False):
    """Exact attention with a (left, right) window; differentiable in q, k and v. On CUDA the
    backward adds dQ with f32 atomics at head dims 64 and 128 (and at every head dim when the
    tensors take the older kernels), so dq can differ in its last bits between runs;
    deterministic=True makes it bit-identical (slower; wa_context_params.cuda_deterministic)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError("winattn: %s must be a torch.Tensor" % name)
    if not (q.device == k.device == v.device):
        raise ValueError("winattn: q, k, v are on different devices (%s, %s, %s)" % (q.device, k.device, v.device))
    left, right, scale, softcap = _lib.window_args(window, causal, scale, softcap)
    o, lse = _run(_forward, _Attention, _forward_kernel, "attention", (q, k, v), left, right, scale, softcap,
                  bool(deterministic))
    return (o, lse) if return_lse else o


# ---- packed variable-length batches ----

def _wa_thd(t, name):
    """[T, H, D] as the varlen wa_tensor [1, H, T, D]; lse [H, T] as [1, H, T, 1]"""
    w = Tensor()
    w.data = t.data_ptr()
    w.device = WA_DEVICE_CPU if t.device.type == "cpu" else WA_DEVICE_CUDA
    if name == "lse":
        w.dtype = WA_F32
        w.shape[:] = [1, t.shape[0], t.shape[1], 1]
        w.stride[:] = [0, t.stride(0), t.stride(1), 1]
    else:
        if t.dtype not in _DTYPES:
            raise TypeError("winattn: %s has dtype %s; float32, float16 or bfloat16 are supported" % (name, t.dtype))
        w.dtype = _DTYPES[t.dtype]
        w.shape[:] = [1, t.shape[1], t.shape[0], t.shape[2]]
        w.stride[:] = [0, t.stride(1), t.stride(0), 1]  # the batch of one is never stepped over
    return w


def _seqs(cu_q, cu_k, max_q, max_k):
    seqs = _lib.Varlen()
    seqs.batch = cu_q.numel() - 1
    seqs.cu_seqlens_q, seqs.cu_seqlens_k = cu_q.data_ptr(), cu_k.data_ptr()
    seqs.max_seqlen_q, seqs.max_seqlen_k = max_q, max_k
    return seqs


def _forward_varlen_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, left, right, scale,
                           softcap, deterministic):
    _lib.require_varlen()
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    args = [_wa_thd(q, "q"), _wa_thd(k, "k"), _wa_thd(v, "v"), _wa_thd(o, "o"), _wa_thd(lse, "lse")]
    d = _desc(left, right, scale, softcap)
    seqs = _seqs(cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    _call(q, False, lib.wa_forward_varlen, ctypes.byref(d), ctypes.byref(seqs), *[ctypes.byref(a) for a in args])
    return o, lse


def _forward_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, left, right, scale, softcap,
                         deterministic):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


_forward_varlen = _define(
    "forward_varlen", "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k, int left, int right, float scale, float softcap, bool deterministic) -> (Tensor, Tensor)",
    _forward_varlen_kernel, _forward_varlen_fake)


def _backward_varlen_kernel(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, left, right,
                            scale, softcap, deterministic):
    _lib.require_varlen()
    q, k, v, o, do = (_unit_stride(t) for t in (q, k, v, o, do))
    lse = lse.contiguous()
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    args = [_wa_thd(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (o, "o"), (lse, "lse"), (do, "do"),
                                       (dq, "dq"), (dk, "dk"), (dv, "dv"))]
    d = _desc(left, right, scale, softcap)
    seqs = _seqs(cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    _call(q, deterministic, lib.wa_backward_varlen, ctypes.byref(d), ctypes.byref(seqs),
          *[ctypes.byref(a) for a in args])
    return dq, dk, dv


def _backward_fake_varlen(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, left, right,
                          scale, softcap, deterministic):
    return _backward_fake(q, k, v, o, lse, do, left, right, scale, softcap, deterministic)


_backward_varlen_op = _define(
    "backward_varlen", "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, int left, int right, float scale, float softcap, "
    "bool deterministic) -> (Tensor, Tensor, Tensor)", _backward_varlen_kernel, _backward_fake_varlen)


def _setup_context_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, left, right, scale, softcap, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.params = (max_q, max_k, left, right, scale, softcap, deterministic)
    ctx.mark_non_differentiable(lse)


def _backward_varlen(ctx, do, dlse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _backward_varlen_op(q, k, v, o, lse, do, cu_q, cu_k, *ctx.params)
    return (dq, dk, dv) + (None,) * 9


torch.library.register_autograd("winattn::forward_varlen", _backward_varlen, setup_context=_setup_context_varlen,
                                lib=_LIB)


_AttentionVarlen = _eager_function("_AttentionVarlen", _forward_varlen_kernel, _setup_context_varlen,
                                   _backward_varlen_kernel, 12)


def _max_seqlen_arg(x, name):
    if isinstance(x, torch.Tensor):  # reading it would be a device sync (and break CUDA graph capture)
        raise TypeError("winattn: %s must be a Python int, not a tensor (flash_attn_varlen_func takes an int too)"
                        % name)
    if isinstance(x, torch.SymInt):  # traced by torch.compile: the library checks it at run time
        return x
    return _lib.int_arg(x, name, 0, 2 ** 31 - 1)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window=(-1, -1), causal=False,
                     scale=None, softcap=0.0, return_lse=False, deterministic=False):
    """Exact attention over a packed batch of B sequences of different lengths, differentiable in q,
    k and v; the arguments in flash_attn_varlen_func's order. q [Tq, Hq, D], k and v [Tk, Hkv, D]
    hold the sequences end to end; cu_seqlens_q and cu_seqlens_k are int32 tensors of B + 1
    offsets on the tensors' device (sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    and key rows cu_seqlens_k[b]:cu_seqlens_k[b+1]); max_seqlen_q and max_seqlen_k are Python ints,
    the longest sequence (an upper bound is fine). Each sequence attends only within itself, its
    window bottom-right aligned as if it were called alone. Returns o [Tq, Hq, D] and, with
    return_lse, lse float32 [Hq, Tq].

    Nothing reads the offsets back to the host: on CUDA the call is asynchronous and CUDA-graph
    capturable. So on CUDA malformed offsets are not reported (the kernels clamp them, giving
    unspecified values but no access outside the tensors; include/winattn.h), while on the CPU
    the library checks them and raises WinattnError."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError("winattn: %s must be a torch.Tensor" % name)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError("winattn: %s must be 3-d [T, H, D] (tokens of all sequences, heads, head dim), got "
                             "shape %s" % (name, tuple(t.shape)))
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dtype != torch.int32:
            raise TypeError("winattn: %s must be int32 (as flash_attn_varlen_func takes), got %s" % (name, t.dtype))
        if t.dim() != 1 or t.numel() < 1:
            raise ValueError("winattn: %s must be 1-d with B + 1 >= 1 entries, got shape %s" % (name, tuple(t.shape)))
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError("winattn: cu_seqlens_q has %d entries and cu_seqlens_k %d; both must be B + 1"
                         % (cu_seqlens_q.numel(), cu_seqlens_k.numel()))
    devices = [t.device for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)]
    if any(d != devices[0] for d in devices):
        raise ValueError("winattn: q, k, v, cu_seqlens_q, cu_seqlens_k must be on one device, got %s"
                         % ", ".join(map(str, devices)))
    max_q = _max_seqlen_arg(max_seqlen_q, "max_seqlen_q")
    max_k = _max_seqlen_arg(max_seqlen_k, "max_seqlen_k")
    left, right, scale, softcap = _lib.window_args(window, causal, scale, softcap)
    _lib.require_varlen()
    o, lse = _run(_forward_varlen, _AttentionVarlen, _forward_varlen_kernel, "attention_varlen",
                  (q, k, v, cu_seqlens_q, cu_seqlens_k),
                  max_q, max_k, left, right, scale, softcap, bool(deterministic))
    return (o, lse) if return_lse else o

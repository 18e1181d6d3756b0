/* _torch_ext.cpp — winattn.torch's eager path in C++: attention and attention_varlen as
 * torch::autograd::Function s that call the library's forward and backward directly.
 *
 * Why: a forward + backward through the Python autograd.Function costs several hundred µs of host
 * time on a slow host (458 µs on the H200 machine, of which the library's own work is 41 µs;
 * docs/gpu-peers.md), most of it Python; the same calls from C++ take less than half of it. The
 * Python path stays the reference and the fallback: winattn.torch uses this module only when it
 * was built against the running torch (`make torch-ext`, python/build_torch_ext.py), and only on
 * the calls that the Python eager path would take (plain tensors, no tracing, no modes); the
 * registered ops keep serving torch.compile, subclasses and transforms. Both paths run the same
 * kernels with the same arguments, so their results are bit-identical (tests/test_python.py).
 *
 * The library is not linked: winattn.torch passes the addresses of the entry points of the copy
 * that winattn._lib loaded (bind()), so one copy of the library, with one set of contexts per
 * path, serves the process. No CUDA headers either: the current stream comes through c10's
 * device-generic interface, so one build serves CPU-only and CUDA builds of the same torch. */
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "winattn.h"

namespace py = pybind11;

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

/* the library's entry points, bound once at import to the copy winattn._lib loaded */
struct Entries {
    decltype(&wa_context_create) context_create = nullptr;
    decltype(&wa_context_destroy) context_destroy = nullptr;
    decltype(&wa_forward) forward = nullptr;
    decltype(&wa_backward) backward = nullptr;
    decltype(&wa_forward_varlen) forward_varlen = nullptr; /* null in a library without varlen */
    decltype(&wa_backward_varlen) backward_varlen = nullptr;
    decltype(&wa_last_error) last_error = nullptr;
} wa;
std::vector<std::string> status_names; /* winattn._lib.STATUS_NAMES, so messages read as the Python path's */
PyObject *winattn_error = nullptr;     /* winattn.WinattnError */

/* a failed library call; the translator registered below raises it as WinattnError */
struct LibraryError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

void check(wa_status st) {
    if (st == WA_OK) return;
    const size_t i = (size_t)st;
    const std::string name = i < status_names.size() ? status_names[i] : "status " + std::to_string((int)st);
    throw LibraryError("winattn: " + name + ": " + wa.last_error());
}

/* A wa_context and the lock that keeps it to one call at a time (the library's rule). Held by
 * shared_ptr: release_workspace() drops the table's references, and a context still in a call
 * is destroyed when that call lets go of it. */
struct Context {
    wa_context *ctx = nullptr;
    std::mutex busy;
    ~Context() {
        if (ctx) wa.context_destroy(ctx);
    }
};

std::mutex contexts_lock;
std::map<std::tuple<int, int, void *, bool>, std::shared_ptr<Context>> contexts;

/* The context for tensors on `device`, as winattn.torch's _context_for keys them: one for the
 * CPU (torch's thread count when it is made), one per GPU, stream and determinism. */
std::shared_ptr<Context> context_for(const at::Device &device, bool deterministic) {
    wa_context_params params{};
    if (device.is_cuda()) {
        const c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
        params.threads = 1;
        params.cuda_stream = cuda.getStream(device).native_handle();
        params.cuda_deterministic = deterministic ? 1 : 0;
    } else {
        params.threads = at::get_num_threads();
        deterministic = false;
    }
    const auto key = std::make_tuple((int)device.is_cuda(), (int)device.index(), params.cuda_stream, deterministic);
    std::lock_guard<std::mutex> guard(contexts_lock);
    auto &slot = contexts[key];
    if (!slot) {
        auto c = std::make_shared<Context>();
        check(wa.context_create(&params, &c->ctx));
        slot = std::move(c);
    }
    return slot;
}

/* run call(context) on the tensors' context, the GIL released while the library works when the
 * caller holds it (the forward, called from Python; the backward runs on autograd's threads) */
template <typename Call> void on_context(const at::Tensor &t, bool deterministic, Call call) {
    const at::OptionalDeviceGuard on(at::device_of(t)); /* the library launches on the current GPU */
    const bool has_gil = PyGILState_Check();
    std::unique_ptr<py::gil_scoped_release> no_gil;
    if (has_gil) no_gil = std::make_unique<py::gil_scoped_release>();
    const std::shared_ptr<Context> c = context_for(t.device(), deterministic);
    std::lock_guard<std::mutex> one_call(c->busy);
    check(call(c->ctx));
}

std::string shape_text(const at::Tensor &t) {
    std::string s = "(";
    for (int64_t i = 0; i < t.dim(); i++) s += (i ? ", " : "") + std::to_string(t.size(i));
    return s + (t.dim() == 1 ? ",)" : ")");
}

wa_dtype dtype_of(const at::Tensor &t, const char *name) {
    switch (t.scalar_type()) {
    case at::kBFloat16: return WA_BF16;
    case at::kHalf: return WA_F16;
    case at::kFloat: return WA_F32;
    default:
        throw py::type_error(std::string("winattn: ") + name + " has dtype torch." +
                             std::string(c10::getDtypeNames(t.scalar_type()).first) +
                             "; float32, float16 or bfloat16 are supported");
    }
}

wa_device wa_device_for(const at::Tensor &t) { return t.is_cuda() ? WA_DEVICE_CUDA : WA_DEVICE_CPU; }

/* q, k, v, o, do and the gradients [B, H, N, D] */
wa_tensor view(const at::Tensor &t, const char *name) {
    const wa_dtype dtype = dtype_of(t, name);
    if (t.dim() != 4)
        throw py::value_error(std::string("winattn: ") + name + " must be [B, H, N, D], got shape " + shape_text(t));
    wa_tensor w{t.data_ptr(), dtype, wa_device_for(t), {}, {}};
    for (int i = 0; i < 4; i++) w.shape[i] = t.size(i), w.stride[i] = t.stride(i);
    return w;
}

/* lse, f32 [B, H, N], as [B, H, N, 1] */
wa_tensor view_lse(const at::Tensor &lse) {
    wa_tensor w{lse.data_ptr(), WA_F32, wa_device_for(lse), {lse.size(0), lse.size(1), lse.size(2), 1},
                {lse.stride(0), lse.stride(1), lse.stride(2), 1}};
    return w;
}

/* packed [T, H, D] (3-d: winattn.torch checks) as the varlen [1, H, T, D]; the batch of one is never
 * stepped over */
wa_tensor view_thd(const at::Tensor &t, const char *name) {
    wa_tensor w{t.data_ptr(), dtype_of(t, name), wa_device_for(t), {1, t.size(1), t.size(0), t.size(2)},
                {0, t.stride(1), t.stride(0), 1}};
    return w;
}

/* the varlen lse, f32 [H, T], as [1, H, T, 1] */
wa_tensor view_thd_lse(const at::Tensor &lse) {
    wa_tensor w{lse.data_ptr(), WA_F32, wa_device_for(lse), {1, lse.size(0), lse.size(1), 1},
                {0, lse.stride(0), lse.stride(1), 1}};
    return w;
}

at::Tensor unit_stride(const at::Tensor &t) { return t.stride(-1) == 1 ? t : t.contiguous(); }
at::Tensor empty_like_contiguous(const at::Tensor &t) { return at::empty_like(t, at::MemoryFormat::Contiguous); }

/* the library's descriptor, and the parameters as the autograd context keeps them */
struct Params {
    int64_t left, right;
    double scale, softcap;
    bool deterministic;
    wa_attn_desc desc() const { return wa_attn_desc{(float)scale, (float)softcap, left, right}; }
    void save(AutogradContext *ctx) const {
        ctx->saved_data["left"] = left, ctx->saved_data["right"] = right;
        ctx->saved_data["scale"] = scale, ctx->saved_data["softcap"] = softcap;
        ctx->saved_data["deterministic"] = deterministic;
    }
    static Params load(AutogradContext *ctx) {
        return Params{ctx->saved_data["left"].toInt(), ctx->saved_data["right"].toInt(),
                      ctx->saved_data["scale"].toDouble(), ctx->saved_data["softcap"].toDouble(),
                      ctx->saved_data["deterministic"].toBool()};
    }
};

/* A failed library call inside the backward, which autograd's engine runs (on its own thread for
 * GPU tensors) and hands back to the caller: raised there as WinattnError, as the Python path's,
 * by a Python error persisted across the hand-over (what torch does for Python functions). */
[[noreturn]] void raise_from_backward(const LibraryError &e) {
    pybind11::gil_scoped_acquire gil;
    PyErr_SetString(winattn_error ? winattn_error : PyExc_RuntimeError, e.what());
    python_error err;
    err.persist();
    throw err;
}

/* The backward both functions share: the saved q, k, v (as passed: an in-place change after the
 * forward is caught by their version counters), o, lse (first in the saved list) and the incoming
 * dO as the library's views (view_of; lse_of for lse), dQ, dK, dV allocated, then call(context,
 * descriptor, saved, the six inputs, the three gradients) on the context of the forward's
 * determinism; returns {dq, dk, dv}. With create_graph and a dO that wants gradients, the results
 * come out as once_differentiable's do: constants to autograd.grad, an error to a backward() that
 * reaches them (winattn has no second derivative). */
template <typename ViewOf, typename LseOf, typename Call>
tensor_list run_backward(AutogradContext *ctx, const tensor_list &grads, ViewOf view_of, LseOf lse_of, Call call) {
    /* The forwards turn off autograd's materialised gradients: otherwise it fills a zero tensor for
     * lse's gradient (lse is not differentiable; nothing reads it) before every backward, and that
     * fill cost more host time than the rest of the backward (docs/experiments.md, bench/call_gap.py). So an
     * output no gradient reached comes as an undefined tensor: o's means none for q, k, v. */
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const bool graph = at::GradMode::is_enabled() && grads[0].requires_grad();
    tensor_list out;
    {
        const at::NoGradGuard no_graph;
        const Params p = Params::load(ctx);
        const tensor_list saved = ctx->get_saved_variables();
        const at::Tensor q = unit_stride(saved[0]), k = unit_stride(saved[1]), v = unit_stride(saved[2]);
        const at::Tensor d_o = unit_stride(grads[0]);
        at::Tensor dq = empty_like_contiguous(q), dk = empty_like_contiguous(k), dv = empty_like_contiguous(v);
        const wa_tensor t[6] = {view_of(q, "q"), view_of(k, "k"), view_of(v, "v"), view_of(saved[3], "o"), lse_of(saved[4]),
                                view_of(d_o, "do")};
        wa_tensor g[3] = {view_of(dq, "dq"), view_of(dk, "dk"), view_of(dv, "dv")};
        const wa_attn_desc d = p.desc();
        try {
            on_context(q, p.deterministic, [&](wa_context *c) { return call(c, d, saved, t, g); });
        } catch (const LibraryError &e) {
            raise_from_backward(e);
        }
        out = {dq, dk, dv};
    }
    if (!graph) return out;
    for (at::Tensor &x : out) x = x.detach().requires_grad_(true);
    return torch::autograd::DelayedError("winattn: attention's backward is not differentiable (a second derivative "
                                         "through winattn.torch.attention)", 3)
        .apply(std::move(out));
}

struct Attention : torch::autograd::Function<Attention> {
    static tensor_list forward(AutogradContext *ctx, const at::Tensor &q_in, const at::Tensor &k_in,
                               const at::Tensor &v_in, int64_t left, int64_t right, double scale, double softcap,
                               bool deterministic) {
        const Params p{left, right, scale, softcap, deterministic};
        const at::Tensor q = unit_stride(q_in), k = unit_stride(k_in), v = unit_stride(v_in);
        const wa_tensor tq = view(q, "q"), tk = view(k, "k"), tv = view(v, "v");
        at::Tensor o = empty_like_contiguous(q);
        at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
        wa_tensor to = view(o, "o"), tl = view_lse(lse);
        const wa_attn_desc d = p.desc();
        on_context(q, false, [&](wa_context *c) { return wa.forward(c, &d, &tq, &tk, &tv, &to, &tl); });
        ctx->save_for_backward({q_in, k_in, v_in, o, lse});
        p.save(ctx);
        ctx->mark_non_differentiable({lse});
        ctx->set_materialize_grads(false); /* lse's gradient stays undefined (run_backward) */
        return {o, lse};
    }

    static tensor_list backward(AutogradContext *ctx, tensor_list grads) {
        tensor_list out = run_backward(ctx, grads, view, view_lse, [](wa_context *c, const wa_attn_desc &d, const tensor_list &,
                                                                      const wa_tensor *t, wa_tensor *g) {
            return wa.backward(c, &d, &t[0], &t[1], &t[2], &t[3], &t[4], &t[5], &g[0], &g[1], &g[2]);
        });
        out.resize(8); /* no gradients for the parameters */
        return out;
    }
};

struct AttentionVarlen : torch::autograd::Function<AttentionVarlen> {
    static wa_varlen seqs(const at::Tensor &cu_q, const at::Tensor &cu_k, int64_t max_q, int64_t max_k) {
        return wa_varlen{cu_q.numel() - 1, cu_q.data_ptr<int32_t>(), cu_k.data_ptr<int32_t>(), max_q, max_k};
    }

    static tensor_list forward(AutogradContext *ctx, const at::Tensor &q_in, const at::Tensor &k_in,
                               const at::Tensor &v_in, const at::Tensor &cu_q_in, const at::Tensor &cu_k_in,
                               int64_t max_q, int64_t max_k, int64_t left, int64_t right, double scale,
                               double softcap, bool deterministic) {
        const Params p{left, right, scale, softcap, deterministic};
        const at::Tensor q = unit_stride(q_in), k = unit_stride(k_in), v = unit_stride(v_in);
        const at::Tensor cu_q = cu_q_in.contiguous(), cu_k = cu_k_in.contiguous();
        at::Tensor o = empty_like_contiguous(q);
        at::Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
        const wa_tensor tq = view_thd(q, "q"), tk = view_thd(k, "k"), tv = view_thd(v, "v");
        wa_tensor to = view_thd(o, "o"), tl = view_thd_lse(lse);
        const wa_attn_desc d = p.desc();
        const wa_varlen s = seqs(cu_q, cu_k, max_q, max_k);
        on_context(q, false, [&](wa_context *c) { return wa.forward_varlen(c, &d, &s, &tq, &tk, &tv, &to, &tl); });
        ctx->save_for_backward({q_in, k_in, v_in, o, lse, cu_q_in, cu_k_in});
        p.save(ctx);
        ctx->saved_data["max_q"] = max_q, ctx->saved_data["max_k"] = max_k;
        ctx->mark_non_differentiable({lse});
        ctx->set_materialize_grads(false); /* lse's gradient stays undefined (run_backward) */
        return {o, lse};
    }

    static tensor_list backward(AutogradContext *ctx, tensor_list grads) {
        const int64_t max_q = ctx->saved_data["max_q"].toInt(), max_k = ctx->saved_data["max_k"].toInt();
        const auto call = [=](wa_context *c, const wa_attn_desc &d, const tensor_list &saved, const wa_tensor *t,
                              wa_tensor *g) {
            const at::Tensor cu_q = saved[5].contiguous(), cu_k = saved[6].contiguous();
            const wa_varlen s = seqs(cu_q, cu_k, max_q, max_k);
            return wa.backward_varlen(c, &d, &s, &t[0], &t[1], &t[2], &t[3], &t[4], &t[5], &g[0], &g[1], &g[2]);
        };
        tensor_list out = run_backward(ctx, grads, view_thd, view_thd_lse, call);
        out.resize(12); /* no gradients for the offsets and parameters */
        return out;
    }
};

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                             int64_t left, int64_t right, double scale, double softcap,
                                             bool deterministic) {
    auto r = Attention::apply(q, k, v, left, right, scale, softcap, deterministic);
    return {r[0], r[1]};
}

std::tuple<at::Tensor, at::Tensor> attention_varlen(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                                    const at::Tensor &cu_q, const at::Tensor &cu_k, int64_t max_q,
                                                    int64_t max_k, int64_t left, int64_t right, double scale,
                                                    double softcap, bool deterministic) {
    /* winattn.torch has checked the library's varlen entry points and the tensors' dimensions */
    if (!wa.forward_varlen) throw LibraryError("winattn: this libwinattn has no wa_forward_varlen");
    auto r = AttentionVarlen::apply(q, k, v, cu_q, cu_k, max_q, max_k, left, right, scale, softcap, deterministic);
    return {r[0], r[1]};
}

template <typename F> void bind_entry(const py::dict &addresses, const char *name, F &slot, bool required = true) {
    if (!addresses.contains(name)) {
        if (required) throw py::value_error(std::string("winattn: _torch_ext.bind: no address for ") + name);
        return;
    }
    slot = reinterpret_cast<F>(addresses[name].cast<uintptr_t>());
}

/* the entry points (name -> address, from ctypes), WinattnError and the status names */
void bind(const py::dict &addresses, const py::object &error_type, const std::vector<std::string> &names) {
    bind_entry(addresses, "wa_context_create", wa.context_create);
    bind_entry(addresses, "wa_context_destroy", wa.context_destroy);
    bind_entry(addresses, "wa_forward", wa.forward);
    bind_entry(addresses, "wa_backward", wa.backward);
    bind_entry(addresses, "wa_forward_varlen", wa.forward_varlen, false);
    bind_entry(addresses, "wa_backward_varlen", wa.backward_varlen, false);
    bind_entry(addresses, "wa_last_error", wa.last_error);
    Py_XDECREF(winattn_error);
    winattn_error = error_type.ptr();
    Py_INCREF(winattn_error);
    status_names = names;
}

/* drop every context (their workspaces); calls in flight keep theirs until they return */
void release_workspace() {
    decltype(contexts) dropped;
    {
        std::lock_guard<std::mutex> guard(contexts_lock);
        dropped.swap(contexts);
    }
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "winattn.torch's eager path in C++ (python/winattn/_torch_ext.cpp); used through winattn.torch";
    m.attr("torch_version") = WA_TORCH_VERSION;
    m.attr("source_hash") = WA_EXT_SOURCE_HASH; /* of winattn.h and this file, by build_torch_ext.py */
    /* the sizes of the structs this module was compiled with, which winattn.torch compares with its
     * ctypes mirror of the library's header before binding */
    m.attr("layout") = py::make_tuple(sizeof(wa_tensor), sizeof(wa_attn_desc), sizeof(wa_context_params), sizeof(wa_varlen));
    m.def("bind", &bind, "bind the library's entry points (name -> address), WinattnError and the status names");
    m.def("attention", &attention, "(o, lse) of winattn's attention, differentiable in q, k and v");
    m.def("attention_varlen", &attention_varlen, "(o, lse) over a packed batch, differentiable in q, k and v");
    m.def("release_workspace", &release_workspace, "drop the contexts and their workspaces");
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const LibraryError &e) {
            PyErr_SetString(winattn_error ? winattn_error : PyExc_RuntimeError, e.what());
        }
    });
}

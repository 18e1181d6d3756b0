/* attention_ext.cpp — lab prototype: winattn's forward and backward as a C++ autograd function
 * (torch::autograd::Function) instead of the Python eager path of winattn.torch, to measure what
 * the Python layer costs per call. CPU tensors, and CUDA tensors on the current stream when built
 * with WA_EXT_CUDA (measure.py does that where torch has CUDA and the CUDA headers are found); one
 * context per CPU and per (GPU, stream), deterministic; no varlen; the library does the argument
 * checks. Not wired into winattn.torch: measure.py builds it and times it beside attention(). */
#include <torch/extension.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#ifdef WA_EXT_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include "winattn.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

void check(wa_status st) {
    if (st != WA_OK) throw std::runtime_error(std::string("winattn: ") + wa_last_error());
}

/* a wa_context and the lock that keeps it to one call at a time (the library's rule) */
struct Context {
    wa_context *ctx = nullptr;
    std::mutex busy;
    ~Context() { wa_context_destroy(ctx); }
};

/* the context for tensors on `device`: one for the CPU (one thread), one per GPU and stream */
Context &context_for(const at::Device &device) {
    static std::mutex lock;
    static std::map<std::tuple<int, int, void *>, std::unique_ptr<Context>> contexts;
    wa_context_params params{};
    params.threads = 1;
    params.cuda_deterministic = 1;
    if (device.is_cuda()) {
#ifdef WA_EXT_CUDA
        params.cuda_stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
#else
        TORCH_CHECK(false, "attention_ext: built without CUDA (WA_EXT_CUDA)");
#endif
    } else {
        TORCH_CHECK(device.is_cpu(), "attention_ext: CPU or CUDA tensors");
    }
    const auto key = std::make_tuple((int)device.is_cuda(), (int)device.index(), params.cuda_stream);
    std::lock_guard<std::mutex> guard(lock);
    auto &slot = contexts[key];
    if (!slot) {
        auto c = std::make_unique<Context>();
        check(wa_context_create(&params, &c->ctx));
        slot = std::move(c);
    }
    return *slot;
}

/* a [B, H, N, D] tensor (or lse [B, H, N], as [B, H, N, 1]) as the library's view */
wa_tensor view(const at::Tensor &t) {
    wa_tensor w{};
    w.data = t.data_ptr();
    switch (t.scalar_type()) {
    case at::kBFloat16: w.dtype = WA_BF16; break;
    case at::kHalf: w.dtype = WA_F16; break;
    case at::kFloat: w.dtype = WA_F32; break;
    default: TORCH_CHECK(false, "attention_ext: float32, float16 or bfloat16");
    }
    w.device = t.is_cuda() ? WA_DEVICE_CUDA : WA_DEVICE_CPU;
    for (int i = 0; i < 4; i++) {
        w.shape[i] = i < t.dim() ? t.size(i) : 1;
        w.stride[i] = i < t.dim() ? t.stride(i) : 1;
    }
    return w;
}

struct Attention : torch::autograd::Function<Attention> {
    static tensor_list forward(AutogradContext *ctx, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t left,
                               int64_t right, double scale, double softcap) {
        at::Tensor o = at::empty_like(q, at::MemoryFormat::Contiguous);
        at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
        const wa_attn_desc d{(float)scale, (float)softcap, left, right};
        const wa_tensor tq = view(q), tk = view(k), tv = view(v);
        wa_tensor to = view(o), tl = view(lse);
        const at::OptionalDeviceGuard on(at::device_of(q)); /* the library launches on the current GPU */
        {
            pybind11::gil_scoped_release no_gil; /* as ctypes does: other Python threads run meanwhile */
            Context &c = context_for(q.device());
            std::lock_guard<std::mutex> one_call(c.busy);
            check(wa_forward(c.ctx, &d, &tq, &tk, &tv, &to, &tl));
        }
        ctx->save_for_backward({q, k, v, o, lse});
        ctx->saved_data["left"] = left;
        ctx->saved_data["right"] = right;
        ctx->saved_data["scale"] = scale;
        ctx->saved_data["softcap"] = softcap;
        ctx->mark_non_differentiable({lse});
        return {o, lse};
    }

    static tensor_list backward(AutogradContext *ctx, tensor_list grads) {
        const auto saved = ctx->get_saved_variables();
        const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
        const at::Tensor d_o = grads[0].stride(-1) == 1 ? grads[0] : grads[0].contiguous();
        at::Tensor dq = at::empty_like(q, at::MemoryFormat::Contiguous), dk = at::empty_like(k, at::MemoryFormat::Contiguous),
                   dv = at::empty_like(v, at::MemoryFormat::Contiguous);
        const wa_attn_desc d{(float)ctx->saved_data["scale"].toDouble(), (float)ctx->saved_data["softcap"].toDouble(),
                             ctx->saved_data["left"].toInt(), ctx->saved_data["right"].toInt()};
        wa_tensor t[9] = {view(q), view(k), view(v), view(saved[3]), view(saved[4]), view(d_o), view(dq), view(dk), view(dv)};
        const at::OptionalDeviceGuard on(at::device_of(q));
        Context &c = context_for(q.device());
        std::lock_guard<std::mutex> one_call(c.busy);
        check(wa_backward(c.ctx, &d, &t[0], &t[1], &t[2], &t[3], &t[4], &t[5], &t[6], &t[7], &t[8]));
        return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

at::Tensor attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t left, int64_t right, double scale,
                     double softcap) {
    return Attention::apply(q, k, v, left, right, scale, softcap)[0];
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("attention", &attention, "o of winattn's attention, differentiable in q, k and v");
}

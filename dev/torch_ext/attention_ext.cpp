/* attention_ext.cpp — lab prototype: winattn's forward and backward as a C++ autograd function
 * (torch::autograd::Function) instead of the Python eager path of winattn.torch, to measure what
 * the Python layer costs per call. CPU tensors only, one context of one thread, no varlen; the
 * library does the argument checks. Not wired into winattn.torch: measure.py builds it and times
 * it beside attention(). */
#include <torch/extension.h>

#include "winattn.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

wa_context *context() {
    static wa_context *ctx = [] {
        wa_context_params params{};
        params.threads = 1;
        wa_context *c = nullptr;
        if (wa_context_create(&params, &c) != WA_OK) throw std::runtime_error(wa_last_error());
        return c;
    }();
    return ctx;
}

/* a [B, H, N, D] tensor (or lse [B, H, N], as [B, H, N, 1]) as the library's view */
wa_tensor view(const at::Tensor &t) {
    TORCH_CHECK(t.device().is_cpu(), "attention_ext: CPU tensors only");
    wa_tensor w{};
    w.data = t.data_ptr();
    switch (t.scalar_type()) {
    case at::kBFloat16: w.dtype = WA_BF16; break;
    case at::kHalf: w.dtype = WA_F16; break;
    case at::kFloat: w.dtype = WA_F32; break;
    default: TORCH_CHECK(false, "attention_ext: float32, float16 or bfloat16");
    }
    w.device = WA_DEVICE_CPU;
    for (int i = 0; i < 4; i++) {
        w.shape[i] = i < t.dim() ? t.size(i) : 1;
        w.stride[i] = i < t.dim() ? t.stride(i) : 1;
    }
    return w;
}

void check(wa_status st) {
    if (st != WA_OK) throw std::runtime_error(std::string("winattn: ") + wa_last_error());
}

struct Attention : torch::autograd::Function<Attention> {
    static tensor_list forward(AutogradContext *ctx, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t left,
                               int64_t right, double scale, double softcap) {
        at::Tensor o = at::empty_like(q, at::MemoryFormat::Contiguous);
        at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
        const wa_attn_desc d{(float)scale, (float)softcap, left, right};
        const wa_tensor tq = view(q), tk = view(k), tv = view(v);
        wa_tensor to = view(o), tl = view(lse);
        {
            pybind11::gil_scoped_release no_gil; /* as ctypes does: other Python threads run meanwhile */
            check(wa_forward(context(), &d, &tq, &tk, &tv, &to, &tl));
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
        check(wa_backward(context(), &d, &t[0], &t[1], &t[2], &t[3], &t[4], &t[5], &t[6], &t[7], &t[8]));
        return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

at::Tensor attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t left, int64_t right, double scale,
                     double softcap) {
    return Attention::apply(q, k, v, left, right, scale, softcap)[0];
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("attention", &attention, "o of winattn's attention, differentiable in q, k and v (CPU tensors)");
}

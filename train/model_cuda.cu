// model_cuda.cu — the Gemma model with LoRA on one NVIDIA GPU (model_cuda.h). Read top to
// bottom: cuBLAS (and cuBLASLt) loaded at run time, the row-major product on it and an fp8 base's
// FP8 products; the kernels (embedding, RMSNorm with its residual forms, the per-head q/k/v norm
// with RoPE, GeGLU, the chunked cross-entropy), each beside its backward; the weights on the device
// (from the checkpoint or drawn there); one decoder layer forward and backward; the head; the
// drivers with per-layer recomputation, which follow train/model.c line for line so the two can be
// read side by side.
//
// Everything is templated on the element type E of weights and activations: __nv_bfloat16 (the
// trainer's default) or float (the check against the CPU model). Reductions run in f32 always.
extern "C" { // the trainer's C headers (model.h, checkpoint.h) declare no linkage of their own
#include "checkpoint.h"
#include "convert.h"
#include "model_cuda.h"
#include "platform.h"
#include "quant.h"
}
#include "winattn.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <initializer_list>
#include <vector>

typedef __nv_bfloat16 bf16;

namespace {

// ---------------------------------------------------------------------------------------------
// Errors: every failing CUDA or cuBLAS call becomes one line naming the call.

struct failure {
    char msg[512];
};

[[noreturn]] void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void fail(const char *fmt, ...) {
    failure f;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f.msg, sizeof f.msg, fmt, ap);
    va_end(ap);
    throw f;
}

#define CU(call)                                                                          \
    do {                                                                                  \
        cudaError_t e_ = (call);                                                          \
        if (e_ != cudaSuccess) fail("%s: %s", #call, cudaGetErrorString(e_));             \
    } while (0)

// ---------------------------------------------------------------------------------------------
// cuBLAS, opened with dlopen when a model is put on the GPU: the command links no CUDA library
// dynamically and so starts, and trains on the CPU, where the toolkit is not installed.

// The first of `names` dlopen finds (one line naming `missing` where none is there), and one
// symbol of it (one line naming the library where it lacks it).
void *library_open(std::initializer_list<const char *> names, const char *missing) {
    void *lib = nullptr;
    for (const char *n : names)
        if ((lib = dlopen(n, RTLD_NOW | RTLD_LOCAL))) break;
    if (!lib) fail("cannot load %s: %s", missing, dlerror());
    return lib;
}

void library_symbol(void *lib, void **slot, const char *name, const char *library) {
    *slot = dlsym(lib, name);
    if (!*slot) fail("%s has no %s", library, name);
}

struct blas_api {
    void *lib = nullptr;
    decltype(&cublasCreate_v2) create;
    decltype(&cublasDestroy_v2) destroy;
    decltype(&cublasSetStream_v2) set_stream;
    decltype(&cublasSetMathMode) set_math_mode;
    decltype(&cublasSetWorkspace_v2) set_workspace;
    // the library's own entry point (the header also has a C++ overload taking cudaDataType)
    cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void *,
                              const void *, cudaDataType, int, const void *, cudaDataType, int, const void *, void *,
                              cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
};

void blas_open(blas_api *b) {
    b->lib = library_open({"libcublas.so.13", "libcublas.so.12", "libcublas.so"}, "cuBLAS (libcublas.so.13 or .12)");
#define SYM(field, name) library_symbol(b->lib, (void **)&b->field, name, "cuBLAS")
    SYM(create, "cublasCreate_v2");
    SYM(destroy, "cublasDestroy_v2");
    SYM(set_stream, "cublasSetStream_v2");
    SYM(set_math_mode, "cublasSetMathMode");
    SYM(set_workspace, "cublasSetWorkspace_v2");
    SYM(gemm_ex, "cublasGemmEx");
#undef SYM
}

// cuBLASLt, opened the same way and only for the FP8 products of an fp8 base (bf16 mode, compute
// capability 8.9 or more): the other paths never need it.
struct lt_api {
    void *lib = nullptr;
    decltype(&cublasLtCreate) create;
    decltype(&cublasLtDestroy) destroy;
    decltype(&cublasLtMatmulDescCreate) desc_create;
    decltype(&cublasLtMatmulDescDestroy) desc_destroy;
    decltype(&cublasLtMatmulDescSetAttribute) desc_set;
    decltype(&cublasLtMatrixLayoutCreate) layout_create;
    decltype(&cublasLtMatrixLayoutDestroy) layout_destroy;
    decltype(&cublasLtMatmulPreferenceCreate) pref_create;
    decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy;
    decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set;
    decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic;
    decltype(&cublasLtMatmul) matmul;
};

void lt_open(lt_api *b) {
    b->lib = library_open({"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"},
                          "cuBLASLt (libcublasLt.so.13 or .12) for the fp8 base's FP8 products");
#define SYM(field, name) library_symbol(b->lib, (void **)&b->field, name, "cuBLASLt")
    SYM(create, "cublasLtCreate");
    SYM(destroy, "cublasLtDestroy");
    SYM(desc_create, "cublasLtMatmulDescCreate");
    SYM(desc_destroy, "cublasLtMatmulDescDestroy");
    SYM(desc_set, "cublasLtMatmulDescSetAttribute");
    SYM(layout_create, "cublasLtMatrixLayoutCreate");
    SYM(layout_destroy, "cublasLtMatrixLayoutDestroy");
    SYM(pref_create, "cublasLtMatmulPreferenceCreate");
    SYM(pref_destroy, "cublasLtMatmulPreferenceDestroy");
    SYM(pref_set, "cublasLtMatmulPreferenceSetAttribute");
    SYM(heuristic, "cublasLtMatmulAlgoGetHeuristic");
    SYM(matmul, "cublasLtMatmul");
#undef SYM
}

// The algorithm cuBLASLt's heuristic chose for one product shape (and operand alignments): asked
// once per shape, as a step repeats the same few shapes in every layer.
struct fp8_algo {
    long m, n, k, lda, ldb, ldd;
    unsigned align[3];
    cublasLtMatmulAlgo_t algo;
};

// The FP8 products of an fp8 base (see "FP8 products" below). The backward's transposed codes and
// the stacked row scales live in the dequantization scratch, which this path leaves unused.
struct fp8_engine {
    int on = 0;
    lt_api lt;
    cublasLtHandle_t handle = nullptr;
    void *workspace = nullptr; // cuBLAS's workspace: both libraries run on one stream, one call at a time
    size_t workspace_bytes = 0;
    float *ones = nullptr;     // the codes' scale vector of the input gradient's product (all 1)
    long width = 0;            // the widest operand row a product quantizes (bytes per token of the buffer)
    std::vector<fp8_algo> algos;
    int layer = -1;            // the layer whose transposed codes the scratch holds (-1: none)
    uint8_t *codes_t = nullptr; // [in, Σout] per group of a layer, at the group's offset in the scratch
    float *scale_t = nullptr;   // the layer's row scales stacked in projection order
};

constexpr size_t BLAS_WORKSPACE_BYTES = (size_t)64 << 20; // cuBLAS's, lent to cuBLASLt too

template <class E> constexpr cudaDataType_t dtype_of();
template <> constexpr cudaDataType_t dtype_of<float>() { return CUDA_R_32F; }
template <> constexpr cudaDataType_t dtype_of<bf16>() { return CUDA_R_16BF; }

// A row-major operand: data, its element type, leading dimension, transposed or not.
struct mat {
    const void *p;
    cudaDataType_t t;
    long ld;
    bool trans;
};
template <class E> mat M(const E *p, long ld, bool trans = false) { return {p, dtype_of<E>(), ld, trans}; }

// ---------------------------------------------------------------------------------------------
// Kernels. E ↔ f32 conversion first, then block and warp reductions.

__device__ __forceinline__ float f32(float x) { return x; }
__device__ __forceinline__ float f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float f32(__half x) { return __half2float(x); } // a checkpoint's f16 values
template <class E> __device__ __forceinline__ E to_e(float x);
template <> __device__ __forceinline__ float to_e<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 to_e<bf16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v, float *shared32) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads(); // shared32 may still be read by a previous call
    if (lane == 0) shared32[wid] = v;
    __syncthreads();
    v = lane < nw ? shared32[lane] : 0.f;
    return warp_sum(v);
}

constexpr int ROW_THREADS = 256;

// x [rows, ld] → y = x·inv_rms(x)·w (w NULL: no weight) — rows of n, one block per row.
template <class E>
__global__ void k_rmsnorm(const E *x, long ldx, const float *w, E *y, long ldy, int n, float eps) {
    __shared__ float sh[32];
    const E *xr = x + (long)blockIdx.x * ldx;
    E *yr = y + (long)blockIdx.x * ldy;
    float ss = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += f32(xr[i]) * f32(xr[i]);
    float inv = rsqrtf(block_sum(ss, sh) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = to_e<E>(f32(xr[i]) * inv * (w ? w[i] : 1.f));
}

// The residual forms of a decoder layer: h = (resid + norm(x)·w) · scale, the normed term and the
// sum each rounded to E as a framework computing in E rounds them; then, with w2, y2 = norm(h)·w2.
template <class E>
__global__ void k_add_norm(const E *resid, const E *x, const float *w, E *h, float scale, const float *w2, E *y2,
                           int n, float eps) {
    __shared__ float sh[32];
    long off = (long)blockIdx.x * n;
    float ss = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += f32(x[off + i]) * f32(x[off + i]);
    float inv = rsqrtf(block_sum(ss, sh) / n + eps);
    float ss2 = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float t = f32(to_e<E>(f32(x[off + i]) * inv * w[i]));
        float s = f32(to_e<E>(f32(resid[off + i]) + t));
        if (scale != 1.f) s = f32(to_e<E>(s * scale));
        h[off + i] = to_e<E>(s);
        ss2 += s * s;
    }
    if (!w2) return;
    float inv2 = rsqrtf(block_sum(ss2, sh) / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) y2[off + i] = to_e<E>(f32(h[off + i]) * inv2 * w2[i]);
}

// One row of the norm backward: out[i] = base(i) + d/dx of norm(x)·w given dy (w NULL: no
// weight; out may alias base's source). With g = dy·w and r = 1/rms: dx = r·g − x·r³·(g·x)/n.
// in_scale multiplies dy first (the layer scalar). Every thread of the block calls it.
template <class E, class Base>
__device__ __forceinline__ void rmsnorm_bwd_row(const E *x, const float *w, const E *dy, float in_scale, Base base,
                                                E *out, int n, float eps, float *sh) {
    float ss = 0, gx = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float xi = f32(x[i]);
        ss += xi * xi;
        gx += f32(dy[i]) * in_scale * (w ? w[i] : 1.f) * xi;
    }
    ss = block_sum(ss, sh);
    gx = block_sum(gx, sh);
    float inv = rsqrtf(ss / n + eps);
    float k = inv * inv * inv * gx / n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float g = inv * f32(dy[i]) * in_scale * (w ? w[i] : 1.f) - f32(x[i]) * k;
        out[i] = to_e<E>(base(i) + g);
    }
}

// out = base + d/dx of norm(x)·w given dy (base NULL: none; out may be base), one block per row
template <class E>
__global__ void k_rmsnorm_bwd(const E *x, const float *w, const E *dy, float in_scale, const E *base, E *out, int n,
                              float eps) {
    __shared__ float sh[32];
    long off = (long)blockIdx.x * n;
    const E *b = base ? base + off : nullptr;
    rmsnorm_bwd_row<E>(x + off, w, dy + off, in_scale, [&](int i) { return b ? f32(b[i]) : 0.f; }, out + off, n, eps,
                       sh);
}

// The backward of the layer's two residual norms, the reverse of h = x + norm(ao)·w_post_attn and
// mi = norm(h)·w_pre_ffw, with out = (h + …)·scalar: dx = dout·scalar (rounded to E, the gradient
// that bypasses the norms) + norm'(h)ᵀ·d_mi, then d_ao = norm'(ao)ᵀ·dx from dx as stored in E.
// One block per row; each thread reads back only the dx entries it wrote.
template <class E>
__global__ void k_residual_norms_bwd(const E *dout, float scalar, const E *h, const float *w_pre_ffw, const E *d_mi,
                                     const E *ao, const float *w_post_attn, E *dx, E *d_ao, int n, float eps) {
    __shared__ float sh[32];
    long off = (long)blockIdx.x * n;
    const E *dr = dout + off;
    // __fmul_rn: the product stays a rounded product in f32 too (no multiply-add with the norm's share)
    auto bypass = [&](int i) { return f32(to_e<E>(__fmul_rn(f32(dr[i]), scalar))); };
    rmsnorm_bwd_row<E>(h + off, w_pre_ffw, d_mi + off, 1.f, bypass, dx + off, n, eps, sh);
    rmsnorm_bwd_row<E>(ao + off, w_post_attn, dx + off, 1.f, [](int) { return 0.f; }, d_ao + off, n, eps, sh);
}

// The per-head kernels of a layer's fused q|k|v projection, one launch over every head of a row:
// q heads first, then k heads, then v heads where the layer has its own values. Rows of qkv have
// stride ld, k's heads start at column k_at, v's at v_at (v_at < 0: k_eq_v, the values are the
// raw keys); outputs are contiguous [T, heads, D]. One warp per (row, head), 8 warps a block.
struct qkv_heads {
    long ld, k_at, v_at;
    int T, heads, kv_heads, D;
    int per_row; // heads + kv_heads, + kv_heads with separate values
    float eps;
    const int32_t *pos;
    const float *cosv, *sinv; // the RoPE tables [positions, D/2] of q and k
};

constexpr int HEAD_WARPS = 8;

qkv_heads qkv_layout(long ld, long k_at, long v_at, int T, int heads, int kv_heads, int D, float eps,
                     const int32_t *pos, const float *cosv, const float *sinv) {
    int per_row = heads + kv_heads + (v_at >= 0 ? kv_heads : 0);
    return {ld, k_at, v_at, T, heads, kv_heads, D, per_row, eps, pos, cosv, sinv};
}

int qkv_blocks(const qkv_heads &q) { return (int)(((long)q.T * q.per_row + HEAD_WARPS - 1) / HEAD_WARPS); }

// 1/rms of one head's vector (norm 0: 1), the same value in every lane
template <class E> __device__ __forceinline__ float head_inv_rms(const E *xv, int D, float eps, int norm, int lane) {
    if (!norm) return 1.f;
    float ss = 0;
    for (int i = lane; i < D; i += 32) ss += f32(xv[i]) * f32(xv[i]);
    return rsqrtf(warp_sum(ss) / D + eps);
}

// y = rope(x·inv·w) over one head (w NULL: no weight; c NULL: no rotation): rotate-half pairs
// (j, j + D/2) with the row's tables c, s
template <class E>
__device__ __forceinline__ void head_scale_rope(const E *xv, float inv, const float *w, E *yv, int D, const float *c,
                                                const float *s, int lane) {
    int half = D / 2;
    for (int j = lane; j < half; j += 32) {
        float x1 = f32(xv[j]) * inv * (w ? w[j] : 1.f), x2 = f32(xv[j + half]) * inv * (w ? w[j + half] : 1.f);
        if (c) {
            float r1 = x1 * c[j] - x2 * s[j], r2 = x2 * c[j] + x1 * s[j];
            x1 = r1, x2 = r2;
        }
        yv[j] = to_e<E>(x1);
        yv[j + half] = to_e<E>(x2);
    }
}

// qr = rope(norm(q)·q_norm), kr = rope(norm(k)·k_norm), vn = norm(v) (v_norm; Gemma 4) or v (Gemma
// 3). With k_eq_v the warp of a k head also writes its value head from the same raw keys and rms.
template <class E>
__global__ void k_qkv_norm_rope(const E *qkv, qkv_heads q, const float *q_w, const float *k_w, int v_norm, E *qr,
                                E *kr, E *vn) {
    long vec = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (vec >= (long)q.T * q.per_row) return;
    long t = vec / q.per_row;
    int h = (int)(vec % q.per_row), half = q.D / 2;
    const float *c = q.cosv + (long)q.pos[t] * half, *s = q.sinv + (long)q.pos[t] * half;
    const E *row = qkv + t * q.ld;
    if (h < q.heads) {
        const E *xv = row + (long)h * q.D;
        head_scale_rope(xv, head_inv_rms(xv, q.D, q.eps, 1, lane), q_w, qr + (t * q.heads + h) * q.D, q.D, c, s, lane);
        return;
    }
    h -= q.heads; // a k head, then a v head: h and h - kv_heads index [T, kv_heads]
    long out = (t * q.kv_heads + (h < q.kv_heads ? h : h - q.kv_heads)) * q.D;
    if (h < q.kv_heads) {
        const E *xv = row + q.k_at + (long)h * q.D;
        float inv = head_inv_rms(xv, q.D, q.eps, 1, lane);
        head_scale_rope(xv, inv, k_w, kr + out, q.D, c, s, lane);
        if (q.v_at < 0) head_scale_rope<E>(xv, v_norm ? inv : 1.f, nullptr, vn + out, q.D, nullptr, nullptr, lane);
        return;
    }
    const E *xv = row + q.v_at + (long)(h - q.kv_heads) * q.D;
    head_scale_rope<E>(xv, head_inv_rms(xv, q.D, q.eps, v_norm, lane), nullptr, vn + out, q.D, nullptr, nullptr,
                       lane);
}

// The backward of one head, written into the fused q|k|v gradient: dx = norm'ᵀ · rope⁻¹(dy) (the
// inverse rotation is the transpose), plus, with g2, the weightless v-norm backward of the same
// raw x (k_eq_v, whose values are the raw keys).
template <class E, bool weighted = true>
__device__ __forceinline__ void head_norm_rope_bwd(const E *xv, const float *w, const E *gv, const E *g2, E *ov, int D,
                                                   float eps, int norm, const float *c, const float *s, int lane) {
    int half = D / 2;
    // rope⁻¹(dy) pairs, recomputed in both passes rather than held (D up to 512)
    auto unrot = [&](int j, float &u1, float &u2) {
        float a = f32(gv[j]), b = f32(gv[j + half]);
        if (c) u1 = a * c[j] + b * s[j], u2 = b * c[j] - a * s[j];
        else u1 = a, u2 = b;
    };
    if (!norm) {
        for (int j = lane; j < half; j += 32) {
            float u1, u2;
            unrot(j, u1, u2);
            ov[j] = to_e<E>(u1);
            ov[j + half] = to_e<E>(u2);
        }
        return;
    }
    float ss = 0, gx = 0, gx2 = 0;
    for (int j = lane; j < half; j += 32) {
        float u1, u2, x1 = f32(xv[j]), x2 = f32(xv[j + half]);
        unrot(j, u1, u2);
        ss += x1 * x1 + x2 * x2;
        // weightless (the v heads: w a constant null) the fmaf keeps x1's product the fused one, as
        // the weighted form compiles; contraction alone fuses x2's there in f32, rounding gx otherwise
        if constexpr (weighted) gx += u1 * (w ? w[j] : 1.f) * x1 + u2 * (w ? w[j + half] : 1.f) * x2;
        else gx += fmaf(u1, x1, u2 * x2);
        if (g2) gx2 += f32(g2[j]) * x1 + f32(g2[j + half]) * x2;
    }
    ss = warp_sum(ss), gx = warp_sum(gx), gx2 = warp_sum(gx2);
    float inv = rsqrtf(ss / D + eps), k = inv * inv * inv * gx / D, k2 = inv * inv * inv * gx2 / D;
    for (int j = lane; j < half; j += 32) {
        float u1, u2, x1 = f32(xv[j]), x2 = f32(xv[j + half]);
        unrot(j, u1, u2);
        float d1 = inv * u1 * (w ? w[j] : 1.f) - x1 * k, d2 = inv * u2 * (w ? w[j + half] : 1.f) - x2 * k;
        if (g2) d1 += inv * f32(g2[j]) - x1 * k2, d2 += inv * f32(g2[j + half]) - x2 * k2;
        ov[j] = to_e<E>(d1);
        ov[j + half] = to_e<E>(d2);
    }
}

// d_qkv (stride q.ld) from d_qr, d_kr, d_vn: each head as head_norm_rope_bwd; with k_eq_v the
// k heads take d_vn as well (their raw keys were the values)
template <class E>
__global__ void k_qkv_norm_rope_bwd(const E *qkv, qkv_heads q, const float *q_w, const float *k_w, int v_norm,
                                    const E *d_qr, const E *d_kr, const E *d_vn, E *d_qkv) {
    long vec = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (vec >= (long)q.T * q.per_row) return;
    long t = vec / q.per_row;
    int h = (int)(vec % q.per_row), half = q.D / 2;
    const float *c = q.cosv + (long)q.pos[t] * half, *s = q.sinv + (long)q.pos[t] * half;
    const E *row = qkv + t * q.ld;
    E *orow = d_qkv + t * q.ld;
    if (h < q.heads) {
        long at = (long)h * q.D;
        head_norm_rope_bwd<E>(row + at, q_w, d_qr + (t * q.heads + h) * q.D, nullptr, orow + at, q.D, q.eps, 1, c, s,
                              lane);
        return;
    }
    h -= q.heads;
    long in = (t * q.kv_heads + (h < q.kv_heads ? h : h - q.kv_heads)) * q.D;
    if (h < q.kv_heads) {
        long at = q.k_at + (long)h * q.D;
        head_norm_rope_bwd<E>(row + at, k_w, d_kr + in, q.v_at < 0 ? d_vn + in : nullptr, orow + at, q.D, q.eps, 1, c,
                              s, lane);
        return;
    }
    long at = q.v_at + (long)(h - q.kv_heads) * q.D;
    head_norm_rope_bwd<E, false>(row + at, nullptr, d_vn + in, nullptr, orow + at, q.D, q.eps, v_norm, nullptr,
                                 nullptr, lane);
}

// gelu_pytorch_tanh and its derivative
__device__ __forceinline__ float gelu_tanh(float x, float *grad) {
    const float k = 0.7978845608028654f;
    float t = tanhf(k * (x + 0.044715f * x * x * x));
    if (grad) *grad = 0.5f * (1 + t) + 0.5f * x * (1 - t * t) * k * (1 + 3 * 0.044715f * x * x);
    return 0.5f * x * (1 + t);
}

// z = gelu(g)·u over rows of the fused gate|up product gu [T, 2I]; grid.y walks the rows (in
// chunks of 65,535), grid.x the columns, so no thread divides by I
template <class E> __global__ void k_geglu(const E *gu, E *z, long row0, int I) {
    long t = row0 + blockIdx.y;
    const E *g = gu + t * 2 * I, *u = g + I;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < I; j += gridDim.x * blockDim.x)
        z[t * I + j] = to_e<E>(gelu_tanh(f32(g[j]), nullptr) * f32(u[j]));
}

template <class E> __global__ void k_geglu_bwd(const E *gu, const E *dz, E *dgu, long row0, int I) {
    long t = row0 + blockIdx.y;
    const E *g = gu + t * 2 * I, *u = g + I;
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < I; j += gridDim.x * blockDim.x) {
        float gg, d = f32(dz[t * I + j]), a = gelu_tanh(f32(g[j]), &gg);
        dgu[t * 2 * I + j] = to_e<E>(d * f32(u[j]) * gg);
        dgu[t * 2 * I + I + j] = to_e<E>(d * a);
    }
}

template <class E> void geglu(cudaStream_t st, const E *gu, const E *dz, E *out, long T, int I) {
    int bx = std::min((I + 255) / 256, 64);
    for (long r0 = 0; r0 < T; r0 += 65535) {
        dim3 grid(bx, (unsigned)std::min(65535L, T - r0));
        if (dz) k_geglu_bwd<E><<<grid, 256, 0, st>>>(gu, dz, out, r0, I);
        else k_geglu<E><<<grid, 256, 0, st>>>(gu, out, r0, I);
    }
}

// x[t] = embed[token[t]] · scale, the scale rounded to E first as transformers' scaled embedding does
template <class E> __global__ void k_embed(const int32_t *tokens, const E *embed, float scale, E *x, int H) {
    long t = blockIdx.x;
    const E *row = embed + (long)tokens[t] * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) x[t * H + i] = to_e<E>(f32(row[i]) * scale);
}

// Cross-entropy of one chunk of rows, one block per row over logits [rows, V] f32 (the
// product's output): the final softcap in place, argmax (first on ties), log-sum-exp, the loss
// where target ≥ 0; with dlog, dlogits = grad_scale·(softmax − onehot)·(1 − (capped/cap)²) in E
// (zero rows where nothing counts).
template <class E>
__global__ void k_cross_entropy(float *logits, int V, const int32_t *target, float cap, float *loss, int *agree,
                                E *dlog, float grad_scale) {
    __shared__ float sh[32];
    __shared__ float smax[32];
    __shared__ int sarg[32];
    long r = blockIdx.x;
    float *row = logits + r * V;
    int y = target[r];
    if (y < 0) { // nothing to learn here; the capped logits may still be read
        if (cap > 0)
            for (int j = threadIdx.x; j < V; j += blockDim.x) row[j] = cap * tanhf(row[j] / cap);
        if (dlog)
            for (int j = threadIdx.x; j < V; j += blockDim.x) dlog[r * V + j] = to_e<E>(0.f);
        if (threadIdx.x == 0) loss[r] = 0, agree[r] = 0;
        return;
    }
    float mx = -INFINITY;
    int arg = 0x7fffffff;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float v = row[j];
        if (cap > 0) row[j] = v = cap * tanhf(v / cap);
        if (v > mx) mx = v, arg = j; // j grows within a thread: the first maximum stays
    }
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, mx, o);
        int a2 = __shfl_xor_sync(0xffffffffu, arg, o);
        if (m2 > mx || (m2 == mx && a2 < arg)) mx = m2, arg = a2;
    }
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) smax[wid] = mx, sarg[wid] = arg;
    __syncthreads();
    mx = lane < nw ? smax[lane] : -INFINITY;
    arg = lane < nw ? sarg[lane] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, mx, o);
        int a2 = __shfl_xor_sync(0xffffffffu, arg, o);
        if (m2 > mx || (m2 == mx && a2 < arg)) mx = m2, arg = a2;
    }
    float sum = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) sum += __expf(row[j] - mx);
    sum = block_sum(sum, sh);
    float lse = mx + logf(sum);
    if (threadIdx.x == 0) loss[r] = lse - row[y], agree[r] = arg == y;
    if (!dlog) return;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float v = row[j], g = __expf(v - lse) - (j == y ? 1.f : 0.f);
        if (cap > 0) g *= 1 - (v / cap) * (v / cap);
        dlog[r * V + j] = to_e<E>(grad_scale * g);
    }
}

// f32 ↔ E copies (the adapters' product copies) and a non-finite scan with the first bad index
template <class E> __global__ void k_to_e(const float *x, E *y, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] = to_e<E>(x[i]);
}

template <class E> __global__ void k_first_nonfinite(const E *x, long n, unsigned long long *first) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        if (!isfinite(f32(x[i]))) atomicMin(first, (unsigned long long)i);
}

// The optimizer. The gradient's squared L2 norm, deterministic: block b of NORM_THREADS threads
// sums entries [b · NORM_CHUNK, (b + 1) · NORM_CHUNK) in double, thread t those ≡ t mod
// NORM_THREADS in index order, then a fixed tree over the threads; k_sum_fixed sums the block
// sums the same way in one block. Double, not f32 pairwise: the host's train_clip_grad_norm sums
// in double, so the two norms agree to ~1e-15 relative (only the order differs) and a clipping
// decision near the threshold goes the same way on both; and a sum of squares of finite f32
// values cannot overflow a double, so the norm is finite exactly when every gradient is.
enum { NORM_THREADS = 256, NORM_CHUNK = 1 << 16 };

__device__ double tree_sum(double v, double *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = NORM_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] = __dadd_rn(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    return sh[0];
}

__global__ void __launch_bounds__(NORM_THREADS) k_sumsq_blocks(const float *g, long n, double *block_sums) {
    __shared__ double sh[NORM_THREADS];
    long lo = (long)blockIdx.x * NORM_CHUNK, hi = lo + NORM_CHUNK < n ? lo + NORM_CHUNK : n;
    double s = 0;
    for (long i = lo + threadIdx.x; i < hi; i += NORM_THREADS) s = __dadd_rn(s, __dmul_rn((double)g[i], (double)g[i]));
    double total = tree_sum(s, sh);
    if (threadIdx.x == 0) block_sums[blockIdx.x] = total;
}

__global__ void __launch_bounds__(NORM_THREADS) k_sum_fixed(const double *x, long n, double *out) {
    __shared__ double sh[NORM_THREADS];
    double s = 0;
    for (long i = threadIdx.x; i < n; i += NORM_THREADS) s = __dadd_rn(s, x[i]);
    double total = tree_sum(s, sh);
    if (threadIdx.x == 0) *out = total;
}

// One Adam(W) update per entry, the host's train_optimizer_update operation for operation: every
// product and sum in double, rounded as the host rounds them (explicit _rn intrinsics, so nvcc
// fuses nothing: the host is built with -ffp-contract=off), the moments stored as f32 and read
// back from f32 as the host's are. clip_scale < 1 first scales the gradient as
// train_clip_grad_norm does (into f32). Then the E copy is refreshed and the gradient zeroed.
struct adam_args {
    double clip_scale;      // 1: no clipping
    double decay;           // AdamW's 1 - lr · wd; 1 for Adam (multiplying by it is skipped)
    int adamw;
    double step_lr;         // the rate with bias correction folded in
    double beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
};

template <class E>
__global__ void k_adam(float *params, E *params_e, float *grads, float *m1, float *m2, long n, adam_args a) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float gf = grads[i];
        if (a.clip_scale < 1.0) gf = __double2float_rn(__dmul_rn((double)gf, a.clip_scale));
        double g = gf;
        float m = __double2float_rn(__dadd_rn(__dmul_rn(a.beta1, (double)m1[i]), __dmul_rn(a.one_minus_beta1, g)));
        float v = __double2float_rn(
            __dadd_rn(__dmul_rn(a.beta2, (double)m2[i]), __dmul_rn(__dmul_rn(a.one_minus_beta2, g), g)));
        double p = params[i];
        if (a.adamw) p = __dmul_rn(p, a.decay);
        double step = __ddiv_rn(__dmul_rn(a.step_lr, (double)m), __dadd_rn(__dsqrt_rn((double)v), a.eps));
        float np = __double2float_rn(__dsub_rn(p, step));
        m1[i] = m, m2[i] = v, params[i] = np, grads[i] = 0.f;
        if (sizeof(E) != sizeof(float)) params_e[i] = to_e<E>(np);
    }
}

// Weights drawn on the device: normal(0, std) from a counter-based hash of (seed, stream, index)
// with Box–Muller, so any element is reproducible without generating the ones before it.
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

template <class E> __global__ void k_random_normal(E *x, long n, float std, unsigned long long seed) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        unsigned long long a = mix64(seed + 0x9e3779b97f4a7c15ull * (unsigned long long)(2 * i + 1));
        unsigned long long b = mix64(a ^ 0xd1b54a32d192ed03ull);
        float u1 = ((a >> 40) + 1) * (1.f / 16777216.f), u2 = (b >> 40) * (1.f / 16777216.f);
        x[i] = to_e<E>(std * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
    }
}

// ---------------------------------------------------------------------------------------------
// Dequantization of one frozen projection into E [rows, cols] (train/quant.h's formats): each value
// is made by the CPU reference's f32 operations in its order (the _rn intrinsics keep nvcc from
// fusing a product into a sum; the host is built with -ffp-contract=off), then rounded to E.

// convert.h's wa_round_to on the device: 0 f32, 1 f16, 2 bf16, round to nearest even (f16 above
// 65,520 to inf in both)
__device__ __forceinline__ float round_storage(int code, float x) {
    if (code == 1) return __half2float(__float2half_rn(x));
    if (code == 2) return __bfloat162float(__float2bfloat16_rn(x));
    return x;
}

__device__ __forceinline__ float load_storage(const void *p, long i, int code) {
    if (code == 0) return ((const float *)p)[i];
    unsigned short h = ((const unsigned short *)p)[i];
    return code == 1 ? __half2float(__ushort_as_half(h)) : __bfloat162float(__ushort_as_bfloat16(h));
}

// mlx4: one thread per uint32 word of eight 4-bit codes (the first in the low bits); a row has
// words_per_row words, a group of 64 values is 8 words; scales and biases [rows, groups] in the
// storage dtype `code`. w' = round(round(scale · q) + bias), as mlx4_dequantize_value.
template <class E>
__global__ void k_dequant_mlx4(const uint32_t *words, const void *scales, const void *biases, int code,
                               long words_total, long words_per_row, E *out) {
    constexpr int per_word = 32 / MLX4_BITS, words_per_group = MLX4_GROUP / per_word;
    long groups_per_row = words_per_row / words_per_group;
    for (long w = blockIdx.x * (long)blockDim.x + threadIdx.x; w < words_total; w += (long)gridDim.x * blockDim.x) {
        long r = w / words_per_row, gi = r * groups_per_row + (w % words_per_row) / words_per_group;
        float scale = load_storage(scales, gi, code), bias = load_storage(biases, gi, code);
        uint32_t word = words[w];
        for (int k = 0; k < per_word; k++) {
            float q = (float)((word >> (MLX4_BITS * k)) & 0xfu);
            float v = round_storage(code, __fmul_rn(scale, q));
            out[w * per_word + k] = to_e<E>(round_storage(code, __fadd_rn(v, bias)));
        }
    }
}

// nf4 on the device: n codes two a byte (the first in the high nibble) over the flat [rows, cols];
// block b of `block` values scaled by code8[absmax_codes[b]] · nested[b / nested_block] + offset
// (double quantization) or by absmax[b] (f32, absmax_codes NULL).
struct nf4_dev {
    const uint8_t *codes, *absmax_codes;
    const float *absmax, *code8, *nested;
    float offset;
    long n, block, nested_block;
};

__device__ __forceinline__ float nf4_scale(const nf4_dev &q, long b) {
    return q.absmax_codes ? __fadd_rn(__fmul_rn(q.code8[q.absmax_codes[b]], q.nested[b / q.nested_block]), q.offset)
                          : q.absmax[b];
}

// one thread per byte; nf4 holds NF4_CODE's 16 values. w' = NF4[code] · absmax', as nf4_dequantize.
// A byte's two values share a block unless the block size is odd.
template <class E> __global__ void k_dequant_nf4(nf4_dev q, const float *nf4, E *out) {
    long bytes = (q.n + 1) / 2;
    for (long i2 = blockIdx.x * (long)blockDim.x + threadIdx.x; i2 < bytes; i2 += (long)gridDim.x * blockDim.x) {
        unsigned byte = q.codes[i2];
        long i = 2 * i2;
        float scale = nf4_scale(q, i / q.block);
        out[i] = to_e<E>(__fmul_rn(nf4[byte >> 4], scale));
        if (i + 1 >= q.n) continue;
        if (q.block & 1) scale = nf4_scale(q, (i + 1) / q.block);
        out[i + 1] = to_e<E>(__fmul_rn(nf4[byte & 0xfu], scale));
    }
}

// fp8: one thread per e4m3 byte of [rows, cols]; value holds fp8_e4m3_decode of every code.
// w' = value(code) · scale[row], as fp8_round_trip.
template <class E>
__global__ void k_dequant_fp8(const uint8_t *codes, const float *row_scale, const float *value, long n, long cols,
                              E *out) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = to_e<E>(__fmul_rn(value[codes[i]], row_scale[i / cols]));
}

int grid_for(long n, int threads) {
    long b = (n + threads - 1) / threads;
    return (int)(b < 8192 ? (b > 0 ? b : 1) : 8192);
}

// Quantization of a projection on the device at load: the kernels (their bit-identity with
// train/quant.c is argued there); the host side is with the loader below.
#include "quant_cuda.cuh"

// ---------------------------------------------------------------------------------------------
// The model on the device.

// A frozen projection as the device keeps it with a quantized base (dlayer.packed): its parts in
// one allocation, and where in the layer's dequantization scratch its E values go.
enum qformat { Q_NONE, Q_DENSE, Q_MLX4, Q_NF4, Q_FP8 };

struct qmat {
    qformat fmt = Q_NONE; // Q_NONE: absent (v with k_eq_v)
    long rows = 0, cols = 0;
    size_t at = 0;            // offset in the scratch, in elements of E
    const void *dense = nullptr; // Q_DENSE: E [rows, cols] (a float tensor of a packed folder)
    const void *words = nullptr, *scales = nullptr, *biases = nullptr; // Q_MLX4
    int scale_code = 0;       // the scales' and biases' dtype: 0 f32, 1 f16, 2 bf16
    nf4_dev nf4 = {};         // Q_NF4
    const void *fp8 = nullptr, *row_scale = nullptr; // Q_FP8: u8 [rows, cols], f32 [rows]
};

struct dlayer {
    gemma_layer_kind kind;
    // frozen weights [out, in], laid out so q|k|v and gate|up are each one [Σout, in] matrix: one
    // product per group instead of three or two
    void *w_qkv, *w_o, *w_gu, *w_down;
    int qd, kd, vd; // output widths of q, k, v (vd 0 with k_eq_v)
    float *input_norm, *post_attn_norm, *pre_ffw_norm, *post_ffw_norm, *q_norm, *k_norm;
    float layer_scalar;
    // with a quantized base: the packed projections; w_qkv, w_o, w_gu and w_down then point into
    // the scratch that dequantize_layer fills
    qmat packed[PROJ_COUNT];
};

// Device memory counted for the peak: the static part (cudaMalloc) and the stream-ordered pool
// (activations, winattn's workspace), whose own high-water mark the driver keeps.
struct gemma_model_dev;

} // namespace

struct gemma_cuda {
    gemma_config cfg;
    lora_config lora;
    gemma_precision precision;
    size_t esize;
    int logit_rows;
    cudaStream_t stream;
    cudaMemPool_t pool;
    blas_api blas;
    cublasHandle_t handle;
    void *blas_workspace;
    wa_context *wa;
    void *weights; // one allocation: every E matrix (with a quantized base: the embedding and head only)
    // a quantized base: the packed projections' allocations; the scratch one layer's projections
    // are dequantized into (the largest layer's q|k|v, o, gate|up and down in E) and the layer it
    // holds now (-1: none); the tables the kernels read (NF4's 16 values, e4m3's 256, the dynamic
    // 8-bit code's 256)
    int quantized;
    const char *base_name;
    std::vector<void *> packed_mem;
    void *dequant;
    int dequant_layer;
    float *tables;
    fp8_engine fp8; // an fp8 base's FP8 products (fp8.on), in place of the dequantization
    float *norms;  // one allocation: every norm weight (f32, Gemma 3's 1 + w applied)
    void *embed, *lm_head;
    float *final_norm;
    std::vector<dlayer> layer;
    // adapters: f32 master, E copy for the products, f32 gradients, Adam's moments; the device's
    // copy is the authoritative one (model_cuda.h)
    size_t param_count;
    float *params, *grads;
    void *params_e;
    float *moment1, *moment2;
    double *norm_partial;       // the gradient norm's block sums, then their total
    unsigned long long *first_bad; // k_first_nonfinite's answer
    const float *params_pinned; // host->params, page-locked while this object lives
    size_t static_bytes;
    // The layer inputs backward() keeps for its recomputation (docs/train.md §7). With
    // inputs_on_host, layer l's input xs[l] for l < layers - 1 lives in page-locked host memory
    // (host_inputs, room for host_tokens tokens, [layers - 1, T, hidden] E at a step of T tokens)
    // and the device holds two [T, hidden] buffers it passes through: the forward copies each
    // input down on copy_stream while the next layer runs, the backward copies layer l - 1's up
    // while layer l's runs. slot_released[s]: g->stream is done with device buffer s so far (its
    // writing in the forward, its reading in the backward); slot_copied[s]: the last copy that
    // reads or writes buffer s has ended. Without inputs_on_host (the host refused the memory:
    // gemma_cuda_token_budget) all L + 1 inputs stay on the device. inputs_line says which.
    int inputs_on_host;
    void *host_inputs;
    long host_tokens;
    cudaStream_t copy_stream;
    cudaEvent_t slot_released[2], slot_copied[2], copies_joined;
    char inputs_line[320];
    // WINATTN_TRAIN_PROFILE=1: where a step's device time goes, by phase (events between marks)
    struct {
        int on, gemm_phase, elem_phase;
        std::vector<cudaEvent_t> ev;
        std::vector<int> phase;
        size_t used;
        double flop[GEMMA_PHASES]; // the products' operations since the last close, by phase
        gemma_cuda_profile sum;    // the closed calls since the last gemma_cuda_profile_take
    } prof;
    // RoPE tables per layer kind, for positions up to rope_len
    float *cosv[2], *sinv[2];
    int rope_len;
    char describe[320];
};

namespace {

// model_cuda.h's phases, short names inside this file. PH_Q8: what the FP8 products add around their
// cuBLASLt calls (the inputs' per-row quantization, the layer's transposed codes); PH_COPY:
// g->stream waiting for a layer input's copy to or from the host to end (what of the copies the
// computation does not hide); PH_OPT: gemma_cuda_optimizer_step. Each of these three is printed only
// where it ran.
enum {
    PH_GEMM = GEMMA_PHASE_PRODUCTS,
    PH_LORA = GEMMA_PHASE_LORA,
    PH_ATTN = GEMMA_PHASE_ATTENTION,
    PH_ELEM = GEMMA_PHASE_ELEMENTWISE,
    PH_HEAD = GEMMA_PHASE_HEAD,
    PH_Q8 = GEMMA_PHASE_FP8_QUANT,
    PH_COPY = GEMMA_PHASE_COPY_WAITS,
    PH_OPT = GEMMA_PHASE_OPTIMIZER,
    PH_COUNT = GEMMA_PHASES
};
const char *const phase_name[PH_COUNT] = {"products", "LoRA products", "attention", "elementwise", "head",
                                          "FP8 quantization", "layer-input copy waits", "optimizer"};

// From this point on the device's time counts towards phase p (until the next mark).
void mark(gemma_cuda *g, int p) {
    auto &P = g->prof;
    if (!P.on) return;
    if (P.used == P.ev.size()) {
        cudaEvent_t e;
        CU(cudaEventCreate(&e));
        P.ev.push_back(e);
        P.phase.push_back(0);
    }
    CU(cudaEventRecord(P.ev[P.used], g->stream));
    P.phase[P.used++] = p;
}

// Starts a call's profile in phase p: the marks and operation counts of a call left unclosed (it
// failed) are dropped.
void profile_open(gemma_cuda *g, int p) {
    g->prof.used = 0;
    for (double &f : g->prof.flop) f = 0;
    mark(g, p);
}

// A product of m x n x k counts 2·m·n·k operations towards the phase it runs in.
void count_flop(gemma_cuda *g, long m, long n, long k) {
    if (g->prof.on) g->prof.flop[g->prof.gemm_phase] += 2.0 * m * n * k;
}

// Closes the marks of a call (T tokens; 0 for the optimizer update) and adds its phases to the sum
// gemma_cuda_profile_take hands over; with `what`, prints them, with the products' rate.
void profile_close(gemma_cuda *g, const char *what, int T) {
    auto &P = g->prof;
    if (!P.on || P.used == 0) return;
    mark(g, PH_ELEM);
    CU(cudaStreamSynchronize(g->stream));
    double ms[PH_COUNT] = {0}, total = 0;
    for (size_t i = 0; i + 1 < P.used; i++) {
        float t = 0;
        CU(cudaEventElapsedTime(&t, P.ev[i], P.ev[i + 1]));
        ms[P.phase[i]] += t;
        total += t;
    }
    P.used = 0;
    P.sum.passes++;
    P.sum.tokens += T;
    for (int p = 0; p < PH_COUNT; p++) P.sum.ms[p] += ms[p], P.sum.flop[p] += P.flop[p];
    if (what) {
        fprintf(stderr, "profile %s (%d tokens): %.1f ms on the device:", what, T, total);
        for (int p = 0; p < PH_COUNT; p++) {
            if (p >= PH_Q8 && ms[p] == 0) continue;
            fprintf(stderr, "%s %s %.1f", p ? "," : "", phase_name[p], ms[p]);
            // the phases that are products alone (the head's time holds its cross-entropy too)
            if ((p == PH_GEMM || p == PH_LORA) && P.flop[p] > 0 && ms[p] > 0)
                fprintf(stderr, " (%.0f TFLOP/s)", P.flop[p] / (ms[p] * 1e9));
        }
        fprintf(stderr, "\n");
    }
}

void *dev_alloc(gemma_cuda *g, size_t bytes) {
    void *p = nullptr;
    CU(cudaMalloc(&p, bytes ? bytes : 16));
    g->static_bytes += bytes;
    return p;
}

// stream-ordered scratch, freed on scope exit
struct scratch {
    gemma_cuda *g;
    std::vector<void *> ptrs;
    explicit scratch(gemma_cuda *g_) : g(g_) {}
    template <class T> T *get(size_t count) {
        void *p = nullptr;
        CU(cudaMallocAsync(&p, (count ? count : 1) * sizeof(T), g->stream));
        ptrs.push_back(p);
        return (T *)p;
    }
    ~scratch() {
        for (void *p : ptrs) cudaFreeAsync(p, g->stream);
    }
};

const char *blas_status(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "out of memory";
    case CUBLAS_STATUS_INVALID_VALUE: return "invalid value";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "architecture mismatch";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "execution failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "not supported";
    default: return "error";
    }
}

// Row-major C[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · C, through the column-major
// library as Cᵀ = op(B)ᵀ · op(A)ᵀ. f32 accumulation always; with f32 operands pure f32 (the
// handle's math mode forbids TF32), with bf16 operands the tensor cores.
void gemm(gemma_cuda *g, long m, long n, long k, float alpha, mat A, mat B, float beta, void *C, cudaDataType_t ct,
          long ldc) {
    if (m == 0 || n == 0) return;
    mark(g, g->prof.gemm_phase);
    count_flop(g, m, n, k);
    cublasStatus_t s = g->blas.gemm_ex(g->handle, B.trans ? CUBLAS_OP_T : CUBLAS_OP_N,
                                       A.trans ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n, (int)m, (int)k, &alpha, B.p, B.t,
                                       (int)B.ld, A.p, A.t, (int)A.ld, &beta, C, ct, (int)ldc, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        fail("cuBLAS GemmEx (%ld x %ld x %ld): %s", m, n, k, blas_status(s));
    mark(g, g->prof.elem_phase);
}

// the LoRA products count as their own phase
struct lora_phase {
    gemma_cuda *g;
    explicit lora_phase(gemma_cuda *g_) : g(g_) { g->prof.gemm_phase = PH_LORA; }
    ~lora_phase() { g->prof.gemm_phase = PH_GEMM; }
};

// ---------------------------------------------------------------------------------------------
// FP8 products of an fp8 base: in bf16 mode on compute capability 8.9 or more, where cuBLASLt takes
// outer-vector scaling (one f32 scale per row of each operand), the frozen projections multiply as
// e4m3 codes instead of being dequantized. One primitive, row-major, both operands K-major (the
// "TN" layout FP8 needs):
//   D[r, c] = x_scale[r] · w_scale[c] · Σ_k Xq[r, k] · Wq[c, k]     (D bf16, f32 accumulation)
// Forward y = x Wᵀ: Xq the activation rows quantized on the fly (one scale a token), Wq the codes
// as stored ([out, in]), w_scale their row scales. Input gradient dx = dy W, whose sum runs over
// the weight's rows: the row scales are folded into dy first (dy·diag(s)), that quantized a token
// a row, and Wq the codes transposed ([in, out], one layer at a time into a scratch), w_scale 1.
// Quantization: scale = amax / 448 of the row (1 for a row of zeros), code = e4m3(v / scale)
// rounded to nearest, ties to even, saturating (quant.h's fp8_e4m3_encode); e4m3 for the gradients
// too: the per-row scale maps each row's largest value to 448, so e5m2's wider range buys nothing
// and its one bit fewer would double the error. Fast accumulation stays off (cuBLASLt's default):
// the tensor cores' partial sums are promoted to f32 at intervals.

__device__ float block_max(float v, float *shared32) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads(); // shared32 may still be read by a previous call
    if (lane == 0) shared32[wid] = v;
    __syncthreads();
    v = lane < nw ? shared32[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Rows of x [rows, cols] (row stride ldx), each value times col_scale[col] when given (an f32
// product), to e4m3 codes q [rows, cols] (contiguous) with row_scale[row]; one block per row. The
// host reproduces it exactly (tests/test_train_cuda.c): f32 products, max, __fdiv_rn.
template <class E>
__global__ void k_quant_rows_e4m3(const E *x, long ldx, const float *col_scale, int cols, uint8_t *q,
                                  float *row_scale) {
    __shared__ float sh[32];
    const E *xr = x + (long)blockIdx.x * ldx;
    uint8_t *qr = q + (long)blockIdx.x * cols;
    float amax = 0;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = col_scale ? __fmul_rn(f32(xr[i]), col_scale[i]) : f32(xr[i]);
        amax = fmaxf(amax, fabsf(v));
    }
    amax = block_max(amax, sh);
    float s = __fdiv_rn(amax, FP8_E4M3_MAX);
    if (s == 0.f) s = 1.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = col_scale ? __fmul_rn(f32(xr[i]), col_scale[i]) : f32(xr[i]);
        qr[i] = __nv_cvt_float_to_fp8(__fdiv_rn(v, s), __NV_SATFINITE, __NV_E4M3);
    }
    if (threadIdx.x == 0) row_scale[blockIdx.x] = s;
}

// codes [rows, cols] → dst[c · ldd + r]: the columns of a row-major [cols, ldd] (a projection's
// block of its group's transposed codes); 32 x 32 tiles through shared memory
__global__ void k_transpose_codes(const uint8_t *src, long rows, long cols, uint8_t *dst, long ldd) {
    __shared__ uint8_t tile[32][33];
    long c0 = (long)blockIdx.x * 32, r0 = (long)blockIdx.y * 32;
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        long r = r0 + i, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[i][threadIdx.x] = src[r * cols + c];
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
        long c = c0 + i, r = r0 + threadIdx.x;
        if (r < rows && c < cols) dst[c * ldd + r] = tile[threadIdx.x][i];
    }
}

template <class E> void quant_rows(cudaStream_t st, const E *x, long ldx, const float *col_scale, long rows, long cols,
                                   uint8_t *q, float *row_scale) {
    if (rows == 0) return;
    k_quant_rows_e4m3<E><<<(unsigned)rows, ROW_THREADS, 0, st>>>(x, ldx, col_scale, (int)cols, q, row_scale);
    CU(cudaGetLastError());
}

void transpose_codes(cudaStream_t st, const uint8_t *src, long rows, long cols, uint8_t *dst, long ldd) {
    dim3 grid((unsigned)((cols + 31) / 32), (unsigned)((rows + 31) / 32));
    k_transpose_codes<<<grid, dim3(32, 8), 0, st>>>(src, rows, cols, dst, ldd);
    CU(cudaGetLastError());
}

// the largest power of two (at most 256) dividing the address: what the heuristic may assume
unsigned alignment_of(const void *p) {
    uintptr_t a = (uintptr_t)p;
    unsigned al = 1;
    while (al < 256 && !(a & al)) al <<= 1;
    return al;
}

// The primitive above through cuBLASLt. cuBLASLt is column-major: D as [cols, rows] (ld ldd) =
// op(A) · B with A = Wq stored [k, cols] (ld ldw) and transposed, B = Xq stored [k, rows] (ld ldx),
// A's scale vector of length cols (w_scale), B's of length rows (x_scale). The status, not a
// failure: the probe at open takes a refusal as "this device has no such product".
cublasStatus_t fp8_product_status(fp8_engine *f, cudaStream_t st, long rows, long cols, long k, const uint8_t *xq,
                                  long ldx, const float *x_scale, const uint8_t *wq, long ldw, const float *w_scale,
                                  bf16 *d, long ldd) {
    const lt_api &L = f->lt;
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
    cublasStatus_t s = L.desc_create(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N, mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    const void *pa = w_scale, *pb = x_scale;
    auto set = [&](cublasLtMatmulDescAttributes_t a, const void *v, size_t n) {
        if (s == CUBLAS_STATUS_SUCCESS) s = L.desc_set(desc, a, v, n);
    };
    set(CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    set(CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode);
    set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode);
    set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof pa);
    set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof pb);
    if (s == CUBLAS_STATUS_SUCCESS) s = L.layout_create(&la, CUDA_R_8F_E4M3, (uint64_t)k, (uint64_t)cols, ldw);
    if (s == CUBLAS_STATUS_SUCCESS) s = L.layout_create(&lb, CUDA_R_8F_E4M3, (uint64_t)k, (uint64_t)rows, ldx);
    if (s == CUBLAS_STATUS_SUCCESS) s = L.layout_create(&ld, CUDA_R_16BF, (uint64_t)cols, (uint64_t)rows, ldd);
    unsigned align[3] = {alignment_of(wq), alignment_of(xq), alignment_of(d)};
    const fp8_algo *found = nullptr;
    for (const fp8_algo &a : f->algos)
        if (a.m == cols && a.n == rows && a.k == k && a.lda == ldw && a.ldb == ldx && a.ldd == ldd &&
            !memcmp(a.align, align, sizeof align))
            found = &a;
    if (s == CUBLAS_STATUS_SUCCESS && !found) {
        if (f->algos.size() >= 256) f->algos.clear(); // batches of many lengths: a bound, then asked afresh
        cublasLtMatmulPreference_t pref = nullptr;
        s = L.pref_create(&pref);
        uint64_t ws = f->workspace_bytes;
        uint32_t al[3] = {align[0], align[1], align[2]};
        if (s == CUBLAS_STATUS_SUCCESS) s = L.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
        if (s == CUBLAS_STATUS_SUCCESS) s = L.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al[0], 4);
        if (s == CUBLAS_STATUS_SUCCESS) s = L.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al[1], 4);
        if (s == CUBLAS_STATUS_SUCCESS) s = L.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al[2], 4);
        if (s == CUBLAS_STATUS_SUCCESS) s = L.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al[2], 4);
        cublasLtMatmulHeuristicResult_t h = {};
        int got = 0;
        if (s == CUBLAS_STATUS_SUCCESS) s = L.heuristic(f->handle, desc, la, lb, ld, ld, pref, 1, &h, &got);
        if (s == CUBLAS_STATUS_SUCCESS && (got < 1 || h.state != CUBLAS_STATUS_SUCCESS)) s = CUBLAS_STATUS_NOT_SUPPORTED;
        if (pref) L.pref_destroy(pref);
        if (s == CUBLAS_STATUS_SUCCESS) {
            fp8_algo a = {cols, rows, k, ldw, ldx, ldd, {align[0], align[1], align[2]}, h.algo};
            f->algos.push_back(a);
            found = &f->algos.back();
        }
    }
    float one = 1.f, zero = 0.f;
    if (s == CUBLAS_STATUS_SUCCESS)
        s = L.matmul(f->handle, desc, &one, wq, la, xq, lb, &zero, d, ld, d, ld, &found->algo, f->workspace,
                     f->workspace_bytes, st);
    if (ld) L.layout_destroy(ld);
    if (lb) L.layout_destroy(lb);
    if (la) L.layout_destroy(la);
    if (desc) L.desc_destroy(desc);
    return s;
}

void fp8_product(fp8_engine *f, cudaStream_t st, long rows, long cols, long k, const uint8_t *xq, long ldx,
                 const float *x_scale, const uint8_t *wq, long ldw, const float *w_scale, bf16 *d, long ldd) {
    if (rows == 0 || cols == 0) return;
    cublasStatus_t s = fp8_product_status(f, st, rows, cols, k, xq, ldx, x_scale, wq, ldw, w_scale, d, ldd);
    if (s != CUBLAS_STATUS_SUCCESS) fail("cuBLASLt FP8 product (%ld x %ld x %ld): %s", rows, cols, k, blas_status(s));
}

// FP8 products apply to a model whose every frozen projection is fp8 codes (Q_FP8; Q_NONE for an
// absent v), in bf16 mode, on compute capability 8.9 or more, with every dimension a product
// reads a multiple of 16 (FP8's 16-byte alignment of rows and leading dimensions).
int fp8_applies(const gemma_cuda *g, const cudaDeviceProp &prop) {
    if (g->precision != PRECISION_BF16 || !g->quantized || prop.major * 10 + prop.minor < 89) return 0;
    for (const dlayer &L : g->layer)
        for (int p = 0; p < PROJ_COUNT; p++) {
            const qmat &q = L.packed[p];
            if (q.fmt == Q_NONE) continue;
            if (q.fmt != Q_FP8 || q.rows % 16 || q.cols % 16) return 0;
        }
    return 1;
}

void fp8_close(fp8_engine *f) {
    if (f->handle) f->lt.destroy(f->handle);
    f->handle = nullptr;
    cudaFree(f->ones);
    f->ones = nullptr;
    if (f->lt.lib) dlclose(f->lt.lib);
    f->lt.lib = nullptr;
    f->on = 0;
}

// cuBLASLt opened (a one-line failure where it is missing), its handle, the ones vector of length
// max_in, and a product of the model's kind tried (17 rows, as token counts need not be multiples
// of 16, into columns 16..31 of a 32-wide output, as q, k and v write theirs): 1 when it runs, 0
// (and everything released) when the library refuses outer-vector FP8 scaling on this device.
int fp8_open(fp8_engine *f, cudaStream_t st, void *workspace, size_t workspace_bytes, long max_in) {
    lt_open(&f->lt);
    if (f->lt.create(&f->handle) != CUBLAS_STATUS_SUCCESS) {
        f->handle = nullptr;
        fail("cublasLtCreate failed");
    }
    f->workspace = workspace, f->workspace_bytes = workspace_bytes;
    std::vector<float> ones((size_t)std::max(max_in, 32L), 1.f); // 32: the probe's rows too
    CU(cudaMalloc(&f->ones, ones.size() * sizeof(float)));
    CU(cudaMemcpy(f->ones, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
    void *probe = nullptr;
    size_t bytes = 256 + 512 + 17 * 32 * sizeof(bf16);
    CU(cudaMalloc(&probe, bytes));
    CU(cudaMemsetAsync(probe, 0, bytes, st));
    uint8_t *w = (uint8_t *)probe, *x = w + 256;
    bf16 *d = (bf16 *)(x + 512);
    cublasStatus_t s = fp8_product_status(f, st, 17, 16, 16, x, 16, f->ones, w, 16, f->ones, d + 16, 32);
    cudaError_t e = cudaStreamSynchronize(st);
    cudaFree(probe);
    if (e != cudaSuccess) fail("the FP8 product's probe: %s", cudaGetErrorString(e));
    if (s == CUBLAS_STATUS_SUCCESS) return f->on = 1;
    fp8_close(f);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// A packed batch on the device (model.c's packing: cu, pos, tokens, target).

struct dbatch {
    int n, T, longest;
    int32_t *cu, *pos, *tokens, *target;
    std::vector<int32_t> h_target;
};

void batch_upload(gemma_cuda *g, scratch &S, const gemma_seq *seqs, int n, dbatch *b) {
    if (n < 1) fail("a batch needs at least one record");
    long T = 0;
    b->longest = 0;
    for (int i = 0; i < n; i++) {
        if (seqs[i].len < 1) fail("record %d: a sequence needs at least one token", i + 1);
        for (int t = 0; t < seqs[i].len; t++)
            if (seqs[i].tokens[t] < 0 || seqs[i].tokens[t] >= g->cfg.vocab)
                fail("record %d: token %d at position %d is outside the vocabulary (%d)", i + 1, seqs[i].tokens[t], t,
                     g->cfg.vocab);
        T += seqs[i].len;
        if (T > INT32_MAX) fail("a packed batch must hold fewer than 2^31 tokens");
        b->longest = seqs[i].len > b->longest ? seqs[i].len : b->longest;
    }
    b->n = n;
    b->T = (int)T;
    std::vector<int32_t> host((size_t)n + 1 + 3 * (size_t)T);
    int32_t *cu = host.data(), *pos = cu + n + 1, *tok = pos + T, *tgt = tok + T;
    cu[0] = 0;
    for (int i = 0; i < n; i++) {
        const gemma_seq *s = &seqs[i];
        int32_t r0 = cu[i];
        cu[i + 1] = r0 + s->len;
        for (int t = 0; t < s->len; t++) {
            pos[r0 + t] = t;
            tok[r0 + t] = s->tokens[t];
            int counted = t < s->len - 1 && (!s->target_mask || s->target_mask[t]);
            tgt[r0 + t] = counted ? s->tokens[t + 1] : -1;
        }
    }
    int32_t *d = S.get<int32_t>(host.size());
    CU(cudaMemcpyAsync(d, host.data(), host.size() * sizeof(int32_t), cudaMemcpyHostToDevice, g->stream));
    b->cu = d, b->pos = d + n + 1, b->tokens = b->pos + T, b->target = b->tokens + T;
    b->h_target.assign(tgt, tgt + T);
    CU(cudaStreamSynchronize(g->stream)); // host is a local vector
}

// RoPE tables in double on the host, as model.c's rope_table (exact angles), for positions up to P
void rope_tables(gemma_cuda *g, int P) {
    if (P <= g->rope_len) return;
    for (int k = 0; k < 2; k++) {
        const gemma_rope *r = &g->cfg.kind[k].rope;
        int D = g->cfg.kind[k].head_dim, half = D / 2;
        int rotated = r->proportional ? (int)(r->partial * D / 2) : half;
        std::vector<float> c((size_t)P * half), s((size_t)P * half);
        for (int j = 0; j < half; j++) {
            double inv = j < rotated ? pow(r->theta, -(double)(2 * j) / D) / r->linear_factor : 0.0;
            for (int t = 0; t < P; t++) {
                c[(size_t)t * half + j] = (float)cos(t * inv);
                s[(size_t)t * half + j] = (float)sin(t * inv);
            }
        }
        cudaFree(g->cosv[k]);
        cudaFree(g->sinv[k]);
        g->cosv[k] = g->sinv[k] = nullptr;
        CU(cudaMalloc(&g->cosv[k], c.size() * sizeof(float)));
        CU(cudaMalloc(&g->sinv[k], s.size() * sizeof(float)));
        CU(cudaMemcpy(g->cosv[k], c.data(), c.size() * sizeof(float), cudaMemcpyHostToDevice));
        CU(cudaMemcpy(g->sinv[k], s.data(), s.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    g->rope_len = P;
}

// ---------------------------------------------------------------------------------------------
// One layer's activations, sized for the widest layer kind and reused by every layer.

template <class E> struct acts {
    int T;
    E *a, *qkv, *qr, *kr, *vn, *o, *ao, *h, *mi, *gu, *z, *mo;
    E *t[PROJ_COUNT]; // LoRA x·A
    float *lse;
    uint8_t *q8;     // FP8 products: one operand's rows quantized, [T, fp8.width]
    float *q8_scale; // and their scales [T]
    // backward
    E *d_mo, *d_z, *d_gu, *d_mi, *d_ao, *d_o, *d_qr, *d_kr, *d_vn, *d_qkv, *d_a, *d_t;
};

// The E buffers of A (the forward's, and with backward their gradients), each `rows(width)`:
// width elements per token. One list for the allocation and for the token budget's count.
template <class E, class Rows> void acts_layout(const gemma_cuda *g, int backward, acts<E> *A, Rows rows) {
    const gemma_config *c = &g->cfg;
    long H = c->hidden, I = c->intermediate, r = g->lora.rank > 0 ? g->lora.rank : 1, qd = 0, kd = 0, qkv = 0;
    for (const dlayer &L : g->layer) {
        qd = std::max(qd, (long)L.qd);
        kd = std::max(kd, (long)L.kd);
        qkv = std::max(qkv, (long)(L.qd + L.kd + L.vd));
    }
    A->a = rows(H), A->qkv = rows(qkv), A->qr = rows(qd), A->kr = rows(kd), A->vn = rows(kd), A->o = rows(qd);
    A->ao = rows(H), A->h = rows(H), A->mi = rows(H), A->gu = rows(2 * I), A->z = rows(I), A->mo = rows(H);
    for (int p = 0; p < PROJ_COUNT; p++) A->t[p] = rows(r);
    if (!backward) return;
    A->d_mo = rows(H), A->d_z = rows(I), A->d_gu = rows(2 * I), A->d_mi = rows(H), A->d_ao = rows(H);
    A->d_o = rows(qd), A->d_qr = rows(qd), A->d_kr = rows(kd), A->d_vn = rows(kd), A->d_qkv = rows(qkv);
    A->d_a = rows(H), A->d_t = rows(r);
}

template <class E> void acts_alloc(gemma_cuda *g, scratch &S, int T, int backward, acts<E> *A) {
    A->T = T;
    acts_layout<E>(g, backward, A, [&](long width) { return S.get<E>((size_t)T * width); });
    A->lse = S.get<float>((size_t)g->cfg.heads * T);
    A->q8 = g->fp8.on ? S.get<uint8_t>((size_t)T * g->fp8.width) : nullptr;
    A->q8_scale = g->fp8.on ? S.get<float>((size_t)T) : nullptr;
}

// elements of E per token that acts_alloc(backward) takes
long acts_elems_per_token(const gemma_cuda *g, int backward) {
    acts<float> A;
    long n = 0;
    acts_layout<float>(g, backward, &A, [&](long width) {
        n += width;
        return (float *)nullptr;
    });
    return n;
}

// ---------------------------------------------------------------------------------------------
// The frozen products of one layer, y = x Wᵀ and dx = dy W over a group of projections that share
// their input (q|k|v, o, gate|up, down: first..last in projection order) whose fused output or
// gradient has width `width`: through the FP8 products where they apply, else one product on the
// E weights (the dequantized scratch with a quantized base).

// the projections first..last of layer L in order, each with its output's column offset in the group
template <class F> void for_group(const dlayer &L, int first, int last, F f) {
    long off = 0;
    for (int p = first; p <= last; p++) {
        const qmat &q = L.packed[p];
        if (q.fmt == Q_NONE) continue;
        f(q, off);
        off += q.rows;
    }
}

// The backward's operands of layer l: each group's codes transposed into one [in, width] matrix at
// the group's offset in the scratch (the codes take a byte where the dequantized values took an
// element: the groups fit as they did), and every row scale of the layer stacked in projection
// order after them. Kept for the layer's backward; the next layer's overwrites them in stream order.
void fp8_prepare_backward(gemma_cuda *g, int l) {
    fp8_engine *f = &g->fp8;
    if (f->layer == l) return;
    const dlayer &L = g->layer[l];
    static const int groups[4][2] = {{PROJ_Q, PROJ_V}, {PROJ_O, PROJ_O}, {PROJ_GATE, PROJ_UP}, {PROJ_DOWN, PROJ_DOWN}};
    long scale_off = 0;
    for (const auto &grp : groups) {
        long width = 0;
        for_group(L, grp[0], grp[1], [&](const qmat &q, long) { width += q.rows; });
        uint8_t *dst = f->codes_t + L.packed[grp[0]].at;
        for_group(L, grp[0], grp[1], [&](const qmat &q, long off) {
            transpose_codes(g->stream, (const uint8_t *)q.fp8, q.rows, q.cols, dst + off, width);
            CU(cudaMemcpyAsync(f->scale_t + scale_off + off, q.row_scale, (size_t)q.rows * sizeof(float),
                               cudaMemcpyDeviceToDevice, g->stream));
        });
        scale_off += width;
    }
    f->layer = l;
}

// where layer L's group starting at projection `first` has its stacked row scales
long fp8_scale_offset(const dlayer &L, int first) {
    long off = 0;
    for (int p = PROJ_Q; p < first; p++) off += L.packed[p].fmt == Q_NONE ? 0 : L.packed[p].rows;
    return off;
}

// y [T, width] (row stride width) = x [T, K] · Wᵀ; W the E weights [width, K] of the group
template <class E>
void frozen_forward(gemma_cuda *g, const dlayer &L, int first, int last, acts<E> *A, const E *x, long K, const void *W,
                    E *y, long width) {
    int T = A->T;
    if (!g->fp8.on) {
        gemm(g, T, width, K, 1, M(x, K), M((const E *)W, K, true), 0, y, dtype_of<E>(), width);
        return;
    }
    mark(g, PH_Q8);
    quant_rows<E>(g->stream, x, K, nullptr, T, K, A->q8, A->q8_scale);
    mark(g, g->prof.gemm_phase);
    for_group(L, first, last, [&](const qmat &q, long off) {
        count_flop(g, T, q.rows, K);
        fp8_product(&g->fp8, g->stream, T, q.rows, K, A->q8, K, A->q8_scale, (const uint8_t *)q.fp8, K,
                    (const float *)q.row_scale, (bf16 *)(y + off), width);
    });
    mark(g, g->prof.elem_phase);
}

// dx [T, K] = dy [T, width] (row stride width) · W; W the E weights [width, K] of the group that
// starts at projection `first` (fp8_prepare_backward has its transposed codes)
template <class E>
void frozen_input_grad(gemma_cuda *g, int l, int first, acts<E> *A, const E *dy, long width, const void *W, E *dx,
                       long K) {
    int T = A->T;
    if (!g->fp8.on) {
        gemm(g, T, K, width, 1, M(dy, width), M((const E *)W, K), 0, dx, dtype_of<E>(), K);
        return;
    }
    const dlayer &L = g->layer[l];
    mark(g, PH_Q8);
    fp8_prepare_backward(g, l);
    quant_rows<E>(g->stream, dy, width, g->fp8.scale_t + fp8_scale_offset(L, first), T, width, A->q8, A->q8_scale);
    mark(g, g->prof.gemm_phase);
    count_flop(g, T, K, width);
    fp8_product(&g->fp8, g->stream, T, K, width, A->q8, width, A->q8_scale, g->fp8.codes_t + L.packed[first].at, width,
                g->fp8.ones, (bf16 *)dx, K);
    mark(g, g->prof.elem_phase);
}

// ---------------------------------------------------------------------------------------------
// The LoRA linear: y = x Wᵀ + s (x A) B, for one projection whose output is a column block of a
// fused product (y with stride ldy).

template <class E> const E *lora_a(gemma_cuda *g, const lora_slot *s) { return (const E *)g->params_e + s->a; }
template <class E> const E *lora_b(gemma_cuda *g, const lora_slot *s) { return (const E *)g->params_e + s->b; }

template <class E>
void lora_fwd(gemma_cuda *g, const gemma_model_f32 *host, int l, gemma_proj p, const E *x, int T, E *y, long ldy,
              E *t) {
    int si = host->layer[l].lora[p];
    if (si < 0) return;
    const lora_slot *s = &host->slots[si];
    int r = g->lora.rank;
    lora_phase lp(g);
    gemm(g, T, r, s->in, 1, M(x, s->in), M(lora_a<E>(g, s), r), 0, t, dtype_of<E>(), r);
    gemm(g, T, s->out, r, (float)g->lora.scale, M((const E *)t, r), M(lora_b<E>(g, s), s->out), 1, y, dtype_of<E>(),
         ldy);
}

// The adapter gradients and dx += dt Aᵀ for one projection: dB += s tᵀ dy, dt = s dy Bᵀ,
// dA += xᵀ dt. dy has stride lddy (a column block of a fused gradient).
template <class E>
void lora_bwd(gemma_cuda *g, const gemma_model_f32 *host, int l, gemma_proj p, const E *x, const E *t, const E *dy,
              long lddy, int T, E *dx, E *dt) {
    int si = host->layer[l].lora[p];
    if (si < 0) return;
    const lora_slot *s = &host->slots[si];
    int r = g->lora.rank;
    float sc = (float)g->lora.scale;
    lora_phase lp(g);
    gemm(g, r, s->out, T, sc, M(t, r, true), M(dy, lddy), 1, g->grads + s->b, CUDA_R_32F, s->out);
    gemm(g, T, r, s->out, sc, M(dy, lddy), M(lora_b<E>(g, s), s->out, true), 0, dt, dtype_of<E>(), r);
    gemm(g, s->in, r, T, 1, M(x, s->in, true), M((const E *)dt, r), 1, g->grads + s->a, CUDA_R_32F, r);
    gemm(g, T, s->in, r, 1, M((const E *)dt, r), M(lora_a<E>(g, s), r, true), 1, dx, dtype_of<E>(), s->in);
}

// ---------------------------------------------------------------------------------------------
// Attention through winattn: q [T, Hq, D], k and v [T, Hkv, D] contiguous, one varlen call.

wa_attn_desc layer_desc(const gemma_cuda *g, int l) {
    const gemma_config *c = &g->cfg;
    wa_attn_desc d = c->layer_kind[l] == LAYER_SLIDING ? wa_attn_desc_sliding(c->sliding_window) : wa_attn_desc_causal();
    d.scale = (float)c->score_scale;
    d.softcap = (float)c->attn_softcap;
    return d;
}

template <class E> wa_tensor dev_thd(const E *p, int T, int H, int D) {
    wa_tensor t = wa_tensor_thd((void *)p, sizeof(E) == 2 ? WA_BF16 : WA_F32, T, H, D);
    t.device = WA_DEVICE_CUDA;
    return t;
}

wa_tensor dev_lse(float *p, int H, int T) {
    wa_tensor t = wa_tensor_lse_varlen(p, H, T);
    t.device = WA_DEVICE_CUDA;
    return t;
}

void wa_check(wa_status st, const char *what) {
    if (st != WA_OK) fail("winattn %s: %s (%s)", what, wa_status_str(st), wa_last_error());
}

// ---------------------------------------------------------------------------------------------
// A quantized base: layer l's projections into the scratch its w_qkv, w_o, w_gu and w_down point
// at, unless the scratch holds them already (the backward recomputes a layer's forward, then runs
// its backward: one dequantization serves both, and the forward's last layer serves the
// backward's first). Everything runs on g->stream, so the products of the layer before have read
// the scratch before it is overwritten, and this layer's products read it after.
enum { NF4_TABLE = 0, FP8_TABLE = 16, DYNAMIC_TABLE = 16 + 256, TABLES = 16 + 256 + 256 };

template <class E> void dequantize_layer(gemma_cuda *g, int l) {
    if (!g->quantized || g->fp8.on || g->dequant_layer == l) return; // FP8 products read the codes
    const dlayer &L = g->layer[l];
    cudaStream_t st = g->stream;
    for (int p = 0; p < PROJ_COUNT; p++) {
        const qmat &q = L.packed[p];
        long n = q.rows * q.cols;
        E *dst = (E *)g->dequant + q.at;
        switch (q.fmt) {
        case Q_NONE: break;
        case Q_DENSE: CU(cudaMemcpyAsync(dst, q.dense, (size_t)n * sizeof(E), cudaMemcpyDeviceToDevice, st)); break;
        case Q_MLX4: {
            long words = n / (32 / MLX4_BITS);
            k_dequant_mlx4<E><<<grid_for(words, 256), 256, 0, st>>>((const uint32_t *)q.words, q.scales, q.biases,
                                                                   q.scale_code, words, q.cols / (32 / MLX4_BITS), dst);
            break;
        }
        case Q_NF4:
            k_dequant_nf4<E><<<grid_for((n + 1) / 2, 256), 256, 0, st>>>(q.nf4, g->tables + NF4_TABLE, dst);
            break;
        case Q_FP8:
            k_dequant_fp8<E><<<grid_for(n, 256), 256, 0, st>>>((const uint8_t *)q.fp8, (const float *)q.row_scale,
                                                              g->tables + FP8_TABLE, n, q.cols, dst);
            break;
        }
    }
    CU(cudaGetLastError());
    g->dequant_layer = l;
}

// ---------------------------------------------------------------------------------------------
// One decoder layer, as model.c's layer_forward / layer_backward.

// How a layer's forward runs. PASS_SWEEP: one of the forward's passes over the layers in order,
// into out: layer l - 1 has left this layer's normed input in A->a (l > 0), and the residual that
// closes this layer writes the next one's beside out (one pass over the row for both).
// PASS_RECOMPUTE: the backward's recomputation of the layer's insides alone: its input normed
// here, no closing residual, no output (out NULL).
enum layer_pass { PASS_SWEEP, PASS_RECOMPUTE };

// attention_kept 0: run the attention into A->o, A->lse; 1: A->o and A->lse already hold this
// layer's (kept from the first forward: the recomputation skips the full layers' quadratic attention)
template <class E>
void layer_forward(gemma_cuda *g, const gemma_model_f32 *host, int l, const dbatch *b, const E *x, acts<E> *A,
                   layer_pass pass, E *out, int attention_kept = 0) {
    dequantize_layer<E>(g, l);
    const gemma_config *c = &g->cfg;
    const dlayer &L = g->layer[l];
    const gemma_attn_shape *s = &c->kind[L.kind];
    int T = A->T, H = c->hidden, D = s->head_dim, I = c->intermediate;
    long ldqkv = L.qd + L.kd + L.vd;
    float eps = (float)c->norm_eps;
    cudaStream_t st = g->stream;

    if (pass == PASS_RECOMPUTE || l == 0)
        k_rmsnorm<E><<<T, ROW_THREADS, 0, st>>>(x, H, L.input_norm, A->a, H, H, eps);
    frozen_forward<E>(g, L, PROJ_Q, PROJ_V, A, A->a, H, L.w_qkv, A->qkv, ldqkv);
    lora_fwd<E>(g, host, l, PROJ_Q, A->a, T, A->qkv, ldqkv, A->t[PROJ_Q]);
    lora_fwd<E>(g, host, l, PROJ_K, A->a, T, A->qkv + L.qd, ldqkv, A->t[PROJ_K]);
    if (L.vd) lora_fwd<E>(g, host, l, PROJ_V, A->a, T, A->qkv + L.qd + L.kd, ldqkv, A->t[PROJ_V]);

    // k_eq_v (no v columns): the values are the raw keys, before k_norm and RoPE
    qkv_heads qh = qkv_layout(ldqkv, L.qd, L.vd ? L.qd + L.kd : -1, T, c->heads, s->kv_heads, D, eps, b->pos,
                              g->cosv[L.kind], g->sinv[L.kind]);
    k_qkv_norm_rope<E><<<qkv_blocks(qh), 32 * HEAD_WARPS, 0, st>>>(A->qkv, qh, L.q_norm, L.k_norm,
                                                                  c->family == GEMMA_4, A->qr, A->kr, A->vn);
    CU(cudaGetLastError());

    wa_attn_desc d = layer_desc(g, l);
    wa_varlen vl = {b->n, b->cu, b->cu, b->longest, b->longest};
    wa_tensor tq = dev_thd<E>(A->qr, T, c->heads, D), tk = dev_thd<E>(A->kr, T, s->kv_heads, D);
    wa_tensor tv = dev_thd<E>(A->vn, T, s->kv_heads, D), to = dev_thd<E>(A->o, T, c->heads, D);
    wa_tensor tl = dev_lse(A->lse, c->heads, T);
    if (!attention_kept) {
        mark(g, PH_ATTN);
        wa_check(wa_forward_varlen(g->wa, &d, &vl, &tq, &tk, &tv, &to, &tl), "forward");
        mark(g, PH_ELEM);
    }

    frozen_forward<E>(g, L, PROJ_O, PROJ_O, A, A->o, L.qd, L.w_o, A->ao, H);
    lora_fwd<E>(g, host, l, PROJ_O, A->o, T, A->ao, H, A->t[PROJ_O]);
    k_add_norm<E><<<T, ROW_THREADS, 0, st>>>(x, A->ao, L.post_attn_norm, A->h, 1.f, L.pre_ffw_norm, A->mi, H, eps);
    frozen_forward<E>(g, L, PROJ_GATE, PROJ_UP, A, A->mi, H, L.w_gu, A->gu, 2L * I);
    lora_fwd<E>(g, host, l, PROJ_GATE, A->mi, T, A->gu, 2L * I, A->t[PROJ_GATE]);
    lora_fwd<E>(g, host, l, PROJ_UP, A->mi, T, A->gu + I, 2L * I, A->t[PROJ_UP]);
    geglu<E>(st, A->gu, nullptr, A->z, T, I);
    frozen_forward<E>(g, L, PROJ_DOWN, PROJ_DOWN, A, A->z, I, L.w_down, A->mo, H);
    lora_fwd<E>(g, host, l, PROJ_DOWN, A->z, T, A->mo, H, A->t[PROJ_DOWN]);
    if (pass == PASS_SWEEP) { // the products above have read A->a: it takes the next layer's normed input
        const float *next_norm = l + 1 < c->layers ? g->layer[l + 1].input_norm : nullptr;
        k_add_norm<E><<<T, ROW_THREADS, 0, st>>>(A->h, A->mo, L.post_ffw_norm, out, L.layer_scalar, next_norm, A->a,
                                                 H, eps);
    }
    CU(cudaGetLastError());
}

template <class E>
void layer_backward(gemma_cuda *g, const gemma_model_f32 *host, int l, const dbatch *b, const E *x, acts<E> *A,
                    const E *dout, E *dx) {
    dequantize_layer<E>(g, l);
    const gemma_config *c = &g->cfg;
    const dlayer &L = g->layer[l];
    const gemma_attn_shape *s = &c->kind[L.kind];
    int T = A->T, H = c->hidden, D = s->head_dim, I = c->intermediate;
    long ldqkv = L.qd + L.kd + L.vd;
    float eps = (float)c->norm_eps;
    cudaStream_t st = g->stream;

    // out = (h + n_post_ffw(mo)) · layer_scalar
    k_rmsnorm_bwd<E><<<T, ROW_THREADS, 0, st>>>(A->mo, L.post_ffw_norm, dout, L.layer_scalar, nullptr, A->d_mo, H, eps);
    frozen_input_grad<E>(g, l, PROJ_DOWN, A, A->d_mo, H, L.w_down, A->d_z, I);
    lora_bwd<E>(g, host, l, PROJ_DOWN, A->z, A->t[PROJ_DOWN], A->d_mo, H, T, A->d_z, A->d_t);
    geglu<E>(st, A->gu, A->d_z, A->d_gu, T, I);
    frozen_input_grad<E>(g, l, PROJ_GATE, A, A->d_gu, 2L * I, L.w_gu, A->d_mi, H);
    lora_bwd<E>(g, host, l, PROJ_GATE, A->mi, A->t[PROJ_GATE], A->d_gu, 2L * I, T, A->d_mi, A->d_t);
    lora_bwd<E>(g, host, l, PROJ_UP, A->mi, A->t[PROJ_UP], A->d_gu + I, 2L * I, T, A->d_mi, A->d_t);
    // h = x + n_post_attn(ao): dx gets h's gradient whole (dout · layer_scalar, plus the pre-FFW
    // norm's share), plus the input norm's share below
    k_residual_norms_bwd<E><<<T, ROW_THREADS, 0, st>>>(dout, L.layer_scalar, A->h, L.pre_ffw_norm, A->d_mi, A->ao,
                                                       L.post_attn_norm, dx, A->d_ao, H, eps);
    frozen_input_grad<E>(g, l, PROJ_O, A, A->d_ao, H, L.w_o, A->d_o, L.qd);
    lora_bwd<E>(g, host, l, PROJ_O, A->o, A->t[PROJ_O], A->d_ao, H, T, A->d_o, A->d_t);
    CU(cudaGetLastError());

    wa_attn_desc d = layer_desc(g, l);
    wa_varlen vl = {b->n, b->cu, b->cu, b->longest, b->longest};
    wa_tensor tq = dev_thd<E>(A->qr, T, c->heads, D), tk = dev_thd<E>(A->kr, T, s->kv_heads, D);
    wa_tensor tv = dev_thd<E>(A->vn, T, s->kv_heads, D), to = dev_thd<E>(A->o, T, c->heads, D);
    wa_tensor tl = dev_lse(A->lse, c->heads, T), tdo = dev_thd<E>(A->d_o, T, c->heads, D);
    wa_tensor tdq = dev_thd<E>(A->d_qr, T, c->heads, D), tdk = dev_thd<E>(A->d_kr, T, s->kv_heads, D);
    wa_tensor tdv = dev_thd<E>(A->d_vn, T, s->kv_heads, D);
    mark(g, PH_ATTN);
    wa_check(wa_backward_varlen(g->wa, &d, &vl, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk, &tdv), "backward");
    mark(g, PH_ELEM);

    // separate values: d_v from the v norm (Gemma 4) or as is (Gemma 3); k_eq_v: the raw keys feed
    // both the k norm + RoPE and the v norm
    int gemma4 = c->family == GEMMA_4;
    if (!L.vd && !gemma4) fail("attention_k_eq_v is a Gemma 4 feature");
    qkv_heads qh = qkv_layout(ldqkv, L.qd, L.vd ? L.qd + L.kd : -1, T, c->heads, s->kv_heads, D, eps, b->pos,
                              g->cosv[L.kind], g->sinv[L.kind]);
    k_qkv_norm_rope_bwd<E><<<qkv_blocks(qh), 32 * HEAD_WARPS, 0, st>>>(A->qkv, qh, L.q_norm, L.k_norm, gemma4, A->d_qr,
                                                                      A->d_kr, A->d_vn, A->d_qkv);
    CU(cudaGetLastError());

    frozen_input_grad<E>(g, l, PROJ_Q, A, A->d_qkv, ldqkv, L.w_qkv, A->d_a, H);
    lora_bwd<E>(g, host, l, PROJ_Q, A->a, A->t[PROJ_Q], A->d_qkv, ldqkv, T, A->d_a, A->d_t);
    lora_bwd<E>(g, host, l, PROJ_K, A->a, A->t[PROJ_K], A->d_qkv + L.qd, ldqkv, T, A->d_a, A->d_t);
    if (L.vd) lora_bwd<E>(g, host, l, PROJ_V, A->a, A->t[PROJ_V], A->d_qkv + L.qd + L.kd, ldqkv, T, A->d_a, A->d_t);
    k_rmsnorm_bwd<E><<<T, ROW_THREADS, 0, st>>>(x, L.input_norm, A->d_a, 1.f, dx, dx, H, eps);
    CU(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------------
// The head: final norm, tied logits in chunks of rows, final softcap, cross-entropy; with dxL it
// writes dL/dxL for loss = grad_scale · Σ CE.

template <class E>
void head(gemma_cuda *g, scratch &S, const dbatch *b, const E *xL, gemma_stats *st, float *logits_out,
          double grad_scale, E *dxL) {
    const gemma_config *c = &g->cfg;
    int H = c->hidden, V = c->vocab, T = b->T;
    int C = g->logit_rows > 0 ? g->logit_rows : (int)std::max<long>(1, (1L << 30) / ((long)V * 4));
    C = std::min(C, T);
    E *f = S.get<E>((size_t)T * H);
    float *lg = S.get<float>((size_t)C * V);
    E *dl = dxL ? S.get<E>((size_t)C * V) : nullptr;
    E *df = dxL ? S.get<E>((size_t)T * H) : nullptr;
    float *loss = S.get<float>((size_t)T);
    int *agree = S.get<int>((size_t)T);
    mark(g, PH_HEAD);
    g->prof.gemm_phase = g->prof.elem_phase = PH_HEAD;
    k_rmsnorm<E><<<T, ROW_THREADS, 0, g->stream>>>(xL, H, g->final_norm, f, H, H, (float)c->norm_eps);
    for (int r0 = 0; r0 < T; r0 += C) {
        int rows = std::min(C, T - r0);
        gemm(g, rows, V, H, 1, M((const E *)f + (long)r0 * H, H), M((const E *)g->lm_head, H, true), 0, lg,
             CUDA_R_32F, V);
        k_cross_entropy<E><<<rows, 1024, 0, g->stream>>>(lg, V, b->target + r0, (float)c->final_softcap, loss + r0,
                                                         agree + r0, dl, (float)grad_scale);
        CU(cudaGetLastError());
        if (logits_out)
            CU(cudaMemcpyAsync(logits_out + (long)r0 * V, lg, (size_t)rows * V * sizeof(float), cudaMemcpyDeviceToHost,
                               g->stream));
        if (dxL)
            gemm(g, rows, H, V, 1, M((const E *)dl, V), M((const E *)g->lm_head, H), 0, df + (long)r0 * H,
                 dtype_of<E>(), H);
    }
    if (dxL) k_rmsnorm_bwd<E><<<T, ROW_THREADS, 0, g->stream>>>(xL, g->final_norm, df, 1.f, nullptr, dxL, H,
                                                                (float)c->norm_eps);
    g->prof.gemm_phase = PH_GEMM, g->prof.elem_phase = PH_ELEM;
    mark(g, PH_ELEM);
    std::vector<float> hl(T);
    std::vector<int> ha(T);
    CU(cudaMemcpyAsync(hl.data(), loss, (size_t)T * sizeof(float), cudaMemcpyDeviceToHost, g->stream));
    CU(cudaMemcpyAsync(ha.data(), agree, (size_t)T * sizeof(int), cudaMemcpyDeviceToHost, g->stream));
    CU(cudaStreamSynchronize(g->stream));
    for (int t = 0; t < T; t++)
        if (b->h_target[t] >= 0) st->loss_sum += hl[t], st->tokens++, st->agree += ha[t];
}

// ---------------------------------------------------------------------------------------------
// The drivers: as model.c's forward_packed / backward_packed.

// host->params onto the device, and the E copy made from them; complete when it returns
template <class E> void params_upload(gemma_cuda *g, const gemma_model_f32 *host) {
    CU(cudaMemcpyAsync(g->params, host->params, g->param_count * sizeof(float), cudaMemcpyHostToDevice, g->stream));
    if (sizeof(E) != sizeof(float))
        k_to_e<E><<<grid_for((long)g->param_count, 256), 256, 0, g->stream>>>(g->params, (E *)g->params_e,
                                                                              (long)g->param_count);
    CU(cudaGetLastError());
    CU(cudaStreamSynchronize(g->stream)); // host->params may change once this returns
}

// The gradient's squared norm summed on the device (k_sumsq_blocks), read back.
double grads_sumsq(gemma_cuda *g) {
    long n = (long)g->param_count, blocks = (n + NORM_CHUNK - 1) / NORM_CHUNK;
    if (blocks == 0) return 0;
    k_sumsq_blocks<<<(unsigned)blocks, NORM_THREADS, 0, g->stream>>>(g->grads, n, g->norm_partial);
    k_sum_fixed<<<1, NORM_THREADS, 0, g->stream>>>(g->norm_partial, blocks, g->norm_partial + blocks);
    CU(cudaGetLastError());
    double sum = 0;
    CU(cudaMemcpyAsync(&sum, g->norm_partial + blocks, sizeof sum, cudaMemcpyDeviceToHost, g->stream));
    CU(cudaStreamSynchronize(g->stream));
    return sum;
}

template <class E> void optimizer_step(gemma_cuda *g, const gemma_cuda_adam *o, double *grad_norm, int *nonfinite) {
    profile_open(g, PH_OPT);
    double norm = sqrt(grads_sumsq(g));
    *grad_norm = norm;
    *nonfinite = !isfinite(norm);
    if (*nonfinite) {
        profile_close(g, nullptr, 0);
        return;
    }
    adam_args a;
    a.clip_scale = o->grad_clip > 0 ? fmin(1.0, o->grad_clip / (norm + 1e-6)) : 1.0;
    a.adamw = o->adamw != 0;
    a.decay = 1 - o->lr * o->weight_decay;
    a.step_lr = o->lr;
    if (o->bias_correction)
        a.step_lr *= sqrt(1 - pow(o->beta2, (double)o->update)) / (1 - pow(o->beta1, (double)o->update));
    a.beta1 = o->beta1, a.one_minus_beta1 = 1 - o->beta1;
    a.beta2 = o->beta2, a.one_minus_beta2 = 1 - o->beta2;
    a.eps = o->eps;
    long n = (long)g->param_count;
    if (n > 0)
        k_adam<E><<<grid_for(n, 256), 256, 0, g->stream>>>(g->params, (E *)g->params_e, g->grads, g->moment1,
                                                          g->moment2, n, a);
    CU(cudaGetLastError());
    CU(cudaStreamSynchronize(g->stream));
    profile_close(g, nullptr, 0);
}

template <class E> void forward(gemma_cuda *g, const gemma_model_f32 *host, const gemma_seq *seqs, int n,
                                gemma_stats *st, float *logits) {
    profile_open(g, PH_ELEM);
    scratch S(g);
    dbatch b;
    batch_upload(g, S, seqs, n, &b);
    rope_tables(g, b.longest);
    long TH = (long)b.T * g->cfg.hidden;
    E *x = S.get<E>(TH), *y = S.get<E>(TH);
    acts<E> A;
    acts_alloc<E>(g, S, b.T, 0, &A);
    k_embed<E><<<b.T, ROW_THREADS, 0, g->stream>>>(b.tokens, (const E *)g->embed,
                                                   (float)(E)(float)g->cfg.embed_scale, x, g->cfg.hidden);
    for (int l = 0; l < g->cfg.layers; l++) {
        layer_forward<E>(g, host, l, &b, x, &A, PASS_SWEEP, y);
        std::swap(x, y);
    }
    head<E>(g, S, &b, x, st, logits, 0, nullptr);
    profile_close(g, "forward", b.T);
}

// ---------------------------------------------------------------------------------------------
// The layer inputs in page-locked host memory (gemma_cuda.inputs_on_host).

// bytes of host memory the layer inputs of `tokens` tokens take: xs[0..layers-2] (the last input
// and the head's stay in the two device buffers)
double host_input_bytes(const gemma_cuda *g, long tokens) {
    return (double)tokens * std::max(g->cfg.layers - 1, 0) * g->cfg.hidden * g->esize;
}

void inputs_line_on_host(gemma_cuda *g) {
    snprintf(g->inputs_line, sizeof g->inputs_line, "layer inputs in page-locked host memory (%.2f GB for %ld tokens)",
             host_input_bytes(g, g->host_tokens) / 1e9, g->host_tokens);
}

void host_inputs_free(gemma_cuda *g) {
    if (g->copy_stream) cudaStreamSynchronize(g->copy_stream); // no copy still reads or writes it (nor throws:
                                                                 // gemma_cuda_token_budget calls this)
    if (g->host_inputs) cudaFreeHost(g->host_inputs);
    g->host_inputs = nullptr;
    g->host_tokens = 0;
}

// Page-locked host memory for the layer inputs of `tokens` tokens (kept if it holds them already):
// 1, or 0 with why (the bytes needed and the refusal) and no memory held. Refused, too, beyond 80%
// of the memory the kernel calls available (pinned pages cannot be swapped: more would push the
// machine into the out-of-memory killer rather than make cudaHostAlloc fail).
int host_inputs_reserve(gemma_cuda *g, long tokens, char *why, size_t whylen) {
    if (tokens <= g->host_tokens) return 1;
    host_inputs_free(g);
    double bytes = host_input_bytes(g, tokens), avail = (double)mem_available_bytes();
    if (avail > 0 && bytes > 0.8 * avail) {
        snprintf(why, whylen, "%.2f GB of page-locked host memory for %ld tokens' layer inputs, %.2f GB available",
                 bytes / 1e9, tokens, avail / 1e9);
        return 0;
    }
    void *p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, bytes > 0 ? (size_t)bytes : 1, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        cudaGetLastError(); // an allocation's refusal is not sticky: clear it
        snprintf(why, whylen, "%.2f GB of page-locked host memory for %ld tokens' layer inputs: cudaHostAlloc: %s",
                 bytes / 1e9, tokens, cudaGetErrorString(e));
        return 0;
    }
    g->host_inputs = p, g->host_tokens = tokens;
    inputs_line_on_host(g);
    return 1;
}

// A step of T tokens on the host path: the memory is there (grown by a quarter at least, so that
// slowly growing batches do not pin anew every step), or the step fails naming what it needed.
void host_inputs_for_step(gemma_cuda *g, int T) {
    if (T <= g->host_tokens) return;
    char why[256];
    long grown = std::max((long)T, g->host_tokens + g->host_tokens / 4);
    if (host_inputs_reserve(g, grown, why, sizeof why) || host_inputs_reserve(g, T, why, sizeof why)) return;
    fail("%s", why);
}

// Layer l's input between device buffer `slot` (l % 2) and its host slot, on the copy stream once
// every use of that buffer issued on g->stream so far is done: down (to_host) in the forward, once
// layer l - 1 has written it, beside the next layers; up in the backward, once the input the
// buffer held has been read.
template <class E> void copy_input(gemma_cuda *g, int l, E *slot, long TH, bool to_host) {
    int s = l % 2;
    E *host = (E *)g->host_inputs + l * TH;
    CU(cudaEventRecord(g->slot_released[s], g->stream));
    CU(cudaStreamWaitEvent(g->copy_stream, g->slot_released[s], 0));
    CU(cudaMemcpyAsync(to_host ? host : slot, to_host ? slot : host, (size_t)TH * sizeof(E),
                       to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, g->copy_stream));
    CU(cudaEventRecord(g->slot_copied[s], g->copy_stream));
}

// g->stream goes on once the last copy of device buffer s has ended (profiled: the wait shows)
void wait_for_copy(gemma_cuda *g, int s) {
    mark(g, PH_COPY);
    CU(cudaStreamWaitEvent(g->stream, g->slot_copied[s], 0));
    mark(g, PH_ELEM);
}

// On leaving a step by any way, failures included: g->stream waits for everything issued on the
// copy stream, so the stream-ordered frees of the step's buffers (on g->stream) come after the
// copies that use them. Declared after the step's scratch, so it runs before the scratch's frees.
struct copies_join {
    gemma_cuda *g;
    ~copies_join() {
        if (cudaEventRecord(g->copies_joined, g->copy_stream) == cudaSuccess)
            cudaStreamWaitEvent(g->stream, g->copies_joined, 0);
    }
};

template <class E> void backward(gemma_cuda *g, gemma_model_f32 *host, const gemma_seq *seqs, int n,
                                 double grad_scale, gemma_stats *st) {
    profile_open(g, PH_ELEM);
    scratch S(g);
    copies_join join{g};
    dbatch b;
    batch_upload(g, S, seqs, n, &b);
    rope_tables(g, b.longest);
    int Lc = g->cfg.layers, on_host = g->inputs_on_host;
    long TH = (long)b.T * g->cfg.hidden;
    if (on_host) host_inputs_for_step(g, b.T);
    // the layer inputs are all the forward keeps; each layer's insides are recomputed. On the host
    // path the device holds two buffers: layer l's input is in buffer l % 2 while layer l runs
    // (the forward's layer l writes its output, layer l + 1's input, into the other); otherwise
    // all L + 1 inputs, layer l's at xs + l·TH
    E *xs = S.get<E>((size_t)(on_host ? 2 : Lc + 1) * TH), *dx = S.get<E>(TH), *dprev = S.get<E>(TH);
    auto input = [&](int l) { return xs + (on_host ? l % 2 : l) * TH; };
    acts<E> A;
    acts_alloc<E>(g, S, b.T, 1, &A);
    // the full layers' attention output and log-sum-exp are kept from the first forward: their
    // attention is quadratic in the record length, the rest of a layer is cheap to recompute
    std::vector<E *> kept_o(Lc, nullptr);
    std::vector<float *> kept_lse(Lc, nullptr);
    E *o_work = A.o;
    float *lse_work = A.lse;
    for (int l = 0; l < Lc; l++)
        if (g->cfg.layer_kind[l] == LAYER_FULL) {
            kept_o[l] = S.get<E>((size_t)b.T * g->layer[l].qd);
            kept_lse[l] = S.get<float>((size_t)b.T * g->cfg.heads);
        }
    auto use_attention = [&](int l) {
        A.o = kept_o[l] ? kept_o[l] : o_work;
        A.lse = kept_lse[l] ? kept_lse[l] : lse_work;
    };
    k_embed<E><<<b.T, ROW_THREADS, 0, g->stream>>>(b.tokens, (const E *)g->embed,
                                                   (float)(E)(float)g->cfg.embed_scale, input(0), g->cfg.hidden);
    for (int l = 0; l < Lc; l++) {
        use_attention(l);
        if (on_host) {
            // xs[l] down to the host (the last input stays in its buffer for the backward's first layer)
            if (l < Lc - 1) copy_input<E>(g, l, input(l), TH, true);
            // layer l writes buffer (l + 1) % 2, whose input xs[l - 1] went down beside layer l - 1
            if (l >= 1) wait_for_copy(g, (l + 1) % 2);
        }
        layer_forward<E>(g, host, l, &b, input(l), &A, PASS_SWEEP, input(l + 1));
    }
    head<E>(g, S, &b, input(Lc), st, nullptr, grad_scale, dx);
    for (int l = Lc - 1; l >= 0; l--) {
        use_attention(l);
        if (on_host) {
            // xs[l] came up beside layer l + 1's backward (xs[L - 1] never left its buffer)
            if (l < Lc - 1) wait_for_copy(g, l % 2);
            // xs[l - 1] up into the other buffer, whose input (xs[l + 1], or the head's xs[L]) is read
            if (l >= 1) copy_input<E>(g, l - 1, input(l - 1), TH, false);
        }
        layer_forward<E>(g, host, l, &b, input(l), &A, PASS_RECOMPUTE, nullptr, kept_o[l] != nullptr);
        layer_backward<E>(g, host, l, &b, input(l), &A, dx, dprev);
        std::swap(dx, dprev);
    }
    A.o = o_work, A.lse = lse_work;
    profile_close(g, "forward + backward", b.T);
}

// ---------------------------------------------------------------------------------------------
// Weights onto the device.

// One matrix or vector the config implies: its checkpoint name, shape, and where it goes.
struct wplan {
    char name[128];
    long rows, cols; // cols 0: a vector
    void *dst;       // E data (matrices) — or float (vectors)
    int is_vector;
    double add;      // Gemma 3's 1 + w norms
    float fill;      // random init of vectors
    float *scalar;   // layer_scalar
    int layer, proj; // a decoder projection (quantized with the base), or -1
};

// A packed tensor of a quantized folder (U32: mlx_lm.convert's; U8: bitsandbytes') dequantized on
// the host into out [rows, cols] f32 with train/quant.c, as the CPU loader reads it; the checks and
// messages are the CPU loader's.
void dequantize_packed_host(const checkpoint *ck, const wplan *p, const st_tensor *t, float *out) {
    char why[256] = "";
    int rc;
    if (t->dtype == ST_U32) {
        const st_tensor *scales, *biases;
        mlx4_parts_find(ck, p->name, &scales, &biases);
        rc = mlx4_dequantize_tensor(t, scales, biases, p->rows, p->cols, out, why, sizeof why);
    } else {
        bnb4_tensors parts;
        bnb4_parts_find(ck, p->name, t, &parts);
        rc = nf4_dequantize_tensor(&parts, p->rows, p->cols, out, why, sizeof why);
    }
    if (rc != 0) fail("tensor \"%s%s\": %s", ck->prefix, p->name, why);
}

void upload_matrix(gemma_cuda *g, const checkpoint *ck, const wplan *p, std::vector<unsigned char> &stage) {
    const st_tensor *t = checkpoint_find(ck, p->name);
    if (!t) fail("checkpoint has no tensor \"%s%s\"", ck->prefix, p->name);
    size_t n = (size_t)p->rows * p->cols;
    if (t->dtype == ST_U32 || t->dtype == ST_U8) { // packed (the embedding of an mlx_lm.convert -q folder)
        std::vector<float> w(n);
        dequantize_packed_host(ck, p, t, w.data());
        std::vector<unsigned char> e(n * g->esize);
        for (size_t i = 0; i < n; i++) {
            if (g->precision == PRECISION_F32) memcpy(e.data() + 4 * i, &w[i], 4);
            else {
                uint16_t b = wa_f32_to_bf16(w[i]);
                memcpy(e.data() + 2 * i, &b, 2);
            }
        }
        CU(cudaMemcpy(p->dst, e.data(), e.size(), cudaMemcpyHostToDevice));
        return;
    }
    if (t->rank != 2 || t->shape[0] != p->rows || t->shape[1] != p->cols)
        fail("tensor \"%s\" has the wrong shape (the config implies [%ld, %ld])", p->name, p->rows, p->cols);
    int want = g->precision == PRECISION_BF16 ? ST_BF16 : ST_F32;
    if (t->dtype == want) { // straight from the mapping
        CU(cudaMemcpy(p->dst, t->data, n * g->esize, cudaMemcpyHostToDevice));
        return;
    }
    if (t->dtype != ST_F32 && t->dtype != ST_F16 && t->dtype != ST_BF16)
        fail("tensor \"%s\" has dtype %s (F32, F16, BF16 are read on the GPU)", p->name, st_dtype_name(t->dtype));
    size_t chunk = stage.size() / g->esize;
    const unsigned char *src = (const unsigned char *)t->data;
    for (size_t i0 = 0; i0 < n; i0 += chunk) {
        size_t m = std::min(chunk, n - i0);
        for (size_t i = 0; i < m; i++) {
            float x;
            size_t j = i0 + i;
            if (t->dtype == ST_F32) memcpy(&x, src + 4 * j, 4);
            else {
                uint16_t v;
                memcpy(&v, src + 2 * j, 2);
                x = t->dtype == ST_F16 ? wa_f16_to_f32(v) : wa_bf16_to_f32(v);
            }
            if (g->precision == PRECISION_F32) memcpy(stage.data() + 4 * i, &x, 4);
            else {
                uint16_t b = wa_f32_to_bf16(x);
                memcpy(stage.data() + 2 * i, &b, 2);
            }
        }
        CU(cudaMemcpy((unsigned char *)p->dst + i0 * g->esize, stage.data(), m * g->esize, cudaMemcpyHostToDevice));
    }
}

void upload_vector(gemma_cuda *g, const checkpoint *ck, const wplan *p) {
    const st_tensor *t = checkpoint_find(ck, p->name);
    if (!t) fail("checkpoint has no tensor \"%s%s\"", ck->prefix, p->name);
    long n = p->scalar ? 1 : p->rows;
    if (st_numel(t) != n || t->rank > 1)
        fail("tensor \"%s%s\" has the wrong shape (the config implies [%ld])", ck->prefix, p->name, n);
    uint64_t bad;
    if (st_tensor_first_nonfinite(t, &bad)) // the CPU loader's check and message
        fail("tensor \"%s%s\" holds a non-finite value (%s) at element %llu", ck->prefix, p->name,
             st_tensor_value_kind(t, bad), (unsigned long long)bad);
    std::vector<float> v(n);
    const unsigned char *src = (const unsigned char *)t->data;
    for (long i = 0; i < n; i++) {
        double x;
        switch (t->dtype) {
        case ST_F64: { double d; memcpy(&d, src + 8 * i, 8); x = d; break; }
        case ST_F32: { float f; memcpy(&f, src + 4 * i, 4); x = f; break; }
        case ST_F16: { uint16_t h; memcpy(&h, src + 2 * i, 2); x = wa_f16_to_f32(h); break; }
        case ST_BF16: { uint16_t h; memcpy(&h, src + 2 * i, 2); x = wa_bf16_to_f32(h); break; }
        default: fail("tensor \"%s%s\" has dtype %s", ck->prefix, p->name, st_dtype_name(t->dtype));
        }
        v[i] = (float)(p->add != 0 ? (float)p->add + (float)x : x); // rounds once, as model.c
    }
    if (p->scalar) *p->scalar = v[0];
    else CU(cudaMemcpy(p->dst, v.data(), n * sizeof(float), cudaMemcpyHostToDevice));
}

// The matrices are scanned where they already are, on the device (a host pass would read the 62 GB
// of a 31B checkpoint once more); the message is the CPU loader's. first: one device word.
template <class E> void check_finite(const checkpoint *ck, const wplan *p, unsigned long long *first) {
    unsigned long long h = ~0ull;
    CU(cudaMemcpy(first, &h, sizeof h, cudaMemcpyHostToDevice));
    long n = p->rows * p->cols;
    k_first_nonfinite<E><<<grid_for(n, 256), 256>>>((const E *)p->dst, n, first);
    CU(cudaMemcpy(&h, first, sizeof h, cudaMemcpyDeviceToHost));
    if (h == ~0ull) return;
    E x;
    CU(cudaMemcpy(&x, (const E *)p->dst + h, sizeof x, cudaMemcpyDeviceToHost));
    float f = (float)x;
    fail("tensor \"%s%s\" holds a non-finite value (%s) at element %llu", ck->prefix, p->name,
         isnan(f) ? "NaN" : f > 0 ? "inf" : "-inf", h);
}

// bytes rounded up to the 256-byte boundary every part of a shared device allocation starts at, so
// every word and float of each part is aligned (and FP8 products' operands as cuBLASLt wants them)
size_t part_span(size_t bytes) { return (bytes + 255) & ~(size_t)255; }

// The parts of one packed projection into one device allocation (counted in static_bytes), each
// part at a 256-byte boundary so every word and float of it is aligned.
struct part {
    const void *src;
    size_t bytes;
    const void **dst;
};

void upload_parts(gemma_cuda *g, const std::vector<part> &parts) {
    size_t total = 0;
    for (const part &p : parts) total += part_span(p.bytes);
    unsigned char *mem = (unsigned char *)dev_alloc(g, total);
    g->packed_mem.push_back(mem);
    size_t off = 0;
    for (const part &p : parts) {
        CU(cudaMemcpy(mem + off, p.src, p.bytes, cudaMemcpyHostToDevice));
        *p.dst = mem + off;
        off += part_span(p.bytes);
    }
}

// ---------------------------------------------------------------------------------------------
// A float projection quantized at load on the device (quant_cuda.cuh's kernels), from values
// drawn there or copied up as a checkpoint stores them. One projection at a time: its values in a
// scratch (the dequantization scratch where it is large enough), its packed form in an allocation
// of its own.

// A packed form's parts in one allocation, each at a 256-byte boundary (as upload_parts lays them
// out): mlx4 words, scales, biases; nf4 codes, absmax codes, nested absmax; fp8 codes, row scales;
// dense: the E values.
struct packed_layout {
    int count = 0;
    size_t at[3] = {}, bytes[3] = {}, total = 0;
};

packed_layout layout_of(qformat fmt, long rows, long cols, int scale_code, size_t esize) {
    packed_layout l;
    size_t n = (size_t)rows * cols, blocks = (n + NF4_BLOCK - 1) / NF4_BLOCK;
    size_t groups = n / MLX4_GROUP, ssize = scale_code ? 2 : 4;
    if (fmt == Q_DENSE) l.count = 1, l.bytes[0] = n * esize;
    else if (fmt == Q_MLX4) l.count = 3, l.bytes[0] = n * MLX4_BITS / 8, l.bytes[1] = l.bytes[2] = groups * ssize;
    else if (fmt == Q_NF4)
        l.count = 3, l.bytes[0] = (n + 1) / 2, l.bytes[1] = blocks,
        l.bytes[2] = (blocks + NF4_NESTED_BLOCK - 1) / NF4_NESTED_BLOCK * sizeof(float);
    else l.count = 2, l.bytes[0] = n, l.bytes[1] = (size_t)rows * sizeof(float);
    for (int k = 0; k < l.count; k++) {
        l.at[k] = l.total;
        l.total += part_span(l.bytes[k]);
    }
    return l;
}

// What quantizing at load needs besides the values: the stream it all runs on, a device word for
// the first non-finite index, nf4's f32 absmax on the device (room for the largest projection's
// blocks) and the host buffers of nf4's double quantization, which runs on the host with
// train/quant.c's own functions (torch's summation order of the mean, bitsandbytes' 8-bit table):
// n / 64 floats cross each way, against the n values quantized on the device.
struct quant_work {
    cudaStream_t stream = 0;
    unsigned long long *first = nullptr;
    float *absmax = nullptr;
    std::vector<float> absmax_host, nested;
    std::vector<uint8_t> absmax_codes, lut;
    quant_constants k = {};
};

void quant_work_open(quant_work *w, cudaStream_t stream, long largest, int nf4) {
    w->stream = stream;
    CU(cudaMalloc(&w->first, sizeof *w->first));
    if (nf4) {
        CU(cudaMalloc(&w->absmax, (size_t)((largest + NF4_BLOCK - 1) / NF4_BLOCK) * sizeof(float)));
        w->lut.resize(BNB_LUT_SIZE);
    }
    // quant.c's constants as the host compiler reads them (quant_cuda.cuh says why)
    w->k.mlx4_eps = 1e-7f;
    w->k.nf4_floor = 1e-38f;
    for (int i = 0; i < 15; i++) w->k.nf4_midpoint[i] = (NF4_CODE[i] + NF4_CODE[i + 1]) / 2;
}

void quant_work_close(quant_work *w) {
    cudaFree(w->first);
    cudaFree(w->absmax);
    w->first = nullptr, w->absmax = nullptr;
}

// The device's first non-finite index of src[0..n), or -1.
template <class T> long first_nonfinite(quant_work *w, const T *src, long n) {
    unsigned long long bad;
    CU(cudaMemsetAsync(w->first, 0xff, sizeof *w->first, w->stream));
    k_first_nonfinite<T><<<grid_for(n, 256), 256, 0, w->stream>>>(src, n, w->first);
    CU(cudaGetLastError());
    CU(cudaMemcpyAsync(&bad, w->first, sizeof bad, cudaMemcpyDeviceToHost, w->stream));
    CU(cudaStreamSynchronize(w->stream));
    return bad == ~0ull ? -1 : (long)bad;
}

// src (device, T [q->rows, q->cols], written on w->stream) into q->fmt's packed form in mem (laid
// out as lay; scale_code: the dtype of mlx4's scales and biases, 0 f32, 1 f16, 2 bf16), q's
// pointers set to its parts (tables: the device's dequantization tables, NULL where nothing
// dequantizes). The flat index of the first non-finite value (the parts then unset), or -1. The
// stream is synchronised on return.
template <class T, class E>
long quantize_into(quant_work *w, const T *src, qmat *q, int scale_code, const packed_layout &lay, unsigned char *mem,
                   const float *tables) {
    cudaStream_t st = w->stream;
    long n = q->rows * q->cols, blocks = (n + NF4_BLOCK - 1) / NF4_BLOCK;
    unsigned char *part[3] = {mem + lay.at[0], mem + lay.at[1], mem + lay.at[2]};
    CU(cudaMemsetAsync(w->first, 0xff, sizeof *w->first, st));
    if (q->fmt == Q_DENSE) {
        k_widen_dense<T, E><<<grid_for(n, 256), 256, 0, st>>>(src, n, (E *)part[0], w->first);
    } else if (q->fmt == Q_MLX4) { // a warp per group
        long groups = n / MLX4_GROUP;
        k_quant_mlx4<T><<<grid_for(groups * 32, 256), 256, 0, st>>>(src, groups, scale_code, w->k, part[0], part[1],
                                                                    part[2], w->first);
    } else if (q->fmt == Q_NF4) { // a warp per block
        k_quant_nf4<T><<<grid_for(blocks * 32, 256), 256, 0, st>>>(src, n, w->k, part[0], w->absmax, w->first);
    } else { // a thread block per row
        int grid = (int)std::min(q->rows, 8192L);
        k_quant_fp8<T><<<grid, QUANT_ROW_THREADS, 0, st>>>(src, q->rows, q->cols, part[0], (float *)part[1], w->first);
    }
    CU(cudaGetLastError());
    unsigned long long bad;
    CU(cudaMemcpyAsync(&bad, w->first, sizeof bad, cudaMemcpyDeviceToHost, st));
    if (q->fmt == Q_NF4) {
        w->absmax_host.resize((size_t)blocks);
        CU(cudaMemcpyAsync(w->absmax_host.data(), w->absmax, (size_t)blocks * sizeof(float), cudaMemcpyDeviceToHost,
                           st));
    }
    CU(cudaStreamSynchronize(st));
    if (bad != ~0ull) return (long)bad;
    if (q->fmt == Q_DENSE) {
        q->dense = part[0];
    } else if (q->fmt == Q_MLX4) {
        q->words = part[0], q->scales = part[1], q->biases = part[2], q->scale_code = scale_code;
    } else if (q->fmt == Q_NF4) {
        // the double quantization as nf4_quantize makes it: torch's mean on one thread, subtracted,
        // then the 8-bit blocks of 256
        long nested_blocks = (blocks + NF4_NESTED_BLOCK - 1) / NF4_NESTED_BLOCK;
        float *absmax = w->absmax_host.data();
        float offset = nf4_torch_mean(absmax, blocks, 1);
        for (long b = 0; b < blocks; b++) absmax[b] -= offset;
        w->absmax_codes.resize((size_t)blocks);
        w->nested.resize((size_t)nested_blocks);
        bnb_quantize_8bit(absmax, blocks, NF4_NESTED_BLOCK, BNB_DYNAMIC_CODE, w->lut.data(), w->absmax_codes.data(),
                          w->nested.data());
        CU(cudaMemcpyAsync(part[1], w->absmax_codes.data(), (size_t)blocks, cudaMemcpyHostToDevice, st));
        CU(cudaMemcpyAsync(part[2], w->nested.data(), (size_t)nested_blocks * sizeof(float), cudaMemcpyHostToDevice,
                           st));
        CU(cudaStreamSynchronize(st));
        q->nf4.n = n, q->nf4.block = NF4_BLOCK, q->nf4.nested_block = NF4_NESTED_BLOCK, q->nf4.offset = offset;
        q->nf4.codes = part[0], q->nf4.absmax_codes = part[1], q->nf4.nested = (const float *)part[2];
        q->nf4.absmax = nullptr, q->nf4.code8 = tables ? tables + DYNAMIC_TABLE : nullptr;
    } else {
        q->fp8 = part[0], q->row_scale = part[1];
    }
    return -1;
}

// The refusals of a non-finite value at flat index `bad`: in a tensor as the checkpoint stores it,
// the CPU loader's line (model.c scans every base tensor before use); in values drawn or widened
// from F64 (where a finite double may overflow f32), the quantizer's (train/quant.c).
[[noreturn]] void refuse_stored(const char *name, const st_tensor *t, long bad) {
    fail("tensor \"%s\" holds a non-finite value (%s) at element %ld", name, st_tensor_value_kind(t, (uint64_t)bad),
         bad);
}
[[noreturn]] void refuse_quantizing(const char *name, long bad) {
    fail("tensor \"%s\": a non-finite value at element %ld cannot be quantized", name, bad);
}

// One projection's values src (device, T [q->rows, q->cols]; stored: the checkpoint tensor they were
// copied from as stored, NULL for values drawn or widened from F64) into q->fmt's packed form, in
// an allocation alloc(bytes) gives; its layout returned. Refused in one line, as the CPU loader
// refuses: a non-finite value first, then mlx4 rows that groups of 64 do not cut.
template <class T, class E, class Alloc>
packed_layout quantize_projection(quant_work *w, const T *src, qmat *q, int scale_code, const char *name,
                                  const st_tensor *stored, const float *tables, Alloc alloc) {
    long bad;
    if (q->fmt == Q_MLX4 && q->cols % MLX4_GROUP != 0) {
        if ((bad = first_nonfinite<T>(w, src, q->rows * q->cols)) >= 0) {
            if (stored) refuse_stored(name, stored, bad);
            refuse_quantizing(name, bad);
        }
        fail("tensor \"%s\": rows of %ld values cannot be cut into groups of %d", name, q->cols, MLX4_GROUP);
    }
    packed_layout lay = layout_of(q->fmt, q->rows, q->cols, scale_code, sizeof(E));
    unsigned char *mem = alloc(lay.total);
    if ((bad = quantize_into<T, E>(w, src, q, scale_code, lay, mem, tables)) >= 0) {
        if (stored) refuse_stored(name, stored, bad);
        refuse_quantizing(name, bad);
    }
    return lay;
}

// A float checkpoint tensor t (F32, F16, BF16 or F64, its shape [q->rows, q->cols] checked) into
// q->fmt's packed form: copied up as stored into raw (room for it in f32) and quantized from there,
// mlx4's scales and biases in t's dtype (f32 for F64), as model.c's loader quantizes it. F64 is
// scanned and widened to f32 on the host, through a stage (raw holds f32 values, not f64).
template <class E, class Alloc>
packed_layout quantize_tensor(quant_work *w, const st_tensor *t, qmat *q, void *raw, const char *name,
                              const float *tables, Alloc alloc) {
    size_t n = (size_t)q->rows * q->cols;
    int scale_code = t->dtype == ST_BF16 ? 2 : t->dtype == ST_F16 ? 1 : 0;
    if (t->dtype == ST_F64) {
        uint64_t bad;
        if (st_tensor_first_nonfinite(t, &bad)) refuse_stored(name, t, (long)bad);
        std::vector<float> stage(std::min(n, (size_t)1 << 24));
        const unsigned char *src = (const unsigned char *)t->data;
        for (size_t i0 = 0; i0 < n; i0 += stage.size()) {
            size_t m = std::min(stage.size(), n - i0);
            for (size_t i = 0; i < m; i++) { // to f32 as model.c's load_via_f32
                double v;
                memcpy(&v, src + 8 * (i0 + i), 8);
                stage[i] = (float)v;
            }
            CU(cudaMemcpyAsync((float *)raw + i0, stage.data(), m * sizeof(float), cudaMemcpyHostToDevice, w->stream));
            CU(cudaStreamSynchronize(w->stream)); // the stage is refilled next
        }
        return quantize_projection<float, E>(w, (const float *)raw, q, scale_code, name, nullptr, tables, alloc);
    }
    size_t esize = t->dtype == ST_F32 ? 4 : 2;
    CU(cudaMemcpyAsync(raw, t->data, n * esize, cudaMemcpyHostToDevice, w->stream));
    if (t->dtype == ST_F16)
        return quantize_projection<__half, E>(w, (const __half *)raw, q, scale_code, name, t, tables, alloc);
    if (t->dtype == ST_BF16)
        return quantize_projection<bf16, E>(w, (const bf16 *)raw, q, scale_code, name, t, tables, alloc);
    return quantize_projection<float, E>(w, (const float *)raw, q, scale_code, name, t, tables, alloc);
}

qformat format_of(base_dtype base) {
    return base == BASE_MLX4 ? Q_MLX4 : base == BASE_NF4 ? Q_NF4 : base == BASE_FP8 ? Q_FP8 : Q_DENSE;
}

// A packed projection from the checkpoint onto the device as stored (checked as the CPU loader
// checks it before dequantizing); 0 when the tensor is not packed (a float tensor, left to
// quantize_tensor; its shape and dtype are checked here).
int load_packed_projection(gemma_cuda *g, const checkpoint *ck, const wplan *p, const st_tensor *t) {
    char full[300], why[256] = "";
    snprintf(full, sizeof full, "%s%s", ck->prefix, p->name);
    long n = p->rows * p->cols;
    qmat *q = &g->layer[p->layer].packed[p->proj];
    q->rows = p->rows, q->cols = p->cols;
    if (t->dtype == ST_U32) { // mlx_lm.convert's: words, scales and biases copied as stored
        const st_tensor *scales, *biases;
        mlx4_parts_find(ck, p->name, &scales, &biases);
        if (mlx4_packed_check(t, scales, biases, p->rows, p->cols, why, sizeof why) != 0)
            fail("tensor \"%s\": %s", full, why);
        q->fmt = Q_MLX4;
        q->scale_code = scales->dtype == ST_BF16 ? 2 : scales->dtype == ST_F16 ? 1 : 0;
        size_t ssize = q->scale_code ? 2 : 4;
        upload_parts(g, {{t->data, (size_t)st_numel(t) * 4, &q->words},
                         {scales->data, (size_t)st_numel(scales) * ssize, &q->scales},
                         {biases->data, (size_t)st_numel(biases) * ssize, &q->biases}});
        return 1;
    }
    if (t->dtype == ST_U8) { // bitsandbytes': codes, absmax and the nested state copied as stored
        bnb4_tensors parts;
        bnb4_parts_find(ck, p->name, t, &parts);
        nf4_layout lay;
        if (nf4_tensor_layout(&parts, p->rows, p->cols, &lay, why, sizeof why) != 0)
            fail("tensor \"%s\": %s", full, why);
        q->fmt = Q_NF4;
        q->nf4.n = n, q->nf4.block = lay.blocksize, q->nf4.offset = lay.offset;
        q->nf4.nested_block = lay.nested ? lay.nested_blocksize : 1;
        const void *codes, *absmax, *nested = nullptr, *code8 = nullptr;
        if (lay.nested) {
            upload_parts(g, {{t->data, (size_t)(n + 1) / 2, &codes},
                             {parts.absmax->data, (size_t)lay.blocks, &absmax},
                             {parts.nested_absmax->data, (size_t)lay.nested_blocks * 4, &nested},
                             {parts.nested_quant_map->data, 256 * 4, &code8}});
            q->nf4.absmax_codes = (const uint8_t *)absmax;
        } else {
            upload_parts(g, {{t->data, (size_t)(n + 1) / 2, &codes},
                             {parts.absmax->data, (size_t)lay.blocks * 4, &absmax}});
            q->nf4.absmax = (const float *)absmax;
        }
        q->nf4.codes = (const uint8_t *)codes, q->nf4.nested = (const float *)nested;
        q->nf4.code8 = (const float *)code8;
        return 1;
    }
    if (t->rank != 2 || t->shape[0] != p->rows || t->shape[1] != p->cols)
        fail("tensor \"%s\" has the wrong shape (the config implies [%ld, %ld])", p->name, p->rows, p->cols);
    if (t->dtype != ST_F32 && t->dtype != ST_F16 && t->dtype != ST_BF16 && t->dtype != ST_F64)
        fail("tensor \"%s\" has dtype %s (F32, F16, BF16, F64 are read)", full, st_dtype_name(t->dtype));
    return 0;
}

template <class E> void load_weights(gemma_cuda *g, const char *dir, const gemma_cuda_options *o) {
    const gemma_config *c = &g->cfg;
    std::vector<wplan> plan;
    long H = c->hidden, I = c->intermediate;
    char name[128];
    auto mat_plan = [&](long rows, long cols, const char *tensor, int layer = -1, int proj = -1) {
        wplan p = {};
        snprintf(p.name, sizeof p.name, "%s", tensor);
        p.rows = rows, p.cols = cols, p.layer = layer, p.proj = proj;
        plan.push_back(p);
    };
    auto layer_name = [&](int l, const char *module) {
        snprintf(name, sizeof name, "layers.%d.%s.weight", l, module);
        return name;
    };
    // matrices first, in device order: embedding, then per layer q|k|v, o, gate|up, down
    mat_plan(c->vocab, H, "embed_tokens.weight");
    if (!c->tied_embeddings) mat_plan(c->vocab, H, "lm_head.weight");
    for (int l = 0; l < c->layers; l++) {
        const gemma_attn_shape *a = &c->kind[c->layer_kind[l]];
        long qd = (long)c->heads * a->head_dim, kd = (long)a->kv_heads * a->head_dim;
        mat_plan(qd, H, layer_name(l, gemma_proj_path[PROJ_Q]), l, PROJ_Q);
        mat_plan(kd, H, layer_name(l, gemma_proj_path[PROJ_K]), l, PROJ_K);
        if (!a->k_eq_v) mat_plan(kd, H, layer_name(l, gemma_proj_path[PROJ_V]), l, PROJ_V);
        mat_plan(H, qd, layer_name(l, gemma_proj_path[PROJ_O]), l, PROJ_O);
        mat_plan(I, H, layer_name(l, gemma_proj_path[PROJ_GATE]), l, PROJ_GATE);
        mat_plan(I, H, layer_name(l, gemma_proj_path[PROJ_UP]), l, PROJ_UP);
        mat_plan(H, I, layer_name(l, gemma_proj_path[PROJ_DOWN]), l, PROJ_DOWN);
    }
    // vectors: norms (f32) and the layer scalars
    g->layer.resize(c->layers);
    std::vector<wplan> vec;
    double add = c->family == GEMMA_3 ? 1.0 : 0.0;
    float fill = c->family == GEMMA_3 ? 0.f : 1.f;
    size_t vtotal = H;
    for (int l = 0; l < c->layers; l++) vtotal += 4 * H + 2 * (size_t)c->kind[c->layer_kind[l]].head_dim;
    g->norms = (float *)dev_alloc(g, vtotal * sizeof(float));
    float *vp = g->norms;
    auto vec_plan = [&](long n, float **where, const char *tensor) {
        wplan p = {};
        snprintf(p.name, sizeof p.name, "%s", tensor);
        p.rows = n, p.is_vector = 1, p.add = add, p.fill = fill, p.dst = vp, p.layer = p.proj = -1;
        *where = vp;
        vp += n;
        vec.push_back(p);
    };
    vec_plan(H, &g->final_norm, "norm.weight");
    for (int l = 0; l < c->layers; l++) {
        dlayer &L = g->layer[l];
        L.kind = c->layer_kind[l];
        int D = c->kind[L.kind].head_dim;
        vec_plan(H, &L.input_norm, layer_name(l, "input_layernorm"));
        vec_plan(H, &L.post_attn_norm, layer_name(l, "post_attention_layernorm"));
        vec_plan(H, &L.pre_ffw_norm, layer_name(l, "pre_feedforward_layernorm"));
        vec_plan(H, &L.post_ffw_norm, layer_name(l, "post_feedforward_layernorm"));
        vec_plan(D, &L.q_norm, layer_name(l, "self_attn.q_norm"));
        vec_plan(D, &L.k_norm, layer_name(l, "self_attn.k_norm"));
        L.layer_scalar = 1;
        if (c->family == GEMMA_4) {
            wplan p = {};
            snprintf(p.name, sizeof p.name, "layers.%d.layer_scalar", l);
            p.is_vector = 1, p.rows = 1, p.scalar = &L.layer_scalar, p.fill = 1, p.layer = p.proj = -1;
            vec.push_back(p);
        }
    }

    checkpoint ck;
    int ck_open = 0;
    unsigned long long *first = nullptr;
    void *raw_own = nullptr;
    quant_work work;
    if (!o->random_init) {
        char err[512];
        if (checkpoint_open(dir, &ck, err, sizeof err) != 0) fail("%s", err);
        ck_open = 1;
    }
    try {
        // the projections stay packed with a quantized base, or where the folder stores them packed
        g->quantized = o->base != BASE_BF16;
        for (const wplan &p : plan)
            if (ck_open && p.layer >= 0 && !g->quantized) {
                const st_tensor *t = checkpoint_find(&ck, p.name);
                g->quantized = t && (t->dtype == ST_U32 || t->dtype == ST_U8);
            }
        g->base_name = o->base != BASE_BF16 ? base_dtype_name(o->base)
                     : g->quantized         ? "as the folder packs them"
                                            : nullptr;
        size_t total = 0;
        for (const wplan &p : plan)
            if (!(g->quantized && p.layer >= 0)) total += (size_t)p.rows * p.cols;
        g->weights = dev_alloc(g, total * sizeof(E));
        size_t off = 0;
        for (wplan &p : plan)
            if (!(g->quantized && p.layer >= 0)) {
                p.dst = (E *)g->weights + off;
                off += (size_t)p.rows * p.cols;
            }
        g->embed = plan[0].dst;
        g->lm_head = c->tied_embeddings ? g->embed : plan[1].dst;
        size_t scratch = 0;
        for (int l = 0; l < c->layers; l++) {
            const gemma_attn_shape *a = &c->kind[c->layer_kind[l]];
            dlayer &L = g->layer[l];
            L.qd = c->heads * a->head_dim;
            L.kd = a->kv_heads * a->head_dim;
            L.vd = a->k_eq_v ? 0 : L.kd;
            size_t qkv = (size_t)(L.qd + L.kd + L.vd) * H, o_n = (size_t)H * L.qd, gu = 2 * (size_t)I * H;
            scratch = std::max(scratch, qkv + o_n + gu + (size_t)H * I);
            // where each projection's values go in the scratch: q|k|v, o, gate|up, down
            size_t at[PROJ_COUNT] = {0,   (size_t)L.qd * H, (size_t)(L.qd + L.kd) * H, qkv, qkv + o_n,
                                     qkv + o_n + (size_t)I * H, qkv + o_n + gu};
            for (int p = 0; p < PROJ_COUNT; p++) L.packed[p].at = at[p];
        }
        size_t dequant_bytes = g->quantized ? scratch * sizeof(E) : 0;
        if (g->quantized) {
            g->dequant = dev_alloc(g, dequant_bytes);
            g->dequant_layer = -1;
            std::vector<float> t(TABLES);
            memcpy(&t[NF4_TABLE], NF4_CODE, sizeof NF4_CODE);
            for (int code = 0; code < 256; code++) t[FP8_TABLE + code] = fp8_e4m3_decode((uint8_t)code);
            memcpy(&t[DYNAMIC_TABLE], BNB_DYNAMIC_CODE, sizeof BNB_DYNAMIC_CODE);
            g->tables = (float *)dev_alloc(g, TABLES * sizeof(float));
            CU(cudaMemcpy(g->tables, t.data(), TABLES * sizeof(float), cudaMemcpyHostToDevice));
            for (dlayer &L : g->layer) {
                E *w = (E *)g->dequant;
                L.w_qkv = w, L.w_o = w + L.packed[PROJ_O].at, L.w_gu = w + L.packed[PROJ_GATE].at;
                L.w_down = w + L.packed[PROJ_DOWN].at;
            }
        } else {
            size_t mi = c->tied_embeddings ? 1 : 2;
            for (int l = 0; l < c->layers; l++) {
                dlayer &L = g->layer[l];
                L.w_qkv = plan[mi].dst;
                mi += L.vd ? 3 : 2;
                L.w_o = plan[mi++].dst;
                L.w_gu = plan[mi].dst;
                mi += 2;
                L.w_down = plan[mi++].dst;
            }
        }

        // float projections are quantized on the device one at a time, on g->stream: drawn into the
        // dequantization scratch, or copied up as stored into `raw` (the scratch where it has room for
        // the largest in its stored dtype, widened F64 counting as f32; else an allocation of its own
        // for the load); nf4's absmax and the non-finite word beside, all freed before training
        long largest = 0;
        size_t raw_bytes = 0;
        for (const wplan &p : plan) {
            if (p.dst) continue;
            const st_tensor *t = ck_open ? checkpoint_find(&ck, p.name) : nullptr;
            if (t && (t->dtype == ST_U32 || t->dtype == ST_U8)) continue; // packed: copied as stored
            largest = std::max(largest, p.rows * p.cols);
            size_t esize = t && (t->dtype == ST_F16 || t->dtype == ST_BF16) ? 2 : 4;
            raw_bytes = std::max(raw_bytes, (size_t)(p.rows * p.cols) * esize);
        }
        quant_work_open(&work, g->stream, largest, o->base == BASE_NF4);
        qformat fmt = format_of(o->base);
        auto alloc = [g](size_t bytes) {
            unsigned char *mem = (unsigned char *)dev_alloc(g, bytes);
            g->packed_mem.push_back(mem);
            return mem;
        };
        char full[300];
        if (o->random_init) { // transformers' Gemma initialisation, as `winattn init-model`
            unsigned long long s = o->seed * 0x2545f4914f6cdd1dull + 1;
            for (size_t i = 0; i < plan.size(); i++) {
                const wplan &p = plan[i];
                long n = p.rows * p.cols;
                // a quantized base: drawn into the scratch as the bf16 base draws it, then quantized
                // from there as a checkpoint of E values would be (scales and biases in E)
                E *dst = p.dst ? (E *)p.dst : (E *)g->dequant;
                k_random_normal<E><<<grid_for(n, 256), 256, 0, g->stream>>>(dst, n, 0.02f, s + i * 0x1000003ull);
                CU(cudaGetLastError());
                if (p.dst) continue;
                qmat *q = &g->layer[p.layer].packed[p.proj];
                q->rows = p.rows, q->cols = p.cols, q->fmt = fmt;
                snprintf(full, sizeof full, "%s", p.name);
                quantize_projection<E, E>(&work, (const E *)dst, q, sizeof(E) == 2 ? 2 : 0, full, nullptr, g->tables,
                                          alloc);
            }
            for (const wplan &p : vec) {
                if (p.scalar) continue;
                std::vector<float> v(p.rows, (float)(p.fill + p.add));
                CU(cudaMemcpy(p.dst, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
            }
        } else {
            std::vector<unsigned char> stage((size_t)64 << 20);
            CU(cudaMalloc(&first, sizeof *first));
            void *raw = g->dequant;
            if (raw_bytes > dequant_bytes) {
                CU(cudaMalloc(&raw_own, raw_bytes));
                raw = raw_own;
            }
            for (const wplan &p : plan) {
                if (p.dst) {
                    upload_matrix(g, &ck, &p, stage);
                    check_finite<E>(&ck, &p, first);
                    continue;
                }
                const st_tensor *t = checkpoint_find(&ck, p.name);
                if (!t) fail("checkpoint has no tensor \"%s%s\"", ck.prefix, p.name);
                if (load_packed_projection(g, &ck, &p, t)) continue;
                qmat *q = &g->layer[p.layer].packed[p.proj];
                q->rows = p.rows, q->cols = p.cols, q->fmt = fmt;
                snprintf(full, sizeof full, "%s%s", ck.prefix, p.name);
                quantize_tensor<E>(&work, t, q, raw, full, g->tables, alloc);
            }
            for (const wplan &p : vec) upload_vector(g, &ck, &p);
        }
        // the uploads above ran on the legacy stream and g->stream: all of it is on the device
        // before the first step's kernels (on g->stream) read it
        CU(cudaDeviceSynchronize());
    } catch (...) {
        cudaFree(first);
        cudaFree(raw_own);
        quant_work_close(&work);
        if (ck_open) checkpoint_close(&ck);
        throw;
    }
    cudaFree(first);
    cudaFree(raw_own);
    quant_work_close(&work);
    if (ck_open) checkpoint_close(&ck);
}

// The FP8 products set up where fp8_applies: cuBLASLt opened and probed (a device whose cuBLASLt
// refuses outer-vector scaling keeps the dequantization), the quantized operand's width per
// token, and the backward's transposed codes and stacked row scales placed in the dequantization
// scratch (codes first: a byte a weight where the scratch has two; then the scales, 4 bytes a row,
// which fit in the second half as a projection has at least 16 inputs).
void fp8_setup(gemma_cuda *g) {
    const gemma_config *c = &g->cfg;
    long H = c->hidden, I = c->intermediate, width = std::max(H, 2 * I), max_in = std::max(H, I);
    size_t codes = 0, rows = 0;
    for (const dlayer &L : g->layer) {
        width = std::max(width, (long)(L.qd + L.kd + L.vd));
        width = std::max(width, (long)L.qd);
        max_in = std::max(max_in, (long)L.qd);
        const qmat &down = L.packed[PROJ_DOWN];
        codes = std::max(codes, down.at + (size_t)(down.rows * down.cols));
        size_t r = 0;
        for (int p = 0; p < PROJ_COUNT; p++) r += L.packed[p].fmt == Q_NONE ? 0 : (size_t)L.packed[p].rows;
        rows = std::max(rows, r);
    }
    size_t scale_at = part_span(codes);
    if (scale_at + rows * sizeof(float) > codes * g->esize)
        fail("the FP8 products' transposed codes and scales do not fit the dequantization scratch");
    if (!fp8_open(&g->fp8, g->stream, g->blas_workspace, BLAS_WORKSPACE_BYTES, max_in)) return;
    g->fp8.width = width;
    g->fp8.codes_t = (uint8_t *)g->dequant;
    g->fp8.scale_t = (float *)((uint8_t *)g->dequant + scale_at);
    g->fp8.layer = -1;
}

template <class E> void open_model(gemma_cuda *g, const gemma_model_f32 *host, const char *dir,
                                   const gemma_cuda_options *o) {
    int dev = 0;
    cudaDeviceProp prop;
    CU(cudaGetDevice(&dev));
    CU(cudaGetDeviceProperties(&prop, dev));
    snprintf(g->describe, sizeof g->describe, "%s, %.1f GiB, %s", prop.name, prop.totalGlobalMem / 1073741824.0,
             g->precision == PRECISION_BF16 ? "bf16" : "f32");
    CU(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking));
    CU(cudaStreamCreateWithFlags(&g->copy_stream, cudaStreamNonBlocking));
    for (int s = 0; s < 2; s++) {
        CU(cudaEventCreateWithFlags(&g->slot_released[s], cudaEventDisableTiming));
        CU(cudaEventCreateWithFlags(&g->slot_copied[s], cudaEventDisableTiming));
    }
    CU(cudaEventCreateWithFlags(&g->copies_joined, cudaEventDisableTiming));
    // activations come from the device's stream-ordered pool; keep what it reserves between steps
    // (no release at every synchronisation) so its high-water mark is the step's peak
    CU(cudaDeviceGetDefaultMemPool(&g->pool, dev));
    uint64_t keep = UINT64_MAX;
    CU(cudaMemPoolSetAttribute(g->pool, cudaMemPoolAttrReleaseThreshold, &keep));
    blas_open(&g->blas);
    if (g->blas.create(&g->handle) != CUBLAS_STATUS_SUCCESS) fail("cublasCreate failed");
    g->blas.set_stream(g->handle, g->stream);
    g->blas.set_math_mode(g->handle, CUBLAS_DEFAULT_MATH); // no TF32 for f32 operands
    size_t ws = BLAS_WORKSPACE_BYTES;
    g->blas_workspace = dev_alloc(g, ws);
    g->blas.set_workspace(g->handle, g->blas_workspace, ws);
    wa_context_params wp = {};
    wp.cuda_stream = g->stream;
    wp.cuda_deterministic = o->deterministic;
    wa_status st = wa_context_create(&wp, &g->wa);
    if (st != WA_OK) fail("winattn context: %s", wa_status_str(st));
    load_weights<E>(g, dir, o);
    if (fp8_applies(g, prop)) fp8_setup(g);
    if (g->base_name) {
        size_t len = strlen(g->describe);
        snprintf(g->describe + len, sizeof g->describe - len, ", projections %s, %s", g->base_name,
                 g->fp8.on ? "FP8 products (cuBLASLt)" : "dequantized per layer");
    }
    g->param_count = host->param_count;
    g->params = (float *)dev_alloc(g, g->param_count * sizeof(float));
    g->grads = (float *)dev_alloc(g, g->param_count * sizeof(float));
    g->params_e = sizeof(E) == sizeof(float) ? (void *)g->params : dev_alloc(g, g->param_count * sizeof(E));
    g->moment1 = (float *)dev_alloc(g, g->param_count * sizeof(float));
    g->moment2 = (float *)dev_alloc(g, g->param_count * sizeof(float));
    size_t norm_blocks = (g->param_count + NORM_CHUNK - 1) / NORM_CHUNK;
    g->norm_partial = (double *)dev_alloc(g, (norm_blocks + 1) * sizeof(double));
    g->first_bad = (unsigned long long *)dev_alloc(g, sizeof(unsigned long long));
    CU(cudaMemsetAsync(g->grads, 0, g->param_count * sizeof(float), g->stream));
    CU(cudaMemsetAsync(g->moment1, 0, g->param_count * sizeof(float), g->stream));
    CU(cudaMemsetAsync(g->moment2, 0, g->param_count * sizeof(float), g->stream));
    // page-locked transfers run at the bus's speed (the adapters of 31B at rank 32 are 0.4 GB)
    if (g->param_count && cudaHostRegister(host->params, g->param_count * sizeof(float), cudaHostRegisterDefault) == cudaSuccess)
        g->params_pinned = host->params;
    cudaGetLastError(); // registering is an optimisation: a refusal leaves pageable copies
    params_upload<E>(g, host);
}

// param_count f32 from the device into host memory; complete when it returns
void download(gemma_cuda *g, float *dst, const float *src) {
    CU(cudaMemcpyAsync(dst, src, g->param_count * sizeof(float), cudaMemcpyDeviceToHost, g->stream));
    CU(cudaStreamSynchronize(g->stream));
}

int report(const failure &f, char *err, size_t errlen) {
    snprintf(err, errlen, "%s", f.msg);
    return -1;
}

// rows of logits the head computes at a time (head())
long logit_chunk_rows(const gemma_cuda *g) {
    return g->logit_rows > 0 ? g->logit_rows : std::max<long>(1, (1L << 30) / ((long)g->cfg.vocab * 4));
}

// f32/int32 words per packed token that a forward and a backward both take: the head's loss and
// agreement, the batch's indices, the RoPE tables, and winattn's backward workspace at its largest
// (an f32 dQ accumulator, Hq x D; counted for the forward too, which needs less)
double token_words(const gemma_cuda *g) {
    const gemma_config *c = &g->cfg;
    int dmax = std::max(c->kind[0].head_dim, c->kind[1].head_dim);
    return 2 + 3 + (c->kind[0].head_dim + c->kind[1].head_dim) + (double)c->heads * dmax;
}

// Device bytes a pass's activations may take now, beside `fixed` bytes that do not grow with its
// tokens; 0 when the device cannot say. What is free, and what the stream-ordered pool holds
// unused (the static allocations: weights, packed projections and their dequantization scratch
// with a quantized base, the adapters, are already outside it), less cuBLAS's workspace, the
// allocator's rounding and fragmentation: 3 GiB and 8% kept free (a 44,753-token batch of the 31B
// measured 137.1 of 139.8 GB with 2 GiB and 4%).
double room_for_activations(gemma_cuda *g, double fixed) {
    size_t free_b = 0, total = 0;
    uint64_t reserved = 0, used = 0;
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    cudaMemPoolGetAttribute(g->pool, cudaMemPoolAttrReservedMemCurrent, &reserved);
    cudaMemPoolGetAttribute(g->pool, cudaMemPoolAttrUsedMemCurrent, &used);
    double avail = (double)free_b + (double)(reserved - used);
    return std::max(0.0, avail * 0.92 - 3.0 * (1 << 30) - fixed);
}

// Device copies of a test's host arrays, freed together.
struct test_buffers {
    std::vector<void *> held;
    ~test_buffers() {
        for (void *p : held) cudaFree(p);
    }
    // bytes on the device, holding src's when src is not NULL
    void *get(const void *src, size_t bytes) {
        void *d = nullptr;
        CU(cudaMalloc(&d, bytes ? bytes : 1));
        held.push_back(d);
        if (src) CU(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice));
        return d;
    }
    template <class T> T *copy(const T *src, size_t count) { return (T *)get(src, count * sizeof(T)); }
};

// The layer's residual kernels on host rows of E (model_cuda.h: gemma_cuda_residual_norm and
// gemma_cuda_residual_norms_bwd), launched as layer_forward and layer_backward launch them.
template <class E>
void residual_norm_on(long rows, int n, const void *resid, const void *x, const float *w, float scale, const float *w2,
                      float eps, void *h, void *y2) {
    test_buffers B;
    size_t bytes = (size_t)rows * n * sizeof(E);
    E *dh = (E *)B.get(nullptr, bytes), *dy2 = w2 ? (E *)B.get(nullptr, bytes) : nullptr;
    const float *dw2 = w2 ? B.copy(w2, (size_t)n) : nullptr;
    k_add_norm<E><<<(unsigned)rows, ROW_THREADS>>>((const E *)B.get(resid, bytes), (const E *)B.get(x, bytes),
                                                   B.copy(w, (size_t)n), dh, scale, dw2, dy2, n, eps);
    CU(cudaGetLastError());
    CU(cudaMemcpy(h, dh, bytes, cudaMemcpyDeviceToHost));
    if (w2) CU(cudaMemcpy(y2, dy2, bytes, cudaMemcpyDeviceToHost));
}

template <class E>
void residual_norms_bwd_on(long rows, int n, const void *dout, float scalar, const void *h, const float *w_pre_ffw,
                           const void *d_mi, const void *ao, const float *w_post_attn, float eps, void *dx,
                           void *d_ao) {
    test_buffers B;
    size_t bytes = (size_t)rows * n * sizeof(E);
    E *ddx = (E *)B.get(nullptr, bytes), *dao = (E *)B.get(nullptr, bytes);
    k_residual_norms_bwd<E><<<(unsigned)rows, ROW_THREADS>>>(
        (const E *)B.get(dout, bytes), scalar, (const E *)B.get(h, bytes), B.copy(w_pre_ffw, (size_t)n),
        (const E *)B.get(d_mi, bytes), (const E *)B.get(ao, bytes), B.copy(w_post_attn, (size_t)n), ddx, dao, n, eps);
    CU(cudaGetLastError());
    CU(cudaMemcpy(dx, ddx, bytes, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(d_ao, dao, bytes, cudaMemcpyDeviceToHost));
}

// The per-head kernels on host rows (model_cuda.h: gemma_cuda_qkv_heads), launched as
// layer_forward and layer_backward launch them.
template <class E>
void qkv_heads_on(int T, int heads, int kv_heads, int D, int k_eq_v, int v_norm, float eps, const void *qkv,
                  const float *q_w, const float *k_w, const int32_t *pos, int positions, const float *cosv,
                  const float *sinv, const void *d_qr, const void *d_kr, const void *d_vn, void *qr, void *kr, void *vn,
                  void *d_qkv) {
    test_buffers B;
    long qd = (long)heads * D, kd = (long)kv_heads * D, ld = qd + kd + (k_eq_v ? 0 : kd);
    size_t row_bytes = (size_t)T * ld * sizeof(E), q_bytes = (size_t)T * qd * sizeof(E);
    size_t kv_bytes = (size_t)T * kd * sizeof(E), table = (size_t)positions * (D / 2);
    qkv_heads q = qkv_layout(ld, qd, k_eq_v ? -1 : qd + kd, T, heads, kv_heads, D, eps, B.copy(pos, (size_t)T),
                             B.copy(cosv, table), B.copy(sinv, table));
    const E *x = (const E *)B.get(qkv, row_bytes);
    const float *dq_w = B.copy(q_w, (size_t)D), *dk_w = B.copy(k_w, (size_t)D);
    E *dqr = (E *)B.get(nullptr, q_bytes), *dkr = (E *)B.get(nullptr, kv_bytes), *dvn = (E *)B.get(nullptr, kv_bytes);
    E *dx = (E *)B.get(nullptr, row_bytes);
    k_qkv_norm_rope<E><<<qkv_blocks(q), 32 * HEAD_WARPS>>>(x, q, dq_w, dk_w, v_norm, dqr, dkr, dvn);
    CU(cudaGetLastError());
    k_qkv_norm_rope_bwd<E><<<qkv_blocks(q), 32 * HEAD_WARPS>>>(x, q, dq_w, dk_w, v_norm,
                                                               (const E *)B.get(d_qr, q_bytes),
                                                               (const E *)B.get(d_kr, kv_bytes),
                                                               (const E *)B.get(d_vn, kv_bytes), dx);
    CU(cudaGetLastError());
    CU(cudaMemcpy(qr, dqr, q_bytes, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(kr, dkr, kv_bytes, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(vn, dvn, kv_bytes, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(d_qkv, dx, row_bytes, cudaMemcpyDeviceToHost));
}

__global__ void k_rsqrt(const float *x, float *y, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] = rsqrtf(x[i]);
}

} // namespace

extern "C" {

long gemma_cuda_forward_token_budget(gemma_cuda *g) {
    const gemma_config *c = &g->cfg;
    // what forward() holds per packed token: in E, the residual stream in and out of a layer, one
    // layer's activations and the head's normed rows; in f32 words, a layer's log-sum-exps and
    // the words every pass takes; one chunk of logits (f32) besides
    double elems = 3.0 * c->hidden + acts_elems_per_token(g, 0);
    double per_token = elems * g->esize + ((double)c->heads + token_words(g)) * 4;
    if (g->fp8.on) per_token += (double)g->fp8.width + 4;
    double budget = room_for_activations(g, (double)logit_chunk_rows(g) * c->vocab * 4) / per_token;
    return budget > 0 ? (long)std::min(budget, (double)INT32_MAX) : 0;
}

long gemma_cuda_token_budget(gemma_cuda *g, long largest_batch) {
    const gemma_config *c = &g->cfg;
    long H = c->hidden, kept = 0, full = 0;
    for (const dlayer &L : g->layer)
        if (L.kind == LAYER_FULL) kept += L.qd, full++;
    // what backward() holds per packed token, in elements of E and in f32/int32 words: the layer
    // inputs (two buffers with the inputs in host memory, all L + 1 without) and the two gradient
    // rows, one layer's activations and their gradients, the full layers' kept attention output,
    // the head's normed rows and their gradient
    double elems_but_inputs = 2.0 * H + acts_elems_per_token(g, 1) + kept + 2 * H;
    // f32 words: the log-sum-exps of a layer and of the full layers kept, and the words every pass
    // takes (token_words)
    double per_token = elems_but_inputs * g->esize + ((double)c->heads * (1 + full) + token_words(g)) * 4;
    if (g->fp8.on) per_token += (double)g->fp8.width + 4; // the FP8 products' quantized rows and scales
    // fixed: one chunk of logits (f32) and their gradient (E)
    double room = room_for_activations(g, (double)logit_chunk_rows(g) * c->vocab * (4 + g->esize));
    auto tokens_at = [&](double inputs_per_token) {
        double budget = room / (per_token + inputs_per_token * H * g->esize);
        return budget > 0 ? (long)std::min(budget, (double)INT32_MAX) : 0L;
    };
    long inputs_in_host = tokens_at(2), inputs_on_device = tokens_at(c->layers + 1);
    // page-locked host memory for the largest pass the trainer will run (the budget or its largest
    // batch, whichever is less), allocated now; refused, the inputs stay on the device
    long pass = largest_batch > 0 ? std::min(largest_batch, inputs_in_host) : inputs_in_host;
    char why[256];
    if (host_inputs_reserve(g, pass, why, sizeof why)) {
        g->inputs_on_host = 1;
        return inputs_in_host;
    }
    g->inputs_on_host = 0;
    snprintf(g->inputs_line, sizeof g->inputs_line, "layer inputs on the device (refused: %s)", why);
    return inputs_on_device;
}

int gemma_cuda_open(const gemma_model_f32 *host, const char *dir, const gemma_cuda_options *o, gemma_cuda **out,
                    char *err, size_t errlen) {
    *out = nullptr;
    gemma_cuda *g = new gemma_cuda();
    g->cfg = host->cfg;
    g->lora = host->lora;
    g->precision = o->precision;
    g->esize = o->precision == PRECISION_BF16 ? 2 : 4;
    g->logit_rows = o->logit_rows;
    const char *prof = getenv("WINATTN_TRAIN_PROFILE");
    g->prof.on = prof && *prof && strcmp(prof, "0") != 0;
    g->prof.gemm_phase = PH_GEMM, g->prof.elem_phase = PH_ELEM;
    g->inputs_on_host = 1; // the memory comes with gemma_cuda_token_budget or the first backward
    snprintf(g->inputs_line, sizeof g->inputs_line, "layer inputs in page-locked host memory (none allocated yet)");
    try {
        if (!wa_device_available(WA_DEVICE_CUDA)) fail("no CUDA device is available");
        if (g->cfg.kind[0].head_dim % 2 || g->cfg.kind[1].head_dim % 2) fail("RoPE needs an even head dim");
        if (o->precision == PRECISION_BF16) open_model<bf16>(g, host, dir, o);
        else open_model<float>(g, host, dir, o);
    } catch (const failure &f) {
        gemma_cuda_close(g);
        return report(f, err, errlen);
    }
    *out = g;
    return 0;
}

int gemma_cuda_quantize(base_dtype base, const st_tensor *t, const char *name, gemma_cuda_packed *out, char *err,
                        size_t errlen) {
    memset(out, 0, sizeof *out);
    quant_work work;
    void *raw = nullptr;
    unsigned char *mem = nullptr;
    int rc = 0;
    try {
        if (!wa_device_available(WA_DEVICE_CUDA)) fail("no CUDA device is available");
        if (base == BASE_BF16) fail("bf16 is not a quantized format");
        if (t->rank != 2 || (t->dtype != ST_F32 && t->dtype != ST_F16 && t->dtype != ST_BF16 && t->dtype != ST_F64))
            fail("tensor \"%s\" is not a matrix of F32, F16, BF16 or F64", name);
        qmat q;
        q.rows = (long)t->shape[0], q.cols = (long)t->shape[1], q.fmt = format_of(base);
        long n = q.rows * q.cols;
        quant_work_open(&work, 0, n, base == BASE_NF4);
        CU(cudaMalloc(&raw, (size_t)(n ? n : 1) * sizeof(float)));
        auto alloc = [&mem](size_t bytes) {
            CU(cudaMalloc(&mem, bytes ? bytes : 1));
            return mem;
        };
        packed_layout lay = quantize_tensor<float>(&work, t, &q, raw, name, nullptr, alloc);
        out->count = lay.count;
        out->offset = q.fmt == Q_NF4 ? q.nf4.offset : 0;
        for (int k = 0; k < lay.count; k++) {
            out->bytes[k] = lay.bytes[k];
            out->part[k] = (unsigned char *)malloc(lay.bytes[k] ? lay.bytes[k] : 1);
            if (!out->part[k]) fail("out of host memory for %zu bytes", lay.bytes[k]);
            CU(cudaMemcpy(out->part[k], mem + lay.at[k], lay.bytes[k], cudaMemcpyDeviceToHost));
        }
    } catch (const failure &f) {
        gemma_cuda_packed_free(out);
        rc = report(f, err, errlen);
    }
    cudaFree(mem);
    cudaFree(raw);
    quant_work_close(&work);
    return rc;
}

void gemma_cuda_packed_free(gemma_cuda_packed *p) {
    for (int k = 0; k < 3; k++) free(p->part[k]);
    memset(p, 0, sizeof *p);
}

void gemma_cuda_close(gemma_cuda *g) {
    if (!g) return;
    if (g->stream) cudaStreamSynchronize(g->stream);
    host_inputs_free(g);
    for (int s = 0; s < 2; s++) {
        if (g->slot_released[s]) cudaEventDestroy(g->slot_released[s]);
        if (g->slot_copied[s]) cudaEventDestroy(g->slot_copied[s]);
    }
    if (g->copies_joined) cudaEventDestroy(g->copies_joined);
    if (g->copy_stream) cudaStreamDestroy(g->copy_stream);
    for (cudaEvent_t e : g->prof.ev) cudaEventDestroy(e);
    if (g->wa) wa_context_destroy(g->wa);
    if (g->handle) g->blas.destroy(g->handle);
    fp8_close(&g->fp8);
    for (int k = 0; k < 2; k++) cudaFree(g->cosv[k]), cudaFree(g->sinv[k]);
    cudaFree(g->weights);
    for (void *p : g->packed_mem) cudaFree(p);
    cudaFree(g->dequant);
    cudaFree(g->tables);
    cudaFree(g->norms);
    cudaFree(g->params);
    cudaFree(g->grads);
    if (g->params_e != g->params) cudaFree(g->params_e);
    cudaFree(g->moment1);
    cudaFree(g->moment2);
    cudaFree(g->norm_partial);
    cudaFree(g->first_bad);
    if (g->params_pinned) cudaHostUnregister((void *)g->params_pinned);
    cudaFree(g->blas_workspace);
    if (g->stream) cudaStreamDestroy(g->stream);
    if (g->blas.lib) dlclose(g->blas.lib);
    delete g;
}

int gemma_cuda_forward_batch(gemma_cuda *g, const gemma_model_f32 *host, const gemma_seq *seqs, int n,
                             gemma_stats *stats, float *logits, char *err, size_t errlen) {
    try {
        if (g->precision == PRECISION_BF16) forward<bf16>(g, host, seqs, n, stats, logits);
        else forward<float>(g, host, seqs, n, stats, logits);
        CU(cudaStreamSynchronize(g->stream));
    } catch (const failure &f) {
        return report(f, err, errlen);
    }
    return 0;
}

int gemma_cuda_backward_batch(gemma_cuda *g, gemma_model_f32 *host, const gemma_seq *seqs, int n, double grad_scale,
                              gemma_stats *stats, char *err, size_t errlen) {
    try {
        if (g->precision == PRECISION_BF16) backward<bf16>(g, host, seqs, n, grad_scale, stats);
        else backward<float>(g, host, seqs, n, grad_scale, stats);
        CU(cudaStreamSynchronize(g->stream)); // a fault of the backward is reported by this call
    } catch (const failure &f) {
        return report(f, err, errlen);
    }
    return 0;
}

int gemma_cuda_params_upload(gemma_cuda *g, const gemma_model_f32 *host, char *err, size_t errlen) {
    try {
        if (host->param_count != g->param_count)
            fail("the adapters have %zu parameters, the device's %zu", host->param_count, g->param_count);
        if (g->precision == PRECISION_BF16) params_upload<bf16>(g, host);
        else params_upload<float>(g, host);
    } catch (const failure &f) {
        return report(f, err, errlen);
    }
    return 0;
}

int gemma_cuda_params_download(gemma_cuda *g, gemma_model_f32 *host, char *err, size_t errlen) {
    try {
        if (host->param_count != g->param_count)
            fail("the adapters have %zu parameters, the device's %zu", host->param_count, g->param_count);
        download(g, host->params, g->params);
    } catch (const failure &f) {
        return report(f, err, errlen);
    }
    return 0;
}

int gemma_cuda_grads_download(gemma_cuda *g, float *grads, char *err, size_t errlen) {
    try {
        download(g, grads, g->grads);
    } catch (const failure &f) {
        return report(f, err, errlen);
    }
    return 0;
}

int gemma_cuda_grads_zero(gemma_cuda *g, char *err, size_t errlen) {
    try {
        CU(cudaMemsetAsync(g->grads, 0, g->param_count * sizeof(float), g->stream));
        CU(cudaStreamSynchronize(g->stream));
    } catch (const failure &f) {
        return report(f, err, errlen);
    }
    return 0;
}

int gemma_cuda_moments_upload(gemma_cuda *g, const float *m1, const float *m2, char *err, size_t errlen) {
    try {
        size_t bytes = g->param_count * sizeof(float);
        CU(cudaMemcpyAsync(g->moment1, m1, bytes, cudaMemcpyHostToDevice, g->stream));
        CU(cudaMemcpyAsync(g->moment2, m2, bytes, cudaMemcpyHostToDevice, g->stream));
        CU(cudaStreamSynchronize(g->stream)); // m1 and m2 may change once this returns
    } catch (const failure &f) {
        return report(f, err, errlen);
    }
    return 0;
}

int gemma_cuda_moments_download(gemma_cuda *g, float *m1, float *m2, char *err, size_t errlen) {
    try {
        download(g, m1, g->moment1);
        download(g, m2, g->moment2);
    } catch (const failure &f) {
        return report(f, err, errlen);
    }
    return 0;
}

int gemma_cuda_grads_first_nonfinite(gemma_cuda *g, size_t *index, float *value, char *err, size_t errlen) {
    try {
        unsigned long long first = ~0ull;
        *index = SIZE_MAX;
        *value = 0;
        long n = (long)g->param_count;
        if (n > 0) {
            CU(cudaMemsetAsync(g->first_bad, 0xff, sizeof first, g->stream)); // ~0: none found
            k_first_nonfinite<float><<<grid_for(n, 256), 256, 0, g->stream>>>(g->grads, n, g->first_bad);
            CU(cudaGetLastError());
            CU(cudaMemcpyAsync(&first, g->first_bad, sizeof first, cudaMemcpyDeviceToHost, g->stream));
            CU(cudaStreamSynchronize(g->stream));
        }
        if (first < (unsigned long long)g->param_count) {
            CU(cudaMemcpyAsync(value, g->grads + first, sizeof *value, cudaMemcpyDeviceToHost, g->stream));
            CU(cudaStreamSynchronize(g->stream));
            *index = (size_t)first;
        }
    } catch (const failure &f) {
        return report(f, err, errlen);
    }
    return 0;
}

int gemma_cuda_optimizer_step(gemma_cuda *g, const gemma_cuda_adam *a, double *grad_norm, int *nonfinite, char *err,
                              size_t errlen) {
    try {
        if (g->precision == PRECISION_BF16) optimizer_step<bf16>(g, a, grad_norm, nonfinite);
        else optimizer_step<float>(g, a, grad_norm, nonfinite);
    } catch (const failure &f) {
        return report(f, err, errlen);
    }
    return 0;
}

int gemma_cuda_profile_take(gemma_cuda *g, gemma_cuda_profile *out) {
    gemma_cuda_profile none = {};
    if (out) *out = g->prof.on ? g->prof.sum : none;
    int any = g->prof.on && g->prof.sum.passes > 0;
    g->prof.sum = none;
    return any;
}

void gemma_cuda_memory(gemma_cuda *g, size_t *peak, size_t *device_in_use) {
    uint64_t high = 0;
    cudaMemPoolGetAttribute(g->pool, cudaMemPoolAttrReservedMemHigh, &high);
    size_t rope = 0;
    for (int k = 0; k < 2; k++) rope += 2 * (size_t)g->rope_len * (g->cfg.kind[k].head_dim / 2) * sizeof(float);
    if (peak) *peak = g->static_bytes + rope + high;
    size_t free_b = 0, total = 0;
    cudaMemGetInfo(&free_b, &total);
    if (device_in_use) *device_in_use = total - free_b;
}

void gemma_cuda_reset_peak(gemma_cuda *g) {
    uint64_t zero = 0;
    cudaMemPoolSetAttribute(g->pool, cudaMemPoolAttrReservedMemHigh, &zero);
}

const char *gemma_cuda_describe(const gemma_cuda *g) { return g->describe; }

const char *gemma_cuda_layer_inputs(const gemma_cuda *g) { return g->inputs_line; }

int gemma_cuda_residual_norm(int bf16_rows, long rows, int n, const void *resid, const void *x, const float *w,
                             float scale, const float *w2, float eps, void *h, void *y2, char *err, size_t errlen) {
    try {
        if (rows < 1 || n < 1) fail("residual norm: rows and n must be positive");
        if (bf16_rows) residual_norm_on<bf16>(rows, n, resid, x, w, scale, w2, eps, h, y2);
        else residual_norm_on<float>(rows, n, resid, x, w, scale, w2, eps, h, y2);
        CU(cudaDeviceSynchronize());
    } catch (const failure &e) {
        return report(e, err, errlen);
    }
    return 0;
}

int gemma_cuda_residual_norms_bwd(int bf16_rows, long rows, int n, const void *dout, float scalar, const void *h,
                                  const float *w_pre_ffw, const void *d_mi, const void *ao, const float *w_post_attn,
                                  float eps, void *dx, void *d_ao, char *err, size_t errlen) {
    try {
        if (rows < 1 || n < 1) fail("residual norms backward: rows and n must be positive");
        if (bf16_rows)
            residual_norms_bwd_on<bf16>(rows, n, dout, scalar, h, w_pre_ffw, d_mi, ao, w_post_attn, eps, dx, d_ao);
        else residual_norms_bwd_on<float>(rows, n, dout, scalar, h, w_pre_ffw, d_mi, ao, w_post_attn, eps, dx, d_ao);
        CU(cudaDeviceSynchronize());
    } catch (const failure &e) {
        return report(e, err, errlen);
    }
    return 0;
}

int gemma_cuda_qkv_heads(int bf16_rows, int T, int heads, int kv_heads, int D, int k_eq_v, int v_norm, float eps,
                         const void *qkv, const float *q_w, const float *k_w, const int32_t *pos, int positions,
                         const float *cosv, const float *sinv, const void *d_qr, const void *d_kr, const void *d_vn,
                         void *qr, void *kr, void *vn, void *d_qkv, char *err, size_t errlen) {
    try {
        if (T < 1 || heads < 1 || kv_heads < 1 || D < 2 || D % 2 || positions < 1)
            fail("qkv heads: T, heads, kv_heads and positions must be positive, D even");
        for (int t = 0; t < T; t++)
            if (pos[t] < 0 || pos[t] >= positions)
                fail("qkv heads: position %d of row %d is outside the tables", pos[t], t);
        if (bf16_rows)
            qkv_heads_on<bf16>(T, heads, kv_heads, D, k_eq_v, v_norm, eps, qkv, q_w, k_w, pos, positions, cosv, sinv,
                               d_qr, d_kr, d_vn, qr, kr, vn, d_qkv);
        else
            qkv_heads_on<float>(T, heads, kv_heads, D, k_eq_v, v_norm, eps, qkv, q_w, k_w, pos, positions, cosv, sinv,
                                d_qr, d_kr, d_vn, qr, kr, vn, d_qkv);
        CU(cudaDeviceSynchronize());
    } catch (const failure &e) {
        return report(e, err, errlen);
    }
    return 0;
}

int gemma_cuda_rsqrt(const float *x, float *y, long n, char *err, size_t errlen) {
    try {
        if (n < 1) return 0;
        test_buffers B;
        float *dx = B.copy(x, (size_t)n), *dy = B.copy<float>(nullptr, (size_t)n);
        k_rsqrt<<<grid_for(n, 256), 256>>>(dx, dy, n);
        CU(cudaGetLastError());
        CU(cudaMemcpy(y, dy, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost));
    } catch (const failure &e) {
        return report(e, err, errlen);
    }
    return 0;
}

int gemma_cuda_fp8_product(int input_grad, long rows, long n_out, long k_in, const uint8_t *codes,
                           const float *row_scale, const uint16_t *x, uint16_t *y, uint8_t *xq, float *x_scale,
                           int *compute_capability, char *err, size_t errlen) {
    fp8_engine f;
    cudaStream_t st = nullptr;
    void *mem = nullptr, *workspace = nullptr;
    *compute_capability = 0;
    int rc = 0;
    try {
        int dev = 0;
        cudaDeviceProp prop;
        CU(cudaGetDevice(&dev));
        CU(cudaGetDeviceProperties(&prop, dev));
        *compute_capability = prop.major * 10 + prop.minor;
        if (*compute_capability < 89) return 1;
        if (rows < 1 || n_out % 16 || k_in % 16 || n_out < 16 || k_in < 16)
            fail("an FP8 product needs rows >= 1 and n_out, k_in positive multiples of 16");
        CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        CU(cudaMalloc(&workspace, BLAS_WORKSPACE_BYTES));
        if (!fp8_open(&f, st, workspace, BLAS_WORKSPACE_BYTES, std::max(n_out, k_in))) {
            rc = 1;
        } else {
            long in = input_grad ? n_out : k_in, out = input_grad ? k_in : n_out, w = n_out * k_in;
            // one allocation, each part at a 256-byte boundary
            size_t at_codes = 0, at_scale = at_codes + part_span((size_t)w),
                   at_t = at_scale + part_span((size_t)n_out * 4), at_x = at_t + part_span((size_t)w),
                   at_y = at_x + part_span((size_t)(rows * in) * 2), at_q = at_y + part_span((size_t)(rows * out) * 2),
                   at_s = at_q + part_span((size_t)(rows * in)), total = at_s + part_span((size_t)rows * 4);
            CU(cudaMalloc(&mem, total));
            unsigned char *m = (unsigned char *)mem;
            CU(cudaMemcpy(m + at_codes, codes, (size_t)w, cudaMemcpyHostToDevice));
            CU(cudaMemcpy(m + at_scale, row_scale, (size_t)n_out * 4, cudaMemcpyHostToDevice));
            CU(cudaMemcpy(m + at_x, x, (size_t)(rows * in) * 2, cudaMemcpyHostToDevice));
            const bf16 *dx = (const bf16 *)(m + at_x);
            uint8_t *q = m + at_q;
            float *qs = (float *)(m + at_s);
            if (!input_grad) { // as frozen_forward
                quant_rows<bf16>(st, dx, k_in, nullptr, rows, k_in, q, qs);
                fp8_product(&f, st, rows, n_out, k_in, q, k_in, qs, m + at_codes, k_in, (const float *)(m + at_scale),
                            (bf16 *)(m + at_y), n_out);
            } else { // as frozen_input_grad on a group of one projection
                transpose_codes(st, m + at_codes, n_out, k_in, m + at_t, n_out);
                quant_rows<bf16>(st, dx, n_out, (const float *)(m + at_scale), rows, n_out, q, qs);
                fp8_product(&f, st, rows, k_in, n_out, q, n_out, qs, m + at_t, n_out, f.ones, (bf16 *)(m + at_y),
                            k_in);
            }
            CU(cudaStreamSynchronize(st));
            CU(cudaMemcpy(y, m + at_y, (size_t)(rows * out) * 2, cudaMemcpyDeviceToHost));
            if (xq) CU(cudaMemcpy(xq, q, (size_t)(rows * in), cudaMemcpyDeviceToHost));
            if (x_scale) CU(cudaMemcpy(x_scale, qs, (size_t)rows * 4, cudaMemcpyDeviceToHost));
        }
    } catch (const failure &e) {
        rc = report(e, err, errlen);
    }
    if (st) cudaStreamSynchronize(st);
    fp8_close(&f);
    cudaFree(mem);
    cudaFree(workspace);
    if (st) cudaStreamDestroy(st);
    return rc;
}

} // extern "C"

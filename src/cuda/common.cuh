/* common.cuh — what the CUDA translation units share: the kernel parameter block, dtype
 * conversions, and the entry points of the tensor-core kernels (attn_mma.cu) that the
 * dispatcher in attn_cuda.cu calls. */
#ifndef WA_CUDA_COMMON_CUH
#define WA_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

extern "C" {
#include "../internal.h"
}

#define CUDA_TRY(call)                                                                                        \
    do {                                                                                                      \
        cudaError_t err_ = (call);                                                                            \
        if (err_ != cudaSuccess)                                                                              \
            return wa_fail(WA_ERR_CUDA, "%s failed: %s (%s:%d)", #call, cudaGetErrorString(err_), __FILE__, __LINE__); \
    } while (0)

struct dev_tensor {
    char *data;
    long long s0, s1, s2; /* element strides of B, H, N; the D stride is 1 */
};

struct kparams {
    dev_tensor q, k, v, o, lse, dout, dq, dk, dv;
    long long B, Hq, Hkv, Nq, Nk, D, group;
    float scale, softcap;
    wa_window win;
    float *delta, *rnorm; /* [B, Hq, Nq]; rnorm only for f32 */
    float *dq_acc;        /* the atomic-dQ option's f32 accumulator (else NULL), B*Hq*nq_pad*D floats:
                           * version 2 uses [B, Hq, Nq, D], version 4 its own order (bwd_hopper.cu) */
    float *lse2;          /* version-4 backward: lse·log2(e) per row, +inf past Nq and for empty rows */
    long long nq_pad;     /* row stride of delta and lse2 in the version-4 backward (Nq rounded up to 64) */
    int tile, n_qtiles, n_ktiles;
};

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T> __device__ __forceinline__ T *row_of(const dev_tensor &t, long long b, long long h, long long n) {
    return (T *)t.data + b * t.s0 + h * t.s1 + n * t.s2;
}

/* ---- tensor-core path (attn_mma.cu): f16/bf16, D in {64, 128, 256, 512}, 16-byte aligned rows ---- */
int mma_supports(const wa_problem *p);
/* forward into o and lse */
wa_status mma_forward(const kparams &kp, wa_dtype dt, cudaStream_t s);
/* version 4's forward (fwd_hopper.cu: TMA, warp-specialised wgmma) when it applies (D = 64, 128,
 * 256, strides TMA can express); *taken = 0 leaves the call to mma_forward */
wa_status hopper_forward(const kparams &kp, wa_dtype dt, cudaStream_t s, int *taken);
/* version 4's backward (bwd_hopper.cu) when it applies (D = 64, 128, 256, lse given, strides TMA
 * can express); it needs kp.delta and kp.lse2 with B*Hq*nq_pad floats each. *taken = 0 leaves the
 * call to version 2 in mma_backward */
int hopper_backward_supports(const kparams &kp);
/* whether version 4 has the fused form (dQ added by the dK/dV kernel into kp.dq_acc) for kp's
 * head dim (D <= 128); elsewhere it ignores kp.dq_acc */
int hopper_backward_fuses_dq(const kparams &kp);
wa_status hopper_backward(const kparams &kp, wa_dtype dt, cudaStream_t s, int *taken);
/* version 5's backward at D = 512 (bwd_wide.cu, mma.sync); dQ by atomic adds into kp.dq_acc
 * ([B, Hq, Nq, D] f32) when it is set, else by its own deterministic kernel; the dispatcher sets it
 * only where wide_backward_atomic_dq() says so (a lab build) */
int wide_backward_atomic_dq(void);
wa_status wide_backward(const kparams &kp, wa_dtype dt, cudaStream_t s);
/* backward; kp.delta must point to B*Hq*Nq floats of workspace, which this fills */
wa_status mma_backward(const kparams &kp, wa_dtype dt, cudaStream_t s);

#endif /* WA_CUDA_COMMON_CUH */

/* sm90/bwd_common.cuh — what the backward's kernels on Hopper share (sm90/bwd_*.cu): the CTA's
 * shape and the probability of one score. */
#ifndef WA_CUDA_SM90_BWD_COMMON_CUH
#define WA_CUDA_SM90_BWD_COMMON_CUH

#include "../prims/hopper.cuh"

namespace {

constexpr int kThreads = kSm90Threads; /* producer + two consumer warpgroups */
constexpr int kProducerRegs = kSm90ProducerRegs, kConsumerRegs = kSm90ConsumerRegs;

/* the P·dP step of one accumulator element: dS with respect to the raw q·k (scale and the
 * softcap's derivative included); x is the raw score, lse2 and delta the row's (or column's) */
template <Cap CAP>
__device__ __forceinline__ void prob_of(const kparams &p, float x, float lse2, float scale2, float &pv, float &dcap) {
    if (CAP == Cap::on) {
        const float t = tanhf(x * p.scale / p.softcap);
        pv = exp2_(p.softcap * t * kLog2e - lse2);
        dcap = 1.0f - t * t;
    } else {
        pv = exp2_(x * scale2 - lse2);
        dcap = 1.0f;
    }
}

/* Two ways to split a dK/dV CTA's work between its consumer warpgroups (traits.cuh):
 *   by rows (D ≤ 128): 128 keys per CTA, each warpgroup owns 64 of them with both dK and dV in
 *     registers (2 × 64 × D / 128 ≤ 128 per thread) and does all four products for them;
 *   by output (D = 256): 64 keys per CTA, warpgroup 1 owns dV, warpgroup 2 dK (256 registers per
 *     thread would not fit one), Pᵀ goes from the first to the second through shared memory. */
template <int D> __host__ __device__ constexpr bool kv_by_rows() { return sm90_dkdv_by_rows<D>(); }
template <int D> __host__ __device__ constexpr int kv_keys() { return sm90_dkdv_keys<D>(); }

/* the prep kernel's dynamic shared memory: dO and O of 64 rows */
template <int D> constexpr size_t prep_smem_bytes() { return 1024 + (size_t)2 * 64 * D * 2; }

/* f(T) for the call's dtype: bf16 or f16 */
template <typename F> static wa_status for_dtype(wa_dtype dt, F &&f) {
    if (dt == WA_BF16) return f(__nv_bfloat16());
    return f(__half());
}

} /* namespace */

#endif /* WA_CUDA_SM90_BWD_COMMON_CUH */

/* sm90/fwd_cp_async.cu — the forward at D = 256 on wgmma with cp.async loads: Hopper's path for
 * the calls the TMA forward cannot take (tensors TMA cannot describe, a negative scale without a
 * softcap, WINATTN_CUDA=no-tma). Same algorithm and register layout as the mma.sync forward
 * (sm80/fwd.cu): each warp's 16 rows sit in the same accumulator positions. */
#include "../prims/mma.cuh"

#include <stdint.h>

namespace {

constexpr int kWgBM = kSm90CpAsyncRows, kWgThreads = kSm90CpAsyncThreads;
template <int D> __host__ __device__ constexpr int wg_bn() { return kSm90CpAsyncKeys; }
template <int D> constexpr size_t wg_smem_bytes() { return 1024 + (size_t)2 * (kWgBM * D + 4 * wg_bn<D>() * D); }

/* Same algorithm and register layout as fwd_mma_kernel (each warp's 16 rows sit in the same
 * accumulator positions); the two warpgroups each issue S = Q Kᵀ for their 64 rows as one chain
 * of wgmma reading Q and K from shared memory, and O += P V with P from registers. Both
 * warpgroups run in step (one barrier per key tile). */
template <typename T, int D, bool VARLEN> __global__ void __launch_bounds__(kWgThreads, 1) fwd_wgmma_kernel(const kparams kp) {
#if WA_HOPPER_STUB /* not the sm_90a compilation: never launched (common.cuh) */
    __trap();
#else
    constexpr int BM = kWgBM, BN = wg_bn<D>(), NT = kWgThreads, KS = D / 16, DB = D / 64;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ = (smem_u32(smem) + 1023u) & ~1023u, sK = sQ + BM * D * 2, sV = sK + 2 * BN * D * 2;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, wg = warp >> 2;
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const long long h = blockIdx.y, b = sv.b(), hk = h / p.group, i0 = (long long)blockIdx.x * BM;
    if (VARLEN && i0 >= p.Nq) return;
    const int m = (int)min((long long)BM, p.Nq - i0);
    int64_t kt0, kt1;
    wa_key_tiles_for_rows(&p.win, i0, i0 + m, BN, &kt0, &kt1);

    load_tile_blk<T, D, BM, NT>(sQ, p.q, b, h, i0, p.Nq);
    if (kt0 < kt1) {
        load_tile_blk<T, D, BN, NT>(sK, p.k, b, hk, kt0 * BN, p.Nk);
        load_tile_blk<T, D, BN, NT>(sV, p.v, b, hk, kt0 * BN, p.Nk);
    }
    cp_async_commit();

    float acc[DB][8][4];
    zero_frags(acc);
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
    const long long rows[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
    const float scale2 = p.scale * kLog2e;

    for (long long kt = kt0; kt < kt1; kt++) {
        const int stage = (int)((kt - kt0) & 1);
        if (kt + 1 < kt1) {
            load_tile_blk<T, D, BN, NT>(sK + (stage ^ 1) * BN * D * 2, p.k, b, hk, (kt + 1) * BN, p.Nk);
            load_tile_blk<T, D, BN, NT>(sV + (stage ^ 1) * BN * D * 2, p.v, b, hk, (kt + 1) * BN, p.Nk);
        }
        cp_async_commit();
        cp_async_wait<1>();
        fence_proxy_async();
        __syncthreads();
        const uint32_t k_s = sK + stage * BN * D * 2, v_s = sV + stage * BN * D * 2;

        float s[BN / 8][4];
#pragma unroll
        for (int i = 0; i < BN / 8; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
        reg_fence(s);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
            wgmma_ss<T, BN>(s, gmma_desc(sQ + (ks >> 2) * (BM * 128) + wg * (64 * 128) + (ks & 3) * 32),
                            gmma_desc(k_s + (ks >> 2) * (BN * 128) + (ks & 3) * 32), ks > 0);
        wg_commit();
        wg_wait_all();
        reg_fence(s);

        const long long j0 = kt * BN;
        const int n = (int)min((long long)BN, p.Nk - j0);
        const bool edge = n < BN || wa_tile_needs_mask(&p.win, i0, i0 + m, j0, j0 + n);
        /* acc[DB][8][4] is laid out as DB * 8 fragments of 8 columns, in column order */
        softmax_step<BN, DB * 8>(p, s, reinterpret_cast<float (&)[DB * 8][4]>(acc), row_max, row_sum, rows, j0, edge,
                                 t4, scale2);
        uint32_t pa[BN / 16][4];
        pack_a<T, BN>(pa, s);
        reg_fence(pa);
#pragma unroll
        for (int c = 0; c < DB; c++) reg_fence(acc[c]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
            for (int c = 0; c < DB; c++) wgmma_rs_t<T, 64>(acc[c], pa[kk], gmma_desc(v_s + c * (BN * 128) + kk * (16 * 128)), 1);
        wg_commit();
        wg_wait_all();
#pragma unroll
        for (int c = 0; c < DB; c++) reg_fence(acc[c]);
        __syncthreads(); /* every warp is done with this stage before the next prefetch overwrites it */
    }
    cp_async_wait<0>();
    store_rows<T, DB * 8>(p, reinterpret_cast<const float (&)[DB * 8][4]>(acc), row_max, row_sum, rows, b, h, t4);
#endif
}

template <typename T, int D, bool VARLEN> static wa_status launch(const kparams &kp, cudaStream_t s) {
    static volatile unsigned long long done = 0;
    constexpr size_t bytes = wg_smem_bytes<D>();
    CUDA_TRY(raise_once(fwd_wgmma_kernel<T, D, VARLEN>, bytes, &done));
    return over_sequences(kp, [&](const kparams &c, unsigned z) {
        fwd_wgmma_kernel<T, D, VARLEN><<<dim3((unsigned)((kp.Nq + kWgBM - 1) / kWgBM), (unsigned)kp.Hq, z), kWgThreads, bytes, s>>>(c);
        CUDA_TRY(cudaGetLastError());
        return WA_OK;
    });
}

} /* namespace */

wa_status sm90_forward_cp_async(const kparams &kp, wa_dtype dt, cudaStream_t s) {
    if (kp.D != 256) return wa_fail(WA_ERR_UNSUPPORTED, "cp.async wgmma forward: D = %lld", kp.D);
    if (dt == WA_BF16) return kp.cu_q ? launch<__nv_bfloat16, 256, true>(kp, s) : launch<__nv_bfloat16, 256, false>(kp, s);
    return kp.cu_q ? launch<__half, 256, true>(kp, s) : launch<__half, 256, false>(kp, s);
}

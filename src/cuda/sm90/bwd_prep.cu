/* sm90/bwd_prep.cu — the backward's first kernel on Hopper, at every head dim: δ_i = dO_i · O_i
 * and lse2_i = lse_i·log2(e) into row-padded arrays (+inf for rows past Nq and rows that see
 * nothing, so their P is 0 without a test). δ is the diagonal of dO Oᵀ taken on wgmma, the
 * instruction that forms dP in the dK/dV and dQ kernels: with a one-key window O_i = V_j bitwise,
 * so dP_ij − δ_i is exactly 0 and dq = dk = 0 exactly, as the parity sweep's window-1 cases demand.
 * The fused form's dQ accumulator is zeroed here too. Also the copies of the backward's tensor
 * maps per sequence of a varlen call (sm90_write_seq_maps). */
#include "bwd_common.cuh"

namespace {

/* One CTA (a warpgroup) per 64 query rows of a head. ZERO_ALL false (the ordered dQ, whose first
 * share of each block is stored rather than added): only the accumulator tiles no key tile adds to
 * are zeroed. */
template <typename T, int D, bool VARLEN, bool ZERO_ALL = true> __global__ void __launch_bounds__(128) prep_kernel(const kparams kp) {
#if WA_HOPPER_STUB /* not the sm_90a compilation: never launched (common.cuh) */
    __trap();
#else
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t s_do = (smem_u32(smem) + 1023u) & ~1023u, s_o = s_do + 64 * D * 2;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const long long h = blockIdx.y, b = sv.b(), i0 = (long long)blockIdx.x * 64;
    if (VARLEN && i0 >= p.Nq) return; /* past this sequence's rows */
    load_tile_blk<T, D, 64, 128>(s_do, p.dout, b, h, i0, p.Nq);
    load_tile_blk<T, D, 64, 128>(s_o, p.o, b, h, i0, p.Nq);
    cp_async_commit();
    if (p.dq_acc && !VARLEN) { /* the fused backward's dQ accumulator for these 64 rows (dq_convert_kernel's order) starts at 0 */
        float4 *acc = (float4 *)(p.dq_acc + ((b * p.Hq + h) * (p.nq_pad / 64) + blockIdx.x) * (64 * D));
        int64_t kt0 = 0, kt1 = 0;
        if (!ZERO_ALL) wa_key_tiles_for_rows(&p.win, i0, i0 + 64, kv_keys<D>(), &kt0, &kt1);
        if (ZERO_ALL || kt0 == kt1)
            for (int i = threadIdx.x; i < 16 * D; i += 128) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        /* the ordered form's counters of these rows' D / 64 blocks (dkdv_ws_kernel's dq_order) */
        if (p.dq_order && threadIdx.x < D / 64) p.dq_order[((b * p.Hq + h) * (p.nq_pad / 64) + blockIdx.x) * (D / 64) + threadIdx.x] = 0;
    } else if (p.dq_acc) { /* varlen: its rows of the row-major [Hq, Tq, D] accumulator, this sequence's only */
        float4 *acc = (float4 *)(p.dq_acc + (ws_head<true>(p, b, h, 0) + i0) * D);
        const int n4 = (int)min(64LL, p.Nq - i0) * (D / 4);
        for (int i = threadIdx.x; i < n4; i += 128) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    float d[8][4];
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++)
        wgmma_ss<T, 64>(d, gmma_desc(s_do + (ks >> 2) * (64 * 128) + (ks & 3) * 32),
                        gmma_desc(s_o + (ks >> 2) * (64 * 128) + (ks & 3) * 32), ks > 0);
    wg_commit();
    wg_wait<0>();
    reg_fence(d);
    /* element (g, g) of warp w's rows sits in the lane with t4 = g/2: d[2w][g & 1]; (g+8, g+8) in d[2w+1][2 + (g & 1)] */
    if (t4 != (g >> 1)) return;
    float diag[2] = {0.0f, 0.0f}; /* picked with constant indices: a computed one puts d in local memory */
#pragma unroll
    for (int j = 0; j < 8; j++) {
        if (j == 2 * warp) diag[0] = (g & 1) ? d[j][1] : d[j][0];
        if (j == 2 * warp + 1) diag[1] = (g & 1) ? d[j][3] : d[j][2];
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const long long row = i0 + warp * 16 + g + 8 * r, at = ws_head<VARLEN>(p, b, h, p.nq_pad) + row;
        const float val = diag[r];
        float lse2 = INFINITY, delta = 0.0f;
        if (row < p.Nq) {
            const float lse = *row_of<float>(p.lse, b, h, row);
            lse2 = wa_row_sees_keys(&p.win, row) ? lse * kLog2e : INFINITY; /* -inf or NaN of a row that sees keys: P is NaN */
            delta = val;
        } else if (VARLEN) {
            continue; /* the next sequence's row: the dK/dV and dQ kernels stand in +inf and 0 for it */
        }
        p.delta[at] = delta, p.lse2[at] = lse2;
    }
#endif
}

template <typename T, int D, bool VARLEN, bool ZERO_ALL> static wa_status launch(const kparams &c, unsigned z, cudaStream_t s) {
    static volatile unsigned long long done = 0;
    CUDA_TRY(raise_once(prep_kernel<T, D, VARLEN, ZERO_ALL>, prep_smem_bytes<D>(), &done));
    prep_kernel<T, D, VARLEN, ZERO_ALL><<<dim3((unsigned)(c.nq_pad / 64), (unsigned)c.Hq, z), 128, prep_smem_bytes<D>(), s>>>(c);
    CUDA_TRY(cudaGetLastError());
    return WA_OK;
}

/* the backward's maps: Q, dO, K, V in the dK/dV kernel's boxes, then in the dQ kernel's; the K and
 * V ones span key rows (write_seq_maps) */
constexpr unsigned kKeyMaps = 0b11001100u;

} /* namespace */

wa_status sm90_write_seq_maps(const kparams &kp, const CUtensorMap (&maps)[8], cudaStream_t s) {
    return write_seq_maps(kp, maps, 8, kKeyMaps, s);
}

wa_status sm90_prep(const kparams &c, wa_dtype dt, bool zero_all, unsigned z, cudaStream_t s) {
    return for_dtype(dt, [&](auto t) {
        using T = decltype(t);
        if (!zero_all) { /* the ordered dQ: rectangular calls at kSm90OrderedDqD only */
            if (c.cu_q || c.D != kSm90OrderedDqD) return wa_fail(WA_ERR_UNSUPPORTED, "sm90 prep: partial zeroing at D = %lld", c.D);
            return launch<T, kSm90OrderedDqD, false, false>(c, z, s);
        }
        switch (c.D) {
        case 64: return c.cu_q ? launch<T, 64, true, true>(c, z, s) : launch<T, 64, false, true>(c, z, s);
        case 128: return c.cu_q ? launch<T, 128, true, true>(c, z, s) : launch<T, 128, false, true>(c, z, s);
        case 256: return c.cu_q ? launch<T, 256, true, true>(c, z, s) : launch<T, 256, false, true>(c, z, s);
        case 512: return c.cu_q ? launch<T, 512, true, true>(c, z, s) : launch<T, 512, false, true>(c, z, s);
        }
        return wa_fail(WA_ERR_UNSUPPORTED, "sm90 prep: D = %lld", c.D);
    });
}

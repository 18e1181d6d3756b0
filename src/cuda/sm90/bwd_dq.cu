/* sm90/bwd_dq.cu — the backward's dQ on Hopper for f16/bf16 at D = 64, 128, 256: the
 * deterministic dQ kernel, and the conversion of the fused form's f32 accumulator into dq.
 *
 *   dQ       one CTA per 128 query rows (two consumer warpgroups of 64 rows, one producer), over
 *            the key tiles the window allows: S = Q Kᵀ, dP = dO Vᵀ, dS, dQ += dS K; the forward's
 *            structure (sm90/fwd.cu) with lse and δ known. Every output element is written once by
 *            one thread, no atomics.
 *   convert  dq = the fused form's f32 accumulator (sm90/bwd_dkdv.cu) times the softmax scale,
 *            rounded to the dtype.
 * Masks, tile ranges and edge tiles come from tile_geometry.h. */
#include "bwd_common.cuh"

namespace {

/* key tile: dQ (64 × D f32), S and dP (64 × BN each) in 240 registers; and Q, dO (128 × D) with
 * two stages of K and V in shared memory */
/* The softmax scale stays out of dS and dQ is scaled once at the end, as in the by-rows dK/dV
 * kernels (one multiply less per element of every key tile). */
template <int D> __host__ __device__ constexpr int dq_bn() { return sm90_dq_keys<D>(); }

template <int D> struct dq_layout {
    static constexpr int BM = kSm90DqRows, BN = dq_bn<D>();
    static constexpr uint32_t TILE = BN * D * 2;
    static constexpr uint32_t q = 0, dout = BM * D * 2, k = 2 * BM * D * 2, v = k + kv_ring::kStages * TILE,
                              bars = v + kv_ring::kStages * TILE;
    static constexpr size_t bytes = 1024 + bars + 8 * kv_ring::n_bars;
};

template <typename T, int D, Cap CAP, bool VARLEN>
__global__ void __launch_bounds__(kThreads, 1)
    dq_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo,
                 const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv, const kparams kp) {
#if WA_HOPPER_STUB /* not the sm_90a compilation: never launched (common.cuh) */
    __trap();
#else
    using L = dq_layout<D>;
    constexpr int BM = L::BM, BN = L::BN, DB = D / 64, KS = D / 16, TILE = L::TILE;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t base = (smem_u32(smem) + 1023u) & ~1023u;
    const uint32_t sQ = base + L::q, sdO = base + L::dout, sK = base + L::k, sV = base + L::v;
    const kv_ring ring{base + L::bars};

    const int warp = warp_index(), wg = warp >> 2, lane = threadIdx.x & 31;
    const cta_tile at = heaviest_first<false>(true); /* the longest tiles first under causal masks */
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const long long qt = at.tile, h = at.head, b = sv.b(), hk = h / p.group, i0 = qt * BM;
    if (VARLEN && i0 >= p.Nq) return; /* past this sequence's rows: the whole CTA, before the barriers exist */
    const int m = (int)min((long long)BM, p.Nq - i0);
    int64_t kt0, kt1;
    wa_key_tiles_for_rows(&p.win, i0, i0 + m, BN, &kt0, &kt1);

    if (threadIdx.x == 0) ring.init(8); /* one arrival per consumer warp */
    __syncthreads();

    if (wg == 0) { /* producer: as in the forward, with dO beside Q */
        setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x == 0 && kt0 < kt1) {
            /* maps 4..7 of the launch: this kernel's boxes */
            const CUtensorMap *mq = seq_map<VARLEN>(tq, kp, 4), *mdo = seq_map<VARLEN>(tdo, kp, 5), *mk = seq_map<VARLEN>(tk, kp, 6),
                              *mv = seq_map<VARLEN>(tv, kp, 7);
            mbar_expect_tx(ring.once(), 2 * BM * D * 2);
            for (int c = 0; c < DB; c++) {
                tma_load(sQ + c * (BM * 128), mq, ring.once(), c * 64, (int)((VARLEN ? p.q_row0 : 0) + i0), (int)h, (int)b);
                tma_load(sdO + c * (BM * 128), mdo, ring.once(), c * 64, (int)((VARLEN ? p.q_row0 : 0) + i0), (int)h, (int)b);
            }
            ring.produce<BN, DB>(mk, mv, sK, sV, kt0, kt1, (int)hk, (int)b, VARLEN ? p.k_row0 : 0);
        }
        return;
    }

    setmaxnreg_inc<kConsumerRegs>();
    const int cw = wg - 1, w4 = warp & 3, g = lane >> 2, t4 = lane & 3;
    const long long r0 = i0 + cw * 64, r1 = min(r0 + 64, p.Nq);
    const long long rows[2] = {r0 + w4 * 16 + g, r0 + w4 * 16 + g + 8};
    int64_t wk0 = kt1, wk1 = kt1; /* the key tiles these rows see (the others are waited for and released) */
    if (r0 < r1) {
        wa_key_tiles_for_rows(&p.win, r0, r1, BN, &wk0, &wk1);
        if (wk0 >= wk1) wk0 = wk1 = kt1;
    }
    float lse2[2], delta[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const long long at = ws_head<VARLEN>(p, b, h, p.nq_pad) + rows[r];
        const bool ok = rows[r] < (VARLEN ? p.Nq : p.nq_pad); /* varlen: the next sequence's rows follow */
        lse2[r] = ok ? p.lse2[at] : INFINITY;
        delta[r] = ok ? p.delta[at] : 0.0f;
    }
    int64_t ut0, ut1; /* the key tiles these rows see whole: no mask */
    wa_unmasked_key_tiles(&p.win, r0, r1, BN, &ut0, &ut1);
    const float scale2 = p.scale * kLog2e;
    float acc[DB][8][4];
    zero_frags(acc);

    if (kt0 < kt1) mbar_wait(ring.once(), 0);
    for (long long kt = kt0; kt < wk0; kt++) ring.skip((int)(kt - kt0), lane);
    for (long long kt = wk0; kt < wk1; kt++) {
        const int it = (int)(kt - kt0), st = kv_ring::stage(it);
        const uint32_t ph = kv_ring::parity(it);
        const uint32_t k_s = opaque(sK + st * TILE), v_s = opaque(sV + st * TILE);
        const uint32_t q_s = opaque(sQ + cw * (64 * 128)), do_s = opaque(sdO + cw * (64 * 128));
        float s[BN / 8][4], dp[BN / 8][4];
        mbar_wait(ring.k_full(st), ph);
        mbar_wait(ring.v_full(st), ph);
        wg_fence();
        const uint64_t q_d = gmma_desc(q_s), k_d = gmma_desc(k_s), do_d = gmma_desc(do_s), v_d = gmma_desc(v_s);
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
            wgmma_ss<T, BN>(s, desc_at(q_d, (ks >> 2) * (BM * 128) + (ks & 3) * 32), desc_at(k_d, (ks >> 2) * (BN * 128) + (ks & 3) * 32),
                            ks > 0);
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
            wgmma_ss<T, BN>(dp, desc_at(do_d, (ks >> 2) * (BM * 128) + (ks & 3) * 32), desc_at(v_d, (ks >> 2) * (BN * 128) + (ks & 3) * 32),
                            ks > 0);
        wg_commit();
        wg_wait<0>();
        reg_fence(s);
        reg_fence(dp);
        mbar_arrive_if(ring.v_empty(st), lane == 0);

        const long long j0 = kt * BN;
        edge_form<CAP>(!(kt >= ut0 && kt < ut1), [&](auto edge_c) {
            const bool edge = edge_c;
#pragma unroll
            for (int r = 0; r < 2; r++) {
                int lo = 0, hi = BN - 1;
                if (edge) visible_cols<BN>(p, rows[r], j0, lo, hi);
#pragma unroll
                for (int nb = 0; nb < BN / 8; nb++)
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; e++) {
                        const int c = nb * 8 + 2 * t4 + (e & 1);
                        float pv, dcap;
                        prob_of<CAP>(p, s[nb][e], lse2[r], scale2, pv, dcap);
                        float ds = pv * (dp[nb][e] - delta[r]) * dcap;
                        if (edge && (c < lo || c > hi)) ds = 0.0f;
                        s[nb][e] = ds;
                    }
            }
        });
        uint32_t pa[BN / 16][4];
        pack_a<T, BN>(pa, s);
        /* dQ += dS K, K read transposed as V in the forward */
        reg_fence(pa);
        reg_fence(acc);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) wide_mn_product<T, D>(acc, pa[kk], desc_at(gmma_desc_mn(k_s, BN * 128), kk * (16 * 128)));
        wg_commit();
        wg_wait<0>();
        reg_fence(acc);
        mbar_arrive_if(ring.k_empty(st), lane == 0);
    }
    for (long long kt = wk1; kt < kt1; kt++) ring.skip((int)(kt - kt0), lane);
    scale_frags(acc, p.scale); /* dQ = scale · Σ dS K */
    store_frag_rows<T, DB * 8>(p.dq, reinterpret_cast<const float (&)[DB * 8][4]>(acc), rows, p.Nq, b, h, t4);
#endif
}

/* ---- dQ from the fused backward's f32 accumulator ---- */

/* One CTA per 64 query rows of a head: the accumulator holds, per 64-row tile, D/64 blocks of
 * 64 × 64 floats in the consumers' fragment order (float4 nb·128 + thread: rows 16 w4 + g and
 * + 8, columns 64 block + 8 nb + 2 t4 and + 1), written by add_dq in dkdv_ws_kernel. The
 * rounded tile is staged in shared memory and stored by rows, 16 bytes a thread (a warp stores
 * whole rows), where dq's rows allow it (16-byte aligned), else 4: each thread storing its
 * fragments' pairs straight to dq, 4 bytes a store, would be bound by the memory instruction
 * queue. */
template <typename T, int D> __global__ void __launch_bounds__(128) dq_convert_kernel(kparams p) {
#if WA_HOPPER_STUB /* not the sm_90a compilation: never launched (common.cuh) */
    __trap();
#else
    constexpr int DB = D / 64;
    const int tid = threadIdx.x, w4 = tid >> 5, g = (tid & 31) >> 2, t4 = tid & 3;
    const long long h = blockIdx.y, b = blockIdx.z, i0 = (long long)blockIdx.x * 64;
    const float4 *acc = (const float4 *)(p.dq_acc + ((b * p.Hq + h) * (p.nq_pad / 64) + blockIdx.x) * (64 * D));
    /* a row of the staged tile is 16 bytes longer than its D values, so that a warp's 4-byte
     * stores of 8 rows × 4 pairs fall in 32 different banks */
    constexpr int STRIDE = D * 2 + 16, CHUNKS = D / 8; /* 16-byte chunks a row */
    __shared__ __align__(16) unsigned char tile[64 * STRIDE];
    float4 v[DB * 8];
#pragma unroll
    for (int i = 0; i < DB * 8; i++) v[i] = acc[i * 128 + tid]; /* all loads in flight before the first use */
#pragma unroll
    for (int i = 0; i < DB * 8; i++) {
        /* dQ = scale · Σ dS K: the dK/dV kernel left the scale out of dS */
        unsigned char *at = tile + (w4 * 16 + g) * STRIDE + (i * 8 + 2 * t4) * 2;
        *(uint32_t *)at = pack2<T>(v[i].x * p.scale, v[i].y * p.scale);
        *(uint32_t *)(at + 8 * STRIDE) = pack2<T>(v[i].z * p.scale, v[i].w * p.scale);
    }
    __syncthreads();
    const bool wide = rows_aligned16<T>(p.dq);
#pragma unroll
    for (int k = 0; k < 64 * CHUNKS / 128; k++) {
        const int e = tid + 128 * k, r = e / CHUNKS, c = e % CHUNKS;
        if (i0 + r >= p.Nq) continue;
        const uint4 x = *(const uint4 *)(tile + r * STRIDE + c * 16);
        T *dst = row_of<T>(p.dq, b, h, i0 + r) + c * 8;
        if (wide) {
            *(uint4 *)dst = x;
        } else {
            uint32_t *d4 = (uint32_t *)dst;
            d4[0] = x.x, d4[1] = x.y, d4[2] = x.z, d4[3] = x.w;
        }
    }
#endif
}

/* ---- host side ---- */

template <typename T, int D, Cap CAP, bool VARLEN> static wa_status launch(const kparams &c, const CUtensorMap (&m)[8], unsigned z, cudaStream_t s) {
    static volatile unsigned long long done = 0;
    constexpr size_t bytes = dq_layout<D>::bytes;
    constexpr int BM = dq_layout<D>::BM;
    CUDA_TRY(raise_once(dq_ws_kernel<T, D, CAP, VARLEN>, bytes, &done));
    dq_ws_kernel<T, D, CAP, VARLEN><<<dim3((unsigned)((c.Nq + BM - 1) / BM), (unsigned)c.Hq, z), kThreads, bytes, s>>>(m[4], m[5], m[6], m[7], c);
    CUDA_TRY(cudaGetLastError());
    return WA_OK;
}

} /* namespace */

wa_status sm90_dq(const kparams &c, wa_dtype dt, const CUtensorMap (&maps)[8], unsigned z, cudaStream_t s) {
    return for_dtype(dt, [&](auto t) {
        using T = decltype(t);
        return for_head_dim(c.D, [&](auto d) {
            constexpr int D = decltype(d)::value;
            if (c.softcap > 0.0f) return c.cu_q ? launch<T, D, Cap::on, true>(c, maps, z, s) : launch<T, D, Cap::on, false>(c, maps, z, s);
            return c.cu_q ? launch<T, D, Cap::off, true>(c, maps, z, s) : launch<T, D, Cap::off, false>(c, maps, z, s);
        });
    });
}

wa_status sm90_dq_convert(const kparams &c, wa_dtype dt, unsigned z, cudaStream_t s) {
    return for_dtype(dt, [&](auto t) {
        using T = decltype(t);
        const dim3 grid((unsigned)(c.nq_pad / 64), (unsigned)c.Hq, z);
        switch (c.D) {
        case 64: dq_convert_kernel<T, 64><<<grid, 128, 0, s>>>(c); break;
        case 128: dq_convert_kernel<T, 128><<<grid, 128, 0, s>>>(c); break;
        default: return wa_fail(WA_ERR_UNSUPPORTED, "sm90 dq convert: D = %lld", c.D);
        }
        CUDA_TRY(cudaGetLastError());
        return WA_OK;
    });
}

wa_status sm90_dq_convert_rows(const kparams &kp, wa_dtype dt, cudaStream_t s) {
    return for_dtype(dt, [&](auto t) { return convert_dq_rows<decltype(t), true>(kp, s); /* with the scale left out of dS */ });
}

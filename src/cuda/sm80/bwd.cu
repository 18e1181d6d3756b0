/* sm80/bwd.cu — the backward on mma.sync for f16 and bf16 at D = 64, 128 and 256
 * (FlashAttention-2's scheme): the tensor-core backward of GPUs of compute capability 8.x and up,
 * and on Hopper the fallback where the wgmma backward does not take the call (dispatch.cu).
 *
 *   delta     δ_i = dO_i · O_i on the tensor cores with the same k order as dP below
 *             (delta_mma_kernel, prims/mma.cuh)
 *   dK, dV    one CTA of 8 warps per 64 keys (kv head, batch), looping over the query heads of
 *             the group and the query tiles the window allows; P and dS go through shared memory
 *             so that the 64×64 pair tile can be read transposed for dV += Pᵀ dO, dK += dSᵀ Q.
 *   dQ        one CTA per query tile owning its dQ (no atomics, deterministic); or, when the
 *             call is not deterministic, f32 atomic adds from the dK/dV kernel (ATOMIC_DQ).
 * Shared tiles use the swizzle of sm80/fwd.cu (prims/mma.cuh: swz); K and V stay resident, Q and
 * dO (or K and V in the dQ kernel) are double-buffered by cp.async. Masks and tile ranges come
 * from tile_geometry.h; edge and ragged tiles are masked element-wise. */
#include "../prims/mma.cuh"

#include <stdint.h>

#include <algorithm>

namespace {

constexpr int kBwdBN = kSm80BwdKeys, kBwdBM = kSm80BwdRows, kBwdThreads = kSm80BwdThreads;

template <int D> constexpr size_t dkdv_smem_bytes() {
    return (size_t)2 * (2 * kBwdBN * D + 4 * kBwdBM * D + 2 * kBwdBM * kBwdBN) + (size_t)4 * 4 * kBwdBM;
}

/* The query-side tiles of iteration it (query head hk * group + it / per_head, query tile
 * qt0 + it % per_head) into stage `stage`: Q and dO by cp.async (committed by the caller), and their
 * rows' log-sum-exp and delta. Invariant: the stage is free (its last readers passed the
 * iteration's closing barrier). */
template <typename T, int D, bool VARLEN>
__device__ __forceinline__ void load_q_side(const kparams &p, uint32_t sQ, uint32_t sdO, float *stats, long long b,
                                            long long hk, int64_t qt0, long long per_head, long long it, int stage) {
    constexpr int BM = kBwdBM, NT = kBwdThreads;
    const long long h = hk * p.group + it / per_head, i0 = (qt0 + it % per_head) * BM;
    load_tile<T, D, BM, NT>(sQ + stage * BM * D * 2, p.q, b, h, i0, p.Nq);
    load_tile<T, D, BM, NT>(sdO + stage * BM * D * 2, p.dout, b, h, i0, p.Nq);
    load_row_stats<BM, VARLEN>(stats + stage * BM, stats + 2 * BM + stage * BM, p, b, h, i0);
}

/* S = Q Kᵀ and dP = dO Vᵀ of one warp's 16 queries (from qg * 16) × 32 keys (from kh * 32), from
 * the stage's Q and dO (q_s, do_s) and the resident K and V. Invariant: s and dp are zero on entry. */
template <typename T, int D>
__device__ __forceinline__ void pair_products(float (&s)[4][4], float (&dp)[4][4], uint32_t q_s, uint32_t do_s,
                                              uint32_t sK, uint32_t sV, int qg, int kh, int lane) {
    constexpr int KS = D / 16;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        uint32_t aq[4], ao[4];
        load_a<D>(aq, q_s, qg * 16, ks, lane);
        load_a<D>(ao, do_s, qg * 16, ks, lane);
#pragma unroll
        for (int nb = 0; nb < 2; nb++) {
            uint32_t bk[4], bv[4];
            load_b_nk<D>(bk, sK, kh * 32 + nb * 16, ks, lane);
            load_b_nk<D>(bv, sV, kh * 32 + nb * 16, ks, lane);
            mma<T>(s[2 * nb], aq, bk[0], bk[1]);
            mma<T>(s[2 * nb + 1], aq, bk[2], bk[3]);
            mma<T>(dp[2 * nb], ao, bv[0], bv[1]);
            mma<T>(dp[2 * nb + 1], ao, bv[2], bv[3]);
        }
    }
}

/* P and dS of the warp's pair tile (grads_of, masked where `edge`) written to shared memory as T,
 * swizzled, for the gradient phase to read transposed. Invariant: the caller's barrier follows
 * before anyone reads sP or sdS. */
template <typename T>
__device__ __forceinline__ void store_p_ds(const kparams &p, const float (&s)[4][4], const float (&dp)[4][4],
                                           const float *stats, int stage, long long i0, long long j0, bool edge,
                                           float scale2, uint32_t sP, uint32_t sdS, int qg, int kh, int g, int t4) {
    constexpr int BN = kBwdBN, BM = kBwdBM;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int qr = qg * 16 + g + 8 * r;
        const long long i = i0 + qr;
        const float lse2 = stats[stage * BM + qr] * kLog2e, delta = stats[2 * BM + stage * BM + qr];
        long long lo, hi;
        row_visible_keys(p, i, edge, lo, hi);
#pragma unroll
        for (int nb = 0; nb < 4; nb++) {
            float pv[2], ds[2];
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int kc = kh * 32 + nb * 8 + 2 * t4 + c;
                const long long j = j0 + kc;
                grads_of(p, s[nb][2 * r + c], dp[nb][2 * r + c], lse2, delta, scale2, !edge || (j >= lo && j <= hi),
                         pv[c], ds[c]);
            }
            const int col = kh * 32 + nb * 8 + 2 * t4;
            const uint32_t off = swz<BN>(qr, col >> 3) + (col & 7) * 2;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sP + off), "r"(pack2<T>(pv[0], pv[1])));
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + off), "r"(pack2<T>(ds[0], ds[1])));
        }
    }
}

/* dV += Pᵀ dO and dK += dSᵀ Q for the warp's 16 keys (from kg * 16) × D/2 columns (from dh * D/2).
 * Invariant: P and dS of the step are complete in shared memory (after the barrier). */
template <typename T, int D>
__device__ __forceinline__ void accumulate_dkdv(float (&dv)[D / 16][4], float (&dk)[D / 16][4], uint32_t sP,
                                                uint32_t sdS, uint32_t q_s, uint32_t do_s, int kg, int dh, int lane) {
    constexpr int BN = kBwdBN, BM = kBwdBM, DH = D / 2;
#pragma unroll
    for (int kq = 0; kq < BM / 16; kq++) {
        uint32_t ap[4], as[4];
        load_at<BN>(ap, sP, kq * 16, kg, lane);
        load_at<BN>(as, sdS, kq * 16, kg, lane);
#pragma unroll
        for (int nd = 0; nd < DH / 16; nd++) {
            uint32_t bo[4], bq[4];
            load_b_kn<D>(bo, do_s, kq * 16, dh * (DH / 16) + nd, lane);
            load_b_kn<D>(bq, q_s, kq * 16, dh * (DH / 16) + nd, lane);
            mma<T>(dv[2 * nd], ap, bo[0], bo[1]);
            mma<T>(dv[2 * nd + 1], ap, bo[2], bo[3]);
            mma<T>(dk[2 * nd], as, bq[0], bq[1]);
            mma<T>(dk[2 * nd + 1], as, bq[2], bq[3]);
        }
    }
}

/* dQ[16 qg.., D/2 dh..] of query head h += dS K, f32 atomic adds into p.dq_acc, in column chunks of
 * CW to bound registers (the ATOMIC_DQ form). Invariant: dS is complete in shared memory. */
template <typename T, int D, bool VARLEN>
__device__ __forceinline__ void add_dq_atomic(const kparams &p, long long b, long long h, long long i0, uint32_t sdS,
                                              uint32_t sK, int qg, int dh, int g, int t4, int lane) {
    constexpr int BN = kBwdBN, DH = D / 2, CW = DH < 64 ? DH : 64;
    const long long r0 = i0 + qg * 16 + g;
    float *acc_row0 = p.dq_acc + (ws_head<VARLEN>(p, b, h, p.Nq) + r0) * D, *acc_row1 = acc_row0 + 8 * D;
#pragma unroll
    for (int ch = 0; ch < DH / CW; ch++) {
        float dq[CW / 8][4];
#pragma unroll
        for (int i = 0; i < CW / 8; i++) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < BN / 16; ks++) {
            uint32_t a[4];
            load_a<BN>(a, sdS, qg * 16, ks, lane);
#pragma unroll
            for (int nd = 0; nd < CW / 16; nd++) {
                uint32_t bk[4];
                load_b_kn<D>(bk, sK, ks * 16, (dh * DH + ch * CW) / 16 + nd, lane);
                mma<T>(dq[2 * nd], a, bk[0], bk[1]);
                mma<T>(dq[2 * nd + 1], a, bk[2], bk[3]);
            }
        }
#pragma unroll
        for (int i = 0; i < CW / 8; i++) {
            const int col = dh * DH + ch * CW + i * 8 + 2 * t4;
            if (r0 < p.Nq) atomic_add2(acc_row0 + col, dq[i][0], dq[i][1]);
            if (r0 + 8 < p.Nq) atomic_add2(acc_row1 + col, dq[i][2], dq[i][3]);
        }
    }
}

/* The epilogue: the warp's rows of dK and dV (keys j0 + kg * 16.., columns dh * D/2..) written as T.
 * Keys no query sees fall through with zero accumulators: dK = dV = 0 is written for them. */
template <typename T, int D>
__device__ __forceinline__ void store_dkdv(const kparams &p, const float (&dk)[D / 16][4], const float (&dv)[D / 16][4],
                                           long long b, long long hk, long long j0, int kg, int dh, int g, int t4) {
    constexpr int DH = D / 2;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const long long j = j0 + kg * 16 + g + 8 * r;
        if (j >= p.Nk) continue;
        T *krow = row_of<T>(p.dk, b, hk, j), *vrow = row_of<T>(p.dv, b, hk, j);
#pragma unroll
        for (int i = 0; i < DH / 8; i++) {
            const int col = dh * DH + i * 8 + 2 * t4;
            *(uint32_t *)(krow + col) = pack2<T>(dk[i][2 * r], dk[i][2 * r + 1]);
            *(uint32_t *)(vrow + col) = pack2<T>(dv[i][2 * r], dv[i][2 * r + 1]);
        }
    }
}

/* owner of dK, dV for keys [j0, j0 + 64) of kv head hk; with ATOMIC_DQ it also adds this key
 * tile's share of dQ = dS K into the f32 accumulator p.dq_acc (the fast, non-reproducible option) */
template <typename T, int D, bool ATOMIC_DQ, bool VARLEN>
__global__ void __launch_bounds__(kBwdThreads, 1) dkdv_mma_kernel(const kparams kp) {
    constexpr int BN = kBwdBN, BM = kBwdBM, NT = kBwdThreads, DH = D / 2;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sK = smem_u32(smem), sV = sK + BN * D * 2, sQ = sV + BN * D * 2, sdO = sQ + 2 * BM * D * 2;
    const uint32_t sP = sdO + 2 * BM * D * 2, sdS = sP + BM * BN * 2;
    float *stats = (float *)(smem + (size_t)2 * (2 * BN * D + 4 * BM * D + 2 * BM * BN)); /* lse[2][BM], delta[2][BM] */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int qg = warp & 3, kh = warp >> 2; /* pair phase: 16 queries x 32 keys per warp */
    const int kg = warp & 3, dh = warp >> 2; /* gradient phase: 16 keys x D/2 columns per warp */
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const long long hk = blockIdx.y, b = sv.b(), j0 = (long long)blockIdx.x * BN;
    if (VARLEN && j0 >= p.Nk) return; /* past this sequence's keys */
    const int n = (int)min((long long)BN, p.Nk - j0);
    int64_t qt0, qt1;
    wa_query_tiles_for_cols(&p.win, j0, j0 + n, BM, &qt0, &qt1);
    const long long per_head = qt1 - qt0, iters = per_head * p.group;
    const float scale2 = p.scale * kLog2e;

    load_tile<T, D, BN, NT>(sK, p.k, b, hk, j0, p.Nk);
    load_tile<T, D, BN, NT>(sV, p.v, b, hk, j0, p.Nk);
    if (iters > 0) load_q_side<T, D, VARLEN>(p, sQ, sdO, stats, b, hk, qt0, per_head, 0, 0);
    cp_async_commit();

    float dv[DH / 8][4], dk[DH / 8][4];
#pragma unroll
    for (int i = 0; i < DH / 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) dv[i][e] = dk[i][e] = 0.0f;

    for (long long it = 0; it < iters; it++) {
        const int stage = (int)(it & 1);
        if (it + 1 < iters) load_q_side<T, D, VARLEN>(p, sQ, sdO, stats, b, hk, qt0, per_head, it + 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const long long i0 = (qt0 + it % per_head) * BM;
        const int m = (int)min((long long)BM, p.Nq - i0);
        const uint32_t q_s = sQ + stage * BM * D * 2, do_s = sdO + stage * BM * D * 2;

        /* S = Q Kᵀ and dP = dO Vᵀ for queries 16 qg.., keys 32 kh.. */
        float s[4][4], dp[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[i][e] = dp[i][e] = 0.0f;
        pair_products<T, D>(s, dp, q_s, do_s, sK, sV, qg, kh, lane);
        const bool edge = m < BM || n < BN || wa_tile_needs_mask(&p.win, i0, i0 + m, j0, j0 + n);
        store_p_ds<T>(p, s, dp, stats, stage, i0, j0, edge, scale2, sP, sdS, qg, kh, g, t4);
        __syncthreads(); /* P and dS complete */

        accumulate_dkdv<T, D>(dv, dk, sP, sdS, q_s, do_s, kg, dh, lane);
        if (ATOMIC_DQ) /* into query head hk * group + it / per_head */
            add_dq_atomic<T, D, VARLEN>(p, b, hk * p.group + it / per_head, i0, sdS, sK, qg, dh, g, t4, lane);
        __syncthreads(); /* stage, P and dS are free for the next iteration */
    }
    cp_async_wait<0>();
    store_dkdv<T, D>(p, dk, dv, b, hk, j0, kg, dh, g, t4);
}

/* dQ: one CTA per 128 query rows; each warp owns 16 rows and their dQ in registers. At D = 256
 * the dQ accumulator takes 128 registers a thread, so the key tile is halved to keep S and dP
 * (and Q, dO, K, V twice in shared memory) within budget. */
constexpr int kDqWarps = kSm80DqWarps;
template <int D> __host__ __device__ constexpr int dq_bn() { return sm80_dq_keys<D>(); }
template <int D> constexpr size_t dq_smem_bytes() { return (size_t)2 * (2 * 16 * kDqWarps * D + 4 * dq_bn<D>() * D); }

template <typename T, int D, bool VARLEN> __global__ void __launch_bounds__(32 * kDqWarps, 1) dq_mma_kernel(const kparams kp) {
    constexpr int WARPS = kDqWarps, BM = 16 * WARPS, BN = dq_bn<D>(), NT = 32 * WARPS, KS = D / 16;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ = smem_u32(smem), sdO = sQ + BM * D * 2, sK = sdO + BM * D * 2, sV = sK + 2 * BN * D * 2;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const long long h = blockIdx.y, b = sv.b(), hk = h / p.group, i0 = (long long)blockIdx.x * BM;
    if (VARLEN && i0 >= p.Nq) return;
    const int m = (int)min((long long)BM, p.Nq - i0), qrow = warp * 16;
    int64_t kt0, kt1;
    wa_key_tiles_for_rows(&p.win, i0, i0 + m, BN, &kt0, &kt1);

    load_tile<T, D, BM, NT>(sQ, p.q, b, h, i0, p.Nq);
    load_tile<T, D, BM, NT>(sdO, p.dout, b, h, i0, p.Nq);
    if (kt0 < kt1) {
        load_tile<T, D, BN, NT>(sK, p.k, b, hk, kt0 * BN, p.Nk);
        load_tile<T, D, BN, NT>(sV, p.v, b, hk, kt0 * BN, p.Nk);
    }
    cp_async_commit();

    const long long rows[2] = {i0 + qrow + g, i0 + qrow + g + 8};
    float lse2[2], delta[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const bool ok = rows[r] < p.Nq;
        lse2[r] = ok ? *row_of<float>(p.lse, b, h, rows[r]) * kLog2e : 0.0f;
        delta[r] = ok ? p.delta[ws_head<VARLEN>(p, b, h, p.Nq) + rows[r]] : 0.0f;
    }
    const float scale2 = p.scale * kLog2e;
    float acc[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    for (long long kt = kt0; kt < kt1; kt++) {
        const int stage = (int)((kt - kt0) & 1);
        if (kt + 1 < kt1) {
            load_tile<T, D, BN, NT>(sK + (stage ^ 1) * BN * D * 2, p.k, b, hk, (kt + 1) * BN, p.Nk);
            load_tile<T, D, BN, NT>(sV + (stage ^ 1) * BN * D * 2, p.v, b, hk, (kt + 1) * BN, p.Nk);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const uint32_t k_s = sK + stage * BN * D * 2, v_s = sV + stage * BN * D * 2;

        float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
        for (int i = 0; i < BN / 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[i][e] = dp[i][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            uint32_t aq[4], ao[4];
            load_a<D>(aq, sQ, qrow, ks, lane);
            load_a<D>(ao, sdO, qrow, ks, lane);
#pragma unroll
            for (int nb = 0; nb < BN / 16; nb++) {
                uint32_t bk[4], bv[4];
                load_b_nk<D>(bk, k_s, nb * 16, ks, lane);
                load_b_nk<D>(bv, v_s, nb * 16, ks, lane);
                mma<T>(s[2 * nb], aq, bk[0], bk[1]);
                mma<T>(s[2 * nb + 1], aq, bk[2], bk[3]);
                mma<T>(dp[2 * nb], ao, bv[0], bv[1]);
                mma<T>(dp[2 * nb + 1], ao, bv[2], bv[3]);
            }
        }
        const long long j0 = kt * BN;
        const int n = (int)min((long long)BN, p.Nk - j0);
        const bool edge = n < BN || wa_tile_needs_mask(&p.win, i0, i0 + m, j0, j0 + n);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            long long lo = 0, hi = 0;
            if (edge) lo = wa_row_first_key(&p.win, rows[r]), hi = wa_row_last_key(&p.win, rows[r]);
#pragma unroll
            for (int nb = 0; nb < BN / 8; nb++)
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    const long long j = j0 + nb * 8 + 2 * t4 + c;
                    float pv, ds;
                    grads_of(p, s[nb][2 * r + c], dp[nb][2 * r + c], lse2[r], delta[r], scale2, !edge || (j >= lo && j <= hi),
                             pv, ds);
                    s[nb][2 * r + c] = ds;
                }
        }
        /* dQ += dS K */
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int nd = 0; nd < D / 16; nd++) {
                uint32_t bb[4];
                load_b_kn<D>(bb, k_s, kk * 16, nd, lane);
                mma<T>(acc[2 * nd], a, bb[0], bb[1]);
                mma<T>(acc[2 * nd + 1], a, bb[2], bb[3]);
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (rows[r] >= p.Nq) continue;
        T *qrow_out = row_of<T>(p.dq, b, h, rows[r]);
#pragma unroll
        for (int i = 0; i < D / 8; i++) *(uint32_t *)(qrow_out + i * 8 + 2 * t4) = pack2<T>(acc[i][2 * r], acc[i][2 * r + 1]);
    }
}

/* Each launch runs the rectangular instances (VARLEN false) on (tiles, heads, B) grids, or the
 * varlen ones over the sequences (over_sequences: z in chunks of 65535); the grid's tiles come from
 * the longest sequence, and a CTA past its own sequence's end leaves at once. */
template <typename T, int D, bool VARLEN> static wa_status bwd_launch(const kparams &kp, cudaStream_t s) {
    static volatile unsigned long long done_kv = 0, done_kva = 0, done_q = 0;
    constexpr size_t kv_bytes = dkdv_smem_bytes<D>(), q_bytes = dq_smem_bytes<D>();
    const bool atomic = kp.dq_acc != nullptr;
    CUDA_TRY(raise_once(dkdv_mma_kernel<T, D, false, VARLEN>, kv_bytes, &done_kv));
    CUDA_TRY(raise_once(dkdv_mma_kernel<T, D, true, VARLEN>, kv_bytes, &done_kva));
    CUDA_TRY(raise_once(dq_mma_kernel<T, D, VARLEN>, q_bytes, &done_q));
    if (atomic) {
        const wa_status st = zero_dq_rows(kp, s);
        if (st != WA_OK) return st;
    }
    const wa_status st = over_sequences(kp, [&](const kparams &c, unsigned z) {
        if (kp.Nq > 0) {
            delta_mma_kernel<T, D, VARLEN><<<dim3((unsigned)((kp.Nq + 63) / 64), (unsigned)kp.Hq, z), 128, 0, s>>>(c);
            CUDA_TRY(cudaGetLastError());
        }
        if (kp.Nk > 0) { /* also when Nq = 0: every key tile then writes dK = dV = 0 */
            const dim3 kgrid((unsigned)((kp.Nk + kBwdBN - 1) / kBwdBN), (unsigned)kp.Hkv, z);
            if (atomic) dkdv_mma_kernel<T, D, true, VARLEN><<<kgrid, kBwdThreads, kv_bytes, s>>>(c);
            else dkdv_mma_kernel<T, D, false, VARLEN><<<kgrid, kBwdThreads, kv_bytes, s>>>(c);
            CUDA_TRY(cudaGetLastError());
        }
        constexpr int BM = 16 * kDqWarps;
        if (kp.Nq > 0 && !atomic) {
            dq_mma_kernel<T, D, VARLEN><<<dim3((unsigned)((kp.Nq + BM - 1) / BM), (unsigned)kp.Hq, z), 32 * kDqWarps, q_bytes, s>>>(c);
            CUDA_TRY(cudaGetLastError());
        }
        return WA_OK;
    });
    if (st != WA_OK || !atomic || kp.Nq == 0) return st;
    return convert_dq_rows<T>(kp, s);
}

template <typename T> static wa_status by_dim(const kparams &kp, cudaStream_t s) {
    switch (kp.D) {
    case 64: return kp.cu_q ? bwd_launch<T, 64, true>(kp, s) : bwd_launch<T, 64, false>(kp, s);
    case 128: return kp.cu_q ? bwd_launch<T, 128, true>(kp, s) : bwd_launch<T, 128, false>(kp, s);
    case 256: return kp.cu_q ? bwd_launch<T, 256, true>(kp, s) : bwd_launch<T, 256, false>(kp, s);
    }
    return wa_fail(WA_ERR_UNSUPPORTED, "tensor-core backward: D = %lld", kp.D);
}

} /* namespace */

size_t sm80_backward_smem(long long D) {
    switch (D) {
    case 64: return std::max(dkdv_smem_bytes<64>(), dq_smem_bytes<64>());
    case 128: return std::max(dkdv_smem_bytes<128>(), dq_smem_bytes<128>());
    case 256: return std::max(dkdv_smem_bytes<256>(), dq_smem_bytes<256>());
    }
    return SIZE_MAX;
}

wa_status sm80_backward(const kparams &kp, wa_dtype dt, cudaStream_t s) {
    return dt == WA_BF16 ? by_dim<__nv_bfloat16>(kp, s) : by_dim<__half>(kp, s);
}

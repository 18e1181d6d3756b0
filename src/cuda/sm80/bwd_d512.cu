/* sm80/bwd_d512.cu — the backward at head dim 512 on mma.sync: the tensor-core backward of GPUs
 * of compute capability 8.x and up at D = 512 (where their shared memory fits), and on Hopper the
 * fallback where the wgmma D = 512 backward does not take the call (dispatch.cu).
 *
 * The D <= 256 kernels (sm80/bwd.cu) keep a warp's share of dK and dV (or dQ) in registers over
 * whole rows of D columns; at D = 512 that is twice what a thread has. Here every tile is 32 × 32
 * and the work is cut along D instead:
 *
 *   pair tile  S = Q Kᵀ and dP = dO Vᵀ for 32 queries × 32 keys: warp w forms the 16 × 16 block
 *              (queries 16 (w & 1).., keys 16 ((w >> 1) & 1)..) over one half of D (256 (w >> 2)..);
 *              the two warps of a block trade the halves of their fragments through shared memory
 *              (each finishes half the rows: own half + other half, the same bits either way) and
 *              write P and dS, rounded to the dtype, to shared memory.
 *   dK, dV     one CTA (8 warps) per 32 keys and kv head, over the group's query heads and the
 *              query tiles the window allows (two stages of Q and dO): warp w owns keys 16 (w & 1)..
 *              and columns 128 (w >> 1).. of dK and dV (128 registers a thread, as at D = 256).
 *   dQ         one CTA per 32 query rows forms the same pair tiles again and owns its dQ (no
 *              atomics: deterministic in both library modes).
 *   δ          delta_mma_kernel (prims/mma.cuh), whose k chain at D = 512 is the same two halves, so
 *              that dP − δ is exactly 0 where a row sees a single key.
 *
 * Shared memory: K, V 32 KB each, Q and dO two stages of 32 KB each, P, dS, the exchange buffer and
 * the row statistics: 208.5 KB (the dQ kernel 204 KB). Masks come from tile_geometry.h,
 * element-wise on edge and ragged tiles only.
 */
#include "../prims/mma.cuh"

namespace {

constexpr int kD = 512, kBN = kSm80D512Keys, kBM = kSm80D512Rows, kThreads = kSm80D512Threads, kKS = kD / 16;
constexpr int kTile = kBN * kD * 2;      /* bytes of one 32 × 512 tile */
constexpr int kPairW = 64;               /* P and dS rows padded to 64 values: swz<64> stays inside them */
constexpr int kPair = kBM * kPairW * 2;  /* bytes of P or dS */
constexpr int kXch = 8 * 8 * 32 * 4;     /* per warp: 8 floats (4 of S, 4 of dP) for each lane */

/* S and dP of a 32 × 32 pair tile into P (when WITH_P) and dS in shared memory (rows: queries i0..,
 * columns: keys j0..); see the header. lse and delta hold the tile's 32 rows (lse in natural log).
 * Contains one __syncthreads (the exchange); the caller syncs again before reading P or dS. */
template <typename T, bool WITH_P>
__device__ __forceinline__ void pair_tile(const kparams &p, uint32_t q_s, uint32_t do_s, uint32_t k_s, uint32_t v_s,
                                          uint32_t sP, uint32_t sdS, float *xch, const float *lse, const float *delta,
                                          long long i0, long long j0, bool edge, float scale2) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int qg = warp & 1, kh = (warp >> 1) & 1, dz = warp >> 2;
    float s[2][4], dp[2][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[i][e] = dp[i][e] = 0.0f;
#pragma unroll
    for (int kx = 0; kx < kKS / 2; kx++) {
        const int ks = dz * (kKS / 2) + kx;
        uint32_t aq[4], ao[4], bk[4], bv[4];
        load_a<kD>(aq, q_s, qg * 16, ks, lane);
        load_a<kD>(ao, do_s, qg * 16, ks, lane);
        load_b_nk<kD>(bk, k_s, kh * 16, ks, lane);
        load_b_nk<kD>(bv, v_s, kh * 16, ks, lane);
        mma<T>(s[0], aq, bk[0], bk[1]);
        mma<T>(s[1], aq, bk[2], bk[3]);
        mma<T>(dp[0], ao, bv[0], bv[1]);
        mma<T>(dp[1], ao, bv[2], bv[3]);
    }

    /* the lower half of D finishes rows g (fragment elements 0, 1), the upper half rows g + 8 (2, 3):
     * each hands the other rows' elements to its partner, warp ^ 4 */
    const int keep = dz; /* selects with ?: below: a run-time index would put s and dp in local memory */
    float *mine = xch + warp * 256, *other = xch + (warp ^ 4) * 256;
#pragma unroll
    for (int nb = 0; nb < 2; nb++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            mine[(nb * 2 + c) * 32 + lane] = keep ? s[nb][c] : s[nb][2 + c];
            mine[(4 + nb * 2 + c) * 32 + lane] = keep ? dp[nb][c] : dp[nb][2 + c];
        }
    __syncthreads();

    const int qr = qg * 16 + g + 8 * keep;
    const long long i = i0 + qr;
    const float lse2 = lse[qr] * kLog2e, dlt = delta[qr];
    long long lo, hi;
    row_visible_keys(p, i, edge, lo, hi);
#pragma unroll
    for (int nb = 0; nb < 2; nb++) {
        float pv[2], ds[2];
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const float sacc = (keep ? s[nb][2 + c] : s[nb][c]) + other[(nb * 2 + c) * 32 + lane];
            const float dpacc = (keep ? dp[nb][2 + c] : dp[nb][c]) + other[(4 + nb * 2 + c) * 32 + lane];
            const long long j = j0 + kh * 16 + nb * 8 + 2 * t4 + c;
            grads_of(p, sacc, dpacc, lse2, dlt, scale2, !edge || (j >= lo && j <= hi), pv[c], ds[c]);
        }
        const int col = kh * 16 + nb * 8 + 2 * t4;
        const uint32_t off = swz<kPairW>(qr, col >> 3) + (col & 7) * 2;
        if (WITH_P) asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sP + off), "r"(pack2<T>(pv[0], pv[1])));
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + off), "r"(pack2<T>(ds[0], ds[1])));
    }
}

/* dQ (16 rows from 16 (w & 1), columns 128 (w >> 1) + 64 ch ..) += dS K for the tile's 32 keys */
template <typename T>
__device__ __forceinline__ void dq_chunk(float (&acc)[8][4], uint32_t sdS, uint32_t k_s, int ch, int lane) {
    const int warp = threadIdx.x >> 5, qg = warp & 1, c4 = warp >> 1;
#pragma unroll
    for (int ks = 0; ks < kBN / 16; ks++) {
        uint32_t a[4];
        load_a<kPairW>(a, sdS, qg * 16, ks, lane);
#pragma unroll
        for (int nd = 0; nd < 4; nd++) {
            uint32_t bk[4];
            load_b_kn<kD>(bk, k_s, ks * 16, c4 * 8 + ch * 4 + nd, lane);
            mma<T>(acc[2 * nd], a, bk[0], bk[1]);
            mma<T>(acc[2 * nd + 1], a, bk[2], bk[3]);
        }
    }
}

constexpr size_t kDkdvSmem = (size_t)6 * kTile + 2 * kPair + kXch + 4 * kBM * sizeof(float);
constexpr size_t kDqSmem = (size_t)6 * kTile + kPair + kXch + 2 * kBM * sizeof(float);

/* owner of dK, dV for keys [j0, j0 + 32) of kv head hk */
template <typename T, bool VARLEN> __global__ void __launch_bounds__(kThreads, 1) dkdv_wide_kernel(const kparams kp) {
    constexpr int D = kD, BN = kBN, BM = kBM, NT = kThreads;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sK = smem_u32(smem), sV = sK + kTile, sQ = sV + kTile, sdO = sQ + 2 * kTile, sP = sdO + 2 * kTile,
                   sdS = sP + kPair;
    float *xch = (float *)(smem + 6 * kTile + 2 * kPair), *stats = xch + kXch / 4; /* lse[2][BM], delta[2][BM] */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int kg = warp & 1, c4 = warp >> 1; /* gradient phase: keys 16 kg.., columns 128 c4.. */
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const cta_tile at = heaviest_first<true>(false);
    const long long hk = at.head, b = sv.b(), j0 = at.tile * BN;
    if (VARLEN && j0 >= p.Nk) return; /* past this sequence's keys: the whole CTA, before any barrier */
    const int n = (int)min((long long)BN, p.Nk - j0);
    int64_t qt0, qt1;
    wa_query_tiles_for_cols(&p.win, j0, j0 + n, BM, &qt0, &qt1);
    const long long per_head = qt1 - qt0, iters = per_head * p.group;
    const float scale2 = p.scale * kLog2e;

    auto load_q_side = [&](long long it, int stage) {
        const long long h = hk * p.group + it / per_head, i0 = (qt0 + it % per_head) * BM;
        load_tile<T, D, BM, NT>(sQ + stage * kTile, p.q, b, h, i0, p.Nq);
        load_tile<T, D, BM, NT>(sdO + stage * kTile, p.dout, b, h, i0, p.Nq);
        load_row_stats<BM, VARLEN>(stats + stage * BM, stats + 2 * BM + stage * BM, p, b, h, i0);
    };

    load_tile<T, D, BN, NT>(sK, p.k, b, hk, j0, p.Nk);
    load_tile<T, D, BN, NT>(sV, p.v, b, hk, j0, p.Nk);
    if (iters > 0) load_q_side(0, 0);
    cp_async_commit();

    float dv[16][4], dk[16][4];
#pragma unroll
    for (int i = 0; i < 16; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) dv[i][e] = dk[i][e] = 0.0f;

    for (long long it = 0; it < iters; it++) {
        const int stage = (int)(it & 1);
        if (it + 1 < iters) load_q_side(it + 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const long long i0 = (qt0 + it % per_head) * BM;
        const int m = (int)min((long long)BM, p.Nq - i0);
        const uint32_t q_s = sQ + stage * kTile, do_s = sdO + stage * kTile;
        const bool edge = m < BM || n < BN || wa_tile_needs_mask(&p.win, i0, i0 + m, j0, j0 + n);
        pair_tile<T, true>(p, q_s, do_s, sK, sV, sP, sdS, xch, stats + stage * BM, stats + 2 * BM + stage * BM, i0, j0, edge,
                           scale2);
        __syncthreads(); /* P and dS complete */

        /* dV += Pᵀ dO and dK += dSᵀ Q */
#pragma unroll
        for (int kq = 0; kq < BM / 16; kq++) {
            uint32_t ap[4], as[4];
            load_at<kPairW>(ap, sP, kq * 16, kg, lane);
            load_at<kPairW>(as, sdS, kq * 16, kg, lane);
#pragma unroll
            for (int nd = 0; nd < 8; nd++) {
                uint32_t bo[4], bq[4];
                load_b_kn<D>(bo, do_s, kq * 16, c4 * 8 + nd, lane);
                load_b_kn<D>(bq, q_s, kq * 16, c4 * 8 + nd, lane);
                mma<T>(dv[2 * nd], ap, bo[0], bo[1]);
                mma<T>(dv[2 * nd + 1], ap, bo[2], bo[3]);
                mma<T>(dk[2 * nd], as, bq[0], bq[1]);
                mma<T>(dk[2 * nd + 1], as, bq[2], bq[3]);
            }
        }
        __syncthreads(); /* the stage, P, dS and the exchange buffer are free for the next iteration */
    }
    cp_async_wait<0>();

    /* keys no query sees fall through with zero accumulators: dK = dV = 0 is written for them */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const long long j = j0 + kg * 16 + g + 8 * r;
        if (j >= p.Nk) continue;
        T *krow = row_of<T>(p.dk, b, hk, j), *vrow = row_of<T>(p.dv, b, hk, j);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const int col = c4 * 128 + i * 8 + 2 * t4;
            *(uint32_t *)(krow + col) = pack2<T>(dk[i][2 * r], dk[i][2 * r + 1]);
            *(uint32_t *)(vrow + col) = pack2<T>(dv[i][2 * r], dv[i][2 * r + 1]);
        }
    }
}

/* the deterministic dQ: one CTA per 32 query rows of head h, owning dQ (rows 16 (w & 1)..,
 * columns 128 (w >> 1)..) in registers over the key tiles the window allows */
template <typename T, bool VARLEN> __global__ void __launch_bounds__(kThreads, 1) dq_wide_kernel(const kparams kp) {
    constexpr int D = kD, BN = kBN, BM = kBM, NT = kThreads;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ = smem_u32(smem), sdO = sQ + kTile, sK = sdO + kTile, sV = sK + 2 * kTile, sdS = sV + 2 * kTile;
    float *xch = (float *)(smem + 6 * kTile + kPair), *stats = xch + kXch / 4; /* lse[BM], delta[BM] */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int c4 = warp >> 1;
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const cta_tile at = heaviest_first<false>(true);
    const long long h = at.head, b = sv.b(), hk = h / p.group, i0 = at.tile * BM;
    if (VARLEN && i0 >= p.Nq) return;
    const int m = (int)min((long long)BM, p.Nq - i0);
    int64_t kt0, kt1;
    wa_key_tiles_for_rows(&p.win, i0, i0 + m, BN, &kt0, &kt1);
    const float scale2 = p.scale * kLog2e;

    load_tile<T, D, BM, NT>(sQ, p.q, b, h, i0, p.Nq);
    load_tile<T, D, BM, NT>(sdO, p.dout, b, h, i0, p.Nq);
    load_row_stats<BM, VARLEN>(stats, stats + BM, p, b, h, i0);
    if (kt0 < kt1) {
        load_tile<T, D, BN, NT>(sK, p.k, b, hk, kt0 * BN, p.Nk);
        load_tile<T, D, BN, NT>(sV, p.v, b, hk, kt0 * BN, p.Nk);
    }
    cp_async_commit();

    float acc[2][8][4];
    zero_frags(acc);
    for (long long kt = kt0; kt < kt1; kt++) {
        const int stage = (int)((kt - kt0) & 1);
        if (kt + 1 < kt1) {
            load_tile<T, D, BN, NT>(sK + (stage ^ 1) * kTile, p.k, b, hk, (kt + 1) * BN, p.Nk);
            load_tile<T, D, BN, NT>(sV + (stage ^ 1) * kTile, p.v, b, hk, (kt + 1) * BN, p.Nk);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const uint32_t k_s = sK + stage * kTile, v_s = sV + stage * kTile;
        const long long j0 = kt * BN;
        const int n = (int)min((long long)BN, p.Nk - j0);
        const bool edge = m < BM || n < BN || wa_tile_needs_mask(&p.win, i0, i0 + m, j0, j0 + n);
        pair_tile<T, false>(p, sQ, sdO, k_s, v_s, 0, sdS, xch, stats, stats + BM, i0, j0, edge, scale2);
        __syncthreads(); /* dS complete */
        dq_chunk<T>(acc[0], sdS, k_s, 0, lane);
        dq_chunk<T>(acc[1], sdS, k_s, 1, lane);
        __syncthreads(); /* the stage, dS and the exchange buffer are free for the next tile */
    }
    cp_async_wait<0>();

    const long long r0 = i0 + (warp & 1) * 16 + g;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (r0 + 8 * r >= p.Nq) continue;
        T *row = row_of<T>(p.dq, b, h, r0 + 8 * r);
#pragma unroll
        for (int ch = 0; ch < 2; ch++)
#pragma unroll
            for (int i = 0; i < 8; i++)
                *(uint32_t *)(row + c4 * 128 + ch * 64 + i * 8 + 2 * t4) = pack2<T>(acc[ch][i][2 * r], acc[ch][i][2 * r + 1]);
    }
}

/* rectangular (VARLEN false) on (tiles, heads, B) grids, or varlen over the sequences
 * (over_sequences), tiles from the longest sequence, each CTA past its own sequence's end leaving
 * at once */
template <typename T, bool VARLEN> static wa_status launch(const kparams &kp, cudaStream_t s) {
    static volatile unsigned long long done_kv = 0, done_q = 0;
    CUDA_TRY(raise_once(dkdv_wide_kernel<T, VARLEN>, kDkdvSmem, &done_kv));
    CUDA_TRY(raise_once(dq_wide_kernel<T, VARLEN>, kDqSmem, &done_q));
    return over_sequences(kp, [&](const kparams &c, unsigned z) {
        if (kp.Nq > 0) {
            delta_mma_kernel<T, kD, VARLEN><<<dim3((unsigned)((kp.Nq + 63) / 64), (unsigned)kp.Hq, z), 128, 0, s>>>(c);
            CUDA_TRY(cudaGetLastError());
        }
        if (kp.Nk > 0) { /* also when Nq = 0: every key tile then writes dK = dV = 0 */
            dkdv_wide_kernel<T, VARLEN><<<dim3((unsigned)((kp.Nk + kBN - 1) / kBN), (unsigned)kp.Hkv, z), kThreads, kDkdvSmem, s>>>(c);
            CUDA_TRY(cudaGetLastError());
        }
        if (kp.Nq > 0) {
            dq_wide_kernel<T, VARLEN><<<dim3((unsigned)((kp.Nq + kBM - 1) / kBM), (unsigned)kp.Hq, z), kThreads, kDqSmem, s>>>(c);
            CUDA_TRY(cudaGetLastError());
        }
        return WA_OK;
    });
}

} /* namespace */

size_t sm80_backward_d512_smem(void) { return kDkdvSmem > kDqSmem ? kDkdvSmem : kDqSmem; }

wa_status sm80_backward_d512(const kparams &kp, wa_dtype dt, cudaStream_t s) {
    if (kp.cu_q) return dt == WA_BF16 ? launch<__nv_bfloat16, true>(kp, s) : launch<__half, true>(kp, s);
    return dt == WA_BF16 ? launch<__nv_bfloat16, false>(kp, s) : launch<__half, false>(kp, s);
}

/* attn_mma.cu — the CUDA backend's tensor-core kernels for f16 and bf16 at D = 64, 128 and 256
 * (FlashAttention-2's scheme, written for this library's window geometry): version 2 on mma.sync,
 * and version 3's forward on wgmma at D = 256 (fwd_wgmma_kernel below). Since version 4
 * (fwd_hopper.cu, bwd_hopper.cu) these are the fallback: mma_forward and mma_backward try
 * version 4 first and run these when it does not apply (tensors TMA cannot describe, or
 * WINATTN_CUDA=mma / v3 for comparisons). At D = 512 (version 5) the forward kernel
 * below splits D between two warps per 16 rows (fwd_split) as the fallback of fwd_hopper.cu's
 * wgmma form, and mma_backward hands the backward to bwd_wide.cu where bwd_hopper.cu's D = 512
 * kernels do not take it (varlen calls, tensors TMA cannot describe). On GPUs other than Hopper
 * (compute capability 8.0 and up: cuda_target in common.cuh) the mma.sync kernels here and in
 * bwd_wide.cu are the tensor-core path, where their shared memory fits (mma_supports).
 * Everything else (f32, other head dims, rows not 16-byte aligned) stays on version 1 in
 * attn_cuda.cu, which dispatches here through mma_supports().
 *
 * Building blocks: mma.sync m16n8k16 (16-bit inputs, f32 accumulators), ldmatrix from shared
 * memory, cp.async double buffering of the next key (or query) tile while the current one is
 * multiplied. Shared tiles hold rows of D 16-bit values in 16-byte chunks; chunk c of row r is
 * stored at chunk c ^ (r & 7), so the eight row addresses of one ldmatrix hit eight different
 * bank groups (a row is a multiple of 128 bytes, so unswizzled they would all hit one).
 *
 *   forward   one CTA of 8 warps per 128 query rows; each warp owns 16 rows: S = Q Kᵀ in
 *             registers, online softmax in registers (exp2 with the scale folded in), P rounded
 *             to the input dtype and fed straight back as the A operand of O += P V.
 *   delta     δ_i = dO_i · O_i on the tensor cores with the same k order as dP below (see there)
 *   dK, dV    one CTA of 8 warps per 64 keys (kv head, batch), looping over the query heads of
 *             the group and the query tiles the window allows; P and dS go through shared memory
 *             so that the 64×64 pair tile can be read transposed for dV += Pᵀ dO, dK += dSᵀ Q.
 *   dQ        one CTA per query tile owning its dQ (as version 1: no atomics, deterministic);
 *             or, unless wa_context_params.cuda_deterministic, f32 atomic adds from the dK/dV kernel.
 * docs/cuda.md has the measurements of each, dev/cuda/README.md the variants that lost.
 *
 * Masks and tile ranges come from tile_geometry.h only: a tile pair is masked element-wise when
 * wa_tile_needs_mask() says so or when it is ragged (the last tile of a sequence), where padded
 * rows and columns were zero-filled by cp.async and are masked out.
 */
#include "mma_prims.cuh"

#include <stdint.h>

#include <algorithm>

namespace {

/* ---- forward ---- */

/* key-tile widths; the lab (dev/cuda/bench_parity.sh) overrides them with -D to time variants */
#ifndef WA_FWD_BN_64
#define WA_FWD_BN_64 64
#endif
#ifndef WA_FWD_BN_128
#define WA_FWD_BN_128 64
#endif
#ifndef WA_FWD_BN_256
#define WA_FWD_BN_256 64
#endif
constexpr int kFwdThreads = 256;
/* Above D = 256 an O row of f32 accumulators would take 256 registers a thread, so two warps share
 * 16 query rows (version 5, D = 512): each forms S over one half of D, the pair adds the halves
 * through shared memory (own + other: both get the same bits), both run the same softmax, and each
 * accumulates O for its half of the columns. Key tiles of 32 keep Q, K and V (two stages) within
 * 227 KB. */
template <int D> __host__ __device__ constexpr int fwd_split() { return D > 256 ? 2 : 1; }
template <int D> __host__ __device__ constexpr int fwd_bm() { return 128 / fwd_split<D>(); }
template <int D> __host__ __device__ constexpr int fwd_bn() {
    return D == 64 ? WA_FWD_BN_64 : D == 128 ? WA_FWD_BN_128 : D == 256 ? WA_FWD_BN_256 : 32;
}
/* the exchange buffer of the split form: each warp's S fragments, lane-major */
template <int D> constexpr size_t fwd_xch_bytes() { return fwd_split<D>() > 1 ? (size_t)8 * fwd_bn<D>() / 2 * 32 * 4 : 0; }
template <int D> constexpr size_t fwd_smem_bytes() { return (size_t)2 * (fwd_bm<D>() * D + 4 * fwd_bn<D>() * D) + fwd_xch_bytes<D>(); }

template <typename T, int D, bool VARLEN> __global__ void __launch_bounds__(kFwdThreads, 1) fwd_mma_kernel(const kparams kp) {
    constexpr int CS = fwd_split<D>(), BM = fwd_bm<D>(), BN = fwd_bn<D>(), NT = kFwdThreads, KS = D / 16;
    constexpr int DW = D / CS, STRIPES = 8 / CS; /* columns of O per warp, warps per column half */
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ = smem_u32(smem), sK = sQ + BM * D * 2, sV = sK + 2 * BN * D * 2;
    float *xch = (float *)(smem + (size_t)2 * (BM * D + 4 * BN * D));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int half = warp / STRIPES, qrow = (warp % STRIPES) * 16;
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const long long h = blockIdx.y, b = sv.b(), hk = h / p.group, i0 = (long long)blockIdx.x * BM;
    if (VARLEN && i0 >= p.Nq) return; /* past this sequence's rows: the whole CTA, before any barrier */
    const int m = (int)min((long long)BM, p.Nq - i0);
    int64_t kt0, kt1;
    wa_key_tiles_for_rows(&p.win, i0, i0 + m, BN, &kt0, &kt1);

    load_tile<T, D, BM, NT>(sQ, p.q, b, h, i0, p.Nq);
    if (kt0 < kt1) {
        load_tile<T, D, BN, NT>(sK, p.k, b, hk, kt0 * BN, p.Nk);
        load_tile<T, D, BN, NT>(sV, p.v, b, hk, kt0 * BN, p.Nk);
    }
    cp_async_commit();

    float acc[DW / 8][4];
#pragma unroll
    for (int i = 0; i < DW / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
    const long long rows[2] = {i0 + qrow + g, i0 + qrow + g + 8};
    const float scale2 = p.scale * kLog2e;

    for (long long kt = kt0; kt < kt1; kt++) {
        const int stage = (int)((kt - kt0) & 1);
        if (kt + 1 < kt1) { /* the other stage was released by the barrier ending the last iteration */
            load_tile<T, D, BN, NT>(sK + (stage ^ 1) * BN * D * 2, p.k, b, hk, (kt + 1) * BN, p.Nk);
            load_tile<T, D, BN, NT>(sV + (stage ^ 1) * BN * D * 2, p.v, b, hk, (kt + 1) * BN, p.Nk);
        }
        cp_async_commit();
        cp_async_wait<1>(); /* this tile's group (and Q) landed; the prefetch may still fly */
        __syncthreads();
        const uint32_t k_s = sK + stage * BN * D * 2, v_s = sV + stage * BN * D * 2;

        float s[BN / 8][4];
#pragma unroll
        for (int i = 0; i < BN / 8; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int kx = 0; kx < KS / CS; kx++) {
            const int ks = half * (KS / CS) + kx;
            uint32_t a[4];
            load_a<D>(a, sQ, qrow, ks, lane);
#pragma unroll
            for (int nb = 0; nb < BN / 16; nb++) {
                uint32_t bb[4];
                load_b_nk<D>(bb, k_s, nb * 16, ks, lane);
                mma<T>(s[2 * nb], a, bb[0], bb[1]);
                mma<T>(s[2 * nb + 1], a, bb[2], bb[3]);
            }
        }
        if (CS > 1) { /* S = this half + the other half (warp ^ STRIPES holds it) */
            float *mine = xch + warp * (BN / 2 * 32), *other = xch + (warp ^ STRIPES) * (BN / 2 * 32);
#pragma unroll
            for (int i = 0; i < BN / 8; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) mine[(i * 4 + e) * 32 + lane] = s[i][e];
            __syncthreads(); /* the buffer is rewritten only after the barrier that ends the iteration */
#pragma unroll
            for (int i = 0; i < BN / 8; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[i][e] += other[(i * 4 + e) * 32 + lane];
        }

        const long long j0 = kt * BN;
        const int n = (int)min((long long)BN, p.Nk - j0);
        const bool edge = n < BN || wa_tile_needs_mask(&p.win, i0, i0 + m, j0, j0 + n);
        softmax_step<BN, DW / 8>(p, s, acc, row_max, row_sum, rows, j0, edge, t4, scale2);

        /* O += P V: the S accumulator layout of two adjacent n blocks is the A layout of one k step */
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int nd = 0; nd < DW / 16; nd++) {
                uint32_t bb[4];
                load_b_kn<D>(bb, v_s, kk * 16, half * (DW / 16) + nd, lane);
                mma<T>(acc[2 * nd], a, bb[0], bb[1]);
                mma<T>(acc[2 * nd + 1], a, bb[2], bb[3]);
            }
        }
        __syncthreads(); /* every warp is done with this stage before the next prefetch overwrites it */
    }
    cp_async_wait<0>();
    store_rows<T, DW / 8>(p, acc, row_max, row_sum, rows, b, h, t4, half * DW);
}


/* ---- forward on wgmma (Hopper warpgroup MMA) ---- */

#ifndef WA_WG_BN_128
#define WA_WG_BN_128 64
#endif
/* head dims from this one up take the wgmma forward; smaller ones the mma.sync forward, which
 * measured faster at D = 64 and 128 (dev/cuda/README.md) */
#ifndef WA_WGMMA_MIN_D
#define WA_WGMMA_MIN_D 256
#endif
template <int D> __host__ __device__ constexpr int wg_bn() { return D == 256 ? 64 : D == 128 ? WA_WG_BN_128 : 128; }
constexpr int kWgBM = 128, kWgThreads = 256;
template <int D> constexpr size_t wg_smem_bytes() { return 1024 + (size_t)2 * (kWgBM * D + 4 * wg_bn<D>() * D); }

/* Same algorithm and register layout as fwd_mma_kernel (each warp's 16 rows sit in the same
 * accumulator positions); the two warpgroups each issue S = Q Kᵀ for their 64 rows as one chain
 * of wgmma reading Q and K from shared memory, and O += P V with P from registers. Both
 * warpgroups run in step (one barrier per key tile); running them half a tile apart so that one's
 * softmax overlaps the other's products measured slower (v3b in dev/cuda/README.md). */
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

/* ---- backward ---- */

constexpr int kBwdBN = 64, kBwdBM = 64, kBwdThreads = 256;

template <int D> constexpr size_t dkdv_smem_bytes() {
    return (size_t)2 * (2 * kBwdBN * D + 4 * kBwdBM * D + 2 * kBwdBM * kBwdBN) + (size_t)4 * 4 * kBwdBM;
}

/* owner of dK, dV for keys [j0, j0 + 64) of kv head hk; with ATOMIC_DQ it also adds this key
 * tile's share of dQ = dS K into the f32 accumulator p.dq_acc (the fast, non-reproducible option) */
template <typename T, int D, bool ATOMIC_DQ, bool VARLEN>
__global__ void __launch_bounds__(kBwdThreads, 1) dkdv_mma_kernel(const kparams kp) {
    constexpr int BN = kBwdBN, BM = kBwdBM, NT = kBwdThreads, KS = D / 16, DH = D / 2;
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

    /* stage the query-side tiles of iteration `it` */
    auto load_q_side = [&](long long it, int stage) {
        const long long h = hk * p.group + it / per_head, i0 = (qt0 + it % per_head) * BM;
        load_tile<T, D, BM, NT>(sQ + stage * BM * D * 2, p.q, b, h, i0, p.Nq);
        load_tile<T, D, BM, NT>(sdO + stage * BM * D * 2, p.dout, b, h, i0, p.Nq);
        load_row_stats<BM, VARLEN>(stats + stage * BM, stats + 2 * BM + stage * BM, p, b, h, i0);
    };

    load_tile<T, D, BN, NT>(sK, p.k, b, hk, j0, p.Nk);
    load_tile<T, D, BN, NT>(sV, p.v, b, hk, j0, p.Nk);
    if (iters > 0) load_q_side(0, 0);
    cp_async_commit();

    float dv[DH / 8][4], dk[DH / 8][4];
#pragma unroll
    for (int i = 0; i < DH / 8; i++)
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
        const uint32_t q_s = sQ + stage * BM * D * 2, do_s = sdO + stage * BM * D * 2;

        /* S = Q Kᵀ and dP = dO Vᵀ for queries 16 qg.., keys 32 kh.. */
        float s[4][4], dp[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[i][e] = dp[i][e] = 0.0f;
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
        const bool edge = m < BM || n < BN || wa_tile_needs_mask(&p.win, i0, i0 + m, j0, j0 + n);
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
        __syncthreads(); /* P and dS complete */

        /* dV += Pᵀ dO and dK += dSᵀ Q for keys 16 kg.., columns DH dh.. */
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
        if (ATOMIC_DQ) { /* dQ[16 qg.., DH dh..] += dS K, in column chunks of CW to bound registers */
            constexpr int CW = DH < 64 ? DH : 64;
            const long long h = hk * p.group + it / per_head;
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
        __syncthreads(); /* stage, P and dS are free for the next iteration */
    }
    cp_async_wait<0>();

    /* keys no query sees fall through with zero accumulators: dK = dV = 0 is written for them */
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

/* dQ: one CTA per 128 query rows; each warp owns 16 rows and their dQ in registers. At D = 256
 * the dQ accumulator takes 128 registers a thread, so the key tile is halved to keep S and dP
 * (and Q, dO, K, V twice in shared memory) within budget. */
constexpr int kDqWarps = 8;
#ifndef WA_DQ_BN_256
#define WA_DQ_BN_256 32
#endif
template <int D> __host__ __device__ constexpr int dq_bn() { return D >= 256 ? WA_DQ_BN_256 : 64; }
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

/* ---- host side ---- */

/* Each launch below runs the rectangular instance of a kernel (VARLEN false) on a (tiles, heads, B)
 * grid, or the varlen one over the sequences (over_sequences: z in chunks of 65535); the grid's
 * tiles come from the longest sequence, and a CTA past its own sequence's end leaves at once. */
template <typename T, int D, bool VARLEN> static wa_status fwd_wgmma_launch(const kparams &kp, cudaStream_t s) {
    static volatile unsigned long long done = 0;
    constexpr size_t bytes = wg_smem_bytes<D>();
    CUDA_TRY(raise_once(fwd_wgmma_kernel<T, D, VARLEN>, bytes, &done));
    return over_sequences(kp, [&](const kparams &c, unsigned z) {
        fwd_wgmma_kernel<T, D, VARLEN><<<dim3((unsigned)((kp.Nq + kWgBM - 1) / kWgBM), (unsigned)kp.Hq, z), kWgThreads, bytes, s>>>(c);
        CUDA_TRY(cudaGetLastError());
        return WA_OK;
    });
}

/* the wgmma forward (version 3) where `hopper` (cuda_target), else the mma.sync one */
template <typename T, int D, bool VARLEN> static wa_status fwd_launch(const kparams &kp, bool hopper, cudaStream_t s) {
    if constexpr (D >= WA_WGMMA_MIN_D && D <= 256)
        if (hopper) return fwd_wgmma_launch<T, D, VARLEN>(kp, s);
    static volatile unsigned long long done = 0;
    constexpr size_t bytes = fwd_smem_bytes<D>();
    CUDA_TRY(raise_once(fwd_mma_kernel<T, D, VARLEN>, bytes, &done));
    return over_sequences(kp, [&](const kparams &c, unsigned z) {
        fwd_mma_kernel<T, D, VARLEN><<<dim3((unsigned)((kp.Nq + fwd_bm<D>() - 1) / fwd_bm<D>()), (unsigned)kp.Hq, z), kFwdThreads, bytes,
                                       s>>>(c);
        CUDA_TRY(cudaGetLastError());
        return WA_OK;
    });
}

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

template <typename T> static wa_status fwd_by_dim(const kparams &kp, bool hopper, cudaStream_t s) {
    switch (kp.D) {
    case 64: return kp.cu_q ? fwd_launch<T, 64, true>(kp, hopper, s) : fwd_launch<T, 64, false>(kp, hopper, s);
    case 128: return kp.cu_q ? fwd_launch<T, 128, true>(kp, hopper, s) : fwd_launch<T, 128, false>(kp, hopper, s);
    case 256: return kp.cu_q ? fwd_launch<T, 256, true>(kp, hopper, s) : fwd_launch<T, 256, false>(kp, hopper, s);
    case 512: return kp.cu_q ? fwd_launch<T, 512, true>(kp, hopper, s) : fwd_launch<T, 512, false>(kp, hopper, s);
    }
    return wa_fail(WA_ERR_UNSUPPORTED, "tensor-core forward: D = %lld", kp.D);
}

template <typename T> static wa_status bwd_by_dim(const kparams &kp, cudaStream_t s) {
    switch (kp.D) {
    case 64: return kp.cu_q ? bwd_launch<T, 64, true>(kp, s) : bwd_launch<T, 64, false>(kp, s);
    case 128: return kp.cu_q ? bwd_launch<T, 128, true>(kp, s) : bwd_launch<T, 128, false>(kp, s);
    case 256: return kp.cu_q ? bwd_launch<T, 256, true>(kp, s) : bwd_launch<T, 256, false>(kp, s);
    }
    return wa_fail(WA_ERR_UNSUPPORTED, "tensor-core backward: D = %lld", kp.D);
}

/* cp.async moves 16-byte chunks and the epilogues store 4-byte pairs (a varlen tensor's batch
 * stride is never used: one batch entry, the sequences along its rows) */
static int rows_aligned(const wa_tensor *t, int varlen) {
    if (!t) return 1;
    return ((uintptr_t)t->data % 16) == 0 && (varlen || t->stride[0] % 8 == 0) && t->stride[1] % 8 == 0 && t->stride[2] % 8 == 0;
}

/* Dynamic shared memory of the mma.sync kernels a call at head dim D launches (and raises the
 * limit of): the forward, or the backward's largest (dK/dV or dQ; δ uses none). On compute
 * capability 8.0 (163 KB a block) the forward and the backward fit at D = 64 and 128; on 8.6 and 8.9
 * (99 KB) the forward at D = 64 and 128 and the backward at D = 64; D = 256 and 512 need Hopper's
 * 227 KB. */
static size_t mma_sync_smem(long long D, int backward) {
    switch (D) {
    case 64: return backward ? std::max(dkdv_smem_bytes<64>(), dq_smem_bytes<64>()) : fwd_smem_bytes<64>();
    case 128: return backward ? std::max(dkdv_smem_bytes<128>(), dq_smem_bytes<128>()) : fwd_smem_bytes<128>();
    case 256: return backward ? std::max(dkdv_smem_bytes<256>(), dq_smem_bytes<256>()) : fwd_smem_bytes<256>();
    case 512: return backward ? wide_backward_smem() : fwd_smem_bytes<512>();
    }
    return SIZE_MAX;
}

} /* namespace */

int mma_supports(const wa_problem *p, const cuda_target &t, int backward) {
    if (!t.tensor_cores) return 0;
    if (p->dtype != WA_F16 && p->dtype != WA_BF16) return 0;
    if (p->D != 64 && p->D != 128 && p->D != 256 && p->D != 512) return 0;
    const wa_tensor *all[9] = {p->q, p->k, p->v, p->o, p->lse, p->do_, p->dq, p->dk, p->dv};
    for (int i = 0; i < 9; i++)
        if (i != 4 && !rows_aligned(all[i], p->cu_q != NULL)) return 0;
    /* version 1 takes what does not fit; on Hopper versions 3 and 4 need no more than this either */
    return mma_sync_smem(p->D, backward) <= t.smem_optin;
}

wa_status mma_forward(const kparams &kp, wa_dtype dt, const cuda_target &t, cudaStream_t s) {
    if (t.hopper) {
        int taken = 0;
        const wa_status st = hopper_forward(kp, dt, t, s, &taken);
        if (taken || st != WA_OK) return st;
    }
    return dt == WA_BF16 ? fwd_by_dim<__nv_bfloat16>(kp, t.hopper, s) : fwd_by_dim<__half>(kp, t.hopper, s);
}

wa_status mma_backward(const kparams &kp, wa_dtype dt, const cuda_target &t, cudaStream_t s) {
    if (t.hopper) {
        int taken = 0;
        const wa_status st = hopper_backward(kp, dt, s, &taken);
        if (taken || st != WA_OK) return st;
    }
    /* the ordered form's accumulator is version 4's alone: elsewhere a deterministic call keeps
     * its dQ kernel */
    kparams k = kp;
    if (k.dq_order) k.dq_acc = nullptr, k.dq_order = nullptr;
    if (k.D == 512) return wide_backward(k, dt, s); /* version 5 (bwd_wide.cu) */
    return dt == WA_BF16 ? bwd_by_dim<__nv_bfloat16>(k, s) : bwd_by_dim<__half>(k, s);
}

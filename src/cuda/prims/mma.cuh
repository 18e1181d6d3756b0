/* prims/mma.cuh — the building blocks the tensor-core kernels share (sm80/, sm90/): PTX wrappers
 * (cp.async, ldmatrix, mma.sync, wgmma fences and descriptors), the swizzled shared-memory tile
 * layouts, the masked online-softmax step, the forward's epilogue and the backward pieces of the
 * mma.sync kernels. Everything sits in an anonymous namespace: each translation unit gets its own
 * inlined copy. */
#ifndef WA_CUDA_MMA_PRIMS_CUH
#define WA_CUDA_MMA_PRIMS_CUH

#include "../common.cuh"

#include <math.h>
#include <stdint.h>

namespace {
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

/* ---- PTX wrappers ---- */

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* 16 bytes global -> shared, bypassing L1; valid == false writes 16 zero bytes */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* c += a b for one 16x8x16 step; a row-major 16x16, b "col" (n-major) 16x8 */
template <typename T> __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* two floats rounded to the dtype, lo in the low half (the fragment order) */
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *(uint32_t *)&v;
}

/* dst[0] += x, dst[1] += y (dst 8-byte aligned) by the atomic-dQ kernels: one vector atomic where
 * the hardware has it (sm_90 on), two scalar ones before */
__device__ __forceinline__ void atomic_add2(float *dst, float x, float y) {
#if __CUDA_ARCH__ >= 900
    atomicAdd((float2 *)dst, make_float2(x, y));
#else
    atomicAdd(dst, x), atomicAdd(dst + 1, y);
#endif
}

/* 2^x as the bare MUFU instruction (flushes denormal results to 0, which P never needs), without
 * exp2f's range handling */
__device__ __forceinline__ float exp2_(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* ---- shared-memory tiles ---- */

/* byte offset of 16-byte chunk c of row r in a swizzled tile whose rows hold W 16-bit values */
template <int W> __device__ __forceinline__ uint32_t swz(int r, int c) { return (uint32_t)(r * (W * 2) + ((c ^ (r & 7)) << 4)); }

/* Tiles for wgmma are stored in column blocks of 64 values (128-byte rows), each block R rows deep
 * and 1024-byte aligned, with the 128-byte swizzle the hardware applies (16-byte chunk c of row r
 * at c ^ (r % 8)). The K-major operands (Q, K) and the MN-major V (read transposed) use the same
 * layout, and so would ldmatrix. c counts 16-byte chunks along the whole row of D values. */
template <int R> __device__ __forceinline__ uint32_t blk_off(int r, int c) {
    return (uint32_t)((c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

/* rows [row0, row0 + ROWS) of head (b, h) into a tile laid out as swz<D> (BLOCKS = false, the
 * mma.sync kernels) or blk_off<ROWS> (true, wgmma); rows at or past `limit` become 0 (a ragged
 * last tile must not feed stale or NaN bytes into the products) */
template <typename T, int D, int ROWS, int NT, bool BLOCKS>
__device__ __forceinline__ void load_rows(uint32_t dst, const dev_tensor &t, long long b, long long h, long long row0,
                                          long long limit) {
    constexpr int CH = D / 8;
    static_assert(ROWS * CH % NT == 0, "every thread moves the same number of chunks");
    const T *base = row_of<T>(t, b, h, 0);
#pragma unroll
    for (int k = 0; k < ROWS * CH / NT; k++) {
        const int e = threadIdx.x + k * NT, r = e / CH, c = e % CH;
        const bool ok = row0 + r < limit;
        cp_async16(dst + (BLOCKS ? blk_off<ROWS>(r, c) : swz<D>(r, c)), base + (ok ? row0 + r : 0) * t.s2 + c * 8, ok);
    }
}
template <typename T, int D, int ROWS, int NT>
__device__ __forceinline__ void load_tile(uint32_t dst, const dev_tensor &t, long long b, long long h, long long row0,
                                          long long limit) {
    load_rows<T, D, ROWS, NT, false>(dst, t, b, h, row0, limit);
}
template <typename T, int D, int ROWS, int NT>
__device__ __forceinline__ void load_tile_blk(uint32_t dst, const dev_tensor &t, long long b, long long h, long long row0,
                                              long long limit) {
    load_rows<T, D, ROWS, NT, true>(dst, t, b, h, row0, limit);
}

/* A operand (16 rows from `row`, k columns 16*ks..) from a row-major tile */
template <int W> __device__ __forceinline__ void load_a(uint32_t (&a)[4], uint32_t tile, int row, int ks, int lane) {
    ldsm_x4(a, tile + swz<W>(row + (lane & 15), ks * 2 + (lane >> 4)));
}
/* B operands of two n blocks (rows n..n+15 of the tile are the n index, k columns 16*ks..):
 * b[0], b[1] for rows n..n+7, b[2], b[3] for n+8..n+15 */
template <int W> __device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], uint32_t tile, int n, int ks, int lane) {
    ldsm_x4(b, tile + swz<W>(n + (lane & 7) + ((lane >> 4) << 3), ks * 2 + ((lane >> 3) & 1)));
}
/* B operands of two n blocks from a tile stored k-major (rows k..k+15 are the k index,
 * columns 16*nc.. the n index), read transposed */
template <int W> __device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], uint32_t tile, int k, int nc, int lane) {
    ldsm_x4_t(b, tile + swz<W>(k + (lane & 7) + (((lane >> 3) & 1) << 3), nc * 2 + (lane >> 4)));
}
/* A operand of Xᵀ where X is stored k-major (rows k..k+15, m columns 16*mc..), read transposed */
template <int W> __device__ __forceinline__ void load_at(uint32_t (&a)[4], uint32_t tile, int k, int mc, int lane) {
    ldsm_x4_t(a, tile + swz<W>(k + (lane & 7) + ((lane >> 4) << 3), mc * 2 + ((lane >> 3) & 1)));
}

/* Whether a kernel's softmax applies the softcap: decided per call (the sm80 and the cp.async
 * forwards), or fixed at compile time (the TMA kernels instantiate both: tanhf's temporaries,
 * unrolled over a 64 × 128 tile, make the uncapped kernel spill when the choice is left to run
 * time). */
enum class Cap { per_call, off, on };

/* the scores of one accumulator element in log2 units (softcapped if asked) */
template <Cap CAP = Cap::per_call> __device__ __forceinline__ float score2(const kparams &p, float acc, float scale2) {
    if (CAP == Cap::on || (CAP == Cap::per_call && p.softcap > 0.0f)) return p.softcap * tanhf(acc * p.scale / p.softcap) * kLog2e;
    return acc * scale2;
}

/* The keys of query row `row` that tile columns [j0, j0 + BN) hold, as columns [lo, hi] clamped
 * to [-1, BN] (empty when lo > hi): edge tiles then mask with 32-bit compares per element
 * (64-bit ones cost the TMA kernels their spare registers). */
template <int BN> __device__ __forceinline__ void visible_cols(const kparams &p, long long row, long long j0, int &lo, int &hi) {
    lo = (int)wa_max64(-1, wa_min64(BN, wa_row_first_key(&p.win, row) - j0));
    hi = (int)wa_max64(-1, wa_min64(BN, wa_row_last_key(&p.win, row) - j0));
}
/* the same for key row `key` of a transposed tile: its queries among columns [i0, i0 + BM); a key
 * past the end sees nothing */
template <int BM> __device__ __forceinline__ void visible_query_cols(const kparams &p, long long key, long long i0, int &lo, int &hi) {
    if (key >= p.Nk) {
        lo = BM, hi = -1;
        return;
    }
    lo = (int)wa_max64(-1, wa_min64(BM, wa_col_first_query(&p.win, key) - i0));
    hi = (int)wa_max64(-1, wa_min64(BM, wa_col_last_query(&p.win, key) - i0));
}

/* Which tile of which head a CTA of a (tiles, heads, batch) grid takes, heaviest tiles first
 * (`last_first`: the last tiles are the heaviest, as query tiles are under a causal mask; else the
 * first, as key tiles are). CTAs start in the order of their linear index (x fastest).
 * across_heads (the dK/dV kernels): CTA L = x + tiles·y takes tile L / heads of head L % heads,
 * each tile index in every head before the next, so the last wave holds the lightest tiles of all
 * heads; in the grid's own order the last wave would hold every tile of the last heads, and the
 * dK/dV kernels have few CTAs (a few waves), so SMs would stand idle at the end. The query-side
 * kernels (many waves) keep the grid's order, in which neighbouring query tiles of a head, which
 * share most of their keys, run together. */
struct cta_tile {
    int tile, head; /* 32 bits, as the grid's x and y (two registers less than 64-bit ones) */
};
template <bool ACROSS_HEADS> __device__ __forceinline__ cta_tile heaviest_first(bool last_first) {
    unsigned t = blockIdx.x, h = blockIdx.y;
    if (ACROSS_HEADS) {
        const unsigned long long linear = blockIdx.x + (unsigned long long)gridDim.x * blockIdx.y;
        t = (unsigned)(linear / gridDim.y), h = (unsigned)(linear % gridDim.y);
    }
    return {(int)(last_first ? gridDim.x - 1 - t : t), (int)h};
}

/* f(edge_fixed<true>{}) on edge tiles, f(edge_fixed<false>{}) on the others (f reads it as a bool): the
 * masked and the unmasked form of a step compiled apart, in the TMA kernels. With one form whose
 * masks test a run-time flag, ptxas computes the masks on every tile (the default bounds make them
 * no-ops), a large share of the forward's instructions where it is bound by instruction issue.
 * Only without a softcap: with tanhf's temporaries two forms spill at D = 256 (forward) and D = 128
 * (dK/dV). The sm80 and cp.async forwards pass edge_at_run_time themselves. */
template <bool V> struct edge_fixed {
    __device__ constexpr operator bool() const { return V; }
};
struct edge_at_run_time {
    bool value;
    __device__ constexpr operator bool() const { return value; }
};
template <Cap CAP, typename F> __device__ __forceinline__ void edge_form(bool edge, F &&f) {
    if (CAP == Cap::off) {
        if (edge) f(edge_fixed<true>{});
        else f(edge_fixed<false>{});
        return;
    }
    f(edge_at_run_time{edge});
}

/* lazy rescaling's threshold, in log2 units (softmax_scores_as's LAZY) */
constexpr float kLazyLog2 = 8.0f;

/* One key tile of the online softmax on a thread's fragment, shared by every forward kernel: s
 * holds the raw scores of its two rows (rows[0], rows[1]; columns j0 + nb*8 + 2*t4 + {0,1}) and
 * becomes exp2(score - new max); the running max and sum are updated, and alpha[r] is the factor
 * the row's output accumulator must be multiplied by (rescale() below). Split from the rescale so
 * that the TMA forward can run it while O += P V of the previous tile is still in flight.
 * Masks only on edge tiles (edge_c: a bool, see edge_form), from tile_geometry.h.
 * FOLD (Cap::off in the TMA forwards, which the host takes only for a positive scale): the maximum is
 * taken over the raw scores (a positive factor keeps their order, rounding included) and
 * exp2(score · scale2 − max) is one fused multiply-add, as FlashAttention-3 does, instead of a
 * multiply per score first. Masked scores are −∞ raw, hence −∞ after the multiply-add, 0 after
 * exp2.
 * LAZY (the TMA forwards): a row's running max moves only
 * when a tile's scores pass it by more than kLazyLog2, as FlashAttention 4 does. The result is the
 * same function (O and the row sum carry the same stale max, which cancels in O / l and enters lse
 * exactly); P is then at most 2^kLazyLog2, harmless in f32 and in bf16/f16's exponent range, and
 * alpha is exactly 1 on most tiles, so that rescale_lazy() skips the multiply of O (128 registers
 * a thread at D = 256 and 512, once per 64 or 32 keys). */
template <int BN, Cap CAP, bool FOLD, typename Edge, bool LAZY = false>
__device__ __forceinline__ void softmax_scores_as(const kparams &p, float (&s)[BN / 8][4], float (&row_max)[2],
                                                  float (&row_sum)[2], float (&alpha)[2], const long long (&rows)[2],
                                                  long long j0, Edge edge_c, int t4, float scale2) {
    const bool edge = edge_c;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int lo = 0, hi = BN - 1;
        if (edge) visible_cols<BN>(p, rows[r], j0, lo, hi);
        float mx = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < BN / 8; nb++)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; e++) {
                float x = FOLD ? s[nb][e] : score2<CAP>(p, s[nb][e], scale2);
                if (edge) {
                    const int c = nb * 8 + 2 * t4 + (e & 1);
                    if (c < lo || c > hi) x = -INFINITY;
                }
                s[nb][e] = x;
                mx = fmaxf(mx, x);
            }
        /* the four lanes of a quad hold one row */
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float m_new = fmaxf(row_max[r], FOLD ? mx * scale2 : mx);
        /* not moved by less than the threshold; -inf - -inf is NaN: a row with nothing visible yet stays -inf */
        if (LAZY && !(m_new - row_max[r] > kLazyLog2)) m_new = row_max[r];
        const float m_use = m_new == -INFINITY ? 0.0f : m_new; /* a row with nothing visible yet stays 0 */
        alpha[r] = exp2_(row_max[r] - m_use);
        row_max[r] = m_new;
        row_sum[r] *= alpha[r];
#pragma unroll
        for (int nb = 0; nb < BN / 8; nb++)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; e++) {
                const float x = s[nb][e];
                const float pv = exp2_(FOLD ? fmaf(x, scale2, -m_use) : x - m_use);
                s[nb][e] = pv;
                row_sum[r] += pv;
            }
    }
}

/* the sm90 forwards' step (CAP off or on): the masked form on edge tiles only, folded without a
 * softcap, with lazy rescaling */
template <int BN, Cap CAP>
__device__ __forceinline__ void softmax_scores(const kparams &p, float (&s)[BN / 8][4], float (&row_max)[2],
                                               float (&row_sum)[2], float (&alpha)[2], const long long (&rows)[2],
                                               long long j0, bool edge, int t4, float scale2) {
    static_assert(CAP != Cap::per_call, "the sm80 forwards call softmax_step");
    constexpr bool fold = CAP == Cap::off;
    edge_form<CAP>(edge, [&](auto edge_c) {
        softmax_scores_as<BN, CAP, fold, decltype(edge_c), true>(p, s, row_max, row_sum, alpha, rows, j0, edge_c, t4, scale2);
    });
}

/* the NA output fragments of a thread's two rows times alpha (from softmax_scores) */
template <int NA> __device__ __forceinline__ void rescale(float (&acc)[NA][4], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < NA; i++) acc[i][0] *= alpha[0], acc[i][1] *= alpha[0], acc[i][2] *= alpha[1], acc[i][3] *= alpha[1];
}

/* rescale() after softmax_scores, skipped where no row of the warp moved its max (with
 * kLazyRescale, most tiles); the vote keeps the branch uniform in the warp */
template <int NA> __device__ __forceinline__ void rescale_lazy(float (&acc)[NA][4], const float (&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) rescale<NA>(acc, alpha);
}

/* both of the above, for the kernels that rescale at once */
template <int BN, int NA>
__device__ __forceinline__ void softmax_step(const kparams &p, float (&s)[BN / 8][4], float (&acc)[NA][4],
                                             float (&row_max)[2], float (&row_sum)[2], const long long (&rows)[2],
                                             long long j0, bool edge, int t4, float scale2) {
    float alpha[2];
    softmax_scores_as<BN, Cap::per_call, false>(p, s, row_max, row_sum, alpha, rows, j0, edge_at_run_time{edge}, t4, scale2);
    rescale<NA>(acc, alpha);
}

/* a row's softmax sum over the four threads of its quad (each holds a quarter of its columns) */
__device__ __forceinline__ float quad_sum(float l) {
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    return l + __shfl_xor_sync(0xffffffffu, l, 2);
}
/* a row's lse from its running max (log₂ units) and sum; -inf for a row that sees no key */
__device__ __forceinline__ float row_lse(float m, float l, bool sees) { return sees ? m * kLn2 + logf(l) : -INFINITY; }

/* The forward's epilogue, shared by both kernels: O = acc / row sum (NA fragments of 8 columns from
 * column col0) and lse (written by the warp that holds column 0), for the thread's two rows. */
template <typename T, int NA>
__device__ __forceinline__ void store_rows(const kparams &p, const float (&acc)[NA][4], const float (&row_max)[2],
                                           const float (&row_sum)[2], const long long (&rows)[2], long long b,
                                           long long h, int t4, int col0 = 0) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float l = quad_sum(row_sum[r]);
        if (rows[r] >= p.Nq) continue;
        /* a row that sees keys divides even when l is 0 or NaN (scores all -inf, a NaN among them):
         * softmax's NaN, as a dense computation gives, not an empty row's 0 */
        const bool sees = wa_row_sees_keys(&p.win, rows[r]);
        const float inv = sees ? 1.0f / l : 0.0f;
        T *orow = row_of<T>(p.o, b, h, rows[r]);
#pragma unroll
        for (int i = 0; i < NA; i++)
            *(uint32_t *)(orow + col0 + i * 8 + 2 * t4) = pack2<T>(acc[i][2 * r] * inv, acc[i][2 * r + 1] * inv);
        if (p.lse.data && t4 == 0 && col0 == 0)
            *row_of<float>(p.lse, b, h, rows[r]) = row_lse(row_max[r], l, sees);
    }
}

/* an accumulator of blocks of 8-column fragments set to 0 */
template <int A, int B> __device__ __forceinline__ void zero_frags(float (&x)[A][B][4]) {
#pragma unroll
    for (int a = 0; a < A; a++)
#pragma unroll
        for (int b = 0; b < B; b++) x[a][b][0] = x[a][b][1] = x[a][b][2] = x[a][b][3] = 0.0f;
}
/* an accumulator of blocks of 8-column fragments times f (the softmax scale, which the by-rows dK/dV
 * kernels and the dQ kernel leave out of dS) */
template <int A, int B> __device__ __forceinline__ void scale_frags(float (&x)[A][B][4], float f) {
#pragma unroll
    for (int a = 0; a < A; a++)
#pragma unroll
        for (int b = 0; b < B; b++)
#pragma unroll
            for (int e = 0; e < 4; e++) x[a][b][e] *= f;
}

/* a 16-row × N tile of f32 accumulator fragments (P or dS), rounded to the dtype, as the A
 * operands of N/16 k steps: two adjacent 8-column fragments are one 16-column A fragment */
template <typename T, int N> __device__ __forceinline__ void pack_a(uint32_t (&a)[N / 16][4], const float (&s)[N / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < N / 16; kk++) {
        a[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]), a[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
        a[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]), a[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

/* accumulator fragments of a thread's two rows, rounded to the dtype, into rows < limit of head
 * (b, h) of t from column col0 (no normalisation: the gradients' epilogue) */
template <typename T, int NA>
__device__ __forceinline__ void store_frag_rows(const dev_tensor &t, const float (&acc)[NA][4], const long long (&rows)[2],
                                                long long limit, long long b, long long h, int t4, int col0 = 0) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (rows[r] >= limit) continue;
        T *row = row_of<T>(t, b, h, rows[r]) + col0;
#pragma unroll
        for (int i = 0; i < NA; i++) *(uint32_t *)(row + i * 8 + 2 * t4) = pack2<T>(acc[i][2 * r], acc[i][2 * r + 1]);
    }
}

/* ---- backward pieces of the mma.sync kernels (sm80/bwd.cu, sm80/bwd_d512.cu) ---- */

/* a varlen call's packed tensors and workspace seen as one rectangular batch entry of Tq rows (the
 * host side of the kernels that need no sequence boundaries: dq_rows_convert_kernel) */
static inline kparams varlen_rows(const kparams &kp) {
    kparams c = kp;
    c.B = 1, c.Nq = c.win.Nq = kp.Tq, c.Nk = c.win.Nk = kp.Tk;
    c.cu_q = c.cu_k = nullptr;
    return c;
}

/* lse and δ of query rows [i0, i0 + BM) of head (b, h) into shared memory (threads 0..2 BM - 1,
 * one value each; rows past Nq read as 0), for the backward kernels that keep them per tile */
template <int BM, bool VARLEN>
__device__ __forceinline__ void load_row_stats(float *lse_dst, float *delta_dst, const kparams &p, long long b, long long h,
                                               long long i0) {
    const int r = threadIdx.x;
    if (r < BM) {
        const bool ok = i0 + r < p.Nq;
        cp_async4(smem_u32(lse_dst + r), row_of<float>(p.lse, b, h, ok ? i0 + r : 0), ok);
    } else if (r < 2 * BM) {
        const bool ok = i0 + r - BM < p.Nq;
        cp_async4(smem_u32(delta_dst + r - BM), p.delta + ws_head<VARLEN>(p, b, h, p.Nq) + (ok ? i0 + r - BM : 0), ok);
    }
}

/* δ_i = dO_i · O_i as the diagonal of a 16x16 tensor-core product, with the k steps in the same
 * order as dP = dO Vᵀ in the dK/dV and dQ kernels. When a row sees one key, O_i = V_j bitwise, so
 * dP_ij and δ_i are the same rounded number and dS = 0 exactly, as in exact arithmetic (the
 * parity sweep's window-1 cases need dq = dk = 0 to rounding of the inputs alone). At D = 512 the
 * gradient kernels (sm80/bwd_d512.cu) form dP as two chains over the halves of D, added at the end; so
 * does this one (dp_halves). */
template <int D> __host__ __device__ constexpr int dp_halves() { return D > 256 ? 2 : 1; }
template <typename T, int D, bool VARLEN> __global__ void __launch_bounds__(128) delta_mma_kernel(const kparams kp) {
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const long long h = blockIdx.y, b = sv.b(), i0 = ((long long)blockIdx.x * 4 + warp) * 16;
    if (i0 >= p.Nq) return; /* no barrier in this kernel: each warp leaves on its own */
    const long long r0 = i0 + g, r1 = i0 + g + 8;
    const bool ok0 = r0 < p.Nq, ok1 = r1 < p.Nq;
    const uint32_t *go0 = (const uint32_t *)row_of<T>(p.dout, b, h, ok0 ? r0 : i0);
    const uint32_t *go1 = (const uint32_t *)row_of<T>(p.dout, b, h, ok1 ? r1 : i0);
    const uint32_t *o0 = (const uint32_t *)row_of<T>(p.o, b, h, ok0 ? r0 : i0);
    const uint32_t *o1 = (const uint32_t *)row_of<T>(p.o, b, h, ok1 ? r1 : i0);
    constexpr int HALVES = dp_halves<D>(), KH = D / 16 / HALVES;
    float c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};
#pragma unroll
    for (int hf = 0; hf < HALVES; hf++) {
        float h0[4] = {0, 0, 0, 0}, h1[4] = {0, 0, 0, 0};
#pragma unroll 4
        for (int ks = hf * KH; ks < (hf + 1) * KH; ks++) {
            const int w = ks * 8 + t4; /* 32-bit word of columns 16 ks + 2 t4, +1 */
            uint32_t a[4] = {ok0 ? go0[w] : 0u, ok1 ? go1[w] : 0u, ok0 ? go0[w + 4] : 0u, ok1 ? go1[w + 4] : 0u};
            mma<T>(h0, a, ok0 ? o0[w] : 0u, ok0 ? o0[w + 4] : 0u);
            mma<T>(h1, a, ok1 ? o1[w] : 0u, ok1 ? o1[w + 4] : 0u);
        }
        if (hf == 0) { /* a single chain is used as it is (0 + x would turn -0 into +0) */
#pragma unroll
            for (int e = 0; e < 4; e++) c0[e] = h0[e], c1[e] = h1[e];
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++) c0[e] += h0[e], c1[e] += h1[e];
        }
    }
    /* element (g, g) sits in lane (g, g/2), slot g&1 of block 0; (g+8, g+8) in slot 2 + (g&1) of block 1 */
    if (t4 == (g >> 1)) {
        float *drow = p.delta + ws_head<VARLEN>(p, b, h, p.Nq);
        if (ok0) drow[r0] = c0[g & 1];
        if (ok1) drow[r1] = c1[2 + (g & 1)];
    }
}

/* the keys query row i sees, [lo, hi], for the backward kernels that keep P and dS in shared
 * memory: a padded row past Nq sees none (its P and dS must be 0: they enter dK and dV). Only read
 * on edge tiles (lo = hi = 0 otherwise). */
__device__ __forceinline__ void row_visible_keys(const kparams &p, long long i, bool edge, long long &lo, long long &hi) {
    lo = 0, hi = 0;
    if (!edge) return;
    lo = wa_row_first_key(&p.win, i), hi = wa_row_last_key(&p.win, i);
    if (i >= p.Nq) lo = 1, hi = 0;
}

/* P and dS (dS with respect to the raw q·k, scale and softcap derivative included) of one
 * accumulator element, or 0 and 0 when masked */
__device__ __forceinline__ void grads_of(const kparams &p, float sacc, float dpacc, float lse2, float delta, float scale2,
                                         bool visible, float &pv, float &ds) {
    if (!visible) {
        pv = 0.0f, ds = 0.0f;
        return;
    }
    if (p.softcap > 0.0f) {
        float t = tanhf(sacc * p.scale / p.softcap);
        pv = exp2_(p.softcap * t * kLog2e - lse2);
        ds = pv * (dpacc - delta) * (1.0f - t * t) * p.scale;
    } else {
        pv = exp2_(sacc * scale2 - lse2);
        ds = pv * (dpacc - delta) * p.scale;
    }
}

/* dq = the f32 accumulator [B, Hq, Nq, D] rounded to the dtype (the sm80 atomic dQ, and the sm90
 * fused dQ of a varlen call; the rectangular sm90 one is in fragment order and has its own). A varlen call's
 * accumulator is [Hq, Tq, D] (every kernel's): it runs with B = 1, Nq = Tq (varlen_rows below).
 * SCALED: times the softmax scale, which the kernel that added into it left out of dS. */
template <typename T, bool SCALED> __global__ void dq_rows_convert_kernel(kparams p) {
    const long long total = p.B * p.Hq * p.Nq * (p.D / 2);
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
        const long long pair = e % (p.D / 2), row = e / (p.D / 2), i = row % p.Nq, bh = row / p.Nq;
        const float2 v = *(const float2 *)(p.dq_acc + row * p.D + 2 * pair);
        const float f = SCALED ? p.scale : 1.0f;
        *(uint32_t *)(row_of<T>(p.dq, bh / p.Hq, bh % p.Hq, i) + 2 * pair) = pack2<T>(v.x * f, v.y * f);
    }
}

#include "wgmma_ops.cuh"

/* shared-memory matrix descriptor: 128-byte swizzle, 8-row groups 1024 bytes apart (SBO); the
 * leading offset is unused because every wgmma here stays inside one 64-value column block */
__device__ __forceinline__ uint64_t gmma_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}
/* the same for an MN-major operand wider than one column block (wgmma with N > 64 reading V, K,
 * Q or dO transposed): lbo is the byte distance between consecutive 64-value column blocks */
__device__ __forceinline__ uint64_t gmma_desc_mn(uint32_t addr, uint32_t lbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}
/* desc (from gmma_desc or gmma_desc_mn) moved `bytes` further into shared memory: the address
 * field is the low 14 bits of the low word and a shared address stays below 256 KB, so one 32-bit
 * add does it. A loop forms one descriptor per operand and tile and adds the constant offsets of
 * its k steps, instead of masking and shifting a new address before every wgmma (eight
 * instructions each, per wgmma). */
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, uint32_t bytes) {
    uint32_t lo, hi;
    asm("mov.b64 {%0, %1}, %2;" : "=r"(lo), "=r"(hi) : "l"(desc));
    lo += bytes >> 4;
    asm("mov.b64 %0, {%1, %2};" : "=l"(desc) : "r"(lo), "r"(hi));
    return desc;
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
/* wait until at most N of this warpgroup's committed groups are still running (they finish in order) */
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
/* pins registers in program order around the asynchronous wgmma (the compiler cannot see that the
 * accumulators change until the wait, nor that A fragments must exist before the fence) */
template <int A> __device__ __forceinline__ void reg_fence(float (&x)[A][4]) {
#pragma unroll
    for (int i = 0; i < A; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(x[i][e])::"memory");
}
template <int A, int B> __device__ __forceinline__ void reg_fence(float (&x)[A][B][4]) {
#pragma unroll
    for (int a = 0; a < A; a++) reg_fence(x[a]);
}
template <int A> __device__ __forceinline__ void reg_fence(uint32_t (&x)[A][4]) {
#pragma unroll
    for (int i = 0; i < A; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+r"(x[i][e])::"memory");
}
/* cp.async wrote through the generic proxy; wgmma reads through the async proxy */
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* the f32 accumulator of the sm80 atomic dQ ([B, Hq, Nq, D], or [Hq, Tq, D]
 * varlen) set to 0, and rounded into dq once every add is in */
static wa_status zero_dq_rows(const kparams &kp, cudaStream_t s) {
    const kparams c = kp.cu_q ? varlen_rows(kp) : kp;
    CUDA_TRY(cudaMemsetAsync(kp.dq_acc, 0, (size_t)(c.B * c.Hq * c.Nq * c.D) * sizeof(float), s));
    return WA_OK;
}
/* SCALED: the accumulator holds Σ dS K without the softmax scale, which the rounding applies
 * (the sm90 by-rows dK/dV kernels) */
template <typename T, bool SCALED = false> static wa_status convert_dq_rows(const kparams &kp, cudaStream_t s) {
    dq_rows_convert_kernel<T, SCALED><<<1024, 256, 0, s>>>(kp.cu_q ? varlen_rows(kp) : kp);
    CUDA_TRY(cudaGetLastError());
    return WA_OK;
}

/* The dynamic shared-memory limit of each kernel is set once per device (bit `dev` of *done; a
 * device from 64 on every call: the attribute belongs to the kernel as loaded on the device), to its
 * one fixed size (different sizes per launch race between host threads: see portable/attn.cu). */
template <typename K> static cudaError_t raise_once(K kernel, size_t bytes, volatile unsigned long long *done) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    const unsigned long long bit = dev < 64 ? 1ull << dev : 0;
    if (*done & bit) return cudaSuccess;
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (e == cudaSuccess) *done |= bit; /* a racing thread's bit lost here costs it one more set */
    return e;
}

} /* namespace */

#endif /* WA_CUDA_MMA_PRIMS_CUH */

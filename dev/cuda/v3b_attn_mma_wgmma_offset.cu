/* attn_mma.cu — the CUDA backend, version 2: tensor-core kernels for f16 and bf16 at
 * D = 64, 128 and 256 (FlashAttention-2's scheme, written for this library's window geometry).
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
 *   dQ        one CTA per query tile owning its dQ (as version 1: no atomics, deterministic).
 *
 * Masks and tile ranges come from tile_geometry.h only: a tile pair is masked element-wise when
 * wa_tile_needs_mask() says so or when it is ragged (the last tile of a sequence), where padded
 * rows and columns were zero-filled by cp.async and are masked out.
 */
#include "common.cuh"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* 2^x as the bare MUFU instruction (flushes denormal results to 0, which P never needs): 3-8 %
 * faster than exp2f in the lab (dev/cuda/README.md); -DWA_EXP2F restores exp2f */
__device__ __forceinline__ float exp2_(float x) {
#ifndef WA_EXP2F
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
#endif
}

/* ---- shared-memory tiles ---- */

/* byte offset of 16-byte chunk c of row r in a swizzled tile whose rows hold W 16-bit values */
template <int W> __device__ __forceinline__ uint32_t swz(int r, int c) { return (uint32_t)(r * (W * 2) + ((c ^ (r & 7)) << 4)); }

/* rows [row0, row0 + ROWS) of head (b, h) into a swizzled tile; rows at or past `limit` become 0
 * (a ragged last tile must not feed stale or NaN bytes into the products) */
template <typename T, int D, int ROWS, int NT>
__device__ __forceinline__ void load_tile(uint32_t dst, const dev_tensor &t, long long b, long long h, long long row0,
                                          long long limit) {
    constexpr int CH = D / 8;
    static_assert(ROWS * CH % NT == 0, "every thread moves the same number of chunks");
    const T *base = row_of<T>(t, b, h, 0);
#pragma unroll
    for (int k = 0; k < ROWS * CH / NT; k++) {
        const int e = threadIdx.x + k * NT, r = e / CH, c = e % CH;
        const bool ok = row0 + r < limit;
        cp_async16(dst + swz<D>(r, c), base + (ok ? row0 + r : 0) * t.s2 + c * 8, ok);
    }
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

/* the scores of one accumulator element in log2 units (softcapped if asked) */
__device__ __forceinline__ float score2(const kparams &p, float acc, float scale2) {
    if (p.softcap > 0.0f) return p.softcap * tanhf(acc * p.scale / p.softcap) * kLog2e;
    return acc * scale2;
}

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
constexpr int kFwdBM = 128, kFwdThreads = 256;
template <int D> __host__ __device__ constexpr int fwd_bn() { return D == 64 ? WA_FWD_BN_64 : D == 128 ? WA_FWD_BN_128 : WA_FWD_BN_256; }

template <int D> constexpr size_t fwd_smem_bytes() { return (size_t)2 * (kFwdBM * D + 4 * fwd_bn<D>() * D); }

template <typename T, int D> __global__ void __launch_bounds__(kFwdThreads, 1) fwd_mma_kernel(kparams p) {
    constexpr int BM = kFwdBM, BN = fwd_bn<D>(), NT = kFwdThreads, KS = D / 16;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ = smem_u32(smem), sK = sQ + BM * D * 2, sV = sK + 2 * BN * D * 2;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const long long h = blockIdx.y, b = blockIdx.z, hk = h / p.group, i0 = (long long)blockIdx.x * BM;
    const int m = (int)min((long long)BM, p.Nq - i0), qrow = warp * 16;
    int64_t kt0, kt1;
    wa_key_tiles_for_rows(&p.win, i0, i0 + m, BN, &kt0, &kt1);

    load_tile<T, D, BM, NT>(sQ, p.q, b, h, i0, p.Nq);
    if (kt0 < kt1) {
        load_tile<T, D, BN, NT>(sK, p.k, b, hk, kt0 * BN, p.Nk);
        load_tile<T, D, BN, NT>(sV, p.v, b, hk, kt0 * BN, p.Nk);
    }
    cp_async_commit();

    float acc[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
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
        for (int ks = 0; ks < KS; ks++) {
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

        const long long j0 = kt * BN;
        const int n = (int)min((long long)BN, p.Nk - j0);
        const bool edge = n < BN || wa_tile_needs_mask(&p.win, i0, i0 + m, j0, j0 + n);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            long long lo = 0, hi = 0;
            if (edge) lo = wa_row_first_key(&p.win, rows[r]), hi = wa_row_last_key(&p.win, rows[r]);
            float mx = -INFINITY;
#pragma unroll
            for (int nb = 0; nb < BN / 8; nb++)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; e++) {
                    float x = score2(p, s[nb][e], scale2);
                    if (edge) {
                        long long j = j0 + nb * 8 + 2 * t4 + (e & 1);
                        if (j < lo || j > hi) x = -INFINITY;
                    }
                    s[nb][e] = x;
                    mx = fmaxf(mx, x);
                }
            /* the four lanes of a quad hold one row */
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(row_max[r], mx);
            const float m_use = m_new == -INFINITY ? 0.0f : m_new; /* a row with nothing visible yet stays 0 */
            const float alpha = exp2_(row_max[r] - m_use);
            row_max[r] = m_new;
            row_sum[r] *= alpha;
#pragma unroll
            for (int i = 0; i < D / 8; i++) acc[i][2 * r] *= alpha, acc[i][2 * r + 1] *= alpha;
#pragma unroll
            for (int nb = 0; nb < BN / 8; nb++)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; e++) {
                    float pv = exp2_(s[nb][e] - m_use);
                    s[nb][e] = pv;
                    row_sum[r] += pv;
                }
        }

        /* O += P V: the S accumulator layout of two adjacent n blocks is the A layout of one k step */
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int nd = 0; nd < D / 16; nd++) {
                uint32_t bb[4];
                load_b_kn<D>(bb, v_s, kk * 16, nd, lane);
                mma<T>(acc[2 * nd], a, bb[0], bb[1]);
                mma<T>(acc[2 * nd + 1], a, bb[2], bb[3]);
            }
        }
        __syncthreads(); /* every warp is done with this stage before the next prefetch overwrites it */
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; r++) {
        float l = row_sum[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (rows[r] >= p.Nq) continue;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        T *orow = row_of<T>(p.o, b, h, rows[r]);
#pragma unroll
        for (int i = 0; i < D / 8; i++)
            *(uint32_t *)(orow + i * 8 + 2 * t4) = pack2<T>(acc[i][2 * r] * inv, acc[i][2 * r + 1] * inv);
        if (p.lse.data && t4 == 0)
            *row_of<float>(p.lse, b, h, rows[r]) = l > 0.0f ? row_max[r] * kLn2 + logf(l) : -INFINITY;
    }
}


/* ---- forward on wgmma (Hopper warpgroup MMA) ---- */

#include "wgmma_ops.cuh"

/* Tiles for wgmma are stored in column blocks of 64 values (128-byte rows), each block R rows deep
 * and 1024-byte aligned, with the 128-byte swizzle the hardware applies (16-byte chunk c of row r
 * at c ^ (r % 8)). The K-major operands (Q, K) and the MN-major V (read transposed) use the same
 * layout, and so would ldmatrix. c counts 16-byte chunks along the whole row of D values. */
template <int R> __device__ __forceinline__ uint32_t blk_off(int r, int c) {
    return (uint32_t)((c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

template <typename T, int D, int ROWS, int NT>
__device__ __forceinline__ void load_tile_blk(uint32_t dst, const dev_tensor &t, long long b, long long h, long long row0,
                                              long long limit) {
    constexpr int CH = D / 8;
    static_assert(ROWS * CH % NT == 0, "every thread moves the same number of chunks");
    const T *base = row_of<T>(t, b, h, 0);
#pragma unroll
    for (int k = 0; k < ROWS * CH / NT; k++) {
        const int e = threadIdx.x + k * NT, r = e / CH, c = e % CH;
        const bool ok = row0 + r < limit;
        cp_async16(dst + blk_off<ROWS>(r, c), base + (ok ? row0 + r : 0) * t.s2 + c * 8, ok);
    }
}

/* shared-memory matrix descriptor: 128-byte swizzle, 8-row groups 1024 bytes apart (SBO); the
 * leading offset is unused because every wgmma here stays inside one 64-value column block */
__device__ __forceinline__ uint64_t gmma_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
/* pins registers in program order around the asynchronous wgmma (the compiler cannot see that the
 * accumulators change until the wait, nor that A fragments must exist before the fence) */
template <int A> __device__ __forceinline__ void reg_fence(float (&x)[A][4]) {
#pragma unroll
    for (int i = 0; i < A; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(x[i][e])::"memory");
}
template <int A> __device__ __forceinline__ void reg_fence(uint32_t (&x)[A][4]) {
#pragma unroll
    for (int i = 0; i < A; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+r"(x[i][e])::"memory");
}
/* cp.async wrote through the generic proxy; wgmma reads through the async proxy */
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#ifndef WA_WG_BN_128
#define WA_WG_BN_128 64
#endif
/* head dims from this one up take the wgmma forward; smaller ones the mma.sync forward, which
 * measured faster at D = 64 and 128 (dev/cuda/README.md) */
#ifndef WA_WGMMA_MIN_D
#define WA_WGMMA_MIN_D 256
#endif
template <int D> __host__ __device__ constexpr int wg_bn() { return D == 256 ? 64 : D == 128 ? WA_WG_BN_128 : 128; }
constexpr int kWgBM = 128, kWgThreads = 256, kWgKStages = 2, kWgVStages = 3;
template <int D> constexpr size_t wg_smem_bytes() {
    return 1024 + (size_t)2 * (kWgBM * D + (kWgKStages + kWgVStages) * wg_bn<D>() * D);
}

/* Same algorithm and register layout as fwd_mma_kernel (each warp's 16 rows sit in the same
 * accumulator positions), with S = Q Kᵀ as one chain of wgmma reading Q and K from shared memory
 * and O += P V with P from registers, one warpgroup per 64 query rows.
 *
 * The two warpgroups run half a tile apart so that one's softmax overlaps the other's matrix
 * products (with both in step, the tensor cores idled during every softmax: v3a in
 * dev/cuda/README.md). Phase t, between barriers B_t and B_t+1:
 *   warpgroup 0:  S(t), softmax(t), O += P(t) V(t)
 *   warpgroup 1:  softmax(t-1), O += P(t-1) V(t-1), S(t)
 * so V(t) is read until B_t+2: V has three stages, K two. Each barrier also publishes the tile
 * whose copies every thread waited for just before it. */
template <typename T, int D> __global__ void __launch_bounds__(kWgThreads, 1) fwd_wgmma_kernel(kparams p) {
    constexpr int BM = kWgBM, BN = wg_bn<D>(), NT = kWgThreads, KS = D / 16, DB = D / 64;
    constexpr uint32_t TILE = BN * D * 2;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ = (smem_u32(smem) + 1023u) & ~1023u, sK = sQ + BM * D * 2, sV = sK + kWgKStages * TILE;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, wg = warp >> 2;
    const long long h = blockIdx.y, b = blockIdx.z, hk = h / p.group, i0 = (long long)blockIdx.x * BM;
    const int m = (int)min((long long)BM, p.Nq - i0);
    int64_t kt0, kt1;
    wa_key_tiles_for_rows(&p.win, i0, i0 + m, BN, &kt0, &kt1);
    auto k_stage = [&](long long kt) { return sK + (uint32_t)((kt - kt0) % kWgKStages) * TILE; };
    auto v_stage = [&](long long kt) { return sV + (uint32_t)((kt - kt0) % kWgVStages) * TILE; };

    load_tile_blk<T, D, BM, NT>(sQ, p.q, b, h, i0, p.Nq);
    if (kt0 < kt1) {
        load_tile_blk<T, D, BN, NT>(k_stage(kt0), p.k, b, hk, kt0 * BN, p.Nk);
        load_tile_blk<T, D, BN, NT>(v_stage(kt0), p.v, b, hk, kt0 * BN, p.Nk);
    }
    cp_async_commit();

    float acc[DB][8][4], s[BN / 8][4];
#pragma unroll
    for (int c = 0; c < DB; c++)
#pragma unroll
        for (int i = 0; i < 8; i++) acc[c][i][0] = acc[c][i][1] = acc[c][i][2] = acc[c][i][3] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
    const long long rows[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
    const float scale2 = p.scale * kLog2e;

    auto scores = [&](long long kt) { /* s = Q K(kt)ᵀ for this warpgroup's 64 rows */
        const uint32_t k_s = k_stage(kt);
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
    };

    auto softmax_pv = [&](long long kt) { /* online softmax of s, then O += P V(kt) */
        const long long j0 = kt * BN;
        const int n = (int)min((long long)BN, p.Nk - j0);
        const bool edge = n < BN || wa_tile_needs_mask(&p.win, i0, i0 + m, j0, j0 + n);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            long long lo = 0, hi = 0;
            if (edge) lo = wa_row_first_key(&p.win, rows[r]), hi = wa_row_last_key(&p.win, rows[r]);
            float mx = -INFINITY;
#pragma unroll
            for (int nb = 0; nb < BN / 8; nb++)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; e++) {
                    float x = score2(p, s[nb][e], scale2);
                    if (edge) {
                        long long j = j0 + nb * 8 + 2 * t4 + (e & 1);
                        if (j < lo || j > hi) x = -INFINITY;
                    }
                    s[nb][e] = x;
                    mx = fmaxf(mx, x);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(row_max[r], mx);
            const float m_use = m_new == -INFINITY ? 0.0f : m_new;
            const float alpha = exp2_(row_max[r] - m_use);
            row_max[r] = m_new;
            row_sum[r] *= alpha;
#pragma unroll
            for (int c = 0; c < DB; c++)
#pragma unroll
                for (int i = 0; i < 8; i++) acc[c][i][2 * r] *= alpha, acc[c][i][2 * r + 1] *= alpha;
#pragma unroll
            for (int nb = 0; nb < BN / 8; nb++)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; e++) {
                    float pv = exp2_(s[nb][e] - m_use);
                    s[nb][e] = pv;
                    row_sum[r] += pv;
                }
        }
        uint32_t pa[BN / 16][4];
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            pa[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]), pa[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
            pa[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pa[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
        reg_fence(pa);
#pragma unroll
        for (int c = 0; c < DB; c++) reg_fence(acc[c]);
        wg_fence();
        const uint32_t v_s = v_stage(kt);
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
            for (int c = 0; c < DB; c++) wgmma_rs_t<T, 64>(acc[c], pa[kk], gmma_desc(v_s + c * (BN * 128) + kk * (16 * 128)), 1);
        wg_commit();
        wg_wait_all();
#pragma unroll
        for (int c = 0; c < DB; c++) reg_fence(acc[c]);
    };

    for (long long t = kt0; t <= kt1; t++) {
        cp_async_wait<0>(); /* this thread's copies of tile t landed ... */
        fence_proxy_async();
        __syncthreads(); /* ... and everyone's; stages K(t-1) and V(t-2) are released */
        if (t + 1 < kt1) {
            load_tile_blk<T, D, BN, NT>(k_stage(t + 1), p.k, b, hk, (t + 1) * BN, p.Nk);
            load_tile_blk<T, D, BN, NT>(v_stage(t + 1), p.v, b, hk, (t + 1) * BN, p.Nk);
        }
        cp_async_commit();
        if (wg == 0) {
            if (t < kt1) scores(t), softmax_pv(t);
        } else {
            if (t > kt0) softmax_pv(t - 1);
            if (t < kt1) scores(t);
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; r++) {
        float l = row_sum[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (rows[r] >= p.Nq) continue;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        T *orow = row_of<T>(p.o, b, h, rows[r]);
#pragma unroll
        for (int c = 0; c < DB; c++)
#pragma unroll
            for (int i = 0; i < 8; i++)
                *(uint32_t *)(orow + c * 64 + i * 8 + 2 * t4) = pack2<T>(acc[c][i][2 * r] * inv, acc[c][i][2 * r + 1] * inv);
        if (p.lse.data && t4 == 0)
            *row_of<float>(p.lse, b, h, rows[r]) = l > 0.0f ? row_max[r] * kLn2 + logf(l) : -INFINITY;
    }
}

/* ---- backward ---- */

/* δ_i = dO_i · O_i as the diagonal of a 16x16 tensor-core product, with the k steps in the same
 * order as dP = dO Vᵀ in the dK/dV and dQ kernels. When a row sees one key, O_i = V_j bitwise, so
 * dP_ij and δ_i are the same rounded number and dS = 0 exactly, as in exact arithmetic (the
 * parity sweep's window-1 cases need dq = dk = 0 to rounding of the inputs alone). */
template <typename T, int D> __global__ void __launch_bounds__(128) delta_mma_kernel(kparams p) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const long long h = blockIdx.y, b = blockIdx.z, i0 = ((long long)blockIdx.x * 4 + warp) * 16;
    if (i0 >= p.Nq) return;
    const long long r0 = i0 + g, r1 = i0 + g + 8;
    const bool ok0 = r0 < p.Nq, ok1 = r1 < p.Nq;
    const uint32_t *go0 = (const uint32_t *)row_of<T>(p.dout, b, h, ok0 ? r0 : i0);
    const uint32_t *go1 = (const uint32_t *)row_of<T>(p.dout, b, h, ok1 ? r1 : i0);
    const uint32_t *o0 = (const uint32_t *)row_of<T>(p.o, b, h, ok0 ? r0 : i0);
    const uint32_t *o1 = (const uint32_t *)row_of<T>(p.o, b, h, ok1 ? r1 : i0);
    float c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};
#pragma unroll 4
    for (int ks = 0; ks < D / 16; ks++) {
        const int w = ks * 8 + t4; /* 32-bit word of columns 16 ks + 2 t4, +1 */
        uint32_t a[4] = {ok0 ? go0[w] : 0u, ok1 ? go1[w] : 0u, ok0 ? go0[w + 4] : 0u, ok1 ? go1[w + 4] : 0u};
        mma<T>(c0, a, ok0 ? o0[w] : 0u, ok0 ? o0[w + 4] : 0u);
        mma<T>(c1, a, ok1 ? o1[w] : 0u, ok1 ? o1[w + 4] : 0u);
    }
    /* element (g, g) sits in lane (g, g/2), slot g&1 of block 0; (g+8, g+8) in slot 2 + (g&1) of block 1 */
    if (t4 == (g >> 1)) {
        float *drow = p.delta + (b * p.Hq + h) * p.Nq;
        if (ok0) drow[r0] = c0[g & 1];
        if (ok1) drow[r1] = c1[2 + (g & 1)];
    }
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

constexpr int kBwdBN = 64, kBwdBM = 64, kBwdThreads = 256;

template <int D> constexpr size_t dkdv_smem_bytes() {
    return (size_t)2 * (2 * kBwdBN * D + 4 * kBwdBM * D + 2 * kBwdBM * kBwdBN) + (size_t)4 * 4 * kBwdBM;
}

/* owner of dK, dV for keys [j0, j0 + 64) of kv head hk; with ATOMIC_DQ it also adds this key
 * tile's share of dQ = dS K into the f32 accumulator p.dq_acc (the fast, non-reproducible option) */
template <typename T, int D, bool ATOMIC_DQ> __global__ void __launch_bounds__(kBwdThreads, 1) dkdv_mma_kernel(kparams p) {
    constexpr int BN = kBwdBN, BM = kBwdBM, NT = kBwdThreads, KS = D / 16, DH = D / 2;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sK = smem_u32(smem), sV = sK + BN * D * 2, sQ = sV + BN * D * 2, sdO = sQ + 2 * BM * D * 2;
    const uint32_t sP = sdO + 2 * BM * D * 2, sdS = sP + BM * BN * 2;
    float *stats = (float *)(smem + (size_t)2 * (2 * BN * D + 4 * BM * D + 2 * BM * BN)); /* lse[2][BM], delta[2][BM] */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int qg = warp & 3, kh = warp >> 2; /* pair phase: 16 queries x 32 keys per warp */
    const int kg = warp & 3, dh = warp >> 2; /* gradient phase: 16 keys x D/2 columns per warp */
    const long long hk = blockIdx.y, b = blockIdx.z, j0 = (long long)blockIdx.x * BN;
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
        const int r = threadIdx.x;
        if (r < BM) {
            const bool ok = i0 + r < p.Nq;
            cp_async4(smem_u32(stats + stage * BM + r), row_of<float>(p.lse, b, h, ok ? i0 + r : 0), ok);
        } else if (r < 2 * BM) {
            const bool ok = i0 + r - BM < p.Nq;
            cp_async4(smem_u32(stats + 2 * BM + stage * BM + r - BM), p.delta + (b * p.Hq + h) * p.Nq + (ok ? i0 + r - BM : 0), ok);
        }
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
            long long lo = 0, hi = 0;
            if (edge) {
                lo = wa_row_first_key(&p.win, i), hi = wa_row_last_key(&p.win, i);
                if (i >= p.Nq) lo = 1, hi = 0;
            }
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
            float *acc_row0 = p.dq_acc + ((b * p.Hq + h) * p.Nq + r0) * D, *acc_row1 = acc_row0 + 8 * D;
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
                    if (r0 < p.Nq) atomicAdd((float2 *)(acc_row0 + col), make_float2(dq[i][0], dq[i][1]));
                    if (r0 + 8 < p.Nq) atomicAdd((float2 *)(acc_row1 + col), make_float2(dq[i][2], dq[i][3]));
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

template <typename T, int D> __global__ void __launch_bounds__(32 * kDqWarps, 1) dq_mma_kernel(kparams p) {
    constexpr int WARPS = kDqWarps, BM = 16 * WARPS, BN = dq_bn<D>(), NT = 32 * WARPS, KS = D / 16;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ = smem_u32(smem), sdO = sQ + BM * D * 2, sK = sdO + BM * D * 2, sV = sK + 2 * BN * D * 2;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const long long h = blockIdx.y, b = blockIdx.z, hk = h / p.group, i0 = (long long)blockIdx.x * BM;
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
        delta[r] = ok ? p.delta[(b * p.Hq + h) * p.Nq + rows[r]] : 0.0f;
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

/* dq = the f32 accumulator rounded to the dtype (atomic-dQ option) */
template <typename T> __global__ void dq_convert_kernel(kparams p) {
    const long long total = p.B * p.Hq * p.Nq * (p.D / 2);
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
        const long long pair = e % (p.D / 2), row = e / (p.D / 2), i = row % p.Nq, bh = row / p.Nq;
        const float2 v = *(const float2 *)(p.dq_acc + row * p.D + 2 * pair);
        *(uint32_t *)(row_of<T>(p.dq, bh / p.Hq, bh % p.Hq, i) + 2 * pair) = pack2<T>(v.x, v.y);
    }
}

/* ---- host side ---- */

/* The dynamic shared-memory limit of each kernel is set once, to its one fixed size (different
 * sizes per launch raced between host threads in version 1; see attn_cuda.cu). */
template <typename K> static cudaError_t raise_once(K kernel, size_t bytes, volatile int *done) {
    if (*done) return cudaSuccess;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (e == cudaSuccess) *done = 1;
    return e;
}

template <typename T, int D> static wa_status fwd_wgmma_launch(const kparams &kp, cudaStream_t s) {
    static volatile int done = 0;
    constexpr size_t bytes = wg_smem_bytes<D>();
    CUDA_TRY(raise_once(fwd_wgmma_kernel<T, D>, bytes, &done));
    dim3 grid((unsigned)((kp.Nq + kWgBM - 1) / kWgBM), (unsigned)kp.Hq, (unsigned)kp.B);
    fwd_wgmma_kernel<T, D><<<grid, kWgThreads, bytes, s>>>(kp);
    CUDA_TRY(cudaGetLastError());
    return WA_OK;
}

/* WINATTN_CUDA=mma keeps the forward on the mma.sync kernel (for comparisons in dev/cuda) */
static int forward_on_mma_sync(void) {
    const char *force = getenv("WINATTN_CUDA");
    return force && !strcmp(force, "mma");
}

template <typename T, int D> static wa_status fwd_launch(const kparams &kp, cudaStream_t s) {
    if (D >= WA_WGMMA_MIN_D && !forward_on_mma_sync()) return fwd_wgmma_launch<T, D>(kp, s);
    static volatile int done = 0;
    constexpr size_t bytes = fwd_smem_bytes<D>();
    CUDA_TRY(raise_once(fwd_mma_kernel<T, D>, bytes, &done));
    dim3 grid((unsigned)((kp.Nq + kFwdBM - 1) / kFwdBM), (unsigned)kp.Hq, (unsigned)kp.B);
    fwd_mma_kernel<T, D><<<grid, kFwdThreads, bytes, s>>>(kp);
    CUDA_TRY(cudaGetLastError());
    return WA_OK;
}

template <typename T, int D> static wa_status bwd_launch(const kparams &kp, cudaStream_t s) {
    static volatile int done_kv = 0, done_kva = 0, done_q = 0;
    constexpr size_t kv_bytes = dkdv_smem_bytes<D>(), q_bytes = dq_smem_bytes<D>();
    const bool atomic = kp.dq_acc != nullptr;
    CUDA_TRY(raise_once(dkdv_mma_kernel<T, D, false>, kv_bytes, &done_kv));
    CUDA_TRY(raise_once(dkdv_mma_kernel<T, D, true>, kv_bytes, &done_kva));
    CUDA_TRY(raise_once(dq_mma_kernel<T, D>, q_bytes, &done_q));
    if (atomic) CUDA_TRY(cudaMemsetAsync(kp.dq_acc, 0, (size_t)(kp.B * kp.Hq * kp.Nq * D) * sizeof(float), s));
    const dim3 qgrid((unsigned)((kp.Nq + 63) / 64), (unsigned)kp.Hq, (unsigned)kp.B);
    if (kp.Nq > 0) {
        delta_mma_kernel<T, D><<<qgrid, 128, 0, s>>>(kp);
        CUDA_TRY(cudaGetLastError());
    }
    if (kp.Nk > 0) { /* also when Nq = 0: every key tile then writes dK = dV = 0 */
        const dim3 kgrid((unsigned)((kp.Nk + kBwdBN - 1) / kBwdBN), (unsigned)kp.Hkv, (unsigned)kp.B);
        if (atomic) dkdv_mma_kernel<T, D, true><<<kgrid, kBwdThreads, kv_bytes, s>>>(kp);
        else dkdv_mma_kernel<T, D, false><<<kgrid, kBwdThreads, kv_bytes, s>>>(kp);
        CUDA_TRY(cudaGetLastError());
    }
    constexpr int BM = 16 * kDqWarps;
    if (kp.Nq > 0 && atomic) {
        dq_convert_kernel<T><<<1024, 256, 0, s>>>(kp);
        CUDA_TRY(cudaGetLastError());
    } else if (kp.Nq > 0) {
        dq_mma_kernel<T, D><<<dim3((unsigned)((kp.Nq + BM - 1) / BM), (unsigned)kp.Hq, (unsigned)kp.B), 32 * kDqWarps, q_bytes,
                              s>>>(kp);
        CUDA_TRY(cudaGetLastError());
    }
    return WA_OK;
}

template <typename T> static wa_status fwd_by_dim(const kparams &kp, cudaStream_t s) {
    switch (kp.D) {
    case 64: return fwd_launch<T, 64>(kp, s);
    case 128: return fwd_launch<T, 128>(kp, s);
    case 256: return fwd_launch<T, 256>(kp, s);
    }
    return wa_fail(WA_ERR_UNSUPPORTED, "tensor-core forward: D = %lld", kp.D);
}

template <typename T> static wa_status bwd_by_dim(const kparams &kp, cudaStream_t s) {
    switch (kp.D) {
    case 64: return bwd_launch<T, 64>(kp, s);
    case 128: return bwd_launch<T, 128>(kp, s);
    case 256: return bwd_launch<T, 256>(kp, s);
    }
    return wa_fail(WA_ERR_UNSUPPORTED, "tensor-core backward: D = %lld", kp.D);
}

/* cp.async moves 16-byte chunks and the epilogues store 4-byte pairs */
static int rows_aligned(const wa_tensor *t) {
    if (!t) return 1;
    return ((uintptr_t)t->data % 16) == 0 && t->stride[0] % 8 == 0 && t->stride[1] % 8 == 0 && t->stride[2] % 8 == 0;
}

} /* namespace */

int mma_supports(const wa_problem *p) {
    /* WINATTN_CUDA=v1 keeps every call on version 1 (for comparisons in dev/cuda) */
    const char *force = getenv("WINATTN_CUDA");
    if (force && !strcmp(force, "v1")) return 0;
    if (p->dtype != WA_F16 && p->dtype != WA_BF16) return 0;
    if (p->D != 64 && p->D != 128 && p->D != 256) return 0;
    const wa_tensor *all[9] = {p->q, p->k, p->v, p->o, p->lse, p->do_, p->dq, p->dk, p->dv};
    for (int i = 0; i < 9; i++)
        if (i != 4 && !rows_aligned(all[i])) return 0;
    return 1;
}

wa_status mma_forward(const kparams &kp, wa_dtype dt, cudaStream_t s) {
    return dt == WA_BF16 ? fwd_by_dim<__nv_bfloat16>(kp, s) : fwd_by_dim<__half>(kp, s);
}

wa_status mma_backward(const kparams &kp, wa_dtype dt, cudaStream_t s) {
    return dt == WA_BF16 ? bwd_by_dim<__nv_bfloat16>(kp, s) : bwd_by_dim<__half>(kp, s);
}

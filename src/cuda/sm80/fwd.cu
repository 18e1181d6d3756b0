/* sm80/fwd.cu — the forward on mma.sync for f16 and bf16 at D = 64, 128, 256 and 512
 * (FlashAttention-2's scheme, written for this library's window geometry): the tensor-core forward
 * of GPUs of compute capability 8.x and up, and on Hopper the fallback where neither wgmma forward
 * takes the call (dispatch.cu).
 *
 * One CTA of 8 warps per 128 query rows; each warp owns 16 rows: S = Q Kᵀ in registers, the online
 * softmax in registers (exp2 with the scale folded in), P rounded to the input dtype and fed
 * straight back as the A operand of O += P V. K and V of the next key tile are loaded by cp.async
 * while the current one is multiplied (two stages). At D = 512 two warps share 16 query rows
 * (sm80_fwd_split, traits.cuh): each forms S over one half of D, the pair adds the halves through
 * shared memory (own + other: both get the same bits), both run the same softmax, and each
 * accumulates O for its half of the columns.
 *
 * Shared tiles hold rows of D 16-bit values in 16-byte chunks; chunk c of row r is stored at chunk
 * c ^ (r & 7), so the eight row addresses of one ldmatrix hit eight different bank groups (a row is
 * a multiple of 128 bytes, so unswizzled they would all hit one). Masks and tile ranges come from
 * tile_geometry.h: a tile pair is masked element-wise when wa_tile_needs_mask() says so or when it
 * is ragged (the last tile of a sequence), where cp.async zero-filled the padded rows. */
#include "../prims/mma.cuh"

#include <stdint.h>

namespace {

constexpr int kFwdThreads = kSm80FwdThreads;
template <int D> __host__ __device__ constexpr int fwd_split() { return sm80_fwd_split<D>(); }
template <int D> __host__ __device__ constexpr int fwd_bm() { return sm80_fwd_rows<D>(); }
template <int D> __host__ __device__ constexpr int fwd_bn() { return sm80_fwd_keys<D>(); }
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

/* the rectangular instance (VARLEN false) on a (query tiles, heads, B) grid, or the varlen one over
 * the sequences (over_sequences: z in chunks of 65535); the grid's tiles come from the longest
 * sequence, and a CTA past its own sequence's end leaves at once */
template <typename T, int D, bool VARLEN> static wa_status launch(const kparams &kp, cudaStream_t s) {
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

template <typename T> static wa_status by_dim(const kparams &kp, cudaStream_t s) {
    switch (kp.D) {
    case 64: return kp.cu_q ? launch<T, 64, true>(kp, s) : launch<T, 64, false>(kp, s);
    case 128: return kp.cu_q ? launch<T, 128, true>(kp, s) : launch<T, 128, false>(kp, s);
    case 256: return kp.cu_q ? launch<T, 256, true>(kp, s) : launch<T, 256, false>(kp, s);
    case 512: return kp.cu_q ? launch<T, 512, true>(kp, s) : launch<T, 512, false>(kp, s);
    }
    return wa_fail(WA_ERR_UNSUPPORTED, "tensor-core forward: D = %lld", kp.D);
}

} /* namespace */

size_t sm80_forward_smem(long long D) {
    switch (D) {
    case 64: return fwd_smem_bytes<64>();
    case 128: return fwd_smem_bytes<128>();
    case 256: return fwd_smem_bytes<256>();
    case 512: return fwd_smem_bytes<512>();
    }
    return SIZE_MAX;
}

wa_status sm80_forward(const kparams &kp, wa_dtype dt, cudaStream_t s) {
    return dt == WA_BF16 ? by_dim<__nv_bfloat16>(kp, s) : by_dim<__half>(kp, s);
}

/* sm90/fwd_common.cuh — what the two TMA forwards (sm90/fwd.cu, sm90/fwd_d512.cu) share: the
 * CTA's shape, the staged epilogue of O and the walk over a persistent CTA's work items. */
#ifndef WA_CUDA_SM90_FWD_COMMON_CUH
#define WA_CUDA_SM90_FWD_COMMON_CUH

#include "../prims/hopper.cuh"

namespace {

constexpr int kConsumers = kSm90Consumers, kThreads = kSm90Threads, kStages = kv_ring::kStages;
constexpr int kProducerRegs = kSm90ProducerRegs, kConsumerRegs = kSm90ConsumerRegs;

/* The staged epilogue of one consumer warpgroup (where O's rows are 16-byte aligned; store_rows
 * elsewhere): O is written by stmatrix into shared memory in the 128-byte swizzle (conflict-free)
 * and copied out 16 bytes a lane, whole rows per instruction, instead of 4-byte stores that each
 * touch eight rows' sectors. O = acc / row sum and lse as store_rows; O goes through rows row0 ..
 * row0 + 63 of the tile `tile` (column blocks of BM rows: the Q tile, at D = 512 a consumer's half of V, in the persistent D <= 256 forward a buffer of its own) into
 * rows r0 .. of head (b, h), columns col0 .. col0 + D - 1 (lse by the warpgroup that holds column
 * 0), PART columns at a time (the tile holds PART; each warp stages and copies out only its own 16
 * rows, so a __syncwarp orders one part's reads before the next part's writes); every wgmma of
 * the warpgroup is complete */
template <typename T, int D, int BM, int PART = D>
__device__ __forceinline__ void store_rows_staged(const kparams &p, const float (&acc)[D / 8][4], const float (&row_max)[2],
                                                  const float (&row_sum)[2], long long r0, long long b, long long h,
                                                  unsigned char *tile, int row0, int w4, int lane, int col0 = 0) {
    const int g = lane >> 2, t4 = lane & 3;
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const long long row = r0 + w4 * 16 + g + 8 * r;
        const float l = quad_sum(row_sum[r]);
        const bool sees = row < p.Nq && wa_row_sees_keys(&p.win, row); /* as store_rows */
        inv[r] = sees ? 1.0f / l : 0.0f;
        if (p.lse.data && t4 == 0 && col0 == 0 && row < p.Nq) *row_of<float>(p.lse, b, h, row) = row_lse(row_max[r], l, sees);
    }
    static_assert(D % PART == 0 && PART % 16 == 0, "whole parts of stmatrix pairs");
    /* two 8-column fragments at a time, one stmatrix: tiles (rows 0-7 | 8-15) × (columns of
     * fragment i | i + 1); lane l gives row l % 8 (+ 8 for tiles 1, 3) of chunk i (+ 1 for 2, 3) */
    const uint32_t tile_s = smem_u32(tile);
    const int m_row = row0 + w4 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, m_chunk = lane >> 4;
#pragma unroll
    for (int part = 0; part < D / PART; part++) {
        if (part > 0) __syncwarp(); /* the last part's rows read back before they are overwritten */
#pragma unroll
        for (int j = 0; j < PART / 8; j += 2) {
            const int i = part * (PART / 8) + j;
            const uint32_t r[4] = {pack2<T>(acc[i][0] * inv[0], acc[i][1] * inv[0]), pack2<T>(acc[i][2] * inv[1], acc[i][3] * inv[1]),
                                   pack2<T>(acc[i + 1][0] * inv[0], acc[i + 1][1] * inv[0]),
                                   pack2<T>(acc[i + 1][2] * inv[1], acc[i + 1][3] * inv[1])};
            stsm_x4(tile_s + blk_off<BM>(m_row, j + m_chunk), r);
        }
        __syncwarp(); /* the warp reads back only its own 16 rows */
        constexpr int CHUNKS = PART / 8, ROWS = 32 / CHUNKS; /* 16-byte chunks a row; rows an instruction */
        const int c = lane % CHUNKS;
#pragma unroll
        for (int k = 0; k < 16 / ROWS; k++) {
            const int lr = w4 * 16 + k * ROWS + lane / CHUNKS;
            if (r0 + lr < p.Nq)
                *(uint4 *)(row_of<T>(p.o, b, h, r0 + lr) + col0 + part * PART + c * 8) =
                    *(const uint4 *)(tile + blk_off<BM>(row0 + lr, c));
        }
    }
}

/* f(i0, h, b) for each work item of a forward CTA: query rows from i0, head h, batch entry b.
 * ORDER 0: the CTA's own item (the grid's order, the last query tile first). ORDER 2, persistent
 * (one CTA per SM over all n_qt·Hq·B items, round r taking items r·G .. r·G + G - 1, G =
 * gridDim.x): all heads' query tile t before tile t - 1, each round dealt in the opposite
 * direction to the last (CTA c takes item r·G + c, or r·G + G - 1 - c in odd rounds), which
 * balances causal loads under a static schedule and runs the query heads of one K/V head on the
 * same key tiles at the same time. */
template <int BM, int ORDER, typename F> __device__ __forceinline__ void for_each_item(const kparams &p, long long b0, F &&f) {
    static_assert(ORDER == 0 || ORDER == 2, "the forwards' item orders are 0 and 2");
    if constexpr (ORDER == 0) {
        const cta_tile at = heaviest_first<false>(true);
        f((long long)at.tile * BM, (long long)at.head, b0);
    } else {
        const long long n_qt = (p.Nq + BM - 1) / BM, per_tile = p.Hq * p.B, total = n_qt * per_tile, G = gridDim.x;
        for (long long r = 0;; r++) {
            const long long w = r * G + ((r & 1) ? G - 1 - blockIdx.x : blockIdx.x);
            if (w >= total) break;
            const long long hb = w % per_tile;
            f((n_qt - 1 - w / per_tile) * BM, hb % p.Hq, hb / p.Hq);
        }
    }
}

/* the forwards' maps: Q, K, V (K and V span key rows; write_seq_maps) */
constexpr unsigned kKeyMaps = 0b110;

} /* namespace */

#endif /* WA_CUDA_SM90_FWD_COMMON_CUH */

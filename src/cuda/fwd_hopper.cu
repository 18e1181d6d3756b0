/* fwd_hopper.cu — version 4 of the forward for f16/bf16 at D = 64, 128, 256: the Hopper design
 * (FlashAttention-3's structure, written for this library's window geometry); and the same design
 * at D = 512 with the consumers split by role, persistent for rectangular calls
 * (fwd_wide_asym_kernel, below; the lab's split-D form fwd_wide_ws_kernel beside it).
 *
 * One CTA of three warpgroups per 128 query rows of one head:
 *   producer   warpgroup 0 gives its registers back (setmaxnreg) and one thread issues TMA loads:
 *              Q once, then K and V of each key tile the window allows into a two-stage ring;
 *              each stage has a "full" mbarrier (TMA's transaction count) and an "empty" one
 *              (the consumers' release), separately for K and V.
 *   consumers  warpgroups 1 and 2 own 64 query rows each: S = Q Kᵀ with wgmma from shared memory,
 *              the online softmax in registers, O += P V with P from registers. With PIPELINED the
 *              product O += P V of tile j-1 is issued right after S of tile j and runs on the
 *              tensor cores while this warpgroup does tile j's softmax; only the rescale of O
 *              waits for it (measured no faster than without it, WINATTN_CUDA=v4a, while the two
 *              warpgroups drifted freely and covered each other). At D = 64 and 128 they
 *              take turns to issue (pingpong, below): 6 % faster at D = 128.
 * Tiles are the column blocks of 64 values with the 128-byte swizzle of mma_prims.cuh (blk_off),
 * which is what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and a box of 64 values × rows; rows
 * past the end of a sequence arrive as zeros (TMA's out-of-bounds fill) and are masked.
 *
 * Masks, key-tile ranges and edge tiles come from tile_geometry.h, per warpgroup: a warpgroup
 * skips the key tiles its 64 rows do not see (it still waits for them and releases the stage, so
 * the ring's phases stay in order).
 *
 * Host side: the three tensor maps are encoded per call through the driver's
 * cuTensorMapEncodeTiled, fetched with cudaGetDriverEntryPointByVersion (no link against
 * libcuda). When that is impossible (strides TMA cannot express, no entry point) the forward
 * stays on version 3/2 in attn_mma.cu. docs/cuda.md has the measurements. */
#include "hopper_prims.cuh"

#include <stdlib.h>
#include <string.h>

namespace {

/* ---- the kernel ---- */

constexpr int kConsumers = 2, kThreads = 128 * (kConsumers + 1), kStages = kv_ring::kStages, kBM = 64 * kConsumers;
/* registers per thread after the reallocation: 24 + 2 × 240 fits 65,536 for 3 × 128 threads */
constexpr int kProducerRegs = 24, kConsumerRegs = 240;

/* Pingpong: the two consumer warpgroups take turns to issue their products (FlashAttention-3's
 * "warp scheduler barrier"): named barrier kTurn + w opens warpgroup w's turn, which the other
 * warpgroup's issue ends, so one's softmax runs under the other's products by construction rather
 * than by drift. Every warpgroup takes one turn per key tile of the CTA (skipped tiles too) and
 * one for the last O += P V, so the counts match. Measured 6 % faster at D = 128 ((b): 400 -> 425
 * TFLOP/s at 8K, 426 -> 452 at 32K), 0-2 % at D = 64 and 256 (dev/cuda/fwd_pingpong.sh, commit ff41937);
 * at D = 256 with the staged O and lazy rescaling the free drift is the faster by 1.5-2 % ((a) 8K
 * 606-609 against 595-598 TFLOP/s, 32K 625-628 against 618-621; (b) unchanged: 627-631 / 670-671
 * against 630 / 668-672; `fwd_variants.sh … nopp "-DWA_FWD_NO_PINGPONG"` at 7babd4d, docs/cuda.md),
 * as FlashAttention 4's SM90 forward does not take turns at D = 256. Without turns the rectangular
 * calls run persistent (WA_FWD_PERSIST below), and that form beat the turns at D = 128, (b) 8K
 * 681 against 631-636 TFLOP/s, 32K 697-701 against 672-677 (`fwd_variants.sh old
 * "-DWA_FWD_PERSIST=0 -DWA_FWD_PINGPONG_MAX_D=128" …` at 6a656bc), and at D = 64, 298-300 against
 * 278 at 16K with a 1024 window (`… pp0 "-DWA_FWD_PINGPONG_MAX_D=0"` in the same run; 298-301
 * against 277-278 in `fwd_variants.sh t64 "-DWA_FWD_PINGPONG_MAX_D=64"` at ca6c5ed; docs/cuda.md).
 * So no turns by default: -DWA_FWD_PINGPONG_MAX_D=N builds them at every D <= N (64: D = 64 alone,
 * 128: where they were before the persistent form, 256: everywhere); -DWA_FWD_NO_PINGPONG, the
 * default's spelling, is kept for the lab scripts. */
#ifdef WA_FWD_NO_PINGPONG
#define WA_FWD_PINGPONG_MAX_D 0
#endif
#ifndef WA_FWD_PINGPONG_MAX_D
#define WA_FWD_PINGPONG_MAX_D 0
#endif
template <int D> constexpr bool kPingpong = D <= WA_FWD_PINGPONG_MAX_D;
constexpr int kTurn = 1;

/* key tile: S (64 × BN f32 per warpgroup) and O (64 × D) must fit the consumers' 240 registers.
 * -DWA_FWD_BN128=160|176|192 (lab) sets it at D = 128, as FlashAttention-3 does (176);
 * -DWA_FWD_BN256=80 (lab) at D = 256, as FlashAttention-3 does (128 × 80 tiles): two stages of K
 * and V then take 160 KB beside Q's 64; measured 6 % slower at (a) than 64 (docs/cuda.md) */
#ifndef WA_FWD_BN128
#define WA_FWD_BN128 128
#endif
#ifndef WA_FWD_BN256
#define WA_FWD_BN256 64
#endif
template <int D> __host__ __device__ constexpr int ws_bn() { return D == 256 ? WA_FWD_BN256 : D == 128 ? WA_FWD_BN128 : 128; }

/* warpgroup 0 of both forwards, once it gave its registers back: one thread loads the Q tile (BM rows,
 * DB column blocks) and K and V of key tiles [kt0, kt1) into the ring (from tile it0 of its count), through the launch's maps
 * or (varlen) the sequence's (seq_map: rows past the sequence arrive as zeros); q_row0 and k_row0
 * are a varlen sequence's first rows in the packed tensors (0 otherwise). PAIR: K and V shared with
 * the other CTA of a two-CTA cluster (kv_ring::produce_pair; the lab's D = 512 form) */
template <int BM, int BN, int DB, bool VARLEN, bool PAIR = false>
__device__ __forceinline__ void produce_forward(const kv_ring &ring, const CUtensorMap &tq, const CUtensorMap &tk,
                                                const CUtensorMap &tv, const kparams &kp, uint32_t sQ, uint32_t sK, uint32_t sV,
                                                long long i0, long long h, long long hk, long long b, int64_t kt0, int64_t kt1,
                                                long long q_row0, long long k_row0, int it0 = 0) {
    if (threadIdx.x == 0 && kt0 < kt1) {
        const CUtensorMap *mq = seq_map<VARLEN>(tq, kp, 0), *mk = seq_map<VARLEN>(tk, kp, 1), *mv = seq_map<VARLEN>(tv, kp, 2);
        mbar_expect_tx(ring.once(), BM * DB * 64 * 2);
        for (int c = 0; c < DB; c++) tma_load(sQ + c * (BM * 128), mq, ring.once(), c * 64, (int)(q_row0 + i0), (int)h, (int)b);
        if constexpr (PAIR) ring.produce_pair<BN, DB>(mk, mv, sK, sV, kt0, kt1, (int)hk, (int)b, k_row0, cluster_rank());
        else ring.produce<BN, DB>(mk, mv, sK, sV, kt0, kt1, (int)hk, (int)b, k_row0, it0);
    }
}

/* PERSIST (WA_FWD_PERSIST: 2, the default, or 1, for_each_item's orders; 0 builds the one-item
 * form alone): the version-4 forward's rectangular calls at the head dims whose consumers do not
 * take turns (every D by default) launch one CTA per SM, which walks the work items, as
 * the D = 512 forward does: what a CTA of one item leaves exposed (launch, barrier set-up, the
 * first Q and K loads, the last O += P V, the epilogue) runs under the neighbouring item's work.
 * The producer loads the next item's Q once both consumers' last S of this one is done (q_empty)
 * and its first K and V tiles as soon as the stages free up; the ring's phases run on across the
 * items. O is staged through a buffer of each consumer's own (64 rows × up to 128 columns, D =
 * 256 in two parts) instead of its rows of Q, which by then may hold the next item's. Measured
 * against the one-item form in one run (`fwd_variants.sh … p1 "-DWA_FWD_PERSIST=1" … np
 * "-DWA_FWD_PERSIST=0"` at 6a656bc, docs/cuda.md): (a) 8K / 32K 628-640 / 664-666 TFLOP/s against
 * 613-616 / 639-641, order 1 617-620 / 654-655; with no turns at D = 128 the (b) figures above. */
#ifndef WA_FWD_PERSIST
#define WA_FWD_PERSIST 2
#endif
static_assert(WA_FWD_PERSIST >= 0 && WA_FWD_PERSIST <= 2, "WA_FWD_PERSIST is 0, 1 or 2");
template <int D> constexpr int kFwdOrder = kPingpong<D> ? 0 : WA_FWD_PERSIST;

template <int D, bool PERSIST = false> struct ws_layout {
    static constexpr int BN = ws_bn<D>(), O_PART = D < 128 ? D : 128; /* the persistent epilogue's columns at a time */
    static constexpr uint32_t O_STAGE = 64 * O_PART * 2; /* a consumer's O buffer (persistent) */
    static constexpr uint32_t q = 0, k = kBM * D * 2, v = k + kStages * BN * D * 2, o = v + kStages * BN * D * 2,
                              bars = o + (PERSIST ? kConsumers * O_STAGE : 0), q_empty = bars + 8 * kv_ring::n_bars;
    static constexpr size_t bytes = 1024 + q_empty + (PERSIST ? 8 : 0); /* 1024: alignment slack for the swizzle */
};
static_assert(ws_layout<64>::bytes <= 232448 && ws_layout<128>::bytes <= 232448 && ws_layout<256>::bytes <= 232448,
              "the version-4 forward fits the 227 KB a CTA may have");

/* The epilogue's stores of O. Each warpgroup writes O into its own rows of the Q tile (free once its
 * last product is done), in the tile's 128-byte swizzle, by stmatrix (conflict-free: the eight rows
 * of a tile land in eight different chunks), and each warp then copies its 16 rows out 16 bytes a
 * lane, whole rows per instruction. At D = 256 that is 16 stmatrix, 16 loads and 16 stores of 16
 * bytes against 64 stores of 4 bytes, each of which touches eight rows' sectors, which is what
 * store_rows does: it stays where O is not 16-byte aligned, and -DWA_FWD_STAGED_O=0 builds it
 * everywhere. The (a) forward +5-6 %, (b) +1-2 % (docs/cuda.md, *Results*). */
#ifndef WA_FWD_STAGED_O
#define WA_FWD_STAGED_O 1
#endif
constexpr bool kStagedO = WA_FWD_STAGED_O != 0;
constexpr int kEpilogueBar = 4; /* + the consumer warpgroup's index: its rows of Q are free */

/* kStagedO's epilogue for one consumer warpgroup: O = acc / row sum and lse as store_rows, O
 * through rows row0 .. row0 + 63 of the tile `tile` (column blocks of BM rows: the Q tile, at
 * D = 512 a consumer's half of V, in the persistent version-4 forward a buffer of its own) into
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
 * ORDER 0: the CTA's own item (the grid's order, the last query tile first). Persistent (one CTA
 * per SM over all n_qt·Hq·B items, round r taking items r·G .. r·G + G - 1, G = gridDim.x): ORDER 1
 * head by head, as the grid's order; ORDER 2 all heads' query tile t before tile t - 1, each
 * round dealt in the opposite direction to the last (CTA c takes item r·G + c, or r·G + G - 1 - c
 * in odd rounds), which balances causal loads under a static schedule and runs the query heads of
 * one K/V head on the same key tiles at the same time. */
template <int BM, int ORDER, typename F> __device__ __forceinline__ void for_each_item(const kparams &p, long long b0, F &&f) {
    static_assert(ORDER >= 0 && ORDER <= 2, "the forwards' item orders are 0, 1 and 2");
    if constexpr (ORDER == 0) {
        const cta_tile at = heaviest_first<false>(true);
        f((long long)at.tile * BM, (long long)at.head, b0);
    } else {
        const long long n_qt = (p.Nq + BM - 1) / BM, per_tile = p.Hq * p.B, total = n_qt * per_tile, G = gridDim.x;
        for (long long r = 0;; r++) {
            const long long w = r * G + (ORDER == 2 && (r & 1) ? G - 1 - blockIdx.x : blockIdx.x);
            if (w >= total) break;
            if constexpr (ORDER == 2) {
                const long long hb = w % per_tile;
                f((n_qt - 1 - w / per_tile) * BM, hb % p.Hq, hb / p.Hq);
            } else {
                const long long hq = w % (n_qt * p.Hq);
                f((n_qt - 1 - hq % n_qt) * BM, hq / n_qt, w / (n_qt * p.Hq));
            }
        }
    }
}

template <typename T, int D, bool PIPELINED, Cap CAP, bool VARLEN, int ORDER = 0>
__global__ void __launch_bounds__(kThreads, 1)
    fwd_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                  const __grid_constant__ CUtensorMap tv, const kparams kp) {
#if WA_HOPPER_STUB /* not the sm_90a compilation: never launched (common.cuh) */
    __trap();
#else
    constexpr bool PERSIST = ORDER != 0;
    static_assert(!PERSIST || (!VARLEN && PIPELINED && !kPingpong<D>), "persistent: rectangular, pipelined, no turns");
    using L = ws_layout<D, PERSIST>;
    static_assert(L::bytes <= 232448 && L::o % 1024 == 0, "227 KB a CTA; the O buffers' 128-byte swizzle is 1024-byte aligned");
    constexpr int BM = kBM, BN = L::BN, DB = D / 64, KS = D / 16, TILE = BN * D * 2;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t base = (smem_u32(smem) + 1023u) & ~1023u;
    const uint32_t sQ = base + L::q, sK = base + L::k, sV = base + L::v, q_empty = base + L::q_empty;
    const kv_ring ring{base + L::bars};

    const int warp = warp_index(), wg = warp >> 2, lane = threadIdx.x & 31;
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    /* past this sequence's rows: the whole CTA, before the barriers exist */
    if (VARLEN && heaviest_first<false>(true).tile * (long long)BM >= p.Nq) return;
    /* an item's key tiles [kt0, kt1): those its BM rows see */
    auto key_tiles = [&](long long i0, int64_t &kt0, int64_t &kt1) {
        wa_key_tiles_for_rows(&p.win, i0, min(i0 + BM, p.Nq), BN, &kt0, &kt1);
    };

    if (threadIdx.x == 0) {
        if (PERSIST) mbar_init(q_empty, 4 * kConsumers); /* every consumer warp, after its last S of an item */
        ring.init(4 * kConsumers);
    }
    __syncthreads();

    /* The ring's and Q's phases run on across a persistent CTA's items: kit counts the key tiles
     * before the item, qi the items with keys (Q's loads). */
    int kit = 0;
    uint32_t qi = 0;
    if (wg == 0) { /* the producer: thread 0 issues the loads */
        setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x != 0) return;
        for_each_item<BM, ORDER>(p, sv.b(), [&](long long i0, long long h, long long b) {
            int64_t kt0, kt1;
            key_tiles(i0, kt0, kt1);
            if (kt0 >= kt1) return;
            if (PERSIST && qi > 0) mbar_wait(q_empty, (qi - 1) & 1u); /* the last item's Q read */
            produce_forward<BM, BN, DB, VARLEN>(ring, tq, tk, tv, kp, sQ, sK, sV, i0, h, h / p.group, b, kt0, kt1,
                                                VARLEN ? p.q_row0 : 0, VARLEN ? p.k_row0 : 0, kit);
            kit += (int)(kt1 - kt0), qi++;
        });
        return;
    }

    /* consumers */
    setmaxnreg_inc<kConsumerRegs>();
    const int cw = wg - 1, w4 = warp & 3, g = lane >> 2, t4 = lane & 3;
    const float scale2 = p.scale * kLog2e;
    const bool o_vec16 = rows_aligned16<T>(p.o);
    for_each_item<BM, ORDER>(p, sv.b(), [&](long long i0, long long h, long long b) {
        int64_t kt0, kt1;
        key_tiles(i0, kt0, kt1);
        const long long r0 = i0 + cw * 64, r1 = min(r0 + 64, p.Nq); /* this warpgroup's rows [r0, r1) */
        const long long rows[2] = {r0 + w4 * 16 + g, r0 + w4 * 16 + g + 8};
        int64_t wk0 = kt1, wk1 = kt1; /* the key tiles these rows see; none: every tile is skipped */
        if (r0 < r1) {
            wa_key_tiles_for_rows(&p.win, r0, r1, BN, &wk0, &wk1);
            if (wk0 >= wk1) wk0 = wk1 = kt1;
        }
        int64_t ut0, ut1; /* the key tiles these rows see whole: no mask */
        wa_unmasked_key_tiles(&p.win, r0, r1, BN, &ut0, &ut1);

        float acc[DB][8][4];
        zero_frags(acc);
        float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
        uint32_t pa[BN / 16][4]; /* P of the last tile, the A operand of O += P V */

        /* pingpong turns (see kPingpong), one per key tile of the item and one for the last O += P V;
         * the counts hold for the pipelined loop only */
        pingpong<kPingpong<D> && PIPELINED> turns(kTurn, cw, (int)(kt1 - kt0) + 1);
        auto skip_tile = [&](long long kt) {
            turns.begin();
            turns.end();
            ring.skip(kit + (int)(kt - kt0), lane);
        };

        /* S = Q Kᵀ for the tile in stage st (issue only). One descriptor per operand and tile, moved
         * on by each k step's constant offset (desc_at); the base addresses pass through opaque() so
         * that the compiler does not hoist every step's descriptor out of the loop, which held 2
         * registers per descriptor (spills at D = 128). */
        auto issue_s = [&](float (&s)[BN / 8][4], int st) {
            const uint64_t k_d = gmma_desc(opaque(sK + st * TILE)), q_d = gmma_desc(opaque(sQ + cw * (64 * 128)));
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
                wgmma_ss<T, BN>(s, desc_at(q_d, (ks >> 2) * (BM * 128) + (ks & 3) * 32),
                                desc_at(k_d, (ks >> 2) * (BN * 128) + (ks & 3) * 32), ks > 0);
        };
        /* O += P V for the tile in stage st (issue only) */
        auto issue_pv = [&](int st) {
            const uint64_t v_d = gmma_desc_mn(opaque(sV + st * TILE), BN * 128);
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) wide_mn_product<T, D>(acc, pa[kk], desc_at(v_d, kk * (16 * 128)));
        };
        /* the last tile's O += P V, waited for */
        auto finish_pv = [&](int st, uint32_t ph) {
            mbar_wait(ring.v_full(st), ph);
            reg_fence(pa);
            reg_fence(acc);
            turns.begin();
            wg_fence();
            issue_pv(st);
            wg_commit();
            turns.end();
            wg_wait<0>();
            reg_fence(acc);
            mbar_arrive_if(ring.v_empty(st), lane == 0);
        };
        /* the online-softmax step on S of key tile kt; alpha is O's factor, P goes to pa afterwards */
        auto softmax = [&](float (&s)[BN / 8][4], long long kt, float (&alpha)[2]) {
            const bool edge = !(kt >= ut0 && kt < ut1);
            softmax_scores<BN, CAP>(p, s, row_max, row_sum, alpha, rows, kt * BN, edge, t4, scale2);
        };
        auto pack_p = [&](const float (&s)[BN / 8][4]) { pack_a<T, BN>(pa, s); };

        /* S of key tile kt (stage st) waited for, its stage released, and its softmax step */
        auto s_and_softmax = [&](float (&s)[BN / 8][4], float (&alpha)[2], long long kt, int st, uint32_t ph) {
            mbar_wait(ring.k_full(st), ph);
            turns.begin();
            wg_fence();
            issue_s(s, st);
            wg_commit();
            turns.end();
            wg_wait<0>();
            reg_fence(s);
            mbar_arrive_if(ring.k_empty(st), lane == 0);
            softmax(s, kt, alpha);
        };

        if (kt0 < kt1) mbar_wait(ring.once(), qi & 1u);
        for (long long kt = kt0; kt < wk0; kt++) skip_tile(kt);

        if (wk0 < wk1) {
            /* the first tile: nothing to overlap with yet (and O is zero, no rescale) */
            int pst = kv_ring::stage(kit + (int)(wk0 - kt0));
            uint32_t pph = kv_ring::parity(kit + (int)(wk0 - kt0));
            {
                float s[BN / 8][4], alpha[2];
                s_and_softmax(s, alpha, wk0, pst, pph);
                pack_p(s);
                if (!PIPELINED) finish_pv(pst, pph);
            }
            for (long long kt = wk0 + 1; kt < wk1; kt++) {
                const int it = kit + (int)(kt - kt0), st = kv_ring::stage(it);
                const uint32_t ph = kv_ring::parity(it);
                float s[BN / 8][4], alpha[2];
                if (PIPELINED) {
                    /* S of this tile and O += P V of the last one, back to back; the softmax below runs
                     * while the second is on the tensor cores, the rescale of O after it */
                    mbar_wait(ring.k_full(st), ph);
                    mbar_wait(ring.v_full(pst), pph);
                    reg_fence(pa);
                    reg_fence(acc);
                    turns.begin();
                    wg_fence();
                    issue_s(s, st);
                    wg_commit();
                    issue_pv(pst);
                    wg_commit();
                    turns.end();
                    wg_wait<1>();
                    reg_fence(s);
                    mbar_arrive_if(ring.k_empty(st), lane == 0);
                    softmax(s, kt, alpha);
                    wg_wait<0>();
                    reg_fence(acc);
                    mbar_arrive_if(ring.v_empty(pst), lane == 0);
                    rescale_lazy<DB * 8>(reinterpret_cast<float (&)[DB * 8][4]>(acc), alpha);
                    pack_p(s);
                } else {
                    s_and_softmax(s, alpha, kt, st, ph);
                    rescale_lazy<DB * 8>(reinterpret_cast<float (&)[DB * 8][4]>(acc), alpha);
                    pack_p(s);
                    finish_pv(st, ph);
                }
                pst = st, pph = ph;
            }
            if (PERSIST) mbar_arrive_if(q_empty, lane == 0); /* the item's last S is done: the next Q may land */
            if (PIPELINED) finish_pv(pst, pph);
        } else if (PERSIST && kt0 < kt1) {
            mbar_arrive_if(q_empty, lane == 0); /* these rows read no Q */
        }
        for (long long kt = wk1; kt < kt1; kt++) skip_tile(kt);
        if (wk0 >= wk1) { /* no visible tile: the turn of the last O += P V, empty */
            turns.begin();
            turns.end();
        }

        if (kStagedO && o_vec16) {
            if constexpr (PERSIST) { /* through this warpgroup's own buffer: each warp its 16 rows */
                store_rows_staged<T, D, 64, L::O_PART>(p, reinterpret_cast<const float (&)[DB * 8][4]>(acc), row_max, row_sum, r0, b,
                                                      h, smem + (base + L::o + cw * L::O_STAGE - smem_u32(smem)), 0, w4, lane);
            } else {
                named_sync(kEpilogueBar + cw, 128); /* all the warpgroup's products done: its rows of Q are free */
                store_rows_staged<T, D, BM>(p, reinterpret_cast<const float (&)[DB * 8][4]>(acc), row_max, row_sum, r0, b, h,
                                            smem + (sQ - smem_u32(smem)), cw * 64, w4, lane);
            }
        } else {
            store_rows<T, DB * 8>(p, reinterpret_cast<const float (&)[DB * 8][4]>(acc), row_max, row_sum, rows, b, h, t4);
        }
        if (kt0 < kt1) kit += (int)(kt1 - kt0), qi++;
    });
#endif
}

/* ---- head dim 512 ----
 * A warpgroup cannot hold O for 64 rows × 512 columns (256 registers a thread), so here both
 * consumer warpgroups take the same 64 query rows and split D: each forms S over its half of D's k
 * steps (m64n32k16 from shared memory), the two trade their partial S through shared memory behind
 * a named barrier (double-buffered by tile parity, so one barrier per tile suffices: a warpgroup
 * that passed tile t's barrier knows the other finished reading tile t - 1's buffer) and add own +
 * other (the same bits in both), both take the same row maxima but each computes the exponentials
 * of half the tile's columns and they trade those halves of P (WA_FWD512_SPLIT_EXP, below), and
 * each accumulates O for its 256 columns (m64n256k16 with P from registers: 128 registers a
 * thread). O += P V of the last tile is issued behind S of this one and runs while the halves are
 * traded and the softmax runs. Key
 * tiles of 32: Q (64 KB), two stages of K and V (128 KB) and the exchange buffers (32 KB) take
 * 225 KB. The mma.sync form (attn_mma.cu, fwd_split) stays the fallback. */
constexpr int kWideD = 512, kWideBM = 64, kWideBN = 32;
[[maybe_unused]] constexpr int kTradeBar = 3; /* the split-D kernel's consumers' named barrier */
struct wide_layout {
    static constexpr uint32_t q = 0, k = kWideBM * kWideD * 2, v = k + kStages * kWideBN * kWideD * 2,
                              xch = v + kStages * kWideBN * kWideD * 2, bars = xch + 2 * kConsumers * kWideBM * kWideBN * 4;
    static constexpr size_t bytes = 1024 + bars + 8 * kv_ring::n_bars;
};
static_assert(wide_layout::bytes <= 232448, "the D = 512 forward fits the 227 KB a CTA may have");
static_assert(wide_layout::q == 0 && wide_layout::k % 1024 == 0 && wide_layout::v % 1024 == 0, "the swizzled tiles start 1024-byte aligned");

/* Each consumer keeps the first WA_FWD512_QREG (N, 0 <= N <= 16) of its 16 k steps of Q as A
 * fragments in registers (4 a thread per step, loaded once by ldmatrix) and forms those steps of S
 * with the register-A wgmma, instead of reading that part of Q from shared memory on every key
 * tile: Q is 64 of the about 220 KB of shared-memory traffic per tile, where Nsight Compute's
 * stalls pointed (docs/cuda.md). N = 14 (56 registers) is the fastest measured: 10-15 % over
 * N = 0 at (c), against 3-6 % for 8 and 5-10 % for 12; all 16 spill and run 13-18 % slower than 0
 * (`dev/cuda/fwd_variants.sh`, docs/cuda.md). ptxas at 14: no spills, 40-60 bytes with a softcap
 * (24 with the split exponentials below).
 * -DWA_FWD512_QREG=0 builds the all-shared form. */
#ifndef WA_FWD512_QREG
#define WA_FWD512_QREG 14
#endif
constexpr int kWideQRegSteps = WA_FWD512_QREG;
static_assert(kWideQRegSteps >= 0 && kWideQRegSteps <= kWideD / 32, "a consumer has D / 32 k steps of Q");

/* The two consumers share the softmax's exponentials instead of both computing all 32 columns of
 * the summed S: both still mask and take the row maxima over the whole tile (so both keep the same
 * running max and alpha), but each exponentiates and sums only its half of the columns (16: half
 * the MUFU work and the adds), packs that half of P and trades it through shared memory; O += P V
 * is issued in two k steps, its own half before the next tile's S exchange and the other's half
 * after it (the same named barrier carries both, so there is one more barrier per CTA, for the
 * last tile), and the partial row sums are added once at the end. The P halves live in the
 * consumer's first column block of Q, dead once Q's first k steps are in registers. Against both
 * computing every exponential (-DWA_FWD512_SPLIT_EXP=0): (c) 8K / 16K 503-510 / 491-522 TFLOP/s
 * against 486-489 / 474-476, D = 512 with a 1024 window 409 against 387-391, 200 calls back to
 * back at 16K 473-474 against 461 (`dev/cuda/fwd_variants.sh`, docs/cuda.md). */
#ifndef WA_FWD512_SPLIT_EXP
#define WA_FWD512_SPLIT_EXP 1
#endif
constexpr bool kWideSplitExp = WA_FWD512_SPLIT_EXP != 0;
static_assert(!kWideSplitExp || kWideQRegSteps >= 4, "the P halves are traded through Q's first column block, dead "
                                                     "only once its four k steps are in registers");

/* PAIR (lab, -DWA_FWD512_CLUSTER): the CTA is one of a cluster of two on query heads 2c and 2c + 1
 * of one K/V head at the same query tile, which read the same key tiles under the same masks; the
 * K and V loads are shared (kv_ring::produce_pair), halving what each tile costs in L2 bandwidth,
 * the bound of the single-CTA form (docs/cuda.md, Next). */
template <typename T, Cap CAP, bool VARLEN, bool PAIR = false>
__global__ void __launch_bounds__(kThreads, 1)
    fwd_wide_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                       const __grid_constant__ CUtensorMap tv, const kparams kp) {
#if WA_HOPPER_STUB /* not the sm_90a compilation: never launched (common.cuh) */
    __trap();
#else
    using L = wide_layout;
    constexpr int D = kWideD, BM = kWideBM, BN = kWideBN, DB = D / 64, KH = D / 32, TILE = BN * D * 2;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t base = (smem_u32(smem) + 1023u) & ~1023u;
    const uint32_t sQ = base + L::q, sK = base + L::k, sV = base + L::v;
    float *xch = (float *)(smem + (base - smem_u32(smem)) + L::xch);
    const kv_ring ring{base + L::bars};

    const int warp = warp_index(), wg = warp >> 2, lane = threadIdx.x & 31;
    const cta_tile at = heaviest_first<false>(true); /* the longest (causal) tiles first */
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const long long qt = at.tile, h = at.head, b = sv.b(), hk = h / p.group, i0 = qt * BM;
    if (VARLEN && i0 >= p.Nq) return; /* past this sequence's rows: the whole CTA, before the barriers exist */
    const int m = (int)min((long long)BM, p.Nq - i0);
    int64_t kt0, kt1;
    wa_key_tiles_for_rows(&p.win, i0, i0 + m, BN, &kt0, &kt1);

    /* a stage is released by the consumer warps of this CTA, and with PAIR of the other one too */
    if (threadIdx.x == 0) ring.init(4 * kConsumers * (PAIR ? 2 : 1));
    if constexpr (PAIR) cluster_sync(); /* both CTAs' barriers exist before either CTA loads or arrives */
    else __syncthreads();

    if (wg == 0) {
        setmaxnreg_dec<kProducerRegs>();
        produce_forward<BM, BN, DB, VARLEN, PAIR>(ring, tq, tk, tv, kp, sQ, sK, sV, i0, h, hk, b, kt0, kt1, VARLEN ? p.q_row0 : 0,
                                                  VARLEN ? p.k_row0 : 0);
        if constexpr (PAIR) cluster_sync(); /* the CTA's shared memory outlives the other CTA's loads into it and arrivals on it */
        return;
    }

    /* consumers: warpgroup cw forms S over k steps [16 cw, 16 cw + 16) and owns O's columns [256 cw, 256 cw + 256) */
    setmaxnreg_inc<kConsumerRegs>();
    const int cw = wg - 1, w4 = warp & 3, g = lane >> 2, t4 = lane & 3, tid = threadIdx.x & 127;
    const long long rows[2] = {i0 + w4 * 16 + g, i0 + w4 * 16 + g + 8};
    const float scale2 = p.scale * kLog2e;
    float acc[4][8][4];
    zero_frags(acc);
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
    /* P as the A operand of O += P V, a k step (16 keys) each; with the split exponentials pa[0]
     * holds this consumer's half of the columns (k step cw) and pa[1] the other's (k step cw ^ 1) */
    uint32_t pa[BN / 16][4];
    uint32_t qa[kWideQRegSteps > 0 ? kWideQRegSteps : 1][4]; /* the first kWideQRegSteps of this warpgroup's k steps of Q */

    int64_t ut0, ut1; /* the key tiles the CTA's rows see whole: no mask */
    wa_unmasked_key_tiles(&p.win, i0, i0 + m, BN, &ut0, &ut1);
    auto release = [&](uint32_t empty) { /* a stage this warp has read */
        mbar_arrive_if(empty, lane == 0);
        if constexpr (PAIR) mbar_arrive_cta_if(empty, cluster_rank() ^ 1u, lane == 0);
    };
    /* descriptors as in fwd_ws_kernel: one per operand and tile, moved on by constant offsets */
    auto issue_s = [&](float (&s)[BN / 8][4], int st) {
        const uint64_t k_d = gmma_desc(opaque(sK + st * TILE + cw * 4 * (BN * 128))), q_d = gmma_desc(opaque(sQ + cw * 4 * (BM * 128)));
#pragma unroll
        for (int kx = 0; kx < KH; kx++)
            if (kx < kWideQRegSteps)
                wgmma_rs<T, BN>(s, qa[kx < kWideQRegSteps ? kx : 0], desc_at(k_d, (kx >> 2) * (BN * 128) + (kx & 3) * 32), kx > 0);
            else
                wgmma_ss<T, BN>(s, desc_at(q_d, (kx >> 2) * (BM * 128) + (kx & 3) * 32), desc_at(k_d, (kx >> 2) * (BN * 128) + (kx & 3) * 32),
                                kx > 0);
    };
    auto v_desc = [&](int st) { return gmma_desc_mn(opaque(sV + st * TILE + cw * 4 * (BN * 128)), BN * 128); };
    auto issue_pv = [&](int st) {
        const uint64_t v_d = v_desc(st);
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) wide_mn_product<T, 256>(acc, pa[kk], desc_at(v_d, kk * (16 * 128)));
    };
    /* split exponentials: O += P V over the 16 keys of k step kk (0 or 1) only, with that half of P in a */
    auto issue_pv_half = [&](int st, const uint32_t (&a)[4], int kk) {
        wide_mn_product<T, 256>(acc, a, desc_at(v_desc(st), kk * (16 * 128)));
    };
    /* split exponentials: the P halves (as A fragments, 16 bytes a thread) by tile parity and the
     * final row sums, in each consumer's first column block of Q (8 KB, dead once in registers) */
    uint4 *p_mine = (uint4 *)(smem + (base - smem_u32(smem)) + L::q + cw * 4 * (BM * 128));
    const uint4 *p_other = (const uint4 *)(smem + (base - smem_u32(smem)) + L::q + (cw ^ 1) * 4 * (BM * 128));
    auto publish_p = [&](float (&s)[BN / 8][4], int it) { /* this consumer's half of P: pa[0], and for the other */
        pack_a<T, BN / 2>(reinterpret_cast<uint32_t (&)[1][4]>(pa[0]), reinterpret_cast<const float (&)[BN / 16][4]>(s));
        p_mine[(it & 1) * 128 + tid] = make_uint4(pa[0][0], pa[0][1], pa[0][2], pa[0][3]);
    };
    auto take_other_p = [&](int it) { /* the other consumer's half of tile it's P, after a barrier both passed */
        const uint4 v = p_other[(it & 1) * 128 + tid];
        pa[1][0] = v.x, pa[1][1] = v.y, pa[1][2] = v.z, pa[1][3] = v.w;
    };
    /* S of tile `it` (stage st) once its k steps are done: own half + the other warpgroup's */
    auto trade = [&](float (&s)[BN / 8][4], int it) {
        float *mine = xch + ((it & 1) * kConsumers + cw) * (BM * BN), *other = xch + ((it & 1) * kConsumers + (cw ^ 1)) * (BM * BN);
#pragma unroll
        for (int i = 0; i < BN / 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) mine[(i * 4 + e) * 128 + tid] = s[i][e];
        named_sync(kTradeBar, 256);
#pragma unroll
        for (int i = 0; i < BN / 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[i][e] += other[(i * 4 + e) * 128 + tid];
    };
    auto softmax = [&](float (&s)[BN / 8][4], float (&alpha)[2], long long kt) {
        softmax_scores<BN, CAP, kWideSplitExp>(p, s, row_max, row_sum, alpha, rows, kt * BN, !(kt >= ut0 && kt < ut1), t4,
                                               scale2, cw);
    };
    auto trade_and_softmax = [&](float (&s)[BN / 8][4], float (&alpha)[2], long long kt, int it) {
        trade(s, it);
        softmax(s, alpha, kt);
    };

    if (kt0 < kt1) {
        mbar_wait(ring.once(), 0);
        if constexpr (kWideQRegSteps > 0) {
#pragma unroll
            for (int kx = 0; kx < kWideQRegSteps; kx++) ldsm_x4(qa[kx], sQ + blk_off<BM>(w4 * 16 + (lane & 15), (cw * KH + kx) * 2 + (lane >> 4)));
            reg_fence(qa);
        }
        int pst = kv_ring::stage(0);
        uint32_t pph = kv_ring::parity(0);
        { /* the first tile: nothing to overlap with, O is zero */
            float s[BN / 8][4], alpha[2];
            mbar_wait(ring.k_full(pst), pph);
            wg_fence();
            issue_s(s, pst);
            wg_commit();
            wg_wait<0>();
            reg_fence(s);
            release(ring.k_empty(pst));
            trade_and_softmax(s, alpha, kt0, 0);
            if constexpr (kWideSplitExp) publish_p(s, 0);
            else pack_a<T, BN>(pa, s);
        }
        for (long long kt = kt0 + 1; kt < kt1; kt++) {
            const int it = (int)(kt - kt0), st = kv_ring::stage(it);
            const uint32_t ph = kv_ring::parity(it);
            float s[BN / 8][4], alpha[2];
            mbar_wait(ring.k_full(st), ph);
            mbar_wait(ring.v_full(pst), pph);
            reg_fence(pa);
            reg_fence(acc);
            wg_fence();
            issue_s(s, st);
            wg_commit();
            if constexpr (kWideSplitExp) issue_pv_half(pst, pa[0], cw); /* the last tile's P, own half */
            else issue_pv(pst);
            wg_commit();
            wg_wait<1>();
            reg_fence(s);
            release(ring.k_empty(st));
            if constexpr (kWideSplitExp) {
                trade(s, it); /* its barrier also says the other's half of the last tile's P is there */
                take_other_p(it - 1);
                reg_fence(pa);
                wg_fence();
                issue_pv_half(pst, pa[1], cw ^ 1);
                wg_commit();
                softmax(s, alpha, kt);
            } else {
                trade_and_softmax(s, alpha, kt, it);
            }
            wg_wait<0>();
            reg_fence(acc);
            release(ring.v_empty(pst));
            rescale_lazy<32>(reinterpret_cast<float (&)[32][4]>(acc), alpha);
            if constexpr (kWideSplitExp) publish_p(s, it);
            else pack_a<T, BN>(pa, s);
            pst = st, pph = ph;
        }
        if constexpr (kWideSplitExp) { /* the other's half of the last tile's P, and the row sums of both halves */
            float *sums = (float *)(p_mine + 2 * 128);
            sums[tid] = row_sum[0], sums[128 + tid] = row_sum[1];
            named_sync(kTradeBar, 256);
            take_other_p((int)(kt1 - 1 - kt0));
            const float *other_sums = (const float *)(p_other + 2 * 128);
            row_sum[0] += other_sums[tid], row_sum[1] += other_sums[128 + tid];
        }
        mbar_wait(ring.v_full(pst), pph); /* the last tile's O += P V */
        reg_fence(pa);
        reg_fence(acc);
        wg_fence();
        if constexpr (kWideSplitExp) {
            issue_pv_half(pst, pa[0], cw);
            issue_pv_half(pst, pa[1], cw ^ 1);
        } else {
            issue_pv(pst);
        }
        wg_commit();
        wg_wait<0>();
        reg_fence(acc);
        release(ring.v_empty(pst));
    }
    store_rows<T, 32>(p, reinterpret_cast<const float (&)[32][4]>(acc), row_max, row_sum, rows, b, h, t4, cw * 256);
    if constexpr (PAIR) cluster_sync(); /* the producer's: no CTA leaves while the other may still arrive on it */
#endif
}

/* The D = 512 forward split by role, as ffpa-attn's SM90 kernel splits it (the default;
 * -DWA_FWD512_ASYM=0 builds the split-D kernel above). Consumer 0 (the CTA's warpgroup 1) forms S
 * over all of D (m64n64k16 from shared memory, key tiles of 64), runs the whole softmax, keeps
 * O's columns 0-255 and hands P (bf16, stmatrix) and the rows' rescale factors to consumer 1
 * through shared memory behind mbarriers (two buffers); consumer 1 only reads them (ldmatrix:
 * the same fragments) and accumulates O's columns 256-511. No partial S is traded, no mask or
 * maximum is taken twice, and consumer 1's products run under consumer 0's softmax. K and V have
 * one stage each (64 KB a tile); V's two column halves have their own barriers and are released
 * apart, so the half one consumer is done with is refilled while the other still reads its own,
 * and K's two halves of D likewise (KHALVES below); K and V have a producer thread each. Shared
 * memory: Q, K, V (192 KB), two P buffers (16 KB), two buffers of factors or, last, row sums
 * (2 KB). `winattn bench` (before KHALVES, STAGED_O and PERSIST): (c) 8K / 16K
 * 607-608 / 585-638 TFLOP/s against the split-D kernel's 524-526 / 502-513, D = 512 with a 1024
 * window 470-474 against 420-422 (both with WA_WG_UNIFORM); consumer 0 issuing S of a tile behind
 * O += P V of the last, as the version-4 forward does, measured 346-352 (bd6a93b's
 * -DWA_FWD512_ASYM=2), but ptxas had serialized its wgmma (C7515; OVERLAP below, docs/cuda.md). */
#ifndef WA_FWD512_ASYM
#define WA_FWD512_ASYM 1
#endif
constexpr int kWideAsym = WA_FWD512_ASYM, kAsymBN = 64;
/* KHALVES: K loaded and released by halves of D (a full / empty pair each) and consumer 0's S
 * issued as two commit groups, so that the producer refills K's first half while S still reads
 * the second. STAGED_O: the epilogue's O through shared memory, as store_rows_staged does for the
 * version-4 forward, each consumer its column half (through the Q tile when measured; through
 * its own half of V since the persistent form, whose next Q may land during the epilogue).
 * Together, in `winattn bench` against the role split without them in one run: (c) 8K 624-627
 * TFLOP/s against 604-609, D = 512 with a 1024 window 496-497 against 468-474 (STAGED_O alone
 * 616-622 and 496-497, KHALVES alone 609-610 and 473; docs/cuda.md). =0 builds the form without. */
#ifndef WA_FWD512_KHALVES
#define WA_FWD512_KHALVES 1
#endif
#ifndef WA_FWD512_STAGED_O
#define WA_FWD512_STAGED_O 1
#endif
constexpr bool kAsymKHalves = WA_FWD512_KHALVES != 0, kAsymStagedO = WA_FWD512_STAGED_O != 0;
/* Lab form: consumer 0 keeps the first WA_FWD512_ASYM_QREG of its 32 k steps of Q as A fragments
 * in registers (loaded once an item by ldmatrix) and forms those steps of S with the register-A
 * wgmma, as the split-D kernel's WA_FWD512_QREG does (10-15 % there). Measured no gain here (4 and
 * 8 steps against 0, on the non-persistent kernel: within the rounds' spread; docs/cuda.md), so 0
 * (the default): all of Q from shared memory. */
#ifndef WA_FWD512_ASYM_QREG
#define WA_FWD512_ASYM_QREG 0
#endif
constexpr int kAsymQRegSteps = WA_FWD512_ASYM_QREG;
/* OVERLAP (the default, 1): consumer 0 issues tile t's S and then tile t - 1's O += P V behind it,
 * and runs tile t's softmax while that product does (FlashAttention 3's overlap inside a
 * warpgroup), so the tensor cores are not idle during the softmax. 0 builds the plain order (S,
 * softmax, hand-over, O += P V of the same tile). It needs V_THREADS 2: V's two halves each loaded
 * by its own producer thread. With one thread loading them in order, the back half of tile t
 * waits behind the front half's wait for consumer 0's release of tile t - 1, which the overlap
 * moves to the end of consumer 0's next step; consumer 1 then waited for V (13 % of the kernel's
 * stall samples against 0.5 %) and the overlap lost 6-10 %. `winattn bench --forward-only`, two
 * rounds on an H100 (`ROWS=d512 sh dev/cuda/fwd_variants.sh`; docs/cuda.md has the command whole):
 * (c) 8K / 16K 656 / 650-667 TFLOP/s against 640-642 / 631-646 for the plain order, window 1024
 * at 16K 554 against 549-551; ten calls back to back 609-613 / 622 against 570-587 / 594 and
 * 550-555 against 516-517. V_THREADS 2 alone changes nothing measurable. */
#ifndef WA_FWD512_OVERLAP
#define WA_FWD512_OVERLAP 1
#endif
constexpr bool kAsymOverlap = WA_FWD512_OVERLAP != 0;
#ifndef WA_FWD512_V_THREADS
#define WA_FWD512_V_THREADS 2
#endif
constexpr int kAsymVThreads = WA_FWD512_V_THREADS;
static_assert(kAsymVThreads == 1 || kAsymVThreads == 2, "WA_FWD512_V_THREADS is 1 or 2");
static_assert(kAsymQRegSteps >= 0 && kAsymQRegSteps <= kWideD / 16, "consumer 0 has D / 16 k steps of Q");
/* PERSIST (rectangular calls): one CTA per SM walks the work items (query tile, head, batch
 * entry), so that what a CTA of one item leaves exposed (launch, barrier set-up, the first Q and K
 * loads, the last product's drain, the epilogue) runs under the neighbouring item's work: the
 * producer loads the next item's Q once consumer 0's last S is done (q_empty) and its first K and
 * V tiles as soon as the stages free up, and consumer 0 starts the next item's S while consumer 1
 * finishes the last O += P V. The order (WA_FWD512_PERSIST): 2 (the default) all heads' query
 * tile t before tile t - 1, each round of gridDim.x items assigned in the opposite direction to
 * the last, which balances causal loads under a static schedule and runs the query heads of one
 * K/V head on the same key tiles at the same time; 1 head by head, as the grid's order; 0 one
 * item per CTA (the non-persistent kernel, the varlen calls' form). `winattn bench`, forward
 * TFLOP/s, against the non-persistent kernel in one run: (c) 8K 641-647 against 616-618, D = 512
 * with a 1024 window 551-554 against 490-491; order 1 520-521 windowed but 551 at (c) 8K
 * (docs/cuda.md). */
#ifndef WA_FWD512_PERSIST
#define WA_FWD512_PERSIST 2
#endif
constexpr int kAsymPersist = WA_FWD512_PERSIST;
static_assert(kAsymPersist >= 0 && kAsymPersist <= 2, "WA_FWD512_PERSIST is 0, 1 or 2");

struct asym_layout {
    static constexpr uint32_t TILE = kAsymBN * kWideD * 2, P = kWideBM * 64 * 2;
    static constexpr uint32_t q = 0, k = kWideBM * kWideD * 2, v = k + TILE, p = v + TILE, alpha = p + 2 * P, bars = alpha + 2 * 128 * 8;
    /* the mbarriers, 8 bytes apart from `bars` */
    enum : uint32_t { q_full, q_empty, k_full, k_empty, vf_full, vf_empty, vb_full, vb_empty, p_full, p_empty = p_full + 2, kb_full = p_empty + 2,
                      kb_empty, n_bars };
    static constexpr size_t bytes = 1024 + bars + 8 * n_bars;
};
static_assert(asym_layout::bytes <= 232448, "the role-split D = 512 forward fits the 227 KB a CTA may have");
static_assert(asym_layout::q == 0 && asym_layout::k % 1024 == 0 && asym_layout::v % 1024 == 0 && asym_layout::p % 1024 == 0,
              "the swizzled tiles start 1024-byte aligned");
static_assert(kAsymBN == kWideBM, "a consumer's half of V (BN rows) stages its half of O (BM rows) in the epilogue");

template <typename T, Cap CAP, bool VARLEN, bool PERSIST = false>
__global__ void __launch_bounds__(kThreads, 1)
    fwd_wide_asym_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                         const __grid_constant__ CUtensorMap tv, const kparams kp) {
#if WA_HOPPER_STUB /* not the sm_90a compilation: never launched (common.cuh) */
    __trap();
#else
    static_assert(!(PERSIST && VARLEN), "varlen calls take one item per CTA");
    using L = asym_layout;
    constexpr int D = kWideD, BM = kWideBM, BN = kAsymBN, DB = D / 64, KS = D / 16;
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t base = (smem_u32(smem) + 1023u) & ~1023u;
    unsigned char *aligned = smem + (base - smem_u32(smem));
    const uint32_t sQ = base + L::q, sK = base + L::k, sV = base + L::v, sP = base + L::p;
    auto bar = [&](uint32_t i) { return base + L::bars + 8 * i; };

    const int warp = warp_index(), wg = warp >> 2, lane = threadIdx.x & 31;
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    /* past this sequence's rows: the whole CTA, before the barriers exist */
    if (VARLEN && heaviest_first<false>(true).tile * (long long)BM >= p.Nq) return;
    /* an item's key tiles [kt0, kt1) */
    auto key_tiles = [&](long long i0, int64_t &kt0, int64_t &kt1) {
        wa_key_tiles_for_rows(&p.win, i0, min(i0 + BM, p.Nq), BN, &kt0, &kt1);
    };

    if (threadIdx.x == 0) {
        /* the empty barriers count the warps that read the stage: Q and K's first half consumer 0's
         * (after its last S, after S), V's halves each consumer's (after its O += P V, or after the
         * epilogue staged its half of O there); P's buffers every thread of the consumer that
         * writes (full) or reads (empty) them */
        mbar_init(bar(L::q_full), 1), mbar_init(bar(L::q_empty), 4);
        mbar_init(bar(L::k_full), 1), mbar_init(bar(L::k_empty), 4);
        if constexpr (kAsymKHalves) mbar_init(bar(L::kb_full), 1), mbar_init(bar(L::kb_empty), 4); /* K's second half */
        mbar_init(bar(L::vf_full), 1), mbar_init(bar(L::vf_empty), 4);
        mbar_init(bar(L::vb_full), 1), mbar_init(bar(L::vb_empty), 4);
        for (int i = 0; i < 2; i++) mbar_init(bar(L::p_full + i), 128), mbar_init(bar(L::p_empty + i), 128);
        mbar_init_fence();
    }
    __syncthreads();

    /* The barriers' phases run on across the CTA's items: kit counts the key tiles (K and V stages)
     * before the item, qi the items with keys (Q), pit the hand-overs to consumer 1 (one per key
     * tile and one of the row sums per item). */
    uint32_t kit = 0, qi = 0;
    if (wg == 0) { /* producer: Q and K by one thread, V's halves by one each (V_THREADS 1: one for both) */
        setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x != 0 && threadIdx.x != 32 && !(kAsymVThreads == 2 && threadIdx.x == 64)) return;
        const long long q_row0 = VARLEN ? p.q_row0 : 0, k_row0 = VARLEN ? p.k_row0 : 0;
        const CUtensorMap *mq = seq_map<VARLEN>(tq, kp, 0), *mk = seq_map<VARLEN>(tk, kp, 1), *mv = seq_map<VARLEN>(tv, kp, 2);
        /* tile kt (the it-th of the CTA) of K or V by halves of D (column blocks 0-3, 4-7), halves
         * [h0, h1), each behind its full barrier once its empty one says that the last tile's half
         * has been read */
        auto load_by_halves = [&](uint32_t dst, const CUtensorMap *map, uint32_t full0, uint32_t empty0, uint32_t full1, uint32_t empty1,
                                  uint32_t it, long long kt, long long hk, long long b, int h0 = 0, int h1 = 2) {
            for (int half = h0; half < h1; half++) {
                const uint32_t full = bar(half ? full1 : full0), empty = bar(half ? empty1 : empty0);
                if (it > 0) mbar_wait(empty, (it - 1) & 1u);
                mbar_expect_tx(full, L::TILE / 2);
                for (int c = 4 * half; c < 4 * half + 4; c++)
                    tma_load(dst + c * (BN * 128), map, full, c * 64, (int)(k_row0 + kt * BN), (int)hk, (int)b);
            }
        };
        for_each_item<BM, PERSIST ? kAsymPersist : 0>(p, sv.b(), [&](long long i0, long long h, long long b) {
            int64_t kt0, kt1;
            key_tiles(i0, kt0, kt1);
            if (kt0 >= kt1) return;
            const long long hk = h / p.group;
            if (threadIdx.x == 0) {
                if (qi > 0) mbar_wait(bar(L::q_empty), (qi - 1) & 1u);
                mbar_expect_tx(bar(L::q_full), BM * D * 2);
                for (int c = 0; c < DB; c++) tma_load(sQ + c * (BM * 128), mq, bar(L::q_full), c * 64, (int)(q_row0 + i0), (int)h, (int)b);
                for (long long kt = kt0; kt < kt1; kt++) {
                    const uint32_t it = kit + (uint32_t)(kt - kt0);
                    if constexpr (kAsymKHalves) {
                        load_by_halves(sK, mk, L::k_full, L::k_empty, L::kb_full, L::kb_empty, it, kt, hk, b);
                    } else {
                        if (it > 0) mbar_wait(bar(L::k_empty), (it - 1) & 1u);
                        mbar_expect_tx(bar(L::k_full), L::TILE);
                        for (int c = 0; c < DB; c++) tma_load(sK + c * (BN * 128), mk, bar(L::k_full), c * 64, (int)(k_row0 + kt * BN), (int)hk, (int)b);
                    }
                }
            } else {
                const int h0 = kAsymVThreads == 2 && threadIdx.x == 64, h1 = kAsymVThreads == 2 ? h0 + 1 : 2;
                for (long long kt = kt0; kt < kt1; kt++)
                    load_by_halves(sV, mv, L::vf_full, L::vf_empty, L::vb_full, L::vb_empty, kit + (uint32_t)(kt - kt0), kt, hk, b, h0, h1);
            }
            qi++, kit += (uint32_t)(kt1 - kt0);
        });
        return;
    }

    setmaxnreg_inc<kConsumerRegs>();
    const int cw = wg - 1, w4 = warp & 3, g = lane >> 2, t4 = lane & 3, tid = threadIdx.x & 127;
    float2 *alphas = (float2 *)(aligned + L::alpha);
    /* the fragment rows and 16-byte chunks this lane addresses in stmatrix / ldmatrix: tiles
     * (rows 0-7 | 8-15) × (columns 0-7 | 8-15) of a k step, as the A fragments hold them */
    const int f_row = w4 * 16 + (lane & 15), f_chunk = lane >> 4;
    /* the epilogue stages O through the consumer's own half of V (free after its last product; the
     * producer refills it for the next item once the copy-out is done) where O's rows are 16-byte
     * aligned, and writes from registers (store_rows) elsewhere */
    const bool staged = kAsymStagedO && rows_aligned16<T>(p.o);
    const uint32_t v_empty = bar(cw ? L::vb_empty : L::vf_empty);
    uint32_t pit = 0;
    for_each_item<BM, PERSIST ? kAsymPersist : 0>(p, sv.b(), [&](long long i0, long long h, long long b) {
        int64_t kt0, kt1;
        key_tiles(i0, kt0, kt1);
        const int n = (int)max((int64_t)0, kt1 - kt0);
        const long long rows[2] = {i0 + w4 * 16 + g, i0 + w4 * 16 + g + 8};
        float acc[4][8][4];
        zero_frags(acc);
        float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
        /* O's columns [256 cw, 256 cw + 256) += P V over the tile's 64 keys (V's half cw) */
        auto issue_pv = [&](const uint32_t (&pa)[4][4]) {
            const uint64_t v_d = gmma_desc_mn(opaque(sV + cw * 4 * (BN * 128)), BN * 128);
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wide_mn_product<T, 256>(acc, pa[kk], desc_at(v_d, kk * (16 * 128)));
        };
        /* the it-th tile's O += P V on V's half cw, and the half released unless the epilogue stages O in it */
        auto product_and_release = [&](uint32_t (&pa)[4][4], int it) {
            mbar_wait(bar(cw ? L::vb_full : L::vf_full), (kit + (uint32_t)it) & 1u);
            reg_fence(pa);
            reg_fence(acc);
            wg_fence();
            issue_pv(pa);
            wg_commit();
            wg_wait<0>();
            reg_fence(acc);
            mbar_arrive_if(v_empty, lane == 0 && !(staged && it == n - 1));
        };
        /* hand-over `idx` of the CTA's goes through buffer idx % 2: consumer 0 writes it once
         * consumer 1 has read hand-over idx - 2, consumer 1 reads it once consumer 0 has written it */
        auto handover_slot = [&](uint32_t idx) {
            const uint32_t slot = idx & 1u;
            if (idx >= 2) mbar_wait(bar(L::p_empty + slot), ((idx >> 1) - 1) & 1u);
            return slot;
        };
        auto handed_over_slot = [&](uint32_t idx) {
            const uint32_t slot = idx & 1u;
            mbar_wait(bar(L::p_full + slot), (idx >> 1) & 1u);
            return slot;
        };

        if (cw == 0) {
            int64_t ut0, ut1; /* the key tiles the CTA's rows see whole: no mask */
            wa_unmasked_key_tiles(&p.win, i0, min(i0 + BM, p.Nq), BN, &ut0, &ut1);
            const float scale2 = p.scale * kLog2e;
            uint32_t qa[kAsymQRegSteps > 0 ? kAsymQRegSteps : 1][4]; /* Q's first kAsymQRegSteps k steps */
            auto issue_s = [&](float (&s)[BN / 8][4], const int kx0, const int kx1) { /* k steps [kx0, kx1) */
                const uint64_t q_d = gmma_desc(opaque(sQ)), k_d = gmma_desc(opaque(sK));
#pragma unroll
                for (int kx = kx0; kx < kx1; kx++)
                    if (kx < kAsymQRegSteps)
                        wgmma_rs<T, BN>(s, qa[kx < kAsymQRegSteps ? kx : 0], desc_at(k_d, (kx >> 2) * (BN * 128) + (kx & 3) * 32), kx > 0);
                    else
                        wgmma_ss<T, BN>(s, desc_at(q_d, (kx >> 2) * (BM * 128) + (kx & 3) * 32),
                                        desc_at(k_d, (kx >> 2) * (BN * 128) + (kx & 3) * 32), kx > 0);
            };
            if (n > 0) {
                mbar_wait(bar(L::q_full), qi & 1u);
                if constexpr (kAsymQRegSteps > 0) {
#pragma unroll
                    for (int kx = 0; kx < kAsymQRegSteps; kx++) ldsm_x4(qa[kx], sQ + blk_off<BM>(f_row, 2 * kx + f_chunk));
                    reg_fence(qa);
                }
            }
            /* tile it's S, issued after K's halves are in (KHALVES: two commit groups) */
            auto issue_s_groups = [&](float (&s)[BN / 8][4], int it) {
                const uint32_t ph = (kit + (uint32_t)it) & 1u;
                mbar_wait(bar(L::k_full), ph);
                /* both halves in before the first product: a wait between the two groups makes ptxas
                 * fence the second (C7519, "warpgroup.arrive injected") */
                if constexpr (kAsymKHalves) mbar_wait(bar(L::kb_full), ph);
                wg_fence();
                if constexpr (kAsymKHalves) {
                    issue_s(s, 0, KS / 2);
                    wg_commit();
                    issue_s(s, KS / 2, KS);
                } else {
                    issue_s(s, 0, KS);
                }
                wg_commit();
            };
            /* S done, with `later` (std::integral_constant) groups committed behind it still running;
             * K released as its halves are read (the first refilled under the second's products) */
            auto retire_s = [&](float (&s)[BN / 8][4], auto later) {
                constexpr int LATER = decltype(later)::value;
                if constexpr (kAsymKHalves) {
                    wg_wait<LATER + 1>();
                    mbar_arrive_if(bar(L::k_empty), lane == 0);
                }
                wg_wait<LATER>();
                reg_fence(s);
                mbar_arrive_if(bar(kAsymKHalves ? L::kb_empty : L::k_empty), lane == 0);
            };
            /* tile it's softmax; alpha rescales O before its P V */
            auto softmax_of = [&](float (&s)[BN / 8][4], float (&alpha)[2], int it) {
                const long long kt = kt0 + it;
                mbar_arrive_if(bar(L::q_empty), lane == 0 && it == n - 1); /* the item's last read of Q */
                softmax_scores<BN, CAP>(p, s, row_max, row_sum, alpha, rows, kt * BN, !(kt >= ut0 && kt < ut1), t4, scale2);
            };
            /* its P packed as A fragments and handed to consumer 1 with the rows' factors */
            auto hand_over = [&](const float (&s)[BN / 8][4], uint32_t (&pa)[4][4], const float (&alpha)[2], int it) {
                pack_a<T, BN>(pa, s);
                const uint32_t slot = handover_slot(pit + (uint32_t)it);
#pragma unroll
                for (int kk = 0; kk < 4; kk++) stsm_x4(sP + slot * L::P + blk_off<BM>(f_row, 2 * kk + f_chunk), pa[kk]);
                alphas[slot * 128 + tid] = make_float2(alpha[0], alpha[1]);
                mbar_arrive_if(bar(L::p_full + slot), true);
            };
            if constexpr (!kAsymOverlap) {
                for (int it = 0; it < n; it++) {
                    float s[BN / 8][4], alpha[2];
                    uint32_t pa[4][4];
                    issue_s_groups(s, it);
                    retire_s(s, std::integral_constant<int, 0>{});
                    softmax_of(s, alpha, it);
                    hand_over(s, pa, alpha, it);
                    rescale_lazy<32>(reinterpret_cast<float (&)[32][4]>(acc), alpha);
                    product_and_release(pa, it);
                }
            } else if (n > 0) {
                /* OVERLAP: tile it's S is issued, then the last tile's O += P V behind it, and the
                 * softmax runs while that product does */
                uint32_t pa[4][4]; /* P of the tile whose product is next */
                {
                    float s[BN / 8][4], alpha[2];
                    issue_s_groups(s, 0);
                    retire_s(s, std::integral_constant<int, 0>{});
                    softmax_of(s, alpha, 0);
                    hand_over(s, pa, alpha, 0);
                    rescale_lazy<32>(reinterpret_cast<float (&)[32][4]>(acc), alpha);
                }
                for (int it = 1; it < n; it++) {
                    float s[BN / 8][4], alpha[2];
                    uint32_t pn[4][4];
                    reg_fence(pa);
                    reg_fence(acc);
                    issue_s_groups(s, it);
                    /* tile it - 1's half of V, refilled from this consumer's release one tile ago,
                     * waited for while S runs; the fence orders the wait before the product */
                    mbar_wait(bar(L::vf_full), (kit + (uint32_t)it - 1u) & 1u);
                    wg_fence();
                    issue_pv(pa);
                    wg_commit();
                    retire_s(s, std::integral_constant<int, 1>{});
                    softmax_of(s, alpha, it);
                    wg_wait<0>();
                    reg_fence(acc);
                    mbar_arrive_if(v_empty, lane == 0); /* tile it - 1's half of V read (never the staged last) */
                    /* P packed only now, as FlashAttention 3 does: packing it while the product runs
                     * makes ptxas serialize every wgmma of the kernel (C7513, input registers defined
                     * in the product's pipeline stage) */
                    hand_over(s, pn, alpha, it);
                    rescale_lazy<32>(reinterpret_cast<float (&)[32][4]>(acc), alpha);
#pragma unroll
                    for (int kk = 0; kk < 4; kk++)
#pragma unroll
                        for (int e = 0; e < 4; e++) pa[kk][e] = pn[kk][e];
                }
                product_and_release(pa, n - 1);
            }
            /* consumer 1 divides its columns by the same row sums (each thread's quarter, as here) */
            const uint32_t slot = handover_slot(pit + (uint32_t)n);
            alphas[slot * 128 + tid] = make_float2(row_sum[0], row_sum[1]);
            mbar_arrive_if(bar(L::p_full + slot), true);
        } else {
            for (int it = 0; it < n; it++) {
                const uint32_t slot = handed_over_slot(pit + (uint32_t)it);
                uint32_t pa[4][4];
#pragma unroll
                for (int kk = 0; kk < 4; kk++) ldsm_x4(pa[kk], sP + slot * L::P + blk_off<BM>(f_row, 2 * kk + f_chunk));
                const float2 a2 = alphas[slot * 128 + tid];
                mbar_arrive_if(bar(L::p_empty + slot), true);
                const float alpha[2] = {a2.x, a2.y};
                rescale_lazy<32>(reinterpret_cast<float (&)[32][4]>(acc), alpha);
                product_and_release(pa, it);
            }
            const uint32_t slot = handed_over_slot(pit + (uint32_t)n);
            const float2 sums = alphas[slot * 128 + tid];
            mbar_arrive_if(bar(L::p_empty + slot), true);
            row_sum[0] = sums.x, row_sum[1] = sums.y; /* row_max is read only with column 0 (the lse) */
        }
        if (staged && n > 0) {
            store_rows_staged<T, 256, BN>(p, reinterpret_cast<const float (&)[32][4]>(acc), row_max, row_sum, i0, b, h,
                                          aligned + L::v + cw * 4 * (BN * 128), 0, w4, lane, cw * 256);
            fence_proxy_async(); /* the stage's reads and writes before the TMA load that refills it */
            __syncwarp();
            mbar_arrive_if(v_empty, lane == 0); /* the warp's 16 rows copied out */
        } else {
            store_rows<T, 32>(p, reinterpret_cast<const float (&)[32][4]>(acc), row_max, row_sum, rows, b, h, t4, cw * 256);
        }
        pit += (uint32_t)n + 1, kit += (uint32_t)n;
        qi += n > 0;
    });
#endif
}

/* ---- host side ---- */

/* the forwards' maps: Q, K, V (K and V span key rows; write_seq_maps) */
constexpr unsigned kKeyMaps = 0b110;

/* the rectangular instance (VARLEN false) on a (query tiles, heads, B) grid, or the varlen one over
 * the sequences (over_sequences), tiles from the longest */
template <typename T, int D, bool PIPELINED, Cap CAP, bool VARLEN>
static wa_status launch(const kparams &kp, const CUtensorMap &q, const CUtensorMap &k, const CUtensorMap &v, int sms, cudaStream_t s) {
    static volatile unsigned long long done = 0;
    constexpr int ORDER = VARLEN || !PIPELINED ? 0 : kFwdOrder<D>;
    constexpr size_t bytes = ws_layout<D, ORDER != 0>::bytes;
    CUDA_TRY(raise_once(fwd_ws_kernel<T, D, PIPELINED, CAP, VARLEN, ORDER>, bytes, &done));
    const CUtensorMap maps[3] = {q, k, v};
    const wa_status st = write_seq_maps(kp, maps, 3, kKeyMaps, s);
    if (st != WA_OK) return st;
    return over_sequences(kp, [&](const kparams &c, unsigned z) {
        const dim3 grid((unsigned)((kp.Nq + kBM - 1) / kBM), (unsigned)kp.Hq, z);
        if constexpr (ORDER != 0) { /* one CTA per SM, or per item where there are fewer */
            const long long items = (long long)grid.x * grid.y * grid.z;
            fwd_ws_kernel<T, D, PIPELINED, CAP, VARLEN, ORDER><<<(unsigned)(items < sms ? items : sms), kThreads, bytes, s>>>(q, k, v, c);
        } else {
            fwd_ws_kernel<T, D, PIPELINED, CAP, VARLEN><<<grid, kThreads, bytes, s>>>(q, k, v, c);
        }
        CUDA_TRY(cudaGetLastError());
        return WA_OK;
    });
}

template <typename T, int D, Cap CAP> static wa_status by_variant(const kparams &kp, const CUtensorMap (&maps)[3], int sms, cudaStream_t s) {
    if (kp.cu_q) return launch<T, D, true, CAP, true>(kp, maps[0], maps[1], maps[2], sms, s);
    /* WINATTN_CUDA=v4a: without the in-warpgroup overlap (for comparisons in dev/cuda; rectangular only) */
    const char *force = getenv("WINATTN_CUDA");
    const bool pipelined = !(force && !strcmp(force, "v4a"));
    return pipelined ? launch<T, D, true, CAP, false>(kp, maps[0], maps[1], maps[2], sms, s)
                     : launch<T, D, false, CAP, false>(kp, maps[0], maps[1], maps[2], sms, s);
}

template <typename T> static wa_status by_dim(const kparams &kp, const CUtensorMap (&maps)[3], int sms, cudaStream_t s) {
    return for_head_dim(kp.D, [&](auto d) {
        constexpr int D = decltype(d)::value;
        return kp.softcap > 0.0f ? by_variant<T, D, Cap::on>(kp, maps, sms, s) : by_variant<T, D, Cap::off>(kp, maps, sms, s);
    });
}

/* the lab's two-CTA form (-DWA_FWD512_CLUSTER) where query heads pair up on their K/V head */
#ifdef WA_FWD512_CLUSTER
constexpr bool kWidePairs = true;
#else
constexpr bool kWidePairs = false;
#endif

template <typename T, Cap CAP, bool VARLEN>
static wa_status launch_wide(const kparams &kp, const CUtensorMap (&maps)[3], int sms, cudaStream_t s) {
    static volatile unsigned long long done = 0, done_pair = 0;
    /* the split-D kernel (WA_FWD512_ASYM=0) is instantiated only when it is the one launched */
    const bool pair = kWideAsym == 0 && kWidePairs && kp.group % 2 == 0;
    constexpr bool PERSIST = kAsymPersist != 0 && !VARLEN;
    if constexpr (kWideAsym != 0) CUDA_TRY(raise_once(fwd_wide_asym_kernel<T, CAP, VARLEN, PERSIST>, asym_layout::bytes, &done));
    else if (pair) CUDA_TRY(raise_once(fwd_wide_ws_kernel<T, CAP, VARLEN, kWidePairs>, wide_layout::bytes, &done_pair));
    else CUDA_TRY(raise_once(fwd_wide_ws_kernel<T, CAP, VARLEN>, wide_layout::bytes, &done));
    const wa_status st = write_seq_maps(kp, maps, 3, kKeyMaps, s);
    if (st != WA_OK) return st;
    return over_sequences(kp, [&](const kparams &c, unsigned z) {
        const dim3 grid((unsigned)((kp.Nq + kWideBM - 1) / kWideBM), (unsigned)kp.Hq, z);
        if constexpr (PERSIST) { /* one CTA per SM, or per item where there are fewer */
            const long long items = (long long)grid.x * grid.y * grid.z;
            const unsigned ctas = (unsigned)(items < sms ? items : sms);
            fwd_wide_asym_kernel<T, CAP, VARLEN, PERSIST><<<ctas, kThreads, asym_layout::bytes, s>>>(maps[0], maps[1], maps[2], c);
        } else if constexpr (kWideAsym != 0) {
            fwd_wide_asym_kernel<T, CAP, VARLEN><<<grid, kThreads, asym_layout::bytes, s>>>(maps[0], maps[1], maps[2], c);
        } else if (pair) { /* clusters of two along the heads: 2c and 2c + 1 read K/V head 2c / group */
            cudaLaunchAttribute attr[1];
            attr[0].id = cudaLaunchAttributeClusterDimension;
            attr[0].val.clusterDim.x = 1, attr[0].val.clusterDim.y = 2, attr[0].val.clusterDim.z = 1;
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = grid, cfg.blockDim = dim3(kThreads), cfg.dynamicSmemBytes = wide_layout::bytes, cfg.stream = s;
            cfg.attrs = attr, cfg.numAttrs = 1;
            CUDA_TRY(cudaLaunchKernelEx(&cfg, fwd_wide_ws_kernel<T, CAP, VARLEN, kWidePairs>, maps[0], maps[1], maps[2], c));
        } else {
            fwd_wide_ws_kernel<T, CAP, VARLEN><<<grid, kThreads, wide_layout::bytes, s>>>(maps[0], maps[1], maps[2], c);
        }
        CUDA_TRY(cudaGetLastError());
        return WA_OK;
    });
}
template <typename T> static wa_status by_cap_wide(const kparams &kp, const CUtensorMap (&maps)[3], int sms, cudaStream_t s) {
    if (kp.cu_q)
        return kp.softcap > 0.0f ? launch_wide<T, Cap::on, true>(kp, maps, sms, s) : launch_wide<T, Cap::off, true>(kp, maps, sms, s);
    return kp.softcap > 0.0f ? launch_wide<T, Cap::on, false>(kp, maps, sms, s) : launch_wide<T, Cap::off, false>(kp, maps, sms, s);
}

/* the D = 512 forward on wgmma; -DWA_FWD_WIDE_MMA leaves D = 512 to the mma.sync form (lab) */
static bool wide_forward_head_dim(long long D) {
#ifdef WA_FWD_WIDE_MMA
    (void)D;
    return false;
#else
    return D == kWideD;
#endif
}

} /* namespace */

/* The virtual architecture of the code the driver loaded for one of this file's kernels, as CUB's
 * PtxVersion reads it: 90 for the sm_90a SASS, 80 where the compute_80 PTX was JIT-compiled (a GPU
 * with no SASS here, or any GPU under CUDA_FORCE_PTX_JIT=1), whose Hopper kernels are stubs. Every
 * .cu file is built for the same targets, so the driver makes the same choice for each. No launch:
 * safe during stream capture. */
int hopper_code_loaded(void) {
    cudaFuncAttributes a;
    if (cudaFuncGetAttributes(&a, fwd_ws_kernel<__nv_bfloat16, 128, true, Cap::off, false>) != cudaSuccess) {
        (void)cudaGetLastError(); /* not left behind for the launch checks */
        return 0;
    }
    return a.ptxVersion >= 90;
}

/* Without a softcap the kernels fold the scale into exp2's argument (softmax_scores, mma_prims.cuh),
 * which needs it positive; a negative scale (0 means 1/sqrt(D) by then), which no model uses, runs
 * on versions 2/3. */
int hopper_forward_supports(const kparams &kp) {
    return !hopper_forced_off() && (hopper_head_dim(kp.D) || wide_forward_head_dim(kp.D)) && kp.Nq > 0 && kp.Nk > 0 &&
           (kp.softcap > 0.0f || kp.scale > 0.0f) && tensor_map_encoder() != nullptr;
}

wa_status hopper_forward(const kparams &kp, wa_dtype dt, const cuda_target &t, cudaStream_t s, int *taken) {
    *taken = 0;
    if (!hopper_forward_supports(kp)) return WA_OK;
    const int D = (int)kp.D, wide = D == kWideD;
    const int bm = wide ? kWideBM : kBM, bn = wide ? (kWideAsym ? kAsymBN : kWideBN) : D == 256 ? ws_bn<256>() : D == 128 ? ws_bn<128>() : ws_bn<64>();
    CUtensorMap maps[3];
    const long long nb = map_batch(kp), nq = map_q_rows(kp), nk = map_k_rows(kp);
    if (!tensor_map(&maps[0], kp.q, dt, nb, kp.Hq, nq, D, bm) || !tensor_map(&maps[1], kp.k, dt, nb, kp.Hkv, nk, D, bn) ||
        !tensor_map(&maps[2], kp.v, dt, nb, kp.Hkv, nk, D, bn))
        return WA_OK;
    *taken = 1;
    if (wide) return dt == WA_BF16 ? by_cap_wide<__nv_bfloat16>(kp, maps, t.sms, s) : by_cap_wide<__half>(kp, maps, t.sms, s);
    return dt == WA_BF16 ? by_dim<__nv_bfloat16>(kp, maps, t.sms, s) : by_dim<__half>(kp, maps, t.sms, s);
}

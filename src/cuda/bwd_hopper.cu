/* bwd_hopper.cu — version 4 of the backward for f16/bf16 at D = 64, 128, 256: wgmma, TMA and
 * warp-specialised CTAs like the version-4 forward (fwd_hopper.cu); and the same design at D = 512
 * with the work split between the consumers by role (dkdv_wide_ws_kernel, dq_wide_ws_kernel,
 * "head dim 512" below). Two forms:
 *   fused (the default at D = 64 and 128): prep, dK/dV with dQ added into an f32 accumulator by
 *          bulk reduce-adds, convert. Five tile products per visible pair (FlashAttention-3's
 *          count); dq's last bits depend on the order the adds land in.
 *   ordered (wa_context_params.cuda_deterministic at D = 128, rectangular calls;
 *          WA_DQ_ORDERED): the fused form with each block of the accumulator
 *          summed in one fixed order (ORDERED, dq_order), so dq is bit-identical run to run.
 *   deterministic (cuda_deterministic elsewhere, and always at D = 256): prep, dK/dV, dQ;
 *          every output element written once by one thread, no atomics; seven tile products per
 *          visible pair (the dQ kernel forms S and dP again), the price of determinism without
 *          a dQ workspace.
 * The kernels:
 *
 *   prep   δ_i = dO_i · O_i and lse2_i = lse_i·log2(e) into row-padded arrays (+inf for rows past
 *          Nq and rows that see nothing, so their P is 0 without a test). δ is the diagonal of
 *          dO Oᵀ taken on wgmma, the instruction that forms dP below: with a one-key window
 *          O_i = V_j bitwise, so dP_ij − δ_i is exactly 0 and dq = dk = 0 exactly, as the parity
 *          sweep's window-1 cases demand (versions 1 and 2 did the same with their own orders).
 *          Fused: also zeroes the dQ accumulator.
 *   dK/dV  one CTA per 128 keys (D ≤ 128) or 64 keys (D = 256) of a kv head, over the group's
 *          query heads and the query tiles the window allows (64 queries a step). Warpgroup 0
 *          loads (TMA: K and V once; Q and dO per step into a two-stage ring). At D ≤ 128 each
 *          consumer warpgroup owns 64 keys with their dK and dV and does all four products
 *          (Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, dV += Pᵀ dO, dK += dSᵀ Q), and in the fused form a fifth,
 *          dQ = dS K (kv_layout below). At D = 256 dK and dV of 64 keys do not both fit one
 *          warpgroup's registers, so the work is split by output: warpgroup 1 forms Sᵀ, Pᵀ and
 *          dV; warpgroup 2 forms dPᵀ and, with Pᵀ handed over through shared memory (f32, two
 *          buffers, named barriers), dSᵀ and dK. Each does two products.
 *   dQ     (deterministic) one CTA per 128 query rows (two consumer warpgroups of 64 rows, one
 *          producer), over the key tiles the window allows: S = Q Kᵀ, dP = dO Vᵀ, dS,
 *          dQ += dS K; the forward's structure with lse and δ known.
 *   convert (fused, ordered) dq = the f32 accumulator rounded to the dtype.
 * Masks, tile ranges and edge tiles come from tile_geometry.h. docs/cuda.md has the measurements. */
#include "hopper_prims.cuh"

#include <stdlib.h>
#include <string.h>

namespace {

constexpr int kThreads = 384; /* producer + two consumer warpgroups */
constexpr int kProducerRegs = 24, kConsumerRegs = 240;

/* the P·dP step of one accumulator element: dS with respect to the raw q·k (scale and the
 * softcap's derivative included); x is the raw score, lse2 and delta the row's (or column's) */
template <Cap CAP>
__device__ __forceinline__ void prob_of(const kparams &p, float x, float lse2, float scale2, float &pv, float &dcap) {
    if (CAP == Cap::on) {
        const float t = tanhf(x * p.scale / p.softcap);
        pv = exp2_(p.softcap * t * kLog2e - lse2);
        dcap = 1.0f - t * t;
    } else {
        pv = exp2_(x * scale2 - lse2);
        dcap = 1.0f;
    }
}

/* Two ways to split a CTA's work between its consumer warpgroups:
 *   by rows (D ≤ 128): 128 keys per CTA, each warpgroup owns 64 of them with both dK and dV in
 *     registers (2 × 64 × D / 128 ≤ 128 per thread) and does all four products for them;
 *   by output (D = 256): 64 keys per CTA, warpgroup 1 owns dV, warpgroup 2 dK (256 registers per
 *     thread would not fit one), Pᵀ goes from the first to the second through shared memory. */
template <int D> __host__ __device__ constexpr bool kv_by_rows() { return D <= 128; }
template <int D> __host__ __device__ constexpr int kv_keys() { return kv_by_rows<D>() ? 128 : 64; }

/* ---- prep: δ and lse2 ---- */

template <int D> constexpr size_t prep_smem_bytes() { return 1024 + (size_t)2 * 64 * D * 2; }

/* ZERO_ALL false (the ordered dQ with its first shares stored, kOrderedFirstStores): only the
 * accumulator tiles no key tile adds to are zeroed */
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

/* ---- dK, dV ---- */

/* The fused form (by rows only, the atomic-dQ option): each step also forms dQ = dS K for its 64
 * queries and adds it to an f32 accumulator in global memory. dSᵀ (bf16/f16) goes to shared memory,
 * where a wgmma reads it transposed as the A operand, beside K read transposed as B. Each warpgroup
 * forms 64 columns of the step's dQ: at D = 128 columns [64 cw, 64 cw + 64) over all 128 keys (so
 * it reads the other warpgroup's dSᵀ rows too: both meet at a named barrier), at D = 64 all 64
 * columns over its own 64 keys (a 32-column half could not use the 128-byte swizzle, whose atom is
 * 64 values wide). The 64 × 64 f32 result is stored to shared memory in fragment order and added
 * to the accumulator by one bulk reduce-add (cp.reduce.async.bulk), which the hardware performs
 * at L2; dq_convert_kernel turns the accumulator into dq. */
template <int D> __host__ __device__ constexpr bool dq_split_columns() {
#ifdef WA_DQ_OWN_KEYS /* lab: at D = 128 too each warpgroup forms dQ over its own keys, both column blocks in turn */
    return false;
#else
    return D == 128;
#endif
}

template <int D, bool FUSE> struct kv_layout {
    static constexpr int KEYS = kv_keys<D>();
    static constexpr uint32_t KV = KEYS * D * 2, QT = 64 * D * 2;
    /* fused: dSᵀ of the CTA's keys × 64 queries, two buffers by step parity; each warpgroup's
     * 64 × 64 f32 share of dQ before its reduce-add */
    static constexpr uint32_t DS = FUSE ? KEYS * 64 * 2 : 0, DQ_STAGE = FUSE ? 64 * 64 * 4 : 0;
    /* per consumer warpgroup and step parity, the step's lse2[64] and δ[64] (by rows) or the one
     * of them it needs (by output) */
    static constexpr uint32_t STATS = kv_by_rows<D>() ? 512 : 256;
    /* K, V; Q and dO per stage; stats; Pᵀ exchange buffers (by output); barriers */
    static constexpr uint32_t k = 0, v = KV, q = 2 * KV, dout = q + 2 * QT, ds = dout + 2 * QT, dq_stage = ds + 2 * DS,
                              stats = dq_stage + 2 * DQ_STAGE, xchg = stats + 4 * STATS,
                              bars = xchg + (kv_by_rows<D>() ? 0 : 2 * 64 * 64 * 4);
    static constexpr uint32_t n_bars = 1 + 2 * 2; /* kv_full; per stage full, empty */
    static constexpr size_t bytes = 1024 + bars + 8 * n_bars;
};
/* named barriers (by output): Pᵀ of buffer b ready (1 + b), buffer b free again (3 + b); a
 * consumer warpgroup's stats written (5 + its index); fused: the step's dSᵀ written (7, both
 * warpgroups, or 7 + its index), a warpgroup's dQ share staged (9 + its index), its staging
 * buffer read by the reduce-add (11 + its index, dq_writer below) */
constexpr int kReady = 1, kFree = 3, kStats = 5, kDsWritten = 7, kDqStaged = 9, kDqFree = 11, kTurn = 13;

/* Who issues the fused form's dQ reduce-adds (rectangular calls; varlen ones add from registers):
 * as FlashAttention 3 and 4 do, warp 1 + w of the producer warpgroup for consumer warpgroup w.
 * The consumers store their share to shared memory, fence and only arrive at a named barrier
 * (kDqStaged); the writer waits there, issues the bulk reduce-add, waits for its read of the
 * buffer and hands the buffer back (kDqFree). Before (WA_BWD_DQ_WRITER=0 builds it), thread 0 of
 * each consumer warpgroup issued it after a barrier of the whole warpgroup, where 3.6 % of the
 * (b) kernel's stall samples sat, 5.8 % more on the fence before it. Measured: (b) backward
 * +6-8 % at 8K, causal D = 128 +6 %, D = 64 within 1 % (docs/cuda.md). */
#ifndef WA_BWD_DQ_WRITER
#define WA_BWD_DQ_WRITER 1
#endif
constexpr bool kDqWriter = WA_BWD_DQ_WRITER != 0;
/* (one share per warpgroup and step: dQ's columns split between the warpgroups, or D = 64) */
template <int D, bool FUSE, bool VARLEN> __host__ __device__ constexpr bool dq_writer() {
    return kDqWriter && FUSE && !VARLEN && (dq_split_columns<D>() || D == 64);
}

/* The ordered dQ (ORDERED below; the deterministic form where hopper_backward_orders_dq says so,
 * rectangular calls): the fused kernel with each 64 × 64 block of the accumulator summed in one
 * fixed order, as FlashAttention 3's deterministic mode orders its dQ adds: the key tiles' shares
 * in ascending order, and at D = 64, where both warpgroups of a CTA add to the same block,
 * warpgroup 0's before 1's. A counter per block (kp.dq_order, zeroed by prep) holds the shares
 * added so far; a writer waits until it reads the number that come before its own, issues the
 * reduce-add, and once its writes are done adds one (release; WA_DQ_ORDER_LAG below says when it
 * checks). The CTAs start in ascending key tile (heaviest_first across heads), so a CTA waits only
 * on CTAs that started before it; step_walk orders each CTA's steps so that it reaches a block no
 * sooner than its lower neighbour. It replaces the dQ kernel, which forms S and dP again (seven
 * tile products per visible pair against five), where it measured faster:
 * WA_DQ_ORDERED (hopper_backward_orders_dq)
 *   1 (the default): at D = 128: (b) 8K / 32K 514-515 / 510-553 TFLOP/s against the dQ kernel's
 *     486-487 / 496-505 (fused 556-557 / 543-582), causal 8K 548-549 against 500-503
 *     (`ROWS=det FUSED=default CHECK=build sh dev/cuda/bwd_variants.sh kernel "-DWA_DQ_ORDERED=0"`
 *     at 78b9705);
 *   2 (lab): every D <= 128 rectangular call; at D = 64 (a 1024 window) it lost, 209-210 against
 *     278-280: both warpgroups' shares go to one block, the second waiting for the first's count
 *     (without the waits, WA_DQ_ORDER_LAB=1, 274-277; `… bwd_variants.sh o2 "-DWA_DQ_ORDERED=2"
 *     …` at 33455c4);
 *   0: never.
 * (docs/cuda.md, *Tried and measured*.) */
#ifndef WA_DQ_ORDERED
#define WA_DQ_ORDERED 1
#endif
/* When a writer counts its share in: 1 (default), once the next share's reduce-add is issued, by
 * waiting for all but the newest bulk group (the last share's at the end), so that the wait for
 * the writes to be done is not between two of its shares; 0, right after its own reduce-add's
 * writes are done (the next share waits for that; 5-7 % slower at (b), docs/cuda.md). */
#ifndef WA_DQ_ORDER_LAG
#define WA_DQ_ORDER_LAG 1
#endif
static_assert(WA_DQ_ORDER_LAG == 0 || WA_DQ_ORDER_LAG == 1, "WA_DQ_ORDER_LAG is 0 or 1");
/* Lab, to take the ordered form's cost apart (dq is then not deterministic): 1, the writer does not
 * wait for the shares before its own (it still waits for its writes and counts); 2, neither waits
 * nor counts (the step order alone). Measured with both walks (docs/cuda.md, *Tried and measured*) */
#ifndef WA_DQ_ORDER_LAB
#define WA_DQ_ORDER_LAB 0
#endif
constexpr bool kOrderWaits = WA_DQ_ORDER_LAB == 0, kOrderCounts = WA_DQ_ORDER_LAB != 2;
/* The ordered form's first share of each block (key tile kt0's; at D = 64 its warpgroup 0's) is
 * stored by a bulk copy rather than added, so that prep need not zero the accumulator (half of its
 * bytes): only the tiles no key tile reaches (prep_kernel's ZERO_ALL). WA_DQ_FIRST_STORES 1 (the
 * default) or 0 (prep zeroes, every share adds): deterministic (b) 8K 537-539 TFLOP/s against
 * 531-534, causal D = 128 566-570 against 565 (the bwd_variants.sh run of WA_DQ_CONVERT_STAGED). */
#ifndef WA_DQ_FIRST_STORES
#define WA_DQ_FIRST_STORES 1
#endif
constexpr bool kOrderedFirstStores = WA_DQ_FIRST_STORES != 0 && kOrderWaits;

/* The order of a dK/dV CTA's steps, (query head of the group, query tile): head by head, each's
 * tiles from the first. ORDERED: from the last tile, which decides when a CTA reaches a block its
 * lower neighbour (key tile n - 1) must add to first, and how long a block waits in L2 between
 * the two (the Q, dO and accumulator tiles of a query head and tile, 64 KB at D = 128):
 *   - walks that end at the last query tile (causal, no left bound, and under a left window the
 *     key tiles whose window reaches the end): tile by tile, the group's heads inside. All such
 *     walks reach a block at the same step, the neighbour's share counted one step later; head by
 *     head, a CTA would reach its next head 2·h steps before its neighbour, whose walk is two
 *     tiles longer, and wait for it.
 *   - the others (a left window): head by head, each head's tiles from the last. Key tile n
 *     reaches a block two steps after n − 1 (the window moves two 64-row tiles per 128 keys).
 *     With the heads inside that was 2·group steps, in which the GPU touches about 1,000 other
 *     blocks, more than L2 holds: the step order alone, without a wait, lost 14 % / 27 % at (b)
 *     8K / 32K (WA_DQ_ORDER_LAB=2, docs/cuda.md; `python3 dev/cuda/dq_order_sim.py` models both).
 *     Two heads inside (four steps of slack; -DWA_DQ_WALK_INSIDE=2 at f665a66) measured no gain.
 * Two counters (head, tile) moved on at the end of each step: the signed 32-bit division of a step
 * index costs about 40 instructions a step (dev/cuda/sass_mix.py), and the counters measured 2-4 %
 * faster at D = 64 and 128 (docs/cuda.md, *Tried and measured*) */
template <bool ORDERED> struct step_walk {
    int head = 0, tile; /* the step's query head of the group, its query tile (from the CTA's first) */
    const int nqt, group;
    const bool heads_inside; /* ORDERED: tile by tile, the heads inside */
    __device__ __forceinline__ step_walk(int nqt_, long long group_, bool ends_at_last_tile)
        : tile(ORDERED ? nqt_ - 1 : 0), nqt(nqt_), group((int)group_), heads_inside(ends_at_last_tile) {}
    __device__ __forceinline__ void next() {
        if (!ORDERED) {
            if (++tile == nqt) tile = 0, head++;
        } else if (heads_inside) {
            if (++head == group) head = 0, tile--;
        } else if (--tile < 0) {
            tile = nqt - 1, head++;
        }
    }
};

/* the ordered form's wait: until *flag reads `want` (acquire, so that the reduce-adds the count
 * stands for are seen). A count that never comes would be a bug in the geometry; rather than hang
 * the device the CTA traps after about 2^28 polls (seconds), which the call reports as a CUDA error */
__device__ __forceinline__ void wait_count(const int *flag, int want) {
    for (unsigned polls = 0;; polls++) {
        int v;
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
        if (v == want) break;
        if (polls > (1u << 28)) __trap();
        if (polls > 16) __nanosleep(64);
    }
}
/* the ordered form's hand-on: one more share of the block is in (release, after its writes) */
__device__ __forceinline__ void count_share(int *flag) {
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(flag) : "memory");
}

/* Lab (-DWA_BWD_PINGPONG): by rows, the two consumer warpgroups take turns to issue each batch
 * of products (Sᵀ and dPᵀ; dV and dK), as the forward's pingpong (fwd_hopper.cu), named barriers
 * kTurn + w. Measured no gain where it matters (dev/cuda/bwd_pingpong.sh, commit 4002eb0):
 * fused (b) 367 / 411-416 against 370 / 416-421, D = 64 212 against 221; only the deterministic
 * form gained at 8K and D = 64 (333 against 327, 197 against 187) and lost at 32K (352-355
 * against 359), so it stays off. */
#ifdef WA_BWD_PINGPONG
constexpr bool kBwdPingpong = true;
#else
constexpr bool kBwdPingpong = false;
#endif

/* Step overlap (by rows): each warpgroup overlaps its own products with its element-wise work
 * inside a step, with its products split into commit groups as FlashAttention 4's SM90 backward
 * splits them (it issues dV later, once dSᵀ is written): Sᵀ and dPᵀ in two commit groups, so Pᵀ
 * is formed while dPᵀ still runs; dV += Pᵀ dO issued as soon as Pᵀ is packed, so dSᵀ is formed
 * while it runs; in the fused form dQ = dS K issued before dK += dSᵀ Q, so the step's dQ share is
 * staged and its reduce-add issued while dK runs. The products and their operands are the same
 * as without, so are the results, bit for bit. The dS arithmetic and the dV and dK issue are
 * written out here and in the form below rather than shared: a shared lambda changed the SASS of
 * both forms (same sizes, other schedules), and these are the measured ones. WA_BWD_STEP_OVERLAP:
 *   1 (the default): the fused kernel at D = 128 only, where it measured faster (two runs of
 *     dev/cuda/bwd_variants.sh, docs/cuda.md: (b) 8K +1-3 %, 32K -3 to +9 % (+2 % on average),
 *     causal D = 128 +1-2 %);
 *   2 (lab): every by-rows kernel; slower at D = 64 (-7 %) and in the deterministic form at D = 128
 *     (-3 % at (b) 8K), so those keep the order below;
 *   0: none (nor with the lab's pingpong, which orders the products across the warpgroups).
 * -DWA_BWD_OVERLAP_DK_FIRST (lab) issues dK before dQ (dK runs while the warpgroup waits for the
 * other's dSᵀ; the staging of dQ then runs under nothing). */
#ifndef WA_BWD_STEP_OVERLAP
#define WA_BWD_STEP_OVERLAP 1
#endif
template <int D, bool FUSE> __host__ __device__ constexpr bool step_overlap() {
    return !kBwdPingpong && (WA_BWD_STEP_OVERLAP == 2 || (WA_BWD_STEP_OVERLAP == 1 && FUSE && D == 128));
}
#ifdef WA_BWD_OVERLAP_DK_FIRST
constexpr bool kOverlapDkFirst = true;
#else
constexpr bool kOverlapDkFirst = false;
#endif

/* Two details of FlashAttention 4's SM90 backward, taken (docs/cuda.md, *Tried and measured*):
 * - WA_DS_STMATRIX 1: the fused forms write dSᵀ to shared memory by four stmatrix a step (each lane
 *   addressing one 16-byte row chunk of the 128-byte swizzle) instead of sixteen 4-byte stores;
 * - WA_BWD_STATS_EARLY 1: with the step overlap, each thread of the default (unordered) form reads
 *   its 16 lse2 values from shared memory into registers while Sᵀ runs, not after waiting for it.
 *   It spills 8 bytes (nvcc 13.0, `-Xptxas -v`: the consumers are at their 240 registers there;
 *   δ read before the wait for dPᵀ too: 8 bytes, δ before the wait for Sᵀ: 72); 2 (lab) does it
 *   in the ordered form too, which lost 2-4 % in the steady state.
 * Together, `winattn bench` backward pairs against the earlier form (three runs): (b) 8K +2 % per
 * call, D = 64 +1-4 %, causal D = 128 at 8K +1-7 %, at 32K within the runs' spread; the
 * deterministic form (stmatrix only) within the spread. 0 builds the earlier forms. */
#ifndef WA_DS_STMATRIX
#define WA_DS_STMATRIX 1
#endif
#ifndef WA_BWD_STATS_EARLY
#define WA_BWD_STATS_EARLY 1
#endif

/* The order the dK/dV CTAs start in (the grid is key tiles × kv heads). Across heads (the
 * default): the first key tiles of every head first, so that under a causal mask the longest CTAs
 * start first. Head-major (lab, -DWA_DKDV_HEAD_MAJOR=1 for dkdv_ws_kernel, =2 for the D = 512 one
 * too): a head's key tiles one after another, so that the CTAs running together are neighbouring
 * key tiles of one or two heads, whose query tiles (Q and dO loads, dQ reduce-adds) stay in L2
 * while all of them pass; across heads, the 132 CTAs at (b) span 16 key tiles of all 8 heads and
 * each dQ tile's contributions come in two waves. Measured (dev/cuda/bwd_variants.sh, docs/cuda.md):
 * head-major cuts the fused (b) 8K kernel's DRAM bytes from 1.44 GB to 0.47 GB (the minimum) and
 * still takes 12.5 % more cycles ((b) 8K backward 442-446 TFLOP/s against 496-499, causal D = 128
 * 429-432 against 511-512); at D = 512 +0-2 %, within the runs' spread. Not kept. */
#ifndef WA_DKDV_HEAD_MAJOR
#define WA_DKDV_HEAD_MAJOR 0
#endif
constexpr bool kDkdvAcrossHeads = WA_DKDV_HEAD_MAJOR == 0, kDkdvWideAcrossHeads = WA_DKDV_HEAD_MAJOR < 2;
/* Lab (-DWA_DKDV_HEAD_BAND=G, the by-rows dK/dV kernel's default form): across G kv heads at a time,
 * the bands of G heads one after another (G = all heads is the default order, 1 head-major), so
 * that the CTAs running together span G heads and more key tiles of each: the key tiles that add
 * to one query tile's dQ block run in fewer waves (DRAM bytes, docs/cuda.md *Next*). The last
 * WA_DKDV_BAND_TAIL key tiles of every head come after all bands, across all heads: the shortest
 * CTAs of a window clipped at the last query (and of a causal mask) then fill the last wave, as
 * they do in the default order (`python3 dev/cuda/dq_order_sim.py --bands 2 --tails 0,16`: at (b)
 * 32K 1.027 of the ideal time without them, 1.000 with 16). Grids under WA_DKDV_BAND_MIN_CTAS CTAs
 * keep the default order (at (b) 8K, 512 CTAs, a band of 2 still ends 3 % late on paper). The
 * ordered dQ keeps the default order (its waits assume every head's tile k - 1 started before k).
 * Each head's key tiles still start in ascending order. Measured without the tail at f1e10a9
 * (`ROWS=det SANITIZE=0 CHECK="build-band4" sh dev/cuda/bwd_variants.sh band4 "-DWA_DKDV_HEAD_BAND=4" band2 …`,
 * the ordered form banded too): (b) 8K 547 (G = 4) and 528-530 (G = 2) TFLOP/s against 558-559,
 * causal D = 128 571-580 against 566, deterministic (b) 8K 461-465 and 367-370 against 531-538.
 * As here, in the steady state at 8895e62 (`LAB_CALLS=10 ROWS=fused … bwd_variants.sh b2t16
 * "-DWA_DKDV_HEAD_BAND=2" b1t32 "-DWA_DKDV_HEAD_BAND=1 -DWA_DKDV_BAND_TAIL=32" …`): (b) 32K 508-514
 * (G = 2) and 511-512 (G = 1, tail 32) against 506-507, causal 32K 550 and 554-557 against 540-548;
 * through PyTorch within the harness's spread (docs/cuda.md). Not kept. */
#ifndef WA_DKDV_HEAD_BAND
#define WA_DKDV_HEAD_BAND 0
#endif
#ifndef WA_DKDV_BAND_TAIL
#define WA_DKDV_BAND_TAIL 16
#endif
#ifndef WA_DKDV_BAND_MIN_CTAS
#define WA_DKDV_BAND_MIN_CTAS 1024
#endif
template <int D, bool ORDERED> __device__ __forceinline__ cta_tile dkdv_cta_order() {
    constexpr bool banded = WA_DKDV_HEAD_BAND > 0 && kDkdvAcrossHeads && !ORDERED && kv_by_rows<D>();
    const unsigned T = gridDim.x, H = gridDim.y;
    if (!banded || T * H < (unsigned)WA_DKDV_BAND_MIN_CTAS) return heaviest_first<kDkdvAcrossHeads>(false);
    constexpr unsigned G = WA_DKDV_HEAD_BAND > 0 ? WA_DKDV_HEAD_BAND : 1; /* (1 only to compile the default) */
    const unsigned linear = blockIdx.x + T * blockIdx.y;
    const unsigned in_bands = T > WA_DKDV_BAND_TAIL ? T - WA_DKDV_BAND_TAIL : 0; /* key tiles per head in the bands */
    if (linear >= in_bands * H) { /* the tail: its key tiles across all heads */
        const unsigned r = linear - in_bands * H;
        return {(int)(in_bands + r / H), (int)(r % H)};
    }
    const unsigned band = linear / (G * in_bands), h0 = band * G;
    const unsigned in_band = linear - band * G * in_bands, g = H - h0 < G ? H - h0 : G; /* the last band may be narrower */
    return {(int)(in_band / g), (int)(h0 + in_band % g)};
}

/* The softmax scale in the by-rows dK/dV kernels (D <= 128), as FlashAttention 3 and 4 place it:
 * dSᵀ is formed without it, and dK = scale · Σ dSᵀ Q once at the end, dQ = scale · Σ dS K in the
 * kernel that rounds the fused form's accumulator (dq_convert_kernel, convert_dq_rows), instead
 * of a multiply on every element of dSᵀ (32 a step per thread). dS is rounded to the dtype
 * before the scale rather than after (1/√D is not a power of two): the same sums, other
 * roundings. Measured with the step counters: D = 64 +3 %, D = 128 within the runs' spread
 * (docs/cuda.md). The by-output kernels (D = 256) keep the scale in dS. */

/* lse2 and δ of a step's 64 queries (by rows, rectangular calls). WA_BWD_STATS_TMA:
 *   1 (the default): the producer loads them by two bulk copies into the step's stage beside Q
 *     and dO, counted on its full barrier; every consumer thread arrives on the stage's empty
 *     barrier once its reads are done (256 arrivals, the form of the D = 512 dS hand-back that
 *     racecheck follows). Against 0 in one run (`ROWS=det SANITIZE=0 CHECK="build-st1 build-st2"
 *     sh dev/cuda/bwd_variants.sh st1 "-DWA_BWD_STATS_TMA=1" st2 "-DWA_BWD_STATS_TMA=2"` at
 *     af9e003, two rounds): D = 64 (1024 window, 16K) 309-310 TFLOP/s against 293-295, (b) 8K
 *     557-560 against 552-555, causal D = 128 8K 569-570 against 566-568; deterministic (b) 8K
 *     531-533 against 515, D = 64 285-288 against 276-279, causal 560-563 against 546-550;
 *   0: each consumer thread fetches one value from global memory before the step's products and
 *     stores it to shared memory; a named barrier of the warpgroup (kStats) publishes them;
 *   2 (lab): as 1, one arrival per consumer warp after a __syncwarp (as 1 but at (b) 32K
 *     deterministic 505-517 against 542-558). */
#ifndef WA_BWD_STATS_TMA
#define WA_BWD_STATS_TMA 1
#endif
template <int D, bool VARLEN> __host__ __device__ constexpr bool stats_by_tma() {
    return WA_BWD_STATS_TMA != 0 && kv_by_rows<D>() && !VARLEN;
}

template <typename T, int D, Cap CAP, bool FUSE, bool VARLEN, bool ORDERED = false>
__global__ void __launch_bounds__(kThreads, 1)
    dkdv_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo,
                   const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv, const kparams kp) {
#if WA_HOPPER_STUB /* not the sm_90a compilation: never launched (common.cuh) */
    __trap();
#else
    using L = kv_layout<D, FUSE>;
    constexpr int DB = D / 64, KS = D / 16, QT = L::QT, KEYS = L::KEYS;
    constexpr bool BY_ROWS = kv_by_rows<D>();
    static_assert(!FUSE || BY_ROWS, "dQ is fused into the by-rows form only");
    static_assert(!ORDERED || dq_writer<D, FUSE, VARLEN>(), "the ordered dQ is the writer warps'");
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char *aligned = smem + (((smem_u32(smem) + 1023u) & ~1023u) - smem_u32(smem));
    const uint32_t base = smem_u32(aligned);
    const uint32_t sK = base + L::k, sV = base + L::v, sQ = base + L::q, sdO = base + L::dout, bar = base + L::bars;
    const uint32_t kv_full = bar;
    auto full = [&](int s) { return bar + 8 * (1 + 2 * s); };
    auto empty = [&](int s) { return bar + 8 * (2 + 2 * s); };

    const int warp = warp_index(), wg = warp >> 2, lane = threadIdx.x & 31;
    const cta_tile at = dkdv_cta_order<D, ORDERED>(); /* the first key tiles first: under a causal mask they are the longest */
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const long long hk = at.head, b = sv.b(), j0 = at.tile * KEYS;
    if (VARLEN && j0 >= p.Nk) return; /* past this sequence's keys: the whole CTA, before the barriers exist */
    const int nk = (int)min((long long)KEYS, p.Nk - j0);
    const long long q_row0 = VARLEN ? p.q_row0 : 0, k_row0 = VARLEN ? p.k_row0 : 0; /* TMA rows of the sequence */
    int64_t qt0, qt1;
    wa_query_tiles_for_cols(&p.win, j0, j0 + nk, 64, &qt0, &qt1);
    const int nqt = (int)(qt1 - qt0), steps = nqt * (int)p.group;
    const bool walk_ends_last = qt1 * 64 >= p.Nq; /* the ordered form's step order (step_walk) */
    /* fused: the accumulator's tile (of B·Hq·nq_pad/64, the order of add_dq and dq_convert_kernel)
     * for query tile qt of the group's query head `head` */
    auto dq_tile = [&](int head, long long qt) { return (b * p.Hq + hk * p.group + head) * (p.nq_pad / 64) + qt; };

    if (threadIdx.x == 0) {
        mbar_init(kv_full, 1);
        /* one arrival per consumer warp, or per consumer thread (stats_by_tma, WA_BWD_STATS_TMA 1) */
        constexpr uint32_t empty_arrivals = stats_by_tma<D, VARLEN>() && WA_BWD_STATS_TMA == 1 ? 256 : 8;
        for (int s = 0; s < 2; s++) mbar_init(full(s), 1), mbar_init(empty(s), empty_arrivals);
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) { /* producer */
        setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x == 0 && steps > 0) {
            /* varlen: the sequence's maps (seq_map), so that rows past it arrive as zeros */
            const CUtensorMap *mq = seq_map<VARLEN>(tq, kp, 0), *mdo = seq_map<VARLEN>(tdo, kp, 1), *mk = seq_map<VARLEN>(tk, kp, 2),
                              *mv = seq_map<VARLEN>(tv, kp, 3);
            mbar_expect_tx(kv_full, 2 * L::KV);
            for (int c = 0; c < DB; c++) {
                tma_load(sK + c * (KEYS * 128), mk, kv_full, c * 64, (int)(k_row0 + j0), (int)hk, (int)b);
                tma_load(sV + c * (KEYS * 128), mv, kv_full, c * 64, (int)(k_row0 + j0), (int)hk, (int)b);
            }
            step_walk<ORDERED> walk(nqt, p.group, walk_ends_last);
            for (int n = 0; n < steps; n++) {
                const int st = n & 1;
                const uint32_t ph = (uint32_t)(n >> 1) & 1u;
                const long long h = hk * p.group + walk.head, i0 = (qt0 + walk.tile) * 64;
                if (n >= 2) mbar_wait(empty(st), ph ^ 1u);
                mbar_expect_tx(full(st), 2 * QT + (stats_by_tma<D, VARLEN>() ? 512 : 0));
                for (int c = 0; c < DB; c++) {
                    tma_load(sQ + st * QT + c * (64 * 128), mq, full(st), c * 64, (int)(q_row0 + i0), (int)h, (int)b);
                    tma_load(sdO + st * QT + c * (64 * 128), mdo, full(st), c * 64, (int)(q_row0 + i0), (int)h, (int)b);
                }
                if constexpr (stats_by_tma<D, VARLEN>()) { /* lse2 then δ of the 64 rows (prep padded them to nq_pad) */
                    const long long at = (b * p.Hq + h) * p.nq_pad + i0;
                    bulk_load(base + L::stats + st * 512, p.lse2 + at, 256, full(st));
                    bulk_load(base + L::stats + st * 512 + 256, p.delta + at, 256, full(st));
                }
                walk.next();
            }
        } else if (dq_writer<D, FUSE, VARLEN>() && (warp == 1 || warp == 2) && steps > 0) {
            /* the dQ writer of consumer warpgroup w = warp - 1: each step's staged share into its
             * query tile of the accumulator (add_dq's order) */
            const int w = warp - 1, cb = dq_split_columns<D>() ? w : 0;
            const uint32_t stage = base + L::dq_stage + w * L::DQ_STAGE;
            /* ordered: shares per block and CTA (two at D = 64: both warpgroups add to one block) */
            constexpr int SHARES = dq_split_columns<D>() ? 1 : 2;
            step_walk<ORDERED> walk(nqt, p.group, walk_ends_last);
            int *counted = nullptr; /* ordered, WA_DQ_ORDER_LAG 1: the last share's block, not counted yet */
            for (int n = 0; n < steps; n++) {
                named_sync(kDqStaged + w, 160);
                if (lane == 0) {
                    const long long tile = dq_tile(walk.head, qt0 + walk.tile);
                    bool first = false; /* the block's first share: stored (kOrderedFirstStores) */
                    if constexpr (ORDERED && kOrderWaits) {
                        /* the shares before this one: the key tiles of this query tile below ours */
                        const long long qt = qt0 + walk.tile;
                        int64_t kt0, kt1;
                        wa_key_tiles_for_rows(&p.win, qt * 64, qt * 64 + 64, KEYS, &kt0, &kt1);
                        const int before = SHARES * (int)(at.tile - kt0) + (SHARES == 2 ? w : 0);
                        wait_count(p.dq_order + tile * DB + cb, before);
                        fence_proxy_async(); /* the reduce-add below (async proxy) after the acquire */
                        first = kOrderedFirstStores && before == 0;
                    }
                    if (first) bulk_store_f32(p.dq_acc + (tile * DB + cb) * 4096, stage, 64 * 64 * 4);
                    else bulk_reduce_add_f32(p.dq_acc + (tile * DB + cb) * 4096, stage, 64 * 64 * 4);
                    bulk_commit();
                    if (ORDERED && kOrderCounts && WA_DQ_ORDER_LAG == 1) {
                        if (counted) {
                            bulk_wait<1>(); /* the last share's writes are done */
                            fence_proxy_async();
                            count_share(counted);
                        }
                        counted = p.dq_order + tile * DB + cb;
                    }
                    bulk_wait_read<0>();
                }
                __syncwarp();
                if (n + 1 < steps) named_arrive(kDqFree + w, 160);
                if (ORDERED && kOrderCounts && WA_DQ_ORDER_LAG == 0 && lane == 0) {
                    bulk_wait<0>(); /* its writes are done */
                    fence_proxy_async();
                    count_share(p.dq_order + dq_tile(walk.head, qt0 + walk.tile) * DB + cb);
                }
                walk.next();
            }
            if (ORDERED && kOrderCounts && WA_DQ_ORDER_LAG == 1 && lane == 0 && counted) {
                bulk_wait<0>();
                fence_proxy_async();
                count_share(counted);
            }
            if (lane == 0) bulk_wait<0>(); /* the reduce-adds are done before the CTA's shared memory goes */
        }
        return;
    }

    setmaxnreg_inc<kConsumerRegs>();
    const int cw = wg - 1, w4 = warp & 3, g = lane >> 2, t4 = lane & 3, tid = threadIdx.x & 127;
    /* this warpgroup's 64 keys: its own (by rows) or the CTA's (by output) */
    const long long k0 = j0 + (BY_ROWS ? cw * 64 : 0);
    const long long keys[2] = {k0 + w4 * 16 + g, k0 + w4 * 16 + g + 8};
    const uint32_t kv_row = BY_ROWS ? cw * (64 * 128) : 0; /* its rows inside the K and V column blocks */
    const float scale2 = p.scale * kLog2e;
    /* by rows: dV in acc, dK in acc2; by output: dV (cw 0) or dK (cw 1) in acc */
    float acc[DB][8][4], acc2[BY_ROWS ? DB : 1][8][4];
    zero_frags(acc);
    zero_frags(acc2);
    auto fence_acc = [&]() {
        reg_fence(acc);
        if (BY_ROWS) reg_fence(acc2);
    };
    /* x (64 keys × 64 queries) = rows of `a_s` (K or V) times those of `b_s` (Q or dO), transposed */
    auto tile_product = [&](float (&x)[8][4], uint32_t a_s, uint32_t b_s) {
        const uint64_t a_d = gmma_desc(a_s + kv_row), b_d = gmma_desc(b_s);
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
            wgmma_ss<T, 64>(x, desc_at(a_d, (ks >> 2) * (KEYS * 128) + (ks & 3) * 32), desc_at(b_d, (ks >> 2) * (64 * 128) + (ks & 3) * 32),
                            ks > 0);
    };
    /* Pᵀ of the tile in place of Sᵀ (0 where masked); pd = what dS needs of it (P times the softcap's
     * derivative). The masked and the unmasked form are compiled apart (edge_form below). */
    auto probs_as = [&](float (&x)[8][4], float (&pd)[8][4], auto lse2_of, long long i0, auto edge_c) {
        const bool edge = edge_c;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            int lo = 0, hi = 63;
            if (edge) visible_query_cols<64>(p, keys[r], i0, lo, hi);
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; e++) {
                    const int c = nb * 8 + 2 * t4 + (e & 1);
                    float pv, dcap;
                    prob_of<CAP>(p, x[nb][e], lse2_of(nb, e & 1, c), scale2, pv, dcap);
                    if (edge && (c < lo || c > hi)) pv = 0.0f;
                    x[nb][e] = pv, pd[nb][e] = pv * dcap;
                }
        }
    };
    auto probs = [&](float (&x)[8][4], float (&pd)[8][4], const float *lse2, long long i0, bool edge) {
        edge_form<CAP>(edge, [&](auto edge_c) { probs_as(x, pd, [&](int, int, int c) { return lse2[c]; }, i0, edge_c); });
    };
    /* the same with each thread's lse2 values already in registers (WA_BWD_STATS_EARLY) */
    auto probs_early = [&](float (&x)[8][4], float (&pd)[8][4], const float (&lse2_r)[8][2], long long i0, bool edge) {
        edge_form<CAP>(edge, [&](auto edge_c) { probs_as(x, pd, [&](int nb, int j, int) { return lse2_r[nb][j]; }, i0, edge_c); });
    };

    /* fused: dSᵀ (packed as A fragments: rows w4·16 + g (+8), columns 16 kk + 2 t4 (+8)) into
     * this warpgroup's 64 rows of dS buffer `buf`, in the 128-byte swizzle: four stmatrix
     * (WA_DS_STMATRIX), or sixteen 4-byte stores (conflict-free: the 8 g of a warp hit 8 different
     * chunks) */
    auto write_ds = [&](const uint32_t (&pb)[4][4], int buf) {
        if constexpr (WA_DS_STMATRIX != 0) {
            /* pb[kk] is four 8 × 8 tiles: rows +0 / +8 of chunk 2 kk, then of chunk 2 kk + 1; lane l
             * addresses row l % 8 (+ 8 for tiles 1, 3) of chunk 2 kk (+ 1 for tiles 2, 3) */
            const uint32_t rows = base + L::ds + buf * L::DS;
            const int m_row = cw * 64 + w4 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, m_chunk = lane >> 4;
#pragma unroll
            for (int kk = 0; kk < 4; kk++) stsm_x4(rows + blk_off<KEYS>(m_row, 2 * kk + m_chunk), pb[kk]);
            fence_proxy_async();
            return;
        }
        unsigned char *rows = aligned + L::ds + buf * L::DS;
        const int r = cw * 64 + w4 * 16 + g;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            *(uint32_t *)(rows + blk_off<KEYS>(r, 2 * kk) + 4 * t4) = pb[kk][0];
            *(uint32_t *)(rows + blk_off<KEYS>(r + 8, 2 * kk) + 4 * t4) = pb[kk][1];
            *(uint32_t *)(rows + blk_off<KEYS>(r, 2 * kk + 1) + 4 * t4) = pb[kk][2];
            *(uint32_t *)(rows + blk_off<KEYS>(r + 8, 2 * kk + 1) + 4 * t4) = pb[kk][3];
        }
        fence_proxy_async(); /* the wgmma below reads them through the async proxy */
    };
    /* fused: this warpgroup's 64 columns of the step's dQ = dS K (see kv_layout), once the dSᵀ
     * rows it reads are written and its staging buffer's last reduce-add has read it */
    auto dq_product = [&](float (&dq)[8][4], int buf, int cb) {
        constexpr bool SPLIT = dq_split_columns<D>();
        constexpr int KEY_STEPS = SPLIT ? KEYS / 16 : 4;
        const int key0 = SPLIT ? 0 : cw * 64;
        if (!dq_writer<D, FUSE, VARLEN>() && tid == 0) bulk_wait_read<0>();
        if (SPLIT) named_sync(kDsWritten, 256);
        else named_sync(kDsWritten + cw, 128);
        const uint32_t a_s = opaque(base + L::ds + buf * L::DS + key0 * 128), b_s = opaque(sK + cb * (KEYS * 128) + key0 * 128);
        const uint64_t a_d = gmma_desc_mn(a_s, KEYS * 128), b_d = gmma_desc_mn(b_s, KEYS * 128);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < KEY_STEPS; kk++)
            wgmma_ss_tt<T, 64>(dq, desc_at(a_d, kk * (16 * 128)), desc_at(b_d, kk * (16 * 128)), kk > 0);
        wg_commit();
    };
    /* fused: dq (64 queries × 64 columns) into shared memory in fragment order, then one thread
     * adds it to query tile `tile` (of B·Hq·nq_pad/64) of the accumulator: this warpgroup's writer
     * warp (dq_writer; `first`: the CTA's first share, whose buffer nothing read before), or else
     * its thread 0; dq_convert_kernel knows the order */
    auto add_dq = [&](const float (&dq)[8][4], long long tile, int cb, bool first) {
        float4 *stage = (float4 *)(aligned + L::dq_stage + cw * L::DQ_STAGE);
        if (dq_writer<D, FUSE, VARLEN>() && !first) named_sync(kDqFree + cw, 160); /* the writer has read the last share */
#pragma unroll
        for (int nb = 0; nb < 8; nb++) stage[nb * 128 + tid] = make_float4(dq[nb][0], dq[nb][1], dq[nb][2], dq[nb][3]);
        fence_proxy_async();
        if (dq_writer<D, FUSE, VARLEN>()) {
            named_arrive(kDqStaged + cw, 160); /* the writer issues the reduce-add */
            return;
        }
        named_sync(kDqStaged + cw, 128);
        if (tid == 0) {
            bulk_reduce_add_f32(p.dq_acc + (tile * DB + cb) * 4096, smem_u32(stage), 64 * 64 * 4);
            bulk_commit();
        }
    };

    /* fused, varlen: dq (64 queries × 64 columns, block cb) added from registers into rows i0.. of
     * head h of the row-major [Hq, Tq, D] accumulator, by vector reductions, the sequence's rows
     * only: a sequence's 64-row tiles do not line up with the packed rows, so the fragment-order
     * tiles of add_dq (one bulk reduce-add each) would need 64 padded rows per sequence. Not timed;
     * reductions from registers in fragment order (red.v4) measured 14 % slower than add_dq at (b)
     * in the rectangular kernel (dev/cuda/dq_red.patch) */
    auto add_dq_rows = [&](const float (&dq)[8][4], long long h, long long i0, int cb) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const long long row = i0 + w4 * 16 + g + 8 * r;
            float *dst = p.dq_acc + (ws_head<true>(p, b, h, 0) + row) * D + cb * 64 + 2 * t4;
#pragma unroll
            for (int nb = 0; nb < 8; nb++) red_add_v2_if(dst + nb * 8, dq[nb][2 * r], dq[nb][2 * r + 1], row < p.Nq);
        }
    };

    /* pingpong turns (lab): two per step */
    pingpong<kBwdPingpong && BY_ROWS> turns(kTurn, cw, 2 * steps);

    int64_t uq0 = 0, uq1 = 0; /* the query tiles that see all of the CTA's keys: no mask (a ragged key tile: none) */
    if (nk == KEYS) wa_unmasked_query_tiles(&p.win, j0, j0 + nk, 64, &uq0, &uq1);

    if (steps > 0) mbar_wait(kv_full, 0);
    step_walk<ORDERED> walk(nqt, p.group, walk_ends_last);
    for (int n = 0; n < steps; n++) {
        const int st = n & 1, buf = n & 1;
        const uint32_t ph = (uint32_t)(n >> 1) & 1u;
        const long long qt = qt0 + walk.tile, i0 = qt * 64;
        const bool edge = !(qt >= uq0 && qt < uq1);
        const uint32_t q_s = opaque(sQ + st * QT), do_s = opaque(sdO + st * QT);
        /* lse2 and δ of the step's 64 queries: by rows on rectangular calls, in the stage beside Q
         * and dO (stats_by_tma); otherwise each thread of the warpgroup fetches one value before
         * the tile products and stores it to shared memory while they run, and a named barrier of
         * the warpgroup publishes them (two buffers by step parity, so a fast warp's next store
         * cannot meet a slow warp's reads). Reading them where used (from L1) measured 5-12 %
         * slower at D <= 128. An earlier form by bulk copies, released by one arrival per warp,
         * drew racecheck hazards; with every thread arriving it draws none (docs/cuda.md). */
        const long long at = VARLEN ? ws_head<true>(p, b, hk * p.group + walk.head, 0) + i0
                                    : (b * p.Hq + hk * p.group + walk.head) * p.nq_pad + i0;
        constexpr bool TMA_STATS = stats_by_tma<D, VARLEN>();
        /* by TMA: the stage's (the producer's bulk copies); else this warpgroup's, by step parity */
        float *wstats = (float *)(aligned + L::stats + (TMA_STATS ? st * 512 : (cw * 2 + (n & 1)) * L::STATS));
        const float *lse2 = wstats, *delta = BY_ROWS ? wstats + 64 : wstats;
        const bool fetcher = !TMA_STATS && (BY_ROWS || tid < 64);
        float mine = 0.0f;
        if (fetcher && !VARLEN)
            mine = BY_ROWS ? (tid < 64 ? p.lse2[at + tid] : p.delta[at + tid - 64]) : (cw == 0 ? p.lse2 : p.delta)[at + tid];
        if (fetcher && VARLEN) {
            /* rows past the sequence are the next one's: they stand in as rows past Nq do (lse2 =
             * +inf, δ = 0, so P = dS = 0), which the masks ensure in any case */
            const bool want_lse2 = BY_ROWS ? tid < 64 : cw == 0;
            const int r = BY_ROWS ? tid & 63 : tid;
            mine = i0 + r < p.Nq ? (want_lse2 ? p.lse2 : p.delta)[at + r] : want_lse2 ? INFINITY : 0.0f;
        }
        mbar_wait(full(st), ph);
        auto publish_stats = [&]() {
            if (TMA_STATS) return; /* they came with Q and dO */
            if (fetcher) wstats[tid] = mine;
            named_sync(kStats + cw, 128);
        };

        float s[8][4], pd[8][4];
        uint32_t pa[4][4];
        if constexpr (BY_ROWS && step_overlap<D, FUSE>()) {
            /* Sᵀ | dPᵀ | dV += Pᵀ dO | [fused: dQ = dS K] | dK += dSᵀ Q, each its own commit group,
             * each waited for only where its result is needed */
            float dp[8][4];
            wg_fence();
            tile_product(s, opaque(sK), q_s);
            wg_commit();
            tile_product(dp, opaque(sV), do_s);
            wg_commit();
            publish_stats();
            constexpr bool STATS_EARLY = WA_BWD_STATS_EARLY == 2 || (WA_BWD_STATS_EARLY == 1 && !ORDERED);
            float lse2_r[8][2]; /* STATS_EARLY: this thread's columns' lse2, read while Sᵀ runs */
            if constexpr (STATS_EARLY) {
#pragma unroll
                for (int nb = 0; nb < 8; nb++)
#pragma unroll
                    for (int j = 0; j < 2; j++) lse2_r[nb][j] = lse2[nb * 8 + 2 * t4 + j];
            }
            wg_wait<1>(); /* Sᵀ */
            reg_fence(s);
            if constexpr (STATS_EARLY) probs_early(s, pd, lse2_r, i0, edge);
            else probs(s, pd, lse2, i0, edge);
            pack_a<T, 64>(pa, s);
            reg_fence(pa);
            fence_acc();
            wg_fence();
            const uint64_t do_d = gmma_desc_mn(do_s, 64 * 128), q_d = gmma_desc_mn(q_s, 64 * 128);
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wide_mn_product<T, D>(acc, pa[kk], desc_at(do_d, kk * (16 * 128)));
            wg_commit();
            wg_wait<1>(); /* dPᵀ; dV still runs */
            reg_fence(dp);
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int c = nb * 8 + 2 * t4 + (e & 1);
                    s[nb][e] = pd[nb][e] * (dp[nb][e] - delta[c]); /* dSᵀ / scale */
                }
            uint32_t pb[4][4];
            pack_a<T, 64>(pb, s);
            if constexpr (FUSE) {
                static_assert(dq_split_columns<D>() || D == 64, "one dQ block per warpgroup and step");
                write_ds(pb, n & 1);
                auto dk_product = [&]() {
                    reg_fence(pb);
                    wg_fence();
#pragma unroll
                    for (int kk = 0; kk < 4; kk++) wide_mn_product<T, D>(acc2, pb[kk], desc_at(q_d, kk * (16 * 128)));
                    wg_commit();
                };
                float dq[8][4];
                if (kOverlapDkFirst) dk_product();
                dq_product(dq, n & 1, dq_split_columns<D>() ? cw : 0); /* its own commit group */
                if (!kOverlapDkFirst) dk_product();
                if (kOverlapDkFirst) wg_wait<0>();
                else wg_wait<1>(); /* dV and dQ; dK still runs */
                reg_fence(dq);
                reg_fence(pa);
                const long long tile = dq_tile(walk.head, qt);
                if constexpr (VARLEN) add_dq_rows(dq, hk * p.group + walk.head, i0, dq_split_columns<D>() ? cw : 0);
                else add_dq(dq, tile, dq_split_columns<D>() ? cw : 0, n == 0);
            } else {
                reg_fence(pb);
                wg_fence();
#pragma unroll
                for (int kk = 0; kk < 4; kk++) wide_mn_product<T, D>(acc2, pb[kk], desc_at(q_d, kk * (16 * 128)));
                wg_commit();
            }
            wg_wait<0>();
            reg_fence(pa);
            reg_fence(pb);
            fence_acc();
        } else if constexpr (BY_ROWS) {
            /* Sᵀ and dPᵀ, then dV += Pᵀ dO and dK += dSᵀ Q, all for this warpgroup's keys */
            float dp[8][4];
            turns.begin();
            wg_fence();
            tile_product(s, opaque(sK), q_s);
            tile_product(dp, opaque(sV), do_s);
            wg_commit();
            turns.end();
            publish_stats();
            wg_wait<0>();
            reg_fence(s);
            reg_fence(dp);
            probs(s, pd, lse2, i0, edge);
            pack_a<T, 64>(pa, s);
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int c = nb * 8 + 2 * t4 + (e & 1);
                    s[nb][e] = pd[nb][e] * (dp[nb][e] - delta[c]); /* dSᵀ / scale */
                }
            uint32_t pb[4][4];
            pack_a<T, 64>(pb, s);
            /* before the products that read pb: reading a wgmma's A registers while it runs is undefined */
            if constexpr (FUSE) write_ds(pb, n & 1);
            reg_fence(pa);
            reg_fence(pb);
            fence_acc();
            turns.begin();
            wg_fence();
            const uint64_t do_d = gmma_desc_mn(do_s, 64 * 128), q_d = gmma_desc_mn(q_s, 64 * 128);
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wide_mn_product<T, D>(acc, pa[kk], desc_at(do_d, kk * (16 * 128)));
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wide_mn_product<T, D>(acc2, pb[kk], desc_at(q_d, kk * (16 * 128)));
            wg_commit();
            turns.end();
            if constexpr (FUSE) {
                const long long tile = dq_tile(walk.head, qt);
                /* split columns: this warpgroup's block; own keys: every block in turn */
                constexpr int BLOCKS = dq_split_columns<D>() ? 1 : DB;
#pragma unroll
                for (int c = 0; c < BLOCKS; c++) {
                    const int cb = dq_split_columns<D>() ? cw : c;
                    float dq[8][4];
                    dq_product(dq, n & 1, cb);
                    wg_wait<0>();
                    if (c == 0) fence_acc();
                    reg_fence(dq);
                    if constexpr (VARLEN) add_dq_rows(dq, hk * p.group + walk.head, i0, cb);
                    else add_dq(dq, tile, cb, n == 0 && c == 0);
                }
            } else {
                wg_wait<0>();
                fence_acc();
            }
        } else {
            float4 *xchg = (float4 *)(aligned + L::xchg + buf * (64 * 64 * 4));
            wg_fence();
            tile_product(s, opaque(cw == 0 ? sK : sV), cw == 0 ? q_s : do_s); /* cw 0: Sᵀ = K Qᵀ; cw 1: dPᵀ = V dOᵀ */
            wg_commit();
            publish_stats();
            wg_wait<0>();
            reg_fence(s);
            if (cw == 0) {
                probs(s, pd, lse2, i0, edge);
                if (n >= 2) named_sync(kFree + buf, 256);
#pragma unroll
                for (int nb = 0; nb < 8; nb++) xchg[nb * 128 + tid] = make_float4(pd[nb][0], pd[nb][1], pd[nb][2], pd[nb][3]);
                named_arrive(kReady + buf, 256);
            } else {
                named_sync(kReady + buf, 256);
#pragma unroll
                for (int nb = 0; nb < 8; nb++) {
                    const float4 q4 = xchg[nb * 128 + tid];
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int c = nb * 8 + 2 * t4 + (e & 1);
                        const float pde = e == 0 ? q4.x : e == 1 ? q4.y : e == 2 ? q4.z : q4.w;
                        s[nb][e] = pde * (s[nb][e] - delta[c]) * p.scale; /* dSᵀ */
                    }
                }
                if (n + 2 < steps) named_arrive(kFree + buf, 256);
            }
            pack_a<T, 64>(pa, s);
            /* cw 0: dV += Pᵀ dO; cw 1: dK += dSᵀ Q (the second operand read transposed, as V in the forward) */
            const uint32_t m_s = opaque(cw == 0 ? do_s : q_s);
            reg_fence(pa);
            fence_acc();
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wide_mn_product<T, D>(acc, pa[kk], desc_at(gmma_desc_mn(m_s, 64 * 128), kk * (16 * 128)));
            wg_commit();
            wg_wait<0>();
            fence_acc();
        }
        if (stats_by_tma<D, VARLEN>() && WA_BWD_STATS_TMA == 2) __syncwarp(); /* the warp's reads of the stats are done */
        mbar_arrive_if(empty(st), lane == 0 || (stats_by_tma<D, VARLEN>() && WA_BWD_STATS_TMA == 1));
        walk.next();
    }
    /* the reduce-adds are done before the CTA's shared memory goes (dq_writer: the writers wait) */
    if (FUSE && !dq_writer<D, FUSE, VARLEN>() && tid == 0) bulk_wait<0>();
    if constexpr (BY_ROWS) {
        store_frag_rows<T, DB * 8>(p.dv, reinterpret_cast<const float (&)[DB * 8][4]>(acc), keys, p.Nk, b, hk, t4);
        scale_frags(acc2, p.scale); /* dK = scale · Σ dSᵀ Q: the scale left out of dSᵀ */
        store_frag_rows<T, DB * 8>(p.dk, reinterpret_cast<const float (&)[DB * 8][4]>(acc2), keys, p.Nk, b, hk, t4);
    } else {
        store_frag_rows<T, DB * 8>(cw == 0 ? p.dv : p.dk, reinterpret_cast<const float (&)[DB * 8][4]>(acc), keys, p.Nk, b, hk, t4);
    }
#endif
}

/* ---- dQ ---- */

/* key tile: dQ (64 × D f32), S and dP (64 × BN each) in 240 registers; and Q, dO (128 × D) with
 * two stages of K and V in shared memory */
/* The softmax scale stays out of dS and dQ is scaled once at the end, as in the by-rows dK/dV
 * kernels (one multiply less per element of every key tile): the deterministic (b) backward +2-5 %
 * (docs/cuda.md, *Results*). -DWA_DQ_FOLD_SCALE=0 builds the scale into dS. */
#ifndef WA_DQ_FOLD_SCALE
#define WA_DQ_FOLD_SCALE 1
#endif
constexpr bool kDqFoldScale = WA_DQ_FOLD_SCALE != 0;
template <int D> __host__ __device__ constexpr int dq_bn() { return D == 256 ? 32 : 64; }

template <int D> struct dq_layout {
    static constexpr int BM = 128, BN = dq_bn<D>();
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
                        float ds = pv * (dp[nb][e] - delta[r]) * dcap * (kDqFoldScale ? 1.0f : p.scale);
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
    if (kDqFoldScale) scale_frags(acc, p.scale);
    store_frag_rows<T, DB * 8>(p.dq, reinterpret_cast<const float (&)[DB * 8][4]>(acc), rows, p.Nq, b, h, t4);
#endif
}

/* ---- head dim 512 ----
 * dK and dV of 64 keys, or dQ of 64 query rows, over 512 columns take 256 accumulator registers a
 * thread in one warpgroup, and Q and dO of 64 rows alone fill 128 KB of shared memory. So at D = 512
 * the two consumer warpgroups split each step by role (version 4's split by output at D = 256, with
 * D rather than the keys as the products' M where that saves registers):
 *   dK/dV  one CTA per 32 keys, K and V resident (64 KB), Q and dO of each 64-query step in one
 *          stage (128 KB), loaded and released in kQParts parts along D. Warpgroup 1 forms
 *          S = Q Kᵀ (64 queries × 32 keys, all of D), P, and dVᵀ += dOᵀ P; warpgroup 2 forms
 *          dP = dO Vᵀ, and with P (times the softcap's derivative, f32) handed over through shared
 *          memory, dS and dKᵀ += Qᵀ dS. The second products take D as M (eight m64n32k16 column
 *          blocks, A = dO or Q read transposed, B = P or dS stored transposed in shared memory): dVᵀ
 *          or dKᵀ of 512 × 32 is 128 registers a thread. Each warpgroup does half of every step's
 *          work: 8.4 MFLOP per step and CTA, 64 FLOP per byte brought from L2 (docs/cuda.md).
 *   dQ     one CTA per 64 query rows, Q and dO resident (128 KB), key tiles of kDqWideBN in a ring of
 *          kDqWideStages. Warpgroup 1 forms S and P and hands P (f32) to warpgroup 2, which forms
 *          dP and dS and hands dS back (bf16, as A fragments); each then adds dS K for its 256 of
 *          dQ's columns (m64n256k16, dS from registers, K read transposed: 128 registers).
 * dP's k steps run in the order prep's δ takes (one chain over all of D), so a one-key window still
 * gives dP − δ = 0 exactly. */
constexpr int kWideD = 512, kWideKeys = 32;
/* The parts Q and dO are loaded and released in along D: 4 (the default), or 1 (whole), 2, 8 (lab).
 * With parts, each part of Q and of dO has its own full / empty mbarriers and Q and dO a producer
 * thread each; the first product waits for each part just before its k steps, and the second
 * product commits a group per part and releases each part as its group completes, so that the
 * next step's first parts are refilled, and its first product starts on them, while this step's
 * last products still run (one stage of 128 KB leaves no room for a second). `winattn bench`
 * backward TFLOP/s at (c) 8K causal / D = 512 with a 1024 window at 16K, per call: 4 parts
 * 311-316 / 272, 2 parts 309-313 / 270-271, whole 303-305 / 264, 8 parts 274 / 249-250
 * (dev/cuda/bwd_d512_wgmma.sh variants, docs/cuda.md). */
#ifndef WA_DKDV512_PARTS
#define WA_DKDV512_PARTS 4
#endif
constexpr int kQParts = WA_DKDV512_PARTS;
static_assert(kQParts == 1 || kQParts == 2 || kQParts == 4 || kQParts == 8, "Q and dO whole or in 2, 4 or 8 parts");
/* lab: the dQ kernel's key tile, 32 (one stage) or 16 (two) */
#ifndef WA_DQ512_BN
#define WA_DQ512_BN 32
#endif
constexpr int kDqWideBN = WA_DQ512_BN, kDqWideStages = kDqWideBN == 16 ? 2 : 1;
static_assert(kDqWideBN == 16 || kDqWideBN == 32, "the dQ kernel's key tiles");
using dq_wide_ring = kv_ring_of<kDqWideStages>;
/* named barriers of both kernels: the f32 P of buffer b ready (1 + b) and free again (3 + b); a
 * warpgroup's own transposed tile written (5 + its index); dQ kernel: dS of buffer b ready (7 + b)
 * and free again (9 + b) */
constexpr int kWideReady = 1, kWideFree = 3, kWideOwn = 5, kWideDsReady = 7, kWideDsFree = 9;

struct kv_wide_layout {
    static constexpr uint32_t KV = kWideKeys * kWideD * 2, QT = 64 * kWideD * 2;
    static constexpr uint32_t P32 = 64 * kWideKeys * 4, P16 = 64 * kWideKeys * 2;
    /* K, V; Q, dO; P (f32, two buffers by step parity); P and dS stored transposed for the second
     * products (1024-byte aligned: the 128-byte swizzle); barriers */
    static constexpr uint32_t k = 0, v = KV, q = 2 * KV, dout = q + QT, xp = dout + QT, sp = xp + 2 * P32, sds = sp + P16,
                              bars = sds + P16;
    static constexpr uint32_t n_bars = 1 + 4 * kQParts; /* kv_full; per part of Q and dO, full and empty */
    static constexpr size_t bytes = 1024 + bars + 8 * n_bars;
};
static_assert(kv_wide_layout::bytes <= 232448, "the D = 512 dK/dV kernel fits the 227 KB a CTA may have");
static_assert(kv_wide_layout::sp % 1024 == 0 && kv_wide_layout::sds % 1024 == 0, "swizzled tiles start 1024-byte aligned");

/* The dQ kernel hands dS back behind mbarriers (a full and an empty one per buffer, every thread of
 * a warpgroup arriving). The named-barrier form (bar.arrive by the writer, bar.sync by the reader,
 * as the P hand-over) is as correct, but compute-sanitizer's racecheck reports hundreds of
 * thousands of hazards on it, and on the same handshake alone with every value checked
 * (dev/cuda/racecheck_exchange.cu), while it passes the mbarrier form clean; the two time within
 * the run-to-run spread (docs/cuda.md). -DWA_LAB_DS_NAMED builds the named-barrier form. */
#ifdef WA_LAB_DS_NAMED
constexpr bool kDsMbar = false;
#else
constexpr bool kDsMbar = true;
#endif

struct dq_wide_layout {
    static constexpr int BN = kDqWideBN;
    static constexpr uint32_t QT = 64 * kWideD * 2, TILE = BN * kWideD * 2;
    /* Q, dO; the ring's K and V stages; P (f32) and dS (A fragments), two buffers each; barriers */
    static constexpr uint32_t q = 0, dout = QT, k = 2 * QT, v = k + kDqWideStages * TILE, xp = v + kDqWideStages * TILE,
                              xds = xp + 2 * 64 * BN * 4, bars = xds + 2 * 64 * BN * 2;
    static constexpr uint32_t ds_bars = bars + 8 * dq_wide_ring::n_bars; /* kDsMbar: full 0, 1, empty 0, 1 */
    static constexpr size_t bytes = 1024 + ds_bars + (kDsMbar ? 8 * 4 : 0);
};
static_assert(dq_wide_layout::bytes <= 232448, "the D = 512 dQ kernel fits the 227 KB a CTA may have");

/* lse2 (cw 0) or δ (cw 1) of a thread's two query rows of head h: the padding rows of the
 * rectangular workspace hold +inf and 0 (prep); a varlen sequence's rows past its end are the next
 * one's, replaced by the same */
template <bool VARLEN>
__device__ __forceinline__ void wide_row_stats(const kparams &p, long long b, long long h, const long long (&rows)[2], int cw,
                                               float (&stat)[2]) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const long long at = ws_head<VARLEN>(p, b, h, p.nq_pad) + rows[r];
        const bool ok = rows[r] < (VARLEN ? p.Nq : p.nq_pad);
        stat[r] = ok ? (cw == 0 ? p.lse2 : p.delta)[at] : cw == 0 ? INFINITY : 0.0f;
    }
}

/* The first product of a step in both kernels, waited for: s (64 queries × BN keys) = the 64 rows
 * of Q or dO at a_s times the BN rows of K or V at b_s, over all of D in one chain of 32 k steps
 * (prep's δ takes the same order). The chain's k steps come in PARTS parts along D, and
 * wait_part(x) is called before part x's are issued (the dK/dV kernel's parts of Q and dO). */
template <typename T, int BN, int PARTS = 1, typename WaitPart>
__device__ __forceinline__ void wide_scores(float (&s)[BN / 8][4], uint32_t a_s, uint32_t b_s, WaitPart &&wait_part) {
    constexpr int KS = kWideD / 16, PS = KS / PARTS;
    const uint64_t a_d = gmma_desc(opaque(a_s)), b_d = gmma_desc(opaque(b_s));
#pragma unroll
    for (int x = 0; x < PARTS; x++) {
        wait_part(x);
        wg_fence();
#pragma unroll
        for (int ks = x * PS; ks < (x + 1) * PS; ks++)
            wgmma_ss<T, BN>(s, desc_at(a_d, (ks >> 2) * (64 * 128) + (ks & 3) * 32), desc_at(b_d, (ks >> 2) * (BN * 128) + (ks & 3) * 32),
                            ks > 0);
    }
    wg_commit();
    wg_wait<0>();
    reg_fence(s);
}

/* the PARTS commit groups in flight, oldest first: each waited for in turn and release(x) called
 * once group x is done */
template <int PARTS, int X = 0, typename Release> __device__ __forceinline__ void release_groups_in_order(Release &&release) {
    if constexpr (X < PARTS) {
        wg_wait<PARTS - 1 - X>();
        release(X);
        release_groups_in_order<PARTS, X + 1>(release);
    }
}

/* cw 0's step of both kernels: S (64 queries × BN keys from j0, raw) becomes P in place and pd = P
 * times the softcap's derivative, 0 where masked (edge tiles only, compiled apart: edge_form) */
template <int BN, Cap CAP>
__device__ __forceinline__ void wide_probs(const kparams &p, float (&s)[BN / 8][4], float (&pd)[BN / 8][4], const long long (&rows)[2],
                                           const float (&lse2)[2], long long j0, bool edge, int t4, float scale2) {
    edge_form<CAP>(edge, [&](auto edge_c) {
        const bool masked = edge_c;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            int lo = 0, hi = BN - 1;
            if (masked) visible_cols<BN>(p, rows[r], j0, lo, hi);
#pragma unroll
            for (int nb = 0; nb < BN / 8; nb++)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; e++) {
                    const int c = nb * 8 + 2 * t4 + (e & 1);
                    float pv, dcap;
                    prob_of<CAP>(p, s[nb][e], lse2[r], scale2, pv, dcap);
                    if (masked && (c < lo || c > hi)) pv = 0.0f;
                    s[nb][e] = pv, pd[nb][e] = pv * dcap;
                }
        }
    });
}

/* cw 1's step of both kernels: dS = pd (from buffer x, written by cw 0 in fragment order) × (dP − δ)
 * × scale, in place of dP */
template <int BN>
__device__ __forceinline__ void wide_dscores(const kparams &p, float (&dp)[BN / 8][4], const float4 *x, const float (&delta)[2],
                                             int tid) {
#pragma unroll
    for (int nb = 0; nb < BN / 8; nb++) {
        const float4 v = x[nb * 128 + tid];
        const float pd[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < 4; e++) dp[nb][e] = pd[e] * (dp[nb][e] - delta[e >> 1]) * p.scale;
    }
}

template <typename T, Cap CAP, bool VARLEN>
__global__ void __launch_bounds__(kThreads, 1)
    dkdv_wide_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo,
                        const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv, const kparams kp) {
#if WA_HOPPER_STUB /* not the sm_90a compilation: never launched (common.cuh) */
    __trap();
#else
    using L = kv_wide_layout;
    constexpr int D = kWideD, KEYS = kWideKeys, DB = D / 64, HB = DB / kQParts;
    constexpr uint32_t PART = HB * (64 * 128); /* bytes of one part of Q or dO */
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char *aligned = smem + (((smem_u32(smem) + 1023u) & ~1023u) - smem_u32(smem));
    const uint32_t base = smem_u32(aligned);
    const uint32_t sK = base + L::k, sV = base + L::v, sQ = base + L::q, sdO = base + L::dout, bar = base + L::bars;
    const uint32_t kv_full = bar;
    auto q_full = [&](int x) { return bar + 8 * (1 + x); };
    auto q_empty = [&](int x) { return bar + 8 * (1 + kQParts + x); };
    auto do_full = [&](int x) { return bar + 8 * (1 + 2 * kQParts + x); };
    auto do_empty = [&](int x) { return bar + 8 * (1 + 3 * kQParts + x); };

    const int warp = warp_index(), wg = warp >> 2, lane = threadIdx.x & 31;
    const cta_tile at = heaviest_first<kDkdvWideAcrossHeads>(false); /* the first key tiles first: under a causal mask they are the longest */
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const long long hk = at.head, b = sv.b(), j0 = at.tile * KEYS;
    if (VARLEN && j0 >= p.Nk) return; /* past this sequence's keys: the whole CTA, before the barriers exist */
    const int nk = (int)min((long long)KEYS, p.Nk - j0);
    int64_t qt0, qt1;
    wa_query_tiles_for_cols(&p.win, j0, j0 + nk, 64, &qt0, &qt1);
    const int nqt = (int)(qt1 - qt0), steps = nqt * (int)p.group;

    if (threadIdx.x == 0) {
        mbar_init(kv_full, 1);
        for (int x = 0; x < kQParts; x++) {
            mbar_init(q_full(x), 1), mbar_init(do_full(x), 1);
            mbar_init(q_empty(x), 8), mbar_init(do_empty(x), 8); /* one arrival per consumer warp */
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) { /* producer: K and V once, then Q and dO of every step, part by part as released;
                    * in parts, Q by thread 0 and dO by thread 32, so that neither waits for the
                    * other's release */
        setmaxnreg_dec<kProducerRegs>();
        const bool loads_q = threadIdx.x == 0, loads_do = kQParts == 1 ? threadIdx.x == 0 : threadIdx.x == 32;
        if ((loads_q || loads_do) && steps > 0) {
            const CUtensorMap *mq = seq_map<VARLEN>(tq, kp, 0), *mdo = seq_map<VARLEN>(tdo, kp, 1);
            const long long q_row0 = VARLEN ? p.q_row0 : 0, k_row0 = VARLEN ? p.k_row0 : 0; /* TMA rows of the sequence */
            if (loads_q) {
                const CUtensorMap *mk = seq_map<VARLEN>(tk, kp, 2), *mv = seq_map<VARLEN>(tv, kp, 3);
                mbar_expect_tx(kv_full, 2 * L::KV);
                for (int c = 0; c < DB; c++) {
                    tma_load(sK + c * (KEYS * 128), mk, kv_full, c * 64, (int)(k_row0 + j0), (int)hk, (int)b);
                    tma_load(sV + c * (KEYS * 128), mv, kv_full, c * 64, (int)(k_row0 + j0), (int)hk, (int)b);
                }
            }
            for (int n = 0; n < steps; n++) {
                const uint32_t ph = (uint32_t)n & 1u;
                const int h = (int)(hk * p.group + n / nqt), row = (int)(q_row0 + (qt0 + n % nqt) * 64);
                /* part x of Q or dO into dst, once the consumers have released the previous step's */
                auto refill = [&](int x, uint32_t dst, const CUtensorMap *m, uint32_t full, uint32_t empty) {
                    if (n > 0) mbar_wait(empty, ph ^ 1u);
                    mbar_expect_tx(full, PART);
                    for (int c = x * HB; c < (x + 1) * HB; c++) tma_load(dst + c * (64 * 128), m, full, c * 64, row, h, (int)b);
                };
                for (int x = 0; x < kQParts; x++) {
                    if (loads_q) refill(x, sQ, mq, q_full(x), q_empty(x));
                    if (loads_do) refill(x, sdO, mdo, do_full(x), do_empty(x));
                }
            }
        }
        return;
    }

    setmaxnreg_inc<kConsumerRegs>();
    const int cw = wg - 1, w4 = warp & 3, g = lane >> 2, t4 = lane & 3, tid = threadIdx.x & 127;
    const float scale2 = p.scale * kLog2e;
    /* cw 0: dVᵀ, cw 1: dKᵀ; acc[c] holds rows (of D) 64 c .. 64 c + 63, columns the CTA's keys */
    float acc[DB][KEYS / 8][4];
    zero_frags(acc);
    int64_t uq0 = 0, uq1 = 0; /* the query tiles that see all of the CTA's keys: no mask (a ragged key tile: none) */
    if (nk == KEYS) wa_unmasked_query_tiles(&p.win, j0, j0 + nk, 64, &uq0, &uq1);
    /* the first product's operands (cw 0: S = Q Kᵀ, cw 1: dP = dO Vᵀ) and the second's (cw 0: dVᵀ =
     * dOᵀ P, cw 1: dKᵀ = Qᵀ dS, with the transposed tile this warpgroup writes) */
    const uint32_t first_a = cw == 0 ? sQ : sdO, first_b = cw == 0 ? sK : sV, second_a = cw == 0 ? sdO : sQ;
    const uint32_t own_tile = L::sp + cw * L::P16;
    auto first_full = [&](int x) { return cw == 0 ? q_full(x) : do_full(x); };
    auto first_empty = [&](int x) { return cw == 0 ? q_empty(x) : do_empty(x); };
    auto second_full = [&](int x) { return cw == 0 ? do_full(x) : q_full(x); };
    auto second_empty = [&](int x) { return cw == 0 ? do_empty(x) : q_empty(x); };

    if (steps > 0) mbar_wait(kv_full, 0);
    for (int n = 0; n < steps; n++) {
        const uint32_t ph = (uint32_t)n & 1u;
        const int buf = n & 1;
        const long long h = hk * p.group + n / nqt, qt = qt0 + n % nqt, i0 = qt * 64;
        const long long rows[2] = {i0 + w4 * 16 + g, i0 + w4 * 16 + g + 8};
        float stat[2]; /* cw 0: lse2, cw 1: δ of the thread's rows, fetched before the product runs */
        wide_row_stats<VARLEN>(p, b, h, rows, cw, stat);

        float s[KEYS / 8][4];
        wide_scores<T, KEYS, kQParts>(s, first_a, first_b, [&](int x) { mbar_wait(first_full(x), ph); });
        for (int x = 0; x < kQParts; x++) mbar_arrive_if(first_empty(x), lane == 0);

        float4 *xp = (float4 *)(aligned + L::xp + buf * L::P32);
        if (cw == 0) {
            float pd[KEYS / 8][4];
            wide_probs<KEYS, CAP>(p, s, pd, rows, stat, j0, !(qt >= uq0 && qt < uq1), t4, scale2);
            if (n >= 2) named_sync(kWideFree + buf, 256); /* warpgroup 2 read this buffer two steps ago */
#pragma unroll
            for (int nb = 0; nb < KEYS / 8; nb++) xp[nb * 128 + tid] = make_float4(pd[nb][0], pd[nb][1], pd[nb][2], pd[nb][3]);
            named_arrive(kWideReady + buf, 256);
        } else {
            named_sync(kWideReady + buf, 256);
            wide_dscores<KEYS>(p, s, xp, stat, tid);
            if (n + 2 < steps) named_arrive(kWideFree + buf, 256);
        }
        /* P (cw 0) or dS (cw 1), rounded, into this warpgroup's tile stored transposed (keys × the
         * step's 64 queries, one 128-byte swizzled column block): the B operand of the second product.
         * The last step's product that read it was waited for. */
        {
            unsigned char *tile = aligned + own_tile;
#pragma unroll
            for (int nb = 0; nb < KEYS / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = nb * 8 + 2 * t4 + (e & 1), q = w4 * 16 + g + 8 * (e >> 1);
                    *(T *)(tile + blk_off<KEYS>(key, q >> 3) + (q & 7) * 2) = from_f32<T>(s[nb][e]);
                }
            fence_proxy_async(); /* the wgmma below reads it through the async proxy */
            named_sync(kWideOwn + cw, 128);
        }
        {
            const uint64_t t_d = gmma_desc(opaque(base + own_tile));
#pragma unroll
            for (int x = 0; x < kQParts; x++) { /* each part's products issued as soon as it has landed */
                mbar_wait(second_full(x), ph);
                if (x == 0) reg_fence(acc);
                wg_fence();
#pragma unroll
                for (int c = x * HB; c < (x + 1) * HB; c++) {
                    const uint64_t m_d = gmma_desc_mn(opaque(second_a + c * (64 * 128)), 64 * 128);
#pragma unroll
                    for (int kk = 0; kk < 4; kk++) wgmma_ss_tn<T, KEYS>(acc[c], desc_at(m_d, kk * (16 * 128)), desc_at(t_d, kk * 32), 1);
                }
                wg_commit();
            }
            /* each part released as soon as its products are done, while the later parts' run */
            release_groups_in_order<kQParts>([&](int x) { mbar_arrive_if(second_empty(x), lane == 0); });
            reg_fence(acc);
        }
    }
    /* acc[c][nb][e] is row (of D) 64 c + 16 w4 + g + 8 (e / 2) of the key j0 + 8 nb + 2 t4 + e % 2 */
    const dev_tensor out = cw == 0 ? p.dv : p.dk; /* a copy: a reference into a varlen CTA's kparams put it on the stack */
#pragma unroll
    for (int nb = 0; nb < KEYS / 8; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const long long key = j0 + nb * 8 + 2 * t4 + (e & 1);
            if (key >= p.Nk) continue;
            T *row = row_of<T>(out, b, hk, key) + w4 * 16 + g + 8 * (e >> 1);
#pragma unroll
            for (int c = 0; c < DB; c++) row[c * 64] = from_f32<T>(acc[c][nb][e]);
        }
#endif
}

template <typename T, Cap CAP, bool VARLEN>
__global__ void __launch_bounds__(kThreads, 1)
    dq_wide_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo,
                      const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv, const kparams kp) {
#if WA_HOPPER_STUB /* not the sm_90a compilation: never launched (common.cuh) */
    __trap();
#else
    using L = dq_wide_layout;
    constexpr int D = kWideD, BM = 64, BN = L::BN, DB = D / 64, TILE = L::TILE;
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char *aligned = smem + (((smem_u32(smem) + 1023u) & ~1023u) - smem_u32(smem));
    const uint32_t base = smem_u32(aligned);
    const uint32_t sQ = base + L::q, sdO = base + L::dout, sK = base + L::k, sV = base + L::v;
    const dq_wide_ring ring{base + L::bars};

    const int warp = warp_index(), wg = warp >> 2, lane = threadIdx.x & 31;
    const cta_tile at = heaviest_first<false>(true); /* the longest tiles first under causal masks */
    const seq_view<T, VARLEN> sv(kp);
    const kparams &p = sv.p;
    const long long qt = at.tile, h = at.head, b = sv.b(), hk = h / p.group, i0 = qt * BM;
    if (VARLEN && i0 >= p.Nq) return; /* past this sequence's rows: the whole CTA, before the barriers exist */
    const int m = (int)min((long long)BM, p.Nq - i0);
    int64_t kt0, kt1;
    wa_key_tiles_for_rows(&p.win, i0, i0 + m, BN, &kt0, &kt1);
    const int steps = (int)max(kt1 - kt0, (int64_t)0);

    const uint32_t ds_full = base + L::ds_bars, ds_empty = ds_full + 16; /* kDsMbar: + 8 buf */
    if (threadIdx.x == 0) {
        ring.init(8, 4); /* K: both warpgroups' warps; V: the second's */
        if constexpr (kDsMbar) {
            for (int x = 0; x < 2; x++) mbar_init(ds_full + 8 * x, 128), mbar_init(ds_empty + 8 * x, 128);
            mbar_init_fence();
        }
    }
    __syncthreads();

    if (wg == 0) { /* producer: Q and dO once, then the key tiles */
        setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x == 0 && steps > 0) {
            /* maps 4..7 of the launch: this kernel's boxes */
            const CUtensorMap *mq = seq_map<VARLEN>(tq, kp, 4), *mdo = seq_map<VARLEN>(tdo, kp, 5), *mk = seq_map<VARLEN>(tk, kp, 6),
                              *mv = seq_map<VARLEN>(tv, kp, 7);
            const int row = (int)((VARLEN ? p.q_row0 : 0) + i0);
            mbar_expect_tx(ring.once(), 2 * BM * D * 2);
            for (int c = 0; c < DB; c++) {
                tma_load(sQ + c * (BM * 128), mq, ring.once(), c * 64, row, (int)h, (int)b);
                tma_load(sdO + c * (BM * 128), mdo, ring.once(), c * 64, row, (int)h, (int)b);
            }
            ring.produce<BN, DB, true>(mk, mv, sK, sV, kt0, kt1, (int)hk, (int)b, VARLEN ? p.k_row0 : 0);
        }
        return;
    }

    setmaxnreg_inc<kConsumerRegs>();
    const int cw = wg - 1, w4 = warp & 3, g = lane >> 2, t4 = lane & 3, tid = threadIdx.x & 127;
    const long long rows[2] = {i0 + w4 * 16 + g, i0 + w4 * 16 + g + 8};
    float stat[2]; /* cw 0: lse2, cw 1: δ */
    wide_row_stats<VARLEN>(p, b, h, rows, cw, stat);
    int64_t ut0, ut1; /* the key tiles the CTA's rows see whole: no mask */
    wa_unmasked_key_tiles(&p.win, i0, i0 + m, BN, &ut0, &ut1);
    const float scale2 = p.scale * kLog2e;
    float acc[4][8][4]; /* dQ's columns [256 cw, 256 cw + 256) */
    zero_frags(acc);
    const uint32_t first_a = cw == 0 ? sQ : sdO;

    if (steps > 0) mbar_wait(ring.once(), 0);
    for (int it = 0; it < steps; it++) {
        const long long kt = kt0 + it;
        const int st = dq_wide_ring::stage(it), buf = it & 1;
        const uint32_t ph = dq_wide_ring::parity(it);
        /* cw 0: S = Q Kᵀ, cw 1: dP = dO Vᵀ, over all of D */
        float s[BN / 8][4];
        mbar_wait(cw == 0 ? ring.k_full(st) : ring.v_full(st), ph);
        wide_scores<T, BN>(s, first_a, (cw == 0 ? sK : sV) + st * TILE, [](int) {});
        float4 *xp = (float4 *)(aligned + L::xp + buf * (BM * BN * 4));
        uint4 *xds = (uint4 *)(aligned + L::xds + buf * (BM * BN * 2));
        uint32_t pa[BN / 16][4]; /* dS as A fragments */
        if (cw == 0) {
            float pd[BN / 8][4];
            wide_probs<BN, CAP>(p, s, pd, rows, stat, kt * BN, !(kt >= ut0 && kt < ut1), t4, scale2);
            if (it >= 2) named_sync(kWideFree + buf, 256);
#pragma unroll
            for (int nb = 0; nb < BN / 8; nb++) xp[nb * 128 + tid] = make_float4(pd[nb][0], pd[nb][1], pd[nb][2], pd[nb][3]);
            named_arrive(kWideReady + buf, 256);
            if constexpr (kDsMbar) mbar_wait(ds_full + 8 * buf, (it >> 1) & 1);
            else named_sync(kWideDsReady + buf, 256);
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                const uint4 v = xds[kk * 128 + tid];
                pa[kk][0] = v.x, pa[kk][1] = v.y, pa[kk][2] = v.z, pa[kk][3] = v.w;
            }
            if constexpr (kDsMbar) mbar_arrive_if(ds_empty + 8 * buf, it + 2 < steps);
            else if (it + 2 < steps) named_arrive(kWideDsFree + buf, 256);
        } else {
            mbar_arrive_if(ring.v_empty(st), lane == 0);
            named_sync(kWideReady + buf, 256);
            wide_dscores<BN>(p, s, xp, stat, tid);
            if (it + 2 < steps) named_arrive(kWideFree + buf, 256);
            pack_a<T, BN>(pa, s);
            if (it >= 2) {
                if constexpr (kDsMbar) mbar_wait(ds_empty + 8 * buf, ((it - 2) >> 1) & 1);
                else named_sync(kWideDsFree + buf, 256);
            }
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) xds[kk * 128 + tid] = make_uint4(pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3]);
            if constexpr (kDsMbar) mbar_arrive_if(ds_full + 8 * buf, true);
            else named_arrive(kWideDsReady + buf, 256);
            mbar_wait(ring.k_full(st), ph); /* K, read below */
        }
        /* dQ += dS K over this warpgroup's 256 columns, K read transposed as V in the forward */
        reg_fence(pa);
        reg_fence(acc);
        wg_fence();
        {
            const uint64_t k_d = gmma_desc_mn(opaque(sK + st * TILE + cw * 4 * (BN * 128)), BN * 128);
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) wide_mn_product<T, 256>(acc, pa[kk], desc_at(k_d, kk * (16 * 128)));
        }
        wg_commit();
        wg_wait<0>();
        reg_fence(acc);
        mbar_arrive_if(ring.k_empty(st), lane == 0);
    }
    store_frag_rows<T, 32>(p.dq, reinterpret_cast<const float (&)[32][4]>(acc), rows, p.Nq, b, h, t4, cw * 256);
#endif
}

/* ---- dQ from the fused backward's f32 accumulator ---- */

/* One CTA per 64 query rows of a head: the accumulator holds, per 64-row tile, D/64 blocks of
 * 64 × 64 floats in the consumers' fragment order (float4 nb·128 + thread: rows 16 w4 + g and
 * + 8, columns 64 block + 8 nb + 2 t4 and + 1), written by add_dq in dkdv_ws_kernel.
 * WA_DQ_CONVERT_STAGED:
 *   1 (the default): the rounded tile is staged in shared memory and stored by rows, 16 bytes a
 *     thread (a warp stores whole rows), where dq's rows allow it (16-byte aligned), else 4: the
 *     (b) 8K backward 557-562 TFLOP/s against 553-555, deterministic 537-539 against 527-532
 *     (`ROWS=det CHECK=build sh dev/cuda/bwd_variants.sh conv0 "-DWA_DQ_CONVERT_STAGED=0" …` at
 *     a7d7c28);
 *   0: each thread stores its fragments' pairs straight to dq, 4 bytes a store (Nsight Compute at
 *     b27b129, (b) 8K: 63.9 µs, its largest stall lg_throttle, the memory instruction queue). */
#ifndef WA_DQ_CONVERT_STAGED
#define WA_DQ_CONVERT_STAGED 1
#endif
template <typename T, int D> __global__ void __launch_bounds__(128) dq_convert_kernel(kparams p) {
#if WA_HOPPER_STUB /* not the sm_90a compilation: never launched (common.cuh) */
    __trap();
#else
    constexpr int DB = D / 64;
    const int tid = threadIdx.x, w4 = tid >> 5, g = (tid & 31) >> 2, t4 = tid & 3;
    const long long h = blockIdx.y, b = blockIdx.z, i0 = (long long)blockIdx.x * 64;
    const float4 *acc = (const float4 *)(p.dq_acc + ((b * p.Hq + h) * (p.nq_pad / 64) + blockIdx.x) * (64 * D));
    if constexpr (WA_DQ_CONVERT_STAGED == 0) {
        float frag[DB * 8][4];
#pragma unroll
        for (int i = 0; i < DB * 8; i++) {
            const float4 v = acc[i * 128 + tid];
            /* dQ = scale · Σ dS K: the dK/dV kernel left the scale out of dS */
            frag[i][0] = v.x * p.scale, frag[i][1] = v.y * p.scale, frag[i][2] = v.z * p.scale, frag[i][3] = v.w * p.scale;
        }
        const long long rows[2] = {i0 + w4 * 16 + g, i0 + w4 * 16 + g + 8};
        store_frag_rows<T, DB * 8>(p.dq, frag, rows, p.Nq, b, h, t4);
    } else {
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
    }
#endif
}

/* ---- host side ---- */

/* The rectangular instances (VARLEN false) on (tiles, heads, B) grids, or the varlen ones over the
 * sequences (over_sequences), tiles from the longest sequence. Fused varlen: prep zeroes the
 * sequences' rows of the row-major accumulator, the dK/dV kernel adds into them (add_dq_rows), and
 * dq_rows_convert_kernel (mma_prims.cuh) rounds it. */
/* the backward's maps (hopper_backward): Q, dO, K, V in the dK/dV kernel's boxes, then in the dQ
 * kernel's; the K and V ones span key rows (write_seq_maps) */
constexpr unsigned kKeyMaps = 0b11001100u;

template <typename T, int D, Cap CAP, bool VARLEN>
static wa_status launch_all(const kparams &kp, const CUtensorMap (&m)[8], cudaStream_t s) {
    static volatile unsigned long long done_prep = 0, done_prep_stores = 0, done_kv = 0, done_fused = 0, done_ordered = 0, done_q = 0;
    constexpr int keys = kv_keys<D>();
    const unsigned q_tiles = (unsigned)(kp.nq_pad / 64), key_tiles = (unsigned)((kp.Nk + keys - 1) / keys);
    CUDA_TRY(raise_once(prep_kernel<T, D, VARLEN>, prep_smem_bytes<D>(), &done_prep));
    /* varlen: every sequence's copies of the eight maps (Q, dO, K, V of each kernel), once */
    const wa_status maps_st = write_seq_maps(kp, m, 8, kKeyMaps, s);
    if (maps_st != WA_OK) return maps_st;
    if constexpr (kv_by_rows<D>()) {
        if (kp.dq_acc) { /* fused: prep (zeroes the accumulator and the ordered form's counters), dK/dV
                          * with dQ (in order where kp.dq_order is set: rectangular calls), dq from
                          * the accumulator */
            auto dkdv = dkdv_ws_kernel<T, D, CAP, true, VARLEN>;
            auto prep = prep_kernel<T, D, VARLEN>;
            volatile unsigned long long *done = &done_fused;
            if constexpr (!VARLEN)
                if (kp.dq_order) {
                    dkdv = dkdv_ws_kernel<T, D, CAP, true, false, true>, done = &done_ordered;
                    if (kOrderedFirstStores) {
                        prep = prep_kernel<T, D, false, false>;
                        CUDA_TRY(raise_once(prep, prep_smem_bytes<D>(), &done_prep_stores));
                    }
                }
            CUDA_TRY(raise_once(dkdv, kv_layout<D, true>::bytes, done));
            const wa_status st = over_sequences(kp, [&](const kparams &c, unsigned z) {
                prep<<<dim3(q_tiles, (unsigned)kp.Hq, z), 128, prep_smem_bytes<D>(), s>>>(c);
                CUDA_TRY(cudaGetLastError());
                dkdv<<<dim3(key_tiles, (unsigned)kp.Hkv, z), kThreads, kv_layout<D, true>::bytes, s>>>(m[0], m[1], m[2], m[3], c);
                CUDA_TRY(cudaGetLastError());
                if (!VARLEN) {
                    dq_convert_kernel<T, D><<<dim3(q_tiles, (unsigned)kp.Hq, z), 128, 0, s>>>(c);
                    CUDA_TRY(cudaGetLastError());
                }
                return WA_OK;
            });
            if (st != WA_OK || !VARLEN) return st;
            return convert_dq_rows<T, true>(kp, s); /* with the scale left out of dS */
        }
    }
    kparams dkp = kp;
    dkp.dq_acc = nullptr; /* not fused: prep has nothing to zero */
    CUDA_TRY(raise_once(dkdv_ws_kernel<T, D, CAP, false, VARLEN>, kv_layout<D, false>::bytes, &done_kv));
    CUDA_TRY(raise_once(dq_ws_kernel<T, D, CAP, VARLEN>, dq_layout<D>::bytes, &done_q));
    return over_sequences(dkp, [&](const kparams &c, unsigned z) {
        prep_kernel<T, D, VARLEN><<<dim3(q_tiles, (unsigned)kp.Hq, z), 128, prep_smem_bytes<D>(), s>>>(c);
        CUDA_TRY(cudaGetLastError());
        dkdv_ws_kernel<T, D, CAP, false, VARLEN>
            <<<dim3(key_tiles, (unsigned)kp.Hkv, z), kThreads, kv_layout<D, false>::bytes, s>>>(m[0], m[1], m[2], m[3], c);
        CUDA_TRY(cudaGetLastError());
        dq_ws_kernel<T, D, CAP, VARLEN><<<dim3((unsigned)((kp.Nq + 127) / 128), (unsigned)kp.Hq, z), kThreads, dq_layout<D>::bytes, s>>>(
            m[4], m[5], m[6], m[7], c);
        CUDA_TRY(cudaGetLastError());
        return WA_OK;
    });
}

template <typename T, int D> static wa_status by_cap(const kparams &kp, const CUtensorMap (&m)[8], cudaStream_t s) {
    if (kp.cu_q) return kp.softcap > 0.0f ? launch_all<T, D, Cap::on, true>(kp, m, s) : launch_all<T, D, Cap::off, true>(kp, m, s);
    return kp.softcap > 0.0f ? launch_all<T, D, Cap::on, false>(kp, m, s) : launch_all<T, D, Cap::off, false>(kp, m, s);
}

template <typename T> static wa_status by_dim(const kparams &kp, const CUtensorMap (&m)[8], cudaStream_t s) {
    return for_head_dim(kp.D, [&](auto d) { return by_cap<T, decltype(d)::value>(kp, m, s); });
}

/* D = 512: prep, dK/dV, dQ (deterministic either way: no dQ accumulator) */
template <typename T, Cap CAP, bool VARLEN>
static wa_status launch_wide(const kparams &kp, const CUtensorMap (&m)[8], cudaStream_t s) {
    static volatile unsigned long long done_prep = 0, done_kv = 0, done_q = 0;
    CUDA_TRY(raise_once(prep_kernel<T, kWideD, VARLEN>, prep_smem_bytes<kWideD>(), &done_prep));
    CUDA_TRY(raise_once(dkdv_wide_ws_kernel<T, CAP, VARLEN>, kv_wide_layout::bytes, &done_kv));
    CUDA_TRY(raise_once(dq_wide_ws_kernel<T, CAP, VARLEN>, dq_wide_layout::bytes, &done_q));
    const wa_status maps_st = write_seq_maps(kp, m, 8, kKeyMaps, s);
    if (maps_st != WA_OK) return maps_st;
    kparams dkp = kp;
    dkp.dq_acc = nullptr; /* prep has nothing to zero */
    return over_sequences(dkp, [&](const kparams &c, unsigned z) {
        prep_kernel<T, kWideD, VARLEN><<<dim3((unsigned)(kp.nq_pad / 64), (unsigned)kp.Hq, z), 128, prep_smem_bytes<kWideD>(), s>>>(c);
        CUDA_TRY(cudaGetLastError());
        dkdv_wide_ws_kernel<T, CAP, VARLEN><<<dim3((unsigned)((kp.Nk + kWideKeys - 1) / kWideKeys), (unsigned)kp.Hkv, z), kThreads,
                                              kv_wide_layout::bytes, s>>>(m[0], m[1], m[2], m[3], c);
        CUDA_TRY(cudaGetLastError());
        dq_wide_ws_kernel<T, CAP, VARLEN>
            <<<dim3((unsigned)((kp.Nq + 63) / 64), (unsigned)kp.Hq, z), kThreads, dq_wide_layout::bytes, s>>>(m[4], m[5], m[6], m[7], c);
        CUDA_TRY(cudaGetLastError());
        return WA_OK;
    });
}
template <typename T> static wa_status by_cap_wide(const kparams &kp, const CUtensorMap (&m)[8], cudaStream_t s) {
    if (kp.cu_q) return kp.softcap > 0.0f ? launch_wide<T, Cap::on, true>(kp, m, s) : launch_wide<T, Cap::off, true>(kp, m, s);
    return kp.softcap > 0.0f ? launch_wide<T, Cap::on, false>(kp, m, s) : launch_wide<T, Cap::off, false>(kp, m, s);
}

/* the D = 512 backward on wgmma, rectangular and varlen calls; -DWA_BWD_WIDE_MMA leaves it to
 * version 5's mma.sync kernels (bwd_wide.cu; lab, for comparisons in one build) */
static bool wide_backward_takes(const kparams &kp) {
#ifdef WA_BWD_WIDE_MMA
    (void)kp;
    return false;
#else
    return kp.D == kWideD;
#endif
}

} /* namespace */

int hopper_backward_fuses_dq(const kparams &kp) { return kp.D == 64 || kp.D == 128; }

int hopper_backward_orders_dq(const kparams &kp) {
    if (!kDqWriter || kp.cu_q) return 0;
    return WA_DQ_ORDERED == 2 || (WA_DQ_ORDERED == 1 && kp.D == 128);
}

int hopper_backward_supports(const kparams &kp) {
    return !hopper_forced_off() && (hopper_head_dim(kp.D) || wide_backward_takes(kp)) && kp.Nq > 0 && kp.Nk > 0 && kp.lse.data &&
           tensor_map_encoder() != nullptr;
}

wa_status hopper_backward(const kparams &kp, wa_dtype dt, cudaStream_t s, int *taken) {
    *taken = 0;
    if (!hopper_backward_supports(kp) || !kp.lse2) return WA_OK;
    const int D = (int)kp.D, wide = D == kWideD, bn = wide ? kDqWideBN : D == 256 ? dq_bn<256>() : dq_bn<128>();
    /* dK/dV kernel: Q, dO in 64-row boxes, K, V in boxes of its keys; dQ kernel: Q, dO in its rows
     * (128, or 64 at D = 512), K, V in bn */
    const int kv_rows = wide ? kWideKeys : D == 256 ? kv_keys<256>() : kv_keys<128>(), dq_rows = wide ? 64 : 128;
    CUtensorMap m[8];
    const long long B = map_batch(kp), Nq = map_q_rows(kp), Nk = map_k_rows(kp);
    const bool ok = tensor_map(&m[0], kp.q, dt, B, kp.Hq, Nq, D, 64) && tensor_map(&m[1], kp.dout, dt, B, kp.Hq, Nq, D, 64) &&
                    tensor_map(&m[2], kp.k, dt, B, kp.Hkv, Nk, D, kv_rows) && tensor_map(&m[3], kp.v, dt, B, kp.Hkv, Nk, D, kv_rows) &&
                    tensor_map(&m[4], kp.q, dt, B, kp.Hq, Nq, D, dq_rows) && tensor_map(&m[5], kp.dout, dt, B, kp.Hq, Nq, D, dq_rows) &&
                    tensor_map(&m[6], kp.k, dt, B, kp.Hkv, Nk, D, bn) && tensor_map(&m[7], kp.v, dt, B, kp.Hkv, Nk, D, bn);
    if (!ok) return WA_OK;
    *taken = 1;
    if (wide) return dt == WA_BF16 ? by_cap_wide<__nv_bfloat16>(kp, m, s) : by_cap_wide<__half>(kp, m, s);
    return dt == WA_BF16 ? by_dim<__nv_bfloat16>(kp, m, s) : by_dim<__half>(kp, m, s);
}

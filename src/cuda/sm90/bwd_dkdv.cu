/* sm90/bwd_dkdv.cu — the backward's dK/dV kernel on Hopper for f16/bf16 at D = 64, 128, 256:
 * wgmma, TMA and warp-specialised CTAs like the forward (sm90/fwd.cu).
 *
 * One CTA per 128 keys (D ≤ 128) or 64 keys (D = 256) of a kv head, over the group's query heads
 * and the query tiles the window allows (64 queries a step). Warpgroup 0 loads (TMA: K and V once;
 * Q and dO per step into a two-stage ring). At D ≤ 128 each consumer warpgroup owns 64 keys with
 * their dK and dV and does all four products (Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, dV += Pᵀ dO, dK += dSᵀ Q),
 * and in the fused form a fifth, dQ = dS K, added into an f32 accumulator by bulk reduce-adds
 * (kv_layout below): five tile products per visible pair, FlashAttention-3's count. At D = 256 dK
 * and dV of 64 keys do not both fit one warpgroup's registers, so the work is split by output:
 * warpgroup 1 forms Sᵀ, Pᵀ and dV; warpgroup 2 forms dPᵀ and, with Pᵀ handed over through shared
 * memory (f32, two buffers, named barriers), dSᵀ and dK. Each does two products.
 *
 * The library's forms of the backward (dispatch.cu):
 *   fused      (D = 64 and 128, unless deterministic): prep, this kernel with dQ, convert; dq's
 *              last bits depend on the order the adds land in.
 *   ordered    (deterministic at kSm90OrderedDqD, rectangular calls): the fused form with each
 *              block of the accumulator summed in one fixed order (ORDERED, dq_order), so dq is
 *              bit-identical run to run.
 *   deterministic (elsewhere, and always at D = 256): prep, this kernel, the dQ kernel
 *              (sm90/bwd_dq.cu); seven tile products per visible pair.
 * Masks, tile ranges and edge tiles come from tile_geometry.h. */
#include "bwd_common.cuh"

namespace {

/* The fused form (by rows only, the atomic-dQ option): each step also forms dQ = dS K for its 64
 * queries and adds it to an f32 accumulator in global memory. dSᵀ (bf16/f16) goes to shared memory,
 * where a wgmma reads it transposed as the A operand, beside K read transposed as B. Each warpgroup
 * forms 64 columns of the step's dQ: at D = 128 columns [64 cw, 64 cw + 64) over all 128 keys (so
 * it reads the other warpgroup's dSᵀ rows too: both meet at a named barrier), at D = 64 all 64
 * columns over its own 64 keys (a 32-column half could not use the 128-byte swizzle, whose atom is
 * 64 values wide). The 64 × 64 f32 result is stored to shared memory in fragment order and added
 * to the accumulator by one bulk reduce-add (cp.reduce.async.bulk), which the hardware performs
 * at L2; dq_convert_kernel turns the accumulator into dq. */
template <int D> __host__ __device__ constexpr bool dq_split_columns() { return D == 128; }

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
constexpr int kReady = 1, kFree = 3, kStats = 5, kDsWritten = 7, kDqStaged = 9, kDqFree = 11;

/* Who issues the fused form's dQ reduce-adds (rectangular calls; varlen ones add from registers):
 * as FlashAttention 3 and 4 do, warp 1 + w of the producer warpgroup for consumer warpgroup w.
 * The consumers store their share to shared memory, fence and only arrive at a named barrier
 * (kDqStaged); the writer waits there, issues the bulk reduce-add, waits for its read of the
 * buffer and hands the buffer back (kDqFree). One share per warpgroup and step: dQ's columns
 * split between the warpgroups (D = 128), or D = 64. */
template <int D, bool FUSE, bool VARLEN> __host__ __device__ constexpr bool dq_writer() {
    return FUSE && !VARLEN && (dq_split_columns<D>() || D == 64);
}

/* The ordered dQ (ORDERED below; the deterministic form at kSm90OrderedDqD, rectangular calls): the
 * fused kernel with each 64 × 64 block of the accumulator summed in one fixed order, as
 * FlashAttention 3's deterministic mode orders its dQ adds: the key tiles' shares in ascending
 * order. A counter per block (kp.dq_order, zeroed by prep) holds the shares added so far; a writer
 * waits until it reads the number that come before its own, issues its share, and counts it in
 * (release) once its writes are done, which it checks only when its next share is issued (the last
 * share's at the end), so that the wait for the writes is not between two of its shares. The first
 * share of each block (key tile kt0's) is stored by a bulk copy rather than added, so that prep
 * need not zero the accumulator, only the tiles no key tile reaches (prep_kernel's ZERO_ALL). The
 * CTAs start in ascending key tile (heaviest_first across heads), so a CTA waits only on CTAs that
 * started before it; step_walk orders each CTA's steps so that it reaches a block no sooner than its
 * lower neighbour. It replaces the dQ kernel, which forms S and dP again (seven tile products per
 * visible pair against five). */

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
 *     reaches a block two steps after n − 1 (the window moves two 64-row tiles per 128 keys);
 *     with the heads inside that would be 2·group steps, in which the GPU touches more blocks than
 *     L2 holds.
 * Two counters (head, tile) moved on at the end of each step, rather than a division of a step
 * index (about 40 instructions a step). */
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

/* Step overlap (by rows, the fused kernel at kSm90StepOverlapD): each warpgroup overlaps its own
 * products with its element-wise work inside a step, with its products split into commit groups
 * as FlashAttention 4's SM90 backward splits them: Sᵀ and dPᵀ in two commit groups, so Pᵀ is
 * formed while dPᵀ still runs; dV += Pᵀ dO issued as soon as Pᵀ is packed, so dSᵀ is formed while
 * it runs; dQ = dS K issued before dK += dSᵀ Q, so the step's dQ share is staged and its
 * reduce-add issued while dK runs. The products and their operands are the same as without, so
 * are the results, bit for bit. The dS arithmetic and the dV and dK issue are written out in both
 * forms rather than shared: a shared lambda changes the SASS of both. Without the ordered dQ, each
 * thread also reads its 16 lse2 values from shared memory into registers while Sᵀ runs. */
template <int D, bool FUSE> __host__ __device__ constexpr bool step_overlap() { return FUSE && D == kSm90StepOverlapD; }

/* The softmax scale in the by-rows dK/dV kernels (D <= 128), as FlashAttention 3 and 4 place it:
 * dSᵀ is formed without it, and dK = scale · Σ dSᵀ Q once at the end, dQ = scale · Σ dS K in the
 * kernel that rounds the fused form's accumulator (dq_convert_kernel, convert_dq_rows), instead
 * of a multiply on every element of dSᵀ (32 a step per thread). dS is rounded to the dtype
 * before the scale rather than after (1/√D is not a power of two): the same sums, other
 * roundings. The by-output kernels (D = 256) keep the scale in dS. */

/* lse2 and δ of a step's 64 queries (by rows, rectangular calls): the producer loads them by two
 * bulk copies into the step's stage beside Q and dO, counted on its full barrier; every consumer
 * thread arrives on the stage's empty barrier once its reads are done (256 arrivals: with one
 * arrival per warp racecheck reports hazards on the stage). Elsewhere each consumer thread fetches
 * one value from global memory before the step's products and stores it to shared memory, and a
 * named barrier of the warpgroup (kStats) publishes them. */
template <int D, bool VARLEN> __host__ __device__ constexpr bool stats_by_tma() { return kv_by_rows<D>() && !VARLEN; }

/* A dQ writer warp of dkdv_ws_kernel (dq_writer: warp w + 1 for consumer warpgroup w): each step's
 * share, staged by the warpgroup (add_dq), reduce-added into its query tile of the accumulator in
 * add_dq's order; ORDERED: stored or added only after the shares of the key tiles below, and counted
 * once written. Invariant: the staging buffer is released (kDqFree) only after the bulk copy read it,
 * and every bulk operation is complete before return (the CTA's shared memory goes after it). */
template <int D, bool FUSE, bool ORDERED, typename DqTile>
__device__ __forceinline__ void write_dq_shares(const kparams &p, const uint32_t &base, const cta_tile &at,
                                                DqTile &dq_tile, const int64_t &qt0, const int &nqt, const int &steps,
                                                const bool &walk_ends_last, const int &warp, const int &lane) {
    using L = kv_layout<D, FUSE>;
    constexpr int DB = D / 64, KEYS = L::KEYS;
    /* the dQ writer of consumer warpgroup w = warp - 1: each step's staged share into its
     * query tile of the accumulator (add_dq's order) */
    const int w = warp - 1, cb = dq_split_columns<D>() ? w : 0;
    const uint32_t stage = base + L::dq_stage + w * L::DQ_STAGE;
    step_walk<ORDERED> walk(nqt, p.group, walk_ends_last);
    int *counted = nullptr; /* ordered: the last share's block, not counted yet */
    for (int n = 0; n < steps; n++) {
        named_sync(kDqStaged + w, 160);
        if (lane == 0) {
            const long long tile = dq_tile(walk.head, qt0 + walk.tile);
            bool first = false; /* ordered: the block's first share, stored rather than added */
            if constexpr (ORDERED) {
                /* the shares before this one: the key tiles of this query tile below ours */
                const long long qt = qt0 + walk.tile;
                int64_t kt0, kt1;
                wa_key_tiles_for_rows(&p.win, qt * 64, qt * 64 + 64, KEYS, &kt0, &kt1);
                const int before = (int)(at.tile - kt0);
                wait_count(p.dq_order + tile * DB + cb, before);
                fence_proxy_async(); /* the reduce-add below (async proxy) after the acquire */
                first = before == 0;
            }
            if (first) bulk_store_f32(p.dq_acc + (tile * DB + cb) * 4096, stage, 64 * 64 * 4);
            else bulk_reduce_add_f32(p.dq_acc + (tile * DB + cb) * 4096, stage, 64 * 64 * 4);
            bulk_commit();
            if (ORDERED) {
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
        walk.next();
    }
    if (ORDERED && lane == 0 && counted) {
        bulk_wait<0>();
        fence_proxy_async();
        count_share(counted);
    }
    if (lane == 0) bulk_wait<0>(); /* the reduce-adds are done before the CTA's shared memory goes */
}

/* The epilogue of dkdv_ws_kernel: by rows, dV (acc) and dK (acc2, times the scale left out of dSᵀ)
 * of this warpgroup's keys; by output, dV (cw 0) or dK (cw 1) of the CTA's. keys are the thread's
 * two key rows. Invariant: the accumulators are final (every product waited for). */
template <typename T, int D, bool BY_ROWS>
__device__ __forceinline__ void store_dkdv(const kparams &p, float (&acc)[D / 64][8][4],
                                           float (&acc2)[BY_ROWS ? D / 64 : 1][8][4], const long long (&keys)[2],
                                           long long b, long long hk, int cw, int t4) {
    constexpr int DB = D / 64;
    if constexpr (BY_ROWS) {
        store_frag_rows<T, DB * 8>(p.dv, reinterpret_cast<const float (&)[DB * 8][4]>(acc), keys, p.Nk, b, hk, t4);
        scale_frags(acc2, p.scale); /* dK = scale · Σ dSᵀ Q: the scale left out of dSᵀ */
        store_frag_rows<T, DB * 8>(p.dk, reinterpret_cast<const float (&)[DB * 8][4]>(acc2), keys, p.Nk, b, hk, t4);
    } else {
        store_frag_rows<T, DB * 8>(cw == 0 ? p.dv : p.dk, reinterpret_cast<const float (&)[DB * 8][4]>(acc), keys, p.Nk,
                                   b, hk, t4);
    }
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
    static_assert(!ORDERED || (D == kSm90OrderedDqD && dq_split_columns<D>()), "one share per block and CTA");
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char *aligned = smem + (((smem_u32(smem) + 1023u) & ~1023u) - smem_u32(smem));
    const uint32_t base = smem_u32(aligned);
    const uint32_t sK = base + L::k, sV = base + L::v, sQ = base + L::q, sdO = base + L::dout, bar = base + L::bars;
    const uint32_t kv_full = bar;
    auto full = [&](int s) { return bar + 8 * (1 + 2 * s); };
    auto empty = [&](int s) { return bar + 8 * (2 + 2 * s); };

    const int warp = warp_index(), wg = warp >> 2, lane = threadIdx.x & 31;
    const cta_tile at = heaviest_first<true>(false); /* the first key tiles first: under a causal mask they are the longest */
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
        /* one arrival per consumer warp, or per consumer thread (stats_by_tma) */
        constexpr uint32_t empty_arrivals = stats_by_tma<D, VARLEN>() ? 256 : 8;
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
            write_dq_shares<D, FUSE, ORDERED>(p, base, at, dq_tile, qt0, nqt, steps, walk_ends_last, warp, lane);
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
    /* the same with each thread's lse2 values already in registers (the step overlap's early read) */
    auto probs_early = [&](float (&x)[8][4], float (&pd)[8][4], const float (&lse2_r)[8][2], long long i0, bool edge) {
        edge_form<CAP>(edge, [&](auto edge_c) { probs_as(x, pd, [&](int nb, int j, int) { return lse2_r[nb][j]; }, i0, edge_c); });
    };

    /* fused: dSᵀ (packed as A fragments: rows w4·16 + g (+8), columns 16 kk + 2 t4 (+8)) into
     * this warpgroup's 64 rows of dS buffer `buf`, in the 128-byte swizzle, by four stmatrix; the
     * wgmma that reads them does so through the async proxy */
    auto write_ds = [&](const uint32_t (&pb)[4][4], int buf) {
        /* pb[kk] is four 8 × 8 tiles: rows +0 / +8 of chunk 2 kk, then of chunk 2 kk + 1; lane l
         * addresses row l % 8 (+ 8 for tiles 1, 3) of chunk 2 kk (+ 1 for tiles 2, 3) */
        const uint32_t rows = base + L::ds + buf * L::DS;
        const int m_row = cw * 64 + w4 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, m_chunk = lane >> 4;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) stsm_x4(rows + blk_off<KEYS>(m_row, 2 * kk + m_chunk), pb[kk]);
        fence_proxy_async();
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
     * tiles of add_dq (one bulk reduce-add each) would need 64 padded rows per sequence */
    auto add_dq_rows = [&](const float (&dq)[8][4], long long h, long long i0, int cb) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const long long row = i0 + w4 * 16 + g + 8 * r;
            float *dst = p.dq_acc + (ws_head<true>(p, b, h, 0) + row) * D + cb * 64 + 2 * t4;
#pragma unroll
            for (int nb = 0; nb < 8; nb++) red_add_v2_if(dst + nb * 8, dq[nb][2 * r], dq[nb][2 * r + 1], row < p.Nq);
        }
    };

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
         * cannot meet a slow warp's reads), rather than each read where used (from L1). */
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
            constexpr bool STATS_EARLY = !ORDERED;
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
                dq_product(dq, n & 1, dq_split_columns<D>() ? cw : 0); /* its own commit group */
                dk_product();
                wg_wait<1>(); /* dV and dQ; dK still runs */
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
            wg_fence();
            tile_product(s, opaque(sK), q_s);
            tile_product(dp, opaque(sV), do_s);
            wg_commit();
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
            wg_fence();
            const uint64_t do_d = gmma_desc_mn(do_s, 64 * 128), q_d = gmma_desc_mn(q_s, 64 * 128);
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wide_mn_product<T, D>(acc, pa[kk], desc_at(do_d, kk * (16 * 128)));
#pragma unroll
            for (int kk = 0; kk < 4; kk++) wide_mn_product<T, D>(acc2, pb[kk], desc_at(q_d, kk * (16 * 128)));
            wg_commit();
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
        mbar_arrive_if(empty(st), lane == 0 || stats_by_tma<D, VARLEN>());
        walk.next();
    }
    /* the reduce-adds are done before the CTA's shared memory goes (dq_writer: the writers wait) */
    if (FUSE && !dq_writer<D, FUSE, VARLEN>() && tid == 0) bulk_wait<0>();
    store_dkdv<T, D, BY_ROWS>(p, acc, acc2, keys, b, hk, cw, t4);
#endif
}

template <typename T, int D, Cap CAP, bool FUSE, bool VARLEN, bool ORDERED>
static wa_status launch(const kparams &c, const CUtensorMap (&m)[8], unsigned z, cudaStream_t s) {
    static volatile unsigned long long done = 0;
    constexpr size_t bytes = kv_layout<D, FUSE>::bytes;
    CUDA_TRY(raise_once(dkdv_ws_kernel<T, D, CAP, FUSE, VARLEN, ORDERED>, bytes, &done));
    const unsigned key_tiles = (unsigned)((c.Nk + kv_keys<D>() - 1) / kv_keys<D>());
    dkdv_ws_kernel<T, D, CAP, FUSE, VARLEN, ORDERED><<<dim3(key_tiles, (unsigned)c.Hkv, z), kThreads, bytes, s>>>(m[0], m[1], m[2], m[3], c);
    CUDA_TRY(cudaGetLastError());
    return WA_OK;
}

template <typename T, int D, Cap CAP>
static wa_status by_form(const kparams &c, const CUtensorMap (&m)[8], bool fused, bool ordered, unsigned z, cudaStream_t s) {
    if constexpr (kv_by_rows<D>()) {
        if (ordered) {
            if constexpr (D == kSm90OrderedDqD)
                if (!c.cu_q) return launch<T, D, CAP, true, false, true>(c, m, z, s);
            return wa_fail(WA_ERR_UNSUPPORTED, "sm90 dK/dV: ordered dQ at D = %lld", c.D);
        }
        if (fused) return c.cu_q ? launch<T, D, CAP, true, true, false>(c, m, z, s) : launch<T, D, CAP, true, false, false>(c, m, z, s);
    } else {
        if (fused || ordered) return wa_fail(WA_ERR_UNSUPPORTED, "sm90 dK/dV: fused dQ at D = %lld", c.D);
    }
    return c.cu_q ? launch<T, D, CAP, false, true, false>(c, m, z, s) : launch<T, D, CAP, false, false, false>(c, m, z, s);
}

} /* namespace */

wa_status sm90_dkdv(const kparams &c, wa_dtype dt, const CUtensorMap (&maps)[8], bool fused, bool ordered, unsigned z,
                    cudaStream_t s) {
    return for_dtype(dt, [&](auto t) {
        using T = decltype(t);
        return for_head_dim(c.D, [&](auto d) {
            constexpr int D = decltype(d)::value;
            return c.softcap > 0.0f ? by_form<T, D, Cap::on>(c, maps, fused, ordered, z, s)
                                    : by_form<T, D, Cap::off>(c, maps, fused, ordered, z, s);
        });
    });
}

/* sm90/bwd_d512.cu — the backward's dK/dV and dQ kernels on Hopper for f16/bf16 at D = 512
 * (prep is sm90/bwd_prep.cu's): wgmma, TMA, the consumer warpgroups split by role. */
#include "bwd_common.cuh"

namespace {

/* ---- head dim 512 ----
 * dK and dV of 64 keys, or dQ of 64 query rows, over 512 columns take 256 accumulator registers a
 * thread in one warpgroup, and Q and dO of 64 rows alone fill 128 KB of shared memory. So at D = 512
 * the two consumer warpgroups split each step by role (as the D = 256 dK/dV kernel splits by
 * output, with D rather than the keys as the products' M where that saves registers):
 *   dK/dV  one CTA per 32 keys, K and V resident (64 KB), Q and dO of each 64-query step in one
 *          stage (128 KB), loaded and released in kQParts parts along D. Warpgroup 1 forms
 *          S = Q Kᵀ (64 queries × 32 keys, all of D), P, and dVᵀ += dOᵀ P; warpgroup 2 forms
 *          dP = dO Vᵀ, and with P (times the softcap's derivative, f32) handed over through shared
 *          memory, dS and dKᵀ += Qᵀ dS. The second products take D as M (eight m64n32k16 column
 *          blocks, A = dO or Q read transposed, B = P or dS stored transposed in shared memory): dVᵀ
 *          or dKᵀ of 512 × 32 is 128 registers a thread. Each warpgroup does half of every step's
 *          work.
 *   dQ     one CTA per 64 query rows, Q and dO resident (128 KB), key tiles of kDqWideBN in a ring of
 *          kDqWideStages. Warpgroup 1 forms S and P and hands P (f32) to warpgroup 2, which forms
 *          dP and dS and hands dS back (bf16, as A fragments); each then adds dS K for its 256 of
 *          dQ's columns (m64n256k16, dS from registers, K read transposed: 128 registers).
 * dP's k steps run in the order prep's δ takes (one chain over all of D), so a one-key window still
 * gives dP − δ = 0 exactly. */
constexpr int kWideD = kSm90D512, kWideKeys = kSm90DkdvD512Keys;
/* The parts Q and dO are loaded and released in along D (kSm90D512QParts): each part of Q and of
 * dO has its own full / empty mbarriers and Q and dO a producer thread each; the first product
 * waits for each part just before its k steps, and the second product commits a group per part
 * and releases each part as its group completes, so that the next step's first parts are
 * refilled, and its first product starts on them, while this step's last products still run (one
 * stage of 128 KB leaves no room for a second). */
constexpr int kQParts = kSm90D512QParts;
static_assert(kQParts == 1 || kQParts == 2 || kQParts == 4 || kQParts == 8, "Q and dO whole or in 2, 4 or 8 parts");
constexpr int kDqWideBN = kSm90DqD512Keys, kDqWideStages = kSm90DqD512Stages;
using dq_wide_ring = kv_ring_of<kDqWideStages>;
/* named barriers of both kernels: the f32 P of buffer b ready (1 + b) and free again (3 + b); a
 * warpgroup's own transposed tile written (5 + its index) */
constexpr int kWideReady = 1, kWideFree = 3, kWideOwn = 5;

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

/* The dQ kernel hands dS back behind mbarriers (a full and an empty one per buffer, every thread
 * of a warpgroup arriving): compute-sanitizer's racecheck follows the mbarrier handshake, while
 * on the named-barrier form of the same hand-over (bar.arrive by the writer, bar.sync by the
 * reader, as the P hand-over) it reports hazards. */
struct dq_wide_layout {
    static constexpr int BN = kDqWideBN;
    static constexpr uint32_t QT = 64 * kWideD * 2, TILE = BN * kWideD * 2;
    /* Q, dO; the ring's K and V stages; P (f32) and dS (A fragments), two buffers each; barriers */
    static constexpr uint32_t q = 0, dout = QT, k = 2 * QT, v = k + kDqWideStages * TILE, xp = v + kDqWideStages * TILE,
                              xds = xp + 2 * 64 * BN * 4, bars = xds + 2 * 64 * BN * 2;
    static constexpr uint32_t ds_bars = bars + 8 * dq_wide_ring::n_bars; /* dS: full 0, 1, empty 0, 1 */
    static constexpr size_t bytes = 1024 + ds_bars + 8 * 4;
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

/* The producer warpgroup's work in dkdv_wide_ws_kernel: thread 0 loads K and V once, then Q and dO
 * of every step part by part, each part once the consumers released the last step's (Q by thread 0
 * and dO by thread 32 when in parts, so that neither waits for the other's release). Invariant: step
 * n's parts land behind the full barriers of phase n & 1, in the order the consumers wait for them.
 * The kernel's scalars come by reference, so that refill captures the kernel's own variables, as it
 * did written inside the kernel: the kernel's SASS stays that of the inline form (cuda_sass_diff.sh). */
template <bool VARLEN, typename QFull, typename QEmpty, typename DoFull, typename DoEmpty>
__device__ __forceinline__ void produce_kv_and_steps(const CUtensorMap &tq, const CUtensorMap &tdo,
                                                     const CUtensorMap &tk, const CUtensorMap &tv, const kparams &kp,
                                                     const kparams &p, const uint32_t &sK, const uint32_t &sV,
                                                     const uint32_t &sQ, const uint32_t &sdO, const uint32_t &kv_full,
                                                     QFull &q_full, QEmpty &q_empty, DoFull &do_full, DoEmpty &do_empty,
                                                     const long long &hk, const long long &b, const long long &j0,
                                                     const int64_t &qt0, const int &nqt, const int &steps) {
    using L = kv_wide_layout;
    constexpr int D = kWideD, KEYS = kWideKeys, DB = D / 64, HB = DB / kQParts;
    constexpr uint32_t PART = HB * (64 * 128); /* bytes of one part of Q or dO */
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
}

/* The epilogue of dkdv_wide_ws_kernel: cw 0 writes dV, cw 1 dK, of the CTA's keys (from j0) below
 * p.Nk. acc[c][nb][e] is row (of D) 64 c + 16 w4 + g + 8 (e / 2) of the key j0 + 8 nb + 2 t4 + e % 2.
 * Invariant: acc is final (every product waited for). */
template <typename T>
__device__ __forceinline__ void store_dkdv_wide(const kparams &p, float (&acc)[kWideD / 64][kWideKeys / 8][4], int cw,
                                                long long b, long long hk, long long j0, int w4, int g, int t4) {
    constexpr int D = kWideD, KEYS = kWideKeys, DB = D / 64;
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
    const cta_tile at = heaviest_first<true>(false); /* the first key tiles first: under a causal mask they are the longest */
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

    if (wg == 0) { /* producer: K and V once, then Q and dO of every step, part by part as released */
        setmaxnreg_dec<kProducerRegs>();
        produce_kv_and_steps<VARLEN>(tq, tdo, tk, tv, kp, p, sK, sV, sQ, sdO, kv_full, q_full, q_empty, do_full, do_empty,
                                     hk, b, j0, qt0, nqt, steps);
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
    store_dkdv_wide<T>(p, acc, cw, b, hk, j0, w4, g, t4);
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
    constexpr int D = kWideD, BM = kSm90DqD512Rows, BN = L::BN, DB = D / 64, TILE = L::TILE;
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

    const uint32_t ds_full = base + L::ds_bars, ds_empty = ds_full + 16; /* + 8 buf */
    if (threadIdx.x == 0) {
        ring.init(8, 4); /* K: both warpgroups' warps; V: the second's */
        for (int x = 0; x < 2; x++) mbar_init(ds_full + 8 * x, 128), mbar_init(ds_empty + 8 * x, 128);
        mbar_init_fence();
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
            mbar_wait(ds_full + 8 * buf, (it >> 1) & 1);
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                const uint4 v = xds[kk * 128 + tid];
                pa[kk][0] = v.x, pa[kk][1] = v.y, pa[kk][2] = v.z, pa[kk][3] = v.w;
            }
            mbar_arrive_if(ds_empty + 8 * buf, it + 2 < steps);
        } else {
            mbar_arrive_if(ring.v_empty(st), lane == 0);
            named_sync(kWideReady + buf, 256);
            wide_dscores<BN>(p, s, xp, stat, tid);
            if (it + 2 < steps) named_arrive(kWideFree + buf, 256);
            pack_a<T, BN>(pa, s);
            if (it >= 2) mbar_wait(ds_empty + 8 * buf, ((it - 2) >> 1) & 1);
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) xds[kk * 128 + tid] = make_uint4(pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3]);
            mbar_arrive_if(ds_full + 8 * buf, true);
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

/* ---- host side ---- */

template <typename T, Cap CAP, bool VARLEN> static wa_status launch_dkdv(const kparams &c, const CUtensorMap (&m)[8], unsigned z, cudaStream_t s) {
    static volatile unsigned long long done = 0;
    CUDA_TRY(raise_once(dkdv_wide_ws_kernel<T, CAP, VARLEN>, kv_wide_layout::bytes, &done));
    dkdv_wide_ws_kernel<T, CAP, VARLEN><<<dim3((unsigned)((c.Nk + kWideKeys - 1) / kWideKeys), (unsigned)c.Hkv, z), kThreads,
                                          kv_wide_layout::bytes, s>>>(m[0], m[1], m[2], m[3], c);
    CUDA_TRY(cudaGetLastError());
    return WA_OK;
}

template <typename T, Cap CAP, bool VARLEN> static wa_status launch_dq(const kparams &c, const CUtensorMap (&m)[8], unsigned z, cudaStream_t s) {
    static volatile unsigned long long done = 0;
    CUDA_TRY(raise_once(dq_wide_ws_kernel<T, CAP, VARLEN>, dq_wide_layout::bytes, &done));
    dq_wide_ws_kernel<T, CAP, VARLEN>
        <<<dim3((unsigned)((c.Nq + kSm90DqD512Rows - 1) / kSm90DqD512Rows), (unsigned)c.Hq, z), kThreads, dq_wide_layout::bytes, s>>>(m[4], m[5], m[6], m[7], c);
    CUDA_TRY(cudaGetLastError());
    return WA_OK;
}

} /* namespace */

wa_status sm90_dkdv_d512(const kparams &c, wa_dtype dt, const CUtensorMap (&maps)[8], unsigned z, cudaStream_t s) {
    return for_dtype(dt, [&](auto t) {
        using T = decltype(t);
        if (c.softcap > 0.0f) return c.cu_q ? launch_dkdv<T, Cap::on, true>(c, maps, z, s) : launch_dkdv<T, Cap::on, false>(c, maps, z, s);
        return c.cu_q ? launch_dkdv<T, Cap::off, true>(c, maps, z, s) : launch_dkdv<T, Cap::off, false>(c, maps, z, s);
    });
}

wa_status sm90_dq_d512(const kparams &c, wa_dtype dt, const CUtensorMap (&maps)[8], unsigned z, cudaStream_t s) {
    return for_dtype(dt, [&](auto t) {
        using T = decltype(t);
        if (c.softcap > 0.0f) return c.cu_q ? launch_dq<T, Cap::on, true>(c, maps, z, s) : launch_dq<T, Cap::on, false>(c, maps, z, s);
        return c.cu_q ? launch_dq<T, Cap::off, true>(c, maps, z, s) : launch_dq<T, Cap::off, false>(c, maps, z, s);
    });
}

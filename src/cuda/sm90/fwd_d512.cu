/* sm90/fwd_d512.cu — the forward for f16/bf16 at D = 512 on Hopper: TMA, wgmma, the consumers
 * split by role (as ffpa-attn's SM90 kernel splits them).
 *
 * A warpgroup cannot hold O for 64 rows × 512 columns (256 registers a thread). So consumer 0
 * (the CTA's warpgroup 1) forms S over all of D (m64n64k16 from shared memory, key tiles of 64),
 * runs the whole softmax, keeps O's columns 0-255 and hands P (bf16/f16, stmatrix) and the rows'
 * rescale factors to consumer 1 through shared memory behind mbarriers (two buffers); consumer 1
 * only reads them (ldmatrix: the same fragments) and accumulates O's columns 256-511. No partial S
 * is traded, no mask or maximum is taken twice, and consumer 1's products run under consumer 0's
 * softmax. Consumer 0 issues tile t's S and then tile t - 1's O += P V behind it, and runs tile t's
 * softmax while that product does (FlashAttention 3's overlap inside a warpgroup).
 *
 * K and V have one stage each (64 KB a tile). K's two halves of D and V's two column halves have
 * their own full / empty mbarriers and are released apart, so the half one consumer is done with
 * is refilled while the rest is still read; K and each half of V have a producer thread of their
 * own (one thread loading V's halves in order would make the back half wait behind the front
 * half's release, which the overlap moves a step later). Shared memory: Q, K, V (192 KB), two P
 * buffers (16 KB), two buffers of factors or, last, row sums (2 KB). The epilogue stages each
 * consumer's half of O through its own half of V where O's rows are 16-byte aligned.
 *
 * Rectangular calls run persistent (kSm90FwdD512Order): one CTA per SM walks the work items, the
 * producer loading the next item's Q once consumer 0's last S is done (q_empty) and its first K
 * and V tiles as soon as the stages free up, and consumer 0 starting the next item's S while
 * consumer 1 finishes the last O += P V. */
#include "fwd_common.cuh"

namespace {

constexpr int kWideD = kSm90D512, kWideBM = kSm90FwdD512Rows, kAsymBN = kSm90FwdD512Keys;

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

/* The epilogue of one consumer warpgroup of fwd_wide_asym_kernel: its half of O (columns from 256 cw)
 * and, with column 0, the log-sum-exp, for the item's rows from i0. Staged through its half of V where
 * O's rows are 16-byte aligned and the item had keys, and that half then released to the producer
 * (v_empty, per warp); otherwise written from registers. Invariant: acc and row_sum are final (the
 * last O += P V waited for, consumer 1's row sums handed over). The scalars are references to the
 * item's variables, as the code used them inline (cuda_sass_diff.sh: the SASS is the same). */
template <typename T>
__device__ __forceinline__ void store_output_half(const kparams &p, float (&acc)[4][8][4], const float (&row_max)[2],
                                                  const float (&row_sum)[2], const long long (&rows)[2],
                                                  const long long &i0, long long b, long long h,
                                                  unsigned char *const &aligned, const bool &staged, const int &n,
                                                  const uint32_t &v_empty, const int &cw, const int &w4,
                                                  const int &lane, const int &t4) {
    using L = asym_layout;
    constexpr int BN = kAsymBN;
    if (staged && n > 0) {
        store_rows_staged<T, 256, BN>(p, reinterpret_cast<const float (&)[32][4]>(acc), row_max, row_sum, i0, b, h,
                                      aligned + L::v + cw * 4 * (BN * 128), 0, w4, lane, cw * 256);
        fence_proxy_async(); /* the stage's reads and writes before the TMA load that refills it */
        __syncwarp();
        mbar_arrive_if(v_empty, lane == 0); /* the warp's 16 rows copied out */
    } else {
        store_rows<T, 32>(p, reinterpret_cast<const float (&)[32][4]>(acc), row_max, row_sum, rows, b, h, t4, cw * 256);
    }
}

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
        mbar_init(bar(L::kb_full), 1), mbar_init(bar(L::kb_empty), 4); /* K's second half */
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
    if (wg == 0) { /* producer: Q and K by one thread, V's halves by one each */
        setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x != 0 && threadIdx.x != 32 && threadIdx.x != 64) return;
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
        for_each_item<BM, PERSIST ? kSm90FwdD512Order : 0>(p, sv.b(), [&](long long i0, long long h, long long b) {
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
                    load_by_halves(sK, mk, L::k_full, L::k_empty, L::kb_full, L::kb_empty, it, kt, hk, b);
                }
            } else {
                const int h0 = threadIdx.x == 64, h1 = h0 + 1;
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
    const bool staged = rows_aligned16<T>(p.o);
    const uint32_t v_empty = bar(cw ? L::vb_empty : L::vf_empty);
    uint32_t pit = 0;
    for_each_item<BM, PERSIST ? kSm90FwdD512Order : 0>(p, sv.b(), [&](long long i0, long long h, long long b) {
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
            auto issue_s = [&](float (&s)[BN / 8][4], const int kx0, const int kx1) { /* k steps [kx0, kx1) */
                const uint64_t q_d = gmma_desc(opaque(sQ)), k_d = gmma_desc(opaque(sK));
#pragma unroll
                for (int kx = kx0; kx < kx1; kx++)
                    wgmma_ss<T, BN>(s, desc_at(q_d, (kx >> 2) * (BM * 128) + (kx & 3) * 32),
                                    desc_at(k_d, (kx >> 2) * (BN * 128) + (kx & 3) * 32), kx > 0);
            };
            if (n > 0) mbar_wait(bar(L::q_full), qi & 1u);
            /* tile it's S, issued once both of K's halves are in, as two commit groups */
            auto issue_s_groups = [&](float (&s)[BN / 8][4], int it) {
                const uint32_t ph = (kit + (uint32_t)it) & 1u;
                mbar_wait(bar(L::k_full), ph);
                /* both halves in before the first product: a wait between the two groups makes ptxas
                 * fence the second (its warning C7519, "warpgroup.arrive injected") */
                mbar_wait(bar(L::kb_full), ph);
                wg_fence();
                issue_s(s, 0, KS / 2);
                wg_commit();
                issue_s(s, KS / 2, KS);
                wg_commit();
            };
            /* S done, with `later` (std::integral_constant) groups committed behind it still running;
             * K released as its halves are read (the first refilled under the second's products) */
            auto retire_s = [&](float (&s)[BN / 8][4], auto later) {
                constexpr int LATER = decltype(later)::value;
                wg_wait<LATER + 1>();
                mbar_arrive_if(bar(L::k_empty), lane == 0);
                wg_wait<LATER>();
                reg_fence(s);
                mbar_arrive_if(bar(L::kb_empty), lane == 0);
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
            if (n > 0) {
                /* tile it's S is issued, then the last tile's O += P V behind it, and the softmax
                 * runs while that product does */
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
        store_output_half<T>(p, acc, row_max, row_sum, rows, i0, b, h, aligned, staged, n, v_empty, cw, w4, lane, t4);
        pit += (uint32_t)n + 1, kit += (uint32_t)n;
        qi += n > 0;
    });
#endif
}

/* ---- host side ---- */

/* the rectangular form (persistent) on one CTA per SM, or the varlen one on a (query tiles, heads,
 * sequences) grid over the sequences (over_sequences), tiles from the longest */
template <typename T, Cap CAP, bool VARLEN>
static wa_status launch(const kparams &kp, const CUtensorMap (&maps)[3], int sms, cudaStream_t s) {
    static volatile unsigned long long done = 0;
    constexpr bool PERSIST = !VARLEN;
    CUDA_TRY(raise_once(fwd_wide_asym_kernel<T, CAP, VARLEN, PERSIST>, asym_layout::bytes, &done));
    const wa_status st = write_seq_maps(kp, maps, 3, kKeyMaps, s);
    if (st != WA_OK) return st;
    return over_sequences(kp, [&](const kparams &c, unsigned z) {
        const dim3 grid((unsigned)((kp.Nq + kWideBM - 1) / kWideBM), (unsigned)kp.Hq, z);
        if constexpr (PERSIST) { /* one CTA per SM, or per item where there are fewer */
            const long long items = (long long)grid.x * grid.y * grid.z;
            const unsigned ctas = (unsigned)(items < sms ? items : sms);
            fwd_wide_asym_kernel<T, CAP, VARLEN, PERSIST><<<ctas, kThreads, asym_layout::bytes, s>>>(maps[0], maps[1], maps[2], c);
        } else {
            fwd_wide_asym_kernel<T, CAP, VARLEN><<<grid, kThreads, asym_layout::bytes, s>>>(maps[0], maps[1], maps[2], c);
        }
        CUDA_TRY(cudaGetLastError());
        return WA_OK;
    });
}

template <typename T> static wa_status by_cap(const kparams &kp, const CUtensorMap (&maps)[3], int sms, cudaStream_t s) {
    if (kp.cu_q) return kp.softcap > 0.0f ? launch<T, Cap::on, true>(kp, maps, sms, s) : launch<T, Cap::off, true>(kp, maps, sms, s);
    return kp.softcap > 0.0f ? launch<T, Cap::on, false>(kp, maps, sms, s) : launch<T, Cap::off, false>(kp, maps, sms, s);
}

} /* namespace */

wa_status sm90_forward_d512(const kparams &kp, wa_dtype dt, const CUtensorMap (&maps)[3], int sms, cudaStream_t s) {
    return dt == WA_BF16 ? by_cap<__nv_bfloat16>(kp, maps, sms, s) : by_cap<__half>(kp, maps, sms, s);
}

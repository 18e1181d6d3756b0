/* sm90/fwd.cu — the forward for f16/bf16 at D = 64, 128, 256 on Hopper: TMA, warp-specialised
 * wgmma (FlashAttention-3's structure, written for this library's window geometry).
 *
 * One CTA of three warpgroups per 128 query rows of one head:
 *   producer   warpgroup 0 gives its registers back (setmaxnreg) and one thread issues TMA loads:
 *              Q once, then K and V of each key tile the window allows into a two-stage ring;
 *              each stage has a "full" mbarrier (TMA's transaction count) and an "empty" one
 *              (the consumers' release), separately for K and V.
 *   consumers  warpgroups 1 and 2 own 64 query rows each: S = Q Kᵀ with wgmma from shared memory,
 *              the online softmax in registers, O += P V with P from registers. PIPELINED: the
 *              product O += P V of tile j-1 is issued right after S of tile j and runs on the
 *              tensor cores while this warpgroup does tile j's softmax; only the rescale of O
 *              waits for it (WINATTN_CUDA=no-overlap runs the form without it).
 * Rectangular calls run persistent: one CTA per SM walks the work items (kSm90FwdOrder), so that
 * what one item leaves exposed (barrier set-up, the first loads, the last O += P V, the epilogue)
 * runs under the next one's work; the ring's and Q's phases run on across the items.
 * Tiles are the column blocks of 64 values with the 128-byte swizzle of prims/mma.cuh (blk_off),
 * which is what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and a box of 64 values × rows; rows
 * past the end of a sequence arrive as zeros (TMA's out-of-bounds fill) and are masked.
 *
 * Masks, key-tile ranges and edge tiles come from tile_geometry.h, per warpgroup: a warpgroup
 * skips the key tiles its 64 rows do not see (it still waits for them and releases the stage, so
 * the ring's phases stay in order). */
#include "fwd_common.cuh"

namespace {

constexpr int kBM = kSm90FwdRows;
template <int D> __host__ __device__ constexpr int ws_bn() { return sm90_fwd_keys<D>(); }

/* warpgroup 0 of both forwards, once it gave its registers back: one thread loads the Q tile (BM rows,
 * DB column blocks) and K and V of key tiles [kt0, kt1) into the ring (from tile it0 of its count), through the launch's maps
 * or (varlen) the sequence's (seq_map: rows past the sequence arrive as zeros); q_row0 and k_row0
 * are a varlen sequence's first rows in the packed tensors (0 otherwise) */
template <int BM, int BN, int DB, bool VARLEN>
__device__ __forceinline__ void produce_forward(const kv_ring &ring, const CUtensorMap &tq, const CUtensorMap &tk,
                                                const CUtensorMap &tv, const kparams &kp, uint32_t sQ, uint32_t sK, uint32_t sV,
                                                long long i0, long long h, long long hk, long long b, int64_t kt0, int64_t kt1,
                                                long long q_row0, long long k_row0, int it0 = 0) {
    if (threadIdx.x == 0 && kt0 < kt1) {
        const CUtensorMap *mq = seq_map<VARLEN>(tq, kp, 0), *mk = seq_map<VARLEN>(tk, kp, 1), *mv = seq_map<VARLEN>(tv, kp, 2);
        mbar_expect_tx(ring.once(), BM * DB * 64 * 2);
        for (int c = 0; c < DB; c++) tma_load(sQ + c * (BM * 128), mq, ring.once(), c * 64, (int)(q_row0 + i0), (int)h, (int)b);
        ring.produce<BN, DB>(mk, mv, sK, sV, kt0, kt1, (int)hk, (int)b, k_row0, it0);
    }
}

/* The shared memory of one CTA. PERSIST: O is staged through a buffer of each consumer's own (64
 * rows × up to 128 columns, D = 256 in two parts) instead of its rows of Q, which by then may hold
 * the next item's Q; q_empty tells the producer when both consumers' last S of an item is done. */
template <int D, bool PERSIST = false> struct ws_layout {
    static constexpr int BN = ws_bn<D>(), O_PART = D < 128 ? D : 128; /* the persistent epilogue's columns at a time */
    static constexpr uint32_t O_STAGE = 64 * O_PART * 2; /* a consumer's O buffer (persistent) */
    static constexpr uint32_t q = 0, k = kBM * D * 2, v = k + kStages * BN * D * 2, o = v + kStages * BN * D * 2,
                              bars = o + (PERSIST ? kConsumers * O_STAGE : 0), q_empty = bars + 8 * kv_ring::n_bars;
    static constexpr size_t bytes = 1024 + q_empty + (PERSIST ? 8 : 0); /* 1024: alignment slack for the swizzle */
};
static_assert(ws_layout<64>::bytes <= 232448 && ws_layout<128>::bytes <= 232448 && ws_layout<256>::bytes <= 232448,
              "the D <= 256 forward fits the 227 KB a CTA may have");

constexpr int kEpilogueBar = 4; /* + the consumer warpgroup's index: its rows of Q are free */

/* The producer warpgroup's work, thread 0 only: each item with keys gets Q and its key tiles
 * (produce_forward). Invariant: kit counts the key tiles and qi the Q loads issued before the item,
 * as the consumers count them, so that the ring's and Q's phases agree across a persistent CTA's
 * items; a persistent CTA waits for q_empty (the last item's Q read) before it overwrites Q. */
template <int BM, int BN, int DB, bool VARLEN, bool PERSIST, int ORDER, typename SeqView, typename KeyTiles>
__device__ __forceinline__ void produce_items(const kv_ring &ring, const CUtensorMap &tq, const CUtensorMap &tk,
                                              const CUtensorMap &tv, const kparams &kp, const SeqView &sv, const uint32_t &sQ,
                                              const uint32_t &sK, const uint32_t &sV, const uint32_t &q_empty, KeyTiles &key_tiles, int &kit, uint32_t &qi) {
    const kparams &p = sv.p;
    for_each_item<BM, ORDER>(p, sv.b(), [&](long long i0, long long h, long long b) {
        int64_t kt0, kt1;
        key_tiles(i0, kt0, kt1);
        if (kt0 >= kt1) return;
        if (PERSIST && qi > 0) mbar_wait(q_empty, (qi - 1) & 1u); /* the last item's Q read */
        produce_forward<BM, BN, DB, VARLEN>(ring, tq, tk, tv, kp, sQ, sK, sV, i0, h, h / p.group, b, kt0, kt1,
                                            VARLEN ? p.q_row0 : 0, VARLEN ? p.k_row0 : 0, kit);
        kit += (int)(kt1 - kt0), qi++;
    });
}

/* The key tiles of one consumer warpgroup's rows within its item: [kt0, kt1) the item's (each one
 * waited for and released, so that the ring's phases stay in order), [wk0, wk1) those these rows see
 * (wk0 = wk1 = kt1: none), [ut0, ut1) those they see whole (no mask). */
/* One consumer warpgroup's main loop over an item's key tiles: S = Q Kᵀ, the online softmax and
 * O += P V into acc (zero on entry), row_max and row_sum, with pa holding P of the last tile between
 * its softmax and its O += P V. Invariant: every tile of [kt0, kt1) is waited for and its stage
 * released exactly once, in order, with ring positions counted from kit; on return every product is
 * complete (acc final) and, persistent, q_empty has had this warpgroup's arrival. */
template <typename T, int D, int BN, bool PIPELINED, Cap CAP, bool PERSIST>
__device__ __forceinline__ void mainloop(const kv_ring &ring, const kparams &p, const uint32_t &sQ, const uint32_t &sK, const uint32_t &sV,
                                         const uint32_t &q_empty, const int64_t &kt0, const int64_t &kt1, const int64_t &wk0, const int64_t &wk1, const int64_t &ut0, const int64_t &ut1, const long long (&rows)[2],
                                         const int &cw, const int &lane, const int &t4, const float &scale2, int &kit, uint32_t &qi,
                                         float (&acc)[D / 64][8][4],
                                         float (&row_max)[2], float (&row_sum)[2], uint32_t (&pa)[BN / 16][4]) {
    constexpr int BM = kBM, DB = D / 64, KS = D / 16, TILE = BN * D * 2;

    auto skip_tile = [&](long long kt) { ring.skip(kit + (int)(kt - kt0), lane); };

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
        wg_fence();
        issue_pv(st);
        wg_commit();
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
        wg_fence();
        issue_s(s, st);
        wg_commit();
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
                wg_fence();
                issue_s(s, st);
                wg_commit();
                issue_pv(pst);
                wg_commit();
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
}

/* The epilogue of one consumer warpgroup: O = acc / row_sum and the log-sum-exp written for its 64
 * rows from r0. Staged through shared memory where O's rows are 16-byte aligned: persistent, this
 * warpgroup's own buffer at base + L::o; otherwise its rows of Q, free once the warpgroup's products
 * are all done (the named barrier). Invariant: acc, row_max and row_sum are final (mainloop returned);
 * acc is only read. */
template <typename T, int D, bool PERSIST>
__device__ __forceinline__ void store_output(const kparams &p, float (&acc)[D / 64][8][4],
                                             const float (&row_max)[2], const float (&row_sum)[2],
                                             const long long (&rows)[2], const long long &r0, long long b, long long h,
                                             unsigned char *smem, const uint32_t &base, const uint32_t &sQ, const bool &o_vec16, const int &cw,
                                             const int &w4, const int &lane, const int &t4) {
    using L = ws_layout<D, PERSIST>;
    constexpr int BM = kBM, DB = D / 64;
    if (o_vec16) {
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
}

template <typename T, int D, bool PIPELINED, Cap CAP, bool VARLEN, int ORDER = 0>
__global__ void __launch_bounds__(kThreads, 1)
    fwd_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                  const __grid_constant__ CUtensorMap tv, const kparams kp) {
#if WA_HOPPER_STUB /* not the sm_90a compilation: never launched (common.cuh) */
    __trap();
#else
    constexpr bool PERSIST = ORDER != 0;
    static_assert(!PERSIST || (!VARLEN && PIPELINED), "persistent: rectangular, pipelined");
    using L = ws_layout<D, PERSIST>;
    static_assert(L::bytes <= 232448 && L::o % 1024 == 0, "227 KB a CTA; the O buffers' 128-byte swizzle is 1024-byte aligned");
    constexpr int BM = kBM, BN = L::BN, DB = D / 64;
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
        produce_items<BM, BN, DB, VARLEN, PERSIST, ORDER>(ring, tq, tk, tv, kp, sv, sQ, sK, sV, q_empty, key_tiles, kit, qi);
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
        mainloop<T, D, BN, PIPELINED, CAP, PERSIST>(ring, p, sQ, sK, sV, q_empty, kt0, kt1, wk0, wk1, ut0, ut1, rows, cw, lane,
                                                    t4, scale2, kit, qi, acc, row_max, row_sum, pa);
        store_output<T, D, PERSIST>(p, acc, row_max, row_sum, rows, r0, b, h, smem, base, sQ, o_vec16, cw, w4, lane, t4);
        if (kt0 < kt1) kit += (int)(kt1 - kt0), qi++;
    });
#endif
}

/* ---- host side ---- */

/* the rectangular instance (VARLEN false) on a (query tiles, heads, B) grid, or the varlen one over
 * the sequences (over_sequences), tiles from the longest */
template <typename T, int D, bool PIPELINED, Cap CAP, bool VARLEN>
static wa_status launch(const kparams &kp, const CUtensorMap &q, const CUtensorMap &k, const CUtensorMap &v, int sms, cudaStream_t s) {
    static volatile unsigned long long done = 0;
    constexpr int ORDER = VARLEN || !PIPELINED ? 0 : kSm90FwdOrder;
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

template <typename T, int D, Cap CAP> static wa_status by_variant(const kparams &kp, const CUtensorMap (&maps)[3], bool pipelined, int sms,
                                                                 cudaStream_t s) {
    if (kp.cu_q) return launch<T, D, true, CAP, true>(kp, maps[0], maps[1], maps[2], sms, s);
    return pipelined ? launch<T, D, true, CAP, false>(kp, maps[0], maps[1], maps[2], sms, s)
                     : launch<T, D, false, CAP, false>(kp, maps[0], maps[1], maps[2], sms, s);
}

template <typename T> static wa_status by_dim(const kparams &kp, const CUtensorMap (&maps)[3], bool pipelined, int sms, cudaStream_t s) {
    return for_head_dim(kp.D, [&](auto d) {
        constexpr int D = decltype(d)::value;
        return kp.softcap > 0.0f ? by_variant<T, D, Cap::on>(kp, maps, pipelined, sms, s)
                                 : by_variant<T, D, Cap::off>(kp, maps, pipelined, sms, s);
    });
}

} /* namespace */

/* The virtual architecture of the code the driver loaded for one of this file's kernels, as CUB's
 * PtxVersion reads it: 90 for the sm_90a SASS, 80 where the compute_80 PTX was JIT-compiled (a GPU
 * with no SASS here, or any GPU under CUDA_FORCE_PTX_JIT=1), whose sm90 kernels are stubs. Every
 * .cu file is built for the same targets, so the driver makes the same choice for each. No launch:
 * safe during stream capture. */
int sm90_code_loaded(void) {
    cudaFuncAttributes a;
    if (cudaFuncGetAttributes(&a, fwd_ws_kernel<__nv_bfloat16, 128, true, Cap::off, false, kSm90FwdOrder>) != cudaSuccess) {
        (void)cudaGetLastError(); /* not left behind for the launch checks */
        return 0;
    }
    return a.ptxVersion >= 90;
}

wa_status sm90_forward(const kparams &kp, wa_dtype dt, const CUtensorMap (&maps)[3], bool pipelined, int sms, cudaStream_t s) {
    return dt == WA_BF16 ? by_dim<__nv_bfloat16>(kp, maps, pipelined, sms, s) : by_dim<__half>(kp, maps, pipelined, sms, s);
}

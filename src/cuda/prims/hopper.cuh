/* prims/hopper.cuh — what the TMA kernels (sm90/) add to prims/mma.cuh: mbarriers, TMA tensor
 * and bulk loads, bulk reduce-adds, named barriers, register reallocation between warpgroups, the
 * key-tile ring, and the per-sequence tensor maps of a varlen call. */
#ifndef WA_CUDA_HOPPER_PRIMS_CUH
#define WA_CUDA_HOPPER_PRIMS_CUH

#include "mma.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#if WA_HOPPER_STUB
/* the stub bodies (common.cuh) leave the kernels' constants unreferenced in this compilation */
#pragma nv_diag_suppress 177
#endif

namespace {

/* ---- mbarrier, TMA and register reallocation (PTX) ---- */

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/* makes the initialised barriers visible to the async proxy (TMA) and the other threads */
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
/* arrive when `pred`, as a predicated instruction rather than a branch: ptxas serialises wgmma
 * around divergent branches while products are in flight (its warning C7520) */
__device__ __forceinline__ void mbar_arrive_if(uint32_t bar, bool pred) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar), "r"((int)pred)
                 : "memory");
}
/* wait until the barrier's phase of the given parity has completed; -DWA_DEBUG_WAIT_TIMEOUT
 * (traits.cuh) makes a wait that spins 2^22 times print where it is and give up */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
#ifdef WA_DEBUG_WAIT_TIMEOUT
    unsigned spins = 0;
#endif
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
#ifdef WA_DEBUG_WAIT_TIMEOUT
        if (!done && ++spins == (1u << 22)) {
            printf("mbar_wait gave up: bar %u parity %u grid %u %u %u block %u %u %u thread %u\n", bar, parity, gridDim.x, gridDim.y,
                   gridDim.z, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
            break;
        }
#endif
    } while (!done);
}
/* one box of the 4-D tensor (d, n, h, b) into shared memory; completion is counted on bar */
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *map, uint32_t bar, int d, int n, int h, int b) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
        "l"((uint64_t)map), "r"(d), "r"(n), "r"(h), "r"(b), "r"(bar)
        : "memory");
}
/* `bytes` (a multiple of 16, both ends 16-byte aligned) from global src into shared dst by the
 * async proxy; completion is counted on bar, as tma_load's */
__device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst), "l"(src),
                 "r"(bytes), "r"(bar)
                 : "memory");
}
/* global f32 [dst, dst + bytes) += shared [src, src + bytes), element-wise, by the async proxy
 * (bytes a multiple of 16, both ends 16-byte aligned); the shared source must have been written
 * before a fence_proxy_async() and a barrier. Completion is tracked by bulk groups: */
__device__ __forceinline__ void bulk_reduce_add_f32(float *dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}
/* global [dst, dst + bytes) = shared [src, src + bytes), by the async proxy, as bulk_reduce_add_f32
 * (the same alignment, completion by bulk groups) */
__device__ __forceinline__ void bulk_store_f32(float *dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
/* global f32 dst[0], dst[1] += x, y when pred: one relaxed vector reduction performed at L2 (dst
 * 8-byte aligned); predicated, not branched, like mbar_arrive_if */
__device__ __forceinline__ void red_add_v2_if(float *dst, float x, float y, bool pred) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %3, 0;\n@p red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};\n}\n" ::"l"(dst),
                 "f"(x), "f"(y), "r"((int)pred)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
/* the source of every committed group but the newest N has been read (its buffer may be rewritten) */
template <int N> __device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
/* every committed group but the newest N is complete (its writes are done) */
template <int N> __device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }
/* x, unknown to the optimiser: what is computed from it is not hoisted above this point */
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
    asm volatile("" : "+r"(x));
    return x;
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> __device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
/* The warp's index in the CTA, from which the kernels take the warpgroup's (warp / 4), read
 * through a shuffle from lane 0 so that the compiler knows it is the same in every lane. Derived
 * from threadIdx.x it looks per-thread: whatever the kernels build from the warpgroup index
 * (roles, tile rows, shared-memory offsets, each wgmma descriptor) would then live in ordinary
 * registers and be copied into uniform ones (R2UR) before every wgmma, and branches on it would
 * carry divergence checks (BRA.DIV). */
__device__ __forceinline__ int warp_index() { return __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 5), 0); }
/* named barriers 1..15 between warpgroups: `n` threads in all arrive or wait */
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void named_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
/* four 8 × 8 tiles of 16-bit values from fragments (the layout ldmatrix gives and mma.sync's
 * accumulators have: r[i] holds row lane / 4, columns 2 (lane % 4) and + 1 of tile i) to shared
 * memory; lanes 8 i .. 8 i + 7 give the addresses of tile i's eight rows */
__device__ __forceinline__ void stsm_x4(uint32_t addr, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

/* The ring the forwards and the dQ kernels stream key tiles through: an "once" barrier for the
 * tiles loaded once per CTA (Q, and dO in the dQ kernels), then for each of STAGES stages a full
 * and an empty mbarrier for K and for V, 8 bytes each from `bar`. Key tile `it` (counted from the
 * CTA's first) goes to stage it % STAGES in round it / STAGES; a consumer waits on full with the
 * round's parity, the producer reuses a stage once the consumer warps that read it (one arrival
 * each) emptied it. Two stages everywhere but the D = 512 dQ kernel, whose resident Q and dO leave
 * room for one stage of 32-key tiles. */
template <int STAGES> struct kv_ring_of {
    static constexpr int kStages = STAGES;
    static constexpr uint32_t n_bars = 1 + 4 * kStages;
    uint32_t bar;

    __device__ uint32_t once() const { return bar; }
    __device__ uint32_t k_full(int s) const { return bar + 8 * (1 + 4 * s); }
    __device__ uint32_t v_full(int s) const { return bar + 8 * (2 + 4 * s); }
    __device__ uint32_t k_empty(int s) const { return bar + 8 * (3 + 4 * s); }
    __device__ uint32_t v_empty(int s) const { return bar + 8 * (4 + 4 * s); }
    static_assert((kStages & (kStages - 1)) == 0, "stage() and parity() mask and shift");
    __device__ static int stage(int it) { return it & (kStages - 1); } /* it >= 0 */
    __device__ static uint32_t parity(int it) { return ((uint32_t)it / kStages) & 1u; }

    /* by one thread, before the CTA's __syncthreads(): the consumer warps that release each K
     * stage, and each V stage (the same unless given: the D = 512 dQ kernel reads V in one
     * warpgroup only) */
    __device__ void init(uint32_t k_warps, uint32_t v_warps = 0) const {
        mbar_init(once(), 1);
        for (int s = 0; s < kStages; s++) {
            mbar_init(k_full(s), 1), mbar_init(v_full(s), 1);
            mbar_init(k_empty(s), k_warps), mbar_init(v_empty(s), v_warps ? v_warps : k_warps);
        }
        mbar_init_fence();
    }
    /* the producer thread: K and V of key tiles [kt0, kt1) of kv head hk, boxes of 64 values × BN
     * rows (the tensor maps'), into the stages at sK and sV (tiles of BN × DB × 64 values); row0
     * is the sequence's first row in a varlen call's packed tensors (0 otherwise); it0 the ring's
     * tiles before these (a persistent CTA's earlier work items). V_FIRST loads each tile's V
     * before its K: the D = 512 dQ kernel releases V early in a step and K at its end, so its
     * single stage can take the next V while this step's K is still read. */
    template <int BN, int DB, bool V_FIRST = false>
    __device__ void produce(const CUtensorMap *tk, const CUtensorMap *tv, uint32_t sK, uint32_t sV, long long kt0,
                            long long kt1, int hk, int b, long long row0, int it0 = 0) const {
        constexpr uint32_t TILE = BN * DB * 64 * 2;
        for (long long kt = kt0; kt < kt1; kt++) {
            const int it = it0 + (int)(kt - kt0), st = stage(it);
            const uint32_t ph = parity(it);
            auto load = [&](bool is_v) {
                if (it >= kStages) mbar_wait(is_v ? v_empty(st) : k_empty(st), ph ^ 1u); /* the consumers released its last use */
                const uint32_t full = is_v ? v_full(st) : k_full(st), dst = (is_v ? sV : sK) + st * TILE;
                mbar_expect_tx(full, TILE);
                for (int c = 0; c < DB; c++) tma_load(dst + c * (BN * 128), is_v ? tv : tk, full, c * 64, (int)(row0 + kt * BN), hk, b);
            };
            load(V_FIRST);
            load(!V_FIRST);
        }
    }
    /* a consumer warp's turn on key tile `it` when its rows see none of it: wait until it landed
     * (so the ring's phases stay in order) and release it */
    __device__ void skip(int it, int lane) const {
        const int st = stage(it);
        const uint32_t ph = parity(it);
        mbar_wait(k_full(st), ph);
        mbar_arrive_if(k_empty(st), lane == 0);
        mbar_wait(v_full(st), ph);
        mbar_arrive_if(v_empty(st), lane == 0);
    }
};
using kv_ring = kv_ring_of<kSm90Stages>;

/* ---- varlen: tensor maps cut at each sequence's end ----
 *
 * A varlen launch maps the packed tensors whole, and a CTA loads at its sequence's rows. The last
 * tile of a sequence would then read the first rows of the next one: masked, but a NaN or an
 * infinity there still reaches the sequence through 0 × NaN in a tile product (P V, dSᵀ Q, dS K).
 * So each sequence gets its own copy of every map of the launch with the row extent (dimension 1)
 * set to the sequence's end: TMA fills the rows past it with zeros, exactly as past the end of a
 * rectangular tensor. seq_maps_kernel writes the copies (kparams.seq_maps, B × kMaxSeqMaps maps)
 * before the launch that reads them; seq_map() picks a CTA's. */
struct launch_maps {
    CUtensorMap map[kMaxSeqMaps];
    int count;
    unsigned key_rows; /* bit i: map i spans key rows (K, V), else query rows (Q, dO) */
};

/* one thread per (sequence, map): the launch's map copied to the sequence's slot, its row extent
 * replaced (tensormap.replace), released to the tensor-map proxy of the kernels that follow */
__global__ void __launch_bounds__(128) seq_maps_kernel(const __grid_constant__ launch_maps lm, const kparams kp) {
#if WA_HOPPER_STUB /* not the sm_90a compilation: never launched (common.cuh) */
    __trap();
#else
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, seq = i / lm.count;
    const int m = (int)(i % lm.count);
    if (seq >= kp.B) return;
    const bool key = (lm.key_rows >> m) & 1u;
    int64_t first, rows;
    wa_seq_rows(key ? kp.cu_k : kp.cu_q, seq, key ? kp.Tk : kp.Tq, key ? kp.Nk : kp.Nq, &first, &rows);
    CUtensorMap *out = (CUtensorMap *)kp.seq_maps + seq * kMaxSeqMaps + m;
    const uint4 *src = (const uint4 *)&lm.map[m];
    static_assert(sizeof(CUtensorMap) == kTensorMapBytes, "the workspace's map slots");
    for (int w = 0; w < (int)(sizeof(CUtensorMap) / sizeof(uint4)); w++) ((uint4 *)out)[w] = src[w];
    /* at least one row: an extent of 0 is no valid map (an empty sequence's CTAs never load) */
    const uint32_t extent = (uint32_t)max(first + rows, (int64_t)1);
    asm volatile("tensormap.replace.tile.global_dim.global.b1024.b32 [%0], 1, %1;\n" ::"l"(out), "r"(extent) : "memory");
    asm volatile("fence.proxy.tensormap::generic.release.gpu;\n" ::: "memory");
#endif
}

/* the tensor map a CTA loads through: the launch's own (rectangular), or its sequence's copy
 * (varlen), acquired for the tensor-map proxy before the first load through it */
template <bool VARLEN>
__device__ __forceinline__ const CUtensorMap *seq_map(const CUtensorMap &launch, const kparams &kp, int index) {
    if (!VARLEN) return &launch;
    const CUtensorMap *m = (const CUtensorMap *)kp.seq_maps + (kp.seq0 + blockIdx.z) * kMaxSeqMaps + index;
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(m) : "memory");
    return m;
}

/* acc (64 × D per warpgroup, f32) += a (16 columns of P or dS, registers) × 16 rows of an MN-major
 * operand (V, K, Q or dO: a tile of R rows stored as D/64 column blocks R × 128 bytes apart) given
 * by its descriptor, gmma_desc_mn(rows, R * 128) moved on with desc_at. One wgmma m64nDk16 spanning
 * every column block (the descriptor's leading offset steps from block to block), not D/64 narrow
 * ones: fewer instructions, and the register operand is read once. */
template <typename T, int D>
__device__ __forceinline__ void wide_mn_product(float (&acc)[D / 64][8][4], const uint32_t (&a)[4], uint64_t desc) {
    wgmma_rs_t<T, D>(reinterpret_cast<float (&)[D / 8][4]>(acc), a, desc, 1);
}

/* ---- host side ---- */

/* f(std::integral_constant<int, D>) for the head dims the sm90 kernels of D = 64, 128, 256 are built for */
template <typename F> static wa_status for_head_dim(long long D, F &&f) {
    switch (D) {
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
    }
    return wa_fail(WA_ERR_UNSUPPORTED, "sm90 kernels: D = %lld", D);
}
/* a varlen launch's per-sequence maps (seq_maps_kernel) from its `count` maps, before the kernels
 * that read them on stream s; rectangular: nothing */
static wa_status write_seq_maps(const kparams &kp, const CUtensorMap *maps, int count, unsigned key_rows, cudaStream_t s) {
    if (!kp.cu_q || kp.B == 0) return WA_OK;
    if (!kp.seq_maps) return wa_fail(WA_ERR_CUDA, "varlen TMA launch without its tensor-map workspace");
    launch_maps lm;
    memset(&lm, 0, sizeof lm);
    memcpy(lm.map, maps, (size_t)count * sizeof(CUtensorMap));
    lm.count = count, lm.key_rows = key_rows;
    const long long threads = kp.B * count;
    seq_maps_kernel<<<(unsigned)((threads + 127) / 128), 128, 0, s>>>(lm, kp);
    CUDA_TRY(cudaGetLastError());
    return WA_OK;
}

} /* namespace */

#endif /* WA_CUDA_HOPPER_PRIMS_CUH */

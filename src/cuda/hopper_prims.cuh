/* hopper_prims.cuh — what the version-4 kernels (fwd_hopper.cu, bwd_hopper.cu) add to
 * mma_prims.cuh: mbarriers, TMA tensor loads, named barriers, register
 * reallocation between warpgroups, and the host side of TMA (tensor maps). */
#ifndef WA_CUDA_HOPPER_PRIMS_CUH
#define WA_CUDA_HOPPER_PRIMS_CUH

#include "mma_prims.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

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
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}
/* one box of the 4-D tensor (d, n, h, b) into shared memory; completion is counted on bar */
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *map, uint32_t bar, int d, int n, int h, int b) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
        "l"((uint64_t)map), "r"(d), "r"(n), "r"(h), "r"(b), "r"(bar)
        : "memory");
}
/* x, unknown to the optimiser: what is computed from it is not hoisted above this point */
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
    asm volatile("" : "+r"(x));
    return x;
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> __device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
/* named barriers 1..15 between warpgroups: `n` threads in all arrive or wait */
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void named_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }

/* acc (64 × D per warpgroup, f32) += a (16 columns of P or dS, registers) × 16 rows of an MN-major
 * operand at `rows` (V, K, Q or dO: a tile of R rows stored as D/64 column blocks R × 128 bytes
 * apart). One wgmma m64nDk16 spanning every column block (the descriptor's leading offset steps
 * from block to block), not D/64 narrow ones: fewer instructions, and the register operand is
 * read once. -DWA_NARROW_MN restores the narrow form (version 4's first measurements). */
template <typename T, int D, int R>
__device__ __forceinline__ void wide_mn_product(float (&acc)[D / 64][8][4], const uint32_t (&a)[4], uint32_t rows) {
#ifndef WA_NARROW_MN
    wgmma_rs_t<T, D>(reinterpret_cast<float (&)[D / 8][4]>(acc), a, gmma_desc_mn(rows, R * 128), 1);
#else
#pragma unroll
    for (int c = 0; c < D / 64; c++) wgmma_rs_t<T, 64>(acc[c], a, gmma_desc(rows + c * (R * 128)), 1);
#endif
}

/* ---- host side: dispatch and tensor maps ---- */

/* WINATTN_CUDA=mma or v3 keeps every call off version 4 (comparisons in dev/cuda) */
static bool hopper_forced_off() {
    const char *force = getenv("WINATTN_CUDA");
    return force && (!strcmp(force, "mma") || !strcmp(force, "v3"));
}

/* f(std::integral_constant<int, D>) for the head dims version 4 is built for (64, 128, 256) */
template <typename F> static wa_status for_head_dim(long long D, F &&f) {
    switch (D) {
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
    }
    return wa_fail(WA_ERR_UNSUPPORTED, "version-4 kernels: D = %lld", D);
}
static bool hopper_head_dim(long long D) { return D == 64 || D == 128 || D == 256; }

using encode_fn = PFN_cuTensorMapEncodeTiled_v12000;

static encode_fn tensor_map_encoder() {
    static const encode_fn fn = [] {
        void *f = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            return (encode_fn) nullptr;
        return (encode_fn)f;
    }();
    return fn;
}

/* t as the 4-D tensor (d, n, h, b) of 16-bit values, read in boxes of 64 values × rows with the
 * 128-byte swizzle. False when TMA cannot express it (a dimension of more than one row with a
 * stride that is zero or not a multiple of 16 bytes). */
static bool tensor_map(CUtensorMap *map, const dev_tensor &t, wa_dtype dt, long long B, long long H, long long N, int D,
                       int rows) {
    const encode_fn encode = tensor_map_encoder();
    if (!encode || N <= 0 || H <= 0 || B <= 0) return false;
    const cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)N, (cuuint64_t)H, (cuuint64_t)B};
    long long strides[3] = {t.s2 * 2, t.s1 * 2, t.s0 * 2};
    long long extent = (long long)D * 2; /* bytes spanned so far: stands in for a size-1 dimension's stride */
    for (int i = 0; i < 3; i++) {
        if (dims[i + 1] == 1) strides[i] = extent;
        if (strides[i] <= 0 || strides[i] % 16 || strides[i] >= (1LL << 40)) return false;
        extent = strides[i] * (long long)dims[i + 1];
    }
    const cuuint64_t gstride[3] = {(cuuint64_t)strides[0], (cuuint64_t)strides[1], (cuuint64_t)strides[2]};
    const cuuint32_t box[4] = {64, (cuuint32_t)rows, 1, 1}, estride[4] = {1, 1, 1, 1};
    return encode(map, dt == WA_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, t.data, dims,
                  gstride, box, estride, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

} /* namespace */

#endif /* WA_CUDA_HOPPER_PRIMS_CUH */

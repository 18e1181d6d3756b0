/* tma.cuh — the host side of TMA for the dispatcher: the driver's tensor-map encoder (fetched
 * with cudaGetDriverEntryPointByVersion, no link against libcuda) and the maps of one tensor. A
 * call whose tensors TMA cannot describe stays off the TMA kernels. */
#ifndef WA_CUDA_PRIMS_TMA_CUH
#define WA_CUDA_PRIMS_TMA_CUH

#include "../common.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>

namespace {

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
 * stride that is zero or not a multiple of 16 bytes). A varlen call's tensors are mapped whole
 * (B = 1, N = T rows): a CTA loads at its sequence's first row plus the tile's (kparams q_row0,
 * k_row0); rows past the sequence then hold the next one's (past T, zeros), and are masked exactly
 * as a ragged last tile's zeros are (tile_geometry.h bounds every mask by the sequence's own Nq,
 * Nk); no kernel stores through TMA. */
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

/* the batch entries and rows a tensor map spans: the packed tensor whole for varlen */
static long long map_batch(const kparams &kp) { return kp.cu_q ? 1 : kp.B; }
static long long map_q_rows(const kparams &kp) { return kp.cu_q ? kp.Tq : kp.Nq; }
static long long map_k_rows(const kparams &kp) { return kp.cu_q ? kp.Tk : kp.Nk; }

} /* namespace */

#endif /* WA_CUDA_PRIMS_TMA_CUH */

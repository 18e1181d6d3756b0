/* tensor_map_cost.cu — the host time of cuTensorMapEncodeTiled, the call the version-4/5 kernels'
 * launchers make for each operand (hopper_prims.cuh tensor_map: 4-D, 16-bit, boxes of 64 × rows,
 * 128-byte swizzle), against the size of the tensor it maps: does the driver's time grow with the
 * bytes mapped? A (b)-shaped operand [1, H, N, 128] bf16 for N from 1K to 64K, in one cudaMalloc
 * each, encoded 200 times; then the same 64K buffer declared 1K rows long (the same pointer, a
 * small extent), and cudaPointerGetAttributes on it for comparison. On the GPU machine:
 *   nvcc -O2 -std=c++17 -o build/tensor_map_cost dev/cuda/tensor_map_cost.cu && build/tensor_map_cost */
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <chrono>
#include <cstdio>

using encode_fn = PFN_cuTensorMapEncodeTiled_v12000;

static double encode_us(encode_fn encode, void *data, long long H, long long N, int reps) {
    const cuuint64_t dims[4] = {128, (cuuint64_t)N, (cuuint64_t)H, 1};
    const cuuint64_t gstride[3] = {256, (cuuint64_t)(256 * N), (cuuint64_t)(256 * N * H)};
    const cuuint32_t box[4] = {64, 128, 1, 1}, estride[4] = {1, 1, 1, 1};
    CUtensorMap map;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; i++)
        if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, data, dims, gstride, box, estride, CU_TENSOR_MAP_INTERLEAVE_NONE,
                   CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
            return -1.0;
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / reps;
}

int main() {
    void *f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
        fprintf(stderr, "tensor_map_cost: no cuTensorMapEncodeTiled\n");
        return 1;
    }
    const encode_fn encode = (encode_fn)f;
    const long long H = 32;
    printf("| rows N | MB mapped | us per encode |\n|---|---|---|\n");
    void *last = nullptr;
    for (long long N = 1024; N <= 65536; N *= 4) {
        void *p = nullptr;
        if (cudaMalloc(&p, (size_t)(256 * N * H)) != cudaSuccess) {
            fprintf(stderr, "tensor_map_cost: cudaMalloc of %lld MB failed\n", 256 * N * H >> 20);
            return 1;
        }
        encode_us(encode, p, H, N, 20); /* warm */
        printf("| %lld | %lld | %.2f |\n", N, (256 * N * H) >> 20, encode_us(encode, p, H, N, 200));
        if (last) cudaFree(last);
        last = p;
    }
    printf("| 1024 of the 65536-row buffer | %lld | %.2f |\n", (256LL * 1024 * H) >> 20, encode_us(encode, last, H, 1024, 200));
    cudaPointerAttributes a;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 200; i++) cudaPointerGetAttributes(&a, last);
    printf("cudaPointerGetAttributes: %.2f us\n",
           std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 200);
    cudaFree(last);
    return 0;
}

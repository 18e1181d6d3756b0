/* l2_bandwidth.cu — how many bytes per second the SMs together can read from L2 (a buffer that
 * fits in it, read over and over) and from HBM (one that does not): the ceiling docs/cuda.md's
 * bytes-per-product estimate of the D = 512 kernels needs.
 *
 *   nvcc -O3 -arch=sm_90a -o build/l2_bandwidth dev/cuda/l2_bandwidth.cu && build/l2_bandwidth
 *
 * Every thread reads 16-byte vectors with ld.global.cg (cached in L2 only, not L1), a grid of
 * 4 CTAs of 512 threads per SM sweeping the whole buffer `passes` times; the XOR of what was read
 * is stored only if it equals a value it never has, so the loads stay. Median of 5 timings with
 * CUDA events. Prints one line per buffer size. */
#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

__global__ void __launch_bounds__(512) sweep(const uint4 *buf, size_t n, int passes, unsigned *out) {
    unsigned acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (int p = 0; p < passes; p++)
        for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
            const uint4 v = __ldcg(buf + i);
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    if (acc == 0x9e3779b9u) out[0] = acc;
}

int main() {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    int l2 = 0;
    cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0);
    printf("l2_bandwidth: %d SMs, L2 %d MB\n", sms, l2 >> 20);
    const size_t sizes_mb[] = {4, 8, 16, 24, 32, 2048};
    unsigned *out;
    uint4 *buf;
    if (cudaMalloc(&buf, (size_t)2048 << 20) != cudaSuccess || cudaMalloc(&out, 4) != cudaSuccess) {
        fprintf(stderr, "l2_bandwidth: cudaMalloc failed\n");
        return 1;
    }
    cudaMemset(buf, 1, (size_t)2048 << 20);
    cudaEvent_t a, b;
    cudaEventCreate(&a), cudaEventCreate(&b);
    for (size_t mb : sizes_mb) {
        const size_t n = (mb << 20) / sizeof(uint4);
        const int passes = mb >= 1024 ? 2 : (int)std::max<size_t>(4, 8192 / mb);
        sweep<<<4 * sms, 512>>>(buf, n, 1, out); /* warm-up: brings a small buffer into L2 */
        std::vector<float> ms;
        for (int r = 0; r < 5; r++) {
            cudaEventRecord(a);
            sweep<<<4 * sms, 512>>>(buf, n, passes, out);
            cudaEventRecord(b);
            cudaEventSynchronize(b);
            float t = 0;
            cudaEventElapsedTime(&t, a, b);
            ms.push_back(t);
        }
        std::sort(ms.begin(), ms.end());
        const double bytes = (double)(mb << 20) * passes;
        printf("buffer %5zu MB, %4d passes: %.2f ms, %.2f TB/s (%s)\n", mb, passes, ms[2], bytes / (ms[2] * 1e-3) / 1e12,
               (mb << 20) <= (size_t)l2 / 2 ? "fits in L2" : (mb << 20) <= (size_t)l2 ? "about L2's size" : "HBM");
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        fprintf(stderr, "l2_bandwidth: %s\n", cudaGetErrorString(e));
        return 1;
    }
    return 0;
}

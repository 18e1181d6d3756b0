// quant_cuda.cuh — train/quant.c's quantizers on the device: a projection already on the GPU (the
// values as a checkpoint stores them, or as drawn) into the packed form model_cuda.cu keeps. Included
// by model_cuda.cu inside its anonymous namespace, after f32() and to_e<>() (nothing else includes it).
//
// Bit-identity with the CPU reference: every f32 operation is the one quant.c makes, in its order,
// through the _rn intrinsics (nvcc fuses a product into a following sum unless told not to; quant.c
// is built with -ffp-contract=off); rintf is round half to even on both; denormals are kept (the
// build does not flush them). Maxima and minima are order-free (fmaxf/fminf of finite values is
// exact), so warps and blocks may reduce them in any order; where a zero's sign could come out
// differently the result does not depend on it (mlx4: a signed zero edge gives q0 = 0 and bias 0;
// nf4 and fp8 reduce |w|, always +0). Constants the CPU writes as decimal literals (mlx4's eps,
// nf4's floor, NF4's midpoints) come from the host compiler as kernel arguments, so both sides
// read the same bits.
//
// A non-finite value is not quantized: the kernel lowers *first to its flat index (atomicMin, from
// ~0) and leaves its unit (group, block, row) unwritten; the caller checks *first before the packed
// form is used.

// the host's constants, by value
struct quant_constants {
    float mlx4_eps;         // 1e-7f: the smallest |scale| of a group
    float nf4_floor;        // 1e-38f: the smallest absmax a block divides by
    float nf4_midpoint[15]; // (NF4[i] + NF4[i + 1]) / 2, as nf4_quantize_blocks computes them
};

__device__ __forceinline__ void note_nonfinite(unsigned long long *first, long i) {
    atomicMin(first, (unsigned long long)i);
}

// mlx4's code of x in its group: clamp(rint((x - bias) / scale), 0, 15), as mlx4_quantize_group
__device__ __forceinline__ unsigned mlx4_code(float x, float bias, float scale) {
    float v = rintf(__fdiv_rn(__fsub_rn(x, bias), scale));
    v = fminf(fmaxf(v, 0.0f), (float)((1 << MLX4_BITS) - 1));
    return (unsigned)v;
}

// mlx4: one warp per group of MLX4_GROUP (64) values, the groups consecutive in the flat row-major
// array (rows are whole groups); lane l holds values 2l and 2l + 1. Writes the group's 32 bytes of
// words (byte l: value 2l in the low nibble, 2l + 1 in the high one, which is the uint32 layout of
// eight codes a word, the first in the low bits, on a little-endian machine) and its scale and bias
// rounded to the storage dtype `code` (0 f32, 1 f16, 2 bf16), as mlx4_quantize_group.
template <class T>
__global__ void k_quant_mlx4(const T *w, long groups, int code, quant_constants k, uint8_t *words, void *scales,
                             void *biases, unsigned long long *first) {
    static_assert(MLX4_GROUP == 64 && MLX4_BITS == 4, "a warp holds one group, two values a lane");
    const unsigned all = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    long warp = (blockIdx.x * (long)blockDim.x + threadIdx.x) >> 5, warps = ((long)gridDim.x * blockDim.x) >> 5;
    for (long gi = warp; gi < groups; gi += warps) { // warp-uniform: every lane takes each group
        long i = gi * MLX4_GROUP + 2 * lane;
        float x0 = f32(w[i]), x1 = f32(w[i + 1]);
        if (!isfinite(x0)) note_nonfinite(first, i);
        else if (!isfinite(x1)) note_nonfinite(first, i + 1);
        if (!__all_sync(all, isfinite(x0) && isfinite(x1))) continue;
        float w_max = fmaxf(x0, x1), w_min = fminf(x0, x1);
        for (int o = 16; o > 0; o >>= 1) {
            w_max = fmaxf(w_max, __shfl_xor_sync(all, w_max, o));
            w_min = fminf(w_min, __shfl_xor_sync(all, w_min, o));
        }
        const float n_bins = (float)((1 << MLX4_BITS) - 1);
        bool min_is_edge = fabsf(w_min) > fabsf(w_max);
        float scale = fmaxf(__fdiv_rn(__fsub_rn(w_max, w_min), n_bins), k.mlx4_eps);
        if (!min_is_edge) scale = -scale;
        float edge = min_is_edge ? w_min : w_max;
        float q0 = rintf(__fdiv_rn(edge, scale));
        float bias = 0.0f;
        if (q0 != 0.0f) {
            scale = __fdiv_rn(edge, q0);
            bias = edge;
        }
        words[gi * (MLX4_GROUP / 2) + lane] = (uint8_t)(mlx4_code(x0, bias, scale) | mlx4_code(x1, bias, scale) << 4);
        if (lane == 0) {
            if (code == 1) {
                ((__half *)scales)[gi] = __float2half_rn(scale);
                ((__half *)biases)[gi] = __float2half_rn(bias);
            } else if (code == 2) {
                ((bf16 *)scales)[gi] = __float2bfloat16_rn(scale);
                ((bf16 *)biases)[gi] = __float2bfloat16_rn(bias);
            } else {
                ((float *)scales)[gi] = scale;
                ((float *)biases)[gi] = bias;
            }
        }
    }
}

// nf4's 4-bit step (nf4_quantize_blocks): one warp per block of NF4_BLOCK (64) values of the flat
// w[0..n), lane l holding values 2l and 2l + 1 of its block; the last block may be short (then it
// divides by max(absmax, floor) and stores that, where a full block multiplies by the reciprocal
// and stores absmax). Writes the codes two a byte, the first in the high nibble (a short block's
// odd last value leaves the low nibble 0), and the f32 absmax[b].
template <class T>
__global__ void k_quant_nf4(const T *w, long n, quant_constants k, uint8_t *codes, float *absmax,
                            unsigned long long *first) {
    static_assert(NF4_BLOCK == 64, "a warp holds one block, two values a lane");
    const unsigned all = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    long warp = (blockIdx.x * (long)blockDim.x + threadIdx.x) >> 5, warps = ((long)gridDim.x * blockDim.x) >> 5;
    long blocks = (n + NF4_BLOCK - 1) / NF4_BLOCK;
    for (long b = warp; b < blocks; b += warps) { // warp-uniform
        long len = n - b * NF4_BLOCK < NF4_BLOCK ? n - b * NF4_BLOCK : NF4_BLOCK;
        long i = b * NF4_BLOCK + 2 * lane;
        bool has0 = 2 * lane < len, has1 = 2 * lane + 1 < len;
        float x0 = has0 ? f32(w[i]) : 0.0f, x1 = has1 ? f32(w[i + 1]) : 0.0f;
        if (!isfinite(x0)) note_nonfinite(first, i);
        else if (!isfinite(x1)) note_nonfinite(first, i + 1);
        if (!__all_sync(all, isfinite(x0) && isfinite(x1))) continue;
        float m = fmaxf(fabsf(x0), fabsf(x1)); // an absent value is +0, below every |w|
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(all, m, o));
        float floor_m = fmaxf(m, k.nf4_floor);
        bool short_block = len < NF4_BLOCK;
        float inverse = __fdiv_rn(1.0f, floor_m);
        if (lane == 0) absmax[b] = short_block ? floor_m : m;
        unsigned c[2];
        float x[2] = {x0, x1};
        for (int h = 0; h < 2; h++) {
            float s = short_block ? __fdiv_rn(x[h], floor_m) : __fmul_rn(x[h], inverse);
            s = fminf(fmaxf(s, -1.0f), 1.0f);
            unsigned code = 0;
            while (code < 15 && k.nf4_midpoint[code] < s) code++;
            c[h] = code;
        }
        if (has0) codes[b * (NF4_BLOCK / 2) + lane] = (uint8_t)(c[0] << 4 | (has1 ? c[1] : 0u));
    }
}

// fp8_e4m3_encode on the device: the same integer steps, and the same f32 sum for subnormals
__device__ __forceinline__ uint8_t e4m3_encode(float x) {
    uint32_t bits = __float_as_uint(x);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return 0x7f;                                // NaN
    if (magnitude > __float_as_uint(FP8_E4M3_MAX)) return sign | 0x7e;       // saturate to 448
    uint8_t code;
    if (magnitude < (121u << 23)) { // below 2^-6: the adder rounds to a multiple of 2^-9, ties to even
        code = (uint8_t)(__float_as_uint(__fadd_rn(__uint_as_float(magnitude), 16384.0f)) -
                         __float_as_uint(16384.0f));
    } else { // rebias the exponent (127 -> 7), round the mantissa to 3 bits, ties to even
        uint32_t odd = (magnitude >> 20) & 1u;
        magnitude += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + odd;
        code = (uint8_t)(magnitude >> 20);
    }
    return sign | code;
}

// fp8: one block of QUANT_ROW_THREADS threads per row of [rows, cols] (fp8_round_trip): amax over
// the row, scale = amax / 448 (1 for a row of zeros), code = e4m3(w / scale).
constexpr int QUANT_ROW_THREADS = 256;

template <class T>
__global__ void k_quant_fp8(const T *w, long rows, long cols, uint8_t *codes, float *row_scale,
                            unsigned long long *first) {
    __shared__ float shared_max[QUANT_ROW_THREADS / 32];
    const unsigned all = 0xffffffffu;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    for (long r = blockIdx.x; r < rows; r += gridDim.x) { // block-uniform
        const T *x = w + r * cols;
        float amax = 0.0f;
        int bad = 0;
        for (long j = threadIdx.x; j < cols; j += blockDim.x) {
            float v = f32(x[j]);
            if (!isfinite(v)) {
                if (!bad) note_nonfinite(first, r * cols + j);
                bad = 1;
            }
            amax = fmaxf(amax, fabsf(v));
        }
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(all, amax, o));
        __syncthreads(); // shared_max may still be read for the row before
        if (lane == 0) shared_max[wid] = amax;
        if (__syncthreads_or(bad)) continue;
        amax = shared_max[0];
        for (int k = 1; k < QUANT_ROW_THREADS / 32; k++) amax = fmaxf(amax, shared_max[k]);
        float scale = amax > 0.0f ? __fdiv_rn(amax, FP8_E4M3_MAX) : 1.0f;
        if (threadIdx.x == 0) row_scale[r] = scale;
        for (long j = threadIdx.x; j < cols; j += blockDim.x)
            codes[r * cols + j] = e4m3_encode(__fdiv_rn(f32(x[j]), scale));
    }
}

// A float projection kept in E (a float tensor of a folder that packs the others): out = E(w), the
// widening exact and the rounding to bf16 to nearest even (wa_f32_to_bf16).
template <class T, class E>
__global__ void k_widen_dense(const T *w, long n, E *out, unsigned long long *first) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float v = f32(w[i]);
        if (!isfinite(v)) note_nonfinite(first, i);
        out[i] = to_e<E>(v);
    }
}

/* quant.c — see quant.h. */
#include "quant.h"

#include "checkpoint.h"
#include "convert.h"

#include <jansson.h>

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* wa_round_to's dtype code for a storage dtype */
static int round_code(st_dtype storage) { return storage == ST_BF16 ? 2 : storage == ST_F16 ? 1 : 0; }

int mlx4_quantize_group(const float *w, st_dtype storage, uint8_t *q, float *scale_out, float *bias_out) {
    const float n_bins = (1 << MLX4_BITS) - 1, eps = 1e-7f;
    float w_min = INFINITY, w_max = -INFINITY;
    for (int j = 0; j < MLX4_GROUP; j++) {
        if (!isfinite(w[j])) return -1;
        w_max = fmaxf(w_max, w[j]);
        w_min = fminf(w_min, w[j]);
    }
    int min_is_edge = fabsf(w_min) > fabsf(w_max);
    float scale = fmaxf((w_max - w_min) / n_bins, eps);
    if (!min_is_edge) scale = -scale;
    float edge = min_is_edge ? w_min : w_max;
    float q0 = rintf(edge / scale);
    float bias = 0;
    if (q0 != 0) {
        scale = edge / q0;
        bias = edge;
    }
    /* the codes come from the f32 scale and bias; only the stored pair is rounded */
    for (int j = 0; j < MLX4_GROUP; j++) {
        float v = rintf((w[j] - bias) / scale);
        v = fminf(fmaxf(v, 0.0f), n_bins);
        q[j] = (uint8_t)v;
    }
    *scale_out = wa_round_to(round_code(storage), scale);
    *bias_out = wa_round_to(round_code(storage), bias);
    return 0;
}

float mlx4_dequantize_value(int q, float scale, float bias, st_dtype storage) {
    int code = round_code(storage);
    return wa_round_to(code, wa_round_to(code, scale * (float)q) + bias);
}

int mlx4_round_trip(float *w, int64_t rows, int64_t cols, st_dtype storage, char *err, size_t errlen) {
    if (cols % MLX4_GROUP != 0)
        return snprintf(err, errlen, "rows of %lld values cannot be cut into groups of %d", (long long)cols,
                        MLX4_GROUP), -1;
    int64_t groups = rows * (cols / MLX4_GROUP);
    for (int64_t g = 0; g < groups; g++) {
        float *x = w + g * MLX4_GROUP, scale, bias;
        uint8_t q[MLX4_GROUP];
        if (mlx4_quantize_group(x, storage, q, &scale, &bias) != 0) {
            int64_t j = 0;
            while (j < MLX4_GROUP && isfinite(x[j])) j++;
            return snprintf(err, errlen, "a non-finite value at element %lld cannot be quantized",
                            (long long)(g * MLX4_GROUP + j)), -1;
        }
        for (int j = 0; j < MLX4_GROUP; j++) x[j] = mlx4_dequantize_value(q[j], scale, bias, storage);
    }
    return 0;
}

static float read_float(const st_tensor *t, uint64_t i) {
    const unsigned char *p = t->data;
    if (t->dtype == ST_F32) {
        float v;
        memcpy(&v, p + 4 * i, 4);
        return v;
    }
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return t->dtype == ST_F16 ? wa_f16_to_f32(h) : wa_bf16_to_f32(h);
}

int mlx4_packed_check(const st_tensor *packed, const st_tensor *scales, const st_tensor *biases, int64_t rows,
                      int64_t cols, char *err, size_t errlen) {
    const int per_word = 32 / MLX4_BITS;
    if (cols % MLX4_GROUP != 0)
        return snprintf(err, errlen, "rows of %lld values cannot be cut into groups of %d", (long long)cols,
                        MLX4_GROUP), -1;
    int64_t groups = cols / MLX4_GROUP;
    if (packed->dtype != ST_U32 || packed->rank != 2 || packed->shape[0] != rows || packed->shape[1] != cols / per_word)
        return snprintf(err, errlen, "the packed weight is not U32 [%lld, %lld] (4 bits, group %d)", (long long)rows,
                        (long long)(cols / per_word), MLX4_GROUP), -1;
    const st_tensor *pair[2] = {scales, biases};
    for (int k = 0; k < 2; k++) {
        const st_tensor *t = pair[k];
        if (!t) return snprintf(err, errlen, "the %s are missing", k ? "biases" : "scales"), -1;
        if ((t->dtype != ST_F32 && t->dtype != ST_F16 && t->dtype != ST_BF16) || t->rank != 2 ||
            t->shape[0] != rows || t->shape[1] != groups)
            return snprintf(err, errlen, "the %s are not F32, F16 or BF16 [%lld, %lld] (group %d)",
                            k ? "biases" : "scales", (long long)rows, (long long)groups, MLX4_GROUP), -1;
    }
    if (scales->dtype != biases->dtype)
        return snprintf(err, errlen, "the scales (%s) and biases (%s) differ in dtype", st_dtype_name(scales->dtype),
                        st_dtype_name(biases->dtype)), -1;
    for (uint64_t gi = 0; gi < (uint64_t)(rows * groups); gi++)
        if (!isfinite(read_float(scales, gi)) || !isfinite(read_float(biases, gi)))
            return snprintf(err, errlen, "a non-finite scale or bias in group %llu", (unsigned long long)gi), -1;
    return 0;
}

int mlx4_dequantize_tensor(const st_tensor *packed, const st_tensor *scales, const st_tensor *biases, int64_t rows,
                           int64_t cols, float *out, char *err, size_t errlen) {
    const int per_word = 32 / MLX4_BITS;
    if (mlx4_packed_check(packed, scales, biases, rows, cols, err, errlen) != 0) return -1;
    int64_t groups = cols / MLX4_GROUP;
    const unsigned char *words = packed->data;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            uint64_t gi = (uint64_t)(r * groups + g);
            float scale = read_float(scales, gi), bias = read_float(biases, gi);
            for (int w = 0; w < MLX4_GROUP / per_word; w++) {
                uint32_t word;
                memcpy(&word, words + 4 * (uint64_t)(r * (cols / per_word) + g * (MLX4_GROUP / per_word) + w), 4);
                float *o = out + r * cols + g * MLX4_GROUP + w * per_word;
                for (int k = 0; k < per_word; k++)
                    o[k] = mlx4_dequantize_value((int)((word >> (MLX4_BITS * k)) & 0xfu), scale, bias, scales->dtype);
            }
        }
    return 0;
}

int mlx4_config_quantization(const char *config_path, char *err, size_t errlen) {
    json_t *root = json_load_file(config_path, 0, NULL);
    const json_t *q = root ? json_object_get(root, "quantization") : NULL;
    int rc = 0;
    if (q) {
        json_int_t bits = json_integer_value(json_object_get(q, "bits"));
        json_int_t group = json_integer_value(json_object_get(q, "group_size"));
        const char *mode = json_string_value(json_object_get(q, "mode"));
        if (bits == MLX4_BITS && group == MLX4_GROUP && (!mode || strcmp(mode, "affine") == 0)) rc = 1;
        else {
            snprintf(err, errlen,
                     "%s: \"quantization\" is bits %lld, group_size %lld%s%s: only MLX's affine 4-bit with group 64 "
                     "is read",
                     config_path, (long long)bits, (long long)group, mode ? ", mode " : "", mode ? mode : "");
            rc = -1;
        }
    }
    json_decref(root);
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * nf4: bitsandbytes' NF4 with double quantization (quant.h). */

const float NF4_CODE[16] = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                            -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                            0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f,
                            0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
                            0.7229568362236023f, 1.0f};

/* create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): for i = 0..6 the midpoints
 * of torch.linspace(0.1, 1, 2^i + 1) (float32) times ±10^(i - 6), then 0 and 1, sorted. torch's
 * vectorised linspace decides the last bits, so the values are listed as it produces them. */
const float BNB_DYNAMIC_CODE[256] = {
    -0x1.fc6666p-1f, -0x1.f53334p-1f, -0x1.eep-1f, -0x1.e6ccccp-1f, -0x1.df999ap-1f, -0x1.d86666p-1f,
    -0x1.d13334p-1f, -0x1.cap-1f, -0x1.c2ccccp-1f, -0x1.bb999ap-1f, -0x1.b46666p-1f, -0x1.ad3334p-1f, -0x1.a6p-1f,
    -0x1.9eccccp-1f, -0x1.97999ap-1f, -0x1.906666p-1f, -0x1.893334p-1f, -0x1.82p-1f, -0x1.7accccp-1f,
    -0x1.73999ap-1f, -0x1.6c6668p-1f, -0x1.653334p-1f, -0x1.5ep-1f, -0x1.56ccccp-1f, -0x1.4f999ap-1f,
    -0x1.486668p-1f, -0x1.413334p-1f, -0x1.3ap-1f, -0x1.32ccccp-1f, -0x1.2b999ap-1f, -0x1.246668p-1f,
    -0x1.1d3334p-1f, -0x1.16p-1f, -0x1.0eccccp-1f, -0x1.079998p-1f, -0x1.006666p-1f, -0x1.f26664p-2f, -0x1.e4p-2f,
    -0x1.d59998p-2f, -0x1.c73334p-2f, -0x1.b8ccccp-2f, -0x1.aa6666p-2f, -0x1.9cp-2f, -0x1.8d9998p-2f,
    -0x1.7f3334p-2f, -0x1.70ccccp-2f, -0x1.626666p-2f, -0x1.54p-2f, -0x1.459998p-2f, -0x1.373334p-2f,
    -0x1.28ccccp-2f, -0x1.1a6668p-2f, -0x1.0cp-2f, -0x1.fb3332p-3f, -0x1.de6666p-3f, -0x1.c1999ap-3f,
    -0x1.a4ccccp-3f, -0x1.88p-3f, -0x1.6b3334p-3f, -0x1.4e6666p-3f, -0x1.31999ap-3f, -0x1.14ccccp-3f, -0x1.fp-4f,
    -0x1.b66668p-4f, -0x1.93d70ap-4f, -0x1.8851eep-4f, -0x1.7ccccep-4f, -0x1.7147aep-4f, -0x1.65c29p-4f,
    -0x1.5a3d7p-4f, -0x1.4eb854p-4f, -0x1.433334p-4f, -0x1.37ae14p-4f, -0x1.2c28f6p-4f, -0x1.20a3d6p-4f,
    -0x1.151ebap-4f, -0x1.09999ap-4f, -0x1.fc28f6p-5f, -0x1.e51ebap-5f, -0x1.ce147ap-5f, -0x1.b70a3ep-5f,
    -0x1.ap-5f, -0x1.88f5c2p-5f, -0x1.71eb86p-5f, -0x1.5ae146p-5f, -0x1.43d70ap-5f, -0x1.2ccccep-5f, -0x1.15c29p-5f,
    -0x1.fd70a4p-6f, -0x1.cf5c2ap-6f, -0x1.a147aep-6f, -0x1.733334p-6f, -0x1.451ebap-6f, -0x1.170a3ep-6f,
    -0x1.d1eb86p-7f, -0x1.75c29p-7f, -0x1.3e76c8p-7f, -0x1.2c083p-7f, -0x1.19999ap-7f, -0x1.072b02p-7f,
    -0x1.e978d4p-8f, -0x1.c49ba6p-8f, -0x1.9fbe76p-8f, -0x1.7ae148p-8f, -0x1.56041ap-8f, -0x1.3126e8p-8f,
    -0x1.0c49bap-8f, -0x1.ced914p-9f, -0x1.851eb8p-9f, -0x1.3b645ap-9f, -0x1.e353f8p-10f, -0x1.4fdf3ap-10f,
    -0x1.eecbfep-11f, -0x1.b3d07cp-11f, -0x1.78d5p-11f, -0x1.3dd982p-11f, -0x1.02de02p-11f, -0x1.8fc506p-12f,
    -0x1.19ce0ap-12f, -0x1.47ae16p-13f, -0x1.743e96p-14f, -0x1.15df66p-14f, -0x1.6f0068p-15f, -0x1.64840cp-16f,
    -0x1.040bfep-17f, -0x1.b43528p-19f, -0x1.27476ep-21f, 0.0f, 0x1.27476ep-21f, 0x1.b43528p-19f, 0x1.040bfep-17f,
    0x1.64840cp-16f, 0x1.6f0068p-15f, 0x1.15df66p-14f, 0x1.743e96p-14f, 0x1.47ae16p-13f, 0x1.19ce0ap-12f,
    0x1.8fc506p-12f, 0x1.02de02p-11f, 0x1.3dd982p-11f, 0x1.78d5p-11f, 0x1.b3d07cp-11f, 0x1.eecbfep-11f,
    0x1.4fdf3ap-10f, 0x1.e353f8p-10f, 0x1.3b645ap-9f, 0x1.851eb8p-9f, 0x1.ced914p-9f, 0x1.0c49bap-8f,
    0x1.3126e8p-8f, 0x1.56041ap-8f, 0x1.7ae148p-8f, 0x1.9fbe76p-8f, 0x1.c49ba6p-8f, 0x1.e978d4p-8f, 0x1.072b02p-7f,
    0x1.19999ap-7f, 0x1.2c083p-7f, 0x1.3e76c8p-7f, 0x1.75c29p-7f, 0x1.d1eb86p-7f, 0x1.170a3ep-6f, 0x1.451ebap-6f,
    0x1.733334p-6f, 0x1.a147aep-6f, 0x1.cf5c2ap-6f, 0x1.fd70a4p-6f, 0x1.15c29p-5f, 0x1.2ccccep-5f, 0x1.43d70ap-5f,
    0x1.5ae146p-5f, 0x1.71eb86p-5f, 0x1.88f5c2p-5f, 0x1.ap-5f, 0x1.b70a3ep-5f, 0x1.ce147ap-5f, 0x1.e51ebap-5f,
    0x1.fc28f6p-5f, 0x1.09999ap-4f, 0x1.151ebap-4f, 0x1.20a3d6p-4f, 0x1.2c28f6p-4f, 0x1.37ae14p-4f, 0x1.433334p-4f,
    0x1.4eb854p-4f, 0x1.5a3d7p-4f, 0x1.65c29p-4f, 0x1.7147aep-4f, 0x1.7ccccep-4f, 0x1.8851eep-4f, 0x1.93d70ap-4f,
    0x1.b66668p-4f, 0x1.fp-4f, 0x1.14ccccp-3f, 0x1.31999ap-3f, 0x1.4e6666p-3f, 0x1.6b3334p-3f, 0x1.88p-3f,
    0x1.a4ccccp-3f, 0x1.c1999ap-3f, 0x1.de6666p-3f, 0x1.fb3332p-3f, 0x1.0cp-2f, 0x1.1a6668p-2f, 0x1.28ccccp-2f,
    0x1.373334p-2f, 0x1.459998p-2f, 0x1.54p-2f, 0x1.626666p-2f, 0x1.70ccccp-2f, 0x1.7f3334p-2f, 0x1.8d9998p-2f,
    0x1.9cp-2f, 0x1.aa6666p-2f, 0x1.b8ccccp-2f, 0x1.c73334p-2f, 0x1.d59998p-2f, 0x1.e4p-2f, 0x1.f26664p-2f,
    0x1.006666p-1f, 0x1.079998p-1f, 0x1.0eccccp-1f, 0x1.16p-1f, 0x1.1d3334p-1f, 0x1.246668p-1f, 0x1.2b999ap-1f,
    0x1.32ccccp-1f, 0x1.3ap-1f, 0x1.413334p-1f, 0x1.486668p-1f, 0x1.4f999ap-1f, 0x1.56ccccp-1f, 0x1.5ep-1f,
    0x1.653334p-1f, 0x1.6c6668p-1f, 0x1.73999ap-1f, 0x1.7accccp-1f, 0x1.82p-1f, 0x1.893334p-1f, 0x1.906666p-1f,
    0x1.97999ap-1f, 0x1.9eccccp-1f, 0x1.a6p-1f, 0x1.ad3334p-1f, 0x1.b46666p-1f, 0x1.bb999ap-1f, 0x1.c2ccccp-1f,
    0x1.cap-1f, 0x1.d13334p-1f, 0x1.d86666p-1f, 0x1.df999ap-1f, 0x1.e6ccccp-1f, 0x1.eep-1f, 0x1.f53334p-1f,
    0x1.fc6666p-1f, 0x1p+0f,
};

void nf4_quantize_blocks(const float *w, int64_t n, uint8_t *codes, float *absmax) {
    float midpoint[15];
    for (int i = 0; i < 15; i++) midpoint[i] = (NF4_CODE[i] + NF4_CODE[i + 1]) / 2;
    for (int64_t b = 0; b * NF4_BLOCK < n; b++) {
        const float *x = w + b * NF4_BLOCK;
        int64_t len = n - b * NF4_BLOCK < NF4_BLOCK ? n - b * NF4_BLOCK : NF4_BLOCK;
        float m = 0;
        for (int64_t j = 0; j < len; j++) m = fmaxf(m, fabsf(x[j]));
        float floor_m = fmaxf(m, 1e-38f);
        /* a full block multiplies by the reciprocal; the short last one divides and keeps the floor */
        int short_block = len < NF4_BLOCK;
        float inverse = 1.0f / floor_m;
        absmax[b] = short_block ? floor_m : m;
        for (int64_t j = 0; j < len; j++) {
            float s = short_block ? x[j] / floor_m : x[j] * inverse;
            s = fminf(fmaxf(s, -1.0f), 1.0f);
            uint8_t code = 0;
            while (code < 15 && midpoint[code] < s) code++;
            codes[b * NF4_BLOCK + j] = code;
        }
    }
}

/* torch's multi_row_sum over `size` rows of `width` lanes: four accumulators a lane, each row
 * added into the first; after every 2^level_power rows the first is carried into the second,
 * and so on up the levels while the row count is a multiple of the next level's step. */
static void cascade_rows(const float *x, int64_t size, int64_t row_stride, int width, float *out) {
    enum { LEVELS = 4, MAX_WIDTH = 32 };
    int ceil_log2 = 0;
    while (((int64_t)1 << ceil_log2) < size) ceil_log2++;
    int level_power = ceil_log2 / LEVELS > 4 ? ceil_log2 / LEVELS : 4;
    int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    float acc[LEVELS][MAX_WIDTH] = {{0}};
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < width; k++) acc[0][k] += x[i * row_stride + k];
        for (int level = 1; level < LEVELS; level++) {
            for (int k = 0; k < width; k++) {
                acc[level][k] += acc[level - 1][k];
                acc[level - 1][k] = 0;
            }
            if ((i & (level_mask << (level * level_power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < width; k++) acc[0][k] += x[i * row_stride + k];
    for (int level = 1; level < LEVELS; level++)
        for (int k = 0; k < width; k++) acc[0][k] += acc[level][k];
    memcpy(out, acc[0], (size_t)width * sizeof(float));
}

/* torch's row_sum: `size` items of `lanes` floats each (lanes 1: scalars), read four items a
 * row through cascade_rows, the leftover items added to the first partial, then the four
 * partials summed in order. Writes `lanes` sums. */
static void torch_row_sum(const float *x, int64_t size, int lanes, float *out) {
    enum { ILP = 4 };
    float partial[ILP * 8];
    int64_t rows = size / ILP;
    cascade_rows(x, rows, ILP * lanes, ILP * lanes, partial);
    for (int64_t i = rows * ILP; i < size; i++)
        for (int k = 0; k < lanes; k++) partial[k] += x[i * lanes + k];
    for (int p = 1; p < ILP; p++)
        for (int k = 0; k < lanes; k++) partial[k] += partial[p * lanes + k];
    memcpy(out, partial, (size_t)lanes * sizeof(float));
}

/* torch's float32 sum of one contiguous run (vectorized_inner_sum, or the scalar path below 8) */
static float torch_sum_run(const float *x, int64_t n) {
    enum { LANES = 8 };
    float total = 0;
    if (n >= LANES) {
        float lane[LANES];
        int64_t vectors = n / LANES;
        torch_row_sum(x, vectors, LANES, lane);
        for (int64_t k = vectors * LANES; k < n; k++) total += x[k];
        for (int k = 0; k < LANES; k++) total += lane[k];
    } else {
        torch_row_sum(x, n, 1, &total);
    }
    return 0.0f + total; /* accumulated into the zero-filled output */
}

float nf4_torch_mean(const float *x, int64_t n, int threads) {
    enum { GRAIN = 32768, MAX_THREADS = 256 };
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    float sum;
    if (n < GRAIN || threads <= 1) {
        sum = torch_sum_run(x, n);
    } else {
        /* at::parallel_for: min(threads, ceil(n / grain)) chunks of ceil(n / chunks); each thread's
         * sum lands in a zero-filled slot, then the slots (unused ones 0) are summed */
        int64_t chunks = (n + GRAIN - 1) / GRAIN < threads ? (n + GRAIN - 1) / GRAIN : threads;
        int64_t chunk = (n + chunks - 1) / chunks;
        float slot[MAX_THREADS] = {0};
        for (int64_t c = 0; c < chunks; c++) {
            int64_t begin = c * chunk, len = n - begin < chunk ? n - begin : chunk;
            if (len > 0) slot[c] = torch_sum_run(x + begin, len);
        }
        sum = torch_sum_run(slot, threads);
    }
    return sum / (float)n;
}

void bnb_quantize_8bit(const float *x, int64_t n, int64_t blocksize, const float *code, uint8_t *lut, uint8_t *q,
                       float *absmax) {
    float midpoint[255];
    for (int i = 0; i < 255; i++) midpoint[i] = (code[i] + code[i + 1]) * 0.5f;
    int idx = 0;
    for (int i = 0; i < BNB_LUT_SIZE; i++) {
        float t = ((float)i + (float)i) / (float)(BNB_LUT_SIZE - 1) - 1.0f;
        while (idx < 255 && midpoint[idx] < t) idx++;
        lut[i] = (uint8_t)idx;
    }
    for (int64_t b = 0; b * blocksize < n; b++) {
        const float *v = x + b * blocksize;
        int64_t len = n - b * blocksize < blocksize ? n - b * blocksize : blocksize;
        float m = 0;
        for (int64_t j = 0; j < len; j++) m = fmaxf(m, fabsf(v[j]));
        absmax[b] = m;
        if (m == 0) {
            memset(q + b * blocksize, 0, (size_t)len);
            continue;
        }
        float inverse = 1.0f / m;
        for (int64_t j = 0; j < len; j++) {
            float s = fminf(fmaxf(v[j] * inverse, -1.0f), 1.0f);
            /* (s + 1) · 0.5 · 65535 + 0.5 with the last product and sum fused, as bitsandbytes' build
             * computes it; truncated toward zero */
            float index = fmaf((s + 1.0f) * 0.5f, (float)(BNB_LUT_SIZE - 1), 0.5f);
            q[b * blocksize + j] = lut[(uint16_t)(int32_t)index];
        }
    }
}

void nf4_quantized_free(nf4_quantized *q) {
    free(q->codes);
    free(q->absmax_codes);
    free(q->nested_absmax);
    memset(q, 0, sizeof *q);
}

int nf4_quantize(const float *w, int64_t n, int torch_threads, nf4_quantized *q, char *err, size_t errlen) {
    memset(q, 0, sizeof *q);
    if (n < 0) return snprintf(err, errlen, "a negative count of weights (%lld)", (long long)n), -1;
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(w[i]))
            return snprintf(err, errlen, "a non-finite value at element %lld cannot be quantized", (long long)i), -1;
    q->n = n;
    q->blocks = (n + NF4_BLOCK - 1) / NF4_BLOCK;
    q->nested_blocks = (q->blocks + NF4_NESTED_BLOCK - 1) / NF4_NESTED_BLOCK;
    q->codes = malloc((size_t)(n ? n : 1));
    q->absmax_codes = malloc((size_t)(q->blocks ? q->blocks : 1));
    q->nested_absmax = malloc((size_t)(q->nested_blocks ? q->nested_blocks : 1) * sizeof(float));
    float *absmax = malloc((size_t)(q->blocks ? q->blocks : 1) * sizeof(float));
    uint8_t *lut = malloc(BNB_LUT_SIZE);
    int rc = 0;
    if (!q->codes || !q->absmax_codes || !q->nested_absmax || !absmax || !lut) {
        snprintf(err, errlen, "out of memory quantizing %lld weights", (long long)n);
        nf4_quantized_free(q);
        rc = -1;
    } else if (n > 0) {
        nf4_quantize_blocks(w, n, q->codes, absmax);
        q->offset = nf4_torch_mean(absmax, q->blocks, torch_threads);
        for (int64_t b = 0; b < q->blocks; b++) absmax[b] -= q->offset;
        bnb_quantize_8bit(absmax, q->blocks, NF4_NESTED_BLOCK, BNB_DYNAMIC_CODE, lut, q->absmax_codes,
                          q->nested_absmax);
    }
    free(absmax);
    free(lut);
    return rc;
}

void nf4_dequantize(const nf4_quantized *q, float *out) {
    for (int64_t b = 0; b < q->blocks; b++) {
        float scale = BNB_DYNAMIC_CODE[q->absmax_codes[b]] * q->nested_absmax[b / NF4_NESTED_BLOCK] + q->offset;
        for (int64_t i = b * NF4_BLOCK; i < q->n && i < (b + 1) * NF4_BLOCK; i++)
            out[i] = NF4_CODE[q->codes[i]] * scale;
    }
}

int nf4_round_trip(float *w, int64_t n, int torch_threads, char *err, size_t errlen) {
    nf4_quantized q;
    if (nf4_quantize(w, n, torch_threads, &q, err, errlen) != 0) return -1;
    nf4_dequantize(&q, w);
    nf4_quantized_free(&q);
    return 0;
}

/* a float tensor of exactly `count` elements and dtype F32, all finite */
static int f32_vector(const st_tensor *t, uint64_t count) {
    uint64_t bad;
    return t && t->dtype == ST_F32 && st_numel(t) == count && !st_tensor_first_nonfinite(t, &bad);
}

static float f32_at(const st_tensor *t, uint64_t i) {
    float v;
    memcpy(&v, (const unsigned char *)t->data + 4 * i, 4);
    return v;
}

int nf4_tensor_layout(const bnb4_tensors *t, int64_t rows, int64_t cols, nf4_layout *out, char *err, size_t errlen) {
    if (!t->quant_state || t->quant_state->dtype != ST_U8)
        return snprintf(err, errlen, "the U8 weight has no quant_state.bitsandbytes__nf4 beside it"), -1;
    json_error_t jerr;
    json_t *state = json_loadb(t->quant_state->data, (size_t)st_numel(t->quant_state), 0, &jerr);
    if (!state || !json_is_object(state)) {
        json_decref(state);
        return snprintf(err, errlen, "quant_state.bitsandbytes__nf4 is not a JSON object (%s)", jerr.text), -1;
    }
    int rc = -1;
    const char *quant_type = json_string_value(json_object_get(state, "quant_type"));
    const char *dtype = json_string_value(json_object_get(state, "dtype"));
    json_int_t blocksize = json_integer_value(json_object_get(state, "blocksize"));
    const json_t *shape = json_object_get(state, "shape");
    const json_t *offset_json = json_object_get(state, "nested_offset");
    int nested = t->nested_absmax != NULL || offset_json != NULL;
    json_int_t nested_blocksize = json_integer_value(json_object_get(state, "nested_blocksize"));
    const char *nested_dtype = json_string_value(json_object_get(state, "nested_dtype"));
    int64_t n = rows * cols;
    int64_t blocks = blocksize > 0 ? (n + blocksize - 1) / blocksize : 0;
    int64_t nested_blocks = nested_blocksize > 0 ? (blocks + nested_blocksize - 1) / nested_blocksize : 0;
    int known_dtype = dtype && (!strcmp(dtype, "float32") || !strcmp(dtype, "float16") || !strcmp(dtype, "bfloat16"));
    if (!quant_type || strcmp(quant_type, "nf4") != 0)
        snprintf(err, errlen, "quant_type %s: only nf4 is read", quant_type ? quant_type : "missing");
    else if (blocksize <= 0 || blocksize > BNB_MAX_BLOCK)
        snprintf(err, errlen, "the quant state's blocksize is not between 1 and %d", BNB_MAX_BLOCK);
    else if (!known_dtype)
        snprintf(err, errlen, "the quant state's dtype %s is not float32, float16 or bfloat16",
                 dtype ? dtype : "missing");
    else if (json_array_size(shape) != 2 || json_integer_value(json_array_get(shape, 0)) != rows ||
             json_integer_value(json_array_get(shape, 1)) != cols)
        snprintf(err, errlen, "the quant state's shape is not [%lld, %lld]", (long long)rows, (long long)cols);
    else if (!t->weight || t->weight->dtype != ST_U8 || st_numel(t->weight) != (uint64_t)(n + 1) / 2)
        snprintf(err, errlen, "the packed weight is not %lld U8 bytes (two 4-bit codes a byte)",
                 (long long)(n + 1) / 2);
    else if (!t->quant_map || !f32_vector(t->quant_map, 16) || memcmp(t->quant_map->data, NF4_CODE, sizeof NF4_CODE))
        snprintf(err, errlen, "the quant_map is not NF4's 16 float32 values");
    else if (nested && (!t->nested_absmax || !offset_json || !json_is_number(offset_json) || nested_blocksize <= 0 ||
                        nested_blocksize > BNB_MAX_BLOCK || !nested_dtype || strcmp(nested_dtype, "float32") != 0))
        snprintf(err, errlen, "the double quantization is incomplete (nested_absmax, nested_offset, nested_blocksize "
                              "up to %d and nested_dtype float32 are needed)", BNB_MAX_BLOCK);
    else if (nested && !(fabs(json_number_value(offset_json)) <= FLT_MAX))
        snprintf(err, errlen, "the nested_offset is not a finite float32");
    else if (nested && (!t->absmax || t->absmax->dtype != ST_U8 || st_numel(t->absmax) != (uint64_t)blocks))
        snprintf(err, errlen, "the absmax is not U8 [%lld] (blocks of %lld, double-quantized)", (long long)blocks,
                 (long long)blocksize);
    else if (nested && !f32_vector(t->nested_absmax, (uint64_t)nested_blocks))
        snprintf(err, errlen, "the nested_absmax is not %lld finite float32 values", (long long)nested_blocks);
    else if (nested && (!t->nested_quant_map || !f32_vector(t->nested_quant_map, 256)))
        snprintf(err, errlen, "the nested_quant_map is not 256 finite float32 values");
    else if (!nested && !f32_vector(t->absmax, (uint64_t)blocks))
        snprintf(err, errlen, "the absmax is not %lld finite float32 values (blocks of %lld)", (long long)blocks,
                 (long long)blocksize);
    else
        rc = 0;
    float offset = nested && rc == 0 ? (float)json_number_value(offset_json) : 0;
    json_decref(state);
    if (rc != 0) return -1;
    out->blocksize = blocksize;
    out->blocks = blocks;
    out->nested = nested;
    out->nested_blocksize = nested ? nested_blocksize : 0;
    out->nested_blocks = nested ? nested_blocks : 0;
    out->offset = offset;
    return 0;
}

int nf4_dequantize_tensor(const bnb4_tensors *t, int64_t rows, int64_t cols, float *out, char *err, size_t errlen) {
    nf4_layout q;
    if (nf4_tensor_layout(t, rows, cols, &q, err, errlen) != 0) return -1;
    int64_t n = rows * cols;
    const uint8_t *packed = t->weight->data, *absmax_codes = t->absmax->data;
    for (int64_t b = 0; b < q.blocks; b++) {
        float scale = q.nested ? f32_at(t->nested_quant_map, absmax_codes[b]) *
                                         f32_at(t->nested_absmax, (uint64_t)(b / q.nested_blocksize)) +
                                     q.offset
                               : f32_at(t->absmax, (uint64_t)b);
        for (int64_t i = b * q.blocksize; i < n && i < (b + 1) * q.blocksize; i++) {
            int code = i % 2 ? packed[i / 2] & 0xf : packed[i / 2] >> 4;
            out[i] = NF4_CODE[code] * scale;
        }
    }
    return 0;
}

int bnb_config_quantization(const char *config_path, char *err, size_t errlen) {
    json_t *root = json_load_file(config_path, 0, NULL);
    const json_t *q = root ? json_object_get(root, "quantization_config") : NULL;
    int rc = 0;
    const char *method = q ? json_string_value(json_object_get(q, "quant_method")) : NULL;
    /* mlx_lm.convert writes its "quantization" again under this name, without a quant_method */
    if (method) {
        const char *type = json_string_value(json_object_get(q, "bnb_4bit_quant_type"));
        const char *storage = json_string_value(json_object_get(q, "bnb_4bit_quant_storage"));
        int four_bit = json_is_true(json_object_get(q, "load_in_4bit"));
        int eight_bit = json_is_true(json_object_get(q, "load_in_8bit"));
        if (!strcmp(method, "bitsandbytes") && four_bit && type && !strcmp(type, "nf4") &&
            (!storage || !strcmp(storage, "uint8")))
            rc = 1;
        else {
            snprintf(err, errlen,
                     "%s: \"quantization_config\" is %s%s%s%s%s%s: only bitsandbytes' 4-bit nf4 (uint8 storage) is "
                     "read",
                     config_path, method, eight_bit ? ", 8-bit" : "", four_bit ? ", 4-bit " : "",
                     four_bit && type ? type : "", storage && strcmp(storage, "uint8") ? ", storage " : "",
                     storage && strcmp(storage, "uint8") ? storage : "");
            rc = -1;
        }
    }
    json_decref(root);
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * fp8: e4m3 with a scale per output channel (quant.h). */

uint8_t fp8_e4m3_encode(float x) {
    uint32_t bits = wa_f32_bits(x);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return 0x7f; /* NaN */
    if (magnitude > wa_f32_bits(FP8_E4M3_MAX)) return sign | 0x7e; /* saturate to 448 */
    uint8_t code;
    if (magnitude < (121u << 23)) {
        /* below 2^-6, e4m3's smallest normal: adding 2^14 makes the f32 adder round the value to a
         * multiple of 2^-9 (e4m3's subnormal step) with ties to even; the low bits are the code
         * (8 steps is 2^-6, code 0x08, the smallest normal) */
        code = (uint8_t)(wa_f32_bits(wa_bits_f32(magnitude) + 16384.0f) - wa_f32_bits(16384.0f));
    } else {
        /* rebias the exponent (127 -> 7) and round the 23-bit mantissa to 3 bits, ties to even */
        uint32_t odd = (magnitude >> 20) & 1u;
        magnitude += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + odd;
        code = (uint8_t)(magnitude >> 20);
    }
    return sign | code;
}

float fp8_e4m3_decode(uint8_t code) {
    int exponent = (code >> 3) & 0xf, mantissa = code & 7;
    float magnitude = (code & 0x7f) == 0x7f ? NAN
                    : exponent == 0         ? ldexpf((float)mantissa, -9)
                                            : ldexpf((float)(8 + mantissa), exponent - 10);
    return code & 0x80 ? -magnitude : magnitude;
}

int fp8_round_trip(float *w, int64_t rows, int64_t cols, float *scales, uint8_t *codes, char *err, size_t errlen) {
    for (int64_t i = 0; i < rows * cols; i++)
        if (!isfinite(w[i]))
            return snprintf(err, errlen, "a non-finite value at element %lld cannot be quantized", (long long)i), -1;
    for (int64_t r = 0; r < rows; r++) {
        float *x = w + r * cols, amax = 0;
        for (int64_t j = 0; j < cols; j++) amax = fmaxf(amax, fabsf(x[j]));
        float scale = amax > 0 ? amax / FP8_E4M3_MAX : 1.0f;
        if (scales) scales[r] = scale;
        for (int64_t j = 0; j < cols; j++) {
            uint8_t code = fp8_e4m3_encode(x[j] / scale);
            if (codes) codes[r * cols + j] = code;
            x[j] = fp8_e4m3_decode(code) * scale;
        }
    }
    return 0;
}

void mlx4_parts_find(const checkpoint *ck, const char *weight_name, const st_tensor **scales,
                     const st_tensor **biases) {
    char name[400];
    int stem = (int)(strlen(weight_name) - strlen(".weight"));
    snprintf(name, sizeof name, "%.*s.scales", stem, weight_name);
    *scales = checkpoint_find(ck, name);
    snprintf(name, sizeof name, "%.*s.biases", stem, weight_name);
    *biases = checkpoint_find(ck, name);
}

void bnb4_parts_find(const checkpoint *ck, const char *weight_name, const st_tensor *weight, bnb4_tensors *parts) {
    static const char *const suffix[5] = {"absmax", "quant_map", "nested_absmax", "nested_quant_map",
                                          "quant_state.bitsandbytes__nf4"};
    const st_tensor **slot[5] = {&parts->absmax, &parts->quant_map, &parts->nested_absmax, &parts->nested_quant_map,
                                 &parts->quant_state};
    char name[400];
    parts->weight = weight;
    for (int k = 0; k < 5; k++) {
        snprintf(name, sizeof name, "%s.%s", weight_name, suffix[k]);
        *slot[k] = checkpoint_find(ck, name);
    }
}

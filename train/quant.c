/* quant.c — see quant.h. */
#include "quant.h"

#include "convert.h"

#include <jansson.h>

#include <math.h>
#include <stdio.h>
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

int mlx4_dequantize_tensor(const st_tensor *packed, const st_tensor *scales, const st_tensor *biases, int64_t rows,
                           int64_t cols, float *out, char *err, size_t errlen) {
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
    const unsigned char *words = packed->data;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            uint64_t gi = (uint64_t)(r * groups + g);
            float scale = read_float(scales, gi), bias = read_float(biases, gi);
            if (!isfinite(scale) || !isfinite(bias))
                return snprintf(err, errlen, "a non-finite scale or bias in group %llu", (unsigned long long)gi), -1;
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

/* quant.h — 4-bit formats of a frozen base, for the CPU reference: a weight is quantized and
 * dequantized back to f32, so the model trains on exactly the values a quantized base holds.
 *
 * mlx4 is MLX's affine 4-bit with groups of 64 along a row (mlx.core.quantize, bits 4,
 * group_size 64, mode "affine"), as its CPU kernel computes it:
 *   the group's min and max; scale = max((max - min) / 15, 1e-7), negated unless |min| > |max|;
 *   edge = min if |min| > |max| else max; q0 = rint(edge / scale);
 *   if q0 != 0: scale = edge / q0, bias = edge; else bias = 0;
 *   q = clamp(rint((w - bias) / scale), 0, 15); scale and bias are stored in the weight's dtype.
 *   Dequantized: w' = scale · q + bias, the product and the sum each rounded to that dtype
 *   (mlx.core.dequantize on arrays of the weight's dtype).
 * The arithmetic above is f32 throughout, rint rounding halves to even. */
#ifndef WA_TRAIN_QUANT_H
#define WA_TRAIN_QUANT_H

#include "safetensors.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MLX4_GROUP 64
#define MLX4_BITS 4

/* One group of MLX4_GROUP values: q (0..15), and scale and bias already rounded to the storage
 * dtype (ST_F32, ST_F16 or ST_BF16; any other is treated as ST_F32). -1 when a value is NaN or
 * ±inf (MLX would store a meaningless group), 0 otherwise. */
int mlx4_quantize_group(const float *w, st_dtype storage, uint8_t *q, float *scale, float *bias);
/* scale · q + bias, each step rounded to the storage dtype. */
float mlx4_dequantize_value(int q, float scale, float bias, st_dtype storage);
/* Replace w[0..rows·cols) (row-major, cols a multiple of MLX4_GROUP) by its quantized and
 * dequantized values. 0, or -1 with a one-line message (the flat index of a non-finite value, or
 * a row length that groups of 64 do not divide). */
int mlx4_round_trip(float *w, int64_t rows, int64_t cols, st_dtype storage, char *err, size_t errlen);
/* A weight saved by mlx_lm.convert with bits 4, group 64: packed [rows, cols / 8] uint32 (eight
 * 4-bit values per word, the first in the low bits), scales and biases [rows, cols / 64] of one
 * float dtype (F32, F16, BF16). Writes the dequantized [rows, cols] to out. 0, or -1 with a
 * one-line message naming what does not fit. */
int mlx4_dequantize_tensor(const st_tensor *packed, const st_tensor *scales, const st_tensor *biases, int64_t rows,
                           int64_t cols, float *out, char *err, size_t errlen);

/* config.json's "quantization" (mlx_lm.convert -q) at config_path: 1 for MLX's affine 4-bit with
 * group 64 (the weights it lists are read by dequantizing them); 0 when absent (or the file
 * unreadable: the config reader says why); -1 with a one-line message for any other setting. */
int mlx4_config_quantization(const char *config_path, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif

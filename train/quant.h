/* quant.h — quantized formats of a frozen base, for the CPU reference: a weight is quantized and
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
 * The arithmetic above is f32 throughout, rint rounding halves to even.
 *
 * nf4 is QLoRA's NormalFloat 4-bit with double quantization, as bitsandbytes computes it on the CPU
 * (bitsandbytes.functional.quantize_4bit(w, blocksize=64, quant_type="nf4",
 * compress_statistics=True)); the weight is one flat row-major array, cut into blocks of 64:
 *   absmax = max |w| of the block (f32; bf16 and f16 weights widen exactly);
 *   s = clamp(w · (1 / max(absmax, 1e-38)), -1, 1), where a last block shorter than 64 divides,
 *   w / max(absmax, 1e-38), and stores that clamped absmax;
 *   code = the number of midpoints (NF4[i] + NF4[i+1]) / 2 strictly below s (a value on a
 *   midpoint takes the lower code), two codes a byte, the first in the high nibble.
 * Double quantization: offset = the f32 mean of the absmax as torch computes it (nf4_torch_mean);
 * absmax - offset is quantized to 8 bits in blocks of 256 against bitsandbytes' signed dynamic
 * code (create_dynamic_map(), BNB_DYNAMIC_CODE) by its CPU kernel (bnb_quantize_8bit): per block
 * m = max |x| (an all-zero block stores m = 0 and codes 0); v = clamp(x · (1 / m), -1, 1);
 * i = (int)fma((v + 1) · 0.5, 65535, 0.5); the code is the number of the code's midpoints strictly
 * below t = 2·i / 65535 - 1 (a 65536-entry table of them). So a value within a table step of a
 * midpoint can take the farther code, and values near 0, where the code is denser than the table,
 * take the code nearest t: the table, not the nearest code, is bitsandbytes' rule.
 * Dequantized: absmax' = dynamic[q8] · m + offset, then w' = NF4[code] · absmax', each step an f32
 * product or sum, kept in f32: what bitsandbytes' matmul_4bit multiplies a float32 input by (its
 * gemm_4bit dequantizes into the input's dtype; dequantize_4bit alone would round to the dtype the
 * weight had, and a bfloat16 model computes in bfloat16 anyway).
 *
 * fp8 is OCP FP8 e4m3 (torch.float8_e4m3fn: bias 7, no infinities, 0x7f the NaN, largest 448)
 * with one f32 scale per output channel (a row of the [out, in] weight): scale = amax / 448 (1
 * for a row of zeros), code = e4m3(w / scale) rounded to nearest, ties to even, saturating to
 * ±448; dequantized w' = value(code) · scale in f32 (as torch's
 * (w / scale).to(torch.float8_e4m3fn).float() * scale). */
#ifndef WA_TRAIN_QUANT_H
#define WA_TRAIN_QUANT_H

#include "checkpoint.h"
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

/* The checks of mlx4_dequantize_tensor alone (shapes, dtypes, finite scales and biases), for a reader
 * that keeps the packed form (the GPU model). 0, or -1 with the same one-line message. */
int mlx4_packed_check(const st_tensor *packed, const st_tensor *scales, const st_tensor *biases, int64_t rows,
                      int64_t cols, char *err, size_t errlen);

/* config.json's "quantization" (mlx_lm.convert -q) at config_path: 1 for MLX's affine 4-bit with
 * group 64 (the weights it lists are read by dequantizing them); 0 when absent (or the file
 * unreadable: the config reader says why); -1 with a one-line message for any other setting. */
int mlx4_config_quantization(const char *config_path, char *err, size_t errlen);

#define NF4_BLOCK 64
#define NF4_NESTED_BLOCK 256
#define BNB_LUT_SIZE 65536
#define BNB_MAX_BLOCK 65536 /* the largest block size a saved quant state may give (bitsandbytes: 4096) */

/* NF4's 16 values (bitsandbytes' get_4bit_type("nf4")) and the signed dynamic 8-bit code of the
 * double quantization (create_dynamic_map(), sorted, 256 values), both f32. */
extern const float NF4_CODE[16];
extern const float BNB_DYNAMIC_CODE[256];

/* The 4-bit step: codes[0..n) (one code a byte, 0..15) and absmax[0..ceil(n / 64)) of w[0..n). */
void nf4_quantize_blocks(const float *w, int64_t n, uint8_t *codes, float *absmax);
/* torch's float32 mean of x[0..n) on the CPU (its cascade sum of 8-lane vectors, then / n), as
 * torch computes it with `threads` intra-op threads: from 32768 values on, torch sums one chunk a
 * thread and then the chunks' sums, so the last bit can depend on the thread count (1 to 256). */
float nf4_torch_mean(const float *x, int64_t n, int threads);
/* bitsandbytes' CPU 8-bit blockwise quantization of x[0..n) against a sorted 256-entry code:
 * q[0..n), absmax[0..ceil(n / blocksize)). lut is BNB_LUT_SIZE bytes of scratch. */
void bnb_quantize_8bit(const float *x, int64_t n, int64_t blocksize, const float *code, uint8_t *lut, uint8_t *q,
                       float *absmax);
/* A weight in NF4 with its double-quantized absmax, as quantize_4bit(..., compress_statistics=True)
 * returns it (the codes unpacked, one a byte). */
typedef struct nf4_quantized {
    int64_t n, blocks, nested_blocks; /* values; blocks of 64; blocks of 256 absmax */
    uint8_t *codes;                   /* [n], 0..15 */
    uint8_t *absmax_codes;            /* [blocks], into BNB_DYNAMIC_CODE */
    float *nested_absmax;             /* [nested_blocks] */
    float offset;                     /* the mean absmax, subtracted before the 8-bit step */
} nf4_quantized;
/* Quantize w[0..n) (torch_threads as in nf4_torch_mean). 0, or -1 with a one-line message (the
 * flat index of a non-finite value, or no memory); nf4_quantized_free releases q either way. */
int nf4_quantize(const float *w, int64_t n, int torch_threads, nf4_quantized *q, char *err, size_t errlen);
/* out[0..q->n): NF4[code] · absmax' in f32. */
void nf4_dequantize(const nf4_quantized *q, float *out);
void nf4_quantized_free(nf4_quantized *q);
/* Replace w[0..n) by its NF4 values: nf4_quantize, then nf4_dequantize into w. */
int nf4_round_trip(float *w, int64_t n, int torch_threads, char *err, size_t errlen);

/* One weight of a transformers checkpoint saved with a bitsandbytes 4-bit quantization_config:
 * NAME.weight and the tensors beside it, NULL where absent. */
typedef struct bnb4_tensors {
    const st_tensor *weight;           /* U8, ceil(n / 2) bytes ([n / 2, 1] as saved) */
    const st_tensor *absmax;           /* .absmax: U8 [blocks] when double-quantized, else F32 */
    const st_tensor *quant_map;        /* .quant_map: F32 [16], NF4_CODE */
    const st_tensor *nested_absmax;    /* .nested_absmax: F32 [ceil(blocks / nested_blocksize)] */
    const st_tensor *nested_quant_map; /* .nested_quant_map: F32 [256] */
    const st_tensor *quant_state;      /* .quant_state.bitsandbytes__nf4: U8, the JSON of the rest */
} bnb4_tensors;
/* What the quant state says and the tensors agree on: blocks of blocksize values, each scaled by
 * absmax' = nested_quant_map[absmax[b]] · nested_absmax[b / nested_blocksize] + offset (nested) or
 * by the f32 absmax[b]. */
typedef struct nf4_layout {
    int64_t blocksize, blocks;
    int nested;
    int64_t nested_blocksize, nested_blocks; /* 0 unless nested */
    float offset;                            /* 0 unless nested */
} nf4_layout;
/* The tensors beside a packed projection weight_name ("....q_proj.weight") in ck, NULL where absent:
 * mlx_lm.convert's STEM.scales and STEM.biases (STEM = weight_name less ".weight"), and
 * bitsandbytes' weight_name.absmax, .quant_map, .nested_absmax, .nested_quant_map and
 * .quant_state.bitsandbytes__nf4 (parts->weight = weight). */
void mlx4_parts_find(const checkpoint *ck, const char *weight_name, const st_tensor **scales,
                     const st_tensor **biases);
void bnb4_parts_find(const checkpoint *ck, const char *weight_name, const st_tensor *weight, bnb4_tensors *parts);
/* The checks of nf4_dequantize_tensor alone, for a reader that keeps the packed form (the GPU
 * model): 0 with *out filled, or -1 with the same one-line message. */
int nf4_tensor_layout(const bnb4_tensors *t, int64_t rows, int64_t cols, nf4_layout *out, char *err, size_t errlen);
/* The [rows, cols] values NF4[code] · absmax' (f32, as nf4_dequantize) into out. 0, or -1 with a
 * one-line message naming what is missing or does not fit. */
int nf4_dequantize_tensor(const bnb4_tensors *t, int64_t rows, int64_t cols, float *out, char *err, size_t errlen);
/* config.json's "quantization_config" at config_path: 1 for bitsandbytes 4-bit nf4 in uint8 (with or
 * without double quantization); 0 when absent, without a quant_method (mlx_lm.convert's copy of its
 * "quantization") or the file unreadable; -1 with a one-line message for any other method or
 * setting. */
int bnb_config_quantization(const char *config_path, char *err, size_t errlen);

#define FP8_E4M3_MAX 448.0f
/* f32 -> e4m3 code, nearest with ties to even, |x| above 448 saturating to ±448; NaN -> 0x7f. */
uint8_t fp8_e4m3_encode(float x);
float fp8_e4m3_decode(uint8_t code);
/* Replace w[0..rows·cols) (row-major, a row per output channel) by value(code) · scale, one scale a
 * row (amax / 448, 1 for a row of zeros); scales[rows] and codes[rows·cols] receive them where not
 * NULL. 0, or -1 with a one-line message (the flat index of a non-finite value). */
int fp8_round_trip(float *w, int64_t rows, int64_t cols, float *scales, uint8_t *codes, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif

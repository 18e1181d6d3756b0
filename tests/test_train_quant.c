/* test_train_quant.c — the frozen base's quantized formats on the CPU (train/quant.h):
 *   1. mlx4 groups worked by hand: a ramp, a constant group, zeros, negative values only, and the
 *      scale and bias rounded to bf16 where the weight is bf16;
 *   2. refusals: a NaN or inf in a group, rows that groups of 64 do not divide, packed tensors whose
 *      shapes or dtypes do not fit;
 *   3. packed words (eight 4-bit codes per uint32, the first in the low bits) dequantize to what the
 *      round trip gives;
 *   4. nf4: codes against a search of NF4's values typed again here (each midpoint takes the lower
 *      code, the next float up the upper one; random, all-zero and short blocks); the dynamic code
 *      against its definition; torch's mean; the 8-bit step against its 65536-entry table (values
 *      near 0 taking a code that is not their nearest); the round trip within its bound; NaN and
 *      inf refused; a weight saved as transformers saves it (packed, double-quantized or not, the
 *      quant state's JSON) dequantizing to the round trip, and eight ways it can be wrong refused;
 *   5. fp8: every e4m3 code decoded from the format; values, every midpoint between neighbours and
 *      the floats beside them encoded as the nearest value found by search, ties to even, beyond
 *      448 saturating; the per-channel round trip and its scales;
 *   6. gemma_model_load_base on the gemma4_tiny fixture: with BASE_MLX4 every decoder projection
 *      within one step of its group of the plain load, embeddings and norms untouched, gemma4_smoke
 *      (rows of 32) refused in one line; with BASE_NF4 and BASE_FP8, both fixtures within the
 *      format's bound;
 *   7. a run trained on a quantized base resumes on the same one only (mlx4 to bf16, nf4 to fp8
 *      refused); train_run takes mlx4, nf4 and fp8 on the GPU, and folders whose config.json says
 *      MLX or bitsandbytes quantization (tests/test_train_cuda.c checks them there against the CPU);
 *      bitsandbytes settings other than 4-bit nf4 in uint8 refused.
 * Usage: test_train_quant [FIXTURES_DIR] (default train/fixtures).
 * test_train_quant --dump MODEL_DIR bf16|mlx4|nf4|fp8 OUT writes every decoder projection as loaded
 * (f32, layer by layer in q, k, v, o, gate, up, down order, absent ones skipped) to OUT, for
 * python/tests/test_quant.py to compare with mlx.core.dequantize, bitsandbytes and torch; --nf4,
 * --fp8 and --tables write codes and tables for it (their comments below say what). */
#define _GNU_SOURCE
#include "check.h"
#include "model.h"
#include "quant.h"
#include "train.h"

#include "convert.h"

#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *fixtures = "train/fixtures";

/* uniform in [-1, 1) from a 64-bit LCG's top bits */
static float uniform(uint64_t *state) {
    *state = *state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((double)(*state >> 40) / (double)(1ULL << 23) - 1.0);
}

static float bf16_round(float x) { return wa_bf16_to_f32(wa_f32_to_bf16(x)); }

/* the largest |dequantized - original| over a group stored as f32 */
static float worst_error(const float *w, const uint8_t *q, float scale, float bias) {
    float worst = 0;
    for (int j = 0; j < MLX4_GROUP; j++)
        worst = fmaxf(worst, fabsf(mlx4_dequantize_value(q[j], scale, bias, ST_F32) - w[j]));
    return worst;
}

static void test_groups(void) {
    float w[MLX4_GROUP], scale, bias;
    uint8_t q[MLX4_GROUP];

    /* 0, 1, ..., 63: max is the edge (|max| > |min|), scale = -(63 / 15) = -4.2, q0 = -15 so
     * scale = 63 / -15 and bias = 63; w = 63 - 4.2 q, so 21 is q = 10 and 0 is q = 15 */
    for (int j = 0; j < MLX4_GROUP; j++) w[j] = (float)j;
    int rc = mlx4_quantize_group(w, ST_F32, q, &scale, &bias);
    check(rc == 0 && scale == 63.0f / -15.0f && bias == 63.0f &&
              q[0] == 15 && q[63] == 0 && q[21] == 10 && q[42] == 5,
          "mlx4 ramp 0..63: scale %g (want -4.2), bias %g (want 63), q[0] %d q[21] %d q[42] %d q[63] %d", scale, bias,
          q[0], q[21], q[42], q[63]);
    float worst = worst_error(w, q, scale, bias);
    check(worst <= 2.1f + 1e-5f, "mlx4 ramp: every value within half a step (2.1) of its own (worst %g)", worst);

    /* a constant group: scale falls to eps (1e-7), q0 = rint(0.5 / -1e-7) != 0, bias = 0.5, all q 0 */
    for (int j = 0; j < MLX4_GROUP; j++) w[j] = 0.5f;
    int ok = mlx4_quantize_group(w, ST_F32, q, &scale, &bias) == 0 && bias == 0.5f;
    for (int j = 0; j < MLX4_GROUP; j++) ok &= q[j] == 0 && mlx4_dequantize_value(q[j], scale, bias, ST_F32) == 0.5f;
    check(ok, "mlx4 constant group 0.5: bias 0.5, codes 0, dequantized exactly 0.5 (scale %g)", scale);

    /* zeros: q0 = 0, so bias 0 and scale -1e-7; every value back to 0 */
    memset(w, 0, sizeof w);
    ok = mlx4_quantize_group(w, ST_F32, q, &scale, &bias) == 0 && bias == 0.0f && scale == -1e-7f;
    for (int j = 0; j < MLX4_GROUP; j++) ok &= q[j] == 0 && mlx4_dequantize_value(q[j], scale, bias, ST_F32) == 0.0f;
    check(ok, "mlx4 zeros: scale -1e-7, bias 0, dequantized 0 (scale %g, bias %g)", scale, bias);

    /* -1 - j/63, in [-2, -1]: min is the edge, scale 1/15 then -2 / rint(-30) = 1/15, bias -2 */
    for (int j = 0; j < MLX4_GROUP; j++) w[j] = -1.0f - (float)j / 63.0f;
    ok = mlx4_quantize_group(w, ST_F32, q, &scale, &bias) == 0 && bias == -2.0f && scale > 0 && q[63] == 0 &&
         q[0] == 15;
    worst = worst_error(w, q, scale, bias);
    check(ok && worst <= scale / 2 + 1e-6f && mlx4_dequantize_value(q[63], scale, bias, ST_F32) == -2.0f,
          "mlx4 negative only [-2, -1]: bias -2, -2 back exactly, worst error %g <= half a step %g", worst, scale / 2);

    /* bf16 storage: scale and bias are bf16 values, and so is every dequantized value */
    uint64_t state = 3;
    for (int j = 0; j < MLX4_GROUP; j++) w[j] = bf16_round(0.02f * uniform(&state));
    ok = mlx4_quantize_group(w, ST_BF16, q, &scale, &bias) == 0 && scale == bf16_round(scale) &&
         bias == bf16_round(bias);
    for (int j = 0; j < MLX4_GROUP; j++) {
        float v = mlx4_dequantize_value(q[j], scale, bias, ST_BF16);
        ok &= v == bf16_round(v);
    }
    check(ok, "mlx4 bf16 weights: scale %g and bias %g stored as bf16, dequantized values bf16", scale, bias);
}

static void test_refusals(void) {
    float w[2 * MLX4_GROUP];
    char err[256] = "";
    for (int j = 0; j < 2 * MLX4_GROUP; j++) w[j] = (float)j;
    w[70] = NAN;
    int rc = mlx4_round_trip(w, 1, 2 * MLX4_GROUP, ST_F32, err, sizeof err);
    check(rc == -1 && strstr(err, "non-finite") && strstr(err, "element 70") && !strchr(err, '\n'),
          "mlx4 refuses a NaN, naming its element: %s", err);
    w[70] = INFINITY;
    check(mlx4_round_trip(w, 1, 2 * MLX4_GROUP, ST_F32, err, sizeof err) == -1, "mlx4 refuses inf: %s", err);
    w[70] = 1;
    rc = mlx4_round_trip(w, 4, 32, ST_F32, err, sizeof err);
    check(rc == -1 && strstr(err, "groups of 64"), "mlx4 refuses rows of 32: %s", err);

    uint32_t words[8] = {0};
    float sb[2] = {1, 0};
    float out[64];
    st_tensor packed = {.dtype = ST_U32, .rank = 2, .shape = {1, 8}, .data = words};
    st_tensor scales = {.dtype = ST_F32, .rank = 2, .shape = {1, 1}, .data = &sb[0]};
    st_tensor biases = {.dtype = ST_F32, .rank = 2, .shape = {1, 1}, .data = &sb[1]};
    st_tensor wide = packed;
    wide.shape[1] = 16;
    check(mlx4_dequantize_tensor(&wide, &scales, &biases, 1, 64, out, err, sizeof err) == -1 && strstr(err, "U32"),
          "mlx4 refuses a packed weight of the wrong width (8 bits?): %s", err);
    check(mlx4_dequantize_tensor(&packed, &scales, NULL, 1, 64, out, err, sizeof err) == -1 && strstr(err, "biases"),
          "mlx4 refuses a packed weight without biases: %s", err);
    st_tensor two_groups = scales;
    two_groups.shape[1] = 2;
    check(mlx4_dequantize_tensor(&packed, &two_groups, &biases, 1, 64, out, err, sizeof err) == -1 &&
              strstr(err, "group 64"),
          "mlx4 refuses scales of group 32: %s", err);
}

static void test_packed(void) {
    enum { ROWS = 3, COLS = 128 };
    float w[ROWS * COLS], back[ROWS * COLS], out[ROWS * COLS];
    uint32_t words[ROWS * COLS / 8] = {0};
    uint16_t scales[ROWS * COLS / 64], biases[ROWS * COLS / 64];
    uint64_t state = 11;
    for (int i = 0; i < ROWS * COLS; i++) w[i] = bf16_round(0.05f * uniform(&state));
    memcpy(back, w, sizeof w);
    char err[256];
    int ok = mlx4_round_trip(back, ROWS, COLS, ST_BF16, err, sizeof err) == 0;
    for (int g = 0; ok && g < ROWS * COLS / 64; g++) {
        uint8_t q[64];
        float s, b;
        ok &= mlx4_quantize_group(w + 64 * g, ST_BF16, q, &s, &b) == 0;
        scales[g] = wa_f32_to_bf16(s);
        biases[g] = wa_f32_to_bf16(b);
        for (int j = 0; j < 64; j++) words[(64 * g + j) / 8] |= (uint32_t)q[j] << (4 * (j % 8));
    }
    st_tensor packed = {.dtype = ST_U32, .rank = 2, .shape = {ROWS, COLS / 8}, .data = words};
    st_tensor st = {.dtype = ST_BF16, .rank = 2, .shape = {ROWS, COLS / 64}, .data = scales};
    st_tensor bt = st;
    bt.data = biases;
    ok = ok && mlx4_dequantize_tensor(&packed, &st, &bt, ROWS, COLS, out, err, sizeof err) == 0;
    check(ok && memcmp(out, back, sizeof out) == 0,
          "mlx4 packed words (bf16 scales) dequantize to the round trip's values");
}

static void test_model(void) {
    char dir[1024], err[512] = "";
    snprintf(dir, sizeof dir, "%s/gemma4_tiny", fixtures);
    lora_config none = {0};
    gemma_model_f32 plain, quant;
    if (gemma_model_load_f32(&plain, dir, &none, err, sizeof err) != 0 ||
        gemma_model_load_base_f32(&quant, dir, &none, BASE_MLX4, err, sizeof err) != 0) {
        check_fail("mlx4 load of %s: %s", dir, err);
        return;
    }
    int changed = 0, within = 1, others_same = 1;
    for (int l = 0; l < plain.cfg.layers; l++)
        for (int p = 0; p < PROJ_COUNT; p++) {
            const float *a = plain.layer[l].w[p], *b = quant.layer[l].w[p];
            if (!a) continue;
            size_t n = (size_t)plain.layer[l].in[p] * (size_t)plain.layer[l].out[p];
            for (size_t g = 0; g < n / 64; g++) {
                float lo = INFINITY, hi = -INFINITY, worst = 0;
                for (int j = 0; j < 64; j++) {
                    lo = fminf(lo, a[64 * g + j]), hi = fmaxf(hi, a[64 * g + j]);
                    worst = fmaxf(worst, fabsf(a[64 * g + j] - b[64 * g + j]));
                    changed += a[64 * g + j] != b[64 * g + j];
                }
                /* one step: MLX moves the scale to edge / q0 so that the edge is exact, which leaves up
                 * to (max - min) / 16 clipped at the far end and half of a step at most 16/15 as large
                 * elsewhere; widened by the bf16 rounding (2^-9 relative) of the scale (times up to 15
                 * steps), the bias and the result, for bf16 checkpoints */
                float bound = (hi - lo) / 15 + (hi - lo) / 256 + fmaxf(fabsf(lo), fabsf(hi)) / 128;
                if (worst > bound && within) {
                    printf("# layer %d proj %d group %zu: worst %g > %g (range %g..%g)\n", l, p, g, worst, bound, lo,
                           hi);
                    within = 0;
                }
            }
            others_same &= memcmp(plain.layer[l].input_norm, quant.layer[l].input_norm,
                                  (size_t)plain.cfg.hidden * sizeof(float)) == 0;
        }
    others_same &= memcmp(plain.embed, quant.embed, (size_t)plain.cfg.vocab * plain.cfg.hidden * sizeof(float)) == 0;
    if (!within || !others_same) printf("# within %d, others_same %d\n", within, others_same);
    check(changed > 0 && within && others_same,
          "mlx4 gemma4_tiny: projections within one step of their group (%d values changed), embeddings and "
          "norms as loaded",
          changed);
    gemma_model_free_f32(&plain);
    gemma_model_free_f32(&quant);

    snprintf(dir, sizeof dir, "%s/gemma4_smoke", fixtures);
    int rc = gemma_model_load_base_f32(&quant, dir, &none, BASE_MLX4, err, sizeof err);
    check(rc == -1 && strstr(err, "groups of 64") && strstr(err, "q_proj") && !strchr(err, '\n'),
          "mlx4 refuses gemma4_smoke (rows of 32) in one line: %s", err);

    /* nf4 and fp8 on both fixtures (nf4's blocks run over the flat weight, so rows of 32 are fine):
     * each projection within its format's bound of the plain load (nf4: as test_nested; fp8: half
     * a step of e4m3 relative, or of the subnormal step, at the row's scale), everything else as
     * loaded */
    for (int fixture = 0; fixture < 2; fixture++)
        for (base_dtype b = BASE_NF4; b <= BASE_FP8; b++) {
            snprintf(dir, sizeof dir, "%s/%s", fixtures, fixture ? "gemma4_smoke" : "gemma4_tiny");
            if (gemma_model_load_f32(&plain, dir, &none, err, sizeof err) != 0 ||
                gemma_model_load_base_f32(&quant, dir, &none, b, err, sizeof err) != 0) {
                check_fail("%s load of %s: %s", base_dtype_name(b), dir, err);
                return;
            }
            size_t moved = 0, outside = 0;
            for (int l = 0; l < plain.cfg.layers; l++)
                for (int p = 0; p < PROJ_COUNT; p++) {
                    const float *x = plain.layer[l].w[p], *y = quant.layer[l].w[p];
                    if (!x) continue;
                    int64_t rows = plain.layer[l].out[p], cols = plain.layer[l].in[p], n = rows * cols;
                    float top = 0;
                    for (int64_t i = 0; i < n; i++) top = fmaxf(top, fabsf(x[i]));
                    for (int64_t r = 0; r < rows; r++) {
                        float row_max = 0;
                        for (int64_t j = 0; j < cols; j++) row_max = fmaxf(row_max, fabsf(x[r * cols + j]));
                        for (int64_t j = 0; j < cols; j++) {
                            int64_t i = r * cols + j;
                            float block_max = 0;
                            for (int64_t k = i / 64 * 64; k < n && k < i / 64 * 64 + 64; k++)
                                block_max = fmaxf(block_max, fabsf(x[k]));
                            float bound = b == BASE_NF4
                                              ? 0.1520f * block_max + 0.0072f * top + fabsf(y[i]) * 0x1p-22f
                                              : fabsf(x[i]) / 16 + row_max / 448 * 0x1p-10f;
                            moved += x[i] != y[i];
                            outside += fabsf(x[i] - y[i]) > bound;
                        }
                    }
                }
            int same = memcmp(plain.embed, quant.embed, (size_t)plain.cfg.vocab * plain.cfg.hidden * 4) == 0 &&
                       memcmp(plain.layer[0].input_norm, quant.layer[0].input_norm, (size_t)plain.cfg.hidden * 4) == 0;
            check(moved > 0 && outside == 0 && same,
                  "%s %s: projections within the format's bound (%zu values changed, %zu outside), embeddings and "
                  "norms as loaded", base_dtype_name(b), fixture ? "gemma4_smoke" : "gemma4_tiny", moved, outside);
            gemma_model_free_f32(&plain);
            gemma_model_free_f32(&quant);
        }
}

/* ---------------------------------------------------------------------------------------------
 * nf4 and fp8. The expectations below are computed here from the formats' definitions, not by
 * calling the code under test: NF4's values typed again, their float midpoints, a search. */

static const float nf4_values[16] = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                                     -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                                     0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f,
                                     0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
                                     0.7229568362236023f, 1.0f};

/* bitsandbytes' rule for a scaled value s in [-1, 1]: the nearest of the 16 values, a value on a
 * (float) midpoint taking the lower one; found by bisection over the midpoints */
static int nf4_expected(float s) {
    int lo = 0, hi = 15; /* the code is in [lo, hi] */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (s > (nf4_values[mid] + nf4_values[mid + 1]) / 2) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static void test_nf4_codes(void) {
    check(memcmp(NF4_CODE, nf4_values, sizeof nf4_values) == 0, "NF4_CODE holds QLoRA's 16 NF4 values");
    /* a block holding 1.0 (absmax 1, so s = w exactly): every midpoint, the floats either side of
     * it, and the 16 values themselves */
    float w[3 * NF4_BLOCK], absmax[3];
    uint8_t codes[3 * NF4_BLOCK];
    int j = 0;
    w[j++] = 1.0f;
    for (int i = 0; i < 15; i++) {
        float mid = (nf4_values[i] + nf4_values[i + 1]) / 2;
        w[j++] = mid;
        w[j++] = nextafterf(mid, 2.0f);
        w[j++] = nextafterf(mid, -2.0f);
        w[j++] = nf4_values[i];
    }
    while (j < NF4_BLOCK) w[j++] = 0.0f;
    nf4_quantize_blocks(w, NF4_BLOCK, codes, absmax);
    int ok = absmax[0] == 1.0f, ties_lower = 1;
    for (int i = 0; i < NF4_BLOCK; i++) ok &= codes[i] == nf4_expected(w[i]);
    for (int i = 0; i < 15; i++) ties_lower &= codes[1 + 4 * i] == i && codes[2 + 4 * i] == i + 1;
    check(ok && ties_lower, "nf4: a value on a midpoint takes the lower code, the next float up the upper one "
                            "(absmax %g)", absmax[0]);

    /* random blocks at three scales, a zero block, and a short last block (which divides) */
    uint64_t state = 5;
    int64_t n = 2 * NF4_BLOCK + 21;
    for (int64_t i = 0; i < n; i++) w[i] = bf16_round((i < NF4_BLOCK ? 0.02f : 3.0f) * uniform(&state));
    for (int64_t i = NF4_BLOCK; i < 2 * NF4_BLOCK; i++) w[i] = 0.0f;
    nf4_quantize_blocks(w, n, codes, absmax);
    int bad = 0;
    for (int64_t b = 0; b < 3; b++) {
        int64_t len = b < 2 ? NF4_BLOCK : 21;
        float m = 0;
        for (int64_t i = 0; i < len; i++) m = fmaxf(m, fabsf(w[b * NF4_BLOCK + i]));
        float floor_m = fmaxf(m, 1e-38f), inverse = 1.0f / floor_m;
        bad += absmax[b] != (b < 2 ? m : floor_m);
        for (int64_t i = 0; i < len; i++) {
            float x = w[b * NF4_BLOCK + i], s = b < 2 ? x * inverse : x / floor_m;
            bad += codes[b * NF4_BLOCK + i] != nf4_expected(fminf(fmaxf(s, -1.0f), 1.0f));
        }
    }
    check(bad == 0 && absmax[1] == 0 && codes[NF4_BLOCK] == 7 && codes[2 * NF4_BLOCK - 1] == 7,
          "nf4: codes and absmax of random, all-zero (code 7 = 0.0, absmax 0) and short blocks (%d differ)", bad);
}

/* the dynamic map's definition in double: the midpoints of linspace(0.1, 1, 2^i + 1) times
 * ±10^(i - 6), i = 0..6, with 0 and 1 */
static void test_dynamic_code(void) {
    double want[256];
    int k = 0;
    for (int i = 0; i < 7; i++) {
        int points = (1 << i) + 1;
        for (int j = 0; j + 1 < points; j++) {
            double a = 0.1 + 0.9 * j / (points - 1), b = 0.1 + 0.9 * (j + 1) / (points - 1);
            want[k++] = pow(10.0, i - 6) * (a + b) / 2;
            want[k++] = -pow(10.0, i - 6) * (a + b) / 2;
        }
    }
    want[k++] = 0;
    want[k++] = 1;
    int ok = k == 256, sorted = 1;
    for (int i = 0; i < 256; i++)
        for (int j = i + 1; j < 256; j++)
            if (want[j] < want[i]) {
                double t = want[i];
                want[i] = want[j], want[j] = t;
            }
    double worst = 0;
    for (int i = 0; i < 256; i++) {
        if (i && !(BNB_DYNAMIC_CODE[i] > BNB_DYNAMIC_CODE[i - 1])) sorted = 0;
        double rel = want[i] == 0 ? fabs(BNB_DYNAMIC_CODE[i]) : fabs(BNB_DYNAMIC_CODE[i] - want[i]) / fabs(want[i]);
        worst = fmax(worst, rel);
    }
    check(ok && sorted && worst < 1e-6, "BNB_DYNAMIC_CODE: 256 increasing values, each within 1e-6 of "
                                        "create_dynamic_map's definition (worst %.2g relative)", worst);
}

static void test_nested(void) {
    /* torch's mean: exact where every partial sum is exact; the same for 1 and 2 threads when the
     * values are equal; within float rounding of the double mean otherwise */
    float x[70000];
    for (int i = 0; i < 7; i++) x[i] = (float)(i + 1);
    int ok = nf4_torch_mean(x, 7, 1) == 4.0f && nf4_torch_mean(x, 3, 1) == 2.0f;
    for (int i = 0; i < 70000; i++) x[i] = 0.375f;
    ok &= nf4_torch_mean(x, 70000, 1) == 0.375f && nf4_torch_mean(x, 70000, 2) == 0.375f;
    uint64_t state = 9;
    double exact = 0;
    for (int i = 0; i < 70000; i++) exact += x[i] = 0.5f + 0.5f * uniform(&state);
    exact /= 70000;
    float one = nf4_torch_mean(x, 70000, 1), two = nf4_torch_mean(x, 70000, 2);
    check(ok && fabs(one - exact) < 4e-7 * exact && fabs(two - exact) < 4e-7 * exact,
          "nf4 offset (torch's f32 mean): exact sums exact; 70000 values %.9g (1 thread), %.9g (2) vs %.9g", one,
          two, exact);

    /* the 8-bit step: per block of 256, m = max |x|; the code is the table's entry at
     * trunc(fl((s + 1) / 2 · 65535 + 0.5)), the table giving for t = 2i / 65535 - 1 the code whose
     * midpoints bracket t (here searched by bisection, and the index summed in double) */
    static uint8_t lut[BNB_LUT_SIZE];
    float v[2 * NF4_NESTED_BLOCK + 40], m8[3];
    uint8_t q[2 * NF4_NESTED_BLOCK + 40];
    int64_t n = 2 * NF4_NESTED_BLOCK + 40;
    for (int64_t i = 0; i < n; i++) v[i] = 0.01f * uniform(&state);
    for (int64_t i = NF4_NESTED_BLOCK; i < 2 * NF4_NESTED_BLOCK; i++) v[i] = 0;
    v[3] = -0.01f; /* a block's absmax at -1 exactly */
    /* values within a table step (2 / 65535) of 0, where the dynamic code is far denser than the
     * table: they take the code of the table entry, not their nearest */
    for (int i = 0; i < 6; i++) v[5 + i] = 0.01f * (float)(i - 3) * 2e-6f;
    bnb_quantize_8bit(v, n, NF4_NESTED_BLOCK, BNB_DYNAMIC_CODE, lut, q, m8);
    int bad = 0, farther = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t b = i / NF4_NESTED_BLOCK;
        if (m8[b] == 0) {
            bad += q[i] != 0;
            continue;
        }
        float s = fminf(fmaxf(v[i] * (1.0f / m8[b]), -1.0f), 1.0f);
        double exact_index = (double)((s + 1.0f) * 0.5f) * 65535.0 + 0.5;
        long index = (long)(float)exact_index;
        float t = ((float)index + (float)index) / 65535.0f - 1.0f;
        int lo = 0, hi = 255;
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (t > (BNB_DYNAMIC_CODE[mid] + BNB_DYNAMIC_CODE[mid + 1]) * 0.5f) lo = mid + 1;
            else hi = mid;
        }
        bad += q[i] != lo;
        /* the table's code against the nearest code of s itself */
        int near = lo;
        for (int c = 0; c < 256; c++)
            if (fabsf(BNB_DYNAMIC_CODE[c] - s) < fabsf(BNB_DYNAMIC_CODE[near] - s)) near = c;
        farther += near != lo;
    }
    check(bad == 0 && farther > 0 && m8[1] == 0 && m8[0] > 0 && q[3] == 0 && BNB_DYNAMIC_CODE[0] < -0.99f,
          "nf4 8-bit step: %lld codes from the 65536-entry table (%d differ; %d of them not the nearest code), a "
          "zero block codes 0", (long long)n, bad, farther);

    /* the round trip: every value within half NF4's widest gap (-1 to -0.696: 0.1519) of its block's absmax, plus
     * the 8-bit step's error on the absmax (half the dynamic code's widest gap, 0.0071, plus a
     * table step, of the largest |absmax - offset|, at most the tensor's largest absmax) */
    enum { N = 5 * NF4_BLOCK * NF4_NESTED_BLOCK / 4 + 17 };
    static float w[N], back[N];
    for (int i = 0; i < N; i++) w[i] = bf16_round((i % 3 ? 0.05f : 0.8f) * uniform(&state));
    memcpy(back, w, sizeof w);
    char err[256];
    int rc = nf4_round_trip(back, N, 1, err, sizeof err);
    float top = 0, worst = 0;
    for (int i = 0; i < N; i++) top = fmaxf(top, fabsf(w[i]));
    int within = rc == 0;
    for (int b = 0; b * NF4_BLOCK < N; b++) {
        float m = 0;
        for (int i = b * NF4_BLOCK; i < N && i < (b + 1) * NF4_BLOCK; i++) m = fmaxf(m, fabsf(w[i]));
        for (int i = b * NF4_BLOCK; i < N && i < (b + 1) * NF4_BLOCK; i++) {
            float e = fabsf(back[i] - w[i]), bound = 0.1520f * m + 0.0072f * top + fabsf(back[i]) * 0x1p-22f;
            worst = fmaxf(worst, e / bound);
            within &= e <= bound;
        }
    }
    check(within, "nf4 round trip of %d bf16 weights: every value within its bound (worst %.2f of it)", N, worst);
    back[70] = NAN;
    rc = nf4_round_trip(back, N, 1, err, sizeof err);
    check(rc == -1 && strstr(err, "element 70") && !strchr(err, '\n'), "nf4 refuses a NaN in one line: %s", err);
    back[70] = -INFINITY;
    check(nf4_round_trip(back, N, 1, err, sizeof err) == -1 && strstr(err, "non-finite"),
          "nf4 refuses -inf: %s", err);
}

/* a bnb4_tensors set for the weight w [rows, cols] built from nf4_quantize's parts as
 * transformers saves them; json is the quant state text */
typedef struct bnb4_fixture {
    uint8_t packed[NF4_BLOCK * 8];
    st_tensor weight, absmax, quant_map, nested_absmax_t, nested_map, state;
    char json[512];
    nf4_quantized q;
} bnb4_fixture;

static void bnb4_fixture_make(bnb4_fixture *f, const float *w, int rows, int cols) {
    char err[256];
    int64_t n = (int64_t)rows * cols;
    nf4_quantize(w, n, 1, &f->q, err, sizeof err);
    memset(f->packed, 0, sizeof f->packed);
    for (int64_t i = 0; i < n; i++) f->packed[i / 2] |= (uint8_t)(i % 2 ? f->q.codes[i] : f->q.codes[i] << 4);
    f->weight = (st_tensor){.dtype = ST_U8, .rank = 2, .shape = {(n + 1) / 2, 1}, .data = f->packed};
    f->absmax = (st_tensor){.dtype = ST_U8, .rank = 1, .shape = {f->q.blocks}, .data = f->q.absmax_codes};
    f->quant_map = (st_tensor){.dtype = ST_F32, .rank = 1, .shape = {16}, .data = NF4_CODE};
    f->nested_absmax_t = (st_tensor){.dtype = ST_F32, .rank = 1, .shape = {f->q.nested_blocks},
                                     .data = f->q.nested_absmax};
    f->nested_map = (st_tensor){.dtype = ST_F32, .rank = 1, .shape = {256}, .data = BNB_DYNAMIC_CODE};
    snprintf(f->json, sizeof f->json,
             "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"float32\", \"shape\": [%d, %d], "
             "\"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": %.17g}",
             rows, cols, (double)f->q.offset);
    f->state = (st_tensor){.dtype = ST_U8, .rank = 1, .shape = {(int64_t)strlen(f->json)}, .data = f->json};
}

static bnb4_tensors bnb4_parts(bnb4_fixture *f) {
    return (bnb4_tensors){&f->weight, &f->absmax, &f->quant_map, &f->nested_absmax_t, &f->nested_map, &f->state};
}

static void test_bnb4_tensor(void) {
    enum { ROWS = 6, COLS = 40 };
    float w[ROWS * COLS], back[ROWS * COLS], out[ROWS * COLS];
    uint64_t state = 21;
    for (int i = 0; i < ROWS * COLS; i++) w[i] = 0.03f * uniform(&state);
    memcpy(back, w, sizeof w);
    char err[256] = "";
    nf4_round_trip(back, ROWS * COLS, 1, err, sizeof err);
    static bnb4_fixture f;
    bnb4_fixture_make(&f, w, ROWS, COLS);
    bnb4_tensors t = bnb4_parts(&f);
    int rc = nf4_dequantize_tensor(&t, ROWS, COLS, out, err, sizeof err);
    check(rc == 0 && memcmp(out, back, sizeof out) == 0,
          "nf4 saved weight (packed high nibble first, double-quantized absmax, offset in the JSON) dequantizes to "
          "the round trip's values%s%s", rc ? ": " : "", rc ? err : "");

    /* without double quantization: absmax stored as F32 */
    float absmax[4];
    for (int64_t b = 0; b < f.q.blocks; b++)
        absmax[b] = BNB_DYNAMIC_CODE[f.q.absmax_codes[b]] * f.q.nested_absmax[0] + f.q.offset;
    bnb4_tensors plain = t;
    st_tensor absmax_f32 = {.dtype = ST_F32, .rank = 1, .shape = {f.q.blocks}, .data = absmax};
    char plain_json[256];
    snprintf(plain_json, sizeof plain_json,
             "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"float32\", \"shape\": [%d, %d]}", ROWS, COLS);
    st_tensor plain_state = {.dtype = ST_U8, .rank = 1, .shape = {(int64_t)strlen(plain_json)}, .data = plain_json};
    plain.absmax = &absmax_f32;
    plain.nested_absmax = plain.nested_quant_map = NULL;
    plain.quant_state = &plain_state;
    rc = nf4_dequantize_tensor(&plain, ROWS, COLS, out, err, sizeof err);
    check(rc == 0 && memcmp(out, back, sizeof out) == 0, "nf4 saved weight without double quantization (F32 "
                                                         "absmax) reads%s%s", rc ? ": " : "", rc ? err : "");

    /* each refusal in one line */
    struct refusal {
        const char *what, *needle;
        bnb4_tensors t;
        int rows;
    } cases[8];
    int k = 0;
    cases[k] = (struct refusal){"no quant state", "quant_state", t, ROWS};
    cases[k++].t.quant_state = NULL;
    cases[k] = (struct refusal){"no nested_absmax", "double quantization", t, ROWS};
    cases[k++].t.nested_absmax = NULL;
    cases[k] = (struct refusal){"absmax of another length", "absmax", t, ROWS};
    st_tensor short_absmax = f.absmax;
    short_absmax.shape[0] = 2;
    cases[k++].t.absmax = &short_absmax;
    cases[k] = (struct refusal){"a quant_map that is not NF4's", "quant_map", t, ROWS};
    float fp4_map[16];
    memcpy(fp4_map, NF4_CODE, sizeof fp4_map);
    fp4_map[3] = 0.5f;
    st_tensor other_map = f.quant_map;
    other_map.data = fp4_map;
    cases[k++].t.quant_map = &other_map;
    cases[k++] = (struct refusal){"a shape other than the config's", "shape", t, ROWS + 1};
    cases[k] = (struct refusal){"a weight of the wrong size", "packed weight", t, ROWS};
    st_tensor short_weight = f.weight;
    short_weight.shape[0] -= 1;
    cases[k++].t.weight = &short_weight;
    char fp4_json[512];
    snprintf(fp4_json, sizeof fp4_json, "%s", f.json);
    memcpy(strstr(fp4_json, "nf4"), "fp4", 3);
    st_tensor fp4_state = f.state;
    fp4_state.data = fp4_json;
    cases[k] = (struct refusal){"quant_type fp4", "only nf4", t, ROWS};
    cases[k++].t.quant_state = &fp4_state;
    float nan_nested = NAN;
    st_tensor bad_nested = f.nested_absmax_t;
    bad_nested.data = &nan_nested;
    cases[k] = (struct refusal){"a NaN nested absmax", "nested_absmax", t, ROWS};
    cases[k++].t.nested_absmax = &bad_nested;
    for (int i = 0; i < k; i++) {
        err[0] = '\0';
        rc = nf4_dequantize_tensor(&cases[i].t, cases[i].rows, COLS, out, err, sizeof err);
        check(rc == -1 && strstr(err, cases[i].needle) && !strchr(err, '\n'), "nf4 saved weight: %s refused in one "
                                                                               "line: %s", cases[i].what, err);
    }
    nf4_quantized_free(&f.q);
}

/* e4m3's value of a code, from the format: sign, 4 exponent bits (bias 7), 3 mantissa bits;
 * exponent 0 subnormal; 0x7f and 0xff NaN */
static double e4m3_value(int code) {
    int e = (code >> 3) & 15, m = code & 7;
    if ((code & 0x7f) == 0x7f) return NAN;
    double v = e == 0 ? m * pow(2, -9) : (8 + m) * pow(2, e - 10);
    return code & 0x80 ? -v : v;
}

/* the code nearest to x among e4m3's finite values, ties to the even code; saturating: x beyond
 * ±448 is taken as ±448 */
static int e4m3_expected(float x) {
    int best = -1;
    double best_d = INFINITY, target = fmax(fmin((double)x, 448.0), -448.0);
    for (int c = 0; c < 256; c++) {
        double v = e4m3_value(c), d = fabs(v - target);
        if (isnan(v) || (v == 0 && !signbit(v) != !signbit(x))) continue;
        if (d < best_d || (d == best_d && (c & 1) == 0 && (best & 1))) best = c, best_d = d;
    }
    return best;
}

static void test_fp8(void) {
    int decode_ok = 1;
    for (int c = 0; c < 256; c++) {
        double v = e4m3_value(c);
        float got = fp8_e4m3_decode((uint8_t)c);
        decode_ok &= isnan(v) ? isnan(got) : (double)got == v;
    }
    /* the values, every midpoint between neighbours (ties), the floats either side of them, the
     * subnormal range, 448 and beyond, and random values across the exponents */
    float x[4096];
    int n = 0;
    for (int c = 0; c < 0x7e; c++) {
        float a = (float)e4m3_value(c), b = (float)e4m3_value(c + 1), mid = (a + b) / 2;
        x[n++] = a, x[n++] = mid, x[n++] = nextafterf(mid, 0), x[n++] = nextafterf(mid, 1000), x[n++] = -mid;
    }
    x[n++] = 448, x[n++] = 460, x[n++] = 1e6f, x[n++] = -3e38f, x[n++] = 1e-30f, x[n++] = -0.0f;
    uint64_t state = 13;
    while (n < 4096) x[n++] = ldexpf(uniform(&state), (int)(uniform(&state) * 14) - 4);
    int bad = 0;
    for (int i = 0; i < n; i++) bad += fp8_e4m3_encode(x[i]) != e4m3_expected(x[i]);
    check(decode_ok && bad == 0 && fp8_e4m3_encode(NAN) == 0x7f && fp8_e4m3_encode(1e6f) == 0x7e &&
              fp8_e4m3_encode(-1e6f) == 0xfe && fp8_e4m3_encode(0x1p-10f) == 0 && fp8_e4m3_encode(0x1.8p-9f) == 2,
          "fp8 e4m3: 256 codes decode; %d values encode to the nearest (the %d midpoints of neighbours to the even "
          "code, 2^-10 to 0), beyond 448 saturating, NaN 0x7f (%d differ)", n, 2 * 0x7e, bad);

    /* per-channel round trip: scale = amax / 448, a zero row scale 1, each value within half a step */
    enum { ROWS = 5, COLS = 96 };
    float w[ROWS * COLS], back[ROWS * COLS], scales[ROWS];
    uint8_t codes[ROWS * COLS];
    for (int i = 0; i < ROWS * COLS; i++) w[i] = (i / COLS == 1 ? 0 : (float)(i / COLS + 1)) * uniform(&state);
    memcpy(back, w, sizeof w);
    char err[256];
    int rc = fp8_round_trip(back, ROWS, COLS, scales, codes, err, sizeof err), within = rc == 0;
    for (int r = 0; r < ROWS && within; r++) {
        float amax = 0;
        for (int j = 0; j < COLS; j++) amax = fmaxf(amax, fabsf(w[r * COLS + j]));
        within &= scales[r] == (amax > 0 ? amax / 448 : 1.0f);
        for (int j = 0; j < COLS; j++) {
            int i = r * COLS + j;
            within &= codes[i] == e4m3_expected(w[i] / scales[r]) && back[i] == fp8_e4m3_decode(codes[i]) * scales[r];
            within &= fabsf(back[i] - w[i]) <= fabsf(w[i]) / 16 + scales[r] * 0x1p-10f;
        }
    }
    check(within && scales[1] == 1 && back[COLS] == 0, "fp8 round trip: a scale of amax / 448 a row (1 for a zero "
                                                       "row), codes nearest, values within half a step");
    back[7] = INFINITY;
    rc = fp8_round_trip(back, ROWS, COLS, NULL, NULL, err, sizeof err);
    check(rc == -1 && strstr(err, "element 7") && !strchr(err, '\n'), "fp8 refuses inf in one line: %s", err);
}

/* train_run with its progress lines sent to /dev/null */
static int quiet_run(const train_options *o, char *err, size_t errlen) {
    fflush(stdout);
    int saved = dup(1), null = open("/dev/null", O_WRONLY);
    if (saved < 0 || null < 0) return snprintf(err, errlen, "cannot redirect stdout"), -1;
    dup2(null, 1);
    close(null);
    int rc = train_run(o, err, errlen);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    return rc;
}

/* DIR/config.json: MODEL's config.json with `extra` (one JSON member) added at its end; DIR made */
static int config_with(const char *model, const char *dir, const char *extra) {
    char src[1200], dst[1300], text[65536];
    snprintf(src, sizeof src, "%s/config.json", model);
    snprintf(dst, sizeof dst, "%s/config.json", dir);
    mkdir(dir, 0777);
    FILE *in = fopen(src, "r"), *out = fopen(dst, "w");
    size_t n = in ? fread(text, 1, sizeof text - 1, in) : 0;
    text[n] = '\0';
    char *close_brace = strrchr(text, '}');
    if (in) fclose(in);
    if (!out || !close_brace) {
        if (out) fclose(out);
        check_fail("cannot write %s from %s", dst, src);
        return -1;
    }
    *close_brace = '\0';
    fprintf(out, "%s, %s}\n", text, extra);
    return fclose(out) == 0 ? 0 : -1;
}

static void test_resume(const char *tmp) {
    char model[1024], data[1100], path[1200], out_dir[1100], err[2048] = "";
    snprintf(model, sizeof model, "%s/gemma4_tiny", fixtures);
    snprintf(data, sizeof data, "%s/data", tmp);
    mkdir(data, 0777);
    snprintf(path, sizeof path, "%s/train.jsonl", data);
    FILE *f = fopen(path, "w");
    if (!f) {
        check_fail("cannot write %s", path);
        return;
    }
    fputs("{\"tokens\": [2, 10, 11, 20, 21, 30, 31, 1]}\n{\"tokens\": [2, 12, 13, 22, 23, 32, 33, 1]}\n", f);
    fclose(f);
    snprintf(out_dir, sizeof out_dir, "%s/run", tmp);
    train_options o;
    train_defaults(&o);
    o.model_dir = model;
    o.data_dir = data;
    o.out_dir = out_dir;
    o.iters = 1;
    o.batch = 2;
    o.lora.rank = 2;
    o.threads = 1;
    o.base = BASE_MLX4;
    if (quiet_run(&o, err, sizeof err) != 0) {
        check_fail("mlx4 run on gemma4_tiny: %s", err);
        return;
    }
    o.resume_dir = out_dir;
    o.out_dir = NULL;
    o.base = BASE_BF16;
    int rc = quiet_run(&o, err, sizeof err);
    check(rc == -1 && strstr(err, "base_dtype") && strstr(err, "mlx4") && !strchr(err, '\n'),
          "--resume of an mlx4 run with the base changed to bf16 is refused: %s", err);
    o.base = BASE_MLX4;
    rc = quiet_run(&o, err, sizeof err);
    check(rc == 0, "--resume of an mlx4 run on an mlx4 base continues%s%s", rc ? ": " : "", rc ? err : "");
    o.resume_dir = NULL;
    o.device = WA_DEVICE_CUDA;
    /* the GPU path takes every base: a step where a CUDA device is, elsewhere a stop at the missing
     * device (one line naming CUDA), never at the base */
    int have_gpu = wa_device_available(WA_DEVICE_CUDA);
    for (base_dtype b = BASE_MLX4; b <= BASE_FP8; b++) {
        char gpu_dir[1200];
        snprintf(gpu_dir, sizeof gpu_dir, "%s/run-gpu-%s", tmp, base_dtype_name(b));
        o.out_dir = gpu_dir;
        o.base = b;
        err[0] = '\0';
        rc = quiet_run(&o, err, sizeof err);
        check(have_gpu ? rc == 0
                       : rc == -1 && strstr(err, "CUDA") && !strstr(err, base_dtype_name(b)) && !strchr(err, '\n'),
              "train_run takes %s on the GPU (%s)%s%s", base_dtype_name(b),
              have_gpu ? "a CUDA device: one step" : "no CUDA device: stopped there", *err ? ": " : "", err);
    }
    o.out_dir = out_dir;

    /* an nf4 run resumes on nf4 only */
    o.device = WA_DEVICE_CPU;
    o.base = BASE_NF4;
    snprintf(out_dir, sizeof out_dir, "%s/run-nf4", tmp);
    rc = quiet_run(&o, err, sizeof err);
    check(rc == 0, "an nf4 run on gemma4_tiny%s%s", rc ? ": " : "", rc ? err : "");
    o.resume_dir = out_dir;
    o.out_dir = NULL;
    o.base = BASE_FP8;
    rc = quiet_run(&o, err, sizeof err);
    check(rc == -1 && strstr(err, "base_dtype") && strstr(err, "\"nf4\"") && strstr(err, "\"fp8\"") &&
              !strchr(err, '\n'),
          "--resume of an nf4 run with the base changed to fp8 is refused: %s", err);
    o.resume_dir = NULL;
    o.out_dir = out_dir;
    o.device = WA_DEVICE_CUDA;

    /* folders whose config.json says they are quantized, on the GPU: no longer refused for it (these
     * hold a config only, so the run stops in one line at the missing weights, or the device) */
    const char *bnb = "\"quantization_config\": {\"quant_method\": \"bitsandbytes\", \"load_in_4bit\": true, "
                      "\"bnb_4bit_quant_type\": \"nf4\", \"bnb_4bit_use_double_quant\": true}";
    struct {
        const char *name, *extra, *needle;
    } folders[2] = {{"mlx", "\"quantization\": {\"group_size\": 64, \"bits\": 4}", "MLX-quantized"},
                    {"bnb", bnb, "bitsandbytes-quantized"}};
    o.base = BASE_BF16;
    for (int i = 0; i < 2; i++) {
        char qdir[1200];
        snprintf(qdir, sizeof qdir, "%s/%s", tmp, folders[i].name);
        if (config_with(model, qdir, folders[i].extra) != 0) return;
        o.model_dir = qdir;
        rc = quiet_run(&o, err, sizeof err);
        check(rc == -1 && !strstr(err, folders[i].needle) && !strstr(err, "quantiz") && !strchr(err, '\n'),
              "train_run does not refuse a %s folder on the GPU for its quantization: %s", folders[i].needle, err);
    }

    /* bitsandbytes settings other than 4-bit nf4 in uint8, refused in one line on the CPU */
    struct {
        const char *extra, *needle;
    } others[3] = {
        {"\"quantization_config\": {\"quant_method\": \"bitsandbytes\", \"load_in_4bit\": true, "
         "\"bnb_4bit_quant_type\": \"fp4\"}", "fp4"},
        {"\"quantization_config\": {\"quant_method\": \"bitsandbytes\", \"load_in_8bit\": true}",
         "8-bit"},
        {"\"quantization_config\": {\"quant_method\": \"bitsandbytes\", \"load_in_4bit\": true, "
         "\"bnb_4bit_quant_type\": \"nf4\", \"bnb_4bit_quant_storage\": \"bfloat16\"}", "storage bfloat16"}};
    char cfg_path[1300], qdir[1200];
    snprintf(qdir, sizeof qdir, "%s/bnb", tmp);
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", qdir);
    check(bnb_config_quantization(cfg_path, err, sizeof err) == 1, "bnb_config_quantization: 4-bit nf4 is read");
    for (int i = 0; i < 3; i++) {
        if (config_with(model, qdir, others[i].extra) != 0) return;
        err[0] = '\0';
        rc = bnb_config_quantization(cfg_path, err, sizeof err);
        lora_config none = {0};
        gemma_model_f32 m;
        char load_err[2048] = "";
        int load_rc = gemma_model_load_base_f32(&m, qdir, &none, BASE_BF16, load_err, sizeof load_err);
        check(rc == -1 && load_rc == -1 && strstr(err, others[i].needle) && !strcmp(err, load_err) &&
                  !strchr(err, '\n'),
              "a quantization_config with %s is refused in one line: %s", others[i].needle, err);
    }
}

static int dump(const char *dir, const char *base, const char *out) {
    char err[512];
    lora_config none = {0};
    gemma_model_f32 m;
    base_dtype b;
    if (base_dtype_parse(base, &b) != 0) {
        fprintf(stderr, "test_train_quant: --dump: base %s is not bf16, mlx4, nf4 or fp8\n", base);
        return 1;
    }
    if (gemma_model_load_base_f32(&m, dir, &none, b, err, sizeof err) != 0) {
        fprintf(stderr, "test_train_quant: %s\n", err);
        return 1;
    }
    FILE *f = fopen(out, "wb");
    int rc = f ? 0 : 1;
    for (int l = 0; f && l < m.cfg.layers; l++)
        for (int p = 0; p < PROJ_COUNT; p++)
            if (m.layer[l].w[p])
                rc |= fwrite(m.layer[l].w[p], sizeof(float), (size_t)m.layer[l].in[p] * m.layer[l].out[p], f) !=
                      (size_t)m.layer[l].in[p] * m.layer[l].out[p];
    if (f && fclose(f) != 0) rc = 1;
    gemma_model_free_f32(&m);
    if (rc) fprintf(stderr, "test_train_quant: cannot write %s\n", out);
    return rc;
}

/* IN's raw f32 values, all of them: *n set, NULL with a message on stderr */
static float *read_f32(const char *path, int64_t *n) {
    FILE *f = fopen(path, "rb");
    float *w = NULL;
    long bytes = -1;
    if (f && fseek(f, 0, SEEK_END) == 0 && (bytes = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 &&
        (w = malloc((size_t)bytes + 4)) && fread(w, 1, (size_t)bytes, f) == (size_t)bytes) {
        fclose(f);
        *n = bytes / 4;
        return w;
    }
    if (f) fclose(f);
    free(w);
    fprintf(stderr, "test_train_quant: cannot read %s\n", path);
    return NULL;
}

static int write_parts(const char *path, const void *const *parts, const size_t *sizes, int count) {
    FILE *f = fopen(path, "wb");
    int ok = f != NULL;
    for (int i = 0; ok && i < count; i++) ok = fwrite(parts[i], 1, sizes[i], f) == sizes[i];
    if (f && fclose(f) != 0) ok = 0;
    if (!ok) fprintf(stderr, "test_train_quant: cannot write %s\n", path);
    return ok ? 0 : 1;
}

/* --nf4 IN THREADS OUT: IN's f32 values quantized as nf4 (torch's mean with THREADS threads); OUT
 * holds the codes (one a byte), the absmax codes, the nested absmax (f32) and the offset (f32). */
static int nf4_codes(const char *in, int threads, const char *out) {
    int64_t n;
    float *w = read_f32(in, &n);
    if (!w) return 1;
    nf4_quantized q;
    char err[256];
    int rc = nf4_quantize(w, n, threads, &q, err, sizeof err);
    if (rc != 0) fprintf(stderr, "test_train_quant: %s\n", err);
    else {
        const void *parts[4] = {q.codes, q.absmax_codes, q.nested_absmax, &q.offset};
        size_t sizes[4] = {(size_t)n, (size_t)q.blocks, (size_t)q.nested_blocks * sizeof(float), sizeof(float)};
        rc = write_parts(out, parts, sizes, 4);
    }
    nf4_quantized_free(&q);
    free(w);
    return rc != 0;
}

/* --fp8 IN ROWS OUT: IN's f32 values as ROWS rows quantized as fp8; OUT holds the codes (one a
 * byte), the scales (f32, one a row) and the dequantized values (f32). */
static int fp8_codes(const char *in, int64_t rows, const char *out) {
    int64_t n;
    float *w = read_f32(in, &n);
    if (!w) return 1;
    uint8_t *codes = malloc((size_t)n + 1);
    float *scales = malloc((size_t)rows * sizeof(float) + 4);
    char err[256];
    int rc = !codes || !scales || rows <= 0 || n % rows;
    if (rc) fprintf(stderr, "test_train_quant: %lld values are not %lld rows\n", (long long)n, (long long)rows);
    else if ((rc = fp8_round_trip(w, rows, n / rows, scales, codes, err, sizeof err)) != 0)
        fprintf(stderr, "test_train_quant: %s\n", err);
    else {
        const void *parts[3] = {codes, scales, w};
        size_t sizes[3] = {(size_t)n, (size_t)rows * sizeof(float), (size_t)n * sizeof(float)};
        rc = write_parts(out, parts, sizes, 3);
    }
    free(codes);
    free(scales);
    free(w);
    return rc != 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--tables") == 0) { /* NF4_CODE then BNB_DYNAMIC_CODE, f32 */
        const void *parts[2] = {NF4_CODE, BNB_DYNAMIC_CODE};
        size_t sizes[2] = {sizeof NF4_CODE, sizeof BNB_DYNAMIC_CODE};
        return write_parts(argv[2], parts, sizes, 2);
    }
    if (argc == 5 && strcmp(argv[1], "--dump") == 0) return dump(argv[2], argv[3], argv[4]);
    if (argc == 5 && strcmp(argv[1], "--nf4") == 0) return nf4_codes(argv[2], atoi(argv[3]), argv[4]);
    if (argc == 5 && strcmp(argv[1], "--fp8") == 0) return fp8_codes(argv[2], atoll(argv[3]), argv[4]);
    if (argc > 1) fixtures = argv[1];
    setvbuf(stdout, NULL, _IOLBF, 0);
    test_groups();
    test_refusals();
    test_packed();
    test_nf4_codes();
    test_dynamic_code();
    test_nested();
    test_bnb4_tensor();
    test_fp8();
    test_model();
    char tmp[] = "/tmp/test_train_quant.XXXXXX";
    if (mkdtemp(tmp)) {
        test_resume(tmp);
        char cmd[1100];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
        if (system(cmd) != 0) fprintf(stderr, "note: could not remove %s\n", tmp);
    } else {
        check_fail("cannot create a temporary folder");
    }
    return check_summary();
}

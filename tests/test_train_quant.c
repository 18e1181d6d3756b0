/* test_train_quant.c — the frozen base's 4-bit formats on the CPU (train/quant.h):
 *   1. mlx4 groups worked by hand: a ramp, a constant group, zeros, negative values only, and the
 *      scale and bias rounded to bf16 where the weight is bf16;
 *   2. refusals: a NaN or inf in a group, rows that groups of 64 do not divide, packed tensors whose
 *      shapes or dtypes do not fit;
 *   3. packed words (eight 4-bit codes per uint32, the first in the low bits) dequantize to what the
 *      round trip gives;
 *   4. gemma_model_load_base with BASE_MLX4 on the gemma4_tiny fixture: every decoder projection
 *      within one step of its group of the plain load, embeddings and norms untouched; the
 *      gemma4_smoke fixture (rows of 32) refused in one line;
 *   5. a run trained on an mlx4 base resumes on one only: --resume with the base changed is refused;
 *      train_run refuses mlx4 on the GPU.
 * Usage: test_train_quant [FIXTURES_DIR] (default train/fixtures).
 * test_train_quant --dump MODEL_DIR bf16|mlx4 OUT writes every decoder projection as loaded (f32,
 * layer by layer in q, k, v, o, gate, up, down order, absent ones skipped) to OUT, for
 * python/tests/test_quant.py to compare with mlx.core.dequantize. */
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
    o.out_dir = out_dir;
    o.device = WA_DEVICE_CUDA;
    rc = quiet_run(&o, err, sizeof err);
    check(rc == -1 && strstr(err, "GPU path does not have"), "train_run refuses mlx4 on the GPU: %s", err);

    /* a folder mlx_lm.convert -q wrote (its config.json says "quantization") on the GPU: one line
     * saying the GPU path cannot read it, before any weight is read (only the config is needed) */
    char qdir[1200], src[1200], cfg_path[1300];
    snprintf(qdir, sizeof qdir, "%s/quantized", tmp);
    mkdir(qdir, 0777);
    snprintf(src, sizeof src, "%s/config.json", model);
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", qdir);
    FILE *in = fopen(src, "r"), *out = fopen(cfg_path, "w");
    if (!in || !out) {
        if (in) fclose(in);
        if (out) fclose(out);
        check_fail("cannot write %s", cfg_path);
        return;
    }
    char text[65536];
    size_t n = fread(text, 1, sizeof text - 1, in);
    text[n] = '\0';
    char *close_brace = strrchr(text, '}');
    if (close_brace) *close_brace = '\0';
    fprintf(out, "%s, \"quantization\": {\"group_size\": 64, \"bits\": 4}}\n", text);
    fclose(in);
    fclose(out);
    o.model_dir = qdir;
    o.base = BASE_BF16;
    rc = quiet_run(&o, err, sizeof err);
    check(rc == -1 && strstr(err, "MLX-quantized") && strstr(err, "--device cpu") && !strchr(err, '\n'),
          "train_run refuses an mlx_lm.convert -q folder on the GPU in one line: %s", err);
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
    if (argc == 5 && strcmp(argv[1], "--dump") == 0) return dump(argv[2], argv[3], argv[4]);
    if (argc == 5 && strcmp(argv[1], "--nf4") == 0) return nf4_codes(argv[2], atoi(argv[3]), argv[4]);
    if (argc == 5 && strcmp(argv[1], "--fp8") == 0) return fp8_codes(argv[2], atoll(argv[3]), argv[4]);
    if (argc > 1) fixtures = argv[1];
    setvbuf(stdout, NULL, _IOLBF, 0);
    test_groups();
    test_refusals();
    test_packed();
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

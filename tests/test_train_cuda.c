/* test_train_cuda.c — the trainer's GPU model (train/model_cuda.h) against the same references
 * as the CPU model: transformers' float64 logits, loss and LoRA gradients on the fixtures of
 * train/fixtures, with the CPU float model's own errors printed beside (the GPU's f32 mode must
 * be as close as the CPU is), the GPU f32 loss within 1e-5 of the CPU's, and the bf16 mode within
 * the bounds below. A packed batch of every record of the fixture, as the trainer runs it. Then
 * the device's optimizer (gemma_cuda_optimizer_step) against the host's (train_clip_grad_norm
 * and train_optimizer_update) on the same gradients, gradient accumulation over several backward
 * calls, the refusal of a non-finite gradient, and a step's loss and gradients equal to the bit
 * when it runs again (its layer inputs go through host memory and back). First, the quantization
 * of a float projection on the device at load (mlx4, nf4, fp8; f32, f16, bf16 and f64 as stored)
 * against train/quant.c byte for byte, --init-random on each quantized base, the fp8 base's FP8
 * products alone against the host's double-precision product of the same quantized operands, and
 * the decoder layer's residual and per-head (q/k norm + RoPE) kernels against a host
 * implementation of their f32 operations, byte for byte.
 * Without a CUDA device (or a build without nvcc) every case prints SKIP.
 * Usage: test_train_cuda [FIXTURES_DIR] (default train/fixtures). */
#define _GNU_SOURCE
#include "check.h"
#include "convert.h"
#include "model_cuda.h"
#include "quant.h"
#include "safetensors.h"
#include "trainer.h"

#include <jansson.h>
#include <unistd.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *fixtures = "train/fixtures";
/* 1 once test_fp8_products has seen this device run the fp8 base's FP8 products */
static int fp8_products_here;
/* gemma_cuda_describe of the last model run_outputs opened on the GPU */
static char gpu_describe[320];

typedef struct reference {
    st_file expected;
    const int32_t *tokens, *lengths;
    const float *mask, *logits;
    double loss;
    int B, T, V;
    gemma_seq *seqs;
    uint8_t **masks;
    long targets;
} reference;

static int reference_open(reference *r, const char *dir) {
    char path[1100], err[1024];
    memset(r, 0, sizeof *r);
    snprintf(path, sizeof path, "%s/expected.safetensors", dir);
    if (st_open(path, &r->expected, err, sizeof err) != 0) return check_fail("%s", err), -1;
    const st_tensor *tok = st_find(&r->expected, "tokens"), *len = st_find(&r->expected, "lengths");
    const st_tensor *mask = st_find(&r->expected, "loss_mask"), *lg = st_find(&r->expected, "logits");
    const st_tensor *loss = st_find(&r->expected, "loss");
    if (!tok || !len || !mask || !lg || !loss) return check_fail("%s: a tensor is missing", path), -1;
    r->tokens = tok->data, r->lengths = len->data, r->mask = mask->data, r->logits = lg->data;
    memcpy(&r->loss, loss->data, sizeof(double));
    r->B = (int)tok->shape[0], r->T = (int)tok->shape[1], r->V = (int)lg->shape[2];
    r->seqs = calloc((size_t)r->B, sizeof *r->seqs);
    r->masks = calloc((size_t)r->B, sizeof *r->masks);
    for (int b = 0; b < r->B; b++) {
        int n = r->lengths[b];
        r->masks[b] = malloc((size_t)n);
        for (int t = 0; t < n - 1; t++) r->targets += (r->masks[b][t] = r->mask[(long)b * (r->T - 1) + t] != 0);
        r->seqs[b] = (gemma_seq){r->tokens + (long)b * r->T, n, r->masks[b]};
    }
    return 0;
}

static void reference_close(reference *r) {
    for (int b = 0; b < r->B; b++) free(r->masks[b]);
    free(r->masks);
    free(r->seqs);
    st_close(&r->expected);
}

typedef struct errors {
    double logits, loss, grads; /* relative to the reference's largest value (loss: to the loss) */
    double loss_value;
} errors;

/* packed logits [Σ len, V] against the reference's [B, T - 1, V] on real positions */
static double logits_error(const reference *r, const float *lg) {
    double worst = 0, scale = 0;
    long row = 0;
    for (int b = 0; b < r->B; b++) {
        for (int t = 0; t < r->lengths[b] && t < r->T - 1; t++)
            for (int j = 0; j < r->V; j++) {
                double e = r->logits[((long)b * (r->T - 1) + t) * r->V + j];
                worst = fmax(worst, fabs(lg[(row + t) * r->V + j] - e));
                scale = fmax(scale, fabs(e));
            }
        row += r->lengths[b];
    }
    return worst / (scale > 0 ? scale : 1);
}

static double grads_error(const reference *r, const gemma_model_f32 *m) {
    double worst = 0;
    for (int i = 0; i < m->slot_count; i++)
        for (int k = 0; k < 2; k++) {
            const lora_slot *s = &m->slots[i];
            char name[200];
            snprintf(name, sizeof name, "grad.model.layers.%d.%s.%s", s->layer, gemma_proj_path[s->proj],
                     k ? "lora_b" : "lora_a");
            const st_tensor *t = st_find(&r->expected, name);
            if (!t) return INFINITY;
            const float *e = t->data, *g = m->grads + (k ? s->b : s->a);
            double err = 0, mx = 0;
            for (uint64_t j = 0; j < st_numel(t); j++) {
                err = fmax(err, fabs((double)g[j] - e[j]));
                mx = fmax(mx, fabs((double)e[j]));
            }
            worst = fmax(worst, err / (mx > 0 ? mx : 1));
        }
    return worst;
}

static long packed_rows(const reference *r) {
    long n = 0;
    for (int b = 0; b < r->B; b++) n += r->lengths[b];
    return n;
}

/* the CPU float model with winattn's CPU kernels: the errors the GPU is held to */
static int cpu_errors(const char *dir, const lora_config *lc, const reference *r, errors *out, char *err, size_t n) {
    gemma_model_f32 m;
    char path[1100];
    if (gemma_model_load_f32(&m, dir, lc, err, n) != 0) return -1;
    snprintf(path, sizeof path, "%s/adapters.safetensors", dir);
    int rc = adapters_load(&m, path, err, n) || gemma_set_attention_f32(&m, ATTN_FUSED, 0, 0);
    float *lg = malloc((size_t)packed_rows(r) * r->V * sizeof(float));
    gemma_stats st = {0}, st2 = {0};
    if (!rc) rc = gemma_forward_batch_f32(&m, r->seqs, r->B, &st, lg);
    memset(m.grads, 0, m.param_count * sizeof(float));
    if (!rc) rc = gemma_backward_batch_f32(&m, r->seqs, r->B, 1.0 / (double)r->targets, &st2);
    if (rc && !*err) snprintf(err, n, "%s", m.err);
    if (!rc) {
        out->logits = logits_error(r, lg);
        out->loss_value = st.loss_sum / (double)st.tokens;
        out->loss = fabs(out->loss_value - r->loss) / fabs(r->loss);
        out->grads = grads_error(r, &m);
    }
    free(lg);
    gemma_model_free_f32(&m);
    return rc ? -1 : 0;
}

static int gpu_errors(const char *dir, const lora_config *lc, const reference *r, gemma_precision p, errors *out,
                      char *err, size_t n) {
    gemma_model_f32 m;
    char path[1100];
    if (gemma_model_layout_f32(&m, dir, lc, err, n) != 0) return -1;
    snprintf(path, sizeof path, "%s/adapters.safetensors", dir);
    gemma_cuda *g = NULL;
    gemma_cuda_options o = {p, 0, 0, 7, 0, BASE_BF16}; /* 7 rows per head chunk: the chunking is exercised */
    int rc = adapters_load(&m, path, err, n) || gemma_cuda_open(&m, dir, &o, &g, err, n);
    float *lg = malloc((size_t)packed_rows(r) * r->V * sizeof(float));
    gemma_stats st = {0}, st2 = {0};
    if (!rc) rc = gemma_cuda_forward_batch(g, &m, r->seqs, r->B, &st, lg, err, n);
    /* the device's gradients start at zero: the backward adds into them */
    if (!rc) rc = gemma_cuda_backward_batch(g, &m, r->seqs, r->B, 1.0 / (double)r->targets, &st2, err, n);
    if (!rc) rc = gemma_cuda_grads_download(g, m.grads, err, n);
    if (!rc) {
        out->logits = logits_error(r, lg);
        out->loss_value = st.loss_sum / (double)st.tokens;
        out->loss = fabs(out->loss_value - r->loss) / fabs(r->loss);
        out->grads = grads_error(r, &m);
        if (st.tokens != st2.tokens || st.tokens != r->targets)
            snprintf(err, n, "target counts differ: forward %ld, backward %ld, reference %ld", st.tokens, st2.tokens,
                     r->targets), rc = -1;
    }
    free(lg);
    gemma_cuda_close(g);
    gemma_model_free_f32(&m);
    return rc ? -1 : 0;
}

/* bf16 bounds: FlashAttention's criterion at the model's scale. transformers itself, run on these
 * fixtures in bf16 (eager attention, LoRA in bf16, on the H200: `python3
 * train/fixtures/bf16_reference.py`, transformers 5.17, torch 2.11), lands this far from the
 * float64 references; the GPU trainer's bf16 mode must stay within twice that, plus 2e-3 on the
 * loss (one bf16 rounding, 2^-9, of the logits it comes from: transformers' loss comes from bf16
 * logits, ours from f32 ones, so its own loss error is no yardstick for ours). gemma4_tiny is
 * large on purpose: score scale 1 with q/k norms makes its softmax sharp, and bf16 q and k move
 * its scores by tenths. */
typedef struct bf16_yardstick {
    const char *fixture;
    double logits, loss, grads;
} bf16_yardstick;
static const bf16_yardstick transformers_bf16[] = {
    {"gemma4_smoke", 1.05e-2, 6.8e-4, 3.80e-2},
    {"gemma4_tiny", 8.07e-1, 8.3e-3, 1.76e0},
    {"gemma3_tiny", 9.46e-3, 1.4e-5, 3.55e-2},
};

/* ---------------------------------------------------------------------------------------------
 * A quantized base on the GPU (--base-dtype mlx4, nf4, fp8, and folders stored packed) against the
 * CPU reference on the same base: the GPU keeps the projections packed and dequantizes each layer
 * into the products' precision (model_cuda.h), the CPU dequantizes them to f32 at load; both start
 * from the same codes and scales (train/quant.c quantizes for both), so in f32 the two models see
 * the same weights bit for bit and differ only as the plain base's models do. */

/* what one model gives on the reference batch */
typedef struct outputs {
    float *logits, *grads; /* [packed rows, V], [param_count] */
    double loss;
} outputs;

static void outputs_free(outputs *o) {
    free(o->logits);
    free(o->grads);
    memset(o, 0, sizeof *o);
}

/* One forward (with logits) and backward of r on the model in dir with the adapters of adapters_dir:
 * the CPU's (gpu 0, loaded by gemma_model_load_base; round_weights: every frozen weight then rounded
 * to bf16) or the GPU's in precision p. m keeps the layout for the caller (freed with the outputs on
 * failure). */
static int run_outputs(const char *dir, const char *adapters_dir, const lora_config *lc, const reference *r, int gpu,
                       gemma_precision p, base_dtype base, int round_weights, gemma_model_f32 *m, outputs *out,
                       char *err, size_t n) {
    char path[1100];
    memset(out, 0, sizeof *out);
    err[0] = '\0';
    if ((gpu ? gemma_model_layout_f32(m, dir, lc, err, n) : gemma_model_load_base_f32(m, dir, lc, base, err, n)) != 0)
        return -1;
    if (round_weights && !gpu)
        for (size_t i = 0; i < m->weight_count; i++) m->weights[i] = wa_bf16_to_f32(wa_f32_to_bf16(m->weights[i]));
    snprintf(path, sizeof path, "%s/adapters.safetensors", adapters_dir);
    gemma_cuda *g = NULL;
    gemma_cuda_options o = {p, 0, 0, 7, 0, base};
    int rc = adapters_load(m, path, err, n) ||
             (gpu ? gemma_cuda_open(m, dir, &o, &g, err, n) : gemma_set_attention_f32(m, ATTN_FUSED, 0, 0));
    out->logits = malloc((size_t)packed_rows(r) * r->V * sizeof(float));
    out->grads = malloc((m->param_count ? m->param_count : 1) * sizeof(float));
    gemma_stats st = {0}, st2 = {0};
    double scale = 1.0 / (double)r->targets;
    if (!rc && (!out->logits || !out->grads)) rc = -1, snprintf(err, n, "out of memory");
    if (!rc)
        rc = gpu ? gemma_cuda_forward_batch(g, m, r->seqs, r->B, &st, out->logits, err, n)
                 : gemma_forward_batch_f32(m, r->seqs, r->B, &st, out->logits);
    if (!rc && !gpu) memset(m->grads, 0, m->param_count * sizeof(float));
    if (!rc)
        rc = gpu ? gemma_cuda_backward_batch(g, m, r->seqs, r->B, scale, &st2, err, n)
                 : gemma_backward_batch_f32(m, r->seqs, r->B, scale, &st2);
    if (!rc) {
        if (gpu) rc = gemma_cuda_grads_download(g, out->grads, err, n);
        else memcpy(out->grads, m->grads, m->param_count * sizeof(float));
    }
    if (rc && !gpu && !*err) snprintf(err, n, "%s", m->err);
    if (!rc) out->loss = st.loss_sum / (double)st.tokens;
    if (g) snprintf(gpu_describe, sizeof gpu_describe, "%s", gemma_cuda_describe(g));
    gemma_cuda_close(g);
    if (rc) {
        outputs_free(out);
        gemma_model_free_f32(m);
    }
    return rc ? -1 : 0;
}

/* the largest of worst and d, a NaN counting as infinite */
static double worse(double worst, double d) { return d <= worst ? worst : isnan(d) ? INFINITY : d; }

/* b against a (the CPU's): logits relative to a's largest, the LoRA gradients slot by slot
 * relative to the slot's largest (as grads_error does against transformers), the loss relative */
static errors compare(const gemma_model_f32 *m, const reference *r, const outputs *a, const outputs *b) {
    errors e = {0};
    double worst = 0, largest = 0;
    long n = packed_rows(r) * r->V;
    for (long i = 0; i < n; i++) {
        worst = worse(worst, fabs((double)b->logits[i] - a->logits[i]));
        largest = fmax(largest, fabs((double)a->logits[i]));
    }
    e.logits = worst / (largest > 0 ? largest : 1);
    e.loss = fabs(b->loss - a->loss) / fabs(a->loss);
    e.loss_value = b->loss;
    for (int i = 0; i < m->slot_count; i++)
        for (int k = 0; k < 2; k++) {
            const lora_slot *s = &m->slots[i];
            size_t off = k ? s->b : s->a, len = (size_t)m->lora.rank * (size_t)(k ? s->out : s->in);
            double err = 0, mx = 0;
            for (size_t j = 0; j < len; j++) {
                err = worse(err, fabs((double)b->grads[off + j] - a->grads[off + j]));
                mx = fmax(mx, fabs((double)a->grads[off + j]));
            }
            e.grads = worse(e.grads, err / (mx > 0 ? mx : 1));
        }
    return e;
}

/* The GPU in f32 and bf16 on base against the CPU in f32 on base, fixture `name` (the model in dir,
 * the adapters and references in fixture_dir). f32: the loss to 1e-5 relative, as the plain
 * base's; logits and gradients within 3x the CPU's own error against float64 on the plain base
 * (plus 1e-6): the file holds each f32 model within 2x that of the exact values, so two of them
 * differ by at most the sum; the quantized base only gives the same arithmetic other weights.
 * bf16: the plain base's bf16 bounds against transformers' bf16, plus the CPU's own error, since the
 * yardstick here is the CPU f32 model instead of float64, plus what rounding this base's weights to
 * bf16 alone moves on the CPU: the yardstick measured that rounding on the plain base's weights, and
 * the dequantized ones are other values (they are not bf16 numbers, so every one of them rounds;
 * on gemma4_smoke's nf4 base without this term the gradients came 4 % over the plain bound on an
 * H100). fp8 in bf16 where the device runs FP8 products (its description must then say so): plus
 * the activations' quantization to e4m3 at every frozen product's input, bounded with the same
 * measurement. A relative perturbation of each input value of a product moves its outputs as one
 * of each weight does (Σ_k x_k w_k δ_k either way), e4m3's is at most 2^-4 of the value where
 * rounding to bf16 is at most 2^-8 (the unit roundoffs of 4 and 8 significant bits), and both are
 * spread alike over the value's mantissa: 16 times the weights' rounding term w (which also holds
 * the tied head's rounding, that e4m3 does not touch: it only widens the bound). The logits and
 * the loss see it once (the forward's inputs), the gradients twice (the forward's inputs and the
 * backward's quantized gradients, independent); and twice that, as w is one draw of random
 * roundings like the yardstick's (which is doubled too): 32·w on logits and loss, 64·w on the
 * gradients. Where the CPU refuses the base (mlx4 on
 * rows of 32), the GPU must refuse it with the same one line. */
static void test_quantized(const char *name, const char *dir, const char *fixture_dir, const char *what,
                           base_dtype base, const reference *r, const lora_config *lc, const errors *cpu,
                           const bf16_yardstick *y) {
    gemma_model_f32 mc, mg;
    outputs ref, gout;
    char err[1024], gerr[1024];
    if (run_outputs(dir, fixture_dir, lc, r, 0, PRECISION_F32, base, 0, &mc, &ref, err, sizeof err) != 0) {
        int rc = run_outputs(dir, fixture_dir, lc, r, 1, PRECISION_F32, base, 0, &mg, &gout, gerr, sizeof gerr);
        if (rc == 0) outputs_free(&gout), gemma_model_free_f32(&mg);
        check(rc != 0 && strcmp(err, gerr) == 0 && !strchr(gerr, '\n'),
              "%s %s: the GPU refuses what the CPU refuses, in the same line: cpu \"%s\", cuda \"%s\"", name, what, err,
              gerr);
        return;
    }
    for (int k = 0; k < 2; k++) {
        gemma_precision p = k ? PRECISION_BF16 : PRECISION_F32;
        const char *pname = k ? "bf16" : "f32";
        if (run_outputs(dir, fixture_dir, lc, r, 1, p, base, 0, &mg, &gout, gerr, sizeof gerr) != 0) {
            check_fail("%s %s cuda %s: %s", name, what, pname, gerr);
            continue;
        }
        errors e = compare(&mc, r, &ref, &gout);
        double tol[3];
        if (p == PRECISION_F32)
            tol[0] = 3 * cpu->logits + 1e-6, tol[1] = 1e-5, tol[2] = 3 * cpu->grads + 1e-6;
        else {
            gemma_model_f32 mr;
            outputs rounded;
            if (run_outputs(dir, fixture_dir, lc, r, 0, PRECISION_F32, base, 1, &mr, &rounded, err, sizeof err) != 0) {
                check_fail("%s %s: the CPU with the weights rounded to bf16: %s", name, what, err);
                outputs_free(&gout);
                gemma_model_free_f32(&mg);
                continue;
            }
            errors w = compare(&mc, r, &ref, &rounded);
            outputs_free(&rounded);
            gemma_model_free_f32(&mr);
            tol[0] = 2 * y->logits + cpu->logits + w.logits, tol[1] = 2 * y->loss + 2e-3 + cpu->loss + w.loss,
            tol[2] = 2 * y->grads + cpu->grads + w.grads;
            if (base == BASE_FP8 && fp8_products_here) {
                check(strstr(gpu_describe, "FP8 products") != NULL, "%s %s cuda bf16: the model runs FP8 products (%s)",
                      name, what, gpu_describe);
                tol[0] += 32 * w.logits, tol[1] += 32 * w.loss, tol[2] += 64 * w.grads;
            }
        }
        check(e.logits <= tol[0] && e.loss <= tol[1] && e.grads <= tol[2],
              "%s %s cuda %s vs cpu f32 on the same base: logits %.1e, loss %.1e (%.6g vs %.6g), LoRA grads %.1e "
              "(tol %.1e %.1e %.1e)",
              name, what, pname, e.logits, e.loss, gout.loss, ref.loss, e.grads, tol[0], tol[1], tol[2]);
        outputs_free(&gout);
        gemma_model_free_f32(&mg);
    }
    outputs_free(&ref);
    gemma_model_free_f32(&mc);
}

/* ---------------------------------------------------------------------------------------------
 * The fp8 base's FP8 products (bf16 mode, compute capability 8.9 or more: model_cuda.h). */

/* normal(0, 1) from a splitmix64 stream and Box–Muller (the test's own: no library draws) */
static double draw_normal(uint64_t *state) {
    uint64_t u[2];
    for (int i = 0; i < 2; i++) {
        uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        u[i] = (z ^ (z >> 31)) >> 11;
    }
    double u1 = ((double)u[0] + 1) / 9007199254740993.0, u2 = (double)u[1] / 9007199254740992.0;
    return sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2);
}

/* The device's quantization of one operand row, reproduced: v = x (times the weight's row scale
 * for the input gradient, an f32 product), scale = amax / 448 in f32 (1 for a row of zeros), code =
 * e4m3(v / scale) with quant.h's encoder. */
static float host_quant_row(const uint16_t *x, const float *col_scale, long n, uint8_t *q) {
    float amax = 0;
    for (long i = 0; i < n; i++) {
        float v = col_scale ? wa_bf16_to_f32(x[i]) * col_scale[i] : wa_bf16_to_f32(x[i]);
        amax = fmaxf(amax, fabsf(v));
    }
    float s = amax / FP8_E4M3_MAX;
    if (s == 0.f) s = 1.f;
    for (long i = 0; i < n; i++) {
        float v = col_scale ? wa_bf16_to_f32(x[i]) * col_scale[i] : wa_bf16_to_f32(x[i]);
        q[i] = fp8_e4m3_encode(v / s);
    }
    return s;
}

/* (a) One product in both forms against the host's double-precision product of the same quantized
 * operands: the device's activation codes and scales must equal the host's reproduction bit for
 * bit, and the output must lie within
 *     2^-7 |ref| + 2^-10 · xs · ws · Σ_k |xq_k · wq_k|
 * of ref = xs · ws · Σ_k xq_k · wq_k. Each product of two e4m3 values is exact in f32 (4
 * significant bits each), so what remains is the rounding of the f32 result to bf16 (at most 2^-8
 * relative, doubled) and the accumulation: the tensor cores keep about 14 bits in their FP8 partial
 * sums until cuBLASLt promotes them to f32 (fast accumulation off), i.e. 2^-13 of the running
 * magnitude per addition, which a few additions between promotions keep under 2^-10 of Σ|terms|.
 * A scale on the wrong axis, a wrong transpose or a wrong operand moves outputs by about Σ|terms|
 * over √K, far outside. Rows: magnitudes from 1e-3 to 1e3, a row of zeros, a row with one
 * value 1e4 times the rest; the weight rows scaled from 1e-2 to 1e2. */
static void test_fp8_products(void) {
    static const long shapes[][3] = {{37, 96, 512}, {40, 512, 96}, {1, 16, 16}}; /* rows, n_out, k_in */
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        long rows = shapes[si][0], n_out = shapes[si][1], k_in = shapes[si][2];
        uint64_t rng = 1234 + si;
        float *w = malloc((size_t)(n_out * k_in) * sizeof(float)), *ws = malloc((size_t)n_out * sizeof(float));
        uint8_t *codes = malloc((size_t)(n_out * k_in));
        char err[1024] = "";
        for (long o = 0; o < n_out; o++) {
            double row_mag = pow(10.0, -2 + 4.0 * (double)o / (double)n_out);
            for (long k = 0; k < k_in; k++) w[o * k_in + k] = (float)(row_mag * draw_normal(&rng));
        }
        if (fp8_round_trip(w, n_out, k_in, ws, codes, err, sizeof err) != 0) {
            check_fail("fp8 product: %s", err);
            free(w), free(ws), free(codes);
            return;
        }
        for (int input_grad = 0; input_grad < 2; input_grad++) {
            long in = input_grad ? n_out : k_in, out = input_grad ? k_in : n_out;
            uint16_t *x = malloc((size_t)(rows * in) * 2), *y = malloc((size_t)(rows * out) * 2);
            uint8_t *xq = malloc((size_t)(rows * in)), *hq = malloc((size_t)(rows * in));
            float *xs = malloc((size_t)rows * sizeof(float));
            for (long r = 0; r < rows; r++) {
                double mag = rows > 1 ? pow(10.0, -3 + 6.0 * (double)r / (double)(rows - 1)) : 1.0;
                for (long i = 0; i < in; i++) {
                    double v = r == 2 ? 0.0 : mag * draw_normal(&rng);
                    if (r == 3 && i == in / 3) v *= 1e4;
                    x[r * in + i] = wa_f32_to_bf16((float)v);
                }
            }
            int cc = 0;
            int rc = gemma_cuda_fp8_product(input_grad, rows, n_out, k_in, codes, ws, x, y, xq, xs, &cc, err,
                                            sizeof err);
            const char *form = input_grad ? "input gradient dy·W" : "forward x·Wᵀ";
            if (rc == 1) {
                /* Hopper's cuBLASLt documents outer-vector FP8 scaling: there it must run */
                if (cc >= 90)
                    check_fail("fp8 product %s: compute capability %d.%d takes no FP8 products", form, cc / 10,
                               cc % 10);
                else
                    check_skip("fp8 product %s: compute capability %d.%d takes no FP8 products (the dequantized "
                               "path stays)", form, cc / 10, cc % 10);
            } else if (rc != 0) {
                check_fail("fp8 product %s: %s", form, err);
            } else {
                fp8_products_here = 1;
                long code_diff = 0, scale_diff = 0;
                double worst = 0;
                for (long r = 0; r < rows; r++) {
                    float s = host_quant_row(x + r * in, input_grad ? ws : NULL, in, hq + r * in);
                    scale_diff += s != xs[r];
                    for (long i = 0; i < in; i++) code_diff += hq[r * in + i] != xq[r * in + i];
                    for (long c = 0; c < out; c++) {
                        double sum = 0, abs_sum = 0;
                        for (long k = 0; k < in; k++) {
                            double a = fp8_e4m3_decode(hq[r * in + k]);
                            double b = input_grad ? fp8_e4m3_decode(codes[k * k_in + c])
                                                  : fp8_e4m3_decode(codes[c * k_in + k]);
                            sum += a * b, abs_sum += fabs(a * b);
                        }
                        double scale = (double)s * (input_grad ? 1.0 : (double)ws[c]);
                        double ref = scale * sum, bound = ldexp(fabs(ref), -7) + ldexp(scale * abs_sum, -10);
                        double got = wa_bf16_to_f32(y[r * out + c]), e = fabs(got - ref);
                        worst = worse(worst, bound > 0 ? e / bound : e > 0 ? INFINITY : 0);
                    }
                }
                check(code_diff == 0 && scale_diff == 0 && worst <= 1.0,
                      "fp8 product %s, %ld x %ld x %ld (cc %d.%d): activation codes and scales as the host's (%ld "
                      "codes, %ld scales differ); output vs the host's double product of the same operands: worst "
                      "%.2f of the bound",
                      form, rows, out, in, cc / 10, cc % 10, code_diff, scale_diff, worst);
            }
            free(x), free(y), free(xq), free(hq), free(xs);
        }
        free(w), free(ws), free(codes);
    }
}

/* ---------------------------------------------------------------------------------------------
 * The decoder layer's residual kernels (model_cuda.h: gemma_cuda_residual_norm and
 * gemma_cuda_residual_norms_bwd) against a host implementation of the same f32 operations in the
 * same order, byte for byte: the per-thread sums, the warp butterflies, the E roundings and the
 * fused multiply-adds where the header says; only rsqrtf is the device's (gemma_cuda_rsqrt). In f32 a
 * sum taken in another order, a product fused or not fused otherwise, or a weight or an operand
 * swapped shows in the last bits; in bf16 a rounding to E added, dropped or moved (dout · scalar
 * kept in f32, dx read back before its rounding) shows in many entries. Rows of awkward widths:
 * 1, fewer than a warp, a block and one, neither, and Gemma 3/4 31B's hidden 5376. */

enum { ROW_BLOCK = 256 }; /* the kernels' threads per row */

static float e_round(int bf16, float v) { return bf16 ? wa_bf16_to_f32(wa_f32_to_bf16(v)) : v; }
static float e_get(int bf16, const void *p, size_t i) {
    return bf16 ? wa_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static void e_set(int bf16, void *p, size_t i, float v) {
    if (bf16) ((uint16_t *)p)[i] = wa_f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* lane j takes v[j] + v[j ^ o] for o = 16, 8, 4, 2, 1 (all lanes end equal) */
static float warp_butterfly(float v[32]) {
    for (int o = 16; o > 0; o >>= 1) {
        float next[32];
        for (int j = 0; j < 32; j++) next[j] = v[j] + v[j ^ o];
        memcpy(v, next, sizeof next);
    }
    return v[0];
}

/* the block's sum of the ROW_BLOCK per-thread partials: each warp's butterfly, then the warp sums
 * padded with zeros to a warp */
static float block_sum_host(const float partial[ROW_BLOCK]) {
    float lanes[32], warps[32] = {0};
    for (int w = 0; w < ROW_BLOCK / 32; w++) {
        memcpy(lanes, partial + 32 * w, sizeof lanes);
        warps[w] = warp_butterfly(lanes);
    }
    return warp_butterfly(warps);
}

/* inv[r] = the device's rsqrtf(arg[r]) for every row; 0, or -1 after a failed check */
static int device_rsqrt(const float *arg, float *inv, long rows, const char *what) {
    char err[512] = "";
    if (gemma_cuda_rsqrt(arg, inv, rows, err, sizeof err) != 0) {
        check_fail("%s: rsqrt on the device: %s", what, err);
        return -1;
    }
    return 0;
}

/* the f32 argument of a row's rsqrt: Σ x² by thread, block-summed, / n + eps */
static float norm_arg(int bf16, const void *x, size_t off, int n, float eps) {
    float part[ROW_BLOCK] = {0};
    for (int i = 0; i < n; i++) {
        float xi = e_get(bf16, x, off + (size_t)i);
        part[i % ROW_BLOCK] = fmaf(xi, xi, part[i % ROW_BLOCK]);
    }
    return block_sum_host(part) / (float)n + eps;
}

/* h and y2 as gemma_cuda_residual_norm computes them; 0, or -1 after a failed check */
static int host_residual_norm(int bf16, long rows, int n, const void *resid, const void *x, const float *w,
                              float scale, const float *w2, float eps, void *h, void *y2, const char *what) {
    float *arg = malloc((size_t)rows * sizeof(float)), *inv = malloc((size_t)rows * sizeof(float));
    int rc = -1;
    for (long r = 0; r < rows; r++) arg[r] = norm_arg(bf16, x, (size_t)(r * n), n, eps);
    if (device_rsqrt(arg, inv, rows, what) != 0) goto done;
    for (long r = 0; r < rows; r++) {
        size_t off = (size_t)(r * n);
        for (int i = 0; i < n; i++) {
            float a = e_get(bf16, x, off + (size_t)i) * inv[r], res = e_get(bf16, resid, off + (size_t)i), s;
            if (bf16) s = e_round(bf16, res + e_round(bf16, a * w[i]));
            else s = fmaf(a, w[i], res); /* no rounding between: the product and the add fuse */
            if (scale != 1.f) s = e_round(bf16, s * scale);
            e_set(bf16, h, off + (size_t)i, s);
        }
    }
    if (w2) {
        for (long r = 0; r < rows; r++) arg[r] = norm_arg(bf16, h, (size_t)(r * n), n, eps);
        if (device_rsqrt(arg, inv, rows, what) != 0) goto done;
        for (long r = 0; r < rows; r++)
            for (int i = 0; i < n; i++) {
                size_t at = (size_t)(r * n + i);
                float y = e_get(bf16, h, at) * inv[r];
                e_set(bf16, y2, at, y * w2[i]);
            }
    }
    rc = 0;
done:
    free(arg), free(inv);
    return rc;
}

/* out = E(base + norm'(x, w, dy)) row by row, base E(dout · scalar) with dout, else 0 (model_cuda.h) */
static int host_norm_bwd(int bf16, long rows, int n, const void *x, const float *w, const void *dy, const void *dout,
                         float scalar, float eps, void *out, const char *what) {
    float *arg = malloc((size_t)rows * sizeof(float)), *inv = malloc((size_t)rows * sizeof(float));
    float *gx = malloc((size_t)rows * sizeof(float));
    int rc = -1;
    for (long r = 0; r < rows; r++) {
        size_t off = (size_t)(r * n);
        float part[ROW_BLOCK] = {0};
        arg[r] = norm_arg(bf16, x, off, n, eps);
        for (int i = 0; i < n; i++) {
            float dw = e_get(bf16, dy, off + (size_t)i) * w[i];
            part[i % ROW_BLOCK] = fmaf(e_get(bf16, x, off + (size_t)i), dw, part[i % ROW_BLOCK]);
        }
        gx[r] = block_sum_host(part);
    }
    if (device_rsqrt(arg, inv, rows, what) != 0) goto done;
    for (long r = 0; r < rows; r++) {
        size_t off = (size_t)(r * n);
        float cube = inv[r] * inv[r];
        cube = inv[r] * cube;
        float k = gx[r] * cube / (float)n;
        for (int i = 0; i < n; i++) {
            float xi = e_get(bf16, x, off + (size_t)i), xk = xi * k;
            float g = fmaf(inv[r] * e_get(bf16, dy, off + (size_t)i), w[i], -xk);
            float base = dout ? e_round(bf16, e_get(bf16, dout, off + (size_t)i) * scalar) : 0.f;
            e_set(bf16, out, off + (size_t)i, base + g);
        }
    }
    rc = 0;
done:
    free(arg), free(inv), free(gx);
    return rc;
}

/* entries of E where a and b differ in their bytes */
static long e_differ(int bf16, const void *a, const void *b, size_t count) {
    size_t es = bf16 ? 2 : 4;
    long d = 0;
    for (size_t i = 0; i < count; i++) d += memcmp((const char *)a + i * es, (const char *)b + i * es, es) != 0;
    return d;
}

/* rows of E: normal values times 10^(r mod 5 − 2) */
static void *e_rows(int bf16, long rows, int n, uint64_t *rng) {
    void *p = malloc((size_t)(rows * n) * (bf16 ? 2 : 4));
    for (long r = 0; r < rows; r++)
        for (int i = 0; i < n; i++)
            e_set(bf16, p, (size_t)(r * n + i), (float)(draw_normal(rng) * pow(10.0, (double)(r % 5) - 2)));
    return p;
}

static float *weights(int n, uint64_t *rng) {
    float *w = malloc((size_t)n * sizeof(float));
    for (int i = 0; i < n; i++) w[i] = (float)(1 + 0.5 * draw_normal(rng));
    return w;
}

static void test_residual_kernels(void) {
    static const int widths[] = {1, 19, 256, 257, 700, 5376};
    const float eps = 1e-6f;
    for (int bf16 = 0; bf16 < 2; bf16++)
        for (size_t wi = 0; wi < sizeof widths / sizeof *widths; wi++) {
            int n = widths[wi];
            long rows = 7;
            size_t count = (size_t)(rows * n), bytes = count * (bf16 ? 2 : 4);
            const char *type = bf16 ? "bf16" : "f32";
            uint64_t rng = 977 + 31 * (uint64_t)wi + (uint64_t)bf16;
            void *resid = e_rows(bf16, rows, n, &rng), *x = e_rows(bf16, rows, n, &rng);
            void *d_mi = e_rows(bf16, rows, n, &rng), *ao = e_rows(bf16, rows, n, &rng);
            void *dout = e_rows(bf16, rows, n, &rng);
            float *w = weights(n, &rng), *w2 = weights(n, &rng);
            void *h = malloc(bytes), *y2 = malloc(bytes), *hh = malloc(bytes), *hy2 = malloc(bytes);
            void *dx = malloc(bytes), *dao = malloc(bytes), *hdx = malloc(bytes), *hdao = malloc(bytes);
            char err[512] = "", what[128];
            /* the attention half's close (scale 1, the next norm) and the layer's (its scalar, no norm) */
            for (int form = 0; form < 2; form++) {
                float scale = form ? 0.37f : 1.f;
                const float *next = form ? NULL : w2;
                snprintf(what, sizeof what, "residual norm %s, %ld x %d, scale %g%s", type, rows, n, (double)scale,
                         next ? ", next norm" : "");
                if (gemma_cuda_residual_norm(bf16, rows, n, resid, x, w, scale, next, eps, h, y2, err, sizeof err)) {
                    check_fail("%s: %s", what, err);
                    continue;
                }
                if (host_residual_norm(bf16, rows, n, resid, x, w, scale, next, eps, hh, hy2, what) != 0) continue;
                long dh = e_differ(bf16, h, hh, count), dy = next ? e_differ(bf16, y2, hy2, count) : 0;
                check(dh == 0 && dy == 0, "%s: the device's h and y2 as the host's, byte for byte (%ld and %ld of %zu "
                      "differ)", what, dh, dy, count);
            }
            snprintf(what, sizeof what, "residual norms backward %s, %ld x %d", type, rows, n);
            if (gemma_cuda_residual_norms_bwd(bf16, rows, n, dout, 0.37f, resid, w, d_mi, ao, w2, eps, dx, dao, err,
                                              sizeof err)) {
                check_fail("%s: %s", what, err);
            } else if (host_norm_bwd(bf16, rows, n, resid, w, d_mi, dout, 0.37f, eps, hdx, what) == 0 &&
                       host_norm_bwd(bf16, rows, n, ao, w2, hdx, NULL, 0, eps, hdao, what) == 0) {
                long ddx = e_differ(bf16, dx, hdx, count), dda = e_differ(bf16, dao, hdao, count);
                check(ddx == 0 && dda == 0, "%s: the device's dx and d_ao as the host's, byte for byte (%ld and %ld "
                      "of %zu differ)", what, ddx, dda, count);
            }
            free(resid), free(x), free(d_mi), free(ao), free(dout), free(w), free(w2);
            free(h), free(y2), free(hh), free(hy2), free(dx), free(dao), free(hdx), free(hdao);
        }
}

/* ---------------------------------------------------------------------------------------------
 * The per-head kernels of the fused q|k|v projection (model_cuda.h: gemma_cuda_qkv_heads),
 * forward and backward, against a host implementation of the same f32 operations, byte for byte,
 * as the residual kernels above: head dims 2 (half a pair per lane), 70 (lanes past the end), 256
 * and 512 (the 31B's), separate values with and without their norm, and k_eq_v (the k heads write
 * the values too and take their gradient). */

/* One head vector of a row: where its input starts in the qkv row, its weight (NULL: none), its
 * norm and rotation, and which output and gradient it has. */
typedef struct head_vec {
    long col;
    const float *w;
    int norm, rope, kind; /* kind 0: q, 1: k, 2: v */
    long out;             /* offset in qr (q) or kr / vn (k, v) */
} head_vec;

static head_vec head_at(int h, long t, int heads, int kv_heads, int D, int v_norm, const float *q_w,
                        const float *k_w) {
    head_vec v;
    if (h < heads) {
        v.col = (long)h * D, v.w = q_w, v.norm = 1, v.rope = 1, v.kind = 0, v.out = (t * heads + h) * D;
        return v;
    }
    h -= heads;
    int kh = h < kv_heads ? h : h - kv_heads;
    v.out = (t * kv_heads + kh) * D;
    if (h < kv_heads) v.col = (long)(heads + h) * D, v.w = k_w, v.norm = 1, v.rope = 1, v.kind = 1;
    else v.col = (long)(heads + kv_heads + kh) * D, v.w = NULL, v.norm = v_norm, v.rope = 0, v.kind = 2;
    return v;
}

/* rope⁻¹ of the pair (a, b) at cos c, sin s */
static void unrotate(int rope, float a, float b, float c, float s, float *u1, float *u2) {
    if (rope) *u1 = fmaf(a, c, b * s), *u2 = fmaf(b, c, -(a * s));
    else *u1 = a, *u2 = b;
}

static int host_qkv_heads(int bf16, int T, int heads, int kv_heads, int D, int k_eq_v, int v_norm, float eps,
                          const void *qkv, const float *q_w, const float *k_w, const int32_t *pos, const float *cosv,
                          const float *sinv, const void *d_qr, const void *d_kr, const void *d_vn, void *qr, void *kr,
                          void *vn, void *d_qkv, const char *what) {
    int per_row = heads + kv_heads + (k_eq_v ? 0 : kv_heads), half = D / 2;
    long ld = (long)per_row * D, count = (long)T * per_row;
    float *arg = malloc((size_t)count * sizeof(float)), *inv = malloc((size_t)count * sizeof(float));
    float *gx = malloc((size_t)count * sizeof(float)), *gx2 = malloc((size_t)count * sizeof(float));
    int rc = -1;
    /* forward: Σx² by lane over the vector */
    for (long n = 0; n < count; n++) {
        long t = n / per_row;
        head_vec v = head_at((int)(n % per_row), t, heads, kv_heads, D, v_norm, q_w, k_w);
        float lanes[32] = {0};
        for (int i = 0; i < D; i++) {
            float x = e_get(bf16, qkv, (size_t)(t * ld + v.col + i));
            lanes[i % 32] = fmaf(x, x, lanes[i % 32]);
        }
        arg[n] = warp_butterfly(lanes) / (float)D + eps;
    }
    if (device_rsqrt(arg, inv, count, what) != 0) goto done;
    for (long n = 0; n < count; n++) {
        long t = n / per_row;
        head_vec v = head_at((int)(n % per_row), t, heads, kv_heads, D, v_norm, q_w, k_w);
        const float *c = cosv + (long)pos[t] * half, *s = sinv + (long)pos[t] * half;
        float r = v.norm ? inv[n] : 1.f;
        for (int j = 0; j < half; j++) {
            float x1 = e_get(bf16, qkv, (size_t)(t * ld + v.col + j)) * r;
            float x2 = e_get(bf16, qkv, (size_t)(t * ld + v.col + j + half)) * r;
            if (v.kind == 2) {
                e_set(bf16, vn, (size_t)(v.out + j), x1), e_set(bf16, vn, (size_t)(v.out + j + half), x2);
                continue;
            }
            if (v.kind == 1 && k_eq_v) { /* the raw keys are the values: x · inv (v_norm) or x */
                float s1 = e_get(bf16, qkv, (size_t)(t * ld + v.col + j)) * (v_norm ? r : 1.f);
                float s2 = e_get(bf16, qkv, (size_t)(t * ld + v.col + j + half)) * (v_norm ? r : 1.f);
                e_set(bf16, vn, (size_t)(v.out + j), s1), e_set(bf16, vn, (size_t)(v.out + j + half), s2);
            }
            x1 = x1 * v.w[j], x2 = x2 * v.w[j + half];
            float r1 = fmaf(x1, c[j], -(x2 * s[j])), r2 = fmaf(x2, c[j], x1 * s[j]);
            void *y = v.kind == 0 ? qr : kr;
            e_set(bf16, y, (size_t)(v.out + j), r1), e_set(bf16, y, (size_t)(v.out + j + half), r2);
        }
    }
    /* backward: Σx², Σg·x and (k_eq_v's k heads) Σdv·x by lane over the pairs */
    for (long n = 0; n < count; n++) {
        long t = n / per_row;
        head_vec v = head_at((int)(n % per_row), t, heads, kv_heads, D, v_norm, q_w, k_w);
        const float *c = cosv + (long)pos[t] * half, *s = sinv + (long)pos[t] * half;
        const void *dy = v.kind == 0 ? d_qr : v.kind == 1 ? d_kr : d_vn;
        int g2 = v.kind == 1 && k_eq_v;
        float ss[32] = {0}, g[32] = {0}, g2s[32] = {0};
        for (int j = 0; j < half; j++) {
            float x1 = e_get(bf16, qkv, (size_t)(t * ld + v.col + j));
            float x2 = e_get(bf16, qkv, (size_t)(t * ld + v.col + j + half)), u1, u2;
            unrotate(v.rope, e_get(bf16, dy, (size_t)(v.out + j)), e_get(bf16, dy, (size_t)(v.out + j + half)), c[j],
                     s[j], &u1, &u2);
            ss[j % 32] = ss[j % 32] + fmaf(x1, x1, x2 * x2);
            g[j % 32] = g[j % 32] + (v.w ? fmaf(u1 * v.w[j], x1, u2 * v.w[j + half] * x2) : fmaf(u1, x1, u2 * x2));
            if (g2)
                g2s[j % 32] = g2s[j % 32] + fmaf(e_get(bf16, d_vn, (size_t)(v.out + j)), x1,
                                                 e_get(bf16, d_vn, (size_t)(v.out + j + half)) * x2);
        }
        arg[n] = warp_butterfly(ss) / (float)D + eps;
        gx[n] = warp_butterfly(g), gx2[n] = warp_butterfly(g2s);
    }
    if (device_rsqrt(arg, inv, count, what) != 0) goto done;
    for (long n = 0; n < count; n++) {
        long t = n / per_row;
        head_vec v = head_at((int)(n % per_row), t, heads, kv_heads, D, v_norm, q_w, k_w);
        const float *c = cosv + (long)pos[t] * half, *s = sinv + (long)pos[t] * half;
        const void *dy = v.kind == 0 ? d_qr : v.kind == 1 ? d_kr : d_vn;
        int g2 = v.kind == 1 && k_eq_v;
        float r = inv[n], cube = r * r;
        cube = cube * r;
        float k = cube * gx[n] / (float)D, k2 = cube * gx2[n] / (float)D;
        for (int j = 0; j < half; j++) {
            float x1 = e_get(bf16, qkv, (size_t)(t * ld + v.col + j));
            float x2 = e_get(bf16, qkv, (size_t)(t * ld + v.col + j + half)), u1, u2, d1, d2;
            unrotate(v.rope, e_get(bf16, dy, (size_t)(v.out + j)), e_get(bf16, dy, (size_t)(v.out + j + half)), c[j],
                     s[j], &u1, &u2);
            if (!v.norm) {
                d1 = u1, d2 = u2;
            } else if (v.w) {
                d1 = fmaf(r * u1, v.w[j], -(x1 * k)), d2 = fmaf(r * u2, v.w[j + half], -(x2 * k));
            } else {
                d1 = fmaf(r, u1, -(x1 * k)), d2 = fmaf(r, u2, -(x2 * k));
            }
            if (g2) {
                d1 = d1 + fmaf(r, e_get(bf16, d_vn, (size_t)(v.out + j)), -(x1 * k2));
                d2 = d2 + fmaf(r, e_get(bf16, d_vn, (size_t)(v.out + j + half)), -(x2 * k2));
            }
            e_set(bf16, d_qkv, (size_t)(t * ld + v.col + j), d1);
            e_set(bf16, d_qkv, (size_t)(t * ld + v.col + j + half), d2);
        }
    }
    rc = 0;
done:
    free(arg), free(inv), free(gx), free(gx2);
    return rc;
}

static void test_qkv_heads(void) {
    static const int cases[][3] = {{2, 0, 0}, {70, 0, 1}, {70, 1, 1}, {256, 0, 1}, {512, 1, 1}}; /* D, k_eq_v, v_norm */
    const int T = 5, heads = 3, kv_heads = 2, positions = 7;
    const float eps = 1e-6f;
    for (int bf16 = 0; bf16 < 2; bf16++)
        for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
            int D = cases[ci][0], k_eq_v = cases[ci][1], v_norm = cases[ci][2], half = D / 2;
            long ld = (long)(heads + kv_heads + (k_eq_v ? 0 : kv_heads)) * D;
            long nq = (long)T * heads * D, nk = (long)T * kv_heads * D, nx = T * ld;
            size_t es = bf16 ? 2 : 4;
            uint64_t rng = 4242 + 17 * (uint64_t)ci + (uint64_t)bf16;
            void *qkv = e_rows(bf16, T, (int)ld, &rng), *d_qr = e_rows(bf16, T, heads * D, &rng);
            void *d_kr = e_rows(bf16, T, kv_heads * D, &rng), *d_vn = e_rows(bf16, T, kv_heads * D, &rng);
            float *q_w = weights(D, &rng), *k_w = weights(D, &rng);
            float *cosv = malloc((size_t)(positions * half) * sizeof(float));
            float *sinv = malloc((size_t)(positions * half) * sizeof(float));
            int32_t pos[5];
            for (int i = 0; i < positions * half; i++) {
                double a = 6.283185307179586 * (draw_normal(&rng) + 3);
                cosv[i] = (float)cos(a), sinv[i] = (float)sin(a);
            }
            for (int t = 0; t < T; t++) pos[t] = (int32_t)((t * 3 + (int)ci) % positions);
            void *out[4], *ref[4];
            size_t sizes[4] = {(size_t)nq, (size_t)nk, (size_t)nk, (size_t)nx};
            for (int k = 0; k < 4; k++) out[k] = calloc(sizes[k], es), ref[k] = calloc(sizes[k], es);
            char err[512] = "", what[160];
            snprintf(what, sizeof what, "qkv heads %s, T %d, %d q and %d kv heads of %d%s%s", bf16 ? "bf16" : "f32",
                     T, heads, kv_heads, D, k_eq_v ? ", k_eq_v" : "", v_norm ? ", v norm" : "");
            if (gemma_cuda_qkv_heads(bf16, T, heads, kv_heads, D, k_eq_v, v_norm, eps, qkv, q_w, k_w, pos, positions,
                                     cosv, sinv, d_qr, d_kr, d_vn, out[0], out[1], out[2], out[3], err, sizeof err)) {
                check_fail("%s: %s", what, err);
            } else if (host_qkv_heads(bf16, T, heads, kv_heads, D, k_eq_v, v_norm, eps, qkv, q_w, k_w, pos, cosv,
                                      sinv, d_qr, d_kr, d_vn, ref[0], ref[1], ref[2], ref[3], what) == 0) {
                long dq = e_differ(bf16, out[0], ref[0], sizes[0]), dk = e_differ(bf16, out[1], ref[1], sizes[1]);
                long dv = e_differ(bf16, out[2], ref[2], sizes[2]), dx = e_differ(bf16, out[3], ref[3], sizes[3]);
                check(dq == 0 && dk == 0 && dv == 0 && dx == 0,
                      "%s: the device's qr, kr, vn and d_qkv as the host's, byte for byte (%ld, %ld, %ld and %ld "
                      "differ)", what, dq, dk, dv, dx);
            }
            for (int k = 0; k < 4; k++) free(out[k]), free(ref[k]);
            free(qkv), free(d_qr), free(d_kr), free(d_vn), free(q_w), free(k_w), free(cosv), free(sinv);
        }
}

/* Folders stored packed, built here from a fixture's f32 checkpoint with train/quant.c's own
 * quantizers, in the layouts the real tools write (python/tests/test_quant.py checks those against
 * mlx_lm.convert and bitsandbytes):
 *   mlx: every projection and the embedding as mlx_lm.convert -q stores them (U32 words, BF16
 *        scales and biases [rows, cols / 64]), but layer 0's down_proj left in f32 (what MLX does
 *        with a layer it cannot group), config.json "quantization";
 *   bnb: every projection as transformers saves a bitsandbytes 4-bit nf4 model (U8 [n / 2, 1], the
 *        quant state beside it), double-quantized except in layer 0 (f32 absmax: compress_statistics
 *        off), config.json "quantization_config". */
enum { MAX_OUT = 1024 };
typedef struct folder_out {
    st_out t[MAX_OUT];
    int count;
    void *owned[MAX_OUT];
    int owned_count;
    char *names[MAX_OUT];
    int name_count;
} folder_out;

static void *own(folder_out *f, size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (p && f->owned_count < MAX_OUT) f->owned[f->owned_count++] = p;
    return p;
}

static void add(folder_out *f, const char *name, st_dtype dtype, int rank, int64_t d0, int64_t d1, const void *data) {
    if (f->count >= MAX_OUT || f->name_count >= MAX_OUT) return;
    char *copy = strdup(name);
    f->names[f->name_count++] = copy;
    st_out *o = &f->t[f->count++];
    memset(o, 0, sizeof *o);
    o->name = copy, o->dtype = dtype, o->rank = rank, o->shape[0] = d0, o->shape[1] = d1, o->data = data;
}

static int is_projection(const char *name) {
    for (int p = 0; p < PROJ_COUNT; p++) {
        char tail[64];
        snprintf(tail, sizeof tail, ".%s.weight", gemma_proj_path[p]);
        size_t n = strlen(name), m = strlen(tail);
        if (n > m && strcmp(name + n - m, tail) == 0) return 1;
    }
    return 0;
}

static void pack_mlx(folder_out *f, const st_tensor *t) {
    int64_t rows = t->shape[0], cols = t->shape[1], groups = rows * cols / MLX4_GROUP;
    uint32_t *words = own(f, (size_t)(rows * cols / 8) * 4);
    uint16_t *scales = own(f, (size_t)groups * 2), *biases = own(f, (size_t)groups * 2);
    if (!words || !scales || !biases) return;
    for (int64_t gi = 0; gi < groups; gi++) {
        uint8_t q[MLX4_GROUP];
        float s, b;
        mlx4_quantize_group((const float *)t->data + gi * MLX4_GROUP, ST_BF16, q, &s, &b);
        for (int j = 0; j < MLX4_GROUP; j++) words[gi * 8 + j / 8] |= (uint32_t)q[j] << (4 * (j % 8));
        scales[gi] = wa_f32_to_bf16(s), biases[gi] = wa_f32_to_bf16(b);
    }
    char stem[256], name[300];
    snprintf(stem, sizeof stem, "%.*s", (int)(strlen(t->name) - strlen(".weight")), t->name);
    add(f, t->name, ST_U32, 2, rows, cols / 8, words);
    snprintf(name, sizeof name, "%s.scales", stem);
    add(f, name, ST_BF16, 2, rows, cols / MLX4_GROUP, scales);
    snprintf(name, sizeof name, "%s.biases", stem);
    add(f, name, ST_BF16, 2, rows, cols / MLX4_GROUP, biases);
}

static void pack_bnb(folder_out *f, const st_tensor *t, int nested) {
    int64_t rows = t->shape[0], cols = t->shape[1], n = rows * cols, blocks = (n + NF4_BLOCK - 1) / NF4_BLOCK;
    uint8_t *packed = own(f, (size_t)(n + 1) / 2), *codes = own(f, (size_t)n);
    char *json = own(f, 512), name[300];
    if (!packed || !codes || !json) return;
    const void *absmax;
    if (nested) {
        nf4_quantized q;
        char err[256];
        if (nf4_quantize(t->data, n, 1, &q, err, sizeof err) != 0) return;
        memcpy(codes, q.codes, (size_t)n);
        uint8_t *absmax_codes = own(f, (size_t)blocks);
        float *nested_absmax = own(f, (size_t)q.nested_blocks * 4);
        if (absmax_codes) memcpy(absmax_codes, q.absmax_codes, (size_t)blocks);
        if (nested_absmax) memcpy(nested_absmax, q.nested_absmax, (size_t)q.nested_blocks * 4);
        snprintf(json, 512,
                 "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"float32\", \"shape\": [%lld, %lld], "
                 "\"nested_blocksize\": 256, \"nested_dtype\": \"float32\", \"nested_offset\": %.17g}",
                 (long long)rows, (long long)cols, (double)q.offset);
        snprintf(name, sizeof name, "%s.nested_absmax", t->name);
        add(f, name, ST_F32, 1, q.nested_blocks, 0, nested_absmax);
        snprintf(name, sizeof name, "%s.nested_quant_map", t->name);
        add(f, name, ST_F32, 1, 256, 0, BNB_DYNAMIC_CODE);
        nf4_quantized_free(&q);
        absmax = absmax_codes;
    } else {
        float *absmax_f32 = own(f, (size_t)blocks * 4);
        if (!absmax_f32) return;
        nf4_quantize_blocks(t->data, n, codes, absmax_f32);
        snprintf(json, 512,
                 "{\"quant_type\": \"nf4\", \"blocksize\": 64, \"dtype\": \"float32\", \"shape\": [%lld, %lld]}",
                 (long long)rows, (long long)cols);
        absmax = absmax_f32;
    }
    for (int64_t i = 0; i < n; i++) packed[i / 2] |= (uint8_t)(i % 2 ? codes[i] : codes[i] << 4);
    add(f, t->name, ST_U8, 2, (n + 1) / 2, 1, packed);
    snprintf(name, sizeof name, "%s.absmax", t->name);
    add(f, name, nested ? ST_U8 : ST_F32, 1, blocks, 0, absmax);
    snprintf(name, sizeof name, "%s.quant_map", t->name);
    add(f, name, ST_F32, 1, 16, 0, NF4_CODE);
    snprintf(name, sizeof name, "%s.quant_state.bitsandbytes__nf4", t->name);
    add(f, name, ST_U8, 1, (int64_t)strlen(json), 0, json);
}

/* out/model.safetensors and out/config.json from fixture_dir's, packed as `mlx` says */
static int write_packed_folder(const char *fixture_dir, const char *out, int mlx, char *err, size_t n) {
    char path[1200];
    st_file src;
    snprintf(path, sizeof path, "%s/model.safetensors", fixture_dir);
    if (st_open(path, &src, err, n) != 0) return -1;
    static folder_out f;
    memset(&f, 0, sizeof f);
    for (int i = 0; i < src.count; i++) {
        const st_tensor *t = &src.tensors[i];
        int projection = is_projection(t->name) && t->rank == 2 && t->dtype == ST_F32;
        int embedding = strstr(t->name, "embed_tokens.weight") != NULL && t->rank == 2 && t->dtype == ST_F32;
        if (mlx && (projection || embedding) && !strstr(t->name, "layers.0.mlp.down_proj"))
            pack_mlx(&f, t);
        else if (!mlx && projection)
            pack_bnb(&f, t, !strstr(t->name, "layers.0."));
        else
            add(&f, t->name, t->dtype, t->rank, t->shape[0], t->shape[1], t->data);
    }
    int rc = f.count < MAX_OUT && f.owned_count < MAX_OUT ? 0 : -1;
    if (rc) snprintf(err, n, "more than %d tensors", MAX_OUT);
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    if (!rc) rc = st_write(path, f.t, f.count, NULL, err, n);
    st_close(&src);
    for (int i = 0; i < f.owned_count; i++) free(f.owned[i]);
    for (int i = 0; i < f.name_count; i++) free(f.names[i]);
    if (rc) return -1;
    snprintf(path, sizeof path, "%s/config.json", fixture_dir);
    json_t *config = json_load_file(path, 0, NULL);
    if (!config) return snprintf(err, n, "cannot read %.900s", path), -1;
    json_t *q = mlx ? json_pack("{s:i, s:i}", "group_size", 64, "bits", 4)
                    : json_pack("{s:s, s:b, s:s, s:b}", "quant_method", "bitsandbytes", "load_in_4bit", 1,
                                "bnb_4bit_quant_type", "nf4", "bnb_4bit_use_double_quant", 1);
    json_object_set_new(config, mlx ? "quantization" : "quantization_config", q);
    snprintf(path, sizeof path, "%s/config.json", out);
    rc = json_dump_file(config, path, JSON_INDENT(2));
    json_decref(config);
    return rc ? (snprintf(err, n, "cannot write %.900s", path), -1) : 0;
}

static void remove_folder(const char *dir) {
    char path[1200];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
}

/* every base and the packed folders on fixture `name` (cpu: the CPU's errors on the plain base) */
static void test_quantized_bases(const char *name, const reference *r, const lora_config *lc, const errors *cpu,
                                 const bf16_yardstick *y) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/%s", fixtures, name);
    for (base_dtype b = BASE_MLX4; b <= BASE_FP8; b++)
        test_quantized(name, dir, dir, base_dtype_name(b), b, r, lc, cpu, y);
    if (strcmp(name, "gemma4_smoke") == 0) return; /* rows of 32: groups of 64 do not cut them */
    for (int mlx = 1; mlx >= 0; mlx--) {
        char tmp[] = "/tmp/test_train_cuda_XXXXXX", err[1024] = "";
        const char *what = mlx ? "mlx_lm.convert -q folder" : "bitsandbytes nf4 folder";
        if (!mkdtemp(tmp)) {
            check_fail("%s %s: cannot make a temporary folder", name, what);
            continue;
        }
        if (write_packed_folder(dir, tmp, mlx, err, sizeof err) != 0) check_fail("%s %s: %s", name, what, err);
        else test_quantized(name, tmp, dir, what, BASE_BF16, r, lc, cpu, y);
        remove_folder(tmp);
    }
}

static void test_fixture(const char *name) {
    char dir[1024], path[1100], err[1024] = "";
    snprintf(dir, sizeof dir, "%s/%s", fixtures, name);
    lora_config lc;
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    if (adapter_config_load(path, 1 << 20, &lc, err, sizeof err) != 0) {
        check_fail("%s: %s", name, err);
        return;
    }
    reference r;
    if (reference_open(&r, dir) != 0) return;
    errors cpu, f32, b16;
    if (cpu_errors(dir, &lc, &r, &cpu, err, sizeof err) != 0) {
        check_fail("%s cpu f32: %s", name, err);
        reference_close(&r);
        return;
    }
    if (gpu_errors(dir, &lc, &r, PRECISION_F32, &f32, err, sizeof err) != 0) {
        check_fail("%s cuda f32: %s", name, err);
    } else {
        /* as close to float64 as the CPU float model (twice its error, plus float32 rounding of
         * the references themselves), and the same loss to 1e-5 */
        double dl = fabs(f32.loss_value - cpu.loss_value) / fabs(cpu.loss_value);
        check(f32.logits <= 2 * cpu.logits + 1e-6 && f32.grads <= 2 * cpu.grads + 1e-6 && dl <= 1e-5,
              "%s cuda f32 vs transformers: logits %.1e, loss %.1e, LoRA grads %.1e (cpu f32: %.1e, %.1e, %.1e); "
              "loss vs cpu %.1e (tol 1e-5)",
              name, f32.logits, f32.loss, f32.grads, cpu.logits, cpu.loss, cpu.grads, dl);
    }
    if (gpu_errors(dir, &lc, &r, PRECISION_BF16, &b16, err, sizeof err) != 0) {
        check_fail("%s cuda bf16: %s", name, err);
    } else {
        const bf16_yardstick *y = NULL;
        for (size_t i = 0; i < sizeof transformers_bf16 / sizeof *transformers_bf16; i++)
            if (strcmp(transformers_bf16[i].fixture, name) == 0) y = &transformers_bf16[i];
        if (!y) {
            check_fail("%s cuda bf16: no transformers bf16 yardstick for this fixture", name);
        } else {
            double tol[3] = {2 * y->logits, 2 * y->loss + 2e-3, 2 * y->grads};
            check(b16.logits <= tol[0] && b16.loss <= tol[1] && b16.grads <= tol[2],
                  "%s cuda bf16 vs transformers f64: logits %.1e, loss %.1e, LoRA grads %.1e (transformers bf16: "
                  "%.1e, %.1e, %.1e; tol %.1e %.1e %.1e)",
                  name, b16.logits, b16.loss, b16.grads, y->logits, y->loss, y->grads, tol[0], tol[1], tol[2]);
        }
    }
    const bf16_yardstick *y = NULL;
    for (size_t i = 0; i < sizeof transformers_bf16 / sizeof *transformers_bf16; i++)
        if (strcmp(transformers_bf16[i].fixture, name) == 0) y = &transformers_bf16[i];
    if (y) test_quantized_bases(name, &r, &lc, &cpu, y);
    reference_close(&r);
}

/* Refusals: a non-finite weight names the tensor; a token outside the vocabulary names the record. */
static void test_refusals(void) {
    char dir[1024], path[1100], err[1024] = "";
    snprintf(dir, sizeof dir, "%s/gemma4_smoke", fixtures);
    lora_config lc;
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    gemma_model_f32 m;
    if (adapter_config_load(path, 1 << 20, &lc, err, sizeof err) || gemma_model_layout_f32(&m, dir, &lc, err, sizeof err)) {
        check_fail("refusals: %s", err);
        return;
    }
    gemma_cuda *g = NULL;
    gemma_cuda_options o = {PRECISION_BF16, 0, 0, 0, 0, BASE_BF16};
    if (gemma_cuda_open(&m, dir, &o, &g, err, sizeof err) != 0) {
        check_fail("refusals: open: %s", err);
        gemma_model_free_f32(&m);
        return;
    }
    int32_t bad[3] = {2, m.cfg.vocab, 5};
    gemma_seq s = {bad, 3, NULL};
    gemma_stats st = {0};
    int rc = gemma_cuda_forward_batch(g, &m, &s, 1, &st, NULL, err, sizeof err);
    check(rc != 0 && strstr(err, "outside the vocabulary"), "cuda: a token outside the vocabulary is refused: %s", err);
    gemma_cuda_close(g);
    gemma_model_free_f32(&m);
}

/* ---------------------------------------------------------------------------------------------
 * The optimizer on the device */

/* a fixture's model with its adapters, on the GPU (deterministic: winattn's deterministic backward);
 * r its reference batch */
static int open_fixture(const char *name, gemma_precision p, int deterministic, gemma_model_f32 *m, gemma_cuda **g,
                        reference *r, char *err, size_t n) {
    char dir[1024], path[1100];
    lora_config lc;
    *g = NULL;
    snprintf(dir, sizeof dir, "%s/%s", fixtures, name);
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    if (adapter_config_load(path, 1 << 20, &lc, err, n) != 0 || gemma_model_layout_f32(m, dir, &lc, err, n) != 0)
        return -1;
    snprintf(path, sizeof path, "%s/adapters.safetensors", dir);
    gemma_cuda_options o = {p, 0, 0, 0, deterministic, BASE_BF16};
    if (adapters_load(m, path, err, n) != 0 || gemma_cuda_open(m, dir, &o, g, err, n) != 0) {
        gemma_model_free_f32(m);
        return -1;
    }
    if (reference_open(r, dir) != 0) {
        snprintf(err, n, "%s: the reference batch cannot be read", name);
        gemma_cuda_close(*g);
        gemma_model_free_f32(m);
        return -1;
    }
    return 0;
}

static int open_smoke(gemma_precision p, gemma_model_f32 *m, gemma_cuda **g, reference *r, char *err, size_t n) {
    return open_fixture("gemma4_smoke", p, 0, m, g, r, err, n);
}

/* the largest |a - b| / max(|a|, |b|) over n entries (NaN counts as infinite), and how many differ */
static double max_relative(const float *a, const float *b, size_t n, size_t *differ) {
    double worst = 0;
    *differ = 0;
    for (size_t i = 0; i < n; i++) {
        if (a[i] == b[i]) continue;
        (*differ)++;
        double d = fabs((double)a[i] - b[i]) / fmax(fabs((double)a[i]), fabs((double)b[i]));
        worst = d <= worst ? worst : isnan(d) ? INFINITY : d;
    }
    return worst;
}

static int all_zero(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (x[i] != 0) return 0;
    return 1;
}

/* Adam's moments to start from: not zero, so the update's use of the old moments is exercised */
static void moments_fill(float *m1, float *m2, size_t n) {
    for (size_t i = 0; i < n; i++) {
        m1[i] = 1e-3f * sinf(0.37f * (float)i);
        m2[i] = 1e-6f * (1.5f + cosf(0.11f * (float)i));
    }
}

/* The device's state reset to params p0, moments m10 and m20, zero gradients; then one backward
 * of the reference batch at the given loss scale. */
static int reset_and_backward(gemma_cuda *g, gemma_model_f32 *m, const reference *r, const float *p0, const float *m10,
                              const float *m20, double scale, char *err, size_t n) {
    gemma_stats st = {0};
    memcpy(m->params, p0, m->param_count * sizeof(float));
    if (gemma_cuda_params_upload(g, m, err, n) || gemma_cuda_moments_upload(g, m10, m20, err, n) ||
        gemma_cuda_grads_zero(g, err, n))
        return -1;
    return gemma_cuda_backward_batch(g, m, r->seqs, r->B, scale, &st, err, n);
}

/* (1) One update on the device equals the host's on the downloaded gradients, for Adam and AdamW,
 * clipping active (the clip at half the norm) and inactive (at twice it), bias correction on and
 * off, from non-zero moments at update 3. Tolerance 1e-6 relative per entry of the params, m and
 * v: the device makes the host's double operations in the host's order and rounding (the host is
 * built with -ffp-contract=off, the device uses _rn intrinsics), so without clipping they should
 * agree to the bit; with clipping the scale comes from norms summed in different orders (agreeing
 * to ~1e-15), which can move a clipped f32 gradient by one ulp (6e-8) and m, v and the step by a
 * few: 1e-6 is about 16 ulp. The norms must agree to 1e-12 relative (double sums of one set of
 * squares). After the update the device's gradients are zero. */
static void test_optimizer_step(gemma_precision precision) {
    const char *pname = precision == PRECISION_F32 ? "f32" : "bf16";
    char err[1024] = "";
    gemma_model_f32 m;
    gemma_cuda *g;
    reference r;
    if (open_smoke(precision, &m, &g, &r, err, sizeof err) != 0) {
        check_fail("optimizer %s: %s", pname, err);
        return;
    }
    size_t n = m.param_count;
    float *p0 = malloc(n * sizeof(float)), *m10 = malloc(n * sizeof(float)), *m20 = malloc(n * sizeof(float));
    float *grads = malloc(n * sizeof(float)), *hp = malloc(n * sizeof(float)), *hm1 = malloc(n * sizeof(float));
    float *hm2 = malloc(n * sizeof(float)), *dp = malloc(n * sizeof(float)), *dm1 = malloc(n * sizeof(float));
    float *dm2 = malloc(n * sizeof(float));
    double scale = 1.0 / (double)r.targets;
    if (!p0 || !m10 || !m20 || !grads || !hp || !hm1 || !hm2 || !dp || !dm1 || !dm2) {
        check_fail("optimizer %s: out of memory", pname);
        goto done;
    }
    memcpy(p0, m.params, n * sizeof(float));
    moments_fill(m10, m20, n);
    for (int c = 0; c < 8; c++) {
        int adamw = c & 1, clipping = c >> 1 & 1, bias = c >> 2 & 1;
        char what[96];
        snprintf(what, sizeof what, "optimizer %s %s, clipping %s, bias correction %s", pname,
                 adamw ? "AdamW" : "Adam", clipping ? "active" : "inactive", bias ? "on" : "off");
        if (reset_and_backward(g, &m, &r, p0, m10, m20, scale, err, sizeof err) != 0 ||
            gemma_cuda_grads_download(g, grads, err, sizeof err) != 0) {
            check_fail("%s: %s", what, err);
            continue;
        }
        double norm = train_clip_grad_norm(grads, n, 0, 1); /* max_norm 0: measures only */
        train_options o;
        train_defaults(&o);
        o.lr = 2e-3, o.adamw = adamw, o.bias_correction = bias, o.weight_decay = 0.1;
        o.grad_clip = clipping ? 0.5 * norm : 2 * norm;
        gemma_cuda_adam a = {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.adamw, o.bias_correction, 3, o.grad_clip};
        double dnorm = 0;
        int nonfinite = -1;
        if (gemma_cuda_optimizer_step(g, &a, &dnorm, &nonfinite, err, sizeof err) != 0 ||
            gemma_cuda_params_download(g, &m, err, sizeof err) != 0 ||
            gemma_cuda_moments_download(g, dm1, dm2, err, sizeof err) != 0) {
            check_fail("%s: %s", what, err);
            continue;
        }
        memcpy(dp, m.params, n * sizeof(float));
        memcpy(hp, p0, n * sizeof(float));
        memcpy(hm1, m10, n * sizeof(float));
        memcpy(hm2, m20, n * sizeof(float));
        optimizer opt = {hm1, hm2, n, 2};
        double hnorm = train_clip_grad_norm(grads, n, o.grad_clip, 1);
        train_optimizer_update(&opt, hp, grads, &o, o.lr);
        size_t dif_p, dif_1, dif_2, moved;
        double ep = max_relative(dp, hp, n, &dif_p), e1 = max_relative(dm1, hm1, n, &dif_1);
        double e2 = max_relative(dm2, hm2, n, &dif_2);
        max_relative(hp, p0, n, &moved);
        double en = fabs(dnorm - hnorm) / hnorm;
        check(nonfinite == 0 && en <= 1e-12 && ep <= 1e-6 && e1 <= 1e-6 && e2 <= 1e-6 && moved > n / 2 && norm > 0,
              "%s: device vs host: norm %.3e (rel diff %.1e, tol 1e-12), params %.1e (%zu differ), m %.1e (%zu), "
              "v %.1e (%zu) of %zu (tol 1e-6); %zu params moved",
              what, dnorm, en, ep, dif_p, e1, dif_1, e2, dif_2, n, moved);
        if (gemma_cuda_grads_download(g, grads, err, sizeof err) != 0) check_fail("%s: %s", what, err);
        else check(all_zero(grads, n), "%s: the gradients are zero after the update", what);
    }
    /* the E copy the products use follows the update: a forward after a step gives the loss that
     * a fresh upload of the updated params gives, and not the loss before the step */
    {
        gemma_stats before = {0}, after = {0}, reuploaded = {0};
        gemma_cuda_adam a = {2e-3, 0.9, 0.999, 1e-8, 0, 0, 0, 1, 0};
        double dnorm;
        int nonfinite;
        int rc = reset_and_backward(g, &m, &r, p0, m10, m20, scale, err, sizeof err) ||
                 gemma_cuda_forward_batch(g, &m, r.seqs, r.B, &before, NULL, err, sizeof err) ||
                 gemma_cuda_optimizer_step(g, &a, &dnorm, &nonfinite, err, sizeof err) ||
                 gemma_cuda_forward_batch(g, &m, r.seqs, r.B, &after, NULL, err, sizeof err) ||
                 gemma_cuda_params_download(g, &m, err, sizeof err) ||
                 gemma_cuda_params_upload(g, &m, err, sizeof err) ||
                 gemma_cuda_forward_batch(g, &m, r.seqs, r.B, &reuploaded, NULL, err, sizeof err);
        if (rc) check_fail("optimizer %s: forward after a step: %s", pname, err);
        else
            check(after.loss_sum == reuploaded.loss_sum && after.loss_sum != before.loss_sum,
                  "optimizer %s: the loss after a step %.9g, after uploading the same params %.9g (equal), before "
                  "%.9g (different)", pname, after.loss_sum, reuploaded.loss_sum, before.loss_sum);
    }
done:
    free(p0), free(m10), free(m20), free(grads), free(hp), free(hm1), free(hm2), free(dp), free(dm1), free(dm2);
    reference_close(&r);
    gemma_cuda_close(g);
    gemma_model_free_f32(&m);
}

/* (2) The device's gradients accumulate: the batch's first record and then the rest, in two
 * backward calls at the whole batch's scale, equal one call over the whole batch (the trainer's
 * passes of a batch larger than the device, and its grad_accum batches, rely on it). f32 only: the
 * records are independent in a packed batch, so only the order of the f32 sums over tokens
 * differs; in bf16 cuBLAS may pick other algorithms for the other row counts and round the
 * activations differently. Tolerance 1e-5 of the largest gradient: f32 sums of a few hundred
 * terms. */
static void test_accumulation(void) {
    char err[1024] = "";
    gemma_model_f32 m;
    gemma_cuda *g;
    reference r;
    if (open_smoke(PRECISION_F32, &m, &g, &r, err, sizeof err) != 0) {
        check_fail("accumulation: %s", err);
        return;
    }
    size_t n = m.param_count;
    float *split = malloc(n * sizeof(float)), *whole = malloc(n * sizeof(float));
    double scale = 1.0 / (double)r.targets;
    gemma_stats s1 = {0}, s2 = {0};
    int rc = !split || !whole || r.B < 2;
    if (rc) snprintf(err, sizeof err, "out of memory, or a batch of one record");
    if (!rc)
        rc = gemma_cuda_grads_zero(g, err, sizeof err) ||
             gemma_cuda_backward_batch(g, &m, r.seqs, 1, scale, &s1, err, sizeof err) ||
             gemma_cuda_backward_batch(g, &m, r.seqs + 1, r.B - 1, scale, &s1, err, sizeof err) ||
             gemma_cuda_grads_download(g, split, err, sizeof err) || gemma_cuda_grads_zero(g, err, sizeof err) ||
             gemma_cuda_backward_batch(g, &m, r.seqs, r.B, scale, &s2, err, sizeof err) ||
             gemma_cuda_grads_download(g, whole, err, sizeof err);
    if (rc) {
        check_fail("accumulation: %s", err);
    } else {
        double worst = 0, largest = 0;
        for (size_t i = 0; i < n; i++) {
            worst = fmax(worst, fabs((double)split[i] - whole[i]));
            largest = fmax(largest, fabs((double)whole[i]));
        }
        double rel = largest > 0 ? worst / largest : INFINITY;
        check(rel <= 1e-5 && s1.tokens == s2.tokens && fabs(s1.loss_sum - s2.loss_sum) <= 1e-5 * fabs(s2.loss_sum),
              "accumulation: 1 + %d records in two backward calls vs %d in one: gradients differ by %.1e of the "
              "largest (tol 1e-5); targets %ld vs %ld, loss sums %.7g vs %.7g",
              r.B - 1, r.B, rel, s1.tokens, s2.tokens, s1.loss_sum, s2.loss_sum);
    }
    free(split), free(whole);
    reference_close(&r);
    gemma_cuda_close(g);
    gemma_model_free_f32(&m);
}

/* (3) A non-finite gradient (a NaN loss scale makes the gradients NaN) is found and refused by the
 * update, which leaves the params and moments as they were, to the bit; after zeroing, a finite
 * backward updates again. */
static void test_nonfinite_step(void) {
    char err[1024] = "";
    gemma_model_f32 m;
    gemma_cuda *g;
    reference r;
    if (open_smoke(PRECISION_BF16, &m, &g, &r, err, sizeof err) != 0) {
        check_fail("non-finite: %s", err);
        return;
    }
    size_t n = m.param_count, index = 0;
    float value = 0;
    float *p0 = malloc(n * sizeof(float)), *m10 = malloc(n * sizeof(float)), *m20 = malloc(n * sizeof(float));
    float *m1 = malloc(n * sizeof(float)), *m2 = malloc(n * sizeof(float));
    gemma_cuda_adam a = {1e-3, 0.9, 0.999, 1e-8, 0.01, 1, 1, 1, 1.0};
    double norm = 0;
    int nonfinite = -1, rc = !p0 || !m10 || !m20 || !m1 || !m2;
    if (rc) snprintf(err, sizeof err, "out of memory");
    if (!rc) {
        memcpy(p0, m.params, n * sizeof(float));
        moments_fill(m10, m20, n);
        rc = reset_and_backward(g, &m, &r, p0, m10, m20, NAN, err, sizeof err) ||
             gemma_cuda_grads_first_nonfinite(g, &index, &value, err, sizeof err) ||
             gemma_cuda_optimizer_step(g, &a, &norm, &nonfinite, err, sizeof err) ||
             gemma_cuda_params_download(g, &m, err, sizeof err) ||
             gemma_cuda_moments_download(g, m1, m2, err, sizeof err);
    }
    if (rc) {
        check_fail("non-finite: %s", err);
    } else {
        check(index < n && !isfinite(value), "non-finite: the first bad gradient is found (index %zu, %g)", index,
              value);
        check(nonfinite == 1 && !isfinite(norm) && !memcmp(m.params, p0, n * sizeof(float)) &&
                  !memcmp(m1, m10, n * sizeof(float)) && !memcmp(m2, m20, n * sizeof(float)),
              "non-finite: the update refuses (norm %g, flag %d) and leaves params and moments unchanged", norm,
              nonfinite);
        rc = reset_and_backward(g, &m, &r, p0, m10, m20, 1.0 / (double)r.targets, err, sizeof err) ||
             gemma_cuda_grads_first_nonfinite(g, &index, &value, err, sizeof err) ||
             gemma_cuda_optimizer_step(g, &a, &norm, &nonfinite, err, sizeof err) ||
             gemma_cuda_params_download(g, &m, err, sizeof err);
        if (rc) check_fail("non-finite: then a finite step: %s", err);
        else
            check(index == SIZE_MAX && nonfinite == 0 && isfinite(norm) && memcmp(m.params, p0, n * sizeof(float)),
                  "non-finite: then a finite gradient updates (norm %g)", norm);
    }
    free(p0), free(m10), free(m20), free(m1), free(m2);
    reference_close(&r);
    gemma_cuda_close(g);
    gemma_model_free_f32(&m);
}

/* (4) The layer inputs' trip through page-locked host memory. The backward keeps each layer's
 * input (but the last) on the host: the forward copies it down on a second stream while the next
 * layer runs, the backward copies it up while the layer above runs its backward, with events
 * ordering each copy against the computation that writes or reads the device buffer. The copies
 * move the same bits, so a step must give the same loss and LoRA gradients, bit for bit, every
 * time it runs (winattn's deterministic backward makes every kernel repeatable). gemma4_tiny (12
 * layers, 11 of their inputs through the host) with its reference records repeated to a packed
 * batch A of 8 × 381 tokens (copies of 0.4 MB in bf16, 0.8 MB in f32: long enough beside a
 * layer's kernels for a missing or misplaced wait to show): A, then a batch B of the records
 * in reverse order repeated 16 times (other values at every position, twice the tokens, so the
 * host memory grows: a new allocation between the two runs of A), then A again; the two runs of A
 * must agree to the bit, and their gradients must not be zero. A copy read before it lands
 * (the backward reads the device buffer while its input is still coming up) gives the previous
 * contents of that buffer, an input copied down after the next layer overwrote its buffer, or
 * one never copied, gives another layer's values or those B (or the fresh allocation) left in
 * host memory; with the ordering timing-dependent, the runs differ. A copy that is consistently
 * wrong the same way is caught by the fixtures' comparisons with the CPU above, which run through
 * the same path. */
static void test_layer_inputs_offload(gemma_precision precision) {
    const char *pname = precision == PRECISION_F32 ? "f32" : "bf16";
    enum { REPEAT = 8 };
    char err[1024] = "";
    gemma_model_f32 m;
    gemma_cuda *g;
    reference r;
    if (open_fixture("gemma4_tiny", precision, 1, &m, &g, &r, err, sizeof err) != 0) {
        check_fail("layer inputs on the host %s: %s", pname, err);
        return;
    }
    size_t n = m.param_count;
    int na = r.B * REPEAT, nb = 2 * na;
    gemma_seq *a = malloc((size_t)na * sizeof *a), *b = malloc((size_t)nb * sizeof *b);
    float *first = malloc(n * sizeof(float)), *again = malloc(n * sizeof(float));
    gemma_stats s1 = {0}, sb = {0}, s2 = {0};
    int rc = !a || !b || !first || !again;
    if (rc) snprintf(err, sizeof err, "out of memory");
    if (!rc) {
        for (int i = 0; i < na; i++) a[i] = r.seqs[i % r.B];
        for (int i = 0; i < nb; i++) b[i] = r.seqs[r.B - 1 - i % r.B];
        double scale = 1.0 / ((double)r.targets * REPEAT);
        rc = gemma_cuda_grads_zero(g, err, sizeof err) ||
             gemma_cuda_backward_batch(g, &m, a, na, scale, &s1, err, sizeof err) ||
             gemma_cuda_grads_download(g, first, err, sizeof err) || gemma_cuda_grads_zero(g, err, sizeof err) ||
             gemma_cuda_backward_batch(g, &m, b, nb, scale, &sb, err, sizeof err) ||
             gemma_cuda_grads_zero(g, err, sizeof err) ||
             gemma_cuda_backward_batch(g, &m, a, na, scale, &s2, err, sizeof err) ||
             gemma_cuda_grads_download(g, again, err, sizeof err);
    }
    if (rc) {
        check_fail("layer inputs on the host %s: %s", pname, err);
    } else {
        const char *where = gemma_cuda_layer_inputs(g);
        double gb = 0;
        long held = 0, b_tokens = 2L * REPEAT * packed_rows(&r);
        size_t differ = 0;
        for (size_t i = 0; i < n; i++) differ += memcmp(&first[i], &again[i], sizeof(float)) != 0;
        check(sscanf(where, "layer inputs in page-locked host memory (%lf GB for %ld tokens)", &gb, &held) == 2 &&
                  held >= b_tokens,
              "layer inputs on the host %s: \"%s\" (at least the %ld tokens of B)", pname, where, b_tokens);
        check(differ == 0 && memcmp(&s1.loss_sum, &s2.loss_sum, sizeof s1.loss_sum) == 0 && s1.tokens == s2.tokens &&
                  !all_zero(first, n),
              "layer inputs on the host %s: %d records packed, twice around a batch of %d: loss sums %.17g and "
              "%.17g (equal to the bit), %zu of %zu gradients differ (0), the gradients not all zero",
              pname, na, nb, s1.loss_sum, s2.loss_sum, differ, n);
    }
    free(a), free(b), free(first), free(again);
    reference_close(&r);
    gemma_cuda_close(g);
    gemma_model_free_f32(&m);
}

/* WINATTN_TRAIN_PROFILE=1: the phases of the calls since the last take (gemma_cuda_profile_take, the
 * trainer's log.jsonl fields), with the products' operations counted exactly. LoRA on all seven
 * projections, so that the slots give every frozen projection's [in, out]: a forward + backward
 * forms each frozen product three times over its T packed tokens (the forward sweep, the layer's
 * recomputation, the input gradient), 6·T·Σ in·out, the head's two 4·T·vocab·hidden, each
 * adapter's eight 8·T·r·(in + out) (twice x·A and (x·A)·B, then dB, d(x·A), dA and dx); a forward
 * alone a third of the frozen products and half of the head's. */
static void test_profile(void) {
    char err[1024] = "", dir[1024], path[1100];
    lora_config lc;
    gemma_model_f32 m;
    gemma_cuda *g = NULL;
    reference r;
    snprintf(dir, sizeof dir, "%s/gemma4_tiny", fixtures);
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    if (adapter_config_load(path, 1 << 20, &lc, err, sizeof err) != 0) {
        check_fail("profile: %s", err);
        return;
    }
    lc.proj_mask = (1u << PROJ_COUNT) - 1;
    if (gemma_model_layout_f32(&m, dir, &lc, err, sizeof err) != 0) {
        check_fail("profile: %s", err);
        return;
    }
    gemma_cuda_options o = {PRECISION_BF16, 0, 0, 0, 0, BASE_BF16};
    setenv("WINATTN_TRAIN_PROFILE", "1", 1); /* read when the model opens */
    int rc = gemma_cuda_open(&m, dir, &o, &g, err, sizeof err);
    unsetenv("WINATTN_TRAIN_PROFILE");
    if (rc != 0 || reference_open(&r, dir) != 0) {
        check_fail("profile: %s", rc ? err : "the reference batch cannot be read");
        gemma_cuda_close(g);
        gemma_model_free_f32(&m);
        return;
    }
    const gemma_config *c = &m.cfg;
    double T = (double)packed_rows(&r), frozen = 0, adapters = 0;
    for (int i = 0; i < m.slot_count; i++) {
        frozen += (double)m.slots[i].in * m.slots[i].out;
        adapters += (double)m.lora.rank * (m.slots[i].in + m.slots[i].out);
    }
    double head = 2 * T * c->vocab * c->hidden;
    gemma_cuda_profile none, step, fwd, after;
    int took_none = gemma_cuda_profile_take(g, &none);
    gemma_stats st = {0}, sf = {0};
    gemma_cuda_adam a = {1e-3, 0.9, 0.999, 1e-8, 0, 0, 1, 1, 0};
    double norm = 0;
    int nonfinite = 0;
    float *logits = malloc((size_t)packed_rows(&r) * c->vocab * sizeof(float));
    rc = !logits || gemma_cuda_grads_zero(g, err, sizeof err) ||
         gemma_cuda_backward_batch(g, &m, r.seqs, r.B, 1.0 / (double)r.targets, &st, err, sizeof err) ||
         gemma_cuda_optimizer_step(g, &a, &norm, &nonfinite, err, sizeof err);
    int took_step = rc ? 0 : gemma_cuda_profile_take(g, &step);
    rc = rc || gemma_cuda_forward_batch(g, &m, r.seqs, r.B, &sf, logits, err, sizeof err);
    int took_fwd = rc ? 0 : gemma_cuda_profile_take(g, &fwd);
    int took_after = gemma_cuda_profile_take(g, &after);
    if (rc) {
        check_fail("profile: %s", logits ? err : "out of memory");
    } else {
        check(took_none == 0 && none.passes == 0 && took_after == 0 && after.passes == 0 && after.ms[0] == 0,
              "profile: nothing before the first call nor after a take (%d, %d passes; %d, %d)", took_none,
              none.passes, took_after, after.passes);
        check(took_step && step.passes == 2 && step.tokens == (long)T,
              "profile: a forward + backward and an update are 2 passes over %.0f tokens (%d, %d, %ld)", T, took_step,
              step.passes, step.tokens);
        int timed = 1;
        for (int p = 0; p < GEMMA_PHASES; p++)
            timed &= p == GEMMA_PHASE_FP8_QUANT || p == GEMMA_PHASE_COPY_WAITS ? step.ms[p] >= 0 : step.ms[p] > 0;
        check(timed && step.ms[GEMMA_PHASE_FP8_QUANT] == 0,
              "profile: every phase of a bf16 step took time, FP8 quantization none (products %.3f, LoRA %.3f, "
              "attention %.3f, elementwise %.3f, head %.3f, FP8 %.3f, copies %.3f, optimizer %.3f ms)",
              step.ms[0], step.ms[1], step.ms[2], step.ms[3], step.ms[4], step.ms[5], step.ms[6], step.ms[7]);
        check(step.flop[GEMMA_PHASE_PRODUCTS] == 6 * T * frozen && step.flop[GEMMA_PHASE_HEAD] == 2 * head &&
                  step.flop[GEMMA_PHASE_LORA] == 8 * T * adapters && step.flop[GEMMA_PHASE_ATTENTION] == 0,
              "profile: the step's operations: products %.0f (6·T·Σ in·out %.0f), head %.0f (%.0f), LoRA %.0f "
              "(%.0f), attention %.0f (0: winattn's own)",
              step.flop[0], 6 * T * frozen, step.flop[4], 2 * head, step.flop[1], 8 * T * adapters, step.flop[2]);
        check(took_fwd && fwd.passes == 1 && fwd.flop[GEMMA_PHASE_PRODUCTS] == 2 * T * frozen &&
                  fwd.flop[GEMMA_PHASE_HEAD] == head && fwd.flop[GEMMA_PHASE_LORA] == 2 * T * adapters &&
                  fwd.ms[GEMMA_PHASE_OPTIMIZER] == 0,
              "profile: a forward alone: %d pass, products %.0f (%.0f), head %.0f (%.0f), LoRA %.0f (%.0f)",
              fwd.passes, fwd.flop[0], 2 * T * frozen, fwd.flop[4], head, fwd.flop[1], 2 * T * adapters);
    }
    free(logits);
    reference_close(&r);
    gemma_cuda_close(g);
    gemma_model_free_f32(&m);
}

/* ---------------------------------------------------------------------------------------------
 * Quantizing at load on the device (gemma_cuda_quantize runs the loader's own functions) against
 * train/quant.c byte for byte, on tensors of awkward shapes and values; and a value that cannot be
 * quantized refused in the CPU's line. */

/* a [rows, cols] tensor as a checkpoint stores it, and its values as the loader widens them */
typedef struct qtensor {
    st_tensor t;
    unsigned char *bytes;
    float *values;
    long rows, cols;
} qtensor;

static size_t dtype_bytes(st_dtype d) { return d == ST_F64 ? 8 : d == ST_F32 ? 4 : 2; }

static void qtensor_init(qtensor *q, st_dtype dtype, long rows, long cols) {
    memset(q, 0, sizeof *q);
    q->rows = rows, q->cols = cols;
    q->values = calloc((size_t)(rows * cols), sizeof(float));
    q->bytes = calloc((size_t)(rows * cols), dtype_bytes(dtype));
    q->t.name = "quantized";
    q->t.dtype = dtype, q->t.rank = 2, q->t.shape[0] = rows, q->t.shape[1] = cols;
    q->t.end = (uint64_t)(rows * cols) * dtype_bytes(dtype);
    q->t.data = q->bytes;
}

static void qtensor_free(qtensor *q) {
    free(q->values);
    free(q->bytes);
}

/* values rounded to the dtype (to nearest, ties to even) and written as its bytes */
static void qtensor_store(qtensor *q) {
    for (long i = 0; i < q->rows * q->cols; i++) {
        float v = q->values[i];
        if (q->t.dtype == ST_F64) {
            double d = v;
            memcpy(q->bytes + 8 * i, &d, 8);
        } else if (q->t.dtype == ST_F32) {
            memcpy(q->bytes + 4 * i, &v, 4);
        } else {
            uint16_t h = q->t.dtype == ST_F16 ? wa_f32_to_f16(v) : wa_f32_to_bf16(v);
            memcpy(q->bytes + 2 * i, &h, 2);
            q->values[i] = q->t.dtype == ST_F16 ? wa_f16_to_f32(h) : wa_bf16_to_f32(h);
        }
    }
}

/* a normal value (Box-Muller on a 64-bit xorshift; the test's inputs only need to be varied) */
static double normal(uint64_t *state) {
    double u[2];
    for (int k = 0; k < 2; k++) {
        *state ^= *state << 13, *state ^= *state >> 7, *state ^= *state << 17;
        u[k] = ((double)(*state >> 11) + 0.5) / 9007199254740992.0;
    }
    return sqrt(-2 * log(u[0])) * cos(2 * M_PI * u[1]);
}

/* row r: normal values times a magnitude that changes from row to row (10^-4 .. 10^3) */
static void fill_rows(qtensor *q, uint64_t *rng) {
    for (long r = 0; r < q->rows; r++) {
        float scale = powf(10.0f, (float)(r % 8) - 4.0f);
        for (long j = 0; j < q->cols; j++) q->values[r * q->cols + j] = (float)normal(rng) * scale;
    }
}

/* The host's packed form of q, laid out as gemma_cuda_quantize returns it (model_cuda.h), made with
 * train/quant.c's functions as model.c's loader quantizes: 0, or -1 with the quantizer's message. */
static int host_pack(base_dtype base, const qtensor *q, gemma_cuda_packed *out, char *why, size_t n) {
    long count = q->rows * q->cols;
    float *w = malloc((size_t)count * sizeof(float));
    memcpy(w, q->values, (size_t)count * sizeof(float));
    memset(out, 0, sizeof *out);
    int rc = 0;
    if (base == BASE_MLX4) {
        st_dtype storage = q->t.dtype;
        if ((rc = mlx4_round_trip(w, q->rows, q->cols, storage, why, n)) == 0) {
            memcpy(w, q->values, (size_t)count * sizeof(float));
            int half = storage == ST_F16 || storage == ST_BF16;
            long groups = count / MLX4_GROUP;
            uint32_t *words = calloc((size_t)count / 8, sizeof(uint32_t));
            out->count = 3;
            out->bytes[0] = (size_t)count / 8 * 4, out->bytes[1] = out->bytes[2] = (size_t)groups * (half ? 2 : 4);
            out->part[1] = malloc(out->bytes[1]), out->part[2] = malloc(out->bytes[2]);
            for (long gi = 0; gi < groups; gi++) {
                uint8_t codes[MLX4_GROUP];
                float scale, bias;
                mlx4_quantize_group(w + gi * MLX4_GROUP, storage, codes, &scale, &bias);
                for (long j = 0; j < MLX4_GROUP; j++) {
                    long i = gi * MLX4_GROUP + j;
                    words[i / 8] |= (uint32_t)codes[j] << (4 * (i % 8));
                }
                if (!half) {
                    memcpy(out->part[1] + 4 * gi, &scale, 4), memcpy(out->part[2] + 4 * gi, &bias, 4);
                } else {
                    uint16_t s = storage == ST_F16 ? wa_f32_to_f16(scale) : wa_f32_to_bf16(scale);
                    uint16_t b = storage == ST_F16 ? wa_f32_to_f16(bias) : wa_f32_to_bf16(bias);
                    memcpy(out->part[1] + 2 * gi, &s, 2), memcpy(out->part[2] + 2 * gi, &b, 2);
                }
            }
            out->part[0] = (unsigned char *)words; /* little-endian, as the device's bytes */
        }
    } else if (base == BASE_NF4) {
        nf4_quantized nq;
        if ((rc = nf4_quantize(w, count, 1, &nq, why, n)) == 0) {
            out->count = 3;
            out->bytes[0] = (size_t)(count + 1) / 2, out->bytes[1] = (size_t)nq.blocks;
            out->bytes[2] = (size_t)nq.nested_blocks * sizeof(float);
            out->part[0] = calloc(out->bytes[0], 1);
            for (long i = 0; i < count; i++) out->part[0][i / 2] |= (uint8_t)(i % 2 ? nq.codes[i] : nq.codes[i] << 4);
            out->part[1] = malloc(out->bytes[1]), out->part[2] = malloc(out->bytes[2]);
            memcpy(out->part[1], nq.absmax_codes, out->bytes[1]);
            memcpy(out->part[2], nq.nested_absmax, out->bytes[2]);
            out->offset = nq.offset;
        }
        nf4_quantized_free(&nq);
    } else {
        out->count = 2;
        out->bytes[0] = (size_t)count, out->bytes[1] = (size_t)q->rows * sizeof(float);
        out->part[0] = malloc(out->bytes[0]), out->part[1] = malloc(out->bytes[1]);
        rc = fp8_round_trip(w, q->rows, q->cols, (float *)out->part[1], out->part[0], why, n);
    }
    free(w);
    if (rc) gemma_cuda_packed_free(out);
    return rc;
}

/* the device's packed form of q equal to the host's, part by part, byte for byte */
static void test_device_pack(const char *what, base_dtype base, qtensor *q) {
    gemma_cuda_packed dev, host;
    char err[1024], why[512];
    if (host_pack(base, q, &host, why, sizeof why) != 0) {
        check_fail("device quantization %s: the host refuses it: %s", what, why);
        return;
    }
    if (gemma_cuda_quantize(base, &q->t, "quantized", &dev, err, sizeof err) != 0) {
        check_fail("device quantization %s: %s", what, err);
        gemma_cuda_packed_free(&host);
        return;
    }
    char detail[300] = "";
    int ok = dev.count == host.count && memcmp(&dev.offset, &host.offset, sizeof(float)) == 0;
    if (!ok) snprintf(detail, sizeof detail, " (parts %d vs %d, offset %a vs %a)", dev.count, host.count,
                      (double)dev.offset, (double)host.offset);
    for (int k = 0; ok && k < host.count; k++) {
        if (dev.bytes[k] != host.bytes[k]) {
            ok = 0;
            snprintf(detail, sizeof detail, " (part %d: %zu bytes vs %zu)", k, dev.bytes[k], host.bytes[k]);
            break;
        }
        for (size_t i = 0; i < host.bytes[k]; i++)
            if (dev.part[k][i] != host.part[k][i]) {
                ok = 0;
                snprintf(detail, sizeof detail, " (part %d differs first at byte %zu: 0x%02x vs 0x%02x)", k, i,
                         dev.part[k][i], host.part[k][i]);
                break;
            }
    }
    check(ok, "device quantization %s [%ld, %ld] %s: %d parts (%zu, %zu, %zu bytes) equal to train/quant.c's%s",
          what, q->rows, q->cols, st_dtype_name(q->t.dtype), host.count, host.bytes[0], host.bytes[1],
          host.bytes[2], detail);
    gemma_cuda_packed_free(&dev);
    gemma_cuda_packed_free(&host);
}

/* the device refuses q with exactly `expected` */
static void test_device_refusal(const char *what, base_dtype base, qtensor *q, const char *expected) {
    gemma_cuda_packed dev;
    char err[1024] = "";
    int rc = gemma_cuda_quantize(base, &q->t, "quantized", &dev, err, sizeof err);
    if (rc == 0) gemma_cuda_packed_free(&dev);
    check(rc != 0 && strcmp(err, expected) == 0, "device quantization %s: refused as \"%s\": \"%s\"", what, expected,
          err);
}

/* the CPU loader's line for a non-finite value in a tensor as stored (model.c) */
static void stored_refusal(const qtensor *q, char *out, size_t n) {
    uint64_t bad = 0;
    if (!st_tensor_first_nonfinite(&q->t, &bad)) {
        snprintf(out, n, "(no non-finite value)");
        return;
    }
    snprintf(out, n, "tensor \"quantized\" holds a non-finite value (%s) at element %llu",
             st_tensor_value_kind(&q->t, bad), (unsigned long long)bad);
}

/* q (its values stored first) refused by the device in the CPU loader's line for a stored value */
static void expect_stored_refusal(const char *what, base_dtype base, qtensor *q) {
    char expected[1024];
    qtensor_store(q);
    stored_refusal(q, expected, sizeof expected);
    test_device_refusal(what, base, q, expected);
}

/* q refused by the device in the host quantizer's own line; a host that quantizes q is a failure
 * (`host_accepts` names what it took) */
static void expect_quantizer_refusal(const char *what, base_dtype base, qtensor *q, const char *host_accepts) {
    char expected[1024], why[512];
    gemma_cuda_packed none;
    if (host_pack(base, q, &none, why, sizeof why) == 0) {
        gemma_cuda_packed_free(&none);
        check_fail("device quantization %s: the host %s", base_dtype_name(base), host_accepts);
        return;
    }
    snprintf(expected, sizeof expected, "tensor \"quantized\": %s", why);
    test_device_refusal(what, base, q, expected);
}

/* mlx4 groups that take every branch of mlx4_quantize_group: zeros, a constant, values on halves
 * of the step (rint's ties), negative values only, subnormals, a range past FLT_MAX (an infinite
 * scale) and a constant so large that its scale rounds to zero (codes of 0 / 0) */
static void mlx4_special_groups(qtensor *q) {
    float *v = q->values;
    long g = q->rows * q->cols / MLX4_GROUP;
    for (long j = 0; j < MLX4_GROUP && g > 0; j++) v[j] = 0;
    for (long j = 0; j < MLX4_GROUP && g > 1; j++) v[64 + j] = 0.3f;
    for (long j = 0; j < MLX4_GROUP && g > 2; j++) v[128 + j] = j == 0 ? 0.0f : j == 1 ? 15.0f : (float)(j % 15) + 0.5f;
    for (long j = 0; j < MLX4_GROUP && g > 3; j++) v[192 + j] = -fabsf(v[192 + j]) - 0.25f;
    for (long j = 0; j < MLX4_GROUP && g > 4; j++) v[256 + j] = (float)(j % 7) * 1e-39f - 3e-39f;
    if (q->t.dtype == ST_F16) return; /* f16 holds neither 3e38 nor 1e-39 */
    for (long j = 0; j < MLX4_GROUP && g > 5; j++) v[320 + j] = j == 0 ? 3e38f : j == 1 ? -3e38f : (float)j * 1e36f;
    for (long j = 0; j < MLX4_GROUP && g > 6; j++) v[384 + j] = 3e38f;
}

/* nf4 blocks at NF4's midpoints (absmax 1: s is the value itself; a value on a midpoint takes the
 * lower code), the floats beside them, ±1, and a block of subnormals; from flat index at */
static void nf4_special_block(qtensor *q, long at) {
    float *v = q->values + at;
    long room = q->rows * q->cols - at;
    for (long j = 0; j < room && j < NF4_BLOCK; j++) {
        int i = (int)(j / 3) % 15;
        float mid = (NF4_CODE[i] + NF4_CODE[i + 1]) / 2;
        float beside = nextafterf(mid, j % 3 == 1 ? 2.0f : -2.0f);
        v[j] = j == 0 ? 1.0f : j == 1 ? -1.0f : j % 3 == 0 ? mid : beside;
    }
}

/* fp8: amax 448 (scale 1), so each value is its own e4m3 argument: ±448 and every midpoint between
 * two neighbouring codes (ties to even), both signs, from flat index at (room for 254) */
static void fp8_midpoint_row(qtensor *q, long at) {
    float *v = q->values + at;
    v[0] = FP8_E4M3_MAX, v[253] = -FP8_E4M3_MAX;
    for (int c = 0; c < 126; c++) {
        float mid = (fp8_e4m3_decode((uint8_t)c) + fp8_e4m3_decode((uint8_t)(c + 1))) / 2;
        v[1 + 2 * c] = mid, v[2 + 2 * c] = -mid;
    }
}

static void test_device_quantization(void) {
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    qtensor q;
    /* mlx4: f32, bf16, f16 and f64 storage (the scales and biases in that dtype; f32 for f64) */
    const struct { st_dtype d; long rows, cols; } mlx[] = {
        {ST_F32, 37, 192}, {ST_BF16, 5, 320}, {ST_F16, 3, 448}, {ST_F64, 2, 128}, {ST_BF16, 1, 64}};
    for (size_t k = 0; k < sizeof mlx / sizeof *mlx; k++) {
        qtensor_init(&q, mlx[k].d, mlx[k].rows, mlx[k].cols);
        fill_rows(&q, &rng);
        if (mlx[k].d == ST_F16)
            for (long i = 0; i < q.rows * q.cols; i++) q.values[i] = fminf(fmaxf(q.values[i], -6e4f), 6e4f);
        mlx4_special_groups(&q);
        qtensor_store(&q);
        test_device_pack("mlx4", BASE_MLX4, &q);
        qtensor_free(&q);
    }
    /* nf4: n odd, not a multiple of 64 or of 256 blocks; one value; several nested blocks with a
     * short last one; all zeros (absmax and offset 0) */
    const struct { st_dtype d; long rows, cols; } nf4[] = {{ST_F32, 13, 97},    {ST_F32, 1, 1},   {ST_BF16, 31, 4099},
                                                            {ST_F16, 129, 515}, {ST_F64, 3, 333}, {ST_F32, 64, 300}};
    for (size_t k = 0; k < sizeof nf4 / sizeof *nf4; k++) {
        qtensor_init(&q, nf4[k].d, nf4[k].rows, nf4[k].cols);
        long n = q.rows * q.cols;
        if (k != 5) {
            fill_rows(&q, &rng);
            if (nf4[k].d == ST_F16)
                for (long i = 0; i < n; i++) q.values[i] = fminf(fmaxf(q.values[i], -6e4f), 6e4f);
            nf4_special_block(&q, 0);
            nf4_special_block(&q, (n - 1) / NF4_BLOCK * NF4_BLOCK); /* the short last block divides */
            if (n > 3 * NF4_BLOCK) {
                for (long j = 0; j < NF4_BLOCK; j++) q.values[NF4_BLOCK + j] = 0; /* an all-zero block */
                if (nf4[k].d != ST_F16)
                    for (long j = 0; j < NF4_BLOCK; j++) q.values[2 * NF4_BLOCK + j] = (float)(j - 30) * 1e-40f;
            }
        }
        qtensor_store(&q);
        test_device_pack("nf4", BASE_NF4, &q);
        qtensor_free(&q);
    }
    /* fp8: a zero row (scale 1), a row of e4m3 midpoints, subnormal rows, values near FLT_MAX */
    const struct { st_dtype d; long rows, cols; } fp8[] = {
        {ST_F32, 17, 333}, {ST_BF16, 9, 1000}, {ST_F16, 4, 300}, {ST_F64, 3, 70}, {ST_F32, 1, 1}};
    for (size_t k = 0; k < sizeof fp8 / sizeof *fp8; k++) {
        qtensor_init(&q, fp8[k].d, fp8[k].rows, fp8[k].cols);
        fill_rows(&q, &rng);
        long c = q.cols;
        if (fp8[k].d == ST_F16)
            for (long i = 0; i < q.rows * c; i++) q.values[i] = fminf(fmaxf(q.values[i], -6e4f), 6e4f);
        if (q.rows > 1) memset(q.values, 0, (size_t)c * sizeof(float));
        if (q.rows > 2 && c >= 254) fp8_midpoint_row(&q, c);
        if (q.rows > 2 && fp8[k].d != ST_F16)
            for (long j = 0; j < c; j++) q.values[2 * c + j] = (float)(j % 11 - 5) * 1e-40f;
        if (q.rows > 3 && fp8[k].d != ST_F16)
            for (long j = 0; j < c; j++) q.values[3 * c + j] = j % 2 ? 3.3e38f : -(float)(j % 300) * 1e36f;
        qtensor_store(&q);
        test_device_pack("fp8", BASE_FP8, &q);
        qtensor_free(&q);
    }
    /* refusals: a non-finite value as stored (the loader's line, first index), one that only
     * widening F64 makes (the quantizer's), and mlx4 rows that groups of 64 do not cut */
    const base_dtype bases[3] = {BASE_MLX4, BASE_NF4, BASE_FP8};
    for (int b = 0; b < 3; b++) {
        const char *name = base_dtype_name(bases[b]);
        char what[100];
        qtensor_init(&q, ST_F32, 4, 128);
        fill_rows(&q, &rng);
        q.values[300] = -INFINITY, q.values[130] = NAN;
        snprintf(what, sizeof what, "%s, NaN at 130 and -inf at 300 (f32)", name);
        expect_stored_refusal(what, bases[b], &q);
        qtensor_free(&q);

        qtensor_init(&q, ST_BF16, 3, 192);
        fill_rows(&q, &rng);
        q.values[77] = INFINITY;
        snprintf(what, sizeof what, "%s, inf at 77 (bf16)", name);
        expect_stored_refusal(what, bases[b], &q);
        qtensor_free(&q);

        qtensor_init(&q, ST_F64, 2, 128);
        fill_rows(&q, &rng);
        qtensor_store(&q);
        double huge = 1e300;
        memcpy(q.bytes + 8 * 99, &huge, 8);
        q.values[99] = (float)huge;
        snprintf(what, sizeof what, "%s, 1e300 at 99 (f64, inf in f32)", name);
        expect_quantizer_refusal(what, bases[b], &q, "quantizes an infinite value");
        qtensor_free(&q);
    }
    qtensor_init(&q, ST_F32, 3, 32);
    fill_rows(&q, &rng);
    qtensor_store(&q);
    expect_quantizer_refusal("mlx4, rows of 32", BASE_MLX4, &q, "groups rows of 32");
    q.values[40] = NAN;
    expect_stored_refusal("mlx4, rows of 32 with a NaN (the NaN first, as the CPU loader)", BASE_MLX4, &q);
    qtensor_free(&q);
}

/* --init-random on a quantized base: each projection drawn on the device and quantized there (no
 * checkpoint read). The draws are the bf16 base's, so the loss of gemma4_tiny's reference batch must
 * be finite and near the bf16 base's (its random weights give logits near 0 either way: this holds
 * the load to running and to finite values, the bytes are held to train/quant.c above). */
static int random_init_loss(const char *dir, const lora_config *lc, const reference *r, gemma_precision p,
                            base_dtype base, double *loss, char *err, size_t n) {
    gemma_model_f32 m;
    if (gemma_model_layout_f32(&m, dir, lc, err, n) != 0) return -1;
    gemma_cuda *g = NULL;
    gemma_cuda_options o = {p, 1, 1234, 0, 0, base};
    gemma_stats st = {0};
    int rc = gemma_cuda_open(&m, dir, &o, &g, err, n) ||
             gemma_cuda_forward_batch(g, &m, r->seqs, r->B, &st, NULL, err, n);
    if (!rc) *loss = st.loss_sum / (double)st.tokens;
    gemma_cuda_close(g);
    gemma_model_free_f32(&m);
    return rc ? -1 : 0;
}

static void test_random_init_quantized(void) {
    char dir[1024], path[1100], err[1024] = "";
    snprintf(dir, sizeof dir, "%s/gemma4_tiny", fixtures);
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    lora_config lc;
    reference r;
    if (adapter_config_load(path, 1 << 20, &lc, err, sizeof err) != 0) {
        check_fail("random init: %s", err);
        return;
    }
    if (reference_open(&r, dir) != 0) return;
    for (int k = 0; k < 2; k++) {
        gemma_precision p = k ? PRECISION_BF16 : PRECISION_F32;
        double plain;
        if (random_init_loss(dir, &lc, &r, p, BASE_BF16, &plain, err, sizeof err) != 0) {
            check_fail("random init %s, bf16 base: %s", k ? "bf16" : "f32", err);
            continue;
        }
        const base_dtype bases[3] = {BASE_MLX4, BASE_NF4, BASE_FP8};
        for (int b = 0; b < 3; b++) {
            double loss;
            if (random_init_loss(dir, &lc, &r, p, bases[b], &loss, err, sizeof err) != 0) {
                check_fail("random init %s, %s base: %s", k ? "bf16" : "f32", base_dtype_name(bases[b]), err);
                continue;
            }
            check(isfinite(loss) && fabs(loss - plain) <= 0.05 * plain,
                  "random init %s, %s base quantized on the device: loss %.6g, the bf16 base's %.6g",
                  k ? "bf16" : "f32", base_dtype_name(bases[b]), loss, plain);
        }
    }
    reference_close(&r);
}

int main(int argc, char **argv) {
    if (argc > 1) fixtures = argv[1];
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!wa_device_available(WA_DEVICE_CUDA)) {
        check_skip("test_train_cuda: no CUDA device (or a build without nvcc)");
        return check_summary();
    }
    test_device_quantization();
    test_random_init_quantized();
    test_fp8_products();
    test_residual_kernels();
    test_qkv_heads();
    test_fixture("gemma4_smoke");
    test_fixture("gemma4_tiny");
    test_fixture("gemma3_tiny");
    test_refusals();
    test_optimizer_step(PRECISION_F32);
    test_optimizer_step(PRECISION_BF16);
    test_accumulation();
    test_nonfinite_step();
    test_layer_inputs_offload(PRECISION_F32);
    test_layer_inputs_offload(PRECISION_BF16);
    test_profile();
    return check_summary();
}

/* model.c — the Gemma text model with LoRA (model.h), compiled twice: as float (the trainer)
 * and with -DMODEL_F64 as double (finite-difference and fixture tests). Read top to bottom:
 * loading, the elementwise ops with their backwards, the LoRA linear, the three attention arms,
 * one decoder layer forward and backward, the head (final norm, tied logits, softcap, cross-
 * entropy), and the drivers with per-layer recomputation. A batch runs packed (model.h): rows of
 * every record end to end; RoPE positions and attention follow the records. */
#define _GNU_SOURCE
#include "model.h"

#include "convert.h"
#include "linalg.h"
#include "quant.h"
#include "rng.h"

#include <jansson.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MODEL_F64
#define REAL double
#define MT(name) name##_f64
#define mm mm_f64
#define REAL_IS_FLOAT 0
#define rtanh tanh
#define rexp exp
#else
#define REAL float
#define MT(name) name##_f32
#define mm mm_f32
#define REAL_IS_FLOAT 1
/* the transcendental functions in the model's own precision, as a float framework computes them */
#define rtanh tanhf
#define rexp expf
#endif
typedef REAL real;
typedef MT(gemma_model) model;
typedef MT(gemma_layer) layer;

/* Things both precisions share are defined once, in the float object. */
#ifndef MODEL_F64
const char *const gemma_proj_path[PROJ_COUNT] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                 "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                                 "mlp.down_proj"};
const char *const gemma_proj_short[PROJ_COUNT] = {"q", "k", "v", "o", "gate", "up", "down"};

const char *attn_arm_name(attn_arm arm) {
    return arm == ATTN_FUSED ? "fused" : arm == ATTN_DENSE ? "dense" : arm == ATTN_CHUNKED ? "chunked" : "?";
}
#endif

static int set_err(model *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int set_err(model *m, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m->err, sizeof m->err, fmt, ap);
    va_end(ap);
    return -1;
}

/* ---------------------------------------------------------------------------------------------
 * Loading: first a plan of every tensor the config implies (name, shape, destination), then one
 * allocation, then each tensor checked and converted. */

typedef struct tensor_plan {
    char name[128];
    int rank;          /* 1 or 2; 0 = a scalar stored as [] or [1] */
    int64_t rows, cols;
    const real **dst;  /* where the pointer to the converted data goes */
    real *scalar_dst;  /* for rank 0 */
    int optional;
    double add;        /* added to every element after conversion (Gemma 3's 1 + w norms) */
    int quantizable;   /* a decoder projection: quantized with the base dtype (model_generic.h) */
} tensor_plan;

static int64_t plan_numel(const tensor_plan *p) { return p->rank == 0 ? 1 : p->rank == 1 ? p->rows : p->rows * p->cols; }

static void convert_to_real(const st_tensor *t, real *dst, uint64_t n, double add) {
    const unsigned char *src = t->data;
    for (uint64_t i = 0; i < n; i++) {
        double x;
        switch (t->dtype) {
        case ST_F64: { double v; memcpy(&v, src + 8 * i, 8); x = v; break; }
        case ST_F32: { float v; memcpy(&v, src + 4 * i, 4); x = v; break; }
        case ST_F16: { uint16_t v; memcpy(&v, src + 2 * i, 2); x = wa_f16_to_f32(v); break; }
        default:     { uint16_t v; memcpy(&v, src + 2 * i, 2); x = wa_bf16_to_f32(v); break; }
        }
        /* (real)(1 + w) rounds once, as transformers' float (1.0 + weight) does */
        dst[i] = (real)(add != 0 ? (real)add + (real)x : x);
    }
}

/* A rank-2 tensor through f32 into dst: a packed weight dequantized (U32: mlx_lm.convert's, with
 * NAME.scales and NAME.biases beside NAME.weight; U8: bitsandbytes' 4-bit, with NAME.weight.absmax
 * and the rest of its quant state), or a float tensor quantized and dequantized as base says
 * (mlx4 rounds to the tensor's own dtype, as MLX gives its values back; nf4 and fp8 stay f32). */
static int load_via_f32(const checkpoint *ck, const tensor_plan *p, const st_tensor *t, base_dtype base, real *dst,
                        char *err, size_t errlen) {
    size_t n = (size_t)plan_numel(p);
    float *tmp = malloc((n ? n : 1) * sizeof *tmp);
    if (!tmp) return snprintf(err, errlen, "out of memory for %zu weights", n), -1;
    char why[256] = "";
    int rc = 0;
    if (t->dtype == ST_U32) {
        const st_tensor *scales, *biases;
        mlx4_parts_find(ck, p->name, &scales, &biases);
        rc = mlx4_dequantize_tensor(t, scales, biases, p->rows, p->cols, tmp, why, sizeof why);
    } else if (t->dtype == ST_U8) {
        bnb4_tensors parts;
        bnb4_parts_find(ck, p->name, t, &parts);
        rc = nf4_dequantize_tensor(&parts, p->rows, p->cols, tmp, why, sizeof why);
    } else {
        for (size_t i = 0; i < n; i++) {
            const unsigned char *src = t->data;
            switch (t->dtype) {
            case ST_F64: { double v; memcpy(&v, src + 8 * i, 8); tmp[i] = (float)v; break; }
            case ST_F32: memcpy(&tmp[i], src + 4 * i, 4); break;
            case ST_F16: { uint16_t v; memcpy(&v, src + 2 * i, 2); tmp[i] = wa_f16_to_f32(v); break; }
            default:     { uint16_t v; memcpy(&v, src + 2 * i, 2); tmp[i] = wa_bf16_to_f32(v); break; }
            }
        }
        /* nf4's offset is torch's mean with one intra-op thread (quant.h: nf4_torch_mean) */
        if (base == BASE_MLX4) rc = mlx4_round_trip(tmp, p->rows, p->cols, t->dtype, why, sizeof why);
        else if (base == BASE_NF4) rc = nf4_round_trip(tmp, (int64_t)n, 1, why, sizeof why);
        else if (base == BASE_FP8) rc = fp8_round_trip(tmp, p->rows, p->cols, NULL, NULL, why, sizeof why);
    }
    if (rc == 0)
        for (size_t i = 0; i < n; i++) dst[i] = (real)tmp[i];
    else
        snprintf(err, errlen, "tensor \"%s%s\": %s", ck->prefix, p->name, why);
    free(tmp);
    return rc;
}

static int load_plan(model *m, const checkpoint *ck, tensor_plan *plan, int count, base_dtype base, char *err,
                     size_t errlen) {
    size_t total = 0;
    for (int i = 0; i < count; i++) total += (size_t)plan_numel(&plan[i]);
    m->weight_count = total;
    m->weights = malloc((total ? total : 1) * sizeof(real));
    if (!m->weights) return snprintf(err, errlen, "out of memory for %zu weights", total), -1;
    size_t off = 0;
    for (int i = 0; i < count; i++) {
        tensor_plan *p = &plan[i];
        const st_tensor *t = checkpoint_find(ck, p->name);
        int64_t n = plan_numel(p);
        if (!t) {
            if (p->optional) {
                if (p->dst) *p->dst = NULL;
                continue;
            }
            return snprintf(err, errlen, "checkpoint has no tensor \"%s%s\"", ck->prefix, p->name), -1;
        }
        /* U32: a weight packed by mlx_lm.convert, the shape checked against its scales below; U8: one
         * packed by bitsandbytes, checked against its quant state */
        int packed = (t->dtype == ST_U32 || t->dtype == ST_U8) && p->rank == 2;
        if (t->dtype != ST_F32 && t->dtype != ST_F16 && t->dtype != ST_BF16 && t->dtype != ST_F64 && !packed)
            return snprintf(err, errlen, "tensor \"%s%s\" has dtype %s (F32, F16, BF16, F64 are read)", ck->prefix,
                            p->name, st_dtype_name(t->dtype)), -1;
        int shape_ok;
        if (packed) shape_ok = 1; /* in mlx4_dequantize_tensor and nf4_dequantize_tensor */
        else if (p->rank == 0) shape_ok = st_numel(t) == 1 && t->rank <= 1;
        else if (p->rank == 1) shape_ok = t->rank == 1 && t->shape[0] == p->rows;
        else shape_ok = t->rank == 2 && t->shape[0] == p->rows && t->shape[1] == p->cols;
        if (!shape_ok) {
            char want[64], got[96] = "";
            if (p->rank == 0) snprintf(want, sizeof want, "[1]");
            else if (p->rank == 1) snprintf(want, sizeof want, "[%lld]", (long long)p->rows);
            else snprintf(want, sizeof want, "[%lld, %lld]", (long long)p->rows, (long long)p->cols);
            for (int d = 0; d < t->rank; d++)
                snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? ", " : "", (long long)t->shape[d]);
            return snprintf(err, errlen, "tensor \"%s%s\" has shape [%s], the config implies %s", ck->prefix, p->name, got,
                            want), -1;
        }
        /* a NaN or inf in a frozen weight would surface steps later as a non-finite loss */
        uint64_t bad;
        if (st_tensor_first_nonfinite(t, &bad))
            return snprintf(err, errlen, "tensor \"%s%s\" holds a non-finite value (%s) at element %llu", ck->prefix,
                            p->name, st_tensor_value_kind(t, bad), (unsigned long long)bad), -1;
        real *dst = m->weights + off;
        if (packed || (base != BASE_BF16 && p->quantizable)) {
            if (load_via_f32(ck, p, t, packed ? BASE_BF16 : base, dst, err, errlen) != 0) return -1;
            *p->dst = dst;
            off += (size_t)n;
            continue;
        }
        convert_to_real(t, dst, (uint64_t)n, p->add);
        if (p->rank == 0) *p->scalar_dst = dst[0];
        else *p->dst = dst;
        off += (size_t)n;
    }
    return 0;
}

static void lay_out_lora(model *m) {
    const gemma_config *c = &m->cfg;
    int first = m->lora.num_layers > 0 && m->lora.num_layers < c->layers ? c->layers - m->lora.num_layers : 0;
    m->slots = calloc((size_t)c->layers * PROJ_COUNT, sizeof *m->slots);
    m->slot_count = 0;
    m->param_count = 0;
    for (int l = 0; l < c->layers; l++)
        for (int p = 0; p < PROJ_COUNT; p++) {
            layer *L = &m->layer[l];
            L->lora[p] = -1;
            /* a full layer with k_eq_v has no v_proj to adapt */
            int absent = p == PROJ_V && m->cfg.kind[L->kind].k_eq_v;
            if (l < first || m->lora.rank <= 0 || !(m->lora.proj_mask & (1u << p)) || absent) continue;
            lora_slot *s = &m->slots[m->slot_count];
            s->layer = l;
            s->proj = (gemma_proj)p;
            s->in = L->in[p];
            s->out = L->out[p];
            s->a = m->param_count;
            m->param_count += (size_t)s->in * (size_t)m->lora.rank;
            s->b = m->param_count;
            m->param_count += (size_t)m->lora.rank * (size_t)s->out;
            L->lora[p] = m->slot_count++;
        }
    m->params = calloc(m->param_count ? m->param_count : 1, sizeof(real));
    m->grads = calloc(m->param_count ? m->param_count : 1, sizeof(real));
}

/* with_weights 0: the config, the layer shapes and the adapters only (the weights live elsewhere,
 * e.g. on a GPU: model_cuda.h) */
static int model_load(model *m, const char *dir, const lora_config *lora, int with_weights, base_dtype base, char *err,
                      size_t errlen) {
    memset(m, 0, sizeof *m);
    m->arm = ATTN_CHUNKED;
    m->chunk = 512;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (gemma_config_load(path, &m->cfg, err, errlen) != 0) return -1;
    if (mlx4_config_quantization(path, err, errlen) < 0 || bnb_config_quantization(path, err, errlen) < 0) return -1;
    const gemma_config *c = &m->cfg;
    if (lora) m->lora = *lora;
    checkpoint ck;
    if (with_weights && checkpoint_open(dir, &ck, err, errlen) != 0) return -1;

    m->layer = calloc((size_t)c->layers, sizeof *m->layer);
    int cap = 4 + c->layers * 16, count = 0;
    tensor_plan *plan = calloc((size_t)cap, sizeof *plan);
    double norm_add = c->family == GEMMA_3 ? 1.0 : 0.0;
#define PLAN(rank_, rows_, cols_, dst_, fmt, ...)                                              \
    do {                                                                                       \
        tensor_plan *p_ = &plan[count++];                                                      \
        snprintf(p_->name, sizeof p_->name, fmt, __VA_ARGS__);                                 \
        p_->rank = rank_, p_->rows = rows_, p_->cols = cols_, p_->dst = dst_;                  \
    } while (0)
    PLAN(2, c->vocab, c->hidden, &m->embed, "%s", "embed_tokens.weight");
    PLAN(1, c->hidden, 0, &m->final_norm, "%s", "norm.weight");
    plan[count - 1].add = norm_add;
    if (!c->tied_embeddings) PLAN(2, c->vocab, c->hidden, &m->lm_head, "%s", "lm_head.weight");
    for (int l = 0; l < c->layers; l++) {
        layer *L = &m->layer[l];
        const gemma_attn_shape *a = &c->kind[c->layer_kind[l]];
        L->kind = c->layer_kind[l];
        int qd = c->heads * a->head_dim, kd = a->kv_heads * a->head_dim;
        const int dims[PROJ_COUNT][2] = {{qd, c->hidden}, {kd, c->hidden}, {kd, c->hidden}, {c->hidden, qd},
                                         {c->intermediate, c->hidden}, {c->intermediate, c->hidden},
                                         {c->hidden, c->intermediate}};
        for (int p = 0; p < PROJ_COUNT; p++) {
            L->out[p] = dims[p][0];
            L->in[p] = dims[p][1];
            if (p == PROJ_V && a->k_eq_v) continue; /* full layers with k_eq_v have no v_proj */
            PLAN(2, dims[p][0], dims[p][1], &L->w[p], "layers.%d.%s.weight", l, gemma_proj_path[p]);
            plan[count - 1].quantizable = 1;
        }
        const char *norms[4] = {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                "post_feedforward_layernorm"};
        const real **norm_dst[4] = {&L->input_norm, &L->post_attn_norm, &L->pre_ffw_norm, &L->post_ffw_norm};
        for (int k = 0; k < 4; k++) {
            PLAN(1, c->hidden, 0, norm_dst[k], "layers.%d.%s.weight", l, norms[k]);
            plan[count - 1].add = norm_add;
        }
        PLAN(1, a->head_dim, 0, &L->q_norm, "layers.%d.self_attn.q_norm.weight", l);
        plan[count - 1].add = norm_add;
        PLAN(1, a->head_dim, 0, &L->k_norm, "layers.%d.self_attn.k_norm.weight", l);
        plan[count - 1].add = norm_add;
        L->layer_scalar = 1;
        if (c->family == GEMMA_4) {
            PLAN(0, 1, 0, NULL, "layers.%d.layer_scalar", l);
            plan[count - 1].scalar_dst = &L->layer_scalar;
        }
    }
#undef PLAN
    int rc = with_weights ? load_plan(m, &ck, plan, count, base, err, errlen) : 0;
    free(plan);
    if (with_weights) checkpoint_close(&ck);
    if (rc != 0) {
        MT(gemma_model_free)(m);
        return -1;
    }
    if (c->tied_embeddings) m->lm_head = m->embed;
    lay_out_lora(m);
    if (!m->params || !m->grads || !m->slots) {
        MT(gemma_model_free)(m);
        return snprintf(err, errlen, "out of memory for the adapters"), -1;
    }
    return 0;
}

int MT(gemma_model_load)(model *m, const char *dir, const lora_config *lora, char *err, size_t errlen) {
    return model_load(m, dir, lora, 1, BASE_BF16, err, errlen);
}

int MT(gemma_model_load_base)(model *m, const char *dir, const lora_config *lora, base_dtype base, char *err,
                              size_t errlen) {
    return model_load(m, dir, lora, 1, base, err, errlen);
}

int MT(gemma_model_layout)(model *m, const char *dir, const lora_config *lora, char *err, size_t errlen) {
    return model_load(m, dir, lora, 0, BASE_BF16, err, errlen);
}

void MT(gemma_model_free)(model *m) {
    if (m->wa) wa_context_destroy(m->wa);
    free(m->weights);
    free(m->layer);
    free(m->slots);
    free(m->params);
    free(m->grads);
    memset(m, 0, sizeof *m);
}

void MT(gemma_lora_init)(model *m, uint64_t seed) {
    uint64_t s = seed;
    for (int i = 0; i < m->slot_count; i++) {
        const lora_slot *sl = &m->slots[i];
        double bound = 1.0 / sqrt((double)sl->in);
        for (size_t j = 0; j < (size_t)sl->in * (size_t)m->lora.rank; j++) {
            double u = splitmix64_unit(&s);
            m->params[sl->a + j] = (real)((2 * u - 1) * bound);
        }
        memset(m->params + sl->b, 0, (size_t)m->lora.rank * (size_t)sl->out * sizeof(real));
    }
}

int MT(gemma_set_attention)(model *m, attn_arm arm, int chunk, int threads) {
    if (m->wa) {
        wa_context_destroy(m->wa);
        m->wa = NULL;
    }
    m->arm = arm;
    m->chunk = chunk > 0 ? chunk : 512;
    if (arm != ATTN_FUSED) return 0;
    if (!REAL_IS_FLOAT) return set_err(m, "the fused arm runs in float32 (winattn has no float64 kernels)");
    wa_context_params p = {0};
    p.threads = threads;
    wa_status st = wa_context_create(&p, &m->wa);
    if (st != WA_OK) return set_err(m, "winattn context: %s", wa_status_str(st));
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Elementwise ops, each beside its backward. */

/* y = x / sqrt(mean(x²) + eps) · w over rows of n (w NULL: no weight, Gemma 4's v_norm). */
static void rmsnorm_fwd(const real *x, const real *w, real *y, long rows, int n, double eps) {
    for (long r = 0; r < rows; r++) {
        const real *xr = x + r * n;
        real *yr = y + r * n;
        double ss = 0;
        for (int i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
        real inv = (real)(1.0 / sqrt(ss / n + eps));
        for (int i = 0; i < n; i++) yr[i] = w ? xr[i] * inv * w[i] : xr[i] * inv;
    }
}

/* dx (+)= d/dx of the above: with g = dy·w and r = 1/rms, dx = r·g − x·r³·(g·x)/n. */
static void rmsnorm_bwd(const real *x, const real *w, const real *dy, real *dx, long rows, int n, double eps,
                        int accumulate) {
    for (long r = 0; r < rows; r++) {
        const real *xr = x + r * n, *dyr = dy + r * n;
        real *dxr = dx + r * n;
        double ss = 0, gx = 0;
        for (int i = 0; i < n; i++) {
            ss += (double)xr[i] * xr[i];
            gx += (double)dyr[i] * (w ? w[i] : 1) * xr[i];
        }
        double inv = 1.0 / sqrt(ss / n + eps);
        double k = inv * inv * inv * gx / n;
        for (int i = 0; i < n; i++) {
            real g = (real)(inv * (double)dyr[i] * (w ? w[i] : 1) - (double)xr[i] * k);
            dxr[i] = accumulate ? dxr[i] + g : g;
        }
    }
}

/* Rotary tables for positions 0..T-1: cos/sin [T, D/2], angles in double. transformers forms them in
 * float32 (inv_freq and position · inv_freq), which at position 300 already moves gemma4_tiny's
 * logits by 3e-3 (train/fixtures/README.md): this model's score scale is 1 and the q/k norms make
 * the softmax sharp, so angle rounding matters; exact angles are the reference we test against. */
static void rope_table(const gemma_rope *r, int D, int T, real *cosv, real *sinv) {
    int half = D / 2;
    int rotated = r->proportional ? (int)(r->partial * D / 2) : half;
    for (int j = 0; j < half; j++) {
        /* proportional: the exponent's denominator is the full head dim; unrotated pairs keep angle 0 */
        double inv = j < rotated ? pow(r->theta, -(double)(2 * j) / D) / r->linear_factor : 0.0;
        for (int t = 0; t < T; t++) {
            double ang = (double)t * inv;
            cosv[(long)t * half + j] = (real)cos(ang);
            sinv[(long)t * half + j] = (real)sin(ang);
        }
    }
}

/* Rotate-half RoPE in place on [T, heads, D], row t at position pos[t] (its place in its own
 * record); sign -1 applies the inverse rotation (the backward, since a rotation's transpose is
 * its inverse). */
static void rope_apply(real *x, int T, int heads, int D, const real *cosv, const real *sinv, const int32_t *pos,
                       int sign) {
    int half = D / 2;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < heads; h++) {
            real *v = x + ((long)t * heads + h) * D;
            const real *c = cosv + (long)pos[t] * half, *s = sinv + (long)pos[t] * half;
            for (int j = 0; j < half; j++) {
                real x1 = v[j], x2 = v[j + half], sn = sign * s[j];
                v[j] = x1 * c[j] - x2 * sn;
                v[j + half] = x2 * c[j] + x1 * sn;
            }
        }
}

/* gelu_pytorch_tanh and its derivative */
static const real gelu_k = (real)0.7978845608028654; /* sqrt(2/pi) */
static real gelu(real x) {
    real t = rtanh(gelu_k * (x + (real)0.044715 * x * x * x));
    return (real)0.5 * x * (1 + t);
}
static real gelu_grad(real x) {
    real t = rtanh(gelu_k * (x + (real)0.044715 * x * x * x));
    return (real)0.5 * (1 + t) + (real)0.5 * x * (1 - t * t) * gelu_k * (1 + 3 * (real)0.044715 * x * x);
}

/* ---------------------------------------------------------------------------------------------
 * The LoRA linear: y = x Wᵀ + s (x A) B. t = x A [T, r] is kept for the backward. */

static void linear_fwd(model *m, int l, gemma_proj p, const real *x, int T, real *y, real *t) {
    const layer *L = &m->layer[l];
    int in = L->in[p], out = L->out[p];
    mm(0, 1, T, out, in, 1, x, in, L->w[p], in, 0, y, out);
    int s = L->lora[p];
    if (s < 0) return;
    const lora_slot *sl = &m->slots[s];
    int r = m->lora.rank;
    mm(0, 0, T, r, in, 1, x, in, m->params + sl->a, r, 0, t, r);
    mm(0, 0, T, out, r, (real)m->lora.scale, t, r, m->params + sl->b, out, 1, y, out);
}

/* dx (+)= dy W + dt Aᵀ, and the adapter gradients: dB += s tᵀ dy, dA += xᵀ dt with dt = s dy Bᵀ.
 * dt_buf holds [T, r]. */
static void linear_bwd(model *m, int l, gemma_proj p, const real *x, const real *t, const real *dy, int T, real *dx,
                       int accumulate, real *dt_buf) {
    const layer *L = &m->layer[l];
    int in = L->in[p], out = L->out[p];
    mm(0, 0, T, in, out, 1, dy, out, L->w[p], in, accumulate ? 1 : 0, dx, in);
    int s = L->lora[p];
    if (s < 0) return;
    const lora_slot *sl = &m->slots[s];
    int r = m->lora.rank;
    real scale = (real)m->lora.scale;
    mm(1, 0, r, out, T, scale, t, r, dy, out, 1, m->grads + sl->b, out);
    mm(0, 1, T, r, out, scale, dy, out, m->params + sl->b, out, 0, dt_buf, r);
    mm(1, 0, in, r, T, 1, x, in, dt_buf, r, 1, m->grads + sl->a, r);
    mm(0, 1, T, in, r, 1, dt_buf, r, m->params + sl->a, r, 1, dx, in);
}

/* ---------------------------------------------------------------------------------------------
 * A packed batch: n records end to end as T rows. Per-token ops see only rows; RoPE reads pos,
 * attention reads cu, the head reads target. */

typedef struct packing {
    int n, T, longest;
    int32_t *cu;      /* [n + 1] row offsets of the records, as winattn's varlen takes them */
    int32_t *pos;     /* [T] each row's position within its record */
    int32_t *tokens;  /* [T] */
    int32_t *target;  /* [T] the token row t is trained to predict; -1 where nothing counts */
    void *block;      /* the one allocation behind all of the above */
} packing;

static void packing_free(packing *pk) {
    free(pk->block);
    memset(pk, 0, sizeof *pk);
}

/* Checks every record (at least one token, tokens in the vocabulary) and lays the batch out. */
static int packing_build(model *m, const gemma_seq *seqs, int n, packing *pk) {
    memset(pk, 0, sizeof *pk);
    if (n < 1) return set_err(m, "a batch needs at least one record");
    long T = 0;
    for (int b = 0; b < n; b++) {
        const gemma_seq *s = &seqs[b];
        char where[32] = "";
        if (n > 1) snprintf(where, sizeof where, "record %d: ", b + 1);
        if (s->len < 1) return set_err(m, "%sa sequence needs at least one token", where);
        for (int t = 0; t < s->len; t++)
            if (s->tokens[t] < 0 || s->tokens[t] >= m->cfg.vocab)
                return set_err(m, "%stoken %d at position %d is outside the vocabulary (%d)", where, s->tokens[t], t,
                               m->cfg.vocab);
        T += s->len;
        if (T > INT32_MAX) return set_err(m, "a packed batch must hold fewer than 2^31 tokens");
        pk->longest = s->len > pk->longest ? s->len : pk->longest;
    }
    pk->n = n;
    pk->T = (int)T;
    pk->block = malloc(((size_t)n + 1 + 3 * (size_t)T) * sizeof(int32_t));
    if (!pk->block) return set_err(m, "out of memory for a batch of %ld tokens", T);
    pk->cu = pk->block;
    pk->pos = pk->cu + n + 1;
    pk->tokens = pk->pos + T;
    pk->target = pk->tokens + T;
    pk->cu[0] = 0;
    for (int b = 0; b < n; b++) {
        const gemma_seq *s = &seqs[b];
        int32_t r0 = pk->cu[b];
        pk->cu[b + 1] = r0 + s->len;
        memcpy(pk->tokens + r0, s->tokens, (size_t)s->len * sizeof(int32_t));
        for (int t = 0; t < s->len; t++) {
            pk->pos[r0 + t] = t;
            /* the last row of a record predicts nothing: the next row is another record's */
            int counted = t < s->len - 1 && (!s->target_mask || s->target_mask[t]);
            pk->target[r0 + t] = counted ? s->tokens[t + 1] : -1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Attention over q [T, Hq, D], k and v [T, Hkv, D] (rows of the projections, no transposes):
 * causal, and for sliding layers only keys q − window < k ≤ q, within each record. The
 * functions on one sequence take its T in attn_args; the packed entry points below run them on
 * each record's rows. */

typedef struct attn_args {
    int T, Hq, Hkv, D;
    int window;          /* 0 = full causal */
    double scale, softcap;
} attn_args;

/* Keys visible to any query of [q0, q1): chunked visits only these; dense visits all T. */
static int block_key_start(const model *m, const attn_args *a, int q0) {
    if (m->arm == ATTN_DENSE || a->window == 0) return 0;
    return q0 - a->window + 1 > 0 ? q0 - a->window + 1 : 0;
}

static int block_rows(const model *m, const attn_args *a) { return m->arm == ATTN_DENSE ? a->T : m->chunk; }

/* Query block [q0, q0 + *nq) and the keys it visits, [*k0, *k0 + *span). */
static void block_extent(const model *m, const attn_args *a, int q0, int *nq, int *k0, int *span) {
    int rows = block_rows(m, a);
    *nq = q0 + rows < a->T ? rows : a->T - q0;
    *k0 = block_key_start(m, a, q0);
    *span = (m->arm == ATTN_DENSE ? a->T : q0 + *nq) - *k0;
}

/* Elements of stored probabilities for all heads and blocks (what autodiff keeps). */
static size_t stored_prob_count(const model *m, const attn_args *a) {
    size_t n = 0;
    for (int q0 = 0, nq, k0, span; q0 < a->T; q0 += nq) {
        block_extent(m, a, q0, &nq, &k0, &span);
        n += (size_t)nq * (size_t)span;
    }
    return n * (size_t)a->Hq;
}

/* Scores of one block and head, capped and masked: S[i][j] for query q0+i, key k0+j. */
static void block_scores(const attn_args *a, const real *q, const real *k, int h, int q0, int nq, int k0, int span,
                         real *S) {
    int g = h / (a->Hq / a->Hkv);
    mm(0, 1, nq, span, a->D, (real)a->scale, q + (long)q0 * a->Hq * a->D + (long)h * a->D, a->Hq * a->D,
       k + (long)k0 * a->Hkv * a->D + (long)g * a->D, a->Hkv * a->D, 0, S, span);
    for (int i = 0; i < nq; i++) {
        int qi = q0 + i;
        real *row = S + (long)i * span;
        for (int j = 0; j < span; j++) {
            int kj = k0 + j;
            int visible = kj <= qi && (a->window == 0 || qi - kj < a->window);
            if (!visible) row[j] = (real)-INFINITY;
            else if (a->softcap > 0) row[j] = (real)(a->softcap * tanh((double)row[j] / a->softcap));
        }
    }
}

/* Elements of one block's scratch in the backward (dP, and the raw scores under a softcap). */
static size_t block_scratch_count(const model *m, const attn_args *a) {
    int rows = block_rows(m, a);
    return (size_t)rows * (size_t)(m->arm == ATTN_DENSE ? a->T : rows + (a->window ? a->window : a->T));
}

/* One sequence: o, and its probabilities into P (stored_prob_count elements). */
static void attn_matmul_fwd_seq(const model *m, const attn_args *a, const real *q, const real *k, const real *v,
                                real *o, real *P) {
    int group = a->Hq / a->Hkv;
    size_t off = 0;
    for (int q0 = 0, nq, k0, span; q0 < a->T; q0 += nq) {
        block_extent(m, a, q0, &nq, &k0, &span);
        for (int h = 0; h < a->Hq; h++, off += (size_t)nq * span) {
            real *S = P + off;
            block_scores(a, q, k, h, q0, nq, k0, span, S);
            for (int i = 0; i < nq; i++) { /* softmax; the diagonal is always visible */
                real *row = S + (long)i * span;
                real mx = -INFINITY;
                for (int j = 0; j < span; j++) mx = row[j] > mx ? row[j] : mx;
                double sum = 0;
                for (int j = 0; j < span; j++) sum += (row[j] = (real)exp((double)row[j] - mx));
                real inv = (real)(1.0 / sum);
                for (int j = 0; j < span; j++) row[j] *= inv;
            }
            mm(0, 0, nq, a->D, span, 1, S, span, v + (long)k0 * a->Hkv * a->D + (long)(h / group) * a->D,
               a->Hkv * a->D, 0, o + (long)q0 * a->Hq * a->D + (long)h * a->D, a->Hq * a->D);
        }
    }
}

/* a for record b of a packed batch (a->T is the batch's) */
static attn_args record_args(const attn_args *a, const packing *pk, int b) {
    attn_args r = *a;
    r.T = pk->cu[b + 1] - pk->cu[b];
    return r;
}

/* The packed batch, record by record; *probs receives every record's probabilities, end to end. */
static int attn_matmul_fwd(model *m, const attn_args *a, const packing *pk, const real *q, const real *k,
                           const real *v, real *o, real **probs) {
    size_t n = 0, scratch = 0;
    for (int b = 0; b < pk->n; b++) {
        attn_args r = record_args(a, pk, b);
        n += stored_prob_count(m, &r);
        scratch = block_scratch_count(m, &r) > scratch ? block_scratch_count(m, &r) : scratch;
    }
    char what[64];
    if (pk->n > 1) snprintf(what, sizeof what, "%d tokens in %d records", pk->T, pk->n);
    else snprintf(what, sizeof what, "%d tokens", pk->T);
    /* refuse up front what the layer's backward would need, instead of being killed half way */
    size_t need = (n + scratch * (a->softcap > 0 ? 2 : 1)) * sizeof(real);
    if (m->mem_limit && need > m->mem_limit)
        return set_err(m, "%s attention at %s needs %.2f GB (probabilities and scratch); %.2f GB allowed: out of memory",
                       attn_arm_name(m->arm), what, need / 1e9, m->mem_limit / 1e9);
    real *P = malloc((n ? n : 1) * sizeof(real));
    if (!P) return set_err(m, "%s attention at %s: out of memory (%.2f GB)", attn_arm_name(m->arm), what,
                           n * sizeof(real) / 1e9);
    size_t off = 0;
    for (int b = 0; b < pk->n; b++) {
        attn_args r = record_args(a, pk, b);
        long row = pk->cu[b];
        attn_matmul_fwd_seq(m, &r, q + row * a->Hq * a->D, k + row * a->Hkv * a->D, v + row * a->Hkv * a->D,
                            o + row * a->Hq * a->D, P + off);
        off += stored_prob_count(m, &r);
    }
    *probs = P;
    return 0;
}

/* One sequence: dS = P ∘ (dP − rowsum(P ∘ dP)), through the softcap, then the three products,
 * added into dq, dk, dv. dP and S (the latter only with a softcap) hold block_scratch_count. */
static void attn_matmul_bwd_seq(const model *m, const attn_args *a, const real *q, const real *k, const real *v,
                                const real *P, const real *dout, real *dq, real *dk, real *dv, real *dP, real *S) {
    int group = a->Hq / a->Hkv;
    long qs = (long)a->Hq * a->D, ks = (long)a->Hkv * a->D;
    size_t off = 0;
    for (int q0 = 0, nq, k0, span; q0 < a->T; q0 += nq) {
        block_extent(m, a, q0, &nq, &k0, &span);
        for (int h = 0; h < a->Hq; h++, off += (size_t)nq * span) {
            const real *Ph = P + off;
            int g = h / group;
            const real *qh = q + (long)q0 * qs + (long)h * a->D, *doh = dout + (long)q0 * qs + (long)h * a->D;
            const real *kg = k + (long)k0 * ks + (long)g * a->D, *vg = v + (long)k0 * ks + (long)g * a->D;
            mm(0, 1, nq, span, a->D, 1, doh, (int)qs, vg, (int)ks, 0, dP, span);
            if (S) block_scores(a, q, k, h, q0, nq, k0, span, S);
            for (int i = 0; i < nq; i++) {
                const real *p = Ph + (long)i * span;
                real *d = dP + (long)i * span;
                double dot = 0;
                for (int j = 0; j < span; j++) dot += (double)p[j] * d[j];
                for (int j = 0; j < span; j++) {
                    real ds = p[j] * (d[j] - (real)dot);
                    if (S && p[j] != 0) {
                        double t = (double)S[(long)i * span + j] / a->softcap;
                        ds = (real)(ds * (1 - t * t));
                    }
                    d[j] = ds;
                }
            }
            mm(0, 0, nq, a->D, span, (real)a->scale, dP, span, kg, (int)ks, 1, dq + (long)q0 * qs + (long)h * a->D,
               (int)qs);
            mm(1, 0, span, a->D, nq, (real)a->scale, dP, span, qh, (int)qs, 1, dk + (long)k0 * ks + (long)g * a->D,
               (int)ks);
            mm(1, 0, span, a->D, nq, 1, Ph, span, doh, (int)qs, 1, dv + (long)k0 * ks + (long)g * a->D, (int)ks);
        }
    }
}

/* The packed batch, record by record, P as attn_matmul_fwd left it. dq, dk, dv are overwritten. */
static int attn_matmul_bwd(model *m, const attn_args *a, const packing *pk, const real *q, const real *k,
                           const real *v, const real *P, const real *dout, real *dq, real *dk, real *dv) {
    size_t tmp = 0;
    for (int b = 0; b < pk->n; b++) {
        attn_args r = record_args(a, pk, b);
        tmp = block_scratch_count(m, &r) > tmp ? block_scratch_count(m, &r) : tmp;
    }
    real *dP = malloc(tmp * sizeof(real)), *S = a->softcap > 0 ? malloc(tmp * sizeof(real)) : NULL;
    if (!dP || (a->softcap > 0 && !S)) {
        free(dP);
        free(S);
        return set_err(m, "%s attention backward: out of memory", attn_arm_name(m->arm));
    }
    long qs = (long)a->Hq * a->D, ks = (long)a->Hkv * a->D;
    memset(dq, 0, (size_t)a->T * qs * sizeof(real));
    memset(dk, 0, (size_t)a->T * ks * sizeof(real));
    memset(dv, 0, (size_t)a->T * ks * sizeof(real));
    size_t off = 0;
    for (int b = 0; b < pk->n; b++) {
        attn_args r = record_args(a, pk, b);
        long row = pk->cu[b];
        attn_matmul_bwd_seq(m, &r, q + row * qs, k + row * ks, v + row * ks, P + off, dout + row * qs, dq + row * qs,
                            dk + row * ks, dv + row * ks, dP, S);
        off += stored_prob_count(m, &r);
    }
    free(dP);
    free(S);
    return 0;
}

#if REAL_IS_FLOAT
static wa_attn_desc fused_desc(const attn_args *a) {
    wa_attn_desc d = a->window ? wa_attn_desc_sliding(a->window) : wa_attn_desc_causal();
    d.scale = (float)a->scale;
    d.softcap = (float)a->softcap;
    return d;
}

/* A batch of one record is a plain call; more are one varlen call, each record on its own rows
 * with its own window. lse is [Hq, T] either way. */
static int attn_fused_fwd(model *m, const attn_args *a, const packing *pk, const real *q, const real *k,
                          const real *v, real *o, float *lse) {
    wa_attn_desc d = fused_desc(a);
    wa_status st;
    if (pk->n == 1) {
        wa_tensor tq = wa_tensor_bnhd((void *)q, WA_F32, 1, a->Hq, a->T, a->D);
        wa_tensor tk = wa_tensor_bnhd((void *)k, WA_F32, 1, a->Hkv, a->T, a->D);
        wa_tensor tv = wa_tensor_bnhd((void *)v, WA_F32, 1, a->Hkv, a->T, a->D);
        wa_tensor to = wa_tensor_bnhd(o, WA_F32, 1, a->Hq, a->T, a->D);
        wa_tensor tl = wa_tensor_lse(lse, 1, a->Hq, a->T);
        st = wa_forward(m->wa, &d, &tq, &tk, &tv, &to, &tl);
    } else {
        wa_varlen vl = {pk->n, pk->cu, pk->cu, pk->longest, pk->longest};
        wa_tensor tq = wa_tensor_thd((void *)q, WA_F32, a->T, a->Hq, a->D);
        wa_tensor tk = wa_tensor_thd((void *)k, WA_F32, a->T, a->Hkv, a->D);
        wa_tensor tv = wa_tensor_thd((void *)v, WA_F32, a->T, a->Hkv, a->D);
        wa_tensor to = wa_tensor_thd(o, WA_F32, a->T, a->Hq, a->D);
        wa_tensor tl = wa_tensor_lse_varlen(lse, a->Hq, a->T);
        st = wa_forward_varlen(m->wa, &d, &vl, &tq, &tk, &tv, &to, &tl);
    }
    return st == WA_OK ? 0 : set_err(m, "winattn forward: %s (%s)", wa_status_str(st), wa_last_error());
}

static int attn_fused_bwd(model *m, const attn_args *a, const packing *pk, const real *q, const real *k,
                          const real *v, const real *o, const float *lse, const real *dout, real *dq, real *dk,
                          real *dv) {
    wa_attn_desc d = fused_desc(a);
    wa_status st;
    if (pk->n == 1) {
        wa_tensor tq = wa_tensor_bnhd((void *)q, WA_F32, 1, a->Hq, a->T, a->D);
        wa_tensor tk = wa_tensor_bnhd((void *)k, WA_F32, 1, a->Hkv, a->T, a->D);
        wa_tensor tv = wa_tensor_bnhd((void *)v, WA_F32, 1, a->Hkv, a->T, a->D);
        wa_tensor to = wa_tensor_bnhd((void *)o, WA_F32, 1, a->Hq, a->T, a->D);
        wa_tensor tl = wa_tensor_lse((float *)lse, 1, a->Hq, a->T);
        wa_tensor tdo = wa_tensor_bnhd((void *)dout, WA_F32, 1, a->Hq, a->T, a->D);
        wa_tensor tdq = wa_tensor_bnhd(dq, WA_F32, 1, a->Hq, a->T, a->D);
        wa_tensor tdk = wa_tensor_bnhd(dk, WA_F32, 1, a->Hkv, a->T, a->D);
        wa_tensor tdv = wa_tensor_bnhd(dv, WA_F32, 1, a->Hkv, a->T, a->D);
        st = wa_backward(m->wa, &d, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk, &tdv);
    } else {
        wa_varlen vl = {pk->n, pk->cu, pk->cu, pk->longest, pk->longest};
        wa_tensor tq = wa_tensor_thd((void *)q, WA_F32, a->T, a->Hq, a->D);
        wa_tensor tk = wa_tensor_thd((void *)k, WA_F32, a->T, a->Hkv, a->D);
        wa_tensor tv = wa_tensor_thd((void *)v, WA_F32, a->T, a->Hkv, a->D);
        wa_tensor to = wa_tensor_thd((void *)o, WA_F32, a->T, a->Hq, a->D);
        wa_tensor tl = wa_tensor_lse_varlen((float *)lse, a->Hq, a->T);
        wa_tensor tdo = wa_tensor_thd((void *)dout, WA_F32, a->T, a->Hq, a->D);
        wa_tensor tdq = wa_tensor_thd(dq, WA_F32, a->T, a->Hq, a->D);
        wa_tensor tdk = wa_tensor_thd(dk, WA_F32, a->T, a->Hkv, a->D);
        wa_tensor tdv = wa_tensor_thd(dv, WA_F32, a->T, a->Hkv, a->D);
        st = wa_backward_varlen(m->wa, &d, &vl, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk, &tdv);
    }
    return st == WA_OK ? 0 : set_err(m, "winattn backward: %s (%s)", wa_status_str(st), wa_last_error());
}
#endif

/* ---------------------------------------------------------------------------------------------
 * One decoder layer. The activations of the layer being worked on live in `acts`, sized for the
 * widest layer kind and reused by every layer. */

typedef struct acts {
    int T;
    const packing *pk;    /* the batch the rows belong to */
    real *a, *q, *k, *v, *qr, *kr, *vn, *o, *ao, *h, *mi, *g, *u, *z, *mo, *tmp;
    real *t[PROJ_COUNT];  /* LoRA x·A */
    float *lse;           /* fused arm */
    real *probs;          /* dense/chunked arms, owned while a layer is between forward and backward */
    /* gradients */
    real *d_h, *d_tmp, *d_mi, *d_z, *d_g, *d_u, *d_o, *d_qr, *d_kr, *d_vn, *d_q, *d_k, *d_v, *d_a, *d_t;
    real *cos[2], *sin[2];  /* rope tables per layer kind, for positions up to the longest record */
    real *block;            /* the one allocation behind all of the above */
} acts;

static void acts_free(acts *A) {
    free(A->block);
    free(A->lse);
    free(A->probs);
    memset(A, 0, sizeof *A);
}

static int acts_alloc(model *m, acts *A, const packing *pk, int backward) {
    const gemma_config *c = &m->cfg;
    int T = pk->T;
    memset(A, 0, sizeof *A);
    A->T = T;
    A->pk = pk;
    long H = c->hidden, I = c->intermediate, r = m->lora.rank > 0 ? m->lora.rank : 1;
    long qd = 0, kd = 0;
    for (int k = 0; k < 2; k++) {
        const gemma_attn_shape *s = &c->kind[k];
        qd = (long)c->heads * s->head_dim > qd ? (long)c->heads * s->head_dim : qd;
        kd = (long)s->kv_heads * s->head_dim > kd ? (long)s->kv_heads * s->head_dim : kd;
    }
    /* per-row buffers, T rows each */
    struct { real **p; long n; } parts[] = {
        {&A->a, H}, {&A->q, qd}, {&A->k, kd}, {&A->v, kd}, {&A->qr, qd}, {&A->kr, kd}, {&A->vn, kd}, {&A->o, qd},
        {&A->ao, H}, {&A->h, H}, {&A->mi, H}, {&A->g, I}, {&A->u, I}, {&A->z, I}, {&A->mo, H}, {&A->tmp, H},
        {&A->t[0], r}, {&A->t[1], r}, {&A->t[2], r}, {&A->t[3], r}, {&A->t[4], r}, {&A->t[5], r}, {&A->t[6], r},
        /* backward only from here */
        {&A->d_h, H}, {&A->d_tmp, H}, {&A->d_mi, H}, {&A->d_z, I}, {&A->d_g, I}, {&A->d_u, I}, {&A->d_o, qd},
        {&A->d_qr, qd}, {&A->d_kr, kd}, {&A->d_vn, kd}, {&A->d_q, qd}, {&A->d_k, kd}, {&A->d_v, kd}, {&A->d_a, H},
        {&A->d_t, r},
    };
    int nparts = backward ? (int)(sizeof parts / sizeof *parts) : 23;
    /* the rope tables: one row per position, and positions restart with each record */
    long P = pk->longest, half[2] = {c->kind[0].head_dim / 2, c->kind[1].head_dim / 2};
    size_t total = 2 * (size_t)P * (size_t)(half[0] + half[1]);
    for (int i = 0; i < nparts; i++) total += (size_t)T * (size_t)parts[i].n;
    A->block = malloc(total * sizeof(real));
    A->lse = malloc((size_t)c->heads * (size_t)T * sizeof(float));
    if (!A->block || !A->lse) {
        acts_free(A);
        return set_err(m, "out of memory for one layer's activations at %d tokens", T);
    }
    size_t off = 0;
    for (int i = 0; i < nparts; i++) {
        *parts[i].p = A->block + off;
        off += (size_t)T * (size_t)parts[i].n;
    }
    for (int k = 0; k < 2; k++) {
        A->cos[k] = A->block + off;
        A->sin[k] = A->block + off + (size_t)P * half[k];
        off += 2 * (size_t)P * half[k];
        rope_table(&c->kind[k].rope, c->kind[k].head_dim, (int)P, A->cos[k], A->sin[k]);
    }
    return 0;
}

static attn_args layer_attn_args(const model *m, int l, int T) {
    const gemma_config *c = &m->cfg;
    const gemma_attn_shape *s = &c->kind[c->layer_kind[l]];
    attn_args a = {T, c->heads, s->kv_heads, s->head_dim, c->layer_kind[l] == LAYER_SLIDING ? c->sliding_window : 0,
                   c->score_scale, c->attn_softcap};
    return a;
}

/* x [T, hidden] → out [T, hidden], filling A for the backward. */
static int layer_forward(model *m, int l, const real *x, acts *A, real *out) {
    const gemma_config *c = &m->cfg;
    const layer *L = &m->layer[l];
    const gemma_attn_shape *s = &c->kind[L->kind];
    int T = A->T, H = c->hidden, D = s->head_dim;
    attn_args aa = layer_attn_args(m, l, T);

    rmsnorm_fwd(x, L->input_norm, A->a, T, H, c->norm_eps);
    linear_fwd(m, l, PROJ_Q, A->a, T, A->q, A->t[PROJ_Q]);
    linear_fwd(m, l, PROJ_K, A->a, T, A->k, A->t[PROJ_K]);
    if (!s->k_eq_v) linear_fwd(m, l, PROJ_V, A->a, T, A->v, A->t[PROJ_V]);
    const real *vraw = s->k_eq_v ? A->k : A->v; /* k_eq_v: values are the raw keys, before k_norm and RoPE */
    rmsnorm_fwd(A->q, L->q_norm, A->qr, (long)T * c->heads, D, c->norm_eps);
    rope_apply(A->qr, T, c->heads, D, A->cos[L->kind], A->sin[L->kind], A->pk->pos, 1);
    rmsnorm_fwd(A->k, L->k_norm, A->kr, (long)T * s->kv_heads, D, c->norm_eps);
    rope_apply(A->kr, T, s->kv_heads, D, A->cos[L->kind], A->sin[L->kind], A->pk->pos, 1);
    if (c->family == GEMMA_4) rmsnorm_fwd(vraw, NULL, A->vn, (long)T * s->kv_heads, D, c->norm_eps);
    else memcpy(A->vn, vraw, (size_t)T * s->kv_heads * D * sizeof(real));

    free(A->probs);
    A->probs = NULL;
    int rc;
#if REAL_IS_FLOAT
    if (m->arm == ATTN_FUSED) rc = attn_fused_fwd(m, &aa, A->pk, A->qr, A->kr, A->vn, A->o, A->lse);
    else
#endif
        rc = attn_matmul_fwd(m, &aa, A->pk, A->qr, A->kr, A->vn, A->o, &A->probs);
    if (rc) return rc;

    linear_fwd(m, l, PROJ_O, A->o, T, A->ao, A->t[PROJ_O]);
    rmsnorm_fwd(A->ao, L->post_attn_norm, A->tmp, T, H, c->norm_eps);
    for (long i = 0; i < (long)T * H; i++) A->h[i] = x[i] + A->tmp[i];
    rmsnorm_fwd(A->h, L->pre_ffw_norm, A->mi, T, H, c->norm_eps);
    linear_fwd(m, l, PROJ_GATE, A->mi, T, A->g, A->t[PROJ_GATE]);
    linear_fwd(m, l, PROJ_UP, A->mi, T, A->u, A->t[PROJ_UP]);
    for (long i = 0; i < (long)T * c->intermediate; i++) A->z[i] = gelu(A->g[i]) * A->u[i];
    linear_fwd(m, l, PROJ_DOWN, A->z, T, A->mo, A->t[PROJ_DOWN]);
    rmsnorm_fwd(A->mo, L->post_ffw_norm, A->tmp, T, H, c->norm_eps);
    for (long i = 0; i < (long)T * H; i++) out[i] = (A->h[i] + A->tmp[i]) * L->layer_scalar;
    return 0;
}

/* Given dout = dL/d(layer output), write dx = dL/d(layer input) and add the adapter gradients.
 * A holds this layer's forward. dx may alias nothing else in A. */
static int layer_backward(model *m, int l, const real *x, acts *A, const real *dout, real *dx) {
    const gemma_config *c = &m->cfg;
    const layer *L = &m->layer[l];
    const gemma_attn_shape *s = &c->kind[L->kind];
    int T = A->T, H = c->hidden, D = s->head_dim, I = c->intermediate;
    long TH = (long)T * H;
    attn_args aa = layer_attn_args(m, l, T);

    /* out = (h + n_post_ffw(mo)) · layer_scalar */
    for (long i = 0; i < TH; i++) A->d_h[i] = dout[i] * L->layer_scalar;
    rmsnorm_bwd(A->mo, L->post_ffw_norm, A->d_h, A->d_tmp, T, H, c->norm_eps, 0);
    linear_bwd(m, l, PROJ_DOWN, A->z, A->t[PROJ_DOWN], A->d_tmp, T, A->d_z, 0, A->d_t);
    for (long i = 0; i < (long)T * I; i++) {
        A->d_g[i] = A->d_z[i] * A->u[i] * gelu_grad(A->g[i]);
        A->d_u[i] = A->d_z[i] * gelu(A->g[i]);
    }
    linear_bwd(m, l, PROJ_GATE, A->mi, A->t[PROJ_GATE], A->d_g, T, A->d_mi, 0, A->d_t);
    linear_bwd(m, l, PROJ_UP, A->mi, A->t[PROJ_UP], A->d_u, T, A->d_mi, 1, A->d_t);
    rmsnorm_bwd(A->h, L->pre_ffw_norm, A->d_mi, A->d_h, T, H, c->norm_eps, 1);

    /* h = x + n_post_attn(ao) */
    memcpy(dx, A->d_h, (size_t)TH * sizeof(real));
    rmsnorm_bwd(A->ao, L->post_attn_norm, A->d_h, A->d_tmp, T, H, c->norm_eps, 0);
    linear_bwd(m, l, PROJ_O, A->o, A->t[PROJ_O], A->d_tmp, T, A->d_o, 0, A->d_t);

    int rc;
#if REAL_IS_FLOAT
    if (m->arm == ATTN_FUSED)
        rc = attn_fused_bwd(m, &aa, A->pk, A->qr, A->kr, A->vn, A->o, A->lse, A->d_o, A->d_qr, A->d_kr, A->d_vn);
    else
#endif
        rc = attn_matmul_bwd(m, &aa, A->pk, A->qr, A->kr, A->vn, A->probs, A->d_o, A->d_qr, A->d_kr, A->d_vn);
    free(A->probs);
    A->probs = NULL;
    if (rc) return rc;

    long kn = (long)T * s->kv_heads * D;
    const real *vraw = s->k_eq_v ? A->k : A->v;
    if (c->family == GEMMA_4) rmsnorm_bwd(vraw, NULL, A->d_vn, A->d_v, (long)T * s->kv_heads, D, c->norm_eps, 0);
    else memcpy(A->d_v, A->d_vn, (size_t)kn * sizeof(real));
    rope_apply(A->d_kr, T, s->kv_heads, D, A->cos[L->kind], A->sin[L->kind], A->pk->pos, -1);
    rmsnorm_bwd(A->k, L->k_norm, A->d_kr, A->d_k, (long)T * s->kv_heads, D, c->norm_eps, 0);
    if (s->k_eq_v)
        for (long i = 0; i < kn; i++) A->d_k[i] += A->d_v[i];
    rope_apply(A->d_qr, T, c->heads, D, A->cos[L->kind], A->sin[L->kind], A->pk->pos, -1);
    rmsnorm_bwd(A->q, L->q_norm, A->d_qr, A->d_q, (long)T * c->heads, D, c->norm_eps, 0);

    linear_bwd(m, l, PROJ_Q, A->a, A->t[PROJ_Q], A->d_q, T, A->d_a, 0, A->d_t);
    linear_bwd(m, l, PROJ_K, A->a, A->t[PROJ_K], A->d_k, T, A->d_a, 1, A->d_t);
    if (!s->k_eq_v) linear_bwd(m, l, PROJ_V, A->a, A->t[PROJ_V], A->d_v, T, A->d_a, 1, A->d_t);
    rmsnorm_bwd(x, L->input_norm, A->d_a, dx, T, H, c->norm_eps, 1);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * The head: final norm, tied logits, final softcap, cross-entropy over masked targets. With dxL
 * not NULL it also writes dL/dxL for loss = grad_scale · Σ CE. */

static int head(model *m, const real *xL, const packing *pk, gemma_stats *st, real *logits_out, double grad_scale,
                real *dxL) {
    const gemma_config *c = &m->cfg;
    int H = c->hidden, V = c->vocab, T = pk->T;
    real *f = malloc((size_t)T * H * sizeof(real));
    real *lg = malloc((size_t)T * V * sizeof(real));
    if (!f || !lg) {
        free(f);
        free(lg);
        return set_err(m, "out of memory for the logits of %d tokens", T);
    }
    rmsnorm_fwd(xL, m->final_norm, f, T, H, c->norm_eps);
    mm(0, 1, T, V, H, 1, f, H, m->lm_head, H, 0, lg, V);
    double cap = c->final_softcap;
    if (cap > 0)
        for (long i = 0; i < (long)T * V; i++) lg[i] = (real)cap * rtanh(lg[i] / (real)cap);
    if (logits_out) memcpy(logits_out, lg, (size_t)T * V * sizeof(real));
    for (int t = 0; t < T; t++) {
        real *row = lg + (long)t * V;
        if (pk->target[t] >= 0) {
            int y = pk->target[t];
            int arg = 0;
            for (int j = 1; j < V; j++) arg = row[j] > row[arg] ? j : arg;
            double mx = row[arg], sum = 0;
            for (int j = 0; j < V; j++) sum += rexp(row[j] - (real)mx);
            double lse = mx + log(sum);
            st->loss_sum += lse - row[y];
            st->tokens++;
            st->agree += arg == y;
            if (dxL) /* d CE / d logit = softmax − onehot, then through the cap: 1 − (capped/cap)² */
                for (int j = 0; j < V; j++) {
                    double g = rexp(row[j] - (real)lse) - (j == y);
                    if (cap > 0) g *= 1 - ((double)row[j] / cap) * ((double)row[j] / cap);
                    row[j] = (real)(grad_scale * g);
                }
        } else if (dxL) {
            memset(row, 0, (size_t)V * sizeof(real));
        }
    }
    if (dxL) {
        mm(0, 0, T, H, V, 1, lg, V, m->lm_head, H, 0, f, H);
        rmsnorm_bwd(xL, m->final_norm, f, dxL, T, H, c->norm_eps, 0);
    }
    free(f);
    free(lg);
    return 0;
}

static void embed(const model *m, const int32_t *tokens, int T, real *x) {
    int H = m->cfg.hidden;
    real scale = (real)m->cfg.embed_scale;
    for (int t = 0; t < T; t++)
        for (int i = 0; i < H; i++) x[(long)t * H + i] = m->embed[(long)tokens[t] * H + i] * scale;
}

static int forward_packed(model *m, const packing *pk, gemma_stats *stats, real *logits) {
    int T = pk->T;
    long TH = (long)T * m->cfg.hidden;
    real *x = malloc((size_t)TH * sizeof(real)), *y = malloc((size_t)TH * sizeof(real));
    acts A;
    int rc = (!x || !y) ? set_err(m, "out of memory for %d tokens", T) : acts_alloc(m, &A, pk, 0);
    if (rc == 0) {
        embed(m, pk->tokens, T, x);
        for (int l = 0; l < m->cfg.layers && rc == 0; l++) {
            rc = layer_forward(m, l, x, &A, y);
            real *swap = x;
            x = y;
            y = swap;
        }
        if (rc == 0) rc = head(m, x, pk, stats, logits, 0, NULL);
        acts_free(&A);
    }
    free(x);
    free(y);
    return rc;
}

static int backward_packed(model *m, const packing *pk, double grad_scale, gemma_stats *stats) {
    int Lc = m->cfg.layers, T = pk->T;
    long TH = (long)T * m->cfg.hidden;
    /* the layer inputs are all the forward keeps; each layer's insides are recomputed */
    real *xs = malloc((size_t)(Lc + 1) * TH * sizeof(real));
    real *dx = malloc((size_t)TH * sizeof(real)), *dprev = malloc((size_t)TH * sizeof(real));
    acts A;
    int rc = (!xs || !dx || !dprev) ? set_err(m, "out of memory for the layer inputs of %d tokens", T)
                                    : acts_alloc(m, &A, pk, 1);
    if (rc == 0) {
        embed(m, pk->tokens, T, xs);
        for (int l = 0; l < Lc && rc == 0; l++) {
            rc = layer_forward(m, l, xs + l * TH, &A, xs + (l + 1) * TH);
            free(A.probs); /* recomputed in the backward */
            A.probs = NULL;
        }
        if (rc == 0) rc = head(m, xs + Lc * TH, pk, stats, NULL, grad_scale, dx);
        for (int l = Lc - 1; l >= 0 && rc == 0; l--) {
            real *scratch = dprev; /* the recomputed output is not needed: write it where dprev goes */
            rc = layer_forward(m, l, xs + l * TH, &A, scratch);
            if (rc == 0) rc = layer_backward(m, l, xs + l * TH, &A, dx, dprev);
            real *swap = dx;
            dx = dprev;
            dprev = swap;
        }
        acts_free(&A);
    }
    free(xs);
    free(dx);
    free(dprev);
    return rc;
}

int MT(gemma_forward_batch)(model *m, const gemma_seq *seqs, int n, gemma_stats *stats, real *logits) {
    packing pk;
    int rc = packing_build(m, seqs, n, &pk);
    if (rc == 0) rc = forward_packed(m, &pk, stats, logits);
    packing_free(&pk);
    return rc;
}

int MT(gemma_backward_batch)(model *m, const gemma_seq *seqs, int n, double grad_scale, gemma_stats *stats) {
    packing pk;
    int rc = packing_build(m, seqs, n, &pk);
    if (rc == 0) rc = backward_packed(m, &pk, grad_scale, stats);
    packing_free(&pk);
    return rc;
}

int MT(gemma_forward)(model *m, const int32_t *tokens, int T, const uint8_t *target_mask, gemma_stats *stats,
                      real *logits) {
    gemma_seq s = {tokens, T, target_mask};
    return MT(gemma_forward_batch)(m, &s, 1, stats, logits);
}

int MT(gemma_backward)(model *m, const int32_t *tokens, int T, const uint8_t *target_mask, double grad_scale,
                       gemma_stats *stats) {
    gemma_seq s = {tokens, T, target_mask};
    return MT(gemma_backward_batch)(m, &s, 1, grad_scale, stats);
}

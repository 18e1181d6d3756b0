/* train.c — the small entries of the trainer's interface (train.h): LoRA projection names and
 * random checkpoints (`winattn init-model`). The training loop is trainer.c. */
#define _GNU_SOURCE
#include "train.h"

#include "atomic_file.h"
#include "config.h"
#include "model.h"
#include "rng.h"
#include "safetensors.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int train_lora_key(const char *name) {
    for (int p = 0; p < PROJ_COUNT; p++)
        if (strcmp(name, gemma_proj_short[p]) == 0) return p;
    return -1;
}

static int fail(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (err && errlen) vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
}

/* Box–Muller normal draws from a splitmix64 stream */
static double init_normal(uint64_t *s) {
    double u1 = ((splitmix64(s) >> 11) + 1) * 0x1.0p-53, u2 = splitmix64_unit(s);
    return sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2);
}

typedef struct init_tensor {
    char name[128];
    int64_t rows, cols; /* cols 0: a vector; rows 0: a one-element [1] */
    double std, fill;   /* normal(0, std) when std > 0, else every element = fill */
} init_tensor;

/* the config travels with the weights, byte for byte */
static int copy_config(const char *cfg_path, const char *out, char *err, size_t errlen) {
    FILE *f = fopen(cfg_path, "rb");
    if (!f) return fail(err, errlen, "%s: cannot open", cfg_path);
    char *text = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&text, &len);
    if (!mem) {
        fclose(f);
        return fail(err, errlen, "out of memory reading %s", cfg_path);
    }
    int ch;
    while ((ch = fgetc(f)) != EOF) fputc(ch, mem);
    fclose(f);
    fclose(mem);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", out);
    int rc = write_text_atomic(path, text, err, errlen);
    free(text);
    return rc;
}

/* transformers' Gemma initialisation: linear and embedding weights N(0, 0.02), norms 1 (Gemma 4)
 * or 0 (Gemma 3, whose norms use 1 + w), layer_scalar 1. */
int train_init_model(const char *cfg_path, const char *out, uint64_t seed, int f32, char *summary, size_t summary_len,
                     char *err, size_t errlen) {
    st_dtype dtype = f32 ? ST_F32 : ST_BF16;
    gemma_config c;
    if (gemma_config_load(cfg_path, &c, err, errlen) != 0) return -1;
    if (mkdir(out, 0777) != 0 && errno != EEXIST) return fail(err, errlen, "%s: cannot create the directory", out);

    int cap = 3 + c.layers * 16, n = 0;
    init_tensor *ts = calloc((size_t)cap, sizeof *ts);
    if (!ts) return fail(err, errlen, "out of memory");
    double norm_fill = c.family == GEMMA_3 ? 0.0 : 1.0;
#define ADD(rows_, cols_, std_, fill_, ...)                                        \
    do {                                                                          \
        snprintf(ts[n].name, sizeof ts[n].name, __VA_ARGS__);                     \
        ts[n].rows = rows_, ts[n].cols = cols_, ts[n].std = std_, ts[n].fill = fill_; \
        n++;                                                                      \
    } while (0)
    ADD(c.vocab, c.hidden, 0.02, 0, "model.embed_tokens.weight");
    for (int l = 0; l < c.layers; l++) {
        const gemma_attn_shape *a = &c.kind[c.layer_kind[l]];
        int qd = c.heads * a->head_dim, kd = a->kv_heads * a->head_dim;
        ADD(qd, c.hidden, 0.02, 0, "model.layers.%d.self_attn.q_proj.weight", l);
        ADD(kd, c.hidden, 0.02, 0, "model.layers.%d.self_attn.k_proj.weight", l);
        if (!a->k_eq_v) ADD(kd, c.hidden, 0.02, 0, "model.layers.%d.self_attn.v_proj.weight", l);
        ADD(c.hidden, qd, 0.02, 0, "model.layers.%d.self_attn.o_proj.weight", l);
        ADD(a->head_dim, 0, 0, norm_fill, "model.layers.%d.self_attn.q_norm.weight", l);
        ADD(a->head_dim, 0, 0, norm_fill, "model.layers.%d.self_attn.k_norm.weight", l);
        ADD(c.intermediate, c.hidden, 0.02, 0, "model.layers.%d.mlp.gate_proj.weight", l);
        ADD(c.intermediate, c.hidden, 0.02, 0, "model.layers.%d.mlp.up_proj.weight", l);
        ADD(c.hidden, c.intermediate, 0.02, 0, "model.layers.%d.mlp.down_proj.weight", l);
        ADD(c.hidden, 0, 0, norm_fill, "model.layers.%d.input_layernorm.weight", l);
        ADD(c.hidden, 0, 0, norm_fill, "model.layers.%d.post_attention_layernorm.weight", l);
        ADD(c.hidden, 0, 0, norm_fill, "model.layers.%d.pre_feedforward_layernorm.weight", l);
        ADD(c.hidden, 0, 0, norm_fill, "model.layers.%d.post_feedforward_layernorm.weight", l);
        if (c.family == GEMMA_4) ADD(0, 0, 0, 1.0, "model.layers.%d.layer_scalar", l);
    }
    ADD(c.hidden, 0, 0, norm_fill, "model.norm.weight");
    if (!c.tied_embeddings) ADD(c.vocab, c.hidden, 0.02, 0, "lm_head.weight");
#undef ADD
    st_out *outs = calloc((size_t)n, sizeof *outs);
    if (!outs) {
        free(ts);
        return fail(err, errlen, "out of memory");
    }
    size_t esz = st_dtype_size(dtype);
    uint64_t s = seed;
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        init_tensor *t = &ts[i];
        size_t count = t->rows == 0 ? 1 : (size_t)t->rows * (size_t)(t->cols ? t->cols : 1);
        size_t bytes = count * esz;
        void *mem = NULL;
        if (posix_memalign(&mem, 64, bytes ? bytes : 64) != 0) {
            rc = fail(err, errlen, "out of memory allocating %zu bytes for %s", bytes, t->name);
            break;
        }
        unsigned char *data = mem;
        for (size_t j = 0; j < count; j++) {
            float x = (float)(t->std > 0 ? t->std * init_normal(&s) : t->fill);
            if (dtype == ST_F32) memcpy(data + 4 * j, &x, 4);
            else {
                uint32_t u;
                memcpy(&u, &x, 4);
                uint16_t b = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16); /* round to nearest even */
                memcpy(data + 2 * j, &b, 2);
            }
        }
        outs[i].name = t->name;
        outs[i].dtype = dtype;
        outs[i].rank = t->cols ? 2 : 1;
        outs[i].shape[0] = t->rows ? t->rows : 1;
        outs[i].shape[1] = t->cols;
        outs[i].data = data;
    }
    if (rc == 0) {
        char path[4096], seed_text[32];
        snprintf(seed_text, sizeof seed_text, "%llu", (unsigned long long)seed);
        const char *meta[] = {"format", "pt", "winattn_init_seed", seed_text, NULL};
        snprintf(path, sizeof path, "%s/model.safetensors", out);
        rc = st_write(path, outs, n, meta, err, errlen);
    }
    for (int i = 0; i < n; i++) free((void *)outs[i].data);
    free(outs);
    free(ts);
    if (rc) return -1;
    if (copy_config(cfg_path, out, err, errlen) != 0) return -1;
    gemma_config_describe(&c, summary, summary_len);
    return 0;
}

/* config.c — config.json → gemma_config (see config.h), with jansson. Every field the model
 * needs is checked for type and range; absent optional fields take the defaults transformers
 * gives them. */
#define _GNU_SOURCE
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct parse_ctx {
    const char *name;
    char *err;
    size_t errlen;
    int failed;
} parse_ctx;

static int fail(parse_ctx *p, const char *fmt, ...) {
    if (p->failed) return -1;
    p->failed = 1;
    if (p->err && p->errlen) {
        int n = snprintf(p->err, p->errlen, "%s: ", p->name);
        va_list ap;
        va_start(ap, fmt);
        if (n >= 0 && (size_t)n < p->errlen) vsnprintf(p->err + n, p->errlen - (size_t)n, fmt, ap);
        va_end(ap);
        /* strings from the file (a model_type, a key, jansson's quote of the input near a syntax
         * error) may hold control characters: '?' for those, so the message stays one line */
        for (char *c = p->err + (n > 0 && (size_t)n < p->errlen ? n : 0); *c; c++)
            if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = '?';
    }
    return -1;
}

/* The value as JSON text for a message, cut to fit one line. */
static const char *shown(const json_t *v, char *buf, size_t len) {
    char *text = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    snprintf(buf, len, "%s", text ? text : "?");
    if (text && strlen(text) >= len && len > 4) strcpy(buf + len - 4, "...");
    free(text);
    return buf;
}

/* An integer field: required when dflt < 0 is not allowed by the caller (has_default = 0). */
static int get_int(parse_ctx *p, const json_t *obj, const char *key, int has_default, long dflt, long lo, long hi) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) {
        if (!has_default) fail(p, "missing \"%s\"", key);
        return (int)dflt;
    }
    char b[48];
    if (!json_is_integer(v)) return fail(p, "\"%s\" must be an integer, not %s", key, shown(v, b, sizeof b)), 0;
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi) return fail(p, "\"%s\" = %lld is out of range [%ld, %ld]", key, (long long)x, lo, hi), 0;
    return (int)x;
}

/* A number field; null and absence give dflt (softcaps are null when off). */
static double get_num(parse_ctx *p, const json_t *obj, const char *key, double dflt) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) return dflt;
    char b[48];
    if (!json_is_number(v)) return fail(p, "\"%s\" must be a number, not %s", key, shown(v, b, sizeof b)), dflt;
    double x = json_number_value(v);
    if (!isfinite(x)) return fail(p, "\"%s\" is not finite", key), dflt;
    return x;
}

static int get_bool(parse_ctx *p, const json_t *obj, const char *key, int dflt) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) return dflt;
    char b[48];
    if (!json_is_boolean(v)) return fail(p, "\"%s\" must be true or false, not %s", key, shown(v, b, sizeof b)), dflt;
    return json_is_true(v);
}

static const char *get_str(const json_t *obj, const char *key) {
    const json_t *v = json_object_get(obj, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* One rope_parameters entry (transformers 5) or the legacy flat fields. */
static void parse_rope(parse_ctx *p, const json_t *r, gemma_rope *out, double default_theta) {
    out->theta = default_theta;
    out->partial = 1.0;
    out->linear_factor = 1.0;
    out->proportional = 0;
    if (!r || json_is_null(r)) return;
    if (!json_is_object(r)) {
        fail(p, "rope parameters must be an object");
        return;
    }
    const char *type = get_str(r, "rope_type");
    if (!type) type = get_str(r, "type");
    out->theta = get_num(p, r, "rope_theta", default_theta);
    if (!type || strcmp(type, "default") == 0) {
    } else if (strcmp(type, "proportional") == 0) {
        out->proportional = 1;
        out->partial = get_num(p, r, "partial_rotary_factor", 1.0);
    } else if (strcmp(type, "linear") == 0) {
        out->linear_factor = get_num(p, r, "factor", 1.0);
    } else {
        fail(p, "rope_type \"%s\" is not implemented (default, proportional, linear are)", type);
    }
    if (out->theta <= 0) fail(p, "rope_theta must be positive");
    if (out->partial <= 0 || out->partial > 1) fail(p, "partial_rotary_factor must be in (0, 1]");
    if (out->linear_factor <= 0) fail(p, "rope factor must be positive");
}

/* Features of the Gemma family the trainer leaves out: a config that turns one on is refused. */
static void refuse_unimplemented(parse_ctx *p, const json_t *t) {
    if (get_int(p, t, "hidden_size_per_layer_input", 1, 0, 0, 1 << 20) > 0)
        fail(p, "per-layer embeddings (hidden_size_per_layer_input > 0) are not implemented");
    if (get_int(p, t, "num_kv_shared_layers", 1, 0, 0, 1 << 20) > 0)
        fail(p, "KV sharing (num_kv_shared_layers > 0) is not implemented");
    if (get_bool(p, t, "enable_moe_block", 0))
        fail(p, "the mixture-of-experts block (enable_moe_block) is not implemented");
    if (get_int(p, t, "num_experts", 1, 0, 0, 1 << 20) > 0)
        fail(p, "mixture of experts (num_experts > 0) is not implemented");
    if (get_bool(p, t, "use_double_wide_mlp", 0))
        fail(p, "the double-wide MLP (use_double_wide_mlp) is not implemented");
    const char *act = get_str(t, "hidden_activation");
    if (!act) act = get_str(t, "hidden_act");
    if (act && strcmp(act, "gelu_pytorch_tanh") != 0)
        fail(p, "hidden_activation \"%s\" is not implemented (gelu_pytorch_tanh is)", act);
    const json_t *bidir = json_object_get(t, "use_bidirectional_attention");
    if (json_is_true(bidir) || (json_is_string(bidir) && strcmp(json_string_value(bidir), "all") == 0))
        fail(p, "bidirectional text attention is not implemented");
    if (get_bool(p, t, "attention_bias", 0)) fail(p, "attention_bias is not implemented");
}

static void parse_text_config(parse_ctx *p, const json_t *t, gemma_family fam, gemma_config *c) {
    c->family = fam;
    c->vocab = get_int(p, t, "vocab_size", 0, 0, 1, 1 << 24);
    c->hidden = get_int(p, t, "hidden_size", 0, 0, 1, 1 << 20);
    c->intermediate = get_int(p, t, "intermediate_size", 0, 0, 1, 1 << 22);
    c->layers = get_int(p, t, "num_hidden_layers", 0, 0, 1, GEMMA_MAX_LAYERS);
    c->heads = get_int(p, t, "num_attention_heads", 0, 0, 1, 1024);
    int kv = get_int(p, t, "num_key_value_heads", 1, c->heads, 1, 1024);
    int hd = get_int(p, t, "head_dim", 1, c->heads ? c->hidden / c->heads : 0, 2, 1024);
    if (!p->failed && (hd < 2 || hd > 1024))
        fail(p, "no \"head_dim\", and hidden_size / num_attention_heads = %d / %d = %d is out of range [2, 1024]",
             c->hidden, c->heads, hd);
    c->sliding_window = get_int(p, t, "sliding_window", 0, 0, 1, 1 << 30);
    c->norm_eps = get_num(p, t, "rms_norm_eps", 1e-6);
    c->final_softcap = get_num(p, t, "final_logit_softcapping", 0.0);
    /* transformers 5.x keeps attn_logit_softcapping as Gemma3Attention.attn_logit_softcapping but
     * calls the attention function without softcap=, so no implementation (eager included) caps the
     * scores; Gemma 4's text attention has no cap at all. A checkpoint whose config sets it is run as
     * transformers runs it: uncapped. */
    c->attn_softcap_ignored = get_num(p, t, "attn_logit_softcapping", 0.0);
    c->attn_softcap = 0;
    c->tied_embeddings = get_bool(p, t, "tie_word_embeddings", 1);
    refuse_unimplemented(p, t);
    /* every later step divides by or indexes with what was read: a failed read left 0 there */
    if (p->failed) return;
    if (c->final_softcap < 0 || c->attn_softcap_ignored < 0) fail(p, "softcaps must be positive or null");
    if (c->norm_eps <= 0) fail(p, "rms_norm_eps must be positive");

    gemma_attn_shape *sl = &c->kind[LAYER_SLIDING], *fu = &c->kind[LAYER_FULL];
    sl->kv_heads = kv;
    sl->head_dim = hd;
    sl->k_eq_v = 0;
    *fu = *sl;
    if (fam == GEMMA_4) {
        /* full layers may have their own head dim and KV heads, and share K and V weights */
        fu->head_dim = get_int(p, t, "global_head_dim", 1, hd, 2, 1024);
        fu->kv_heads = get_int(p, t, "num_global_key_value_heads", 1, kv, 1, 1024);
        fu->k_eq_v = get_bool(p, t, "attention_k_eq_v", 0);
        c->score_scale = 1.0;
        if (p->failed) return;
    } else {
        double qpas = get_num(p, t, "query_pre_attn_scalar", (double)hd);
        if (qpas <= 0) fail(p, "query_pre_attn_scalar must be positive");
        c->score_scale = 1.0 / sqrt(qpas);
        if (p->failed) return;
    }

    /* layer kinds: the explicit list, else Gemma 3's rule (every sliding_window_pattern-th is full) */
    const json_t *types = json_object_get(t, "layer_types");
    if (types && !json_is_null(types)) {
        if (!json_is_array(types) || (int)json_array_size(types) != c->layers) {
            fail(p, "\"layer_types\" must list num_hidden_layers (%d) entries", c->layers);
            return;
        }
        for (int l = 0; l < c->layers; l++) {
            const char *s = json_string_value(json_array_get(types, (size_t)l));
            if (s && strcmp(s, "sliding_attention") == 0) c->layer_kind[l] = LAYER_SLIDING;
            else if (s && strcmp(s, "full_attention") == 0) c->layer_kind[l] = LAYER_FULL;
            else {
                fail(p, "layer_types[%d] must be \"sliding_attention\" or \"full_attention\"", l);
                return;
            }
        }
    } else {
        int pattern = get_int(p, t, "sliding_window_pattern", 1, 6, 1, 1 << 20);
        if (p->failed) return;
        for (int l = 0; l < c->layers; l++) c->layer_kind[l] = (l + 1) % pattern == 0 ? LAYER_FULL : LAYER_SLIDING;
    }

    /* transformers ≥ 5.17 writes the full layers' shape as per-layer overrides,
     * "per_layer_config": {"05": {"head_dim": 64, "num_key_value_heads": 1}, ...}, instead of
     * global_head_dim / num_global_key_value_heads. The model keeps one shape per layer kind, so
     * the overrides must agree within a kind. */
    const json_t *plc = json_object_get(t, "per_layer_config");
    if (plc && !json_is_null(plc)) {
        if (!json_is_object(plc)) {
            fail(p, "\"per_layer_config\" must be an object");
            return;
        }
        int seen[2] = {0, 0};
        unsigned char covered[GEMMA_MAX_LAYERS] = {0};
        const char *key;
        const json_t *ov;
        json_object_foreach((json_t *)plc, key, ov) {
            /* digits only: strtol alone would take " 1", "+1" and "1e0" */
            long l = 0;
            size_t n = 0;
            while (key[n] >= '0' && key[n] <= '9' && n < 9) l = l * 10 + (key[n++] - '0');
            if (n == 0 || key[n] != '\0' || l >= c->layers || !json_is_object(ov)) {
                fail(p, "per_layer_config key \"%s\" must be a layer index below %d with an object", key, c->layers);
                return;
            }
            gemma_attn_shape want = c->kind[c->layer_kind[l]];
            want.head_dim = get_int(p, ov, "head_dim", 1, want.head_dim, 2, 1024);
            want.kv_heads = get_int(p, ov, "num_key_value_heads", 1, want.kv_heads, 1, 1024);
            if (p->failed) return;
            gemma_attn_shape *have = &c->kind[c->layer_kind[l]];
            if (seen[c->layer_kind[l]] && (have->head_dim != want.head_dim || have->kv_heads != want.kv_heads)) {
                fail(p, "per_layer_config gives layers of one kind different shapes (not implemented)");
                return;
            }
            seen[c->layer_kind[l]] = 1;
            covered[l] = 1;
            have->head_dim = want.head_dim;
            have->kv_heads = want.kv_heads;
        }
        for (int l = 0; l < c->layers; l++) /* an override for some layers of a kind but not all */
            if (seen[c->layer_kind[l]] && !covered[l]) {
                fail(p, "per_layer_config covers some %s layers but not layer %d (not implemented)",
                     c->layer_kind[l] == LAYER_FULL ? "full" : "sliding", l);
                return;
            }
    }
    for (int k = 0; k < 2; k++) {
        if (c->kind[k].head_dim % 2) fail(p, "head dims must be even for rotary embeddings");
        if (c->heads % c->kind[k].kv_heads)
            fail(p, "num_attention_heads (%d) must be a multiple of the KV heads (%d)", c->heads, c->kind[k].kv_heads);
    }

    /* RoPE: transformers 5 keeps one entry per layer type; older configs use flat fields */
    const json_t *rp = json_object_get(t, "rope_parameters");
    if (json_is_object(rp) && json_object_get(rp, "sliding_attention")) {
        parse_rope(p, json_object_get(rp, "sliding_attention"), &sl->rope, 10000.0);
        parse_rope(p, json_object_get(rp, "full_attention"), &fu->rope, 1000000.0);
    } else {
        double theta = get_num(p, t, "rope_theta", 1000000.0);
        parse_rope(p, json_is_object(rp) ? rp : json_object_get(t, "rope_scaling"), &fu->rope, theta);
        if (!json_is_object(rp)) fu->rope.theta = theta;
        sl->rope.theta = get_num(p, t, "rope_local_base_freq", 10000.0);
        sl->rope.partial = 1.0;
        sl->rope.linear_factor = 1.0;
        sl->rope.proportional = 0;
    }
    /* the flat fields bypass parse_rope's check: a negative rope_theta beside a rope_scaling
     * object, or a rope_local_base_freq of 0, was accepted */
    for (int k = 0; k < 2; k++)
        if (!(c->kind[k].rope.theta > 0))
            fail(p, "%s must be positive", k == LAYER_FULL ? "rope_theta" : "rope_local_base_freq");
    c->embed_scale = sqrt((double)c->hidden);
}

int gemma_config_parse(const char *json_text, const char *name, gemma_config *cfg, char *err, size_t errlen) {
    parse_ctx p = {name, err, errlen, 0};
    memset(cfg, 0, sizeof *cfg);
    json_error_t je;
    json_t *root = json_loads(json_text, JSON_REJECT_DUPLICATES, &je);
    if (!root) return fail(&p, "not valid JSON (line %d: %s)", je.line, je.text);
    if (!json_is_object(root)) {
        json_decref(root);
        return fail(&p, "the top level must be a JSON object");
    }
    const json_t *text = json_object_get(root, "text_config");
    const json_t *t = json_is_object(text) ? text : root;
    const char *type = get_str(t, "model_type");
    if (!type) type = get_str(root, "model_type");
    if (!type) {
        json_decref(root);
        return fail(&p, "no \"model_type\"");
    }
    if (strncmp(type, "gemma4", 6) == 0) parse_text_config(&p, t, GEMMA_4, cfg);
    else if (strncmp(type, "gemma3", 6) == 0) parse_text_config(&p, t, GEMMA_3, cfg);
    else fail(&p, "model_type \"%s\" is not implemented (gemma4, gemma4_text, gemma3, gemma3_text are)", type);
    json_decref(root);
    return p.failed ? -1 : 0;
}

/* config.json files are a few kilobytes; this bound keeps a wrong path (a model file, /dev/zero)
 * from being read into memory */
#define CONFIG_MAX_BYTES (16 << 20)

int gemma_config_load(const char *path, gemma_config *cfg, char *err, size_t errlen) {
    /* O_NONBLOCK: opening a FIFO must not wait for a writer; a FIFO is refused just below */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "%s: not a regular file", path);
        close(fd);
        return -1;
    }
    if (st.st_size > CONFIG_MAX_BYTES) {
        snprintf(err, errlen, "%s: %lld bytes, larger than a config.json can be (%d MB)", path, (long long)st.st_size,
                 CONFIG_MAX_BYTES >> 20);
        close(fd);
        return -1;
    }
    char *buf = malloc((size_t)st.st_size + 1);
    size_t len = 0;
    while (buf && len < (size_t)st.st_size) {
        ssize_t n = read(fd, buf + len, (size_t)st.st_size - len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break; /* an error, or a file that shrank */
        len += (size_t)n;
    }
    close(fd);
    if (!buf || len != (size_t)st.st_size) {
        snprintf(err, errlen, "%s: %s", path, buf ? "read error" : "out of memory");
        free(buf);
        return -1;
    }
    buf[len] = '\0';
    int rc = gemma_config_parse(buf, path, cfg, err, errlen);
    free(buf);
    return rc;
}

void gemma_config_describe(const gemma_config *c, char *buf, size_t buflen) {
    int full = 0;
    for (int l = 0; l < c->layers; l++) full += c->layer_kind[l] == LAYER_FULL;
    snprintf(buf, buflen,
             "Gemma %d: %d layers (%d sliding, %d full), hidden %d, MLP %d, vocab %d, %d heads; sliding: %d KV x %d, "
             "window %d; full: %d KV x %d%s; final softcap %g",
             c->family == GEMMA_4 ? 4 : 3, c->layers, c->layers - full, full, c->hidden, c->intermediate, c->vocab,
             c->heads, c->kind[0].kv_heads, c->kind[0].head_dim, c->sliding_window, c->kind[1].kv_heads,
             c->kind[1].head_dim, c->kind[1].k_eq_v ? ", k_eq_v" : "", c->final_softcap);
    size_t n = strlen(buf);
    if (c->attn_softcap_ignored > 0 && n < buflen)
        snprintf(buf + n, buflen - n, "; attn_logit_softcapping %g not applied, as in transformers",
                 c->attn_softcap_ignored);
}

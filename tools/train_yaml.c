/* train_yaml.c — mlx-lm's LoRA config file for `winattn train -c FILE` (train_yaml.h). libyaml's
 * document loader does the YAML (block and flow styles, quoting, anchors); this file only maps the
 * loaded tree onto train_options, key by key.
 *
 * Scalars are typed as mlx-lm's loader (PyYAML's SafeLoader with a float resolver) types them:
 * plain scalars are numbers, booleans (true/false, yes/no, on/off) or null (~, null, empty); a
 * quoted scalar is always a string. A null value leaves the setting at its default, as a missing
 * key does, which is what mlx-lm does with the None it loads. */
#define _GNU_SOURCE
#include "train_yaml.h"

#include <yaml.h>

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct reader {
    const char *path;
    yaml_document_t *doc;
    char *err;
    size_t errlen;
} reader;

static int fail_at(const reader *r, const yaml_node_t *n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail_at(const reader *r, const yaml_node_t *n, const char *fmt, ...) {
    int at = snprintf(r->err, r->errlen, "%s:%lu: ", r->path, n ? (unsigned long)n->start_mark.line + 1 : 1ul);
    if (at < 0 || (size_t)at >= r->errlen) return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->err + at, r->errlen - (size_t)at, fmt, ap);
    va_end(ap);
    return -1;
}

static yaml_node_t *node_at(const reader *r, int index) { return yaml_document_get_node(r->doc, index); }

static const char *scalar_text(const yaml_node_t *n) {
    return n && n->type == YAML_SCALAR_NODE ? (const char *)n->data.scalar.value : NULL;
}

static int is_plain(const yaml_node_t *n) {
    return n && n->type == YAML_SCALAR_NODE && n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
}

static int is_null(const yaml_node_t *n) {
    if (!is_plain(n)) return 0;
    const char *s = scalar_text(n);
    return !*s || strcmp(s, "~") == 0 || strcmp(s, "null") == 0 || strcmp(s, "Null") == 0 || strcmp(s, "NULL") == 0;
}

/* what a value is, for messages: 'text' for a scalar (cut at 60 characters), else its kind */
static const char *describe(const yaml_node_t *n, char *buf, size_t len) {
    if (n && n->type == YAML_MAPPING_NODE) return "a mapping";
    if (n && n->type == YAML_SEQUENCE_NODE) {
        long count = n->data.sequence.items.top - n->data.sequence.items.start;
        snprintf(buf, len, "a list of %ld", count);
        return buf;
    }
    const char *s = scalar_text(n);
    snprintf(buf, len, "'%.60s%s'", s ? s : "", s && strlen(s) > 60 ? "..." : "");
    return buf;
}

/* the refusal of a scalar that is not a number or boolean: a quoted one says why */
static const char *quoted_note(const yaml_node_t *n) {
    return n && n->type == YAML_SCALAR_NODE && !is_plain(n) ? " (quoted, so a string)" : "";
}

static int get_bool(const reader *r, const yaml_node_t *n, const char *key, int *out) {
    static const char *const yes[] = {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"};
    static const char *const no[] = {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"};
    if (is_plain(n))
        for (size_t i = 0; i < sizeof yes / sizeof *yes; i++) {
            if (strcmp(scalar_text(n), yes[i]) == 0) return *out = 1, 0;
            if (strcmp(scalar_text(n), no[i]) == 0) return *out = 0, 0;
        }
    char buf[80];
    return fail_at(r, n, "%s: true or false, not %s%s", key, describe(n, buf, sizeof buf), quoted_note(n));
}

static int get_int(const reader *r, const yaml_node_t *n, const char *key, long lo, long hi, int *out) {
    const char *s = is_plain(n) ? scalar_text(n) : NULL;
    char *end;
    errno = 0;
    long v = s && *s ? strtol(s, &end, 10) : 0;
    char buf[80];
    if (!s || !*s || errno || *end || v < lo || v > hi)
        return fail_at(r, n, "%s: an integer from %ld to %ld, not %s%s", key, lo, hi, describe(n, buf, sizeof buf),
                       quoted_note(n));
    *out = (int)v;
    return 0;
}

/* a finite number in [lo, hi] (or above lo when lo_open) */
static int get_number(const reader *r, const yaml_node_t *n, const char *key, double lo, int lo_open, double hi,
                      double *out) {
    const char *s = is_plain(n) ? scalar_text(n) : NULL;
    char *end;
    errno = 0;
    double v = s && *s ? strtod(s, &end) : 0;
    char buf[80], range[64];
    if (!s || !*s || errno || *end || !isfinite(v) || strpbrk(s, "xX") || v < lo || (lo_open && v == lo) || v > hi) {
        if (hi < HUGE_VAL) snprintf(range, sizeof range, "from %g to %g", lo, hi);
        else snprintf(range, sizeof range, lo_open ? "above %g" : "of %g or more", lo);
        return fail_at(r, n, "%s: a number %s, not %s%s", key, range, describe(n, buf, sizeof buf), quoted_note(n));
    }
    *out = v;
    return 0;
}

static int get_string(const reader *r, const yaml_node_t *n, const char *key, char **out) {
    const char *s = scalar_text(n);
    char buf[80];
    if (!s || !*s) return fail_at(r, n, "%s: a non-empty string, not %s", key, describe(n, buf, sizeof buf));
    if (strlen(s) != n->data.scalar.length) return fail_at(r, n, "%s: the string holds a NUL character", key);
    free(*out);
    if (!(*out = strdup(s))) return fail_at(r, n, "%s: out of memory", key);
    return 0;
}

/* a mapping's key as text, or the one-line refusal of a key that is not a plain string */
static const char *key_text(const reader *r, const yaml_node_t *k, const char *where) {
    const char *s = scalar_text(k);
    if (!s) fail_at(r, k, "%s%sa key must be a name, not a %s", where, *where ? ": " : "",
                    k && k->type == YAML_MAPPING_NODE ? "mapping" : "list");
    return s;
}

/* Refuses a key given twice in one mapping (YAML leaves it to the application; PyYAML keeps the
 * last silently, which hides which one the file meant). */
static int check_duplicate(const reader *r, const yaml_node_t *map, const yaml_node_pair_t *pair, const char *where) {
    const char *name = scalar_text(node_at(r, pair->key));
    for (const yaml_node_pair_t *p = map->data.mapping.pairs.start; p < pair; p++) {
        const char *other = scalar_text(node_at(r, p->key));
        if (other && strcmp(other, name) == 0)
            return fail_at(r, node_at(r, pair->key), "%s%s%s: given twice", where, *where ? "." : "", name);
    }
    return 0;
}

static int expect_mapping(const reader *r, const yaml_node_t *n, const char *key) {
    char buf[80];
    if (n->type != YAML_MAPPING_NODE) return fail_at(r, n, "%s: a mapping, not %s", key, describe(n, buf, sizeof buf));
    return 0;
}

/* The edit distance between two short names, for "did you mean" (0..3; 3 means 3 or more). */
static int edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63) return 3;
    int d[64][64];
    for (size_t i = 0; i <= la; i++) d[i][0] = (int)i;
    for (size_t j = 0; j <= lb; j++) d[0][j] = (int)j;
    for (size_t i = 1; i <= la; i++)
        for (size_t j = 1; j <= lb; j++) {
            int best = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
            if (d[i - 1][j] + 1 < best) best = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < best) best = d[i][j - 1] + 1;
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] && d[i - 2][j - 2] + 1 < best)
                best = d[i - 2][j - 2] + 1;
            d[i][j] = best;
        }
    return d[la][lb] < 3 ? d[la][lb] : 3;
}

static int unknown_key(const reader *r, const yaml_node_t *k, const char *where, const char *name,
                       const char *const *known, size_t count) {
    const char *near = NULL;
    int best = 3;
    for (size_t i = 0; i < count; i++) {
        int dist = edit_distance(name, known[i]);
        if (dist < best) best = dist, near = known[i];
    }
    char hint[96] = "";
    if (near) snprintf(hint, sizeof hint, "did you mean '%s%s%s'? ", where, *where ? "." : "", near);
    return fail_at(r, k, "unknown key '%s%s%s' (%swinattn train --help lists the keys)", where, *where ? "." : "", name,
                   hint);
}

static int is_known(const char *name, const char *const *known, size_t count) {
    for (size_t i = 0; i < count; i++)
        if (strcmp(name, known[i]) == 0) return 1;
    return 0;
}

#define COUNT(a) (sizeof(a) / sizeof *(a))

/* ------------------------------------------------------------------------------------------- */

/* mlx-lm names a LoRA target by its module path inside a decoder layer (lora_parameters.keys);
 * peft users write the bare projection name, the command line the short one. Any of the three. */
static const char *const module_paths[][2] = {
    {"self_attn.q_proj", "q"}, {"self_attn.k_proj", "k"}, {"self_attn.v_proj", "v"}, {"self_attn.o_proj", "o"},
    {"mlp.gate_proj", "gate"}, {"mlp.up_proj", "up"},     {"mlp.down_proj", "down"},
};

static int lora_key_bit(const char *name) {
    for (size_t i = 0; i < COUNT(module_paths); i++) {
        const char *path = module_paths[i][0], *bare = strchr(path, '.') + 1;
        if (strcmp(name, path) == 0 || strcmp(name, bare) == 0) return train_lora_key(module_paths[i][1]);
    }
    return train_lora_key(name);
}

static int read_lora_parameters(const reader *r, const yaml_node_t *map, train_options *o) {
    static const char *const known[] = {"keys", "rank", "scale", "dropout", "alpha"};
    if (expect_mapping(r, map, "lora_parameters") != 0) return -1;
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        yaml_node_t *k = node_at(r, p->key), *v = node_at(r, p->value);
        const char *name = key_text(r, k, "lora_parameters");
        if (!name || check_duplicate(r, map, p, "lora_parameters") != 0) return -1;
        if (!is_known(name, known, COUNT(known))) return unknown_key(r, k, "lora_parameters", name, known, COUNT(known));
        if (is_null(v)) continue;
        char buf[80];
        if (strcmp(name, "rank") == 0) {
            if (get_int(r, v, "lora_parameters.rank", 1, 4096, &o->lora.rank) != 0) return -1;
        } else if (strcmp(name, "scale") == 0) {
            if (get_number(r, v, "lora_parameters.scale", 0, 1, HUGE_VAL, &o->lora.scale) != 0) return -1;
        } else if (strcmp(name, "dropout") == 0) {
            double dropout;
            if (get_number(r, v, "lora_parameters.dropout", 0, 0, 1, &dropout) != 0) return -1;
            if (dropout != 0) return fail_at(r, v, "lora_parameters.dropout: %g: LoRA dropout is not implemented (0 only)", dropout);
        } else if (strcmp(name, "alpha") == 0) {
            return fail_at(r, k, "lora_parameters.alpha: mlx-lm's LoRA takes scale (the factor on x A B; peft's alpha / rank), not alpha");
        } else {
            if (v->type != YAML_SEQUENCE_NODE)
                return fail_at(r, v, "lora_parameters.keys: a list of projections, not %s", describe(v, buf, sizeof buf));
            unsigned mask = 0;
            for (yaml_node_item_t *it = v->data.sequence.items.start; it < v->data.sequence.items.top; it++) {
                yaml_node_t *item = node_at(r, *it);
                const char *s = scalar_text(item);
                int bit = s ? lora_key_bit(s) : -1;
                if (bit < 0)
                    return fail_at(r, item, "lora_parameters.keys: %s is not a projection this trainer adapts "
                                   "(self_attn.q_proj, k_proj, v_proj, o_proj, mlp.gate_proj, up_proj, down_proj)",
                                   describe(item, buf, sizeof buf));
                mask |= 1u << bit;
            }
            if (!mask) return fail_at(r, v, "lora_parameters.keys: an empty list adapts nothing");
            o->lora.proj_mask = mask;
        }
    }
    return 0;
}

static int read_adam(const reader *r, const yaml_node_t *map, const char *where, int adamw, optimizer_file_settings *s) {
    static const char *const known[] = {"betas", "eps", "bias_correction", "weight_decay"};
    if (expect_mapping(r, map, where) != 0) return -1;
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        yaml_node_t *k = node_at(r, p->key), *v = node_at(r, p->value);
        const char *name = key_text(r, k, where);
        if (!name || check_duplicate(r, map, p, where) != 0) return -1;
        if (!is_known(name, known, COUNT(known)) || (!adamw && strcmp(name, "weight_decay") == 0)) {
            if (strcmp(name, "weight_decay") == 0)
                return fail_at(r, k, "%s.weight_decay: MLX's Adam has no weight decay (optimizer: adamw has)", where);
            return unknown_key(r, k, where, name, known, COUNT(known) - !adamw);
        }
        if (is_null(v)) continue;
        char key[96], buf[80];
        snprintf(key, sizeof key, "%s.%s", where, name);
        if (strcmp(name, "betas") == 0) {
            if (v->type != YAML_SEQUENCE_NODE || v->data.sequence.items.top - v->data.sequence.items.start != 2)
                return fail_at(r, v, "%s: a list of two numbers [beta1, beta2], not %s", key, describe(v, buf, sizeof buf));
            if (get_number(r, node_at(r, v->data.sequence.items.start[0]), key, 0, 0, 1, &s->beta1) != 0 ||
                get_number(r, node_at(r, v->data.sequence.items.start[1]), key, 0, 0, 1, &s->beta2) != 0)
                return -1;
            if (s->beta1 >= 1 || s->beta2 >= 1) return fail_at(r, v, "%s: each beta below 1", key);
            s->has_betas = 1;
        } else if (strcmp(name, "eps") == 0) {
            if (get_number(r, v, key, 0, 1, HUGE_VAL, &s->eps) != 0) return -1;
            s->has_eps = 1;
        } else if (strcmp(name, "bias_correction") == 0) {
            if (get_bool(r, v, key, &s->bias_correction) != 0) return -1;
            s->has_bias_correction = 1;
        } else {
            if (get_number(r, v, key, 0, 0, HUGE_VAL, &s->weight_decay) != 0) return -1;
            s->has_weight_decay = 1;
        }
    }
    return 0;
}

static int read_optimizer_config(const reader *r, const yaml_node_t *map, train_file *f) {
    /* mlx-lm's CONFIG_DEFAULTS lists an entry per optimizer and uses only the run's; the entries of
     * optimizers this trainer does not run configure nothing here and are passed over */
    static const char *const known[] = {"adam", "adamw", "muon", "sgd", "adafactor"};
    if (expect_mapping(r, map, "optimizer_config") != 0) return -1;
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        yaml_node_t *k = node_at(r, p->key), *v = node_at(r, p->value);
        const char *name = key_text(r, k, "optimizer_config");
        if (!name || check_duplicate(r, map, p, "optimizer_config") != 0) return -1;
        if (!is_known(name, known, COUNT(known))) return unknown_key(r, k, "optimizer_config", name, known, COUNT(known));
        if (is_null(v)) continue;
        if (strcmp(name, "adam") == 0 && read_adam(r, v, "optimizer_config.adam", 0, &f->adam) != 0) return -1;
        if (strcmp(name, "adamw") == 0 && read_adam(r, v, "optimizer_config.adamw", 1, &f->adamw) != 0) return -1;
    }
    return 0;
}

/* arguments[i] as a number; as_int: a whole number of updates */
static int schedule_argument(const reader *r, const yaml_node_t *args, int i, int as_int, double *x, int *n) {
    const yaml_node_t *item = node_at(r, args->data.sequence.items.start[i]);
    if (get_number(r, item, "lr_schedule.arguments", 0, 0, HUGE_VAL, x) != 0) return -1;
    if (as_int) {
        if (*x != floor(*x) || *x > INT32_MAX)
            return fail_at(r, item, "lr_schedule.arguments: the step count %g is not a whole number of updates "
                           "(0 to %d)", *x, INT32_MAX);
        *n = (int)*x;
    }
    return 0;
}

/* mlx-lm's lr_schedule (tuner/utils.py build_schedule): {name, arguments, warmup, warmup_init}, the
 * arguments passed to mlx.optimizers' schedule of that name, the first of them the peak rate. */
static int read_lr_schedule(const reader *r, const yaml_node_t *map, train_options *o) {
    static const char *const known[] = {"name", "arguments", "warmup", "warmup_init"};
    if (expect_mapping(r, map, "lr_schedule") != 0) return -1;
    const yaml_node_t *name_node = NULL, *args = NULL;
    lr_schedule s = {LR_CONSTANT, 0, 0, 0, 0};
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        yaml_node_t *k = node_at(r, p->key), *v = node_at(r, p->value);
        const char *name = key_text(r, k, "lr_schedule");
        if (!name || check_duplicate(r, map, p, "lr_schedule") != 0) return -1;
        if (!is_known(name, known, COUNT(known))) return unknown_key(r, k, "lr_schedule", name, known, COUNT(known));
        if (is_null(v)) continue;
        if (strcmp(name, "name") == 0) name_node = v;
        else if (strcmp(name, "arguments") == 0) args = v;
        else if (strcmp(name, "warmup") == 0) {
            if (get_int(r, v, "lr_schedule.warmup", 0, INT32_MAX, &s.warmup) != 0) return -1;
        } else if (get_number(r, v, "lr_schedule.warmup_init", 0, 0, HUGE_VAL, &s.warmup_init) != 0)
            return -1;
    }
    if (!name_node) return fail_at(r, map, "lr_schedule: needs a name (cosine_decay or linear_schedule)");
    if (!args) return fail_at(r, map, "lr_schedule: needs arguments (the schedule's, the peak learning rate first)");
    char buf[80];
    const char *name = scalar_text(name_node);
    if (name && strcmp(name, "cosine_decay") == 0) s.decay = LR_COSINE;
    else if (name && strcmp(name, "linear_schedule") == 0) s.decay = LR_LINEAR;
    else if (name && strcmp(name, "constant") == 0) s.decay = LR_CONSTANT;
    else
        return fail_at(r, name_node, "lr_schedule.name: %s is not a schedule this trainer runs (cosine_decay, "
                       "linear_schedule, or constant)", describe(name_node, buf, sizeof buf));
    long count = args->type == YAML_SEQUENCE_NODE ? args->data.sequence.items.top - args->data.sequence.items.start : -1;
    double lr = 0, x;
    /* mlx.optimizers: cosine_decay(init, decay_steps, end=0), linear_schedule(init, end, steps);
     * constant (this trainer's) takes the rate alone. A step count of 0 means the rest of the run. */
    if (s.decay == LR_COSINE && (count == 2 || count == 3)) {
        if (schedule_argument(r, args, 0, 0, &lr, NULL) != 0 || schedule_argument(r, args, 1, 1, &x, &s.steps) != 0 ||
            (count == 3 && schedule_argument(r, args, 2, 0, &s.end, NULL) != 0))
            return -1;
    } else if (s.decay == LR_LINEAR && count == 3) {
        if (schedule_argument(r, args, 0, 0, &lr, NULL) != 0 || schedule_argument(r, args, 1, 0, &s.end, NULL) != 0 ||
            schedule_argument(r, args, 2, 1, &x, &s.steps) != 0)
            return -1;
    } else if (s.decay == LR_CONSTANT && count == 1) {
        if (schedule_argument(r, args, 0, 0, &lr, NULL) != 0) return -1;
    } else {
        const char *want = s.decay == LR_COSINE   ? "[initial_lr, decay_steps] or [initial_lr, decay_steps, end_lr]"
                           : s.decay == LR_LINEAR ? "[initial_lr, end_lr, steps]"
                                                  : "[lr]";
        return fail_at(r, args, "lr_schedule.arguments: %s takes %s, not %s", name, want, describe(args, buf, sizeof buf));
    }
    if (lr <= 0) return fail_at(r, args, "lr_schedule.arguments: the learning rate %g must be above 0", lr);
    o->schedule = s;
    o->lr = lr; /* mlx-lm takes the rate from the schedule, not learning_rate, when both are given */
    return 0;
}

/* The top-level keys: mlx-lm's (lora.py CONFIG_DEFAULTS, examples/lora_config.yaml, and the older
 * lora_layers), then this trainer's own with no mlx-lm counterpart. Accepted but without effect:
 * steps_per_report (every step is reported), grad_checkpoint (the backward always recomputes),
 * clear_cache_threshold (MLX's allocator), project_name and trust_remote_code (nothing is
 * downloaded or reported), test_batches (the test split is evaluated whole). */
static const char *const top_keys[] = {
    "model", "train", "data", "seed", "num_layers", "lora_layers", "batch_size", "iters", "val_batches",
    "learning_rate", "steps_per_report", "steps_per_eval", "resume_adapter_file", "adapter_path", "save_every",
    "test", "test_batches", "max_seq_length", "grad_checkpoint", "grad_accumulation_steps", "mask_prompt",
    "fine_tune_type", "optimizer", "optimizer_config", "lr_schedule", "lora_parameters", "clear_cache_threshold",
    "report_to", "project_name", "trust_remote_code", "wandb", "hf_dataset", "config",
    "epochs", "grad_clip", "adapter_format", "byte_tokens", "base_dtype",
};

static int read_top_key(const reader *r, const char *name, const yaml_node_t *k, const yaml_node_t *v, train_options *o,
                        train_file *f) {
    int ignored, flag;
    char buf[80];
    if (strcmp(name, "model") == 0) {
        if (get_string(r, v, name, &f->model) != 0) return -1;
        o->model_dir = f->model;
    } else if (strcmp(name, "data") == 0) {
        if (get_string(r, v, name, &f->data) != 0) return -1;
        o->data_dir = f->data;
    } else if (strcmp(name, "adapter_path") == 0) {
        if (get_string(r, v, name, &f->adapter_path) != 0) return -1;
        o->out_dir = f->adapter_path;
    } else if (strcmp(name, "resume_adapter_file") == 0) {
        if (get_string(r, v, name, &f->resume_adapter_file) != 0) return -1;
        o->adapters_path = f->resume_adapter_file;
    } else if (strcmp(name, "train") == 0) {
        if (get_bool(r, v, name, &flag) != 0) return -1;
        f->eval_only = !flag;
    } else if (strcmp(name, "seed") == 0) {
        int seed;
        if (get_int(r, v, name, 0, INT32_MAX, &seed) != 0) return -1;
        o->seed = (uint64_t)seed;
    } else if (strcmp(name, "num_layers") == 0 || strcmp(name, "lora_layers") == 0) {
        /* mlx-lm: -1 adapts every layer (and 0 does too, through its layers[-0:] slice) */
        if (get_int(r, v, name, -1, GEMMA_MAX_LAYERS, &o->lora.num_layers) != 0) return -1;
        if (o->lora.num_layers < 0) o->lora.num_layers = 0;
    } else if (strcmp(name, "batch_size") == 0) {
        if (get_int(r, v, name, 1, 1 << 20, &o->batch) != 0) return -1;
    } else if (strcmp(name, "iters") == 0) {
        if (get_int(r, v, name, 1, 1 << 30, &o->iters) != 0) return -1;
        f->has_iters = 1;
    } else if (strcmp(name, "epochs") == 0) {
        if (get_number(r, v, name, 0, 1, 1e6, &o->epochs) != 0) return -1;
        f->has_epochs = 1;
    } else if (strcmp(name, "val_batches") == 0) {
        if (get_int(r, v, name, -1, 1 << 30, &o->val_batches) != 0) return -1;
    } else if (strcmp(name, "learning_rate") == 0) {
        if (get_number(r, v, name, 0, 1, HUGE_VAL, &o->lr) != 0) return -1;
    } else if (strcmp(name, "steps_per_eval") == 0) {
        if (get_int(r, v, name, 0, 1 << 30, &o->eval_every) != 0) return -1;
    } else if (strcmp(name, "save_every") == 0) {
        if (get_int(r, v, name, 0, 1 << 30, &o->save_every) != 0) return -1;
    } else if (strcmp(name, "test") == 0) {
        if (get_bool(r, v, name, &o->test) != 0) return -1;
    } else if (strcmp(name, "max_seq_length") == 0) {
        /* 0: no truncation (mlx-lm's default is 2048) */
        if (get_int(r, v, name, 0, 1 << 30, &o->max_len) != 0) return -1;
        if (o->max_len == 1) return fail_at(r, v, "max_seq_length: 1 leaves no target; 2 or more, or 0 for no limit");
    } else if (strcmp(name, "grad_accumulation_steps") == 0) {
        if (get_int(r, v, name, 1, 1 << 20, &o->grad_accum) != 0) return -1;
    } else if (strcmp(name, "mask_prompt") == 0) {
        if (get_bool(r, v, name, &o->mask_prompt) != 0) return -1;
    } else if (strcmp(name, "byte_tokens") == 0) {
        if (get_bool(r, v, name, &o->byte_tokens) != 0) return -1;
    } else if (strcmp(name, "grad_clip") == 0) {
        if (get_number(r, v, name, 0, 0, HUGE_VAL, &o->grad_clip) != 0) return -1;
    } else if (strcmp(name, "adapter_format") == 0) {
        const char *s = scalar_text(v);
        if (s && strcmp(s, "mlx") == 0) o->format = ADAPTERS_MLX;
        else if (s && strcmp(s, "peft") == 0) o->format = ADAPTERS_PEFT;
        else return fail_at(r, v, "adapter_format: mlx or peft, not %s", describe(v, buf, sizeof buf));
    } else if (strcmp(name, "base_dtype") == 0) {
        const char *s = scalar_text(v);
        if (base_dtype_parse(s, &o->base) != 0)
            return fail_at(r, v, "base_dtype: bf16, mlx4, nf4 or fp8, not %s", describe(v, buf, sizeof buf));
    } else if (strcmp(name, "fine_tune_type") == 0) {
        const char *s = scalar_text(v);
        if (!s || strcmp(s, "lora") != 0)
            return fail_at(r, v, "fine_tune_type: %s: this trainer trains LoRA adapters only (lora)", describe(v, buf, sizeof buf));
    } else if (strcmp(name, "optimizer") == 0) {
        const char *s = scalar_text(v);
        if (s && strcmp(s, "adam") == 0) o->adamw = 0;
        else if (s && strcmp(s, "adamw") == 0) o->adamw = 1;
        else return fail_at(r, v, "optimizer: %s: adam or adamw", describe(v, buf, sizeof buf));
    } else if (strcmp(name, "optimizer_config") == 0) {
        return read_optimizer_config(r, v, f);
    } else if (strcmp(name, "lr_schedule") == 0) {
        return read_lr_schedule(r, v, o);
    } else if (strcmp(name, "lora_parameters") == 0) {
        return read_lora_parameters(r, v, o);
    } else if (strcmp(name, "steps_per_report") == 0 || strcmp(name, "test_batches") == 0) {
        if (get_int(r, v, name, -1, 1 << 30, &ignored) != 0) return -1;
    } else if (strcmp(name, "grad_checkpoint") == 0 || strcmp(name, "trust_remote_code") == 0) {
        if (get_bool(r, v, name, &ignored) != 0) return -1;
    } else if (strcmp(name, "clear_cache_threshold") == 0 || strcmp(name, "project_name") == 0) {
        if (v->type != YAML_SCALAR_NODE) return fail_at(r, v, "%s: a single value, not %s", name, describe(v, buf, sizeof buf));
    } else if (strcmp(name, "report_to") == 0 || strcmp(name, "wandb") == 0) {
        return fail_at(r, v, "%s: %s: runs are reported to stdout and log.jsonl only (train/plot_runs.py plots them)", name,
                       describe(v, buf, sizeof buf));
    } else if (strcmp(name, "hf_dataset") == 0) {
        return fail_at(r, k, "hf_dataset: Hugging Face datasets are not downloaded; give data: a folder or a JSONL file");
    } else if (strcmp(name, "config") == 0) {
        return fail_at(r, k, "config: a config file cannot name another");
    }
    return 0;
}

/* one line whatever the file (or its name) holds: a quoted key or value may carry line breaks */
static int one_line(char *err) {
    for (char *c = err; *c; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = '?';
    return -1;
}

int train_file_load(const char *path, train_options *o, train_file *f, char *err, size_t errlen) {
    memset(f, 0, sizeof *f);
    reader r = {path, NULL, err, errlen};
    FILE *in = fopen(path, "rb");
    if (!in) {
        snprintf(err, errlen, "%s: cannot open the config file: %s", path, strerror(errno));
        return one_line(err);
    }
    yaml_parser_t parser;
    yaml_document_t doc;
    if (!yaml_parser_initialize(&parser)) {
        fclose(in);
        snprintf(err, errlen, "%s: out of memory", path);
        return one_line(err);
    }
    yaml_parser_set_input_file(&parser, in);
    int rc = -1;
    if (!yaml_parser_load(&parser, &doc)) {
        snprintf(err, errlen, "%s:%lu:%lu: not YAML: %s%s%s", path, (unsigned long)parser.problem_mark.line + 1,
                 (unsigned long)parser.problem_mark.column + 1, parser.problem ? parser.problem : "syntax error",
                 parser.context ? " " : "", parser.context ? parser.context : "");
        yaml_parser_delete(&parser);
        fclose(in);
        return one_line(err);
    }
    r.doc = &doc;
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (!root) {
        snprintf(err, errlen, "%s: holds no settings (an empty YAML document)", path);
        goto done;
    }
    char buf[80];
    if (root->type != YAML_MAPPING_NODE) {
        fail_at(&r, root, "the file must be a mapping of mlx-lm's config keys (key: value), not %s",
                describe(root, buf, sizeof buf));
        goto done;
    }
    /* one document, as mlx-lm's yaml.load (PyYAML) requires */
    yaml_document_t next;
    if (yaml_parser_load(&parser, &next)) {
        int more = yaml_document_get_root_node(&next) != NULL;
        yaml_mark_t at = next.start_mark;
        yaml_document_delete(&next);
        if (more) {
            snprintf(err, errlen, "%s:%lu: a second YAML document; a config file holds one", path, (unsigned long)at.line + 1);
            goto done;
        }
    }
    for (yaml_node_pair_t *p = root->data.mapping.pairs.start; p < root->data.mapping.pairs.top; p++) {
        yaml_node_t *k = node_at(&r, p->key), *v = node_at(&r, p->value);
        const char *name = key_text(&r, k, "");
        if (!name || check_duplicate(&r, root, p, "") != 0) goto done;
        if (!is_known(name, top_keys, COUNT(top_keys))) {
            unknown_key(&r, k, "", name, top_keys, COUNT(top_keys));
            goto done;
        }
        if (is_null(v)) continue;
        if (read_top_key(&r, name, k, v, o, f) != 0) goto done;
    }
    for (yaml_node_pair_t *p = root->data.mapping.pairs.start; p < root->data.mapping.pairs.top; p++) {
        const char *name = scalar_text(node_at(&r, p->key));
        if (strcmp(name, "lora_layers") == 0 && !is_null(node_at(&r, p->value)))
            for (yaml_node_pair_t *q = root->data.mapping.pairs.start; q < root->data.mapping.pairs.top; q++)
                if (strcmp(scalar_text(node_at(&r, q->key)), "num_layers") == 0 && !is_null(node_at(&r, q->value))) {
                    fail_at(&r, node_at(&r, p->key), "lora_layers and num_layers name one setting; give one");
                    goto done;
                }
    }
    if (f->has_iters && f->has_epochs) {
        fail_at(&r, root, "iters and epochs exclude each other");
        goto done;
    }
    if (f->eval_only) o->eval_only = 1;
    rc = 0;
done:
    yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
    fclose(in);
    if (rc != 0) {
        train_file_free(f);
        one_line(err);
    }
    return rc;
}

void train_file_apply_optimizer(const train_file *f, train_options *o, int keep_weight_decay, int keep_bias_correction) {
    const optimizer_file_settings *s = o->adamw ? &f->adamw : &f->adam;
    if (s->has_betas) o->beta1 = s->beta1, o->beta2 = s->beta2;
    if (s->has_eps) o->eps = s->eps;
    if (s->has_weight_decay && !keep_weight_decay) o->weight_decay = s->weight_decay;
    if (s->has_bias_correction && !keep_bias_correction) o->bias_correction = s->bias_correction;
}

void train_file_free(train_file *f) {
    free(f->model);
    free(f->data);
    free(f->adapter_path);
    free(f->resume_adapter_file);
    f->model = f->data = f->adapter_path = f->resume_adapter_file = NULL;
}

/* ------------------------------------------------------------------------------------------- */

/* the shortest form strtod reads back to x exactly; whole numbers as 20.0, as mlx-lm's example
 * writes them */
static const char *number_text(double x, char *buf, size_t len) {
    if (x == floor(x) && fabs(x) < 1e15) {
        snprintf(buf, len, "%.1f", x);
        return buf;
    }
    for (int digits = 1; digits <= 17; digits++) {
        snprintf(buf, len, "%.*g", digits, x);
        if (strtod(buf, NULL) == x) break;
    }
    return buf;
}

/* a double-quoted YAML string: backslash escapes for quotes, backslashes and control bytes */
static void print_string(FILE *out, const char *s) {
    fputc('"', out);
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\') fprintf(out, "\\%c", *c);
        else if (*c < 0x20 || *c == 0x7f) fprintf(out, "\\x%02x", *c);
        else fputc(*c, out);
    }
    fputc('"', out);
}

static void print_path(FILE *out, const char *key, const char *path) {
    fprintf(out, "%s: ", key);
    if (path) print_string(out, path);
    else fputs("null", out);
    fputc('\n', out);
}

int train_file_print(FILE *out, const train_options *o) {
    char a[32], b[32], c[32];
    fputs("# winattn train's options as a config file: winattn train -c FILE reads it back\n", out);
    print_path(out, "model", o->model_dir);
    print_path(out, "data", o->data_dir);
    fprintf(out, "train: %s\n", o->eval_only ? "false" : "true");
    fputs("fine_tune_type: lora\n", out);
    fprintf(out, "optimizer: %s\n", o->adamw ? "adamw" : "adam");
    fprintf(out, "optimizer_config:\n  %s:\n    betas: [%s, %s]\n    eps: %s\n    bias_correction: %s\n",
            o->adamw ? "adamw" : "adam", number_text(o->beta1, a, sizeof a), number_text(o->beta2, b, sizeof b),
            number_text(o->eps, c, sizeof c), o->bias_correction ? "true" : "false");
    if (o->adamw) fprintf(out, "    weight_decay: %s\n", number_text(o->weight_decay, a, sizeof a));
    fprintf(out, "seed: %llu\n", (unsigned long long)o->seed);
    fprintf(out, "num_layers: %d\n", o->lora.num_layers > 0 ? o->lora.num_layers : -1);
    fprintf(out, "batch_size: %d\n", o->batch);
    if (o->iters > 0) fprintf(out, "iters: %d\n", o->iters);
    else fprintf(out, "epochs: %s\n", number_text(o->epochs, a, sizeof a));
    fprintf(out, "grad_accumulation_steps: %d\n", o->grad_accum);
    fprintf(out, "val_batches: %d\n", o->val_batches > 0 ? o->val_batches : -1);
    fprintf(out, "learning_rate: %s\n", number_text(o->lr, a, sizeof a));
    fprintf(out, "steps_per_eval: %d\n", o->eval_every);
    print_path(out, "resume_adapter_file", o->adapters_path);
    print_path(out, "adapter_path", o->out_dir);
    fprintf(out, "adapter_format: %s\n", o->format == ADAPTERS_PEFT ? "peft" : "mlx");
    fprintf(out, "save_every: %d\n", o->save_every);
    fprintf(out, "test: %s\n", o->test ? "true" : "false");
    fprintf(out, "max_seq_length: %d\n", o->max_len);
    fputs("grad_checkpoint: true\n", out);
    fprintf(out, "mask_prompt: %s\n", o->mask_prompt ? "true" : "false");
    fprintf(out, "byte_tokens: %s\n", o->byte_tokens ? "true" : "false");
    fprintf(out, "grad_clip: %s\n", number_text(o->grad_clip, a, sizeof a));
    fprintf(out, "base_dtype: %s\n", base_dtype_name(o->base));
    fputs("lora_parameters:\n  keys: [", out);
    int first = 1;
    for (size_t i = 0; i < COUNT(module_paths); i++)
        if (o->lora.proj_mask & (1u << train_lora_key(module_paths[i][1]))) {
            fprintf(out, "%s\"%s\"", first ? "" : ", ", module_paths[i][0]);
            first = 0;
        }
    fprintf(out, "]\n  rank: %d\n  scale: %s\n  dropout: 0.0\n", o->lora.rank, number_text(o->lora.scale, a, sizeof a));
    const lr_schedule *s = &o->schedule;
    if (s->decay == LR_CONSTANT && s->warmup == 0) {
        fputs("lr_schedule: null\n", out);
    } else {
        fprintf(out, "lr_schedule:\n  name: %s\n",
                s->decay == LR_COSINE ? "cosine_decay" : s->decay == LR_LINEAR ? "linear_schedule" : "constant");
        fprintf(out, "  warmup: %d\n  warmup_init: %s\n", s->warmup, number_text(s->warmup_init, a, sizeof a));
        number_text(o->lr, a, sizeof a);
        number_text(s->end, b, sizeof b);
        if (s->decay == LR_COSINE) fprintf(out, "  arguments: [%s, %d, %s]\n", a, s->steps, b);
        else if (s->decay == LR_LINEAR) fprintf(out, "  arguments: [%s, %s, %d]\n", a, b, s->steps);
        else fprintf(out, "  arguments: [%s]\n", a);
    }
    return fflush(out) == 0 && !ferror(out) ? 0 : -1;
}

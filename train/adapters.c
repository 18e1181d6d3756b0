/* adapters.c — see adapters.h. */
#define _GNU_SOURCE
#include "adapters.h"

#include "atomic_file.h"
#include "checkpoint.h" /* st_tensor_first_nonfinite */
#include "convert.h"
#include "safetensors.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <regex.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

/* The message, one line: names and expressions quoted from a file may hold control characters */
static int fail(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    for (char *c = err; errlen && *c; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = '?';
    return -1;
}

/* How the text model's layers are named, in the order the reader tries them: mlx-lm's text-only
 * and multimodal classes, transformers' multimodal class (5.x) */
static const char *const adapter_prefixes[] = {"model.", "language_model.model.", "model.language_model."};
enum { PREFIX_COUNT = sizeof adapter_prefixes / sizeof *adapter_prefixes };
#define PEFT_ROOT "base_model.model."

const char *adapters_file_name(adapter_format format) {
    return format == ADAPTERS_PEFT ? "adapter_model.safetensors" : "adapters.safetensors";
}

void adapter_slot_name(char *buf, size_t n, const char *prefix, const lora_slot *s, const char *suffix) {
    snprintf(buf, n, "%slayers.%d.%s.%s", prefix, s->layer, gemma_proj_path[s->proj], suffix);
}

/* 1 when model_dir/config.json describes a multimodal checkpoint (a "text_config" object), 0 when
 * text-only, -1 with err when it cannot be read. */
static int checkpoint_multimodal(const char *model_dir, char *err, size_t errlen) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", model_dir);
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root) return fail(err, errlen, "%s: cannot read (%s)", path, je.text);
    int mm = json_is_object(json_object_get(root, "text_config"));
    json_decref(root);
    return mm;
}

/* the prefix and the A, B suffixes of a layout */
static void layout_names(adapter_format format, int multimodal, char *prefix, size_t n, const char **a, const char **b) {
    if (format == ADAPTERS_PEFT) {
        snprintf(prefix, n, PEFT_ROOT "%s", multimodal ? "model.language_model." : "model.");
        *a = "lora_A.weight";
        *b = "lora_B.weight";
    } else {
        snprintf(prefix, n, "%s", multimodal ? "language_model.model." : "model.");
        *a = "lora_a";
        *b = "lora_b";
    }
}

static int write_weights(const gemma_model_f32 *m, const char *path, adapter_format format, int multimodal, char *err,
                         size_t errlen) {
    int n = 2 * m->slot_count, r = m->lora.rank, rc = -1;
    st_out *outs = calloc((size_t)(n ? n : 1), sizeof *outs);
    char (*names)[192] = calloc((size_t)(n ? n : 1), sizeof *names);
    /* peft's nn.Linear weights are the transposes: A [r, in], B [out, r] */
    float *t = format == ADAPTERS_PEFT ? malloc((m->param_count ? m->param_count : 1) * sizeof *t) : NULL;
    if (!outs || !names || (format == ADAPTERS_PEFT && !t)) {
        fail(err, errlen, "out of memory");
        goto done;
    }
    char prefix[64];
    const char *suffix[2];
    layout_names(format, multimodal, prefix, sizeof prefix, &suffix[0], &suffix[1]);
    for (int i = 0; i < m->slot_count; i++) {
        const lora_slot *s = &m->slots[i];
        for (int k = 0; k < 2; k++) {
            st_out *o = &outs[2 * i + k];
            int rows = k ? r : s->in, cols = k ? s->out : r; /* mlx-lm's shape */
            size_t off = k ? s->b : s->a;
            adapter_slot_name(names[2 * i + k], sizeof names[0], prefix, s, suffix[k]);
            o->name = names[2 * i + k];
            o->dtype = ST_F32;
            o->rank = 2;
            if (format == ADAPTERS_PEFT) {
                for (int x = 0; x < rows; x++)
                    for (int y = 0; y < cols; y++) t[off + (size_t)y * rows + x] = m->params[off + (size_t)x * cols + y];
                o->shape[0] = cols;
                o->shape[1] = rows;
                o->data = t + off;
            } else {
                o->shape[0] = rows;
                o->shape[1] = cols;
                o->data = m->params + off;
            }
        }
    }
    rc = st_write(path, outs, n, NULL, err, errlen);
done:
    free(outs);
    free(names);
    free(t);
    return rc;
}

int adapters_save_weights(const gemma_model_f32 *m, const char *path, adapter_format format, const char *model_dir,
                          char *err, size_t errlen) {
    int mm = checkpoint_multimodal(model_dir, err, errlen);
    return mm < 0 ? -1 : write_weights(m, path, format, mm, err, errlen);
}

/* adapter_config.json in mlx-lm's shape, so mlx_lm.load(..., adapter_path=dir) reads it */
static json_t *mlx_config(const gemma_model_f32 *m) {
    json_t *keys = json_array();
    for (int p = 0; p < PROJ_COUNT; p++)
        if (m->lora.proj_mask & (1u << p)) json_array_append_new(keys, json_string(gemma_proj_path[p]));
    json_t *lp = json_pack("{s:i, s:f, s:f, s:o}", "rank", m->lora.rank, "scale", m->lora.scale, "dropout", 0.0, "keys",
                           keys);
    return json_pack("{s:s, s:i, s:o}", "fine_tune_type", "lora", "num_layers",
                     m->lora.num_layers > 0 ? m->lora.num_layers : m->cfg.layers, "lora_parameters", lp);
}

/* adapter_config.json in peft's shape (LoraConfig's fields), so PeftModel.from_pretrained reads it */
static json_t *peft_config(const gemma_model_f32 *m, const char *model_dir, int multimodal) {
    int layers = m->cfg.layers, first = m->lora.num_layers > 0 ? layers - m->lora.num_layers : 0;
    json_t *targets, *ltt = json_null();
    if (multimodal) {
        /* a regular expression (peft matches it whole against each module name) that names the
         * language model's projections only: a bare list would reach the vision tower's q_proj too.
         * Plain syntax that Python's re and POSIX ERE read alike. */
        char *re = malloc(128 + 12 * (size_t)layers + 32 * PROJ_COUNT), *p = re;
        if (!re) return NULL;
        p += sprintf(p, "model\\.language_model\\.layers\\.");
        if (first == 0) p += sprintf(p, "[0-9]+");
        else {
            p += sprintf(p, "(");
            for (int l = first; l < layers; l++) p += sprintf(p, "%s%d", l > first ? "|" : "", l);
            p += sprintf(p, ")");
        }
        p += sprintf(p, "\\.(");
        int any = 0;
        for (int q = 0; q < PROJ_COUNT; q++) {
            if (!(m->lora.proj_mask & (1u << q))) continue;
            p += sprintf(p, "%s", any++ ? "|" : "");
            for (const char *c = gemma_proj_path[q]; *c; c++) {
                if (*c == '.') *p++ = '\\';
                *p++ = *c;
            }
        }
        sprintf(p, ")");
        targets = json_string(re);
        free(re);
    } else {
        targets = json_array();
        for (int q = 0; q < PROJ_COUNT; q++)
            if (m->lora.proj_mask & (1u << q)) json_array_append_new(targets, json_string(strchr(gemma_proj_path[q], '.') + 1));
        if (first > 0) {
            ltt = json_array();
            for (int l = first; l < layers; l++) json_array_append_new(ltt, json_integer(l));
        }
    }
    /* peft's scaling is lora_alpha / r: alpha = scale · r, an integer where it is one */
    double alpha = m->lora.scale * m->lora.rank;
    json_t *alpha_json = alpha == floor(alpha) && fabs(alpha) < 1e15 ? json_integer((json_int_t)alpha) : json_real(alpha);
    char *abs_dir = realpath(model_dir, NULL);
    json_t *cfg = json_object();
    json_object_set_new(cfg, "peft_type", json_string("LORA"));
    json_object_set_new(cfg, "task_type", json_string("CAUSAL_LM"));
    json_object_set_new(cfg, "base_model_name_or_path", json_string(abs_dir ? abs_dir : model_dir));
    json_object_set_new(cfg, "revision", json_null());
    json_object_set_new(cfg, "r", json_integer(m->lora.rank));
    json_object_set_new(cfg, "lora_alpha", alpha_json);
    json_object_set_new(cfg, "lora_dropout", json_real(0.0));
    json_object_set_new(cfg, "target_modules", targets);
    json_object_set_new(cfg, "layers_to_transform", ltt);
    json_object_set_new(cfg, "layers_pattern", json_is_null(ltt) ? json_null() : json_string("layers"));
    json_object_set_new(cfg, "bias", json_string("none"));
    json_object_set_new(cfg, "fan_in_fan_out", json_false());
    json_object_set_new(cfg, "use_rslora", json_false());
    json_object_set_new(cfg, "use_dora", json_false());
    json_object_set_new(cfg, "init_lora_weights", json_true());
    json_object_set_new(cfg, "modules_to_save", json_null());
    json_object_set_new(cfg, "rank_pattern", json_object());
    json_object_set_new(cfg, "alpha_pattern", json_object());
    json_object_set_new(cfg, "inference_mode", json_true());
    free(abs_dir);
    return cfg;
}

int adapters_save(const gemma_model_f32 *m, const char *dir, adapter_format format, const char *model_dir, char *err,
                  size_t errlen) {
    int mm = checkpoint_multimodal(model_dir, err, errlen);
    if (mm < 0) return -1;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, adapters_file_name(format));
    if (write_weights(m, path, format, mm, err, errlen) != 0) return -1;
    json_t *cfg = format == ADAPTERS_PEFT ? peft_config(m, model_dir, mm) : mlx_config(m);
    char *text = cfg ? json_dumps(cfg, JSON_INDENT(2)) : NULL;
    json_decref(cfg);
    if (!text) return fail(err, errlen, "out of memory");
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    int rc = write_text_atomic(path, text, err, errlen);
    free(text);
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * Reading */

static int is_file(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
}

int adapters_locate(const char *path, int need_config, char *weights, size_t weights_len, char *config, size_t config_len,
                    char *err, size_t errlen) {
    struct stat sb;
    if (stat(path, &sb) != 0) return fail(err, errlen, "%s: no such file or folder", path);
    *config = '\0';
    if (!S_ISDIR(sb.st_mode)) {
        if (need_config) return fail(err, errlen, "%s: not a folder (a checkpoint folder is needed)", path);
        snprintf(weights, weights_len, "%s", path);
        return 0;
    }
    char mlx[4096], peft[4096], cfg[4096];
    snprintf(mlx, sizeof mlx, "%s/%s", path, adapters_file_name(ADAPTERS_MLX));
    snprintf(peft, sizeof peft, "%s/%s", path, adapters_file_name(ADAPTERS_PEFT));
    snprintf(cfg, sizeof cfg, "%s/adapter_config.json", path);
    int has_mlx = is_file(mlx), has_peft = is_file(peft), has_cfg = is_file(cfg);
    if (!has_mlx && !has_peft)
        return fail(err, errlen, "%s: holds neither adapters.safetensors (mlx-lm) nor adapter_model.safetensors (peft)", path);
    if (need_config && !has_cfg) return fail(err, errlen, "%s: no adapter_config.json", path);
    int use_peft = has_peft && !has_mlx;
    if (has_mlx && has_peft) {
        json_t *root = has_cfg ? json_load_file(cfg, 0, NULL) : NULL;
        if (!root)
            return fail(err, errlen, "%s: holds adapters.safetensors and adapter_model.safetensors, and no readable "
                                     "adapter_config.json says which one is meant", path);
        use_peft = json_object_get(root, "peft_type") != NULL;
        json_decref(root);
    }
    snprintf(weights, weights_len, "%s", use_peft ? peft : mlx);
    if (has_cfg) snprintf(config, config_len, "%s", cfg);
    return 0;
}

/* tensor t (2-D, [rows, cols] checked) into dst as [rows, cols] floats, or transposed to [cols, rows] */
static void tensor_to_f32(const st_tensor *t, float *dst, int transpose) {
    int64_t rows = t->shape[0], cols = t->shape[1];
    const unsigned char *p = t->data;
    for (int64_t x = 0; x < rows; x++)
        for (int64_t y = 0; y < cols; y++) {
            int64_t i = x * cols + y;
            float v;
            if (t->dtype == ST_F32) memcpy(&v, p + 4 * i, 4);
            else {
                uint16_t h;
                memcpy(&h, p + 2 * i, 2);
                v = t->dtype == ST_BF16 ? wa_bf16_to_f32(h) : wa_f16_to_f32(h);
            }
            dst[transpose ? y * rows + x : i] = v;
        }
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

int adapters_load(gemma_model_f32 *m, const char *path, char *err, size_t errlen) {
    st_file f;
    if (st_open(path, &f, err, errlen) != 0) return -1;
    int peft = 0;
    for (int i = 0; i < f.count && !peft; i++)
        peft = ends_with(f.tensors[i].name, ".lora_A.weight") || ends_with(f.tensors[i].name, ".lora_B.weight");
    float *params = malloc((m->param_count ? m->param_count : 1) * sizeof *params);
    char *used = calloc((size_t)(f.count ? f.count : 1), 1);
    int rc = params && used ? 0 : fail(err, errlen, "out of memory");
    const char *suffix[2] = {peft ? "lora_A.weight" : "lora_a", peft ? "lora_B.weight" : "lora_b"};
    for (int i = 0; i < m->slot_count && rc == 0; i++) {
        const lora_slot *s = &m->slots[i];
        for (int k = 0; k < 2 && rc == 0; k++) {
            const st_tensor *t = NULL;
            char name[256], prefix[64];
            for (int p = 0; p < PREFIX_COUNT && !t; p++) {
                snprintf(prefix, sizeof prefix, "%s%s", peft ? PEFT_ROOT : "", adapter_prefixes[p]);
                adapter_slot_name(name, sizeof name, prefix, s, suffix[k]);
                t = st_find(&f, name);
            }
            int64_t rows = k ? m->lora.rank : s->in, cols = k ? s->out : m->lora.rank; /* mlx-lm's [rows, cols] */
            int64_t want0 = peft ? cols : rows, want1 = peft ? rows : cols;
            uint64_t bad;
            if (!t) {
                snprintf(prefix, sizeof prefix, "%s%s", peft ? PEFT_ROOT : "", adapter_prefixes[0]);
                adapter_slot_name(name, sizeof name, prefix, s, suffix[k]);
                rc = fail(err, errlen, "%s: no adapter \"%s\" (the %s layout; or under another prefix)", path, name,
                          peft ? "peft" : "mlx-lm");
            } else if ((t->dtype != ST_F32 && t->dtype != ST_BF16 && t->dtype != ST_F16) || t->rank != 2 ||
                       t->shape[0] != want0 || t->shape[1] != want1)
                rc = fail(err, errlen, "%s: \"%s\" must be F32 [%lld, %lld] (or BF16, F16) for rank %d%s", path, t->name,
                          (long long)want0, (long long)want1, m->lora.rank, peft ? " in peft's nn.Linear layout" : "");
            else if (st_tensor_first_nonfinite(t, &bad))
                rc = fail(err, errlen, "%s: \"%s\" holds a non-finite value (%s) at element %llu", path, t->name,
                          st_tensor_value_kind(t, bad), (unsigned long long)bad);
            else {
                tensor_to_f32(t, params + (k ? s->b : s->a), peft);
                used[t - f.tensors] = 1;
            }
        }
    }
    /* anything else means the file belongs to another model or LoRA setup */
    for (int i = 0; i < f.count && rc == 0; i++)
        if (!used[i])
            rc = fail(err, errlen, "%s: \"%.160s\" has no place in this model and LoRA setup (rank %d, %d adapted projections)",
                      path, f.tensors[i].name, m->lora.rank, m->slot_count);
    if (rc == 0) memcpy(m->params, params, m->param_count * sizeof *params);
    free(params);
    free(used);
    st_close(&f);
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * adapter_config.json */

static int mlx_config_load(const json_t *root, const char *path, int layers, lora_config *lc, char *err, size_t errlen) {
    const json_t *lp = json_object_get(root, "lora_parameters"), *ftt = json_object_get(root, "fine_tune_type");
    const json_t *rank = json_object_get(lp, "rank"), *scale = json_object_get(lp, "scale");
    const json_t *keys = json_object_get(lp, "keys"), *nl = json_object_get(root, "num_layers");
    if (ftt && !(json_is_string(ftt) && strcmp(json_string_value(ftt), "lora") == 0))
        return fail(err, errlen, "%s: fine_tune_type must be \"lora\" (DoRA and full fine-tuning are not read)", path);
    if (!json_is_integer(rank) || json_integer_value(rank) < 1 || json_integer_value(rank) > 4096 ||
        !json_is_number(scale) || (keys && !json_is_null(keys) && !json_is_array(keys)) || (nl && !json_is_integer(nl)))
        return fail(err, errlen, "%s: needs lora_parameters {rank (1 to 4096), scale, keys (optional)} and an integer num_layers", path);
    if (!isfinite(json_number_value(scale))) return fail(err, errlen, "%s: lora_parameters.scale is not finite", path);
    if (nl && json_integer_value(nl) < -1) /* mlx-lm's -1 is every layer */
        return fail(err, errlen, "%s: num_layers = %lld, must be -1 (all) or 0 and up", path, (long long)json_integer_value(nl));
    memset(lc, 0, sizeof *lc);
    lc->rank = (int)json_integer_value(rank);
    lc->scale = json_number_value(scale);
    /* compared before narrowing: (int)4294967297 would be 1; mlx-lm adapts model.layers[-max(n, 0):],
     * every layer for -1, 0 and anything above the layer count */
    json_int_t nlv = nl ? json_integer_value(nl) : layers;
    lc->num_layers = nlv >= layers || nlv <= 0 ? 0 : (int)nlv;
    if (!json_is_array(keys)) { /* mlx-lm: every linear layer of the block */
        lc->proj_mask = (1u << PROJ_COUNT) - 1;
        return 0;
    }
    size_t i;
    const json_t *k;
    json_array_foreach(keys, i, k) {
        int found = -1;
        for (int p = 0; p < PROJ_COUNT && json_is_string(k); p++)
            if (strcmp(json_string_value(k), gemma_proj_path[p]) == 0) found = p;
        if (found < 0)
            return fail(err, errlen, "%s: lora key %zu is not one of self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj", path, i);
        lc->proj_mask |= 1u << found;
    }
    if (!lc->proj_mask) return fail(err, errlen, "%s: lora_parameters.keys is empty", path);
    return 0;
}

/* peft's target selection, evaluated on the model's projection names */
typedef struct peft_targets {
    const json_t *list;       /* target_modules as a list, or NULL */
    int all_linear;           /* target_modules "all-linear" */
    regex_t target_re;        /* target_modules as a regular expression (when has_target_re) */
    int has_target_re;
    const json_t *exclude;    /* exclude_modules as a list, or NULL */
    regex_t exclude_re;
    int has_exclude_re;
    const json_t *layers;     /* layers_to_transform: an integer or a list of them, or NULL */
} peft_targets;

/* The most repetition operators (*, + and ?) and characters a target pattern may hold. glibc's
 * regcomp is polynomial to exponential in some shapes of pattern (repeated expressions are copied,
 * runs of operators and nested empty branches make its epsilon closures explode: a run of 112 '*'
 * took 5 s, 40 nested "((|)|(|))" under one '*' over a minute), so a pattern from a file is held to
 * what peft's targets need ("model.*\.(q_proj|v_proj)") before it reaches regcomp. */
enum { PATTERN_MAX_REPEATS = 8, PATTERN_MAX_PLUS = 4, PATTERN_MAX_CHARS = 256 };

/* 1 when pattern has a shape compile_pattern does not hand to regcomp: syntax only Python reads
 * (classes like \d, (?...) groups, lazy quantifiers, back-references), bounded repeats ({m,n}),
 * more than PATTERN_MAX_REPEATS operators (PATTERN_MAX_PLUS of them '+'), an operator with nothing
 * to repeat (at the start, after '(', '|' or another operator), or an empty branch or group ("()",
 * "(|", "||", "|)", or '|' first or last). A bracket expression ([...], where these characters are
 * literal) is skipped whole. */
static int pattern_refused(const char *pattern) {
    if (strlen(pattern) > PATTERN_MAX_CHARS || strstr(pattern, "(?") || strstr(pattern, "*?") ||
        strstr(pattern, "+?") || strstr(pattern, "??"))
        return 1;
    int repeats = 0, plus = 0;
    char prev = '('; /* the start behaves as an opening parenthesis: nothing to repeat, no empty branch */
    for (const char *c = pattern; *c; c++) {
        if (*c == '\\') {
            if (!c[1] || strchr("dDwWsSbBAZ0123456789", c[1])) return 1;
            c++, prev = 'a';
        } else if (*c == '[') { /* to the closing ']'; a ']' first (after an optional '^') is literal */
            const char *e = c + 1 + (c[1] == '^');
            e += *e == ']';
            while (*e && *e != ']') e++;
            if (!*e) return 1;
            c = e, prev = 'a';
        } else if (*c == '*' || *c == '+' || *c == '?') {
            if (prev == '(' || prev == '|' || prev == '*' || ++repeats > PATTERN_MAX_REPEATS ||
                (*c == '+' && ++plus > PATTERN_MAX_PLUS))
                return 1;
            prev = '*';
        } else if (*c == '{') {
            return 1;
        } else if (*c == ')' || *c == '|') {
            if (prev == '(' || prev == '|') return 1;
            prev = *c == '|' ? '|' : 'a';
        } else {
            prev = *c == '(' ? '(' : 'a';
        }
    }
    return prev == '|';
}

/* Python's re.fullmatch(pattern, key) for the plain syntax POSIX ERE shares with it; 0 and *re set,
 * or -1 with why in err for a pattern pattern_refused turns away or that does not compile. */
static int compile_pattern(const char *pattern, regex_t *re, const char *path, const char *field, char *err, size_t errlen) {
    size_t n = strlen(pattern);
    char *anchored = pattern_refused(pattern) ? NULL : malloc(n + 5);
    if (anchored) snprintf(anchored, n + 5, "^(%s)$", pattern);
    int rc = anchored && regcomp(re, anchored, REG_EXTENDED | REG_NOSUB) == 0 ? 0 : -1;
    free(anchored);
    if (rc)
        return fail(err, errlen, "%s: %s \"%.80s\" is not a regular expression this reader evaluates (POSIX extended "
                                 "syntax only: no {m,n}, at most %d of * + ? (four '+'), no empty branch, at most "
                                 "%d characters)", path, field, pattern, PATTERN_MAX_REPEATS, PATTERN_MAX_CHARS);
    return 0;
}

static int name_matches_list(const json_t *list, const char *key) {
    size_t i, n = strlen(key);
    const json_t *e;
    json_array_foreach(list, i, e) {
        const char *s = json_string_value(e);
        size_t k = strlen(s);
        if (strcmp(key, s) == 0 || (k < n && key[n - k - 1] == '.' && strcmp(key + n - k, s) == 0)) return 1;
    }
    return 0;
}

/* 1 when peft adapts projection proj of layer `layer`, its module named with adapter_prefixes[scheme] */
static int peft_selects(const peft_targets *pt, int scheme, int layer, int proj) {
    char key[160];
    snprintf(key, sizeof key, "%slayers.%d.%s", adapter_prefixes[scheme], layer, gemma_proj_path[proj]);
    if (pt->has_exclude_re && regexec(&pt->exclude_re, key, 0, NULL, 0) == 0) return 0;
    if (pt->exclude && name_matches_list(pt->exclude, key)) return 0;
    if (pt->all_linear) return 1;
    if (pt->has_target_re) return regexec(&pt->target_re, key, 0, NULL, 0) == 0;
    if (!name_matches_list(pt->list, key)) return 0;
    if (!pt->layers || json_is_null(pt->layers)) return 1;
    if (json_is_integer(pt->layers)) return json_integer_value(pt->layers) == layer;
    size_t i;
    const json_t *e;
    json_array_foreach(pt->layers, i, e) if (json_integer_value(e) == layer) return 1;
    return 0;
}

/* The naming scheme (index into adapter_prefixes) of the peft weights beside the config at
 * config_path, or -1 when there are none to read */
static int peft_weights_scheme(const char *config_path) {
    char path[4096];
    const char *slash = strrchr(config_path, '/');
    snprintf(path, sizeof path, "%.*s%s", slash ? (int)(slash - config_path + 1) : 0, config_path,
             adapters_file_name(ADAPTERS_PEFT));
    st_file f;
    char err[256];
    if (!is_file(path) || st_open(path, &f, err, sizeof err) != 0) return -1;
    int scheme = -1;
    for (int i = 0; i < f.count && scheme < 0; i++)
        for (int p = PREFIX_COUNT - 1; p >= 0 && scheme < 0; p--) { /* the longer prefixes first: "model." is in each */
            char prefix[64];
            snprintf(prefix, sizeof prefix, PEFT_ROOT "%slayers.", adapter_prefixes[p]);
            if (strncmp(f.tensors[i].name, prefix, strlen(prefix)) == 0) scheme = p;
        }
    st_close(&f);
    return scheme;
}

/* null, absent, false, "", [] and {} */
static int empty(const json_t *v) {
    return !v || json_is_null(v) || json_is_false(v) || (json_is_string(v) && !*json_string_value(v)) ||
           (json_is_array(v) && json_array_size(v) == 0) || (json_is_object(v) && json_object_size(v) == 0);
}

static int string_list(const json_t *v) {
    if (!json_is_array(v)) return 0;
    size_t i;
    const json_t *e;
    json_array_foreach(v, i, e) if (!json_is_string(e)) return 0;
    return 1;
}

static int peft_config_load(const json_t *root, const char *path, int layers, lora_config *lc, char *err, size_t errlen) {
    const json_t *type = json_object_get(root, "peft_type"), *r = json_object_get(root, "r");
    const json_t *alpha = json_object_get(root, "lora_alpha"), *rslora = json_object_get(root, "use_rslora");
    const json_t *targets = json_object_get(root, "target_modules"), *exclude = json_object_get(root, "exclude_modules");
    const json_t *ltt = json_object_get(root, "layers_to_transform"), *lpat = json_object_get(root, "layers_pattern");
    const json_t *bias = json_object_get(root, "bias");
    if (!json_is_string(type) || strcmp(json_string_value(type), "LORA") != 0)
        return fail(err, errlen, "%s: peft_type must be \"LORA\" (other peft methods are not read)", path);
    if (!json_is_integer(r) || json_integer_value(r) < 1 || json_integer_value(r) > 4096)
        return fail(err, errlen, "%s: r must be an integer from 1 to 4096", path);
    if (!json_is_number(alpha) || !isfinite(json_number_value(alpha)))
        return fail(err, errlen, "%s: lora_alpha must be a finite number", path);
    if (rslora && !json_is_boolean(rslora)) return fail(err, errlen, "%s: use_rslora must be true or false", path);
    static const char *const unsupported[][2] = {
        {"use_dora", "DoRA"}, {"fan_in_fan_out", "fan_in_fan_out (transposed base weights)"},
        {"modules_to_save", "modules_to_save (fully trained modules)"}, {"rank_pattern", "rank_pattern (ranks per module)"},
        {"alpha_pattern", "alpha_pattern (alphas per module)"}, {"lora_bias", "lora_bias"},
        {"target_parameters", "target_parameters"}, {"trainable_token_indices", "trainable_token_indices"}};
    for (size_t i = 0; i < sizeof unsupported / sizeof *unsupported; i++)
        if (!empty(json_object_get(root, unsupported[i][0])))
            return fail(err, errlen, "%s: %s is set; only plain LoRA on linear projections is read", path, unsupported[i][1]);
    if (!empty(bias) && !(json_is_string(bias) && strcmp(json_string_value(bias), "none") == 0))
        return fail(err, errlen, "%s: bias must be \"none\" (trained biases are not read)", path);
    if (!empty(lpat) && !(json_is_string(lpat) && strcmp(json_string_value(lpat), "layers") == 0) &&
        !(string_list(lpat) && json_array_size(lpat) == 1 && strcmp(json_string_value(json_array_get(lpat, 0)), "layers") == 0))
        return fail(err, errlen, "%s: layers_pattern must be \"layers\" (the decoder layers) or null", path);
    if (ltt && !json_is_null(ltt) && !json_is_integer(ltt)) {
        size_t i;
        const json_t *e;
        int ok = json_is_array(ltt);
        json_array_foreach(ltt, i, e) ok &= json_is_integer(e);
        if (!ok) return fail(err, errlen, "%s: layers_to_transform must be null, an integer or a list of integers", path);
    }

    peft_targets pt = {0};
    if (json_is_string(targets) && strcasecmp(json_string_value(targets), "all-linear") == 0) pt.all_linear = 1;
    else if (json_is_string(targets)) {
        if (!empty(ltt)) return fail(err, errlen, "%s: layers_to_transform cannot go with a target_modules expression (peft refuses it too)", path);
        if (compile_pattern(json_string_value(targets), &pt.target_re, path, "target_modules", err, errlen) != 0) return -1;
        pt.has_target_re = 1;
    } else if (string_list(targets) && json_array_size(targets) > 0) pt.list = targets;
    else return fail(err, errlen, "%s: target_modules must be a list of module names, a regular expression or \"all-linear\"", path);
    pt.layers = ltt;
    int rc = 0;
    if (json_is_string(exclude) && *json_string_value(exclude)) {
        rc = compile_pattern(json_string_value(exclude), &pt.exclude_re, path, "exclude_modules", err, errlen);
        pt.has_exclude_re = rc == 0;
    } else if (string_list(exclude)) pt.exclude = exclude;
    else if (!empty(exclude)) rc = fail(err, errlen, "%s: exclude_modules must be a list of module names or a regular expression", path);

    /* The modules' names depend on the class the checkpoint loads as; the weights beside the config
     * tell which, else the first naming under which anything is selected counts. The selection
     * must be one projection set on each of the last N layers. */
    unsigned mask[GEMMA_MAX_LAYERS] = {0};
    int first = -1, beside = peft_weights_scheme(path);
    if (layers > GEMMA_MAX_LAYERS) layers = GEMMA_MAX_LAYERS;
    for (int s = 0; s < PREFIX_COUNT && first < 0 && rc == 0; s++) {
        int scheme = beside < 0 ? s : s == 0 ? beside : s <= beside ? s - 1 : s;
        for (int l = 0; l < layers; l++) {
            mask[l] = 0;
            for (int p = 0; p < PROJ_COUNT; p++)
                if (peft_selects(&pt, scheme, l, p)) mask[l] |= 1u << p;
            if (mask[l] && first < 0) first = l;
        }
    }
    if (pt.has_target_re) regfree(&pt.target_re);
    if (pt.has_exclude_re) regfree(&pt.exclude_re);
    if (rc) return -1;
    if (first < 0) return fail(err, errlen, "%s: target_modules selects no projection of this model's layers", path);
    for (int l = first; l < layers; l++)
        if (mask[l] != mask[first])
            return fail(err, errlen, "%s: target_modules and layers_to_transform select different projections in layers %d "
                                     "and %d (of %d); the trainer adapts the same ones in each of the last N layers",
                        path, first, l, layers);
    memset(lc, 0, sizeof *lc);
    lc->rank = (int)json_integer_value(r);
    lc->scale = json_number_value(alpha) / (json_is_true(rslora) ? sqrt((double)lc->rank) : (double)lc->rank);
    lc->proj_mask = mask[first];
    lc->num_layers = first == 0 ? 0 : layers - first;
    return 0;
}

int adapter_config_load(const char *path, int layers, lora_config *lc, char *err, size_t errlen) {
    json_error_t je;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!root) /* jansson quotes the input near the error; fail makes the message one line */
        return fail(err, errlen, "%s: cannot read (%s)", path, je.text);
    lora_config out;
    int rc = !json_is_object(root) ? fail(err, errlen, "%s: not a JSON object", path)
             : json_object_get(root, "peft_type") ? peft_config_load(root, path, layers, &out, err, errlen)
                                                  : mlx_config_load(root, path, layers, &out, err, errlen);
    json_decref(root);
    if (rc == 0) *lc = out;
    return rc;
}

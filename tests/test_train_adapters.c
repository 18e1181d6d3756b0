/* test_train_adapters.c — the trainer's adapter files (train/adapters.h) on tiny Gemma 4 layouts
 * (config.json only; no base weights are needed to write and read adapters):
 *   1. round trips in mlx-lm's and peft's layouts, text-only and multimodal checkpoints, all or
 *      the last N layers: names, shapes and every element (peft's A and B transposed) checked in
 *      the files as written, the adapter_config.json fields, and the values read back;
 *   2. files written by others: mlx-lm's "__metadata__": null and its config without keys, peft's
 *      BF16 weights, "all-linear", a regular expression, rsLoRA;
 *   3. refusals, each one line naming the file: wrong shapes (an mlx-lm shape in a peft file),
 *      missing and extra tensors, non-finite values, layers_to_transform that is not the last N
 *      layers, Python-only expressions, peft methods and options that are not plain LoRA.
 * Usage: test_train_adapters. */
#define _GNU_SOURCE
#include "check.h"
#include "adapters.h"
#include "convert.h"
#include "safetensors.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TEXT_CONFIG                                                                                                   \
    "{\"model_type\": \"gemma4_text\", \"vocab_size\": 16, \"hidden_size\": 8, \"intermediate_size\": 12,\n"          \
    " \"num_hidden_layers\": 4, \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 4,\n"            \
    " \"global_head_dim\": 8, \"sliding_window\": 4,\n"                                                                \
    " \"layer_types\": [\"sliding_attention\", \"full_attention\", \"sliding_attention\", \"full_attention\"],\n"      \
    " \"rope_parameters\": {\"sliding_attention\": {\"rope_type\": \"default\", \"rope_theta\": 10000.0},\n"          \
    "   \"full_attention\": {\"rope_type\": \"proportional\", \"partial_rotary_factor\": 0.25, \"rope_theta\": 1000000.0}}}"
enum { LAYERS = 4 };

static char tmp[] = "/tmp/test_train_adapters.XXXXXX";
static char text_dir[600], mm_dir[600];

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
        fprintf(stderr, "test_train_adapters: cannot write %s\n", path);
        exit(2);
    }
}

static void make_dir(char *dir, size_t n, const char *name, const char *config) {
    char path[700];
    snprintf(dir, n, "%s/%s", tmp, name);
    mkdir(dir, 0777);
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_file(path, config);
}

/* A model laid out from dir's config.json with adapters of every slot filled with distinct values. */
static int model_for(gemma_model_f32 *m, const char *dir, int rank, double scale, unsigned mask, int num_layers, int seed) {
    lora_config lc = {rank, scale, mask, num_layers};
    char err[512];
    if (gemma_model_layout_f32(m, dir, &lc, err, sizeof err) != 0) return check_fail("layout %s: %s", dir, err), -1;
    for (size_t i = 0; i < m->param_count; i++) m->params[i] = (float)sin(0.37 * (double)i + seed) * 0.5f;
    return 0;
}

/* 1 line, starts with want_path, contains want */
static int one_line_about(const char *err, const char *want_path, const char *want) {
    return strchr(err, '\n') == NULL && strncmp(err, want_path, strlen(want_path)) == 0 && strstr(err, want) != NULL;
}

static json_t *load_json(const char *path) { return json_load_file(path, 0, NULL); }

/* every tensor of m's adapters in the file at path with the given prefix and suffixes, element by element,
 * transposed when peft */
static int file_matches(const gemma_model_f32 *m, const char *path, const char *prefix, int peft, char *why, size_t n) {
    st_file f;
    char err[512];
    if (st_open(path, &f, err, sizeof err) != 0) return snprintf(why, n, "%s", err), 0;
    int ok = f.count == 2 * m->slot_count;
    if (!ok) snprintf(why, n, "%d tensors, want %d", f.count, 2 * m->slot_count);
    for (int i = 0; i < m->slot_count && ok; i++) {
        const lora_slot *s = &m->slots[i];
        for (int k = 0; k < 2 && ok; k++) {
            char name[256];
            adapter_slot_name(name, sizeof name, prefix, s, peft ? (k ? "lora_B.weight" : "lora_A.weight") : (k ? "lora_b" : "lora_a"));
            const st_tensor *t = st_find(&f, name);
            int rows = k ? m->lora.rank : s->in, cols = k ? s->out : m->lora.rank; /* mlx-lm's A [in, r], B [r, out] */
            if (!t || t->dtype != ST_F32 || t->rank != 2 || t->shape[0] != (peft ? cols : rows) ||
                t->shape[1] != (peft ? rows : cols)) {
                snprintf(why, n, "\"%s\" missing or not F32 [%d, %d]", name, peft ? cols : rows, peft ? rows : cols);
                ok = 0;
                break;
            }
            const float *src = m->params + (k ? s->b : s->a);
            for (int x = 0; x < rows && ok; x++)
                for (int y = 0; y < cols && ok; y++) {
                    float v;
                    memcpy(&v, (const char *)t->data + 4 * (peft ? (size_t)y * rows + x : (size_t)x * cols + y), 4);
                    if (v != src[(size_t)x * cols + y]) {
                        snprintf(why, n, "\"%s\" element (%d, %d) of mlx-lm's layout is %g, want %g", name, x, y, v,
                                 src[(size_t)x * cols + y]);
                        ok = 0;
                    }
                }
        }
    }
    st_close(&f);
    return ok;
}

/* Save m in format to out, check the weights file's names against prefix, read config and weights
 * back into a fresh model, compare. */
static void round_trip(const char *label, const char *model_dir, adapter_format format, int rank, double scale, unsigned mask,
                       int num_layers, const char *prefix) {
    gemma_model_f32 m, back;
    char out[700], err[512], path[800], why[512] = "";
    snprintf(out, sizeof out, "%s/out-%s", tmp, label);
    mkdir(out, 0777);
    if (model_for(&m, model_dir, rank, scale, mask, num_layers, 1) != 0) return;
    if (adapters_save(&m, out, format, model_dir, err, sizeof err) != 0) {
        check_fail("%s: adapters_save: %s", label, err);
        gemma_model_free_f32(&m);
        return;
    }
    int peft = format == ADAPTERS_PEFT;
    snprintf(path, sizeof path, "%s/%s", out, peft ? "adapter_model.safetensors" : "adapters.safetensors");
    int ok = file_matches(&m, path, prefix, peft, why, sizeof why);
    check(ok, "adapters %s: %s holds %d tensors named %s... with the %s%s%s", label,
          peft ? "adapter_model.safetensors" : "adapters.safetensors", 2 * m.slot_count, prefix,
          peft ? "transposes (lora_A [r, in], lora_B [out, r])" : "values as trained (lora_a [in, r], lora_b [r, out])",
          ok ? "" : ": ", ok ? "" : why);

    /* config and weights back through the reader, located from the folder */
    char weights[800], cfg[800];
    lora_config lc;
    int rc = adapters_locate(out, 1, weights, sizeof weights, cfg, sizeof cfg, err, sizeof err);
    if (rc == 0) rc = adapter_config_load(cfg, LAYERS, &lc, err, sizeof err);
    if (rc != 0) {
        check_fail("adapters %s: reading back: %s", label, err);
        gemma_model_free_f32(&m);
        return;
    }
    check(strcmp(weights, path) == 0 && lc.rank == rank && fabs(lc.scale - scale) <= 1e-12 * scale && lc.proj_mask == mask &&
              lc.num_layers == (num_layers >= LAYERS ? 0 : num_layers),
          "adapters %s: adapter_config.json reads back as rank %d, scale %g, keys 0x%x, %d layers (got %d, %g, 0x%x, %d)", label,
          rank, scale, mask, num_layers, lc.rank, lc.scale, lc.proj_mask, lc.num_layers);
    if (gemma_model_layout_f32(&back, model_dir, &lc, err, sizeof err) != 0) {
        check_fail("adapters %s: layout: %s", label, err);
        gemma_model_free_f32(&m);
        return;
    }
    rc = adapters_load(&back, weights, err, sizeof err);
    check(rc == 0 && back.param_count == m.param_count &&
              memcmp(back.params, m.params, m.param_count * sizeof *m.params) == 0,
          "adapters %s: %zu adapter values read back exactly%s%s", label, m.param_count, rc ? ": " : "", rc ? err : "");

    /* the weights alone, for numbered checkpoints: the same bytes as the folder's file */
    snprintf(path, sizeof path, "%s/0000003_adapters.safetensors", out);
    rc = adapters_save_weights(&m, path, format, model_dir, err, sizeof err);
    check(rc == 0 && file_matches(&m, path, prefix, peft, why, sizeof why), "adapters %s: adapters_save_weights writes the same layout to a given path%s%s",
          label, rc ? ": " : "", rc ? err : "");
    gemma_model_free_f32(&back);
    gemma_model_free_f32(&m);
}

static void peft_config_fields(void) {
    gemma_model_f32 m;
    char out[700], err[512], path[800];
    snprintf(out, sizeof out, "%s/out-peft-fields", tmp);
    mkdir(out, 0777);
    unsigned mask = 1u << PROJ_Q | 1u << PROJ_V | 1u << PROJ_DOWN;
    if (model_for(&m, text_dir, 4, 2.5, mask, 2, 2) != 0) return;
    if (adapters_save(&m, out, ADAPTERS_PEFT, text_dir, err, sizeof err) != 0) {
        check_fail("peft config: %s", err);
        gemma_model_free_f32(&m);
        return;
    }
    snprintf(path, sizeof path, "%s/adapter_config.json", out);
    json_t *c = load_json(path);
    const json_t *tm = json_object_get(c, "target_modules"), *ltt = json_object_get(c, "layers_to_transform");
    char *base = realpath(text_dir, NULL);
    int ok = c && strcmp(json_string_value(json_object_get(c, "peft_type")), "LORA") == 0 &&
             strcmp(json_string_value(json_object_get(c, "task_type")), "CAUSAL_LM") == 0 &&
             json_integer_value(json_object_get(c, "r")) == 4 && json_number_value(json_object_get(c, "lora_alpha")) == 10.0 &&
             json_is_array(tm) && json_array_size(tm) == 3 && strcmp(json_string_value(json_array_get(tm, 0)), "q_proj") == 0 &&
             strcmp(json_string_value(json_array_get(tm, 1)), "v_proj") == 0 &&
             strcmp(json_string_value(json_array_get(tm, 2)), "down_proj") == 0 && json_is_array(ltt) &&
             json_array_size(ltt) == 2 && json_integer_value(json_array_get(ltt, 0)) == 2 &&
             json_integer_value(json_array_get(ltt, 1)) == 3 &&
             strcmp(json_string_value(json_object_get(c, "layers_pattern")), "layers") == 0 &&
             strcmp(json_string_value(json_object_get(c, "bias")), "none") == 0 &&
             json_number_value(json_object_get(c, "lora_dropout")) == 0.0 && json_is_false(json_object_get(c, "fan_in_fan_out")) &&
             json_is_false(json_object_get(c, "use_rslora")) && json_is_false(json_object_get(c, "use_dora")) &&
             json_is_null(json_object_get(c, "modules_to_save")) && base &&
             strcmp(json_string_value(json_object_get(c, "base_model_name_or_path")), base) == 0;
    check(ok, "peft adapter_config.json: peft_type LORA, task_type CAUSAL_LM, r 4, lora_alpha 10 (= scale 2.5 · r), "
              "target_modules [q_proj, v_proj, down_proj], layers_to_transform [2, 3], bias none, lora_dropout 0, "
              "fan_in_fan_out, use_rslora, use_dora false, base_model_name_or_path the model folder");
    free(base);
    json_decref(c);

    /* multimodal: an expression over the language model only, every layer */
    snprintf(out, sizeof out, "%s/out-peft-fields-mm", tmp);
    mkdir(out, 0777);
    gemma_model_f32 mm;
    if (model_for(&mm, mm_dir, 4, 2.0, mask, 0, 2) == 0 && adapters_save(&mm, out, ADAPTERS_PEFT, mm_dir, err, sizeof err) == 0) {
        snprintf(path, sizeof path, "%s/adapter_config.json", out);
        c = load_json(path);
        const char *re = json_string_value(json_object_get(c, "target_modules"));
        const char *want = "model\\.language_model\\.layers\\.[0-9]+\\.(self_attn\\.q_proj|self_attn\\.v_proj|mlp\\.down_proj)";
        check(re && strcmp(re, want) == 0 && json_is_null(json_object_get(c, "layers_to_transform")),
              "peft adapter_config.json, multimodal checkpoint: target_modules \"%s\" (got \"%s\"), no layers_to_transform", want,
              re ? re : "(none)");
        json_decref(c);
        gemma_model_free_f32(&mm);
    } else check_fail("peft config, multimodal: %s", err);
    gemma_model_free_f32(&m);
}

/* A safetensors file from a raw header (spaces appended to 8 bytes) and data. */
static void write_raw_safetensors(const char *path, const char *header, const void *data, size_t n) {
    size_t hl = strlen(header), padded = (hl + 7) & ~(size_t)7;
    uint64_t len = padded;
    FILE *f = fopen(path, "wb");
    if (!f) exit(2);
    fwrite(&len, 8, 1, f);
    fputs(header, f);
    for (size_t i = hl; i < padded; i++) fputc(' ', f);
    fwrite(data, 1, n, f);
    fclose(f);
}

/* Files written the way mlx-lm and peft write them, not by adapters_save. */
static void foreign_files(void) {
    gemma_model_f32 m;
    char dir[700], path[800], err[512];
    /* rank 1 on q of the last layer, a full one: A [8, 1], B [1, 16] (q_proj: hidden 8 → 2 heads · 8) */
    if (model_for(&m, text_dir, 1, 20.0, 1u << PROJ_Q, 1, 3) != 0) return;
    float a[8], b[16], want[24];
    for (int i = 0; i < 8; i++) a[i] = 0.25f * (float)(i + 1);
    for (int i = 0; i < 16; i++) b[i] = -0.5f * (float)(i + 1);
    memcpy(want, a, sizeof a);
    memcpy(want + 8, b, sizeof b);
    unsigned char data[96];
    memcpy(data, a, 32);
    memcpy(data + 32, b, 64);

    /* mx.save_safetensors: "__metadata__": null; mlx_lm.lora's config: every argument, no keys, num_layers 16 */
    snprintf(dir, sizeof dir, "%s/mlx-lm", tmp);
    mkdir(dir, 0777);
    snprintf(path, sizeof path, "%s/adapters.safetensors", dir);
    write_raw_safetensors(path,
                          "{\"__metadata__\":null,"
                          "\"model.layers.3.self_attn.q_proj.lora_a\":{\"dtype\":\"F32\",\"shape\":[8,1],\"data_offsets\":[0,32]},"
                          "\"model.layers.3.self_attn.q_proj.lora_b\":{\"dtype\":\"F32\",\"shape\":[1,16],\"data_offsets\":[32,96]}}",
                          data, 96);
    int rc = adapters_load(&m, path, err, sizeof err);
    check(rc == 0 && memcmp(m.params, want, sizeof want) == 0, "mlx-lm's adapters.safetensors with \"__metadata__\": null read%s%s",
          rc ? ": " : "", rc ? err : "");
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    write_file(path, "{\"model\": \"m\", \"train\": true, \"fine_tune_type\": \"lora\", \"num_layers\": 16, \"batch_size\": 4,"
                     " \"lora_parameters\": {\"rank\": 8, \"dropout\": 0.0, \"scale\": 20.0}}");
    lora_config lc;
    rc = adapter_config_load(path, LAYERS, &lc, err, sizeof err);
    check(rc == 0 && lc.rank == 8 && lc.scale == 20.0 && lc.num_layers == 0 && lc.proj_mask == (1u << PROJ_COUNT) - 1,
          "mlx-lm's own adapter_config.json (no keys: every projection; num_layers 16 > 4: every layer)%s%s", rc ? ": " : "",
          rc ? err : "");
    write_file(path, "{\"fine_tune_type\": \"dora\", \"num_layers\": 2, \"lora_parameters\": {\"rank\": 8, \"scale\": 20.0}}");
    rc = adapter_config_load(path, LAYERS, &lc, err, sizeof err);
    check(rc == -1 && one_line_about(err, path, "fine_tune_type"), "mlx-lm's DoRA adapters refused: %s", err);

    /* peft in bf16, the folder found from its name alone */
    snprintf(dir, sizeof dir, "%s/peft-bf16", tmp);
    mkdir(dir, 0777);
    uint16_t h[24]; /* exact in bf16: few mantissa bits; B [16, 1] transposed is B's 16 values in order */
    for (int i = 0; i < 8; i++) h[i] = wa_f32_to_bf16(a[i]);
    for (int i = 0; i < 16; i++) h[8 + i] = wa_f32_to_bf16(b[i]);
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    write_raw_safetensors(path,
                          "{\"__metadata__\":{\"format\":\"pt\"},"
                          "\"base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight\":{\"dtype\":\"BF16\",\"shape\":[1,8],\"data_offsets\":[0,16]},"
                          "\"base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight\":{\"dtype\":\"BF16\",\"shape\":[16,1],\"data_offsets\":[16,48]}}",
                          h, 48);
    char weights[800], cfg[800];
    memset(m.params, 0, m.param_count * sizeof *m.params);
    rc = adapters_locate(dir, 0, weights, sizeof weights, cfg, sizeof cfg, err, sizeof err);
    if (rc == 0) rc = adapters_load(&m, weights, err, sizeof err);
    check(rc == 0 && strcmp(weights, path) == 0 && *cfg == '\0' && memcmp(m.params, want, sizeof want) == 0,
          "peft's BF16 adapter_model.safetensors found in its folder and read%s%s", rc ? ": " : "", rc ? err : "");

    /* peft configs written by peft users */
    struct {
        const char *json, *what;
        int rank, num_layers;
        unsigned mask;
        double scale;
    } good[] = {
        {"{\"peft_type\": \"LORA\", \"r\": 16, \"lora_alpha\": 32, \"target_modules\": [\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\"]}",
         "a list of short names", 16, 0, 0xf, 2.0},
        {"{\"peft_type\": \"LORA\", \"r\": 16, \"lora_alpha\": 32, \"target_modules\": \"all-linear\", \"use_rslora\": true}",
         "\"all-linear\" with rsLoRA (alpha / sqrt r)", 16, 0, 0x7f, 8.0},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 16, \"target_modules\": \".*language_model\\\\..*\\\\.(q_proj|v_proj)\"}",
         "peft's own Gemma 4 default expression", 8, 0, 0x5, 2.0},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8, \"target_modules\": [\"self_attn.o_proj\", \"mlp.up_proj\"], "
         "\"layers_to_transform\": 3, \"layers_pattern\": \"layers\"}",
         "module paths, layers_to_transform one integer (the last layer)", 8, 1, 1u << PROJ_O | 1u << PROJ_UP, 1.0},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\"], \"exclude_modules\": \"model\\\\.layers\\\\.(0|1)\\\\..*\"}",
         "exclude_modules leaving the last 2 layers", 8, 2, 0x1, 1.0},
    };
    snprintf(path, sizeof path, "%s/peft-config.json", tmp);
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        write_file(path, good[i].json);
        memset(&lc, 0, sizeof lc);
        rc = adapter_config_load(path, LAYERS, &lc, err, sizeof err);
        check(rc == 0 && lc.rank == good[i].rank && fabs(lc.scale - good[i].scale) < 1e-12 && lc.proj_mask == good[i].mask &&
                  lc.num_layers == good[i].num_layers,
              "peft adapter_config.json, %s: rank %d, scale %g, keys 0x%x, %d layers (got %d, %g, 0x%x, %d)%s%s", good[i].what,
              good[i].rank, good[i].scale, good[i].mask, good[i].num_layers, lc.rank, lc.scale, lc.proj_mask, lc.num_layers,
              rc ? ": " : "", rc ? err : "");
    }

    struct { const char *json, *want, *what; } bad[] = {
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\"], \"layers_to_transform\": [0, 1]}",
         "the last N layers", "layers_to_transform [0, 1] of 4 (the first layers)"},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\"], \"layers_to_transform\": [1, 3]}",
         "the last N layers", "layers_to_transform [1, 3] (a gap)"},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8, \"target_modules\": \"model\\\\.layers\\\\.\\\\d+\\\\.self_attn\\\\.q_proj\"}",
         "POSIX extended syntax", "an expression with Python's \\d"},
        /* shapes glibc's regcomp takes seconds to minutes on (refused before it sees them; without that
         * refusal these cases hang the test) */
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8, \"target_modules\": \".$.************************"
         "****************************************************************************************\\\\_proj)\"}",
         "POSIX extended syntax", "a run of 112 '*'"},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8, \"target_modules\": \"(((|)|(|))((|)|(|))((|)|(|))"
         "((|)|(|))((|)|(|))((|)|(|))((|)|(|))((|)|(|))((|)|(|))((|)|(|)))*\"}",
         "POSIX extended syntax", "nested empty branches under '*'"},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8, \"target_modules\": \"(a|.*)*(b|.*)*(c|.*)*(d|.*)*(q_proj|.*)\"}",
         "POSIX extended syntax", "nine repetition operators"},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8, \"target_modules\": [\"c_attn\"]}", "selects no projection",
         "target_modules naming no projection of the model"},
        {"{\"peft_type\": \"PREFIX_TUNING\", \"num_virtual_tokens\": 20}", "peft_type", "peft_type PREFIX_TUNING"},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\"], \"use_dora\": true}", "DoRA", "use_dora"},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\"], \"bias\": \"all\"}", "bias", "bias all"},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\"], \"rank_pattern\": {\"q_proj\": 4}}",
         "rank_pattern", "rank_pattern"},
        {"{\"peft_type\": \"LORA\", \"r\": 0, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\"]}", "r must be", "r 0"},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8}", "target_modules", "no target_modules"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        write_file(path, bad[i].json);
        rc = adapter_config_load(path, LAYERS, &lc, err, sizeof err);
        check(rc == -1 && one_line_about(err, path, bad[i].want), "peft adapter_config.json refused: %s: %s", bad[i].what, err);
    }
    gemma_model_free_f32(&m);
}

/* Weights files the model cannot take: one line each, and the adapters untouched. */
static void weight_refusals(void) {
    gemma_model_f32 m;
    char out[700], path[800], err[512];
    if (model_for(&m, text_dir, 2, 2.0, 1u << PROJ_Q | 1u << PROJ_V, 0, 4) != 0) return;
    snprintf(out, sizeof out, "%s/refusals", tmp);
    mkdir(out, 0777);
    float *before = malloc(m.param_count * sizeof *before);
    memcpy(before, m.params, m.param_count * sizeof *before);
    unsigned char data[256] = {0};
    struct { const char *header, *want, *what; } bad[] = {
        /* q_proj of layer 0: A [8, 2] for mlx-lm, [2, 8] for peft; an mlx-lm shape under peft's names */
        {"{\"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight\":{\"dtype\":\"F32\",\"shape\":[8,2],\"data_offsets\":[0,64]}}",
         "must be F32 [2, 8]", "peft names with mlx-lm's (untransposed) shape"},
        {"{\"model.layers.0.self_attn.q_proj.lora_a\":{\"dtype\":\"F32\",\"shape\":[8,2],\"data_offsets\":[0,64]}}",
         "no adapter \"model.layers.0.self_attn.q_proj.lora_b\"", "a missing tensor"},
        {"{\"model.layers.0.self_attn.q_proj.lora_a\":{\"dtype\":\"I32\",\"shape\":[8,2],\"data_offsets\":[0,64]}}",
         "must be F32", "an integer dtype"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(path, sizeof path, "%s/bad%zu.safetensors", out, i);
        write_raw_safetensors(path, bad[i].header, data, 64);
        int rc = adapters_load(&m, path, err, sizeof err);
        check(rc == -1 && one_line_about(err, path, bad[i].want) && memcmp(m.params, before, m.param_count * sizeof *before) == 0,
              "adapters refused: %s: %s", bad[i].what, err);
    }

    /* a complete file plus one tensor more (k_proj); then one holding a NaN */
    gemma_model_f32 other;
    if (model_for(&other, text_dir, 2, 2.0, 1u << PROJ_Q | 1u << PROJ_V | 1u << PROJ_K, 0, 5) == 0) {
        snprintf(path, sizeof path, "%s/more.safetensors", out);
        int rc = adapters_save_weights(&other, path, ADAPTERS_MLX, text_dir, err, sizeof err);
        if (rc == 0) rc = adapters_load(&m, path, err, sizeof err);
        check(rc == -1 && one_line_about(err, path, "k_proj.lora_a\" has no place in this model") &&
                  memcmp(m.params, before, m.param_count * sizeof *before) == 0,
              "adapters refused: a tensor the LoRA setup has no slot for: %s", err);
        gemma_model_free_f32(&other);
    }
    if (model_for(&other, text_dir, 2, 2.0, 1u << PROJ_Q | 1u << PROJ_V, 0, 5) == 0) {
        other.params[5] = NAN;
        snprintf(path, sizeof path, "%s/nan.safetensors", out);
        int rc = adapters_save_weights(&other, path, ADAPTERS_PEFT, text_dir, err, sizeof err);
        if (rc == 0) rc = adapters_load(&m, path, err, sizeof err);
        check(rc == -1 && one_line_about(err, path, "non-finite value (NaN)") &&
                  memcmp(m.params, before, m.param_count * sizeof *before) == 0,
              "adapters refused: a NaN in a peft file: %s", err);
        gemma_model_free_f32(&other);
    }
    /* a folder with both layouts and no config to choose, and one with neither */
    if (adapters_save(&m, out, ADAPTERS_MLX, text_dir, err, sizeof err) != 0) check_fail("refusals: %s", err);
    char weights[800], cfg[800];
    snprintf(path, sizeof path, "%s/adapter_config.json", out);
    unlink(path);
    if (adapters_save_weights(&m, (snprintf(path, sizeof path, "%s/adapter_model.safetensors", out), path), ADAPTERS_PEFT,
                              text_dir, err, sizeof err) == 0) {
        int rc = adapters_locate(out, 0, weights, sizeof weights, cfg, sizeof cfg, err, sizeof err);
        check(rc == -1 && one_line_about(err, out, "says which one is meant"), "a folder with both layouts and no adapter_config.json refused: %s", err);
    }
    int rc = adapters_locate(tmp, 0, weights, sizeof weights, cfg, sizeof cfg, err, sizeof err);
    check(rc == -1 && one_line_about(err, tmp, "holds neither"), "a folder without adapters refused: %s", err);
    rc = adapters_locate(text_dir, 1, weights, sizeof weights, cfg, sizeof cfg, err, sizeof err);
    check(rc == -1 && one_line_about(err, text_dir, "holds neither"), "a resume folder without adapters refused: %s", err);
    free(before);
    gemma_model_free_f32(&m);
}

int main(void) {
    if (!mkdtemp(tmp)) return fprintf(stderr, "test_train_adapters: mkdtemp failed\n"), 2;
    make_dir(text_dir, sizeof text_dir, "text", TEXT_CONFIG);
    make_dir(mm_dir, sizeof mm_dir, "mm", "{\"model_type\": \"gemma4\", \"architectures\": [\"Gemma4ForConditionalGeneration\"], "
                                          "\"vision_config\": {\"hidden_size\": 8}, \"text_config\": " TEXT_CONFIG "}");
    unsigned attn = 1u << PROJ_Q | 1u << PROJ_K | 1u << PROJ_V | 1u << PROJ_O, all = (1u << PROJ_COUNT) - 1;
    round_trip("mlx-text", text_dir, ADAPTERS_MLX, 4, 20.0, attn, 0, "model.");
    round_trip("mlx-text-last2", text_dir, ADAPTERS_MLX, 3, 0.5, all, 2, "model.");
    round_trip("mlx-multimodal", mm_dir, ADAPTERS_MLX, 2, 8.0, attn, 0, "language_model.model.");
    round_trip("peft-text", text_dir, ADAPTERS_PEFT, 4, 20.0, attn, 0, "base_model.model.model.");
    round_trip("peft-text-last3", text_dir, ADAPTERS_PEFT, 5, 0.3, all, 3, "base_model.model.model.");
    round_trip("peft-multimodal", mm_dir, ADAPTERS_PEFT, 4, 2.0, attn, 0, "base_model.model.model.language_model.");
    round_trip("peft-multimodal-last1", mm_dir, ADAPTERS_PEFT, 2, 1.5, 1u << PROJ_Q | 1u << PROJ_UP, 1,
               "base_model.model.model.language_model.");
    peft_config_fields();
    foreign_files();
    weight_refusals();
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0) fprintf(stderr, "test_train_adapters: could not remove %s\n", tmp);
    return check_summary();
}

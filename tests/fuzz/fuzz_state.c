/* fuzz_state.c — libFuzzer target for the files `winattn train` reads on --resume and --adapters
 * (train/adapters.c, train/trainer.c): adapters_load (adapters.safetensors or peft's
 * adapter_model.safetensors), optimizer_load (optimizer.safetensors) and adapter_config_load
 * (mlx-lm's or peft's adapter_config.json).
 *
 * LLVMFuzzerInitialize builds one tiny Gemma 4 (2 layers, hidden 8, LoRA rank 2 on q and v: 64
 * adapter parameters) with gemma_model_layout_f32 from a fixed config.json in a private temporary
 * directory. Each input is written there as optimizer.safetensors, and all three readers read
 * that one file (each is fed the others' formats too, which they must refuse cleanly). Checked:
 *   every reader: 0, or -1 with a non-empty one-line message that starts with the file's path;
 *   optimizer_load, 0: batches in [0, iters], updates in [0, batches];
 *   adapter_config_load, 0: rank in [1, 4096], a finite scale, num_layers in [0, layers),
 *     projection bits below PROJ_COUNT.
 * adapters_load copies every A and B (ASan checks the reads stay inside the file). A broken contract abort()s; ASan, UBSan and
 * LeakSanitizer catch the rest.
 *
 * Seeds: FUZZ_STATE_SEEDS=DIR $(BUILD)/fuzz/fuzz_state writes this model's adapters.safetensors,
 * adapter_config.json, peft's adapter_model.safetensors and adapter_config.json (as
 * adapter_config_peft.json) and optimizer.safetensors into DIR and exits (tests/fuzz/corpus_state/
 * holds them). Build: make fuzz; run: make fuzz-check, or see docs/fuzzing.md.
 */
#define _GNU_SOURCE
#include "safetensors.h"
#include "trainer.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char CONFIG[] =
    "{\"model_type\": \"gemma4_text\", \"vocab_size\": 16, \"hidden_size\": 8, \"intermediate_size\": 8,\n"
    " \"num_hidden_layers\": 2, \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 4,\n"
    " \"global_head_dim\": 8, \"sliding_window\": 4, \"layer_types\": [\"sliding_attention\", \"full_attention\"],\n"
    " \"rope_parameters\": {\"sliding_attention\": {\"rope_type\": \"default\", \"rope_theta\": 10000.0},\n"
    "   \"full_attention\": {\"rope_type\": \"proportional\", \"partial_rotary_factor\": 0.25, \"rope_theta\": 1000000.0}}}\n";
enum { ITERS = 100 };

static char dir[256], file[320];
static gemma_model_f32 model;
static optimizer opt;

static void cleanup(void) {
    char p[320];
    snprintf(p, sizeof p, "%s/config.json", dir);
    unlink(p);
    unlink(file);
    rmdir(dir);
}

static void die(const char *what, const char *err) {
    fprintf(stderr, "fuzz_state: %s: %s\n", what, err);
    exit(2);
}

static void write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n || fclose(f) != 0) die(path, "cannot write");
}

static void write_seeds(const char *out) {
    char err[512], path[1024];
    if (mkdir(out, 0777) != 0 && access(out, W_OK) != 0) die(out, "cannot create");
    gemma_lora_init_f32(&model, 1);
    for (size_t i = 0; i < model.param_count; i++) model.params[i] += 0.25f * (float)(i % 7); /* B non-zero too */
    if (adapters_save(&model, out, ADAPTERS_MLX, dir, err, sizeof err) != 0) die("adapters_save", err);
    /* peft's pair too, renamed beside mlx-lm's */
    char peft[1024], from[1100], to[1100];
    snprintf(peft, sizeof peft, "%s/peft", out);
    if (mkdir(peft, 0777) != 0 || adapters_save(&model, peft, ADAPTERS_PEFT, dir, err, sizeof err) != 0)
        die("adapters_save peft", err);
    static const char *const names[][2] = {{"adapter_model.safetensors", "adapter_model.safetensors"},
                                           {"adapter_config.json", "adapter_config_peft.json"}};
    for (int i = 0; i < 2; i++) {
        snprintf(from, sizeof from, "%s/%s", peft, names[i][0]);
        snprintf(to, sizeof to, "%s/%s", out, names[i][1]);
        if (rename(from, to) != 0) die(from, "cannot rename");
    }
    rmdir(peft);
    for (size_t i = 0; i < opt.n; i++) opt.m1[i] = 0.01f * (float)i, opt.m2[i] = 1e-4f * (float)i;
    st_out outs[2] = {{"m1", ST_F32, 1, {(int64_t)opt.n}, opt.m1}, {"m2", ST_F32, 1, {(int64_t)opt.n}, opt.m2}};
    const char *meta[] = {"updates", "3", "batches", "6", NULL};
    snprintf(path, sizeof path, "%s/optimizer.safetensors", out);
    if (st_write(path, outs, 2, meta, err, sizeof err) != 0) die("st_write", err);
    exit(0);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(dir, sizeof dir, "%s/fuzz_state.XXXXXX", base);
    if (!mkdtemp(dir)) die(dir, "mkdtemp failed");
    atexit(cleanup);
    char path[320], err[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_file(path, CONFIG, sizeof CONFIG - 1);
    snprintf(file, sizeof file, "%s/optimizer.safetensors", dir);
    lora_config lc = {0};
    lc.rank = 2;
    lc.scale = 2.0;
    lc.proj_mask = 1u << PROJ_Q | 1u << PROJ_V;
    if (gemma_model_layout_f32(&model, dir, &lc, err, sizeof err) != 0) die("gemma_model_layout_f32", err);
    opt.n = model.param_count;
    opt.m1 = calloc(opt.n, sizeof(float));
    opt.m2 = calloc(opt.n, sizeof(float));
    if (!opt.m1 || !opt.m2) die("calloc", "out of memory");
    const char *seeds = getenv("FUZZ_STATE_SEEDS");
    if (seeds) write_seeds(seeds);
    return 0;
}

/* -1 with a non-empty one-line message that starts with "path: " */
static void check_refusal(int rc, const char *err, const char *path) {
    size_t n = strlen(path);
    if (rc != -1 || strncmp(err, path, n) != 0 || err[n] != ':' || strlen(err) <= n + 2 || strchr(err, '\n') != NULL ||
        strchr(err, '\r') != NULL)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    write_file(file, data, size);
    char err[512];

    memset(model.params, 0, model.param_count * sizeof *model.params);
    err[0] = '\0';
    int rc = adapters_load(&model, file, err, sizeof err);
    if (rc != 0) check_refusal(rc, err, file);

    long batches = -1;
    opt.updates = -1;
    err[0] = '\0';
    rc = optimizer_load(&opt, &batches, ITERS, dir, err, sizeof err);
    if (rc != 0) check_refusal(rc, err, file);
    else if (batches < 0 || batches > ITERS || opt.updates < 0 || opt.updates > batches)
        abort();

    lora_config lc;
    memset(&lc, 0xff, sizeof lc);
    err[0] = '\0';
    rc = adapter_config_load(file, model.cfg.layers, &lc, err, sizeof err);
    if (rc != 0) check_refusal(rc, err, file);
    else if (lc.rank < 1 || lc.rank > 4096 || !isfinite(lc.scale) || lc.num_layers < 0 ||
             lc.num_layers >= model.cfg.layers || (lc.proj_mask >> PROJ_COUNT) != 0)
        abort();
    return 0;
}

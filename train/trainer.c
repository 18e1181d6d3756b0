/* trainer.c — see trainer.h. The step: zero the adapter gradients every grad_accum batches; one
 * forward + backward over the batch packed into one sequence (or, with pack = 0, one per record),
 * with grad_scale = 1 / (the batch's target count · grad_accum) so the gradient is that of mlx-lm's
 * token-weighted batch mean; then Adam(W). */
#define _GNU_SOURCE
#include "trainer.h"

#include "adapters.h"
#include "data.h"
#include "linalg.h"
#include "rng.h"
#include "atomic_file.h"
#include "platform.h"
#include "safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void train_defaults(train_options *o) {
    memset(o, 0, sizeof *o);
    o->arm = ATTN_FUSED;
    o->chunk = 512;
    o->epochs = 2;
    o->batch = 4;
    o->pack = 1;
    o->grad_accum = 1;
    o->lr = 1e-5;
    o->beta1 = 0.9;
    o->beta2 = 0.999;
    o->eps = 1e-8;
    o->weight_decay = 0.01;
    o->lora.rank = 32;
    o->lora.scale = 20.0;
    o->lora.proj_mask = 1u << PROJ_Q | 1u << PROJ_K | 1u << PROJ_V | 1u << PROJ_O;
    o->lora.num_layers = 0;
}

static int fail(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
}

/* ---------------------------------------------------------------------------------------------
 * Optimizer state: first and second moments, and the step, for --resume. */

/* struct optimizer and optimizer_load: trainer.h */

static int optimizer_save(const optimizer *opt, long batches_done, const char *dir, char *err, size_t errlen) {
    st_out outs[2] = {{"m1", ST_F32, 1, {(int64_t)opt->n}, opt->m1}, {"m2", ST_F32, 1, {(int64_t)opt->n}, opt->m2}};
    char updates[32], batches[32], path[4096];
    snprintf(updates, sizeof updates, "%ld", opt->updates);
    snprintf(batches, sizeof batches, "%ld", batches_done);
    const char *meta[] = {"updates", updates, "batches", batches, NULL};
    snprintf(path, sizeof path, "%s/optimizer.safetensors", dir);
    return st_write(path, outs, 2, meta, err, errlen);
}

/* A metadata integer: decimal digits only, within [lo, hi]; strtol alone reads "3x" as 3, "abc" as 0
 * and wraps "4294967297" through a narrower type. */
static int meta_long(const char *text, long lo, long hi, long *out) {
    if (!text || !*text || strlen(text) > 18) return -1;
    long v = 0;
    for (const char *c = text; *c; c++) {
        if (*c < '0' || *c > '9') return -1;
        v = v * 10 + (*c - '0');
    }
    if (v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

/* iters: the run's batch count; a checkpoint may be at most that far in. */
int optimizer_load(optimizer *opt, long *batches_done, long iters, const char *dir, char *err, size_t errlen) {
    char path[4096];
    snprintf(path, sizeof path, "%s/optimizer.safetensors", dir);
    st_file f;
    if (st_open(path, &f, err, errlen) != 0) return -1;
    const st_tensor *a = st_find(&f, "m1"), *b = st_find(&f, "m2");
    const char *u = st_metadata(&f, "updates"), *bd = st_metadata(&f, "batches");
    int rc = 0;
    if (!a || !b || !u || !bd || a->dtype != ST_F32 || b->dtype != ST_F32 || st_numel(a) != opt->n ||
        st_numel(b) != opt->n)
        rc = fail(err, errlen, "%s: needs F32 m1 and m2 of %zu entries and metadata updates, batches", path, opt->n);
    else if (meta_long(bd, 0, iters, batches_done) != 0)
        rc = fail(err, errlen, "%s: metadata batches = \"%.40s\" is not an integer in [0, %ld] (this run's batches)", path,
                  bd, iters);
    else if (meta_long(u, 0, *batches_done, &opt->updates) != 0)
        rc = fail(err, errlen, "%s: metadata updates = \"%.40s\" is not an integer in [0, %ld] (its batches)", path, u,
                  *batches_done);
    else {
        memcpy(opt->m1, a->data, opt->n * sizeof(float));
        memcpy(opt->m2, b->data, opt->n * sizeof(float));
    }
    st_close(&f);
    return rc;
}

/* MLX's Adam: m ← β1 m + (1−β1) g, v ← β2 v + (1−β2) g², p ← p − lr · m / (√v + ε), bias
 * correction optional; AdamW first decays p by lr · wd. */
/* One range of the update; every element is independent, so the result does not depend on how
 * the ranges are cut. */
typedef struct adam_range {
    optimizer *opt;
    float *params;
    const float *grads;
    const train_options *o;
    double lr;
    size_t lo, hi;
} adam_range;

static void *adam_run(void *arg) {
    const adam_range *r = arg;
    const train_options *o = r->o;
    optimizer *opt = r->opt;
    for (size_t i = r->lo; i < r->hi; i++) {
        double g = r->grads[i];
        opt->m1[i] = (float)(o->beta1 * opt->m1[i] + (1 - o->beta1) * g);
        opt->m2[i] = (float)(o->beta2 * opt->m2[i] + (1 - o->beta2) * g * g);
        double p = r->params[i];
        if (o->adamw) p *= 1 - o->lr * o->weight_decay;
        r->params[i] = (float)(p - r->lr * opt->m1[i] / (sqrt((double)opt->m2[i]) + o->eps));
    }
    return NULL;
}

/* Spread over the run's threads: a 31B model's rank-32 adapters are 90M parameters, whose
 * double-precision update takes about a second on one core, a quarter of a GPU step. */
static void optimizer_update(optimizer *opt, float *params, const float *grads, const train_options *o) {
    opt->updates++;
    double lr = o->lr;
    if (o->bias_correction)
        lr *= sqrt(1 - pow(o->beta2, (double)opt->updates)) / (1 - pow(o->beta1, (double)opt->updates));
    enum { MAX_THREADS = 32 };
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    int n = o->threads > 0 ? o->threads : (int)(online > 0 ? online : 1);
    if (n > MAX_THREADS) n = MAX_THREADS;
    if (opt->n < ((size_t)1 << 20)) n = 1;
    adam_range r[MAX_THREADS];
    pthread_t th[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < n; t++) {
        r[t] = (adam_range){opt, params, grads, o, lr, opt->n * t / n, opt->n * (t + 1) / n};
        if (t > 0) started[t] = pthread_create(&th[t], NULL, adam_run, &r[t]) == 0;
    }
    adam_run(&r[0]);
    for (int t = 1; t < n; t++) {
        if (started[t]) pthread_join(th[t], NULL);
        else adam_run(&r[t]); /* no thread to be had: this range on the caller */
    }
}

/* ---------------------------------------------------------------------------------------------
 * Schedule: mlx-lm's iterate_batches. Batches are consecutive records (its length sort compares
 * raw records and is a no-op, docs/design.md §6.3), the remainder is dropped, and every pass
 * visits the batches in a fresh permutation. */

/* order[i] = the first record of the i-th batch trained, for iters batches */
static int *batch_schedule(int records, int batch, int iters, uint64_t seed) {
    int per_pass = records / batch;
    int *order = malloc((size_t)(iters > 0 ? iters : 1) * sizeof *order);
    int *perm = malloc((size_t)per_pass * sizeof *perm);
    if (!order || !perm) {
        free(order);
        free(perm);
        return NULL;
    }
    uint64_t s = seed ^ 0x5eedba7c4e5ULL;
    for (int i = 0; i < iters; i++) {
        if (i % per_pass == 0) { /* Fisher–Yates */
            for (int j = 0; j < per_pass; j++) perm[j] = j;
            for (int j = per_pass - 1; j > 0; j--) {
                int k = (int)(splitmix64(&s) % (uint64_t)(j + 1));
                int t = perm[j];
                perm[j] = perm[k];
                perm[k] = t;
            }
        }
        order[i] = perm[i % per_pass] * batch;
    }
    free(perm);
    return order;
}

/* ---------------------------------------------------------------------------------------------
 * Measurements */

/* Linux resets VmHWM to the current RSS when "5" is written to clear_refs, so each step's peak
 * is its own (not the run's so far). */
static void reset_peak_rss(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (f) {
        fputs("5", f);
        fclose(f);
    }
}

static uint64_t weights_hash(const gemma_model_f32 *m) {
    uint64_t h = 0xcbf29ce484222325ULL;
    const unsigned char *p = (const unsigned char *)m->weights;
    for (size_t i = 0; i < m->weight_count * sizeof(float); i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}

static void format_duration(double s, char *buf, size_t n) {
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, n, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else snprintf(buf, n, "%ldm%02lds", t / 60, t % 60);
}

/* the records b[0..n) as the model takes them */
static gemma_seq *batch_seqs(const sequence *b, int n) {
    gemma_seq *s = malloc((size_t)n * sizeof *s);
    for (int j = 0; s && j < n; j++) s[j] = (gemma_seq){b[j].tokens, b[j].len, b[j].target_mask};
    return s;
}

/* A batch's forward, or forward and backward, on the device the run uses: the CPU model, or the
 * GPU one (gpu not NULL) with m holding the adapters and their gradients. */
static int batch_forward(gemma_model_f32 *m, gemma_cuda *gpu, const gemma_seq *s, int n, gemma_stats *st) {
    if (!gpu) return gemma_forward_batch_f32(m, s, n, st, NULL);
    return gemma_cuda_forward_batch(gpu, m, s, n, st, NULL, m->err, sizeof m->err);
}

static int batch_backward(gemma_model_f32 *m, gemma_cuda *gpu, const gemma_seq *s, int n, double scale,
                          gemma_stats *st) {
    if (!gpu) return gemma_backward_batch_f32(m, s, n, scale, st);
    return gemma_cuda_backward_batch(gpu, m, s, n, scale, st, m->err, sizeof m->err);
}

static int evaluate(gemma_model_f32 *m, gemma_cuda *gpu, const dataset *valid, int batch, int pack, gemma_stats *st) {
    memset(st, 0, sizeof *st);
    /* mlx-lm evaluates whole batches only; so do we, for the same token set */
    int n = valid->count / batch * batch, step = pack ? batch : 1;
    for (int i = 0; i < n; i += step) {
        gemma_seq *s = batch_seqs(&valid->seq[i], step);
        if (!s) return snprintf(m->err, sizeof m->err, "out of memory"), -1;
        int rc = batch_forward(m, gpu, s, step, st);
        free(s);
        if (rc != 0) return -1;
        if (isatty(STDERR_FILENO)) fprintf(stderr, "\r  eval %d/%d ", i + step, n);
    }
    if (isatty(STDERR_FILENO)) fprintf(stderr, "\r%*s\r", 30, "");
    return 0;
}

/* Evaluate, print one line and log it; "label" says when ("before training", "after step 43"). */
static int report_eval(gemma_model_f32 *m, gemma_cuda *gpu, const dataset *valid, const train_options *o, int step,
                       const char *label, FILE *log, char *err, size_t errlen);

static void log_line(FILE *log, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void log_line(FILE *log, const char *fmt, ...) {
    if (!log) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(log, fmt, ap);
    va_end(ap);
    fputc('\n', log);
    fflush(log);
}

static int report_eval(gemma_model_f32 *m, gemma_cuda *gpu, const dataset *valid, const train_options *o, int step,
                       const char *label, FILE *log, char *err, size_t errlen) {
    gemma_stats ev;
    double t0 = now_seconds();
    if (evaluate(m, gpu, valid, o->batch, o->pack, &ev) != 0) return fail(err, errlen, "evaluation: %s", m->err);
    double vl = ev.loss_sum / (ev.tokens ? ev.tokens : 1), ag = (double)ev.agree / (ev.tokens ? ev.tokens : 1);
    printf("eval%s%s: held-out loss %.4f over %ld tokens, next-token agreement %.2f%% (%.1f s)\n", *label ? " " : "", label, vl, ev.tokens,
           100 * ag, now_seconds() - t0);
    fflush(stdout);
    log_line(log, "{\"eval\": %d, \"loss\": %.6f, \"agreement\": %.6f, \"tokens\": %ld}", step, vl, ag, ev.tokens);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * A non-finite loss or gradient stops the run. The check sits between the backward and the
 * optimizer update, so the adapters and moments are still those of the last update. */

/* 1 and the first bad entry named in what ("the gradient of model.layers.0.self_attn.q_proj.lora_a
 * (NaN at element 12)") when the loss sum or an adapter gradient is NaN or ±inf; else 0. */
static int batch_nonfinite(const gemma_model_f32 *m, const gemma_stats *st, char *what, size_t n) {
    if (!isfinite(st->loss_sum)) {
        snprintf(what, n, "the loss is not finite (%g summed over %ld targets)", st->loss_sum, st->tokens);
        return 1;
    }
    for (int i = 0; i < m->slot_count; i++)
        for (int k = 0; k < 2; k++) {
            const lora_slot *s = &m->slots[i];
            const float *g = m->grads + (k ? s->b : s->a);
            size_t len = (size_t)m->lora.rank * (size_t)(k ? s->out : s->in);
            for (size_t j = 0; j < len; j++)
                if (!isfinite(g[j])) {
                    char name[160];
                    adapter_slot_name(name, sizeof name, "model.", s, k ? "lora_b" : "lora_a");
                    snprintf(what, n, "the gradient of %s is not finite (%s at element %zu)", name,
                             isnan(g[j]) ? "NaN" : g[j] > 0 ? "inf" : "-inf", j);
                    return 1;
                }
        }
    return 0;
}

static int same_dir(const char *a, const char *b) {
    struct stat sa, sb;
    return a && b && stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

/* Step `step` went non-finite (what says how). The adapters and optimizer state after batch
 * good_batches (the last update) go to o->out_dir, unless the run resumed from that directory and
 * has not updated since, so it holds them already. err gets the one line; returns -1. */
static int stop_nonfinite(const gemma_model_f32 *m, const optimizer *opt, const train_options *o, int step,
                          const char *what, long good_batches, long first_batch, char *err, size_t errlen) {
    char when[48];
    if (good_batches > 0) snprintf(when, sizeof when, "after step %ld", good_batches);
    else snprintf(when, sizeof when, "before training");
    if (!o->out_dir) return fail(err, errlen, "step %d: %s; stopped (no --out, nothing saved)", step, what);
    if (good_batches == first_batch && same_dir(o->resume_dir, o->out_dir))
        return fail(err, errlen, "step %d: %s; stopped, %s holds the adapters and optimizer state %s", step, what,
                    o->out_dir, when);
    char serr[512];
    if (adapters_save(m, o->out_dir, o->format, o->model_dir, serr, sizeof serr) != 0 ||
        optimizer_save(opt, good_batches, o->out_dir, serr, sizeof serr) != 0)
        return fail(err, errlen, "step %d: %s; stopped, and saving the state %s failed: %s", step, what, when, serr);
    return fail(err, errlen, "step %d: %s; stopped, the adapters and optimizer state %s are in %s", step, what, when,
                o->out_dir);
}

/* ---------------------------------------------------------------------------------------------
 * The run */

/* The files a run may write, against the files it reads: an output that is an input (the same
 * inode: --log data/train.jsonl, --out the model folder with a file of the same name) would
 * destroy the input when written. Checked before anything is loaded. */
static int same_file(const char *a, const char *b) {
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && S_ISREG(sa.st_mode) && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

static int outputs_spare_inputs(const train_options *o, char *err, size_t errlen) {
    enum { MAX_FILES = 256 };
    char *inputs[MAX_FILES], *outputs[8];
    int ni = 0, no = 0, rc = 0;
    static const char *data_files[] = {"train.jsonl", "valid.jsonl", "test.jsonl"};
    for (size_t i = 0; i < sizeof data_files / sizeof *data_files && o->data_dir; i++)
        if (asprintf(&inputs[ni], "%s/%s", o->data_dir, data_files[i]) >= 0) ni++;
    if (o->data_dir && (inputs[ni] = strdup(o->data_dir))) ni++; /* --data FILE */
    DIR *d = o->model_dir ? opendir(o->model_dir) : NULL; /* config.json, the weights, the index */
    for (struct dirent *e; d && ni < MAX_FILES - 4 && (e = readdir(d));)
        if (e->d_name[0] != '.' && asprintf(&inputs[ni], "%s/%s", o->model_dir, e->d_name) >= 0) ni++;
    if (d) closedir(d);
    if (o->adapters_path && (inputs[ni] = strdup(o->adapters_path))) ni++;
    static const char *resumed[] = {"adapters.safetensors", "adapter_model.safetensors", "adapter_config.json",
                                    "optimizer.safetensors"};
    for (size_t i = 0; i < sizeof resumed / sizeof *resumed && o->resume_dir; i++)
        if (asprintf(&inputs[ni], "%s/%s", o->resume_dir, resumed[i]) >= 0) ni++;
    if (o->log_path && (outputs[no] = strdup(o->log_path))) no++;
    static const char *written[] = {"adapters.safetensors", "adapter_model.safetensors", "adapter_config.json",
                                    "optimizer.safetensors", "log.jsonl"};
    for (size_t i = 0; i < sizeof written / sizeof *written && o->out_dir; i++)
        if (asprintf(&outputs[no], "%s/%s", o->out_dir, written[i]) >= 0) no++;
    for (int a = 0; a < no && rc == 0; a++) {
        for (int b = 0; b < ni && rc == 0; b++) {
            /* resuming into the same folder rewrites its own checkpoint: that is the point */
            const char *oa = strrchr(outputs[a], '/'), *ib = strrchr(inputs[b], '/');
            int own = o->resume_dir && o->out_dir && same_dir(o->resume_dir, o->out_dir) && oa && ib &&
                      strcmp(oa, ib) == 0;
            if (!own && same_file(outputs[a], inputs[b]))
                rc = fail(err, errlen, "%s would overwrite the input %s: choose another path", outputs[a], inputs[b]);
        }
        for (int b = a + 1; b < no && rc == 0; b++)
            if (strcmp(outputs[a], outputs[b]) == 0 || same_file(outputs[a], outputs[b]))
                rc = fail(err, errlen, "%s would be written twice in one run (the log and a checkpoint file)", outputs[a]);
    }
    for (int i = 0; i < ni; i++) free(inputs[i]);
    for (int i = 0; i < no; i++) free(outputs[i]);
    return rc;
}

int train_run(const train_options *o, char *err, size_t errlen) {
    if (outputs_spare_inputs(o, err, errlen) != 0) return -1;
    if (data_check_run(o, err, errlen) != 0) return -1; /* before the model loads */
    gemma_model_f32 m;
    lora_config lc = o->lora;
    char path[4096];
    int rc = -1;
    dataset train = {0}, valid = {0};
    optimizer opt = {0};
    int *order = NULL;
    FILE *log = NULL;
    long batches_done = 0;

    const char *adapter_dir = o->resume_dir;
    /* the adapters to start from, in either layout; the adapter_config.json of the run being
     * continued, or of an --adapters folder, sets the LoRA setup over the flags */
    const char *adapter_src = adapter_dir ? adapter_dir : o->adapters_path;
    char adapter_weights[4096] = "", adapter_cfg[4096] = "";
    if (adapter_src && adapters_locate(adapter_src, adapter_dir != NULL, adapter_weights, sizeof adapter_weights, adapter_cfg,
                                       sizeof adapter_cfg, err, errlen) != 0)
        return -1;
    if (*adapter_cfg) {
        gemma_config cfg;
        snprintf(path, sizeof path, "%s/config.json", o->model_dir);
        if (gemma_config_load(path, &cfg, err, errlen) != 0) return -1;
        if (adapter_config_load(adapter_cfg, cfg.layers, &lc, err, errlen) != 0) return -1;
    }
    gemma_cuda *gpu = NULL;
    int on_gpu = o->device == WA_DEVICE_CUDA;
    /* on the GPU the host keeps the adapters only: the base weights go from the checkpoint to the
     * device (a 31B model has no f32 copy anywhere) */
    if ((on_gpu ? gemma_model_layout_f32 : gemma_model_load_f32)(&m, o->model_dir, &lc, err, errlen) != 0) return -1;
    char desc[512];
    gemma_config_describe(&m.cfg, desc, sizeof desc);
    printf("model: %s (%s)\n", o->model_dir, desc);
    if (on_gpu) {
        gemma_cuda_options co = {o->precision, o->random_init, o->init_seed, 0};
        double t0 = now_seconds();
        if (gemma_cuda_open(&m, o->model_dir, &co, &gpu, err, errlen) != 0) {
            gemma_model_free_f32(&m);
            return -1;
        }
        size_t peak;
        gemma_cuda_memory(gpu, &peak, NULL);
        printf("device: %s; base weights %s in %.1f s, %.2f GB on the device\n", gemma_cuda_describe(gpu),
               o->random_init ? "drawn on the GPU" : "copied from the checkpoint", now_seconds() - t0, peak / 1e9);
    } else if (o->random_init) {
        gemma_model_free_f32(&m);
        return fail(err, errlen, "--init-random draws the weights on the GPU: it needs --device cuda");
    }
    printf("lora: rank %d, scale %g, %d adapted projections, %zu trainable parameters; base %zu parameters frozen\n",
           m.lora.rank, m.lora.scale, m.slot_count, m.param_count, m.weight_count);
    linalg_set_threads(o->threads > 0 ? o->threads : (int)sysconf(_SC_NPROCESSORS_ONLN));
    if (gemma_set_attention_f32(&m, o->arm, o->chunk, o->threads) != 0) {
        fail(err, errlen, "%s", m.err);
        goto done;
    }
    /* the dense and chunked arms refuse up front what would not fit, instead of being killed (or
     * pushing the machine into swap); 80% of what the kernel calls available leaves room for the
     * activations and whatever else runs */
    m.mem_limit = (size_t)(mem_available_bytes() * 0.8);
    printf("attention: %s%s; batches %s; matrix products: %s\n", attn_arm_name(o->arm),
           o->arm == ATTN_CHUNKED ? " (query blocks of the chunk size)" : "",
           o->pack ? "packed (one sequence per batch)" : "one record at a time", linalg_backend());

    /* --data as a folder or one file; the held-out set when evaluating; raw records refused with
     * the command that prepares them (data.h) */
    if (data_load_run(o, m.cfg.vocab, &train, &valid, NULL, err, errlen) != 0) goto done;

    gemma_lora_init_f32(&m, o->seed);
    const char *start = adapter_src ? adapter_weights : NULL;
    if (start && adapters_load(&m, start, err, errlen) != 0) goto done;
    if (start) printf("adapters: %s\n", start);

    if (o->eval_only) {
        rc = report_eval(&m, gpu, &valid, o, 0, "", NULL, err, errlen);
        goto done;
    }

    int iters = o->iters;
    if (iters <= 0) iters = (int)ceil(o->epochs * train.count / o->batch - 1e-9);
    order = batch_schedule(train.count, o->batch, iters, o->seed);
    opt.n = m.param_count;
    opt.m1 = calloc(opt.n ? opt.n : 1, sizeof(float));
    opt.m2 = calloc(opt.n ? opt.n : 1, sizeof(float));
    if (!order || !opt.m1 || !opt.m2) {
        fail(err, errlen, "out of memory");
        goto done;
    }
    if (adapter_dir && optimizer_load(&opt, &batches_done, iters, adapter_dir, err, errlen) != 0) goto done;
    if (o->out_dir && mkdir(o->out_dir, 0777) != 0 && errno != EEXIST) {
        fail(err, errlen, "%s: cannot create the output directory: %s", o->out_dir, strerror(errno));
        goto done;
    }
    if (o->log_path || o->out_dir) {
        if (o->log_path) snprintf(path, sizeof path, "%s", o->log_path);
        else snprintf(path, sizeof path, "%s/log.jsonl", o->out_dir);
        log = fopen(path, batches_done ? "a" : "w");
        if (!log) {
            fail(err, errlen, "%s: cannot open the log: %s", path, strerror(errno));
            goto done;
        }
    }
    long total_tokens = 0, done_tokens = 0;
    for (int i = (int)batches_done; i < iters; i++)
        for (int j = 0; j < o->batch; j++) total_tokens += train.seq[order[i] + j].len;
    printf("data: %d train records (%d per pass after dropping the remainder), longest %d tokens; %d batches of %d "
           "from batch %ld; optimizer %s, lr %g\n",
           train.count, train.count / o->batch * o->batch, train.longest, iters, o->batch, batches_done + 1,
           o->adamw ? "AdamW" : "Adam", o->lr);
    fflush(stdout);

    /* the starting point of the held-out curve */
    if (o->eval_every && batches_done == 0 && report_eval(&m, gpu, &valid, o, 0, "before training", log, err, errlen) != 0)
        goto done;
    uint64_t base_hash = weights_hash(&m);
    /* packed tokens one forward + backward may hold: what the GPU's free memory allows */
    long pass_tokens = LONG_MAX;
    if (gpu && o->pack) {
        pass_tokens = gemma_cuda_token_budget(gpu);
        printf("device: up to %ld tokens per pass; a larger batch runs its records in several passes\n", pass_tokens);
    }
    long first_batch = batches_done;
    long good_batches = batches_done; /* batches behind the adapters and moments: the last update */
    double run_start = now_seconds();
    size_t run_peak = 0, run_dev_peak = 0;
    for (int i = (int)batches_done; i < iters; i++) {
        /* counted from where this run started: batches_done moves every step */
        if ((i - first_batch) % o->grad_accum == 0) memset(m.grads, 0, m.param_count * sizeof(float));
        const sequence *b = &train.seq[order[i]];
        long targets = 0, tokens = 0;
        int longest = 0;
        for (int j = 0; j < o->batch; j++) {
            for (int t = 0; t < b[j].len - 1; t++) targets += !b[j].target_mask || b[j].target_mask[t];
            tokens += b[j].len;
            longest = b[j].len > longest ? b[j].len : longest;
        }
        reset_peak_rss();
        if (gpu) gemma_cuda_reset_peak(gpu);
        double t0 = now_seconds();
        gemma_stats st = {0};
        double scale = targets ? 1.0 / ((double)targets * o->grad_accum) : 0;
        if (o->pack) {
            if (isatty(STDERR_FILENO)) fprintf(stderr, "\r  step %d/%d  %ld tokens packed   ", i + 1, iters, tokens);
            gemma_seq *seqs = batch_seqs(b, o->batch);
            if (!seqs) snprintf(m.err, sizeof m.err, "out of memory");
            /* a batch larger than the device holds runs as consecutive groups of its records, each
             * packed: the same gradient (every record's loss is scaled by the whole batch's target
             * count), computed in several passes */
            int brc = seqs ? 0 : -1;
            for (int j0 = 0, j1; seqs && j0 < o->batch && brc == 0; j0 = j1) {
                long group = b[j0].len;
                for (j1 = j0 + 1; j1 < o->batch && group + b[j1].len <= pass_tokens; j1++) group += b[j1].len;
                brc = batch_backward(&m, gpu, seqs + j0, j1 - j0, scale, &st);
            }
            free(seqs);
            if (brc != 0) {
                fail(err, errlen, "batch %d (records %d to %d, %ld tokens): %s", i + 1, order[i] + 1, order[i] + o->batch,
                     tokens, m.err);
                goto done;
            }
            done_tokens += tokens;
        } else { /* the records one by one, as before packing: the comparison run */
            for (int j = 0; j < o->batch; j++) {
                gemma_seq one = {b[j].tokens, b[j].len, b[j].target_mask};
                if (batch_backward(&m, gpu, &one, 1, scale, &st) != 0) {
                    fail(err, errlen, "batch %d, record %d (%d tokens): %s", i + 1, order[i] + j + 1, b[j].len, m.err);
                    goto done;
                }
                done_tokens += b[j].len;
                if (isatty(STDERR_FILENO)) {
                    double el = now_seconds() - run_start;
                    char eta[32];
                    format_duration(el / done_tokens * (total_tokens - done_tokens), eta, sizeof eta);
                    fprintf(stderr, "\r  step %d/%d  record %d/%d  %d tokens  ETA %s   ", i + 1, iters, j + 1,
                            o->batch, b[j].len, eta);
                }
            }
        }
        char what[256];
        if (batch_nonfinite(&m, &st, what, sizeof what)) {
            stop_nonfinite(&m, &opt, o, i + 1, what, good_batches, first_batch, err, errlen);
            goto done;
        }
        if ((i + 1 - first_batch) % o->grad_accum == 0 || i + 1 == iters) {
            optimizer_update(&opt, m.params, m.grads, o);
            good_batches = i + 1;
        }
        double secs = now_seconds() - t0;
        size_t peak = peak_rss_bytes(), dev_peak = 0;
        run_peak = peak > run_peak ? peak : run_peak;
        if (gpu) gemma_cuda_memory(gpu, &dev_peak, NULL);
        run_dev_peak = dev_peak > run_dev_peak ? dev_peak : run_dev_peak;
        char dev_text[48] = "";
        if (gpu) snprintf(dev_text, sizeof dev_text, "  device peak %.2f GB", dev_peak / 1e9);
        double loss = st.loss_sum / (st.tokens ? st.tokens : 1);
        char eta[32];
        format_duration((now_seconds() - run_start) / done_tokens * (total_tokens - done_tokens), eta, sizeof eta);
        if (isatty(STDERR_FILENO)) fprintf(stderr, "\r%*s\r", 70, "");
        printf("step %d/%d  loss %.4f  tokens %ld  longest %d  %.2f s  %.0f tok/s  peak RSS %.2f GB%s  ETA %s\n", i + 1,
               iters, loss, tokens, longest, secs, tokens / secs, peak / 1e9, dev_text, eta);
        fflush(stdout);
        log_line(log,
                 "{\"step\": %d, \"loss\": %.6f, \"targets\": %ld, \"tokens\": %ld, \"longest\": %d, \"seconds\": %.4f, "
                 "\"peak_rss\": %zu, \"device_peak\": %zu, \"arm\": \"%s\", \"packed\": %d}",
                 i + 1, loss, st.tokens, tokens, longest, secs, peak, dev_peak, attn_arm_name(o->arm), o->pack);
        batches_done = i + 1;
        if (o->eval_every && (i + 1) % o->eval_every == 0 && i + 1 < iters) {
            char label[64];
            snprintf(label, sizeof label, "after step %d", i + 1);
            if (report_eval(&m, gpu, &valid, o, i + 1, label, log, err, errlen) != 0) goto done;
        }
    }
    double wall = now_seconds() - run_start;
    if (weights_hash(&m) != base_hash) {
        fail(err, errlen, "internal error: the frozen base weights changed during training");
        goto done;
    }
    if (gpu) /* the weights never leave the device, which has no host copy to hash */
        printf("trained %d batches in %.1f s (%.0f tok/s), peak RSS %.2f GB, device peak %.2f GB\n",
               (int)(iters - first_batch), wall, done_tokens / (wall > 0 ? wall : 1), run_peak / 1e9, run_dev_peak / 1e9);
    else
        printf("trained %d batches in %.1f s (%.0f tok/s), peak RSS %.2f GB; base weights unchanged (FNV-1a %016llx)\n",
               (int)(iters - first_batch), wall, done_tokens / (wall > 0 ? wall : 1), run_peak / 1e9,
               (unsigned long long)base_hash);
    log_line(log, "{\"done\": %d, \"seconds\": %.3f, \"peak_rss\": %zu, \"tokens\": %ld, \"arm\": \"%s\", \"packed\": %d}",
             iters, wall, run_peak, done_tokens, attn_arm_name(o->arm), o->pack);
    if (o->out_dir) {
        if (adapters_save(&m, o->out_dir, o->format, o->model_dir, err, errlen) != 0 ||
            optimizer_save(&opt, batches_done, o->out_dir, err, errlen) != 0)
            goto done;
        printf("saved: %s/%s, adapter_config.json, optimizer.safetensors\n", o->out_dir, adapters_file_name(o->format));
    }
    if (o->eval_at_end && report_eval(&m, gpu, &valid, o, iters, "after training", log, err, errlen) != 0) goto done;
    rc = 0;
done:
    if (log) fclose(log);
    free(order);
    free(opt.m1);
    free(opt.m2);
    dataset_free(&train);
    dataset_free(&valid);
    gemma_cuda_close(gpu);
    gemma_model_free_f32(&m);
    return rc;
}

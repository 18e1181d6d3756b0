/* trainer.c — see trainer.h. The step: zero the adapter gradients every grad_accum batches; one
 * forward + backward over the batch packed into one sequence (or, with pack = 0, one per record),
 * with grad_scale = 1 / (the batch's target count · grad_accum) so the gradient is that of mlx-lm's
 * token-weighted batch mean; then, every grad_accum batches, the gradient clipped to o->grad_clip
 * (global L2 norm) and Adam(W) at the schedule's rate for that update.
 *
 * Checkpoints. A checkpoint is the state after an optimizer update, in out_dir:
 *   adapters.safetensors + adapter_config.json   what adapters_save writes (mlx-lm's layout, or with
 *                                                --adapter-format peft adapter_model.safetensors
 *                                                and peft's adapter_config.json)
 *   optimizer.safetensors                        Adam's moments, metadata "batches" and "updates"
 *   trainer_state.json                           the manifest: format, batches, updates, "run" (the
 *                                                options a resumed run must share, run_identity: model
 *                                                config, LoRA setup, batch size, seed, iters, optimizer,
 *                                                schedule, clipping, a fingerprint of the training
 *                                                data) and "files" (each file's size and fingerprint)
 * It is written as one unit: every file goes first into out_dir/.checkpoint.partial (each through
 * a temporary, fsync'ed), the manifest last; only when all are complete are they renamed into
 * out_dir, the manifest last. A failure before that (a full disk) leaves the previous checkpoint
 * as it was; the renames need no space, and no signal cuts them (see "Signals"). Only a machine
 * that dies in the microseconds between two renames leaves new files beside the old manifest,
 * which --resume then refuses instead of trusting. --resume reads the manifest and refuses, with
 * one line, a file whose size or fingerprint differs (adapters of one step beside the optimizer
 * state of another can never be resumed), step counts that disagree, and any option of the run
 * that differs. With save_every the adapters of each saved update are kept as
 * NNNNNNN_adapters.safetensors (mlx-lm's name, the update count). Stop signals: see "Signals". */
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
#include <fcntl.h>
#include <limits.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const base_dtype_names[] = {"bf16", "mlx4", "nf4", "fp8"};

const char *base_dtype_name(base_dtype base) {
    return (unsigned)base < sizeof base_dtype_names / sizeof *base_dtype_names ? base_dtype_names[base] : "?";
}

int base_dtype_parse(const char *name, base_dtype *base) {
    for (unsigned i = 0; name && i < sizeof base_dtype_names / sizeof *base_dtype_names; i++)
        if (strcmp(name, base_dtype_names[i]) == 0) {
            *base = (base_dtype)i;
            return 0;
        }
    return -1;
}

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
    o->out_dir = "adapters";
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

/* The step counts of an open optimizer.safetensors (path names it in messages): "batches" in
 * [0, iters], "updates" in [0, batches]. */
static int optimizer_counts(const st_file *f, const char *path, long iters, long *batches, long *updates, char *err,
                            size_t errlen) {
    const char *u = st_metadata(f, "updates"), *bd = st_metadata(f, "batches");
    if (!u || !bd) return fail(err, errlen, "%s: needs metadata updates and batches", path);
    if (meta_long(bd, 0, iters, batches) != 0)
        return fail(err, errlen, "%s: metadata batches = \"%.40s\" is not an integer in [0, %ld] (this run's batches)",
                    path, bd, iters);
    if (meta_long(u, 0, *batches, updates) != 0)
        return fail(err, errlen, "%s: metadata updates = \"%.40s\" is not an integer in [0, %ld] (its batches)", path, u,
                    *batches);
    return 0;
}

/* iters: the run's batch count; a checkpoint may be at most that far in. */
int optimizer_load(optimizer *opt, long *batches_done, long iters, const char *dir, char *err, size_t errlen) {
    char path[4096];
    snprintf(path, sizeof path, "%s/optimizer.safetensors", dir);
    st_file f;
    if (st_open(path, &f, err, errlen) != 0) return -1;
    const st_tensor *a = st_find(&f, "m1"), *b = st_find(&f, "m2");
    int rc = 0;
    long updates = 0;
    if (!a || !b || !st_metadata(&f, "updates") || !st_metadata(&f, "batches") || a->dtype != ST_F32 ||
        b->dtype != ST_F32 || st_numel(a) != opt->n || st_numel(b) != opt->n)
        rc = fail(err, errlen, "%s: needs F32 m1 and m2 of %zu entries and metadata updates, batches", path, opt->n);
    else if (optimizer_counts(&f, path, iters, batches_done, &updates, err, errlen) != 0)
        rc = -1;
    else {
        opt->updates = updates;
        memcpy(opt->m1, a->data, opt->n * sizeof(float));
        memcpy(opt->m2, b->data, opt->n * sizeof(float));
    }
    st_close(&f);
    return rc;
}

double train_lr_at(const train_options *o, long update, long updates) {
    const lr_schedule *s = &o->schedule;
    int warmup = s->warmup > 0 ? s->warmup : 0;
    /* mlx-lm: join_schedules([linear_schedule(warmup_init, lr, W), decay], [W + 1]) */
    if (warmup > 0 && update <= warmup) return s->warmup_init + (o->lr - s->warmup_init) * (double)update / warmup;
    long u = warmup > 0 ? update - warmup - 1 : update;
    long steps = s->steps > 0 ? s->steps : updates - warmup;
    if (steps < 1) steps = 1;
    double frac = (double)(u < steps ? u : steps) / (double)steps;
    switch (s->decay) {
    case LR_COSINE: return s->end + (o->lr - s->end) * 0.5 * (1 + cos(M_PI * frac));
    case LR_LINEAR: return o->lr + (s->end - o->lr) * frac;
    default: return o->lr;
    }
}

/* Work over [0, n) cut into ranges, run on up to `threads` threads (the caller takes the first);
 * a range whose thread cannot be started runs on the caller. */
enum { MAX_THREADS = 32 };
static void run_ranges(void *(*fn)(void *), void *ranges, size_t range_size, int count) {
    pthread_t th[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < count; t++) started[t] = pthread_create(&th[t], NULL, fn, (char *)ranges + t * range_size) == 0;
    fn(ranges);
    for (int t = 1; t < count; t++) {
        if (started[t]) pthread_join(th[t], NULL);
        else fn((char *)ranges + t * range_size);
    }
}

static int thread_count(const train_options *o, size_t n) {
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    int t = o->threads > 0 ? o->threads : (int)(online > 0 ? online : 1);
    if (t > MAX_THREADS) t = MAX_THREADS;
    return n < ((size_t)1 << 20) ? 1 : t;
}

/* The norm is summed per block of NORM_BLOCK entries, then over the blocks in order: the same
 * bits whatever the thread count, which a bit-identical resume on another machine needs. */
enum { NORM_BLOCK = 1 << 16 };
typedef struct norm_range {
    float *grads;
    double *block_sums;
    size_t n, block_lo, block_hi;
    double scale; /* 0: measure; else multiply by it */
} norm_range;

static void *norm_run(void *arg) {
    const norm_range *r = arg;
    for (size_t b = r->block_lo; b < r->block_hi; b++) {
        size_t lo = b * NORM_BLOCK, hi = lo + NORM_BLOCK < r->n ? lo + NORM_BLOCK : r->n;
        if (r->scale != 0) {
            for (size_t i = lo; i < hi; i++) r->grads[i] = (float)(r->grads[i] * r->scale);
        } else {
            double s = 0;
            for (size_t i = lo; i < hi; i++) s += (double)r->grads[i] * r->grads[i];
            r->block_sums[b] = s;
        }
    }
    return NULL;
}

double train_clip_grad_norm(float *grads, size_t n, double max_norm, int threads) {
    size_t blocks = (n + NORM_BLOCK - 1) / NORM_BLOCK;
    double one = 0, *sums = blocks > 1 ? calloc(blocks, sizeof *sums) : &one;
    if (!sums) { /* out of memory: one pass on the caller, the same order of blocks */
        sums = &one;
        blocks = 0;
        for (size_t i = 0; i < n; i++) one += (double)grads[i] * grads[i];
    }
    int t = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if ((size_t)t > blocks) t = blocks > 0 ? (int)blocks : 1;
    norm_range r[MAX_THREADS];
    for (int k = 0; k < t && blocks > 0; k++) r[k] = (norm_range){grads, sums, n, blocks * k / t, blocks * (k + 1) / t, 0};
    if (blocks > 0) run_ranges(norm_run, r, sizeof r[0], t);
    double total = 0;
    for (size_t b = 0; b < blocks; b++) total += sums[b];
    if (blocks == 0) total = one;
    if (sums != &one) free(sums);
    double norm = sqrt(total);
    double scale = max_norm > 0 ? fmin(1.0, max_norm / (norm + 1e-6)) : 1.0;
    if (scale < 1.0 && blocks > 0) {
        for (int k = 0; k < t; k++) r[k].scale = scale;
        run_ranges(norm_run, r, sizeof r[0], t);
    } else if (scale < 1.0) {
        for (size_t i = 0; i < n; i++) grads[i] = (float)(grads[i] * scale);
    }
    return norm;
}

/* MLX's Adam: m ← β1 m + (1−β1) g, v ← β2 v + (1−β2) g², p ← p − lr · m / (√v + ε), bias
 * correction optional; AdamW first decays p by lr · wd, lr being the schedule's rate for this
 * update (mlx.optimizers.AdamW uses the scheduled rate there too). */
/* One range of the update; every element is independent, so the result does not depend on how
 * the ranges are cut. */
typedef struct adam_range {
    optimizer *opt;
    float *params;
    const float *grads;
    const train_options *o;
    double lr, step_lr; /* the scheduled rate; with bias correction folded in */
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
        if (o->adamw) p *= 1 - r->lr * o->weight_decay;
        r->params[i] = (float)(p - r->step_lr * opt->m1[i] / (sqrt((double)opt->m2[i]) + o->eps));
    }
    return NULL;
}

/* One update at rate lr, spread over the run's threads: a 31B model's rank-32 adapters are 90M
 * parameters, whose double-precision update takes about a second on one core. The CPU path's;
 * the GPU path makes the same update on the device (gemma_cuda_optimizer_step). */
void train_optimizer_update(optimizer *opt, float *params, const float *grads, const train_options *o, double lr) {
    opt->updates++;
    double step_lr = lr;
    if (o->bias_correction)
        step_lr *= sqrt(1 - pow(o->beta2, (double)opt->updates)) / (1 - pow(o->beta1, (double)opt->updates));
    int n = thread_count(o, opt->n);
    adam_range r[MAX_THREADS];
    for (int t = 0; t < n; t++) r[t] = (adam_range){opt, params, grads, o, lr, step_lr, opt->n * t / n, opt->n * (t + 1) / n};
    run_ranges(adam_run, r, sizeof r[0], n);
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



/* ---------------------------------------------------------------------------------------------
 * Signals. While train_run trains, the first SIGINT, SIGTERM or SIGHUP only sets stop_signal:
 * the loop finishes the batch in hand (an evaluation pass is abandoned), writes the checkpoint
 * and returns TRAIN_INTERRUPTED. A second one ends the process at once, as the handler
 * out_cleanup_on_signals() installs would: every registered temporary is removed, the staging
 * folder of a checkpoint being written too, and the signal is raised again with its default
 * action. The few renames that publish a checkpoint are not cut: a second signal that comes
 * while they run takes effect right after them (publishing / exit_signal below), so the
 * checkpoint in out_dir is always the old one or the new one, whole. */

static const int stop_signals[] = {SIGINT, SIGTERM, SIGHUP};
enum { STOP_SIGNALS = sizeof stop_signals / sizeof *stop_signals };
volatile int train_stop_signal;
static volatile sig_atomic_t stop_signal, publishing, exit_signal;
void (*train_batch_hook)(long batches_done);

/* the staging folder of the checkpoint being written and the files it may hold, for the second
 * signal to remove; staging_live is 1 while the strings are complete */
enum { STAGED_NAMES = 8 };
static const char *const staged_names[STAGED_NAMES] = {
    "adapters.safetensors", "adapter_config.json", "optimizer.safetensors", "trainer_state.json",
    "adapter_model.safetensors", "README.md", NULL, NULL};
static char staging_dir[4096], staged_paths[STAGED_NAMES][4200];
static volatile sig_atomic_t staging_live;

static void end_now(int sig) { /* async-signal-safe: unlink, rmdir, signal, raise */
    out_remove_temporaries();
    if (staging_live) {
        for (int i = 0; i < STAGED_NAMES && staged_names[i]; i++) (void)unlink(staged_paths[i]);
        (void)rmdir(staging_dir);
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

/* 1 when stderr is a terminal: the first signal is acknowledged there at once (a step can take
 * seconds), with write(2), which a handler may call */
static volatile sig_atomic_t notice_on_stderr;

static void on_stop_signal(int sig) {
    if (!__atomic_load_n(&stop_signal, __ATOMIC_SEQ_CST)) {
        __atomic_store_n(&stop_signal, sig, __ATOMIC_SEQ_CST);
        static const char notice[] = "\nstopping after this step to write the checkpoint; a second signal ends at once\n";
        if (notice_on_stderr) (void)!write(STDERR_FILENO, notice, sizeof notice - 1);
        return;
    }
    __atomic_store_n(&exit_signal, sig, __ATOMIC_SEQ_CST);
    if (!__atomic_load_n(&publishing, __ATOMIC_SEQ_CST)) end_now(sig);
}

/* Installs on_stop_signal for the signals not ignored on entry (nohup's stay ignored); saved gets
 * the previous handlers, which stop_handlers_restore puts back. */
typedef struct saved_handlers {
    struct sigaction old[STOP_SIGNALS];
    int installed[STOP_SIGNALS];
} saved_handlers;

static void stop_handlers_install(saved_handlers *saved) {
    stop_signal = exit_signal = publishing = 0;
    notice_on_stderr = isatty(STDERR_FILENO);
    for (int i = 0; i < STOP_SIGNALS; i++) {
        saved->installed[i] = 0;
        if (sigaction(stop_signals[i], NULL, &saved->old[i]) != 0 || saved->old[i].sa_handler == SIG_IGN) continue;
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_stop_signal;
        sa.sa_flags = SA_RESTART;
        sigemptyset(&sa.sa_mask);
        saved->installed[i] = sigaction(stop_signals[i], &sa, NULL) == 0;
    }
}

static void stop_handlers_restore(saved_handlers *saved) {
    for (int i = 0; i < STOP_SIGNALS; i++)
        if (saved->installed[i]) sigaction(stop_signals[i], &saved->old[i], NULL);
    memset(saved->installed, 0, sizeof saved->installed);
}

static void publish_begin(void) { __atomic_store_n(&publishing, 1, __ATOMIC_SEQ_CST); }
static void publish_end(void) {
    __atomic_store_n(&publishing, 0, __ATOMIC_SEQ_CST);
    int sig = __atomic_load_n(&exit_signal, __ATOMIC_SEQ_CST);
    if (sig) end_now(sig);
}

static const char *signal_name(int sig) {
    return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : sig == SIGHUP ? "SIGHUP" : "a signal";
}

/* ---------------------------------------------------------------------------------------------
 * Evaluation and progress */

/* What the ETA is made of: training tokens left at the training throughput, plus the evaluation
 * passes left at the evaluation throughput (measured on the passes seen; before the first, a
 * third of the training time per token, a forward being about a third of a forward + backward). */
typedef struct progress {
    long total_tokens, done_tokens; /* training tokens of this run's batches, and those done */
    double train_seconds;           /* in training steps */
    long eval_tokens_seen;          /* in evaluation passes so far */
    double eval_seconds;
    long valid_pass_tokens, test_pass_tokens; /* one evaluation pass of each set */
} progress;

static double eta_seconds(const progress *p, long evals_left, int tests_left) {
    double train_rate = p->train_seconds > 0 && p->done_tokens > 0 ? p->done_tokens / p->train_seconds : 0;
    double eval_rate = p->eval_seconds > 0 && p->eval_tokens_seen > 0 ? p->eval_tokens_seen / p->eval_seconds
                                                                      : 3 * train_rate;
    double left = train_rate > 0 ? (p->total_tokens - p->done_tokens) / train_rate : 0;
    long eval_tokens = evals_left * p->valid_pass_tokens + tests_left * p->test_pass_tokens;
    if (eval_rate > 0) left += eval_tokens / eval_rate;
    return left;
}

/* evaluation passes still to come once `done` batches of `iters` are trained */
static long evals_after(const train_options *o, long done, long iters) {
    long n = o->eval_at_end ? 1 : 0;
    if (o->eval_every > 0 && iters > 1) n += (iters - 1) / o->eval_every - done / o->eval_every;
    return n;
}

/* the records an evaluation visits: whole batches (as mlx-lm), at most val_batches of them */
static int eval_records(const dataset *d, int batch, int val_batches) {
    int batches = d->count / batch;
    if (val_batches > 0 && val_batches < batches) batches = val_batches;
    return batches * batch;
}

static long eval_tokens(const dataset *d, int records) {
    long t = 0;
    for (int i = 0; i < records; i++) t += d->seq[i].len;
    return t;
}

/* A batch of n records on the device runs as consecutive passes of whole records, each packed and
 * at most pass_tokens long: the end of the pass that starts at record j0 (one record at least). */
static int pass_end(const gemma_seq *s, int j0, int n, long pass_tokens) {
    long tokens = s[j0].len;
    int j1 = j0 + 1;
    for (; j1 < n && tokens + s[j1].len <= pass_tokens; j1++) tokens += s[j1].len;
    return j1;
}

/* 0; -1 on error (m->err); 1 when a stop signal came (the pass is abandoned) */
static int evaluate(gemma_model_f32 *m, gemma_cuda *gpu, const dataset *set, int batch, int pack, int max_batches,
                    gemma_stats *st) {
    memset(st, 0, sizeof *st);
    int n = eval_records(set, batch, max_batches), step = pack ? batch : 1;
    /* on the GPU a packed batch larger than one forward holds runs as consecutive groups of its
     * records, each packed: the statistics are sums over the tokens, the same either way */
    long pass_tokens = gpu && pack ? gemma_cuda_forward_token_budget(gpu) : LONG_MAX;
    for (int i = 0; i < n; i += step) {
        if (stop_signal) return 1;
        gemma_seq *s = batch_seqs(&set->seq[i], step);
        if (!s) return snprintf(m->err, sizeof m->err, "out of memory"), -1;
        int rc = 0;
        for (int j0 = 0, j1; j0 < step && rc == 0; j0 = j1) {
            j1 = pass_end(s, j0, step, pass_tokens);
            rc = batch_forward(m, gpu, s + j0, j1 - j0, st);
        }
        free(s);
        if (rc != 0) return -1;
        if (isatty(STDERR_FILENO)) fprintf(stderr, "\r  eval %d/%d ", i + step, n);
    }
    if (isatty(STDERR_FILENO)) fprintf(stderr, "\r%*s\r", 30, "");
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * A record longer than the device holds. The trainer splits a batch into passes of whole records
 * (gemma_cuda_token_budget for training, gemma_cuda_forward_token_budget for evaluation), but
 * one record cannot be split: longer than a pass, it would fail inside its step in the device's
 * allocation. It is refused before the first step, before the log or a checkpoint is written. */

/* the longest of the records a run visits: its length, index in its file (from 0) and split */
typedef struct longest_record {
    int len, index;
    const char *split; /* "train", "valid", "test" */
} longest_record;

static void longest_note(longest_record *l, const dataset *d, int index, const char *split) {
    if (d->seq[index].len > l->len) *l = (longest_record){d->seq[index].len, index, split};
}

/* 0 when l fits a pass of pass_tokens; else -1 with the line that names the record, its file
 * (o->data_dir's train.jsonl, valid.jsonl or test.jsonl, or the one file given) and the device's
 * figures: the pass, the device, and what the model (weights, adapters, optimizer state) holds */
static int longest_fits(const longest_record *l, long pass_tokens, const char *pass, gemma_cuda *gpu,
                        const train_options *o, char *err, size_t errlen) {
    if (l->len <= pass_tokens) return 0;
    data_paths files;
    char derr[256], file[4096];
    snprintf(file, sizeof file, "%s.jsonl", l->split);
    if (data_files(o->data_dir, &files, derr, sizeof derr) == 0) {
        const char *path = !strcmp(l->split, "train") ? files.train : !strcmp(l->split, "valid") ? files.valid
                                                                                                   : files.test;
        if (path) snprintf(file, sizeof file, "%s", path);
        data_paths_free(&files);
    }
    size_t model_bytes = 0;
    gemma_cuda_memory(gpu, &model_bytes, NULL); /* no pass has run yet: the static allocations */
    return fail(err, errlen,
                "the longest record (%d tokens, record %d of %s) needs more device memory than is free: %s "
                "on the device holds up to %ld tokens (%s; %.2f GB of it taken by the model and its adapters)",
                l->len, l->index + 1, file, pass, pass_tokens, gemma_cuda_describe(gpu), model_bytes / 1e9);
}

/* The evaluations' records against what one forward holds now: the held-out set's batches when
 * valid_evaluated, the test set's (o->test). 0, or -1 with longest_fits's line. */
static int eval_records_fit(gemma_cuda *gpu, const dataset *valid, int valid_evaluated, const dataset *test,
                            const train_options *o, char *err, size_t errlen) {
    longest_record l = {0, 0, "valid"};
    int nv = valid_evaluated ? eval_records(valid, o->batch, o->val_batches) : 0;
    int nt = o->test ? eval_records(test, o->batch, 0) : 0;
    for (int i = 0; i < nv; i++) longest_note(&l, valid, i, "valid");
    for (int i = 0; i < nt; i++) longest_note(&l, test, i, "test");
    return longest_fits(&l, gemma_cuda_forward_token_budget(gpu), "an evaluation pass", gpu, o, err, errlen);
}

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

/* log.jsonl's names for gemma_cuda_profile's phases (docs/design.md §6.5) */
static const char *const phase_key[GEMMA_PHASES] = {"products", "lora",      "attention",  "elementwise",
                                                    "head",     "fp8_quant", "copy_waits", "optimizer"};

/* A step's device profile (WINATTN_TRAIN_PROFILE=1) as log.jsonl's fields: `, "device_ms": {...},
 * "device_flop": {...}`, every phase's milliseconds and the operations of those that ran products
 * (integers: a step's stay far below 2^53) */
static void profile_json(const gemma_cuda_profile *p, char *buf, size_t n) {
    int k = snprintf(buf, n, ", \"device_ms\": {");
    for (int i = 0; i < GEMMA_PHASES && k > 0 && (size_t)k < n; i++)
        k += snprintf(buf + k, n - (size_t)k, "%s\"%s\": %.3f", i ? ", " : "", phase_key[i], p->ms[i]);
    if (k > 0 && (size_t)k < n) k += snprintf(buf + k, n - (size_t)k, "}, \"device_flop\": {");
    for (int i = 0, first = 1; i < GEMMA_PHASES && k > 0 && (size_t)k < n; i++)
        if (p->flop[i] > 0) {
            k += snprintf(buf + k, n - (size_t)k, "%s\"%s\": %.0f", first ? "" : ", ", phase_key[i], p->flop[i]);
            first = 0;
        }
    if (k > 0 && (size_t)k < n) k += snprintf(buf + k, n - (size_t)k, "}");
    if (k < 0 || (size_t)k >= n) buf[0] = 0; /* cut short: no half a field */
}

/* 1 when the log at path (log.jsonl) records the held-out evaluation after `step` */
static int log_has_eval(const char *path, long step) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char want[48], *line = NULL;
    size_t cap = 0;
    int n = snprintf(want, sizeof want, "{\"eval\": %ld,", step), found = 0;
    while (!found && getline(&line, &cap, f) > 0) found = strncmp(line, want, (size_t)n) == 0;
    free(line);
    fclose(f);
    return found;
}

/* Evaluate `set`, print one line and log it; "label" says when ("before training", "after step
 * 43"); test selects the test set's wording and log key. 0, -1 (err), or 1 when a signal
 * abandoned the pass. The pass's tokens and time go into p (may be NULL). */
static int report_eval(gemma_model_f32 *m, gemma_cuda *gpu, const dataset *set, const train_options *o, int test,
                       int step, const char *label, FILE *log, progress *p, char *err, size_t errlen) {
    gemma_stats ev;
    double t0 = now_seconds();
    int rc = evaluate(m, gpu, set, o->batch, o->pack, test ? 0 : o->val_batches, &ev);
    if (rc < 0) return fail(err, errlen, "%s: %s", test ? "test" : "evaluation", m->err);
    if (rc > 0) return 1;
    double secs = now_seconds() - t0;
    if (p) {
        p->eval_seconds += secs;
        p->eval_tokens_seen += eval_tokens(set, eval_records(set, o->batch, test ? 0 : o->val_batches));
    }
    double vl = ev.loss_sum / (ev.tokens ? ev.tokens : 1), ag = (double)ev.agree / (ev.tokens ? ev.tokens : 1);
    if (test)
        printf("test%s%s: loss %.4f (perplexity %.3f) over %ld tokens, next-token agreement %.2f%% (%.1f s)\n",
               *label ? " " : "", label, vl, exp(vl), ev.tokens, 100 * ag, secs);
    else
        printf("eval%s%s: held-out loss %.4f over %ld tokens, next-token agreement %.2f%% (%.1f s)\n", *label ? " " : "",
               label, vl, ev.tokens, 100 * ag, secs);
    fflush(stdout);
    log_line(log, "{\"%s\": %d, \"loss\": %.6f, \"agreement\": %.6f, \"tokens\": %ld}", test ? "test" : "eval", step, vl,
             ag, ev.tokens);
    return 0;
}


/* ---------------------------------------------------------------------------------------------
 * A non-finite loss or gradient stops the run. The check sits between the backward and the
 * optimizer update, so the adapters and moments are still those of the last update. */

/* The gradient entry at flat index `index` (model.h's order: slot by slot, A then B), whose value
 * v is not finite, named in what. */
static void nonfinite_name(const gemma_model_f32 *m, size_t index, float v, char *what, size_t n) {
    for (int i = 0; i < m->slot_count; i++)
        for (int k = 0; k < 2; k++) {
            const lora_slot *s = &m->slots[i];
            size_t lo = k ? s->b : s->a, len = (size_t)m->lora.rank * (size_t)(k ? s->out : s->in);
            if (index < lo || index >= lo + len) continue;
            char name[160];
            adapter_slot_name(name, sizeof name, "model.", s, k ? "lora_b" : "lora_a");
            snprintf(what, n, "the gradient of %s is not finite (%s at element %zu)", name,
                     isnan(v) ? "NaN" : v > 0 ? "inf" : "-inf", index - lo);
            return;
        }
    snprintf(what, n, "the gradient is not finite (%s at parameter %zu)", isnan(v) ? "NaN" : v > 0 ? "inf" : "-inf",
             index);
}

/* 1 and the first bad entry named in what ("the gradient of model.layers.0.self_attn.q_proj.lora_a
 * (NaN at element 12)") when the loss sum or an adapter gradient is NaN or ±inf; else 0. The
 * gradients are the host's, or with gpu the device's (searched there; the same order, so the same
 * entry is named); -1 with m->err when the device cannot be asked. */
static int batch_nonfinite(gemma_model_f32 *m, gemma_cuda *gpu, const gemma_stats *st, char *what, size_t n) {
    if (!isfinite(st->loss_sum)) {
        snprintf(what, n, "the loss is not finite (%g summed over %ld targets)", st->loss_sum, st->tokens);
        return 1;
    }
    if (gpu) {
        size_t index;
        float v;
        if (gemma_cuda_grads_first_nonfinite(gpu, &index, &v, m->err, sizeof m->err) != 0) return -1;
        if (index == SIZE_MAX) return 0;
        nonfinite_name(m, index, v, what, n);
        return 1;
    }
    for (size_t j = 0; j < m->param_count; j++)
        if (!isfinite(m->grads[j])) {
            nonfinite_name(m, j, m->grads[j], what, n);
            return 1;
        }
    return 0;
}

static int same_dir(const char *a, const char *b) {
    struct stat sa, sb;
    return a && b && stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

/* ---------------------------------------------------------------------------------------------
 * Output folders: created with their missing parents before anything is loaded, and proved
 * writable by creating and removing a file there, so a run never trains for hours to fail at
 * its first save. The folders this run created are removed again if it fails while they are
 * still empty. */

typedef struct made_dirs {
    char *path[16];
    int count;
} made_dirs;

/* mkdir -p; a component this call creates is recorded in made (when not NULL) */
static int make_dirs(const char *dir, made_dirs *made, char *err, size_t errlen) {
    char *p = strdup(dir);
    if (!p) return fail(err, errlen, "out of memory");
    size_t len = strlen(p);
    while (len > 1 && p[len - 1] == '/') p[--len] = '\0';
    int rc = 0;
    for (char *c = p + 1;; c++) {
        if (*c != '/' && *c != '\0') continue;
        char keep = *c;
        *c = '\0';
        struct stat sb;
        if (mkdir(p, 0777) == 0) {
            if (made && made->count < 16) made->path[made->count++] = strdup(p);
        } else if (errno != EEXIST) {
            rc = fail(err, errlen, "%s: cannot create the folder %s: %s", dir, p, strerror(errno));
        } else if (stat(p, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
            rc = fail(err, errlen, "%s: %s is not a folder", dir, p);
        }
        *c = keep;
        if (rc || keep == '\0') break;
    }
    free(p);
    return rc;
}

/* the folders made, newest first, removed where empty (rmdir leaves any other) */
static void made_dirs_undo(made_dirs *made, int remove) {
    for (int i = made->count - 1; i >= 0; i--) {
        if (remove) (void)rmdir(made->path[i]);
        free(made->path[i]);
    }
    made->count = 0;
}

/* dir accepts a new file: one is created there and removed */
static int probe_writable(const char *dir, const char *what, char *err, size_t errlen) {
    char path[4200];
    snprintf(path, sizeof path, "%s/.winattn-write-probe.%ld", dir, (long)getpid());
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0) return fail(err, errlen, "%s %s is not writable: %s", what, dir, strerror(errno));
    close(fd);
    unlink(path);
    return 0;
}

/* the log file may be written: an existing one opened for appending, or a new one created in its
 * folder (made with its parents) and removed */
static int probe_log(const char *path, made_dirs *made, char *err, size_t errlen) {
    int fd = open(path, O_WRONLY | O_APPEND);
    if (fd >= 0) return close(fd), 0;
    if (errno != ENOENT) return fail(err, errlen, "the log %s cannot be written: %s", path, strerror(errno));
    char *dir = strdup(path), *slash = dir ? strrchr(dir, '/') : NULL;
    int rc = 0;
    if (slash && slash != dir) {
        *slash = '\0';
        rc = make_dirs(dir, made, err, errlen);
    }
    free(dir);
    if (rc) return -1;
    fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0) return fail(err, errlen, "the log %s cannot be created: %s", path, strerror(errno));
    close(fd);
    unlink(path);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Checkpoints: see the top of this file. */

/* 64-bit fingerprint of a byte stream: per 8-byte little-endian word w (the tail zero-padded),
 * h = (h ^ w) · 0x9e3779b97f4a7c15, h ^= h >> 32, from FNV-1a's offset basis. Every step is a
 * bijection of h, so two different files of one size collide by chance only (2^-64). It catches a
 * file from another step or a torn write; it is no defence against deliberate forgery. Several
 * GB/s, so a 31B model's optimizer state (0.7 GB) costs a fraction of a second. */
static uint64_t fp_update(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x9e3779b97f4a7c15ULL;
        h ^= h >> 32;
    }
    if (i < n) {
        uint64_t w = 0;
        memcpy(&w, p + i, n - i);
        h = (h ^ w) * 0x9e3779b97f4a7c15ULL;
        h ^= h >> 32;
    }
    return h;
}
#define FP_START 0xcbf29ce484222325ULL

static int file_fingerprint(const char *path, uint64_t *bytes, uint64_t *fp, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) return fail(err, errlen, "%s: cannot read: %s", path, strerror(errno));
    enum { CHUNK = 1 << 20 };
    unsigned char *buf = malloc(CHUNK);
    uint64_t h = FP_START, total = 0;
    size_t n;
    while (buf && (n = fread(buf, 1, CHUNK, f)) > 0) {
        h = fp_update(h, buf, n); /* CHUNK is a multiple of 8: only the last read pads */
        total += n;
    }
    int bad = !buf || ferror(f);
    int e = errno;
    fclose(f);
    free(buf);
    if (bad) return fail(err, errlen, "%s: cannot read: %s", path, buf ? strerror(e) : "out of memory");
    *bytes = total;
    *fp = h;
    return 0;
}

/* the training sequences as the model sees them: count, then per record its length, tokens and
 * target mask */
static uint64_t dataset_fingerprint(const dataset *d) {
    uint64_t h = fp_update(FP_START, &d->count, sizeof d->count);
    for (int i = 0; i < d->count; i++) {
        const sequence *s = &d->seq[i];
        int32_t head[2] = {s->len, s->target_mask != NULL};
        h = fp_update(h, head, sizeof head);
        h = fp_update(h, s->tokens, (size_t)s->len * sizeof *s->tokens);
        if (s->target_mask && s->len > 1) h = fp_update(h, s->target_mask, (size_t)s->len - 1);
    }
    return h;
}

static json_t *json_hex64(uint64_t v) {
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)v);
    return json_string(hex);
}

static const char *const decay_names[] = {"constant", "cosine_decay", "linear_schedule"};

/* What a resumed run must share with the run that wrote the checkpoint: everything that decides
 * the adapters a step produces (the model, the LoRA setup, the batches and their order, the data,
 * the optimizer and its schedule). How it is computed (device, attention arm, packing, threads)
 * and what is reported (evaluation, logs) may change. Keys after mlx-lm's config names. The data
 * and the batch count come in a second call (data_fp != NULL) once the data is read. */
static json_t *run_identity(const train_options *o, const lora_config *lc, int layers, uint64_t model_fp,
                            const uint64_t *data_fp, int records, long iters) {
    json_t *keys = json_array();
    for (int p = 0; p < PROJ_COUNT; p++)
        if (lc->proj_mask & (1u << p)) json_array_append_new(keys, json_string(gemma_proj_path[p]));
    int num_layers = lc->num_layers > 0 && lc->num_layers < layers ? lc->num_layers : layers;
    json_t *id = json_object();
    json_object_set_new(id, "model_config", json_hex64(model_fp));
    json_object_set_new(id, "init_random_seed", o->random_init ? json_integer((json_int_t)o->init_seed) : json_null());
    json_object_set_new(id, "num_layers", json_integer(num_layers));
    json_object_set_new(id, "lora_parameters", json_pack("{s:i, s:f, s:o}", "rank", lc->rank, "scale", lc->scale, "keys", keys));
    json_object_set_new(id, "batch_size", json_integer(o->batch));
    json_object_set_new(id, "grad_accumulation_steps", json_integer(o->grad_accum));
    json_object_set_new(id, "seed", json_integer((json_int_t)o->seed));
    json_object_set_new(id, "optimizer", json_string(o->adamw ? "adamw" : "adam"));
    json_object_set_new(id, "learning_rate", json_real(o->lr));
    json_object_set_new(id, "betas", json_pack("[f, f]", o->beta1, o->beta2));
    json_object_set_new(id, "eps", json_real(o->eps));
    json_object_set_new(id, "weight_decay", json_real(o->adamw ? o->weight_decay : 0));
    json_object_set_new(id, "bias_correction", json_boolean(o->bias_correction));
    json_object_set_new(id, "lr_schedule",
                        json_pack("{s:s, s:i, s:f, s:i, s:f}", "name", decay_names[o->schedule.decay % 3], "steps",
                                  o->schedule.steps, "end", o->schedule.end, "warmup", o->schedule.warmup,
                                  "warmup_init", o->schedule.warmup_init));
    json_object_set_new(id, "grad_clip", json_real(o->grad_clip));
    json_object_set_new(id, "max_seq_length", json_integer(o->max_len));
    json_object_set_new(id, "pad_target", json_boolean(o->pad_target));
    json_object_set_new(id, "mask_prompt", json_boolean(o->mask_prompt));
    json_object_set_new(id, "byte_tokens", json_boolean(o->byte_tokens));
    json_object_set_new(id, "base_dtype", json_string(base_dtype_name(o->base)));
    if (data_fp) {
        json_object_set_new(id, "iters", json_integer(iters));
        json_object_set_new(id, "train_records", json_integer(records));
        json_object_set_new(id, "train_data", json_hex64(*data_fp));
    }
    return id;
}

/* The first key of `now` whose value differs in the checkpoint's `saved`: one line in err, -1. */
static int identity_compare(const json_t *now, const json_t *saved, const char *dir, char *err, size_t errlen) {
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)now, key, v) {
        json_t *s = json_object_get(saved, key);
        if (s && json_equal(v, s)) continue;
        /* a checkpoint without base_dtype comes from a trainer without quantized bases: bf16 */
        if (!s && !strcmp(key, "base_dtype") && !strcmp(json_string_value(v), "bf16")) continue;
        size_t flags = JSON_ENCODE_ANY | JSON_COMPACT | JSON_SORT_KEYS;
        char *a = json_dumps(v, flags), *b = s ? json_dumps(s, flags) : NULL;
        const char *why = !strcmp(key, "train_data") || !strcmp(key, "train_records")
                              ? " (the training data changed)"
                          : !strcmp(key, "model_config") ? " (another model's config.json)"
                          : !strcmp(key, "iters")        ? " (--iters, or --epochs with the batch size)"
                                                         : "";
        fail(err, errlen,
             "--resume %s: %s is %.200s in this run but %.200s in the checkpoint%s; a run resumes with the options "
             "it was started with",
             dir, key, a ? a : "?", b ? b : "not recorded", why);
        free(a);
        free(b);
        return -1;
    }
    return 0;
}

static int plain_name(const char *n) { return n[0] && n[0] != '.' && !strchr(n, '/'); }

/* A checkpoint in `dir`, checked as one unit: trainer_state.json read, optimizer.safetensors'
 * step counts sound, every file the manifest lists of the size and fingerprint it records, the
 * step counts of the manifest and of the optimizer state the same, and `identity` (this run's
 * options so far) equal to the checkpoint's. Returns the manifest (json_decref it), or NULL with
 * one line in err. */
static json_t *resume_checkpoint_open(const char *dir, const json_t *identity, long *batches, long *updates, char *err,
                               size_t errlen) {
    char path[4200];
    struct stat sb;
    if (stat(dir, &sb) != 0) return fail(err, errlen, "--resume %s: %s", dir, strerror(errno)), NULL;
    if (!S_ISDIR(sb.st_mode)) return fail(err, errlen, "--resume %s: not a folder", dir), NULL;
    snprintf(path, sizeof path, "%s/trainer_state.json", dir);
    if (access(path, F_OK) != 0) {
        char ad[4200];
        snprintf(ad, sizeof ad, "%s/adapters.safetensors", dir);
        if (access(ad, F_OK) == 0)
            fail(err, errlen,
                 "--resume %s: no trainer_state.json, so no complete checkpoint (adapters only, or its writing was cut "
                 "short); --adapters %s starts a new run from these adapters",
                 dir, ad);
        else
            fail(err, errlen, "--resume %s: no trainer_state.json: not a checkpoint of winattn train", dir);
        return NULL;
    }
    json_error_t je;
    json_t *man = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!man) {
        for (char *c = je.text; *c; c++)
            if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = '?';
        return fail(err, errlen, "%s: cannot read (%s)", path, je.text), NULL;
    }
    const json_t *files = json_object_get(man, "files"), *run = json_object_get(man, "run");
    const json_t *jb = json_object_get(man, "batches"), *ju = json_object_get(man, "updates");
    const json_t *jit = json_object_get(run, "iters");
    int rc = 0;
    if (!json_is_object(files) || !json_is_object(run) || !json_is_integer(jb) || !json_is_integer(ju) ||
        !json_is_integer(jit) || json_integer_value(jit) < 0 ||
        strcmp(json_string_value(json_object_get(man, "format")) ? json_string_value(json_object_get(man, "format")) : "",
               "winattn-train-checkpoint") != 0)
        rc = fail(err, errlen, "%s: needs format \"winattn-train-checkpoint\", integer batches and updates, a run object "
                               "with iters and a files object", path);
    /* the optimizer state's own step counts first: the most specific message for a file changed alone */
    if (rc == 0) {
        char op[4200];
        snprintf(op, sizeof op, "%s/optimizer.safetensors", dir);
        st_file f;
        if (st_open(op, &f, err, errlen) != 0) rc = -1;
        else {
            rc = optimizer_counts(&f, op, (long)json_integer_value(jit), batches, updates, err, errlen);
            st_close(&f);
        }
    }
    static const char *const needed[] = {"adapter_config.json", "optimizer.safetensors"};
    for (size_t i = 0; i < sizeof needed / sizeof *needed && rc == 0; i++)
        if (!json_object_get(files, needed[i])) rc = fail(err, errlen, "%s: lists no %s", path, needed[i]);
    /* the weights in either layout (adapters_save: mlx-lm's or peft's file name) */
    if (rc == 0 && !json_object_get(files, adapters_file_name(ADAPTERS_MLX)) &&
        !json_object_get(files, adapters_file_name(ADAPTERS_PEFT)))
        rc = fail(err, errlen, "%s: lists no adapters file (%s or %s)", path, adapters_file_name(ADAPTERS_MLX),
                  adapters_file_name(ADAPTERS_PEFT));
    const char *name;
    json_t *entry;
    json_object_foreach((json_t *)files, name, entry) {
        if (rc) break;
        const json_t *jbytes = json_object_get(entry, "bytes"), *jfp = json_object_get(entry, "fingerprint");
        if (!plain_name(name) || !json_is_integer(jbytes) || !json_is_string(jfp)) {
            rc = fail(err, errlen, "%s: file entry \"%.60s\" needs a plain name, bytes and fingerprint", path, name);
            break;
        }
        char fpath[4200], hex[17];
        snprintf(fpath, sizeof fpath, "%s/%s", dir, name);
        uint64_t bytes, fp;
        if (file_fingerprint(fpath, &bytes, &fp, err, errlen) != 0) {
            rc = -1;
            break;
        }
        snprintf(hex, sizeof hex, "%016llx", (unsigned long long)fp);
        if (bytes != (uint64_t)json_integer_value(jbytes) || strcmp(hex, json_string_value(jfp)) != 0)
            rc = fail(err, errlen,
                      "--resume %s: %s does not match trainer_state.json (%s: %llu bytes, fingerprint %s; recorded %lld, "
                      "%s): it is not the file that checkpoint wrote, so the checkpoint cannot be resumed",
                      dir, name, bytes != (uint64_t)json_integer_value(jbytes) ? "size differs" : "content differs",
                      (unsigned long long)bytes, hex, (long long)json_integer_value(jbytes), json_string_value(jfp));
    }
    if (rc == 0 && (*batches != json_integer_value(jb) || *updates != json_integer_value(ju)))
        rc = fail(err, errlen, "--resume %s: optimizer.safetensors is at batch %ld (update %ld), trainer_state.json at "
                               "batch %lld (update %lld)", dir, *batches, *updates, (long long)json_integer_value(jb),
                  (long long)json_integer_value(ju));
    if (rc == 0) rc = identity_compare(identity, run, dir, err, errlen);
    if (rc) {
        json_decref(man);
        return NULL;
    }
    return man;
}

/* removes dir/.checkpoint.partial and whatever plain files it holds */
static void staging_clear(const char *staging) {
    DIR *d = opendir(staging);
    for (struct dirent *e; d && (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char p[4400];
        snprintf(p, sizeof p, "%s/%s", staging, e->d_name);
        unlink(p);
    }
    if (d) closedir(d);
    rmdir(staging);
}

/* a folder's entries to disk; a filesystem that cannot sync folders (EINVAL) has nothing to do */
static int fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return -1;
    int rc = fsync(fd) == 0 || errno == EINVAL || errno == ENOTSUP ? 0 : -1;
    int e = errno;
    close(fd);
    errno = e;
    return rc;
}

/* the bytes of `from` into `to`, through out_open (a temporary renamed into place) */
static int copy_atomic(const char *from, const char *to, char *err, size_t errlen) {
    FILE *in = fopen(from, "rb");
    if (!in) return fail(err, errlen, "%s: cannot read: %s", from, strerror(errno));
    out_file of;
    if (out_open(&of, to, err, errlen) != 0) return fclose(in), -1;
    enum { CHUNK = 1 << 20 };
    char *buf = malloc(CHUNK);
    size_t n;
    int rc = buf ? 0 : fail(err, errlen, "out of memory");
    while (rc == 0 && (n = fread(buf, 1, CHUNK, in)) > 0)
        if (out_write(&of, buf, n) != 0) rc = fail(err, errlen, "cannot write %s: %s", to, strerror(errno));
    if (rc == 0 && ferror(in)) rc = fail(err, errlen, "%s: cannot read: %s", from, strerror(errno));
    fclose(in);
    free(buf);
    if (rc) return out_abort(&of), -1;
    return out_commit(&of, err, errlen);
}

/* Writes the checkpoint of the state after `batches` batches into out_dir as one unit (the top of
 * this file); numbered > 0 also keeps its adapters as NNNNNNN_adapters.safetensors. With gpu the
 * adapters and moments are downloaded into m and opt first. */
static int checkpoint_write(gemma_model_f32 *m, optimizer *opt, gemma_cuda *gpu, long batches, const json_t *identity,
                            const train_options *o, const char *out_dir, long numbered, char *err, size_t errlen) {
    /* on the GPU the device holds the adapters and moments: they come to the host first */
    if (gpu && (gemma_cuda_params_download(gpu, m, err, errlen) != 0 ||
                gemma_cuda_moments_download(gpu, opt->m1, opt->m2, err, errlen) != 0))
        return -1;
    char staging[4096];
    snprintf(staging, sizeof staging, "%s/.checkpoint.partial", out_dir);
    if (strlen(staging) >= sizeof staging_dir - 1 || strlen(staging) + 40 >= sizeof staged_paths[0])
        return fail(err, errlen, "%s: path too long", out_dir);
    staging_clear(staging); /* one a killed run left */
    if (mkdir(staging, 0777) != 0) return fail(err, errlen, "%s: cannot create %s: %s", out_dir, staging, strerror(errno));
    memcpy(staging_dir, staging, strlen(staging) + 1);
    for (int i = 0; i < STAGED_NAMES && staged_names[i]; i++)
        snprintf(staged_paths[i], sizeof staged_paths[i], "%s/%s", staging, staged_names[i]);
    __atomic_store_n(&staging_live, 1, __ATOMIC_SEQ_CST);

    json_t *files = json_object(), *man = NULL;
    char *text = NULL, **names = NULL;
    int count = 0, rc = 0;
    if (adapters_save(m, staging, o->format, o->model_dir, err, errlen) != 0 || optimizer_save(opt, batches, staging, err, errlen) != 0) rc = -1;
    /* every file adapters_save wrote, whatever its layout, goes into the manifest and into out_dir */
    DIR *d = rc ? NULL : opendir(staging);
    for (struct dirent *e; d && (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        char p[4400];
        snprintf(p, sizeof p, "%s/%s", staging, e->d_name);
        uint64_t bytes, fp;
        char **grown = realloc(names, (size_t)(count + 1) * sizeof *names);
        if (!grown) {
            rc = fail(err, errlen, "out of memory");
            break;
        }
        names = grown;
        if (!(names[count] = strdup(e->d_name))) {
            rc = fail(err, errlen, "out of memory");
            break;
        }
        count++;
        if (file_fingerprint(p, &bytes, &fp, err, errlen) != 0) {
            rc = -1;
            break;
        }
        json_object_set_new(files, e->d_name, json_pack("{s:I, s:o}", "bytes", (json_int_t)bytes, "fingerprint", json_hex64(fp)));
    }
    if (d) closedir(d);
    if (rc == 0) {
        man = json_pack("{s:s, s:i, s:I, s:I, s:O, s:O}", "format", "winattn-train-checkpoint", "version", 1, "batches",
                        (json_int_t)batches, "updates", (json_int_t)opt->updates, "run", identity, "files", files);
        text = man ? json_dumps(man, JSON_INDENT(2) | JSON_SORT_KEYS) : NULL;
        char p[4400];
        snprintf(p, sizeof p, "%s/trainer_state.json", staging);
        rc = !text ? fail(err, errlen, "out of memory") : write_text_atomic(p, text, err, errlen);
    }
    /* the numbered adapters, mlx-lm's name with the update count */
    for (int i = 0; i < count && rc == 0 && numbered > 0; i++) {
        size_t len = strlen(names[i]);
        if (len < 12 || strcmp(names[i] + len - 12, ".safetensors") != 0 || !strcmp(names[i], "optimizer.safetensors"))
            continue;
        char from[4400], to[4400];
        snprintf(from, sizeof from, "%s/%s", staging, names[i]);
        snprintf(to, sizeof to, "%s/%07ld_%s", out_dir, numbered, names[i]);
        rc = copy_atomic(from, to, err, errlen);
    }
    if (rc == 0 && fsync_dir(staging) != 0) rc = fail(err, errlen, "%s: cannot sync: %s", staging, strerror(errno));
    /* publish: renames only (no data to write, so a full disk cannot stop them half-way), the
     * manifest last; a second signal waits for them */
    if (rc == 0) {
        publish_begin();
        for (int i = 0; i <= count && rc == 0; i++) {
            const char *n = i < count ? names[i] : "trainer_state.json";
            char from[4400], to[4400];
            snprintf(from, sizeof from, "%s/%s", staging, n);
            snprintf(to, sizeof to, "%s/%s", out_dir, n);
            if (rename(from, to) != 0) rc = fail(err, errlen, "cannot move %s to %s: %s", from, to, strerror(errno));
        }
        if (rc == 0 && fsync_dir(out_dir) != 0) rc = fail(err, errlen, "%s: cannot sync: %s", out_dir, strerror(errno));
        staging_clear(staging);
        __atomic_store_n(&staging_live, 0, __ATOMIC_SEQ_CST);
        publish_end();
    } else {
        staging_clear(staging);
        __atomic_store_n(&staging_live, 0, __ATOMIC_SEQ_CST);
    }
    for (int i = 0; i < count; i++) free(names[i]);
    free(names);
    free(text);
    json_decref(man);
    json_decref(files);
    return rc;
}



/* Step `step` went non-finite (what says how). The checkpoint of the last update (good_batches)
 * goes to out_dir, unless out_dir holds it already (last_saved). err gets the one line; returns -1. */
static int stop_nonfinite(gemma_model_f32 *m, optimizer *opt, gemma_cuda *gpu, const json_t *identity,
                          const train_options *o,
                          const char *out_dir,
                          int step, const char *what, long good_batches, long last_saved, char *err, size_t errlen) {
    char when[48];
    if (good_batches > 0) snprintf(when, sizeof when, "after step %ld", good_batches);
    else snprintf(when, sizeof when, "before training");
    if (good_batches == last_saved)
        return fail(err, errlen, "step %d: %s; stopped, %s holds the adapters and optimizer state %s", step, what,
                    out_dir, when);
    char serr[512];
    if (checkpoint_write(m, opt, gpu, good_batches, identity, o, out_dir, 0, serr, sizeof serr) != 0)
        return fail(err, errlen, "step %d: %s; stopped, and saving the state %s failed: %s", step, what, when, serr);
    return fail(err, errlen, "step %d: %s; stopped, the adapters and optimizer state %s are in %s", step, what, when,
                out_dir);
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

static int outputs_spare_inputs(const train_options *o, const char *out_dir, char *err, size_t errlen) {
    enum { MAX_FILES = 256 };
    char *inputs[MAX_FILES], *outputs[8];
    int ni = 0, no = 0, rc = 0;
    static const char *data_files[] = {"train.jsonl", "valid.jsonl", "test.jsonl"};
    for (size_t i = 0; i < sizeof data_files / sizeof *data_files && o->data_dir; i++)
        if (asprintf(&inputs[ni], "%s/%s", o->data_dir, data_files[i]) >= 0) ni++;
    if (o->data_dir && (inputs[ni] = strdup(o->data_dir))) ni++; /* --data FILE */
    DIR *d = o->model_dir ? opendir(o->model_dir) : NULL; /* config.json, the weights, the index */
    for (struct dirent *e; d && ni < MAX_FILES - 5 && (e = readdir(d));)
        if (e->d_name[0] != '.' && asprintf(&inputs[ni], "%s/%s", o->model_dir, e->d_name) >= 0) ni++;
    if (d) closedir(d);
    if (o->adapters_path && (inputs[ni] = strdup(o->adapters_path))) ni++;
    static const char *resumed[] = {"adapters.safetensors", "adapter_model.safetensors", "adapter_config.json",
                                    "optimizer.safetensors", "trainer_state.json"};
    for (size_t i = 0; i < sizeof resumed / sizeof *resumed && o->resume_dir; i++)
        if (asprintf(&inputs[ni], "%s/%s", o->resume_dir, resumed[i]) >= 0) ni++;
    if (o->log_path && (outputs[no] = strdup(o->log_path))) no++;
    static const char *written[] = {"adapters.safetensors", "adapter_model.safetensors", "adapter_config.json",
                                    "optimizer.safetensors", "trainer_state.json", "log.jsonl"};
    for (size_t i = 0; i < sizeof written / sizeof *written && !o->eval_only; i++)
        if (asprintf(&outputs[no], "%s/%s", out_dir, written[i]) >= 0) no++;
    for (int a = 0; a < no && rc == 0; a++) {
        for (int b = 0; b < ni && rc == 0; b++) {
            /* resuming into the same folder rewrites its own checkpoint: that is the point */
            const char *oa = strrchr(outputs[a], '/'), *ib = strrchr(inputs[b], '/');
            int own = o->resume_dir && same_dir(o->resume_dir, out_dir) && oa && ib && strcmp(oa, ib) == 0;
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

static void describe_schedule(const train_options *o, long updates, char *buf, size_t n) {
    const lr_schedule *s = &o->schedule;
    int len = 0;
    if (s->warmup > 0)
        len = snprintf(buf, n, "warmup from %g over %d updates, then ", s->warmup_init, s->warmup);
    if (len < 0 || (size_t)len >= n) len = 0;
    long steps = s->steps > 0 ? s->steps : updates - (s->warmup > 0 ? s->warmup : 0);
    if (steps < 1) steps = 1;
    if (s->decay == LR_CONSTANT) snprintf(buf + len, n - len, "constant");
    else snprintf(buf + len, n - len, "%s decay to %g over %ld updates", s->decay == LR_COSINE ? "cosine" : "linear",
                  s->end, steps);
}

/* The checkpoint after a stop signal (unless out_dir holds it already), and the one line saying
 * where it is. Returns TRAIN_INTERRUPTED, or -1 when the checkpoint cannot be written. */
static int stop_interrupted(gemma_model_f32 *m, optimizer *opt, gemma_cuda *gpu, const json_t *identity,
                            const train_options *o,
                            const char *out_dir,
                            long batches_run, long good_batches, long iters, long *last_saved, const char *during,
                            char *err, size_t errlen) {
    int sig = stop_signal;
    train_stop_signal = sig;
    char serr[512];
    if (*last_saved != good_batches) {
        if (checkpoint_write(m, opt, gpu, good_batches, identity, o, out_dir, 0, serr, sizeof serr) != 0)
            return fail(err, errlen, "interrupted by %s after step %ld of %ld, and writing the checkpoint failed: %s",
                        signal_name(sig), batches_run, iters, serr);
        *last_saved = good_batches;
    }
    if (during)
        fail(err, errlen, "interrupted by %s during %s: the checkpoint after step %ld of %ld is in %s", signal_name(sig),
             during, good_batches, iters, out_dir);
    else if (good_batches == batches_run)
        fail(err, errlen, "interrupted by %s after step %ld of %ld: the checkpoint is in %s; --resume %s continues",
             signal_name(sig), good_batches, iters, out_dir, out_dir);
    else
        fail(err, errlen,
             "interrupted by %s at step %ld of %ld: the checkpoint of step %ld (the last optimizer update) is in %s; "
             "--resume %s continues", signal_name(sig), batches_run, iters, good_batches, out_dir, out_dir);
    return TRAIN_INTERRUPTED;
}


/* the options this file adds, in range (the command checks its flags; a library caller may not) */
static int options_valid(const train_options *o, char *err, size_t errlen) {
    const lr_schedule *s = &o->schedule;
    if (o->save_every < 0) return fail(err, errlen, "save_every = %d: must be 0 (off) or more", o->save_every);
    if (!(o->grad_clip >= 0) || isinf(o->grad_clip))
        return fail(err, errlen, "grad_clip = %g: must be a finite norm, or 0 (off)", o->grad_clip);
    if (o->val_batches < -1) return fail(err, errlen, "val_batches = %d: must be -1 or 0 (all), or more", o->val_batches);
    if (s->decay != LR_CONSTANT && s->decay != LR_COSINE && s->decay != LR_LINEAR)
        return fail(err, errlen, "lr_schedule: unknown decay %d", (int)s->decay);
    if (s->steps < 0 || s->warmup < 0)
        return fail(err, errlen, "lr_schedule: steps = %d and warmup = %d must not be negative", s->steps, s->warmup);
    if (!isfinite(s->end) || !isfinite(s->warmup_init) || !isfinite(o->lr))
        return fail(err, errlen, "lr_schedule: the learning rate, end and warmup_init must be finite");
    return 0;
}

int train_run(const train_options *o, char *err, size_t errlen) {
    train_stop_signal = 0;
    stop_signal = 0;
    const char *out_dir = o->out_dir && *o->out_dir ? o->out_dir : "adapters";
    if (options_valid(o, err, errlen) != 0 || outputs_spare_inputs(o, out_dir, err, errlen) != 0) return -1;
    if (data_check_run(o, err, errlen) != 0) return -1; /* before the model loads */
    gemma_model_f32 m;
    lora_config lc = o->lora;
    char path[4096];
    int rc = -1;
    dataset train = {0}, valid = {0}, test = {0};
    optimizer opt = {0};
    int *order = NULL;
    FILE *log = NULL;
    long batches_done = 0, resume_batches = 0, resume_updates = 0;
    made_dirs made = {0};
    saved_handlers handlers = {0};
    json_t *identity = NULL, *manifest = NULL;
    /* --adapters FILE or DIR, in either layout; a folder's adapter_config.json sets the LoRA setup
     * over the flags. A resumed run's setup is the flags', checked against its checkpoint's. */
    char adapter_weights[4096] = "", adapter_cfg[4096] = "";
    if (o->adapters_path && adapters_locate(o->adapters_path, 0, adapter_weights, sizeof adapter_weights, adapter_cfg,
                                            sizeof adapter_cfg, err, errlen) != 0)
        return -1;
    if (*adapter_cfg) {
        gemma_config cfg;
        snprintf(path, sizeof path, "%s/config.json", o->model_dir);
        if (gemma_config_load(path, &cfg, err, errlen) != 0) return -1;
        if (adapter_config_load(adapter_cfg, cfg.layers, &lc, err, errlen) != 0) return -1;
    }
    gemma_cuda *gpu = NULL;
    int model_loaded = 0;

    /* before anything large is read: the checkpoint to resume, as one unit and against this
     * run's options, and the output folder's permission */
    if (!o->eval_only) {
        gemma_config cfg;
        uint64_t bytes, model_fp;
        snprintf(path, sizeof path, "%s/config.json", o->model_dir);
        if (gemma_config_load(path, &cfg, err, errlen) != 0 || file_fingerprint(path, &bytes, &model_fp, err, errlen) != 0)
            goto done;
        identity = run_identity(o, &lc, cfg.layers, model_fp, NULL, 0, 0);
        if (o->resume_dir &&
            !(manifest = resume_checkpoint_open(o->resume_dir, identity, &resume_batches, &resume_updates, err, errlen)))
            goto done;
        if (make_dirs(out_dir, &made, err, errlen) != 0 || probe_writable(out_dir, "the output folder", err, errlen) != 0)
            goto done;
        if (o->log_path && probe_log(o->log_path, &made, err, errlen) != 0) goto done;
    }

    int on_gpu = o->device == WA_DEVICE_CUDA;
    /* on the GPU the host keeps the adapters only: the base weights go from the checkpoint to the
     * device (a 31B model has no f32 copy anywhere) */
    if (on_gpu ? gemma_model_layout_f32(&m, o->model_dir, &lc, err, errlen) != 0
               : gemma_model_load_base_f32(&m, o->model_dir, &lc, o->base, err, errlen) != 0)
        goto done;
    model_loaded = 1;
    char desc[512];
    gemma_config_describe(&m.cfg, desc, sizeof desc);
    printf("model: %s (%s)\n", o->model_dir, desc);
    /* the CPU keeps the dequantized f32 values; the GPU keeps the packed form and dequantizes a
     * layer at a time into its precision (model_cuda.h) */
    const char *dequantized = !on_gpu                          ? "dequantized to f32"
                              : o->precision == PRECISION_F32 ? "packed on the device, dequantized per layer to f32"
                                                              : "packed on the device, dequantized per layer to bf16";
    if (o->base == BASE_MLX4)
        printf("base: q, k, v, o, gate, up, down as MLX's affine 4-bit (group 64), %s\n", dequantized);
    else if (o->base == BASE_NF4)
        printf("base: q, k, v, o, gate, up, down as bitsandbytes' NF4 (blocks of 64, double-quantized absmax), %s\n",
               dequantized);
    else if (o->base == BASE_FP8) /* in bf16 on the GPU: FP8 products where the device takes them */
        printf("base: q, k, v, o, gate, up, down as FP8 e4m3 with a scale per output channel, %s\n",
               on_gpu && o->precision == PRECISION_BF16
                   ? "packed on the device, multiplied as FP8 or dequantized per layer to bf16 (the device line says)"
                   : dequantized);
    if (on_gpu) {
        gemma_cuda_options co = {o->precision, o->random_init, o->init_seed, 0, o->deterministic, o->base};
        double t0 = now_seconds();
        if (gemma_cuda_open(&m, o->model_dir, &co, &gpu, err, errlen) != 0) goto done;
        size_t peak;
        gemma_cuda_memory(gpu, &peak, NULL);
        const char *how = o->base == BASE_BF16 ? (o->random_init ? "drawn on the GPU" : "copied from the checkpoint")
                          : o->random_init    ? "drawn and quantized on the GPU"
                                              : "quantized on the GPU from the checkpoint";
        printf("device: %s; base weights %s in %.1f s, %.2f GB on the device\n", gemma_cuda_describe(gpu), how,
               now_seconds() - t0, peak / 1e9);
    } else if (o->random_init) {
        fail(err, errlen, "--init-random draws the weights on the GPU: it needs --device cuda");
        goto done;
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

    /* --data as a folder or one file; the held-out and test sets when asked for (test read now, so
     * a missing one fails before training, not after); raw records refused with the command that
     * prepares them (data.h) */
    if (data_load_run(o, m.cfg.vocab, &train, &valid, &test, err, errlen) != 0) goto done;

    gemma_lora_init_f32(&m, o->seed);
    const char *start = o->adapters_path ? adapter_weights : NULL;
    char resume_weights[4096], resume_cfg[4096];
    if (o->resume_dir) { /* the checkpoint's weights, in the layout it was written in */
        if (adapters_locate(o->resume_dir, 1, resume_weights, sizeof resume_weights, resume_cfg, sizeof resume_cfg, err,
                            errlen) != 0)
            goto done;
        start = resume_weights;
    }
    if (start && adapters_load(&m, start, err, errlen) != 0) goto done;
    if (start) printf("adapters: %s\n", start);
    /* from here the device's copy of the adapters is the one trained and evaluated */
    if (gpu && gemma_cuda_params_upload(gpu, &m, err, errlen) != 0) goto done;

    if (o->eval_only) {
        if (gpu && o->pack && eval_records_fit(gpu, &valid, 1, &test, o, err, errlen) != 0) goto done;
        rc = report_eval(&m, gpu, &valid, o, 0, 0, "", NULL, NULL, err, errlen);
        if (rc == 0 && o->test) rc = report_eval(&m, gpu, &test, o, 1, 0, "", NULL, NULL, err, errlen);
        goto done;
    }

    int iters = o->iters;
    if (iters <= 0) iters = (int)ceil(o->epochs * train.count / o->batch - 1e-9);
    long updates_total = (iters + o->grad_accum - 1) / o->grad_accum;
    {
        uint64_t data_fp = dataset_fingerprint(&train);
        json_t *full = run_identity(o, &lc, m.cfg.layers, 0, &data_fp, train.count, iters);
        /* the model's fingerprint came from the first call */
        json_object_set(full, "model_config", json_object_get(identity, "model_config"));
        json_decref(identity);
        identity = full;
    }
    if (manifest && identity_compare(identity, json_object_get(manifest, "run"), o->resume_dir, err, errlen) != 0)
        goto done;
    order = batch_schedule(train.count, o->batch, iters, o->seed);
    opt.n = m.param_count;
    opt.m1 = calloc(opt.n ? opt.n : 1, sizeof(float));
    opt.m2 = calloc(opt.n ? opt.n : 1, sizeof(float));
    if (!order || !opt.m1 || !opt.m2) {
        fail(err, errlen, "out of memory");
        goto done;
    }
    if (o->resume_dir && optimizer_load(&opt, &batches_done, iters, o->resume_dir, err, errlen) != 0) goto done;
    if (o->resume_dir && gpu && gemma_cuda_moments_upload(gpu, opt.m1, opt.m2, err, errlen) != 0) goto done;
    if (o->resume_dir && (batches_done != resume_batches || opt.updates != resume_updates)) {
        fail(err, errlen, "--resume %s: optimizer.safetensors changed while the run started", o->resume_dir);
        goto done;
    }
    /* batches behind the checkpoint in out_dir; -1: none written by or for this run yet */
    long last_saved = o->resume_dir && same_dir(o->resume_dir, out_dir) ? batches_done : -1;
    if (o->log_path) snprintf(path, sizeof path, "%s", o->log_path);
    else snprintf(path, sizeof path, "%s/log.jsonl", out_dir);
    /* a run stopped after an evaluation step but before its evaluation ended (the signal came in
     * that step or in the evaluation) owes it: the resumed run makes it first, unless the log of
     * the run it continues holds it */
    int owed_eval = o->eval_every && batches_done > 0 && batches_done % o->eval_every == 0 && batches_done < iters;
    if (owed_eval && o->resume_dir) {
        char resumed_log[4200];
        snprintf(resumed_log, sizeof resumed_log, "%s/log.jsonl", o->resume_dir);
        /* the resumed folder's log is this run's own when it resumes in place: read once */
        owed_eval = !log_has_eval(path, batches_done) &&
                    (strcmp(resumed_log, path) == 0 || !log_has_eval(resumed_log, batches_done));
    }
    /* the batches to come: their tokens (the progress line's total), the largest batch (on the
     * GPU the host memory the layer inputs take is allocated for it) and the longest record */
    progress prog = {0};
    long largest_batch = 0;
    longest_record longest_train = {0, 0, "train"};
    for (int i = (int)batches_done; i < iters; i++) {
        long tokens = 0;
        for (int j = 0; j < o->batch; j++) {
            tokens += train.seq[order[i] + j].len;
            longest_note(&longest_train, &train, order[i] + j, "train");
        }
        prog.total_tokens += tokens;
        largest_batch = tokens > largest_batch ? tokens : largest_batch;
    }
    if (valid.count) prog.valid_pass_tokens = eval_tokens(&valid, eval_records(&valid, o->batch, o->val_batches));
    if (test.count) prog.test_pass_tokens = eval_tokens(&test, eval_records(&test, o->batch, 0));
    char sched[160], clip[48] = "";
    describe_schedule(o, updates_total, sched, sizeof sched);
    if (o->grad_clip > 0) snprintf(clip, sizeof clip, "; gradient clipped to norm %g", o->grad_clip);
    printf("data: %d train records (%d per pass after dropping the remainder), longest %d tokens; %d batches of %d "
           "from batch %ld; optimizer %s, lr %g (%s)%s\n",
           train.count, train.count / o->batch * o->batch, train.longest, iters, o->batch, batches_done + 1,
           o->adamw ? "AdamW" : "Adam", o->lr, sched, clip);
    if (o->save_every > 0) printf("checkpoints: %s, every %d updates and at the end\n", out_dir, o->save_every);
    else printf("checkpoints: %s, at the end (and on SIGINT or SIGTERM)\n", out_dir);
    fflush(stdout);

    /* packed tokens one forward + backward may hold: what the GPU's free memory allows; a record
     * longer than that, or an evaluation's longer than one forward holds, is refused here, before
     * the log is written */
    long pass_tokens = LONG_MAX;
    if (gpu && o->pack) {
        pass_tokens = gemma_cuda_token_budget(gpu, largest_batch);
        printf("device: up to %ld tokens per pass, a larger batch runs its records in several passes; %s\n",
               pass_tokens, gemma_cuda_layer_inputs(gpu));
        fflush(stdout);
        int valid_evaluated = valid.count && (owed_eval || (o->eval_every && batches_done == 0) ||
                                              evals_after(o, batches_done, iters) > 0);
        if (longest_fits(&longest_train, pass_tokens, "a training pass", gpu, o, err, errlen) != 0 ||
            eval_records_fit(gpu, &valid, valid_evaluated, &test, o, err, errlen) != 0)
            goto done;
    }
    log = fopen(path, batches_done ? "a" : "w");
    if (!log) {
        fail(err, errlen, "%s: cannot open the log: %s", path, strerror(errno));
        goto done;
    }
    if (batches_done) log_line(log, "{\"resume\": %ld, \"updates\": %ld}", batches_done, opt.updates);

    /* from here a stop signal ends the run with a checkpoint: the evaluation before training too */
    stop_handlers_install(&handlers);
    /* the starting point of the held-out curve */
    if (o->eval_every && batches_done == 0) {
        int erc = report_eval(&m, gpu, &valid, o, 0, 0, "before training", log, &prog, err, errlen);
        if (erc < 0) goto done;
        if (erc > 0) {
            rc = stop_interrupted(&m, &opt, gpu, identity, o, out_dir, 0, 0, iters, &last_saved,
                                  "the evaluation before training", err, errlen);
            goto done;
        }
    }
    if (owed_eval) {
        char label[64], during[96];
        snprintf(label, sizeof label, "after step %ld", batches_done);
        snprintf(during, sizeof during, "the evaluation after step %ld", batches_done);
        int erc = report_eval(&m, gpu, &valid, o, 0, (int)batches_done, label, log, &prog, err, errlen);
        if (erc < 0) goto done;
        if (erc > 0) {
            rc = stop_interrupted(&m, &opt, gpu, identity, o, out_dir, batches_done, batches_done, iters, &last_saved,
                                  during, err, errlen);
            goto done;
        }
    }
    uint64_t base_hash = weights_hash(&m);
    long first_batch = batches_done;
    long good_batches = batches_done; /* batches behind the adapters and moments: the last update */
    double run_start = now_seconds();
    size_t run_peak = 0, run_dev_peak = 0;
    int norm_threads = thread_count(o, opt.n);
    for (int i = (int)batches_done; i < iters; i++) {
        /* counted from where this run started: batches_done moves every step */
        if ((i - first_batch) % o->grad_accum == 0) {
            if (!gpu) memset(m.grads, 0, m.param_count * sizeof(float));
            else if (gemma_cuda_grads_zero(gpu, m.err, sizeof m.err) != 0) {
                fail(err, errlen, "batch %d: %s", i + 1, m.err);
                goto done;
            }
        }
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
        if (gpu) gemma_cuda_profile_take(gpu, NULL); /* the step's own phases, not an evaluation's before it */
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
                j1 = pass_end(seqs, j0, o->batch, pass_tokens);
                brc = batch_backward(&m, gpu, seqs + j0, j1 - j0, scale, &st);
            }
            free(seqs);
            if (brc != 0) {
                fail(err, errlen, "batch %d (records %d to %d, %ld tokens): %s", i + 1, order[i] + 1, order[i] + o->batch,
                     tokens, m.err);
                goto done;
            }
        } else { /* the records one by one, as before packing: the comparison run */
            for (int j = 0; j < o->batch; j++) {
                gemma_seq one = {b[j].tokens, b[j].len, b[j].target_mask};
                if (batch_backward(&m, gpu, &one, 1, scale, &st) != 0) {
                    fail(err, errlen, "batch %d, record %d (%d tokens): %s", i + 1, order[i] + j + 1, b[j].len, m.err);
                    goto done;
                }
                if (isatty(STDERR_FILENO)) {
                    char eta[32];
                    progress now = prog;
                    now.train_seconds += now_seconds() - t0;
                    for (int k = 0; k <= j; k++) now.done_tokens += b[k].len;
                    format_duration(eta_seconds(&now, evals_after(o, i, iters), o->test), eta, sizeof eta);
                    fprintf(stderr, "\r  step %d/%d  record %d/%d  %d tokens  ETA %s   ", i + 1, iters, j + 1,
                            o->batch, b[j].len, eta);
                }
            }
        }
        char what[256];
        int bad = batch_nonfinite(&m, gpu, &st, what, sizeof what);
        if (bad < 0) {
            fail(err, errlen, "batch %d: %s", i + 1, m.err);
            goto done;
        }
        if (bad) {
            stop_nonfinite(&m, &opt, gpu, identity, o, out_dir, i + 1, what, good_batches, last_saved, err, errlen);
            goto done;
        }
        int update = (i + 1 - first_batch) % o->grad_accum == 0 || i + 1 == iters;
        double lr = 0, grad_norm = 0;
        if (update) {
            lr = train_lr_at(o, opt.updates, updates_total);
            if (gpu) { /* clipping and Adam(W) on the device, as on the host below */
                gemma_cuda_adam a = {lr,       o->beta1,          o->beta2,        o->eps, o->weight_decay,
                                     o->adamw, o->bias_correction, opt.updates + 1, o->grad_clip};
                int nonfinite = 0;
                if (gemma_cuda_optimizer_step(gpu, &a, &grad_norm, &nonfinite, m.err, sizeof m.err) != 0) {
                    fail(err, errlen, "batch %d: the optimizer update: %s", i + 1, m.err);
                    goto done;
                }
                if (nonfinite) { /* batch_nonfinite saw every gradient finite: a fault on the device */
                    snprintf(what, sizeof what, "the gradient's norm is not finite (%g)", grad_norm);
                    stop_nonfinite(&m, &opt, gpu, identity, o, out_dir, i + 1, what, good_batches, last_saved, err,
                                   errlen);
                    goto done;
                }
                opt.updates++;
            } else {
                grad_norm = train_clip_grad_norm(m.grads, m.param_count, o->grad_clip, norm_threads);
                train_optimizer_update(&opt, m.params, m.grads, o, lr);
            }
            good_batches = i + 1;
        }
        double secs = now_seconds() - t0;
        prog.train_seconds += secs;
        prog.done_tokens += tokens;
        size_t peak = peak_rss_bytes(), dev_peak = 0;
        run_peak = peak > run_peak ? peak : run_peak;
        if (gpu) gemma_cuda_memory(gpu, &dev_peak, NULL);
        run_dev_peak = dev_peak > run_dev_peak ? dev_peak : run_dev_peak;
        char dev_text[48] = "", upd_text[96];
        if (gpu) snprintf(dev_text, sizeof dev_text, "  device peak %.2f GB", dev_peak / 1e9);
        if (update)
            snprintf(upd_text, sizeof upd_text, "lr %.3e  grad norm %.4g%s", lr, grad_norm,
                     o->grad_clip > 0 && grad_norm > o->grad_clip ? " (clipped)" : "");
        else
            snprintf(upd_text, sizeof upd_text, "accumulating %ld/%d", (i + 1 - first_batch) % o->grad_accum, o->grad_accum);
        double loss = st.loss_sum / (st.tokens ? st.tokens : 1);
        char eta[32];
        format_duration(eta_seconds(&prog, evals_after(o, i + 1, iters), o->test), eta, sizeof eta);
        if (isatty(STDERR_FILENO)) fprintf(stderr, "\r%*s\r", 70, "");
        printf("step %d/%d  loss %.4f  %s  tokens %ld  longest %d  %.2f s  %.0f tok/s  peak RSS %.2f GB%s  ETA %s\n",
               i + 1, iters, loss, upd_text, tokens, longest, secs, tokens / secs, peak / 1e9, dev_text, eta);
        fflush(stdout);
        char upd_log[96] = "", prof_log[640] = "";
        if (update) snprintf(upd_log, sizeof upd_log, ", \"lr\": %.9g, \"grad_norm\": %.9g", lr, grad_norm);
        gemma_cuda_profile prof;
        if (gpu && gemma_cuda_profile_take(gpu, &prof)) profile_json(&prof, prof_log, sizeof prof_log);
        log_line(log,
                 "{\"step\": %d, \"loss\": %.6f, \"targets\": %ld, \"tokens\": %ld, \"longest\": %d, \"seconds\": %.4f, "
                 "\"peak_rss\": %zu, \"device_peak\": %zu, \"arm\": \"%s\", \"packed\": %d%s%s}",
                 i + 1, loss, st.tokens, tokens, longest, secs, peak, dev_peak, attn_arm_name(o->arm), o->pack, upd_log,
                 prof_log);
        batches_done = i + 1;
        if (train_batch_hook) train_batch_hook(batches_done);
        if (update && o->save_every > 0 && opt.updates % o->save_every == 0) {
            if (checkpoint_write(&m, &opt, gpu, good_batches, identity, o, out_dir, opt.updates, err, errlen) != 0)
                goto done;
            last_saved = good_batches;
            printf("checkpoint: %s after step %d (update %ld; adapters also in %07ld_adapters.safetensors)\n", out_dir,
                   i + 1, opt.updates, opt.updates);
            fflush(stdout);
        }
        if (stop_signal) {
            rc = stop_interrupted(&m, &opt, gpu, identity, o, out_dir, batches_done, good_batches, iters, &last_saved,
                                  NULL, err, errlen);
            goto done;
        }
        if (o->eval_every && (i + 1) % o->eval_every == 0 && i + 1 < iters) {
            char label[64];
            snprintf(label, sizeof label, "after step %d", i + 1);
            int erc = report_eval(&m, gpu, &valid, o, 0, i + 1, label, log, &prog, err, errlen);
            if (erc < 0) goto done;
            if (erc > 0) {
                rc = stop_interrupted(&m, &opt, gpu, identity, o, out_dir, batches_done, good_batches, iters,
                                      &last_saved, NULL, err, errlen);
                goto done;
            }
        }
    }
    double wall = now_seconds() - run_start;
    if (weights_hash(&m) != base_hash) {
        fail(err, errlen, "internal error: the frozen base weights changed during training");
        goto done;
    }
    if (gpu) /* the weights never leave the device, which has no host copy to hash */
        printf("trained %d batches in %.1f s (%.0f tok/s), peak RSS %.2f GB, device peak %.2f GB\n",
               (int)(iters - first_batch), wall, prog.done_tokens / (wall > 0 ? wall : 1), run_peak / 1e9,
               run_dev_peak / 1e9);
    else
        printf("trained %d batches in %.1f s (%.0f tok/s), peak RSS %.2f GB; base weights unchanged (FNV-1a %016llx)\n",
               (int)(iters - first_batch), wall, prog.done_tokens / (wall > 0 ? wall : 1), run_peak / 1e9,
               (unsigned long long)base_hash);
    log_line(log, "{\"done\": %d, \"seconds\": %.3f, \"peak_rss\": %zu, \"tokens\": %ld, \"arm\": \"%s\", \"packed\": %d}",
             iters, wall, run_peak, prog.done_tokens, attn_arm_name(o->arm), o->pack);
    if (last_saved != batches_done) {
        if (checkpoint_write(&m, &opt, gpu, batches_done, identity, o, out_dir, 0, err, errlen) != 0) goto done;
        last_saved = batches_done;
    }
    printf("saved: %s/%s, adapter_config.json, optimizer.safetensors, trainer_state.json\n", out_dir,
           adapters_file_name(o->format));
    fflush(stdout);
    int erc = 0;
    if (o->eval_at_end) erc = report_eval(&m, gpu, &valid, o, 0, iters, "after training", log, &prog, err, errlen);
    if (erc == 0 && o->test) erc = report_eval(&m, gpu, &test, o, 1, iters, "after training", log, &prog, err, errlen);
    if (erc > 0)
        rc = stop_interrupted(&m, &opt, gpu, identity, o, out_dir, batches_done, good_batches, iters, &last_saved,
                              "the evaluation after training", err, errlen);
    else rc = erc;
done:
    stop_handlers_restore(&handlers);
    if (log) fclose(log);
    made_dirs_undo(&made, rc != 0);
    json_decref(identity);
    json_decref(manifest);
    free(order);
    free(opt.m1);
    free(opt.m2);
    dataset_free(&train);
    dataset_free(&valid);
    dataset_free(&test);
    gemma_cuda_close(gpu);
    if (model_loaded) gemma_model_free_f32(&m);
    return rc;
}

/* test_train_ckpt.c — what the trainer does so that no work is lost, and how it steps:
 *   1. learning-rate schedules against mlx's formulas computed by hand (cosine_decay,
 *      linear_schedule, mlx-lm's warmup join) and against the rates a training run logs;
 *      gradient clipping by global norm (the norm after clipping, thread counts);
 *   2. checkpoints: save_every's numbered adapters (names, count, contents); a run stopped by a
 *      signal (raised from train_batch_hook, or sent to a child from outside, once or twice) and
 *      resumed ends with the adapters and optimizer state of an uninterrupted run, bit for bit; a
 *      write that fails half-way (RLIMIT_FSIZE: adapters written, optimizer state not) leaves the
 *      previous checkpoint whole; tampered checkpoints and changed options refused with one line;
 *   3. the output folder: missing parents created, a folder that cannot be written refused before
 *      the model is read, folders a failed run created removed; val_batches; the test set; an ETA
 *      that counts the evaluation passes to come.
 * Usage: test_train_ckpt [FIXTURES_DIR] (default train/fixtures). */
#define _GNU_SOURCE
#include "atomic_file.h"
#include "check.h"
#include "safetensors.h"
#include "trainer.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *fixtures = "train/fixtures";
static char model[1024], data[1024];

/* ---------------------------------------------------------------------------------------------
 * Small helpers (as in test_train.c) */

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

/* records [2, then len tokens 10 + (t·step + r·shift) mod m]: learnable in a few steps */
static void write_cycle_records(const char *path, int records, int len, int step, int shift, int m) {
    FILE *f = fopen(path, "w");
    if (!f) return;
    for (int r = 0; r < records; r++) {
        fputs("{\"tokens\": [2", f);
        for (int t = 0; t < len; t++) fprintf(f, ", %d", 10 + (t * step + r * shift) % m);
        fputs("]}\n", f);
    }
    fclose(f);
}

/* dir/a and other/a hold the same bytes, for the adapters and the optimizer state */
static int same_state(const char *dir, const char *other) {
    static const char *const files[] = {"adapters.safetensors", "optimizer.safetensors"};
    for (int i = 0; i < 2; i++) {
        char a[1200], b[1200];
        snprintf(a, sizeof a, "%s/%s", dir, files[i]);
        snprintf(b, sizeof b, "%s/%s", other, files[i]);
        if (!check_same_bytes(a, b)) return 0;
    }
    return 1;
}

static int exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

/* the names in dir that contain needle */
static int count_names(const char *dir, const char *needle) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));) n += strstr(e->d_name, needle) != NULL;
    if (d) closedir(d);
    return n;
}

/* The small run every case starts from: the fixture model, rank-4 adapters, batches of 2, lr 1e-2,
 * one thread, 6 batches. */
static void small_run(train_options *o, const char *out) {
    train_defaults(o);
    o->model_dir = model;
    o->data_dir = data;
    o->out_dir = out;
    o->batch = 2;
    o->iters = 6;
    o->lr = 1e-2;
    o->lora.rank = 4;
    o->lora.scale = 2;
    o->threads = 1;
}

/* stdout off while f runs (the runs print their step lines); restored after */
static int quiet_stdout = -1;
static void quiet(int on) {
    fflush(stdout);
    if (on && quiet_stdout < 0) {
        quiet_stdout = dup(STDOUT_FILENO);
        FILE *null = fopen("/dev/null", "w");
        if (null) dup2(fileno(null), STDOUT_FILENO), fclose(null);
    } else if (!on && quiet_stdout >= 0) {
        dup2(quiet_stdout, STDOUT_FILENO);
        close(quiet_stdout);
        quiet_stdout = -1;
    }
}

static int run(const train_options *o, char *err, size_t errlen) {
    quiet(1);
    int rc = train_run(o, err, errlen);
    quiet(0);
    return rc;
}

/* every "lr" of a log's step lines, in order (NAN for a step without an update); the count */
static int read_logged(const char *log, const char *key, double *v, int cap) {
    FILE *f = fopen(log, "r");
    if (!f) return -1;
    char line[2048], pat[64];
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    int n = 0;
    while (fgets(line, sizeof line, f) && n < cap) {
        if (strncmp(line, "{\"step\"", 7) != 0) continue;
        const char *p = strstr(line, pat);
        v[n++] = p ? strtod(p + strlen(pat), NULL) : NAN;
    }
    fclose(f);
    return n;
}

/* ---------------------------------------------------------------------------------------------
 * 1. Schedules and clipping */

static int close_to(double got, double want, double rel) { return fabs(got - want) <= rel * fmax(fabs(want), 1e-300); }

static void test_schedules(void) {
    train_options o;
    train_defaults(&o);
    o.lr = 1e-3;
    const double pi = 3.14159265358979323846;

    /* constant: lr at every update */
    check(train_lr_at(&o, 0, 10) == 1e-3 && train_lr_at(&o, 9, 10) == 1e-3 && train_lr_at(&o, 50, 10) == 1e-3,
          "schedule: constant gives lr at every update");

    /* cosine_decay(1e-3, 10, 1e-5): end + (init - end) · ½(1 + cos(π min(u, 10) / 10)) */
    o.schedule = (lr_schedule){LR_COSINE, 10, 1e-5, 0, 0};
    double want[] = {1e-3, 1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + cos(pi * 3 / 10)), 1e-5 + (1e-3 - 1e-5) * 0.5,
                     1e-5, 1e-5};
    long at[] = {0, 3, 5, 10, 25};
    int ok = 1;
    for (int i = 0; i < 5; i++) ok &= close_to(train_lr_at(&o, at[i], 100), want[i], 1e-12);
    check(ok, "schedule: cosine_decay(1e-3, 10, 1e-5) at updates 0, 3, 5, 10, 25 = %.6g %.6g %.6g %.6g %.6g",
          train_lr_at(&o, 0, 100), train_lr_at(&o, 3, 100), train_lr_at(&o, 5, 100), train_lr_at(&o, 10, 100),
          train_lr_at(&o, 25, 100));
    /* mlx's own example: cosine_decay(1e-1, 1000), the rate after 5 updates (the 5th used step 4) is 0.0999961 */
    o.lr = 0.1;
    o.schedule = (lr_schedule){LR_COSINE, 1000, 0, 0, 0};
    double got = train_lr_at(&o, 4, 1000);
    check(fabs(got - 0.0999961) < 5e-8, "schedule: mlx's cosine_decay(0.1, 1000) example, 5th update: %.7f (0.0999961)",
          got);

    /* linear_schedule(1e-3, 0, 4): init + (end - init) · min(u, 4) / 4 */
    o.lr = 1e-3;
    o.schedule = (lr_schedule){LR_LINEAR, 4, 0, 0, 0};
    check(close_to(train_lr_at(&o, 1, 100), 7.5e-4, 1e-12) && close_to(train_lr_at(&o, 3, 100), 2.5e-4, 1e-12) &&
              train_lr_at(&o, 4, 100) == 0 && train_lr_at(&o, 9, 100) == 0,
          "schedule: linear_schedule(1e-3, 0, 4) at 1, 3, 4, 9 = %g %g %g %g", train_lr_at(&o, 1, 100),
          train_lr_at(&o, 3, 100), train_lr_at(&o, 4, 100), train_lr_at(&o, 9, 100));

    /* mlx-lm's build_schedule with warmup 3 from 1e-4: join_schedules([linear_schedule(1e-4, 1e-3, 3),
     * cosine_decay(1e-3, 10)], [4]): updates 0..3 warm up, update 4 is the decay's step 0 */
    o.schedule = (lr_schedule){LR_COSINE, 10, 0, 3, 1e-4};
    double w[] = {1e-4, 1e-4 + 9e-4 / 3, 1e-4 + 2 * 9e-4 / 3, 1e-3, 1e-3, 1e-3 * 0.5 * (1 + cos(pi * 2 / 10)),
                  1e-3 * 0.5 * (1 + cos(pi * 9 / 10)), 0};
    long wat[] = {0, 1, 2, 3, 4, 6, 13, 14};
    ok = 1;
    for (int i = 0; i < 8; i++) ok &= close_to(train_lr_at(&o, wat[i], 100), w[i], 1e-12) || (w[i] == 0 && fabs(train_lr_at(&o, wat[i], 100)) < 1e-20);
    check(ok, "schedule: warmup 3 from 1e-4 joined to cosine_decay(1e-3, 10) at the boundary warmup + 1, as mlx-lm "
              "joins them");
    /* mlx's linear_schedule(0, 1e-1, 100) as warmup: after 101 updates the rate is 0.1 */
    o.lr = 0.1;
    o.schedule = (lr_schedule){LR_CONSTANT, 0, 0, 100, 0};
    check(train_lr_at(&o, 100, 1000) == 0.1 && close_to(train_lr_at(&o, 50, 1000), 0.05, 1e-12) &&
              train_lr_at(&o, 0, 1000) == 0,
          "schedule: warmup 100 from 0 (mlx's linear_schedule example): 0, 0.05 at 50, 0.1 at 100");

    /* steps 0: the run's updates less the warmup */
    o.lr = 1e-3;
    o.schedule = (lr_schedule){LR_LINEAR, 0, 0, 2, 0};
    /* 12 updates, warmup 2: the decay runs over 10 updates from update 3 */
    check(close_to(train_lr_at(&o, 3, 12), 1e-3, 1e-12) && close_to(train_lr_at(&o, 8, 12), 1e-3 * 0.5, 1e-12) &&
              close_to(train_lr_at(&o, 11, 12), 1e-3 * 0.2, 1e-12),
          "schedule: steps 0 resolves to the run's 12 updates less warmup 2: %g %g %g", train_lr_at(&o, 3, 12),
          train_lr_at(&o, 8, 12), train_lr_at(&o, 11, 12));
}

static void test_clipping(void) {
    size_t n = 3 * 65536 + 5; /* past several of the norm's blocks */
    float *g = malloc(n * sizeof *g), *h = malloc(n * sizeof *h);
    double sum = 0;
    for (size_t i = 0; i < n; i++) {
        g[i] = (float)(0.5 + 0.25 * sin((double)i));
        sum += (double)g[i] * g[i];
    }
    memcpy(h, g, n * sizeof *g);
    double want = sqrt(sum);
    double n1 = train_clip_grad_norm(g, n, 0, 1), n4 = train_clip_grad_norm(h, n, 0, 4);
    check(close_to(n1, want, 1e-12) && n1 == n4 && memcmp(g, h, n * sizeof *g) == 0,
          "clipping: the norm %.9g (want %.9g), the same bits on 1 and 4 threads, no clip asked: gradient unchanged", n1,
          want);
    float *k = malloc(n * sizeof *k);
    memcpy(k, g, n * sizeof *g);
    double before = train_clip_grad_norm(g, n, 1e9, 2);
    check(before == n1 && memcmp(g, k, n * sizeof *g) == 0, "clipping: a norm under the cap leaves the gradient as it was");
    before = train_clip_grad_norm(g, n, 1.0, 2);
    double after = train_clip_grad_norm(g, n, 0, 1);
    double ratio = g[7] / k[7];
    check(before == n1 && fabs(after - 1.0) < 1e-5 && close_to(ratio, 1.0 / (n1 + 1e-6), 1e-6),
          "clipping to 1: the norm %.4g becomes %.7f, every entry scaled by max / (norm + 1e-6)", before, after);
    free(g);
    free(h);
    free(k);
}

/* ---------------------------------------------------------------------------------------------
 * 2. Checkpoints */

static long hook_stop_at = -1;
static useconds_t hook_sleep;
static void stop_hook(long batches_done) {
    if (batches_done == hook_stop_at) raise(SIGINT);
    if (hook_sleep) usleep(hook_sleep);
}

static rlim_t hook_fsize_limit;
static long hook_limit_at = -1;
static void fsize_hook(long batches_done) {
    if (batches_done != hook_limit_at) return;
    struct rlimit lim;
    getrlimit(RLIMIT_FSIZE, &lim);
    lim.rlim_cur = hook_fsize_limit;
    setrlimit(RLIMIT_FSIZE, &lim);
}

static void test_save_every(const char *tmp) {
    char out[900], ref[900], a[1200], b[1200], err[1024] = "";
    snprintf(out, sizeof out, "%s/every", tmp);
    snprintf(ref, sizeof ref, "%s/every_ref4", tmp);
    train_options o;
    small_run(&o, out);
    o.save_every = 2;
    int rc = run(&o, err, sizeof err);
    int numbered = count_names(out, "_adapters.safetensors");
    const char *names[] = {"0000002_adapters.safetensors", "0000004_adapters.safetensors", "0000006_adapters.safetensors"};
    int all = 1;
    for (int i = 0; i < 3; i++) {
        snprintf(a, sizeof a, "%s/%s", out, names[i]);
        all &= exists(a);
    }
    check(rc == 0 && numbered == 3 && all, "save_every 2 of 6 updates: 0000002, 0000004, 0000006_adapters.safetensors "
                                           "(%d numbered files) %s", numbered, rc ? err : "");
    snprintf(a, sizeof a, "%s/0000006_adapters.safetensors", out);
    snprintf(b, sizeof b, "%s/adapters.safetensors", out);
    check(check_same_bytes(a, b), "save_every: the last numbered adapters are the final adapters.safetensors");
    /* a run of 4 batches (the same batch order's first 4) ends where update 4 was */
    o.save_every = 0;
    o.iters = 4;
    o.out_dir = ref;
    rc = run(&o, err, sizeof err);
    snprintf(a, sizeof a, "%s/0000004_adapters.safetensors", out);
    snprintf(b, sizeof b, "%s/adapters.safetensors", ref);
    check(rc == 0 && check_same_bytes(a, b), "save_every: 0000004_adapters.safetensors = the adapters of a 4-batch run %s",
          rc ? err : "");
    check(count_names(out, ".checkpoint.partial") == 0 && count_names(out, ".tmp") == 0,
          "save_every: no staging folder or temporary left in the output folder");
}

/* the options of the resume tests: a cosine schedule with warmup, clipping, AdamW and two
 * batches per update, so that a resume has to restore all of them */
static void rich_run(train_options *o, const char *out) {
    small_run(o, out);
    o->iters = 8;
    o->grad_accum = 2;
    o->grad_clip = 0.5;
    o->adamw = 1;
    o->schedule = (lr_schedule){LR_COSINE, 0, 1e-4, 1, 1e-3};
}

static void test_resume(const char *tmp) {
    char straight[900], cut[900], cut2[900], path[1200], err[1024] = "";
    snprintf(straight, sizeof straight, "%s/straight", tmp);
    snprintf(cut, sizeof cut, "%s/cut", tmp);
    snprintf(cut2, sizeof cut2, "%s/cut2", tmp);
    train_options o;
    rich_run(&o, straight);
    int rc = run(&o, err, sizeof err);
    if (rc != 0) {
        check_fail("resume: the uninterrupted run: %s", err);
        return;
    }
    /* the logged rates are the schedule's, update by update */
    double lr[16];
    snprintf(path, sizeof path, "%s/log.jsonl", straight);
    int n = read_logged(path, "lr", lr, 16), ok = n == 8;
    for (int i = 0; i < n && ok; i++) {
        if (i % 2 == 0) ok = isnan(lr[i]);
        else ok = close_to(lr[i], train_lr_at(&o, i / 2, 4), 1e-8);
    }
    check(ok, "log: \"lr\" on each update's step line, the schedule's rate (%d lines; %.6g %.6g %.6g %.6g)", n, lr[1],
          lr[3], lr[5], lr[7]);
    double gn[16];
    n = read_logged(path, "grad_norm", gn, 16);
    check(n == 8 && isnan(gn[0]) && gn[1] > 0 && gn[7] > 0, "log: \"grad_norm\" on each update's step line (%g, %g)",
          gn[1], gn[7]);

    /* stopped by SIGINT in the middle of an accumulation (batch 3 of updates of 2): the checkpoint
     * is that of update 1 (batch 2) */
    o.out_dir = cut;
    hook_stop_at = 3;
    train_batch_hook = stop_hook;
    struct sigaction before, after;
    sigaction(SIGINT, NULL, &before);
    rc = run(&o, err, sizeof err);
    sigaction(SIGINT, NULL, &after);
    train_batch_hook = NULL;
    hook_stop_at = -1;
    check(rc == TRAIN_INTERRUPTED && train_stop_signal == SIGINT &&
              strstr(err, "interrupted by SIGINT at step 3 of 8: the checkpoint of step 2") &&
              strstr(err, "--resume ") && !strchr(err, '\n'),
          "SIGINT at batch 3 of 8: returns TRAIN_INTERRUPTED, one line naming the checkpoint: \"%s\"", err);
    check(before.sa_handler == after.sa_handler, "SIGINT: the handler in place before train_run is back after it");
    o.resume_dir = cut;
    rc = run(&o, err, sizeof err);
    check(rc == 0 && same_state(straight, cut),
          "resume after SIGINT (schedule, warmup, clipping, AdamW, grad-accum 2): adapters and optimizer state of the "
          "uninterrupted run, bit for bit %s", rc ? err : "");

    /* stopped after an update, resumed into another folder */
    o.resume_dir = NULL;
    o.out_dir = cut2;
    hook_stop_at = 4;
    train_batch_hook = stop_hook;
    rc = run(&o, err, sizeof err);
    train_batch_hook = NULL;
    hook_stop_at = -1;
    int stopped = rc == TRAIN_INTERRUPTED && strstr(err, "after step 4 of 8: the checkpoint is in ");
    char moved[900];
    snprintf(moved, sizeof moved, "%s/cut2_continued", tmp);
    o.resume_dir = cut2;
    o.out_dir = moved;
    rc = stopped ? run(&o, err, sizeof err) : -1;
    check(stopped && rc == 0 && same_state(straight, moved),
          "SIGINT after step 4, resumed into another folder: the uninterrupted run's state, bit for bit %s",
          rc ? err : "");

    /* SIGINT ignored when the run starts (a background command of a shell without job control): the
     * trainer leaves it so, trains through the SIGINT the hook raises to the end, and SIGINT is
     * still ignored after */
    char ignored[900];
    snprintf(ignored, sizeof ignored, "%s/sigint_ignored", tmp);
    o.resume_dir = NULL;
    o.out_dir = ignored;
    signal(SIGINT, SIG_IGN);
    hook_stop_at = 3;
    train_batch_hook = stop_hook;
    rc = run(&o, err, sizeof err);
    train_batch_hook = NULL;
    hook_stop_at = -1;
    sigaction(SIGINT, NULL, &after);
    signal(SIGINT, SIG_DFL);
    check(rc == 0 && after.sa_handler == SIG_IGN && same_state(straight, ignored),
          "SIGINT ignored when training starts: left ignored, the run ends as the uninterrupted one, bit for bit %s",
          rc ? err : "");
}

/* A write that fails half-way, as on a full disk: from batch 3 on no file may grow past 12000
 * bytes, so the step-4 checkpoint gets its adapters (10 KB) staged and its optimizer state (17 KB)
 * refused. The run fails with the reason; the folder keeps the step-2 checkpoint whole, and a
 * resume from it ends where the uninterrupted run does. */
static void test_failed_write(const char *tmp) {
    char out[900], straight[900], err[1024] = "";
    snprintf(out, sizeof out, "%s/fulldisk", tmp);
    snprintf(straight, sizeof straight, "%s/fulldisk_ref", tmp);
    train_options o;
    small_run(&o, straight);
    int rc = run(&o, err, sizeof err);
    small_run(&o, out);
    o.save_every = 2;
    struct rlimit saved;
    getrlimit(RLIMIT_FSIZE, &saved);
    void (*old_xfsz)(int) = signal(SIGXFSZ, SIG_IGN);
    hook_fsize_limit = 12000;
    hook_limit_at = 3;
    train_batch_hook = fsize_hook;
    int frc = rc ? -1 : run(&o, err, sizeof err);
    train_batch_hook = NULL;
    setrlimit(RLIMIT_FSIZE, &saved);
    signal(SIGXFSZ, old_xfsz);
    check(rc == 0 && frc != 0 && strstr(err, "optimizer.safetensors") && strstr(err, strerror(EFBIG)) &&
              !strchr(err, '\n'),
          "a write cut short at step 4 (file size limit): the run fails naming the file and the reason: \"%s\"", err);
    char a[1200];
    snprintf(a, sizeof a, "%s/0000004_adapters.safetensors", out);
    check(!exists(a) && count_names(out, ".checkpoint.partial") == 0 && count_names(out, ".tmp") == 0,
          "the failed checkpoint left nothing behind (no numbered adapters, staging folder or temporary)");
    o.save_every = 0;
    o.resume_dir = out;
    rc = run(&o, err, sizeof err);
    check(rc == 0 && same_state(straight, out),
          "resume after the failed write: from the whole step-2 checkpoint to the uninterrupted run's state %s",
          rc ? err : "");
}

/* a checkpoint at step 4 of 6 and one at step 2 (SIGINT from the hook) to tamper with */
static int make_checkpoint(const char *out, long at, char *err, size_t errlen) {
    train_options o;
    small_run(&o, out);
    o.save_every = 2;
    hook_stop_at = at;
    train_batch_hook = stop_hook;
    int rc = run(&o, err, errlen);
    train_batch_hook = NULL;
    hook_stop_at = -1;
    return rc == TRAIN_INTERRUPTED ? 0 : -1;
}

static void test_tampered(const char *tmp) {
    char four[900], two[900], t[900], a[1200], b[1200], err[1024] = "";
    snprintf(four, sizeof four, "%s/ck4", tmp);
    snprintf(two, sizeof two, "%s/ck2", tmp);
    snprintf(t, sizeof t, "%s/tampered", tmp);
    if (make_checkpoint(four, 4, err, sizeof err) != 0 || make_checkpoint(two, 2, err, sizeof err) != 0) {
        check_fail("tampered checkpoints: making them: %s", err);
        return;
    }
    static const char *const files[] = {"adapters.safetensors", "adapter_config.json", "optimizer.safetensors",
                                        "trainer_state.json"};
    const struct {
        const char *what, *file, *from, *needle;
    } cases[] = {
        {"adapters of step 2 beside the rest of step 4", "adapters.safetensors", "two",
         "adapters.safetensors does not match trainer_state.json"},
        {"the step-4 numbered adapters of mlx-lm's name copied over step 4's: accepted", "adapters.safetensors", "num4",
         NULL},
        {"optimizer state of step 2 beside step 4's adapters (the full-disk case)", "optimizer.safetensors", "two",
         "optimizer.safetensors does not match trainer_state.json"},
        {"trainer_state.json of step 2 beside step 4's files", "trainer_state.json", "two", "does not match"},
    };
    train_options o;
    small_run(&o, NULL);
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        mkdir(t, 0777);
        for (int i = 0; i < 4; i++) {
            snprintf(a, sizeof a, "%s/%s", four, files[i]);
            snprintf(b, sizeof b, "%s/%s", t, files[i]);
            check_copy_file(a, b);
        }
        if (!strcmp(cases[c].from, "two")) snprintf(a, sizeof a, "%s/%s", two, cases[c].file);
        else snprintf(a, sizeof a, "%s/0000004_adapters.safetensors", four);
        snprintf(b, sizeof b, "%s/%s", t, cases[c].file);
        check_copy_file(a, b);
        o.resume_dir = t;
        o.out_dir = t;
        int rc = run(&o, err, sizeof err);
        if (cases[c].needle)
            check(rc != 0 && strstr(err, cases[c].needle) && !strchr(err, '\n'), "--resume refuses %s: \"%s\"",
                  cases[c].what, err);
        else
            check(rc == 0, "--resume: %s %s", cases[c].what, rc ? err : "");
    }
    /* a file the manifest lists gone; the manifest gone */
    snprintf(a, sizeof a, "%s/adapter_config.json", four);
    snprintf(b, sizeof b, "%s/adapter_config.json.away", four);
    rename(a, b);
    o.resume_dir = four;
    o.out_dir = t;
    int rc = run(&o, err, sizeof err);
    check(rc != 0 && strstr(err, "adapter_config.json: cannot read") && !strchr(err, '\n'),
          "--resume refuses a checkpoint missing a file: \"%s\"", err);
    rename(b, a);
    snprintf(a, sizeof a, "%s/trainer_state.json", four);
    unlink(a);
    rc = run(&o, err, sizeof err);
    check(rc != 0 && strstr(err, "no trainer_state.json") && strstr(err, "--adapters ") && !strchr(err, '\n'),
          "--resume refuses adapters without a manifest, naming --adapters: \"%s\"", err);
}

static void test_mismatch(const char *tmp) {
    char ck[900], out[900], d2[900], p[1200], err[1024] = "";
    snprintf(ck, sizeof ck, "%s/mm", tmp);
    snprintf(out, sizeof out, "%s/mm_out", tmp);
    if (make_checkpoint(ck, 2, err, sizeof err) != 0) {
        check_fail("mismatched options: making the checkpoint: %s", err);
        return;
    }
    enum { LR, BATCH, SEED, ITERS, RANK, KEYS, ACCUM, SCHED, CLIP, OPTIM, MODEL, DATA, CASES };
    const char *names[CASES] = {"learning_rate", "batch_size", "seed", "iters", "lora_parameters", "lora_parameters",
                                "grad_accumulation_steps", "lr_schedule", "grad_clip", "optimizer", "model_config",
                                "train_data"};
    snprintf(d2, sizeof d2, "%s/data_changed", tmp);
    mkdir(d2, 0777);
    snprintf(p, sizeof p, "%s/train.jsonl", d2);
    write_cycle_records(p, 4, 40, 7, 2, 23); /* the same shape, other tokens */
    char other_model[1100];
    snprintf(other_model, sizeof other_model, "%s/gemma4_tiny", fixtures);
    for (int c = 0; c < CASES; c++) {
        train_options o;
        small_run(&o, out);
        o.resume_dir = ck;
        switch (c) {
        case LR: o.lr = 2e-2; break;
        case BATCH: o.batch = 1; break;
        case SEED: o.seed = 7; break;
        case ITERS: o.iters = 8; break;
        case RANK: o.lora.rank = 8; break;
        case KEYS: o.lora.proj_mask = 1; break;
        case ACCUM: o.grad_accum = 2; break;
        case SCHED: o.schedule.decay = LR_COSINE; break;
        case CLIP: o.grad_clip = 1; break;
        case OPTIM: o.adamw = 1; break;
        case MODEL: o.model_dir = other_model; break;
        case DATA: o.data_dir = d2; break;
        }
        int rc = run(&o, err, sizeof err);
        char want[96];
        snprintf(want, sizeof want, "%s is ", names[c]);
        check(rc != 0 && strstr(err, want) && strstr(err, "in the checkpoint") && !strchr(err, '\n'),
              "--resume refuses another %s: \"%s\"", names[c], err);
    }
    /* what only changes how the run is computed or reported is free */
    train_options o;
    small_run(&o, out);
    o.resume_dir = ck;
    o.pack = 0;
    o.threads = 2;
    o.eval_at_end = 1;
    o.val_batches = 1;
    snprintf(p, sizeof p, "%s/valid.jsonl", data);
    int rc = run(&o, err, sizeof err);
    check(rc == 0, "--resume accepts another packing, thread count and evaluation %s", rc ? err : "");
}

/* A child trains with a slow hook and out_cleanup_on_signals() installed first, as the command
 * runs; the parent sends signals once it has logged `after` steps. */
static pid_t start_child(const char *out, int save_every, const char *log) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid != 0) return pid;
    FILE *null = fopen("/dev/null", "w");
    if (null) dup2(fileno(null), STDOUT_FILENO), dup2(fileno(null), STDERR_FILENO);
    out_cleanup_on_signals();
    train_options o;
    small_run(&o, out);
    o.iters = 400;
    o.save_every = save_every;
    hook_sleep = 5000;
    train_batch_hook = stop_hook;
    char err[1024];
    int rc = train_run(&o, err, sizeof err);
    FILE *f = fopen(log, "w");
    if (f) fprintf(f, "%s\n", err), fclose(f);
    _exit(rc == TRAIN_INTERRUPTED ? 3 : rc == 0 ? 0 : 1);
}

static int logged_steps(const char *out) {
    char path[1200], line[2048];
    snprintf(path, sizeof path, "%s/log.jsonl", out);
    FILE *f = fopen(path, "r");
    int n = 0;
    while (f && fgets(line, sizeof line, f)) n += strncmp(line, "{\"step\"", 7) == 0;
    if (f) fclose(f);
    return n;
}

static int wait_steps(const char *out, int steps) {
    for (int i = 0; i < 20000; i++) { /* 20 s */
        if (logged_steps(out) >= steps) return 0;
        usleep(1000);
    }
    return -1;
}

static void test_signals(const char *tmp) {
    char out[900], ref[900], msg[1200], line[1200] = "", err[1024] = "";
    snprintf(out, sizeof out, "%s/sig", tmp);
    snprintf(ref, sizeof ref, "%s/sig_ref", tmp);
    snprintf(msg, sizeof msg, "%s/sig_msg", tmp);
    pid_t pid = start_child(out, 0, msg);
    int status = 0, waited = wait_steps(out, 3);
    kill(pid, waited == 0 ? SIGINT : SIGKILL);
    waitpid(pid, &status, 0);
    FILE *f = fopen(msg, "r");
    if (f) {
        if (!fgets(line, sizeof line, f)) line[0] = '\0';
        fclose(f);
    }
    line[strcspn(line, "\n")] = '\0';
    int at = 0;
    sscanf(line, "interrupted by SIGINT after step %d", &at);
    check(waited == 0 && WIFEXITED(status) && WEXITSTATUS(status) == 3 && at >= 3,
          "a child sent SIGINT while training: finishes its step, writes the checkpoint, returns TRAIN_INTERRUPTED: "
          "\"%s\"", line);
    if (at < 3) return;
    /* the uninterrupted run of as many steps, then both continued to 400 */
    train_options o;
    small_run(&o, out);
    o.iters = 400;
    o.resume_dir = out;
    int rc = run(&o, err, sizeof err);
    o.resume_dir = NULL;
    o.out_dir = ref;
    int rc2 = rc ? -1 : run(&o, err, sizeof err);
    check(rc == 0 && rc2 == 0 && same_state(out, ref),
          "resumed after SIGINT at step %d: the adapters and optimizer state of 400 uninterrupted steps, bit for bit %s",
          at, err);

    /* two signals in a row while a checkpoint is written every update: the process ends at once,
     * the last checkpoint whole, no temporary or staging folder left */
    char out2[900];
    snprintf(out2, sizeof out2, "%s/sig2", tmp);
    pid = start_child(out2, 1, msg);
    waited = wait_steps(out2, 5);
    kill(pid, waited == 0 ? SIGTERM : SIGKILL);
    usleep(1000); /* two signals sent together would arrive as one */
    kill(pid, SIGTERM);
    waitpid(pid, &status, 0);
    int dead = WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM;
    int clean = count_names(out2, ".checkpoint.partial") == 0 && count_names(out2, ".tmp") == 0;
    small_run(&o, out2);
    o.iters = 400;
    o.resume_dir = out2;
    rc = run(&o, err, sizeof err);
    check(waited == 0 && (dead || (WIFEXITED(status) && WEXITSTATUS(status) == 3)) && clean && rc == 0 &&
              same_state(out2, ref),
          "two SIGTERMs while checkpointing every update: %s, nothing half-written left, the last checkpoint resumes "
          "to the uninterrupted state %s",
          dead ? "ended by the second at once" : "the checkpoint was complete before the second", rc ? err : "");
}

/* ---------------------------------------------------------------------------------------------
 * 3. The output folder, val_batches, test */

static void test_out_dir(const char *tmp) {
    char out[900], p[1200], err[1024] = "";
    snprintf(out, sizeof out, "%s/deep/er/out", tmp);
    train_options o;
    small_run(&o, out);
    o.iters = 1;
    int rc = run(&o, err, sizeof err);
    snprintf(p, sizeof p, "%s/trainer_state.json", out);
    check(rc == 0 && exists(p), "out_dir with missing parents: created (mkdir -p), checkpoint written %s", rc ? err : "");

    train_options d;
    train_defaults(&d);
    check(d.out_dir && !strcmp(d.out_dir, "adapters"), "train_defaults: out_dir \"adapters\", as mlx-lm");
    /* options out of range: refused before anything is read */
    for (int c = 0; c < 5; c++) {
        small_run(&d, out);
        const char *want[] = {"save_every = -1", "grad_clip = -1", "val_batches = -2", "steps = -3", "must be finite"};
        if (c == 0) d.save_every = -1;
        if (c == 1) d.grad_clip = -1;
        if (c == 2) d.val_batches = -2;
        if (c == 3) d.schedule.steps = -3;
        if (c == 4) d.schedule.end = NAN;
        rc = run(&d, err, sizeof err);
        check(rc != 0 && strstr(err, want[c]) && !strchr(err, '\n'), "an option out of range refused: \"%s\"", err);
    }

    /* a parent that is a file: refused before the model is read (its weights are truncated:
     * reading them would fail otherwise), the folders made for it removed */
    char short_model[900], file[900];
    snprintf(short_model, sizeof short_model, "%s/short_model", tmp);
    mkdir(short_model, 0777);
    char from[1200];
    snprintf(from, sizeof from, "%s/config.json", model);
    snprintf(p, sizeof p, "%s/config.json", short_model);
    check_copy_file(from, p);
    snprintf(p, sizeof p, "%s/model.safetensors", short_model);
    write_text(p, "truncated");
    snprintf(file, sizeof file, "%s/a_file", tmp);
    write_text(file, "x");
    snprintf(out, sizeof out, "%s/a_file/sub", tmp);
    small_run(&o, out);
    o.model_dir = short_model;
    rc = run(&o, err, sizeof err);
    check(rc != 0 && strstr(err, "a_file is not a folder") && !strchr(err, '\n'),
          "out_dir under a file: refused before the model is read, with the reason: \"%s\"", err);
    snprintf(out, sizeof out, "/proc/winattn-no-such/out");
    o.out_dir = out;
    rc = run(&o, err, sizeof err);
    check(rc != 0 && strstr(err, "/proc/winattn-no-such") && !strchr(err, '\n'),
          "out_dir where no folder can be made (/proc): refused before the model is read: \"%s\"", err);

    /* a run that fails after the checks (the truncated weights) removes the folders it made */
    snprintf(out, sizeof out, "%s/made/by/run", tmp);
    o.out_dir = out;
    rc = run(&o, err, sizeof err);
    snprintf(p, sizeof p, "%s/made", tmp);
    check(rc != 0 && !exists(p), "a run that fails loading the model leaves no folder it created: \"%s\"", err);

    /* the log: its folder made, or refused before training */
    snprintf(p, sizeof p, "%s/a_file/log.jsonl", tmp);
    small_run(&o, NULL);
    snprintf(out, sizeof out, "%s/logged", tmp);
    o.out_dir = out;
    o.log_path = p;
    o.model_dir = short_model;
    rc = run(&o, err, sizeof err);
    check(rc != 0 && strstr(err, "a_file") && !strchr(err, '\n'), "a log under a file: refused before training: \"%s\"",
          err);

    if (geteuid() == 0) {
        check_skip("out_dir without write permission (running as root, where chmod does not bind)");
        return;
    }
    char locked[900];
    snprintf(locked, sizeof locked, "%s/locked", tmp);
    mkdir(locked, 0777);
    chmod(locked, 0500);
    small_run(&o, locked);
    o.model_dir = short_model;
    rc = run(&o, err, sizeof err);
    check(rc != 0 && strstr(err, "not writable") && strstr(err, strerror(EACCES)),
          "out_dir mode 0500: refused before the model is read: \"%s\"", err);
    snprintf(out, sizeof out, "%s/locked/sub", tmp);
    o.out_dir = out;
    rc = run(&o, err, sizeof err);
    check(rc != 0 && strstr(err, "cannot create the folder") && strstr(err, strerror(EACCES)),
          "out_dir inside a 0500 folder: refused before the model is read: \"%s\"", err);
    chmod(locked, 0700);
}

/* the "tokens" of a log's eval or test lines */
static int read_eval_tokens(const char *log, const char *key, long *tokens, double *loss, int cap) {
    FILE *f = fopen(log, "r");
    if (!f) return -1;
    char line[2048], pat[32];
    snprintf(pat, sizeof pat, "{\"%s\": ", key);
    int n = 0;
    while (fgets(line, sizeof line, f) && n < cap) {
        const char *t = strstr(line, "\"tokens\": "), *l = strstr(line, "\"loss\": ");
        if (strncmp(line, pat, strlen(pat)) != 0 || !t || !l) continue;
        tokens[n] = strtol(t + 10, NULL, 10);
        loss[n++] = strtod(l + 8, NULL);
    }
    fclose(f);
    return n;
}

static void test_eval_options(const char *tmp) {
    char out[900], log[1200], p[1200], err[1024] = "";
    snprintf(out, sizeof out, "%s/evals", tmp);
    snprintf(log, sizeof log, "%s/log.jsonl", out);
    train_options o;
    small_run(&o, out);
    o.iters = 2;
    o.eval_at_end = 1;
    long all[4], one[4];
    double la[4], l1[4];
    int rc = run(&o, err, sizeof err);
    int na = rc ? 0 : read_eval_tokens(log, "eval", all, la, 4);
    o.val_batches = 1;
    rc = rc ? rc : run(&o, err, sizeof err);
    int n1 = rc ? 0 : read_eval_tokens(log, "eval", one, l1, 4);
    check(rc == 0 && na == 1 && n1 == 1 && one[0] > 0 && one[0] < all[0],
          "val_batches 1 of 2: the evaluation covers %ld of %ld tokens %s", n1 ? one[0] : 0, na ? all[0] : 0,
          rc ? err : "");
    o.val_batches = -1;
    rc = run(&o, err, sizeof err);
    n1 = rc ? 0 : read_eval_tokens(log, "eval", one, l1, 4);
    check(rc == 0 && n1 == 1 && one[0] == all[0], "val_batches -1: every batch, as mlx-lm's -1 (%ld tokens)",
          n1 ? one[0] : 0);

    /* --test without test.jsonl: refused before training */
    o.val_batches = 0;
    o.test = 1;
    rc = run(&o, err, sizeof err);
    check(rc != 0 && strstr(err, "test.jsonl") && !strchr(err, '\n'), "test without test.jsonl: refused: \"%s\"", err);
    /* test.jsonl = valid.jsonl: the test loss is the evaluation's */
    char from[1200];
    snprintf(from, sizeof from, "%s/valid.jsonl", data);
    snprintf(p, sizeof p, "%s/test.jsonl", data);
    check_copy_file(from, p);
    rc = run(&o, err, sizeof err);
    long tt[4];
    double lt[4];
    int ne = rc ? 0 : read_eval_tokens(log, "eval", all, la, 4), nt = rc ? 0 : read_eval_tokens(log, "test", tt, lt, 4);
    check(rc == 0 && ne == 1 && nt == 1 && tt[0] == all[0] && lt[0] == la[0],
          "test: the loss on test.jsonl after training, logged as {\"test\": ...}; equal to the evaluation on the same "
          "records (%.6f, %.6f) %s", nt ? lt[0] : 0, ne ? la[0] : 0, rc ? err : "");
    unlink(p);
}

/* the loss of the log's evaluation after `step` and how many such lines it holds */
static int logged_evals(const char *log, long step, double *loss) {
    FILE *f = fopen(log, "r");
    if (!f) return -1;
    char line[2048], pat[48];
    int n = snprintf(pat, sizeof pat, "{\"eval\": %ld,", step), count = 0;
    while (fgets(line, sizeof line, f)) {
        const char *l = strstr(line, "\"loss\": ");
        if (strncmp(line, pat, (size_t)n) != 0 || !l) continue;
        *loss = strtod(l + 8, NULL);
        count++;
    }
    fclose(f);
    return count;
}

/* A run stopped in an evaluation step, before its evaluation, owes it: resumed there, the
 * evaluation runs first (equal to the uninterrupted run's), and only when the log lacks it. */
static void test_owed_eval(const char *tmp) {
    char straight[900], cut[900], cut2[900], log[1200], err[1024] = "";
    snprintf(straight, sizeof straight, "%s/eval_straight", tmp);
    snprintf(cut, sizeof cut, "%s/eval_cut", tmp);
    snprintf(cut2, sizeof cut2, "%s/eval_cut2", tmp);
    train_options o;
    small_run(&o, straight);
    o.iters = 4;
    o.eval_every = 2;
    int rc = run(&o, err, sizeof err);
    double want = 0, got = 0, kept = 0;
    snprintf(log, sizeof log, "%s/log.jsonl", straight);
    int n = rc ? 0 : logged_evals(log, 2, &want);
    if (rc != 0 || n != 1) {
        check_fail("owed evaluation: the uninterrupted run logs the evaluation after step 2 once (%d) %s", n,
                   rc ? err : "");
        return;
    }
    /* SIGINT in step 2: the checkpoint is step 2's, its evaluation not made */
    o.out_dir = cut;
    hook_stop_at = 2;
    train_batch_hook = stop_hook;
    rc = run(&o, err, sizeof err);
    train_batch_hook = NULL;
    hook_stop_at = -1;
    snprintf(log, sizeof log, "%s/log.jsonl", cut);
    int before = logged_evals(log, 2, &got);
    o.resume_dir = cut;
    int rc2 = rc == TRAIN_INTERRUPTED ? run(&o, err, sizeof err) : -1;
    int after = logged_evals(log, 2, &got);
    check(rc == TRAIN_INTERRUPTED && before == 0 && rc2 == 0 && after == 1 && got == want,
          "stopped in step 2 before its evaluation, resumed: the evaluation after step 2 is made first, as the "
          "uninterrupted run's (%.6f, %.6f; %d then %d lines) %s", got, want, before, after, rc2 ? err : "");
    /* the same stop, with the log already holding that evaluation: it is not made twice */
    o.resume_dir = NULL;
    o.out_dir = cut2;
    hook_stop_at = 2;
    train_batch_hook = stop_hook;
    rc = run(&o, err, sizeof err);
    train_batch_hook = NULL;
    hook_stop_at = -1;
    snprintf(log, sizeof log, "%s/log.jsonl", cut2);
    FILE *f = fopen(log, "a");
    if (f) fputs("{\"eval\": 2, \"loss\": 9.5, \"agreement\": 0, \"tokens\": 1}\n", f), fclose(f);
    o.resume_dir = cut2;
    rc2 = rc == TRAIN_INTERRUPTED ? run(&o, err, sizeof err) : -1;
    after = logged_evals(log, 2, &kept);
    check(rc2 == 0 && after == 1 && kept == 9.5,
          "resumed at step 2 with its evaluation in the log: not made again (%d lines) %s", after, rc2 ? err : "");
}

/* The ETA counts the evaluation passes to come: 10 batches with an evaluation of 100 records after
 * every one (each pass many times a step's work). At step 1 the ETA must be of the order of
 * the time the rest of the run then takes, not of the 9 training steps alone (a few ms). */
static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void test_eta(const char *tmp) {
    char edata[900], out[900], p[1200], err[1024] = "";
    snprintf(edata, sizeof edata, "%s/eta_data", tmp);
    mkdir(edata, 0777);
    snprintf(p, sizeof p, "%s/train.jsonl", edata);
    write_cycle_records(p, 4, 40, 7, 1, 23);
    snprintf(p, sizeof p, "%s/valid.jsonl", edata);
    write_cycle_records(p, 100, 200, 5, 3, 29);
    snprintf(out, sizeof out, "%s/eta", tmp);
    train_options o;
    small_run(&o, out);
    o.data_dir = edata;
    o.iters = 10;
    o.eval_every = 1;
    char text[1200];
    snprintf(text, sizeof text, "%s/eta_stdout", tmp);
    fflush(stdout);
    int saved = dup(STDOUT_FILENO);
    FILE *f = fopen(text, "w");
    if (f) dup2(fileno(f), STDOUT_FILENO), fclose(f);
    double t0 = seconds_now(), t1 = 0;
    int rc = train_run(&o, err, sizeof err);
    double t_end = seconds_now();
    fflush(stdout);
    dup2(saved, STDOUT_FILENO);
    close(saved);
    /* step 1's ETA, and when step 1 ended: the log's seconds up to then (eval before + step 1) */
    f = fopen(text, "r");
    char line[2048];
    int m = -1, sec = -1;
    double before = 0;
    while (f && fgets(line, sizeof line, f)) {
        const char *e = strstr(line, "ETA ");
        if (!strncmp(line, "step 1/10", 9) && e) sscanf(e + 4, "%dm%ds", &m, &sec);
        double s1;
        const char *paren = strrchr(line, '(');
        if (!strncmp(line, "eval before training", 20) && paren && sscanf(paren + 1, "%lf s)", &s1) == 1) before = s1;
    }
    if (f) fclose(f);
    t1 = t0 + before; /* step 1 itself is a few ms */
    double eta = m >= 0 ? m * 60.0 + sec : -1, rest = t_end - t1;
    check(rc == 0 && rest > 2 && eta >= 0.3 * rest - 0.5 && eta <= 3 * rest + 1,
          "ETA at step 1 counts the 9 evaluation passes to come: %.0f s, the rest of the run took %.1f s %s", eta, rest,
          rc ? err : "");
}

int main(int argc, char **argv) {
    if (argc > 1) fixtures = argv[1];
    char tmp[] = "/tmp/test_train_ckpt.XXXXXX";
    if (!mkdtemp(tmp)) return 1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    check_default_stop_signals();
    snprintf(model, sizeof model, "%s/gemma4_smoke", fixtures);
    snprintf(data, sizeof data, "%s/data", tmp);
    mkdir(data, 0777);
    char path[1200];
    snprintf(path, sizeof path, "%s/train.jsonl", data);
    write_cycle_records(path, 4, 40, 7, 1, 23);
    snprintf(path, sizeof path, "%s/valid.jsonl", data);
    write_text(path, "{\"tokens\": [2, 10, 17, 24, 31, 15, 22, 29, 13]}\n{\"tokens\": [2, 11, 18, 25, 32, 16, 23]}\n"
                     "{\"tokens\": [2, 12, 19, 26, 33]}\n{\"tokens\": [2, 13, 20, 27, 34, 18]}\n");
    test_schedules();
    test_clipping();
    test_save_every(tmp);
    test_resume(tmp);
    test_failed_write(tmp);
    test_tampered(tmp);
    test_mismatch(tmp);
    test_signals(tmp);
    test_out_dir(tmp);
    test_eval_options(tmp);
    test_owed_eval(tmp);
    test_eta(tmp);
    char cmd[1100];
    snprintf(cmd, sizeof cmd, "chmod -R u+w '%s'; rm -rf '%s'", tmp, tmp);
    if (system(cmd) != 0) fprintf(stderr, "note: could not remove %s\n", tmp);
    return check_summary();
}

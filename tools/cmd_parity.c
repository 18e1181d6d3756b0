/* cmd_parity.c — `winattn parity`: the gradient parity sweep. Every case runs the kernel under
 * test forward and backward on fresh random inputs and compares o, lse, dq, dk, dv with the
 * float64 oracle under FlashAttention's criterion (docs/design.md §4; src/ref/case.c):
 *   max|kernel - oracle| <= 2 * max|baseline - oracle| + atol
 * with the low-precision baseline computed from the same inputs: for f32 the float32 reference in
 * src/ref/oracle.c (wa_baseline, which shares no code with the library), for f16 and bf16 the
 * library's dense path (docs/algorithm.md section 5). A gradient that misses 2x but meets 3x
 * (FlashAttention-2's own gradient multiple) passes and is counted and named.
 *
 * The grid (build_cases) covers the write-up's axes: f32/f16/bf16; head dims 1 to 512 with odd
 * ones; GQA 1/2/4/8; Nq < Nk, =, >; lengths 1, 7, 113, 1000, 1023, 4224; windows 1 to 5000 and
 * unbounded, at tile-1/tile/tile+1 of both tile configurations; causal, non-causal, two-sided
 * and one-sided-unbounded windows; softcap; scale 1; both memory layouts; plus seeded random
 * cases; head dim 512 at lengths up to 2081; packed varlen batches; long accumulations (GQA 16
 * and 32, rows of 4,500 and 32,768 keys). --quick runs every 3rd case up to 1100 tokens. */
#define _GNU_SOURCE
#include "ref/case.h"
#include "tool.h"

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char parity_usage[] = "winattn parity [--quick] [--device cpu|cuda] [--json F] [--threads T] [--verbose] [--case I] [--group NAME] [--list] [--deterministic]";
static const char parity_help[] =
    "usage: winattn parity [--quick] [--device cpu|cuda] [--json F] [--threads T] [--verbose]\n"
    "                      [--case I] [--group NAME] [--list] [--deterministic]\n"
    "\n"
    "The gradient parity sweep: every case runs forward and backward and compares o, lse, dq, dk, dv\n"
    "with a float64 oracle under FlashAttention's criterion. Ends \"N passed, N failed\".\n"
    "\n"
    "  --quick             every third case up to 1100 tokens\n"
    "  --device cpu|cuda   the kernels under test (default cpu)\n"
    "  --deterministic     on cuda: the deterministic backward\n"
    "  --json F            also write the results to F as JSON\n"
    "  --threads T         worker threads (default 0: all)\n"
    "  --verbose           one line per case\n"
    "  --case I            only case I (as --list numbers them), verbose\n"
    "  --group NAME        only the cases of one group\n"
    "  --list              list the cases (and their groups) without running them\n"
    "  -h, --help          this help\n";

/* The two tile configurations every case may run under: the default, and a non-square one whose
 * key tile is not a power of two. */
static const int tile_configs[2][2] = {{64, 64}, {32, 96}};

typedef struct pcase {
    wa_case c;
    int cfg;
    int group; /* which part of the grid, for the summary */
} pcase;

typedef struct case_list {
    pcase *v;
    int n, cap;
} case_list;

static const char *const group_names[] = {"window sweep", "head dims", "GQA", "Nq != Nk", "long (4224)", "softcap",
                                          "scale 1", "random", "head dim 512", "varlen", "accumulation"};
enum { n_groups = sizeof group_names / sizeof *group_names };

static void add(case_list *l, int group, int cfg, wa_dtype dt, int64_t Hq, int64_t Hkv, int64_t Nq, int64_t Nk,
                int64_t D, int64_t left, int64_t right, float scale, float cap) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 1024;
        l->v = realloc(l->v, (size_t)l->cap * sizeof *l->v);
        if (!l->v) die("out of memory building the case list");
    }
    pcase *p = &l->v[l->n];
    memset(p, 0, sizeof *p);
    p->c = (wa_case){1, Hq, Hkv, Nq, Nk, D, dt, l->n % 2, left, right, scale, cap, (uint64_t)l->n + 1, WA_DEVICE_CPU, 0, NULL, NULL};
    p->cfg = cfg, p->group = group;
    l->n++;
}

/* a sliding window of W keys including self, in (left, right) form */
#define SLIDE(W) ((W) - 1), 0

static void build_cases(case_list *l) {
    static const wa_dtype dts[3] = {WA_F32, WA_F16, WA_BF16};
    /* A: window sweep at and around both tile sizes, far below and above the length */
    static const int64_t lengths_a[] = {1, 7, 113, 1000, 1023};
    for (int cfg = 0; cfg < 2; cfg++) {
        int64_t T = tile_configs[cfg][1];
        int64_t windows[9][2] = {{SLIDE(1)}, {SLIDE(7)}, {SLIDE(T - 1)}, {SLIDE(T)}, {SLIDE(T + 1)},
                                 {SLIDE(1000)}, {SLIDE(5000)}, {-1, 0}, {-1, -1}};
        for (int d = 0; d < 3; d++)
            for (size_t n = 0; n < sizeof lengths_a / sizeof *lengths_a; n++)
                for (int w = 0; w < 9; w++)
                    add(l, 0, cfg, dts[d], 4, 2, lengths_a[n], lengths_a[n], 64, windows[w][0], windows[w][1], 0, 0);
    }
    /* B: head dims, odd ones included */
    static const int64_t dims[] = {1, 72, 80, 96, 128, 200, 256, 512};
    static const int64_t windows_b[3][2] = {{SLIDE(100)}, {-1, 0}, {40, 25}};
    for (size_t k = 0; k < sizeof dims / sizeof *dims; k++)
        for (int d = 0; d < 3; d++)
            for (int w = 0; w < 3; w++)
                add(l, 1, (int)(k + w) % 2, dts[d], 2, 1, 300, 300, dims[k], windows_b[w][0], windows_b[w][1], 0, 0);
    /* C: GQA ratios */
    static const int64_t windows_c[4][2] = {{SLIDE(65)}, {-1, 0}, {-1, -1}, {20, 20}};
    for (int r = 1; r <= 8; r *= 2)
        for (int d = 0; d < 3; d++)
            for (int w = 0; w < 4; w++)
                for (int cfg = 0; cfg < 2; cfg++)
                    add(l, 2, cfg, dts[d], 2 * r, 2, 257, 257, 64, windows_c[w][0], windows_c[w][1], 0, 0);
    /* D: queries shorter and longer than keys (bottom-right alignment, empty rows, unseen keys) */
    static const int64_t pairs[][2] = {{1, 7}, {7, 1}, {7, 113}, {113, 1000}, {1000, 113},
                                       {1, 1023}, {1023, 1}, {130, 1023}, {1023, 130}, {1000, 1023}};
    static const int64_t windows_d[8][2] = {{SLIDE(1)}, {SLIDE(7)}, {SLIDE(64)}, {-1, 0}, {-1, -1}, {30, 10}, {-1, 5}, {20, -1}};
    for (size_t p = 0; p < sizeof pairs / sizeof *pairs; p++)
        for (int w = 0; w < 8; w++)
            for (int d = 0; d < 3; d++)
                add(l, 3, (int)(p + w + d) % 2, dts[d], 4, 2, pairs[p][0], pairs[p][1], 80, windows_d[w][0], windows_d[w][1], 0, 0);
    /* E: long sequences, window far below the length */
    static const int64_t windows_e[6][2] = {{SLIDE(1024)}, {SLIDE(5000)}, {SLIDE(64)}, {SLIDE(97)}, {-1, 0}, {100, 100}};
    for (int w = 0; w < 6; w++)
        for (int d = 0; d < 3; d++)
            for (int k = 0; k < 2; k++)
                add(l, 4, (w + d + k) % 2, dts[d], 2, 1, 4224, 4224, k ? 128 : 64, windows_e[w][0], windows_e[w][1], 0, 0);
    for (int d = 0; d < 3; d++) {
        add(l, 4, d % 2, dts[d], 2, 1, 4224, 1000, 64, SLIDE(1024), 0, 0);
        add(l, 4, (d + 1) % 2, dts[d], 2, 1, 1000, 4224, 64, SLIDE(1024), 0, 0);
        add(l, 4, d % 2, dts[d], 2, 1, 4224, 1000, 64, -1, 0, 0, 0);
        add(l, 4, (d + 1) % 2, dts[d], 2, 1, 1000, 4224, 64, -1, 0, 0, 0);
    }
    /* F: softcap */
    static const float caps[2] = {30.0f, 5.0f};
    for (int c = 0; c < 2; c++)
        for (int d = 0; d < 3; d++)
            for (int k = 0; k < 2; k++) {
                add(l, 5, k, dts[d], 2, 1, 200, 200, k ? 256 : 64, SLIDE(100), 0, caps[c]);
                add(l, 5, 1 - k, dts[d], 2, 1, 200, 200, k ? 256 : 64, -1, 0, 0, caps[c]);
            }
    /* G: scale 1 (Gemma 4 uses q/k norms instead of 1/sqrt(D)) */
    for (int d = 0; d < 3; d++)
        for (int k = 0; k < 2; k++) {
            add(l, 6, k, dts[d], 2, 1, 150, 150, k ? 256 : 128, SLIDE(33), 1.0f, 0);
            add(l, 6, 1 - k, dts[d], 2, 1, 150, 150, k ? 256 : 128, -1, 0, 1.0f, 0);
        }
    /* H: seeded random draws over every axis */
    uint64_t s = 0x5eed;
    for (int i = 0; i < 200; i++) {
#define DRAW(n) ((int64_t)((s = s * 6364136223846793005ull + 1442695040888963407ull) >> 33) % (n))
        int64_t ratio = (int64_t)1 << DRAW(4), Hkv = 1 + DRAW(2), Nq = 1 + DRAW(600), Nk = DRAW(4) ? Nq : 1 + DRAW(600);
        int64_t D = DRAW(3) ? 8 * (1 + DRAW(64)) : 1 + DRAW(512);
        int64_t left = DRAW(4) ? DRAW(300) : -1, right = DRAW(3) ? 0 : DRAW(4) ? DRAW(50) : -1;
        float cap = DRAW(5) ? 0.0f : 20.0f;
        int cfg = (int)DRAW(2);
        wa_dtype dt = dts[DRAW(3)];
        add(l, 7, cfg, dt, ratio * Hkv, Hkv, Nq, Nk, D, left, right, 0, cap);
#undef DRAW
    }
    /* I: head dim 512 (Gemma 4's global layers), where the CUDA kernels split D: lengths far past
     * their 32-row tiles and the windows, GQA 8, bottom-right alignment both ways, a one-key
     * window (exact zero gradients), softcap, scale 1. Appended, so earlier case numbers hold. */
    for (int d = 0; d < 3; d++) {
        add(l, 8, d % 2, dts[d], 2, 1, 2081, 2081, 512, SLIDE(1024), 0, 0);
        add(l, 8, (d + 1) % 2, dts[d], 8, 1, 1100, 1100, 512, -1, 0, 0, 0);
        add(l, 8, d % 2, dts[d], 2, 1, 700, 2081, 512, SLIDE(1024), 0, 0);
        add(l, 8, (d + 1) % 2, dts[d], 2, 1, 2081, 700, 512, -1, 0, 0, 0);
        add(l, 8, d % 2, dts[d], 2, 2, 1500, 1500, 512, 100, 100, 0, 0);
        add(l, 8, (d + 1) % 2, dts[d], 2, 1, 1100, 1100, 512, SLIDE(1), 0, 0);
        add(l, 8, d % 2, dts[d], 2, 1, 1037, 1037, 512, SLIDE(500), 0, 30.0f);
        add(l, 8, (d + 1) % 2, dts[d], 4, 2, 1000, 1000, 512, -1, -1, 1.0f, 0);
    }
}

/* The last case added, made a packed batch of these lengths (one allocation holding both arrays,
 * freed with the list). */
static void make_varlen(case_list *l, int nseq, const int32_t *seq_q, const int32_t *seq_k) {
    int32_t *lens = xmalloc(2 * (size_t)(nseq > 0 ? nseq : 1) * sizeof *lens, "varlen lengths");
    memcpy(lens, seq_q, (size_t)nseq * sizeof *lens);
    memcpy(lens + nseq, seq_k, (size_t)nseq * sizeof *lens);
    wa_case_varlen(&l->v[l->n - 1].c, nseq, lens, lens + nseq);
}

static void add_varlen(case_list *l, int cfg, wa_dtype dt, int64_t Hq, int64_t Hkv, int64_t D, int64_t left,
                       int64_t right, float scale, float cap, int nseq, const int32_t *seq_q, const int32_t *seq_k) {
    add(l, 9, cfg, dt, Hq, Hkv, 0, 0, D, left, right, scale, cap);
    make_varlen(l, nseq, seq_q, seq_k ? seq_k : seq_q);
}

/* J: packed variable-length batches, each sequence checked against its own float64 oracle: empty
 * sequences and single tokens among long ones, Nq_b != Nk_b both ways, windows shorter than some
 * sequences and longer than others, B = 1 and B = 1000, head dims 1 to 512, GQA 8, softcap, scale
 * 1, then seeded random mixes. Appended, so earlier case numbers hold. */
static void build_varlen_cases(case_list *l) {
    static const wa_dtype dts[3] = {WA_F32, WA_F16, WA_BF16};
    static const int32_t mix[] = {0, 37, 1, 0, 513, 200, 64, 65};
    static const int32_t corpus[] = {1500, 700, 300, 90};      /* the corpus's profile, scaled down */
    static const int32_t uneven_q[] = {5, 100, 0, 64, 300, 1}, uneven_k[] = {40, 100, 7, 1, 129, 0};
    static const int32_t one[] = {1000};
    static const int32_t dims_mix[] = {300, 0, 129, 64, 1};
    for (int d = 0; d < 3; d++) {
        add_varlen(l, d % 2, dts[d], 4, 2, 64, SLIDE(100), 0, 0, 8, mix, NULL);
        add_varlen(l, (d + 1) % 2, dts[d], 4, 2, 64, -1, 0, 0, 0, 8, mix, NULL);
        add_varlen(l, d % 2, dts[d], 4, 2, 128, SLIDE(129), 0, 0, 4, corpus, NULL);
        add_varlen(l, (d + 1) % 2, dts[d], 2, 1, 80, -1, 0, 0, 0, 6, uneven_q, uneven_k);
        add_varlen(l, d % 2, dts[d], 2, 1, 80, 30, 10, 0, 0, 6, uneven_q, uneven_k);
        add_varlen(l, (d + 1) % 2, dts[d], 2, 1, 80, SLIDE(7), 0, 0, 6, uneven_k, uneven_q);
        add_varlen(l, d % 2, dts[d], 2, 2, 64, SLIDE(64), 0, 0, 1, one, NULL);
        add_varlen(l, (d + 1) % 2, dts[d], 8, 1, 64, SLIDE(5000), 0, 0, 8, mix, NULL);
        add_varlen(l, d % 2, dts[d], 4, 2, 64, -1, -1, 0, 0, 8, mix, NULL);
        add_varlen(l, (d + 1) % 2, dts[d], 2, 1, 256, SLIDE(100), 0, 20.0f, 8, mix, NULL);
        add_varlen(l, d % 2, dts[d], 2, 1, 128, SLIDE(33), 1.0f, 0, 4, corpus, NULL);
        static const int64_t dims[] = {1, 72, 200, 512};
        for (int k = 0; k < 4; k++)
            add_varlen(l, (d + k) % 2, dts[d], 2, 1, dims[k], k % 2 ? -1 : SLIDE(100), 0, 0, 5, dims_mix, NULL);
        add_varlen(l, d % 2, dts[d], 8, 1, 512, -1, 0, 0, 0, 4, corpus, NULL);
    }
    /* B = 1000 short sequences (lengths 0 to 12) */
    int32_t many[1000];
    uint64_t s = 0xba7c4;
#define DRAW(n) ((int32_t)(((s = s * 6364136223846793005ull + 1442695040888963407ull) >> 33) % (uint64_t)(n)))
    for (int b = 0; b < 1000; b++) many[b] = DRAW(13);
    for (int d = 0; d < 3; d++) add_varlen(l, d % 2, dts[d], 2, 1, 32, SLIDE(5), 0, 0, 1000, many, NULL);
    /* seeded random mixes over every axis */
    for (int i = 0; i < 40; i++) {
        int32_t lq[12], lk[12];
        int nseq = 1 + DRAW(12), same = DRAW(3) > 0;
        for (int b = 0; b < nseq; b++) {
            lq[b] = DRAW(5) ? DRAW(400) : DRAW(3);
            lk[b] = same ? lq[b] : DRAW(5) ? DRAW(400) : DRAW(3);
        }
        int64_t ratio = (int64_t)1 << DRAW(4), Hkv = 1 + DRAW(2);
        int64_t D = DRAW(3) ? 8 * (1 + DRAW(64)) : 1 + DRAW(512);
        int64_t left = DRAW(4) ? DRAW(300) : -1, right = DRAW(3) ? 0 : DRAW(4) ? DRAW(50) : -1;
        int cfg = DRAW(2);
        wa_dtype dt = dts[DRAW(3)];
        float cap = DRAW(5) ? 0.0f : 20.0f;
        add_varlen(l, cfg, dt, ratio * Hkv, Hkv, D, left, right, 0, cap, nseq, lq, lk);
    }
#undef DRAW
}

/* K: long accumulations, where the f32 sums of the kernels lost to a framework's blocked ones (the
 * GQA group's dK and dV summed head after head, o and dQ over thousands of keys): groups of 16 and
 * 32 query heads on one KV head, rows of 4,500 and 32,768 visible keys, dK and dV over 4 x 32,768
 * query rows, softcap 2 and a small scale on long flat rows. Appended, so earlier case numbers
 * hold. */
static void build_accumulation_cases(case_list *l) {
    static const wa_dtype dts[3] = {WA_F32, WA_F16, WA_BF16};
    for (int d = 0; d < 3; d++) {
        add(l, 10, d % 2, dts[d], 16, 1, 513, 513, 256, 499, 0, 0, 0);                /* the GQA case */
        add(l, 10, (d + 1) % 2, dts[d], 32, 1, 1100, 1100, 64, SLIDE(1024), 0, 0);  /* GQA 32 */
        add(l, 10, d % 2, dts[d], 32, 2, 300, 300, 128, -1, 0, 0, 0);                  /* GQA 16, causal */
        add(l, 10, (d + 1) % 2, dts[d], 4, 4, 2000, 2000, 64, SLIDE(1000), 0, 2.0f); /* the forward */
        add(l, 10, d % 2, dts[d], 4, 4, 2000, 2000, 64, SLIDE(1000), 0, 0);
        add(l, 10, (d + 1) % 2, dts[d], 2, 1, 4500, 4500, 32, -1, 0, 0, 0);            /* long unbounded causal rows */
        add(l, 10, d % 2, dts[d], 2, 1, 4500, 4500, 32, -1, 0, 0, 2.0f);               /* ... softcap 2 */
        add(l, 10, (d + 1) % 2, dts[d], 2, 1, 4500, 4500, 32, -1, 0, 0.02f, 0);        /* ... nearly uniform rows */
        add(l, 10, d % 2, dts[d], 2, 2, 4500, 4500, 16, -1, -1, 0, 0);                 /* full rows */
        add(l, 10, (d + 1) % 2, dts[d], 2, 1, 64, 32768, 32, -1, -1, 0, 0);            /* rows of 32K keys */
        add(l, 10, d % 2, dts[d], 4, 1, 32768, 64, 16, -1, -1, 0, 0);                  /* dK, dV over 4 x 32K rows */
    }
}

typedef struct parity_run {
    const pcase *cases;
    const int *todo;
    int n_todo;
    wa_case_result *results;
    wa_device device;
    _Atomic int next, done;
    int progress;
    int deterministic; /* CUDA kernels under test with wa_context_params.cuda_deterministic */
} parity_run;

static void *worker(void *arg) {
    parity_run *run = arg;
    wa_context *kernel[2], *baseline;
    wa_context_params bp = {0};
    bp.threads = 1, bp.algorithm = WA_ALGO_DENSE;
    if (wa_context_create(&bp, &baseline) != WA_OK) die("%s", wa_last_error());
    for (int c = 0; c < 2; c++) {
        wa_context_params kp = {0};
        kp.threads = 1, kp.tile_q = tile_configs[c][0], kp.tile_k = tile_configs[c][1];
        kp.cuda_deterministic = run->deterministic;
        if (wa_context_create(&kp, &kernel[c]) != WA_OK) die("%s", wa_last_error());
    }
    for (;;) {
        int i = atomic_fetch_add(&run->next, 1);
        if (i >= run->n_todo) break;
        const pcase *pc = &run->cases[run->todo[i]];
        wa_case c = pc->c;
        c.device = run->device;
        wa_run_case(&c, kernel[pc->cfg], baseline, 3.0, &run->results[i]);
        int done = atomic_fetch_add(&run->done, 1) + 1;
        if (run->progress && done % 50 == 0) fprintf(stderr, "\rparity: %d / %d cases", done, run->n_todo);
    }
    wa_context_destroy(kernel[0]), wa_context_destroy(kernel[1]), wa_context_destroy(baseline);
    return NULL;
}

static void line(int index, const pcase *pc, const wa_case_result *r, char *buf, size_t n) {
    char name[200];
    wa_case_name(&pc->c, name, sizeof name);
    snprintf(buf, n, "%s #%d %s tiles=%dx%d o=%.2g/%.2g lse=%.2g/%.2g dq=%.2g/%.2g dk=%.2g/%.2g dv=%.2g/%.2g%s%s%s",
             r->pass ? "PASS" : "FAIL", index, name, tile_configs[pc->cfg][0], tile_configs[pc->cfg][1], r->err[0], r->bound[0],
             r->err[1], r->bound[1], r->err[2], r->bound[2], r->err[3], r->bound[3], r->err[4], r->bound[4],
             r->used_grad_mult ? " [gradient bound 3x]" : "", r->detail[0] ? " : " : "", r->detail);
}

int cmd_parity(int argc, char **argv) {
    int quick = 0, verbose = 0, list = 0, deterministic = 0;
    int64_t threads = 0, only = -1;
    int group = -1; /* --group: only this part of the grid */
    const char *json_path = NULL, *v;
    wa_device device = WA_DEVICE_CPU;
    for (int i = 1; i < argc; i++) {
        if (is_help(argv[i])) show_help(parity_help);
        if (strcmp(argv[i], "--quick") == 0) quick = 1;
        else if (strcmp(argv[i], "--verbose") == 0) verbose = 1;
        else if (strcmp(argv[i], "--list") == 0) list = 1;
        else if (strcmp(argv[i], "--deterministic") == 0) deterministic = 1;
        else if ((v = flag_value(argc, argv, &i, "--json", parity_usage))) json_path = v;
        else if ((v = flag_value(argc, argv, &i, "--group", parity_usage))) {
            for (group = 0; group < n_groups && strcmp(group_names[group], v) != 0; group++) {}
            if (group == n_groups) usage_error(parity_usage, "--group '%s': not a group name (see --list)", v);
        }
        else if ((v = flag_value(argc, argv, &i, "--case", parity_usage))) {
            if (parse_i64(v, 0, 1 << 20, &only)) usage_error(parity_usage, "--case '%s': need a case number", v);
            verbose = 1;
        }
        else if ((v = flag_value(argc, argv, &i, "--threads", parity_usage))) {
            if (parse_i64(v, 0, 1024, &threads)) usage_error(parity_usage, "--threads '%s': need 0 (all) to 1024", v);
        } else if ((v = flag_value(argc, argv, &i, "--device", parity_usage))) {
            if (strcmp(v, "cpu") == 0) device = WA_DEVICE_CPU;
            else if (strcmp(v, "cuda") == 0) device = WA_DEVICE_CUDA;
            else usage_error(parity_usage, "--device '%s': must be cpu or cuda", v);
        } else unknown_option(argv[i]);
    }
    if (device == WA_DEVICE_CUDA && !wa_device_available(WA_DEVICE_CUDA))
        die("--device cuda: this build has no usable CUDA device");

    case_list l = {0};
    build_cases(&l);
    build_varlen_cases(&l);
    build_accumulation_cases(&l);
    int *todo = xmalloc((size_t)l.n * sizeof *todo, "the case list");
    int n_todo = 0;
    for (int i = 0; i < l.n; i++) {
        const wa_case *c = &l.v[i].c;
        if (only >= 0 && i != only) continue;
        if (group >= 0 && l.v[i].group != group) continue;
        if (quick && (i % 3 != 0 || c->Nq > 1100 || c->Nk > 1100)) continue;
        todo[n_todo++] = i;
    }
    if (list) { /* the grid, one case per line, without running anything */
        for (int i = 0; i < n_todo; i++) {
            char name[200];
            wa_case_name(&l.v[todo[i]].c, name, sizeof name);
            printf("#%d %s %s tiles=%dx%d\n", todo[i], group_names[l.v[todo[i]].group], name,
                   tile_configs[l.v[todo[i]].cfg][0], tile_configs[l.v[todo[i]].cfg][1]);
        }
        return 0;
    }
    if (threads == 0) threads = sysconf(_SC_NPROCESSORS_ONLN) > 0 ? sysconf(_SC_NPROCESSORS_ONLN) : 1;
    printf("parity: %d cases%s (grid of %d), kernels under test: %s%s, %lld worker threads\n", n_todo,
           quick ? " (--quick)" : "", l.n, device == WA_DEVICE_CUDA ? "CUDA" : wa_cpu_kernels(),
           deterministic ? " (deterministic backward)" : "", (long long)threads);
    fflush(stdout);

    parity_run run = {l.v, todo, n_todo, xmalloc((size_t)n_todo * sizeof(wa_case_result), "results"), device, 0, 0,
                      isatty(2), deterministic};
    double t0 = now_seconds();
    pthread_t *tids = xmalloc((size_t)threads * sizeof *tids, "threads");
    for (int64_t t = 0; t < threads; t++)
        if (pthread_create(&tids[t], NULL, worker, &run) != 0) die("cannot start worker thread %lld", (long long)t);
    for (int64_t t = 0; t < threads; t++) pthread_join(tids[t], NULL);
    if (run.progress) fprintf(stderr, "\r%40s\r", "");

    int passed = 0, failed = 0, used3 = 0, per_group_fail[n_groups] = {0}, per_group[n_groups] = {0};
    json_t *jcases = json_array();
    char buf[1024];
    for (int i = 0; i < n_todo; i++) {
        const pcase *pc = &l.v[todo[i]];
        const wa_case_result *r = &run.results[i];
        per_group[pc->group]++;
        if (r->pass) passed++;
        else failed++, per_group_fail[pc->group]++;
        used3 += r->pass && r->used_grad_mult;
        line(todo[i], pc, r, buf, sizeof buf);
        if (!r->pass || verbose || r->used_grad_mult) printf("%s\n", buf);
        if (json_path) {
            json_t *jc = json_object(), *je = json_object();
            char name[200];
            wa_case_name(&pc->c, name, sizeof name);
            json_object_set_new(jc, "case", json_string(name));
            json_object_set_new(jc, "group", json_string(group_names[pc->group]));
            json_object_set_new(jc, "tiles", json_pack("[i,i]", tile_configs[pc->cfg][0], tile_configs[pc->cfg][1]));
            json_object_set_new(jc, "pass", json_boolean(r->pass));
            for (int t = 0; t < WA_N_OUT; t++)
                json_object_set_new(je, wa_out_names[t], json_pack("{s:f,s:f,s:f,s:f}", "err", r->err[t], "baseline_err",
                                                                   r->base_err[t], "atol", r->atol[t], "bound", r->bound[t]));
            json_object_set_new(jc, "errors", je);
            json_object_set_new(jc, "gradient_bound_3x", json_boolean(r->used_grad_mult));
            if (r->detail[0]) json_object_set_new(jc, "detail", json_string(r->detail));
            json_array_append_new(jcases, jc);
        }
    }
    double secs = now_seconds() - t0, kern_s = 0, base_s = 0, oracle_s = 0;
    for (int i = 0; i < n_todo; i++)
        kern_s += run.results[i].fwd_seconds + run.results[i].bwd_seconds, base_s += run.results[i].base_seconds,
            oracle_s += run.results[i].oracle_seconds;
    for (int g = 0; g < n_groups; g++)
        if (per_group[g]) printf("  %-14s %4d cases, %d failed\n", group_names[g], per_group[g], per_group_fail[g]);
    printf("criterion: max|kernel-oracle| <= 2*max|baseline-oracle| + atol (FlashAttention's; baseline: f32 src/ref's float32 "
           "reference, f16/bf16 the dense path); %d passing case(s) "
           "needed 3x on a gradient (FlashAttention-2's gradient multiple; docs/design.md §4)\n", used3);
    printf("time: %.1f s (summed over cases: kernels %.1f s, baselines %.1f s, oracle %.1f s)\n", secs, kern_s, base_s,
           oracle_s);
    if (json_path) {
        json_t *root = json_pack("{s:s,s:b,s:i,s:i,s:i,s:f,s:o}", "cpu_kernels", wa_cpu_kernels(), "quick", quick, "passed",
                                 passed, "failed", failed, "gradient_bound_3x", used3, "seconds", secs, "cases", jcases);
        char *text = json_dumps(root, JSON_INDENT(1));
        if (!text) die("cannot format the JSON report");
        write_file_atomic(json_path, text);
        free(text);
        json_decref(root);
    } else {
        json_decref(jcases);
    }
    printf("%d passed, %d failed\n", passed, failed);
    for (int i = 0; i < l.n; i++)
        if (l.v[i].c.nseq > 0) free((void *)l.v[i].c.seq_q);
    free(todo), free(run.results), free(tids), free(l.v);
    return failed ? 1 : 0;
}

/* cmd_bench.c — `winattn bench`: time winattn's forward and backward on one shape and a list of
 * lengths; TFLOP/s counted on visible (query, key) pairs (docs/design.md §5: forward
 * 4*D*pairs per query head, backward 2.5x that). Each figure is the median of --reps timed runs
 * after one warm-up, per call: a run makes --calls calls back to back and synchronises once (more
 * than one: the steady state of a training step, where the host runs ahead of the GPU and a
 * sustained load sets the GPU's clock; one, the default: a call from an idle GPU). Memory is the
 * process's peak RSS growth during the runs (VmHWM, in-process; `winattn probe` gives the isolated
 * per-child measurement). bench/cpu_peers.py runs this beside the peers. */
#define _GNU_SOURCE
#include "tile_geometry.h"
#include "tool.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char bench_usage[] =
    "winattn bench [--n N[,N...]] [--dtype f32|f16|bf16] [--b B] [--hq H] [--hkv H] [--d D] "
    "[--sliding-window W | --causal | --full | --window-left L --window-right R] [--scale S] [--threads T] "
    "[--tile-q Q] [--tile-k K] [--reps R] [--calls C] [--algo tiled|dense] [--device cpu|cuda] [--forward-only] [--deterministic] [--json F] "
    "[--varlen L[,L...]]";
static const char bench_help[] =
    "usage: winattn bench [options]\n"
    "\n"
    "Times winattn's forward and backward on one shape at each length: the median of --reps runs\n"
    "after a warm-up, TFLOP/s counted on the visible (query, key) pairs, and the peak RSS growth.\n"
    "\n"
    "  --n N[,N...]         sequence lengths (default 8192)\n"
    "  --dtype f32|f16|bf16 (default bf16)\n"
    "  --b B --hq H --hkv H --d D\n"
    "                       batch, query heads, key/value heads, head dim (default 1, 32, 16, 256)\n"
    "  --sliding-window W   W keys including the query (default 1024); or --causal, --full, or\n"
    "  --window-left L --window-right R\n"
    "  --scale S            score scale (default 1/sqrt(D))\n"
    "  --threads T          CPU threads (default 0: all)\n"
    "  --tile-q Q --tile-k K  CPU tile sizes (default: the library's)\n"
    "  --reps R             timed runs per figure (default 3)\n"
    "  --calls C            calls back to back per timed run, one synchronisation (default 1)\n"
    "  --algo tiled|dense   winattn's kernels (default) or the dense baseline\n"
    "  --device cpu|cuda    where to run (default cpu)\n"
    "  --forward-only       time the forward only\n"
    "  --deterministic      on cuda: the deterministic backward\n"
    "  --varlen L[,L...]    one packed batch of these lengths against one call per sequence and the\n"
    "                       padded batch (sets the batch; no --b)\n"
    "  --json F             also write the results to F as JSON\n"
    "  -h, --help           this help\n";

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* "a,b,c" into up to max lengths in [lo, hi]; dies naming the flag otherwise */
static int64_t parse_lengths(const char *flag, const char *v, int64_t lo, int64_t hi, int64_t *out, int64_t max) {
    char *copy = strdup(v), *save = NULL;
    int64_t n = 0;
    if (!copy) die("out of memory");
    for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == max || parse_i64(t, lo, hi, &out[n]))
            usage_error(bench_usage, "%s '%s': up to %lld comma-separated lengths, each %lld to %lld", flag, v,
                        (long long)max, (long long)lo, (long long)hi);
        n++;
    }
    free(copy);
    if (!n) usage_error(bench_usage, "%s needs at least one length", flag);
    return n;
}

/* ---- --varlen: one packed batch against the same sequences one call each and the padded batch ---- */

typedef struct varlen_bench {
    wa_context *ctx;
    wa_device dev;
    wa_dtype dt;
    const wa_attn_desc *desc;
    int64_t B, Hq, Hkv, D, Tq, longest;
    const int64_t *lens;
    int32_t *cu_host;
    void *cu;            /* offsets where the tensors live */
    wa_tensor t[9];      /* packed q k v do o lse dq dk dv */
    wa_tensor pad[9];    /* the padded [B, H, longest, D] batch */
} varlen_bench;

enum { ARM_VARLEN, ARM_PER_SEQUENCE, ARM_PADDED, N_ARMS };
static const char *const arm_names[N_ARMS] = {"varlen, one call", "one call per sequence", "padded batch"};

static wa_tensor seq_view(const wa_tensor *t, int64_t start, int64_t len) {
    wa_tensor s = *t;
    s.data = (char *)t->data + start * t->stride[2] * (int64_t)wa_dtype_size(t->dtype);
    s.shape[2] = len;
    return s;
}

/* `calls` calls of one arm back to back, then one synchronisation */
static void run_arm(varlen_bench *vb, int arm, int backward, int64_t calls) {
    wa_status st = WA_OK;
    wa_tensor *t = arm == ARM_PADDED ? vb->pad : vb->t;
    for (int64_t c = 0; c < calls && st == WA_OK; c++) {
        if (arm == ARM_PER_SEQUENCE) {
            for (int64_t b = 0, q0 = 0; b < vb->B && st == WA_OK; q0 += vb->lens[b], b++) {
                wa_tensor s[9];
                for (int i = 0; i < 9; i++) s[i] = seq_view(&t[i], q0, vb->lens[b]);
                st = backward ? wa_backward(vb->ctx, vb->desc, &s[0], &s[1], &s[2], &s[4], &s[5], &s[3], &s[6], &s[7], &s[8])
                              : wa_forward(vb->ctx, vb->desc, &s[0], &s[1], &s[2], &s[4], &s[5]);
            }
        } else if (arm == ARM_VARLEN) {
            wa_varlen seqs = {vb->B, vb->cu, vb->cu, vb->longest, vb->longest};
            st = backward ? wa_backward_varlen(vb->ctx, vb->desc, &seqs, &t[0], &t[1], &t[2], &t[4], &t[5], &t[3], &t[6],
                                               &t[7], &t[8])
                          : wa_forward_varlen(vb->ctx, vb->desc, &seqs, &t[0], &t[1], &t[2], &t[4], &t[5]);
        } else {
            st = backward ? wa_backward(vb->ctx, vb->desc, &t[0], &t[1], &t[2], &t[4], &t[5], &t[3], &t[6], &t[7], &t[8])
                          : wa_forward(vb->ctx, vb->desc, &t[0], &t[1], &t[2], &t[4], &t[5]);
        }
    }
    if (st == WA_OK) st = wa_synchronize(vb->ctx);
    if (st != WA_OK) die("%s %s: %s", arm_names[arm], backward ? "backward" : "forward", wa_last_error());
}

/* nine tensors (q k v do o lse dq dk dv) in fresh memory: packed [T, H, D] when packed, else
 * [B, H, N, D]; q, k, v, do filled */
static void make_tensors(varlen_bench *vb, wa_tensor *t, int packed, int64_t Bt, int64_t N, void **bufs) {
    size_t es = wa_dtype_size(vb->dt);
    const int64_t heads[9] = {vb->Hq, vb->Hkv, vb->Hkv, vb->Hq, vb->Hq, vb->Hq, vb->Hq, vb->Hkv, vb->Hkv};
    for (int i = 0; i < 9; i++) {
        size_t n = (size_t)(Bt * heads[i] * N * (i == 5 ? 1 : vb->D)), bytes = n * (i == 5 ? 4 : es);
        if (wa_malloc(vb->ctx, vb->dev, bytes, &bufs[i]) != WA_OK) die("%s", wa_last_error());
        if (i < 4) {
            void *h = vb->dev == WA_DEVICE_CPU ? bufs[i] : xmalloc(bytes, "staging");
            fill_uniform(h, vb->dt, n, (uint64_t)i + 1);
            if (h != bufs[i]) {
                if (wa_memcpy(vb->ctx, bufs[i], vb->dev, h, WA_DEVICE_CPU, bytes) != WA_OK) die("%s", wa_last_error());
                free(h);
            }
        }
        if (i == 5) t[i] = packed ? wa_tensor_lse_varlen(bufs[i], heads[i], N) : wa_tensor_lse(bufs[i], Bt, heads[i], N);
        else t[i] = packed ? wa_tensor_thd(bufs[i], vb->dt, N, heads[i], vb->D) : wa_tensor_bhnd(bufs[i], vb->dt, Bt, heads[i], N, vb->D);
        t[i].device = vb->dev;
    }
}

static void bench_varlen(wa_context *ctx, wa_device dev, wa_dtype dt, const wa_attn_desc *desc, const int64_t *lens,
                         int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t reps, int64_t calls, int forward_only, json_t *rows) {
    varlen_bench vb = {ctx, dev, dt, desc, B, Hq, Hkv, D, 0, 0, lens, NULL, NULL, {{0}}, {{0}}};
    vb.cu_host = xmalloc((size_t)(B + 1) * sizeof *vb.cu_host, "offsets");
    vb.cu_host[0] = 0;
    double pairs = 0, padded_pairs = 0;
    for (int64_t b = 0; b < B; b++) {
        vb.cu_host[b + 1] = vb.cu_host[b] + (int32_t)lens[b];
        vb.longest = lens[b] > vb.longest ? lens[b] : vb.longest;
        wa_window w = {lens[b], lens[b], desc->window_left, desc->window_right};
        pairs += (double)wa_visible_pairs(&w);
    }
    vb.Tq = vb.cu_host[B];
    wa_window wp = {vb.longest, vb.longest, desc->window_left, desc->window_right};
    padded_pairs = (double)B * (double)wa_visible_pairs(&wp);
    if (dev == WA_DEVICE_CPU) vb.cu = vb.cu_host;
    else if (wa_malloc(ctx, dev, (size_t)(B + 1) * 4, &vb.cu) != WA_OK ||
             wa_memcpy(ctx, vb.cu, dev, vb.cu_host, WA_DEVICE_CPU, (size_t)(B + 1) * 4) != WA_OK)
        die("%s", wa_last_error());
    void *bufs[9], *pad_bufs[9];
    make_tensors(&vb, vb.t, 1, 1, vb.Tq, bufs);
    make_tensors(&vb, vb.pad, 0, B, vb.longest, pad_bufs);
    double flops = 4.0 * (double)D * pairs * (double)Hq; /* useful work: the sequences' own pairs */
    printf("varlen: %lld sequences, %lld tokens (longest %lld; padded batch %lld x %lld = %lld tokens, %.2fx the pairs)\n",
           (long long)B, (long long)vb.Tq, (long long)vb.longest, (long long)B, (long long)vb.longest,
           (long long)(B * vb.longest), padded_pairs / pairs);
    printf("| arm | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s |\n|---|---|---|---|---|\n");
    double med[N_ARMS][2] = {{0}};
    double *times = xmalloc((size_t)reps * 8, "times");
    for (int arm = 0; arm < N_ARMS; arm++) {
        for (int pass = 0; pass < (forward_only ? 1 : 2); pass++) {
            run_arm(&vb, arm, 0, 1); /* warm-up, and the backward's o and lse */
            if (pass) run_arm(&vb, arm, 1, 1);
            for (int64_t r = 0; r < reps; r++) {
                double t0 = now_seconds();
                run_arm(&vb, arm, pass, calls);
                times[r] = (now_seconds() - t0) / (double)calls;
            }
            qsort(times, (size_t)reps, 8, cmp_double);
            med[arm][pass] = times[reps / 2];
        }
        char bms[32] = "-", btf[32] = "-";
        if (!forward_only)
            snprintf(bms, sizeof bms, "%.2f", med[arm][1] * 1e3), snprintf(btf, sizeof btf, "%.3f", 2.5 * flops / med[arm][1] / 1e12);
        printf("| %s | %.2f | %s | %.3f | %s |\n", arm_names[arm], med[arm][0] * 1e3, bms, flops / med[arm][0] / 1e12, btf);
        json_array_append_new(rows, json_pack("{s:s,s:f,s:f,s:f,s:f}", "arm", arm_names[arm], "fwd_s", med[arm][0], "bwd_s",
                                              med[arm][1], "fwd_tflops", flops / med[arm][0] / 1e12, "bwd_tflops",
                                              forward_only ? 0.0 : 2.5 * flops / med[arm][1] / 1e12));
    }
    double total[N_ARMS];
    for (int arm = 0; arm < N_ARMS; arm++) total[arm] = med[arm][0] + med[arm][1];
    printf("varlen vs one call per sequence (TFLOP/s ratio, fwd+bwd): %.3f; padded batch time / varlen time: %.2fx\n",
           total[ARM_PER_SEQUENCE] / total[ARM_VARLEN], total[ARM_PADDED] / total[ARM_VARLEN]);
    for (int i = 0; i < 9; i++) wa_free_memory(ctx, dev, bufs[i]), wa_free_memory(ctx, dev, pad_bufs[i]);
    if (dev != WA_DEVICE_CPU) wa_free_memory(ctx, dev, vb.cu);
    free(vb.cu_host), free(times);
}

int cmd_bench(int argc, char **argv) {
    int64_t lens[16] = {8192}, n_lens = 1, B = 1, Hq = 32, Hkv = 16, D = 256, threads = 0, tq = 0, tk = 0, reps = 3, calls = 1;
    int64_t left = 1023, right = 0, n_varlen = 0;
    static int64_t varlen[4096];
    float scale = 0;
    wa_dtype dt = WA_BF16;
    int dense = 0, forward_only = 0, deterministic = 0;
    wa_device dev = WA_DEVICE_CPU;
    const char *json_path = NULL, *v;
    for (int i = 1; i < argc; i++) {
        int64_t x;
        if (is_help(argv[i])) show_help(bench_help);
        if ((v = flag_value(argc, argv, &i, "--n", bench_usage))) {
            n_lens = parse_lengths("--n", v, 1, 1 << 24, lens, 16);
        } else if ((v = flag_value(argc, argv, &i, "--varlen", bench_usage))) {
            n_varlen = parse_lengths("--varlen", v, 0, 1 << 24, varlen, 4096);
        } else if ((v = flag_value(argc, argv, &i, "--dtype", bench_usage))) {
            if (!strcmp(v, "f32")) dt = WA_F32;
            else if (!strcmp(v, "f16")) dt = WA_F16;
            else if (!strcmp(v, "bf16")) dt = WA_BF16;
            else usage_error(bench_usage, "--dtype '%s': f32, f16 or bf16", v);
        } else if ((v = flag_value(argc, argv, &i, "--b", bench_usage))) {
            if (parse_i64(v, 1, 4096, &B)) usage_error(bench_usage, "--b '%s'", v);
        } else if ((v = flag_value(argc, argv, &i, "--hq", bench_usage))) {
            if (parse_i64(v, 1, 4096, &Hq)) usage_error(bench_usage, "--hq '%s'", v);
        } else if ((v = flag_value(argc, argv, &i, "--hkv", bench_usage))) {
            if (parse_i64(v, 1, 4096, &Hkv)) usage_error(bench_usage, "--hkv '%s'", v);
        } else if ((v = flag_value(argc, argv, &i, "--d", bench_usage))) {
            if (parse_i64(v, 1, WA_MAX_HEAD_DIM, &D)) usage_error(bench_usage, "--d '%s': 1 to 512", v);
        } else if ((v = flag_value(argc, argv, &i, "--sliding-window", bench_usage))) {
            if (parse_i64(v, 1, INT64_MAX / 4, &x)) usage_error(bench_usage, "--sliding-window '%s': need an integer from 1 to %lld", v, (long long)(INT64_MAX / 4));
            left = x - 1, right = 0;
        } else if ((v = flag_value(argc, argv, &i, "--window-left", bench_usage))) {
            if (parse_i64(v, -1, INT64_MAX / 4, &left)) usage_error(bench_usage, "--window-left '%s': need an integer from -1 (unbounded) to %lld", v, (long long)(INT64_MAX / 4));
        } else if ((v = flag_value(argc, argv, &i, "--window-right", bench_usage))) {
            if (parse_i64(v, -1, INT64_MAX / 4, &right)) usage_error(bench_usage, "--window-right '%s': need an integer from -1 (unbounded) to %lld", v, (long long)(INT64_MAX / 4));
        } else if (!strcmp(argv[i], "--causal")) {
            left = -1, right = 0;
        } else if (!strcmp(argv[i], "--full")) {
            left = -1, right = -1;
        } else if ((v = flag_value(argc, argv, &i, "--scale", bench_usage))) {
            if (parse_f32(v, &scale)) usage_error(bench_usage, "--scale '%s'", v);
        } else if ((v = flag_value(argc, argv, &i, "--threads", bench_usage))) {
            if (parse_i64(v, 0, 1024, &threads)) usage_error(bench_usage, "--threads '%s'", v);
        } else if ((v = flag_value(argc, argv, &i, "--tile-q", bench_usage))) {
            if (parse_i64(v, 1, 1024, &tq)) usage_error(bench_usage, "--tile-q '%s'", v);
        } else if ((v = flag_value(argc, argv, &i, "--tile-k", bench_usage))) {
            if (parse_i64(v, 1, 1024, &tk)) usage_error(bench_usage, "--tile-k '%s'", v);
        } else if ((v = flag_value(argc, argv, &i, "--reps", bench_usage))) {
            if (parse_i64(v, 1, 1000, &reps)) usage_error(bench_usage, "--reps '%s'", v);
        } else if ((v = flag_value(argc, argv, &i, "--calls", bench_usage))) {
            if (parse_i64(v, 1, 1000, &calls)) usage_error(bench_usage, "--calls '%s': 1 to 1000 calls a timed run", v);
        } else if ((v = flag_value(argc, argv, &i, "--algo", bench_usage))) {
            if (!strcmp(v, "dense")) dense = 1;
            else if (strcmp(v, "tiled")) usage_error(bench_usage, "--algo '%s': tiled or dense", v);
        } else if ((v = flag_value(argc, argv, &i, "--device", bench_usage))) {
            if (!strcmp(v, "cuda")) dev = WA_DEVICE_CUDA;
            else if (strcmp(v, "cpu")) usage_error(bench_usage, "--device '%s': cpu or cuda", v);
        } else if (!strcmp(argv[i], "--forward-only")) {
            forward_only = 1;
        } else if (!strcmp(argv[i], "--deterministic")) {
            deterministic = 1;
        } else if ((v = flag_value(argc, argv, &i, "--json", bench_usage))) {
            json_path = v;
        } else unknown_option(argv[i]);
    }
    if (dev == WA_DEVICE_CUDA && !wa_device_available(WA_DEVICE_CUDA)) die("--device cuda: this build has no usable CUDA device");
    wa_context_params cp = {0};
    cp.threads = (int)threads, cp.tile_q = (int)tq, cp.tile_k = (int)tk;
    cp.algorithm = dense ? WA_ALGO_DENSE : WA_ALGO_TILED;
    cp.cuda_deterministic = deterministic;
    wa_context *ctx;
    if (wa_context_create(&cp, &ctx) != WA_OK) die("%s", wa_last_error());
    wa_attn_desc desc = {scale, 0, left, right};
    char per_call[64] = "";
    if (calls > 1) snprintf(per_call, sizeof per_call, ", per call of %lld back to back", (long long)calls);
    printf("bench: %s B=%lld Hq=%lld Hkv=%lld D=%lld window=(%lld,%lld) %s %s, %d reps (median)%s\n", dtype_name(dt),
           (long long)B, (long long)Hq, (long long)Hkv, (long long)D, (long long)left, (long long)right,
           dense ? "dense" : "tiled", dev == WA_DEVICE_CUDA ? (deterministic ? "cuda (deterministic backward)" : "cuda") : wa_cpu_kernels(), (int)reps,
           per_call);
    json_t *rows = json_array();
    if (n_varlen) {
        if (B != 1) usage_error(bench_usage, "--varlen sets the batch from its lengths; drop --b");
        bench_varlen(ctx, dev, dt, &desc, varlen, n_varlen, Hq, Hkv, D, reps, calls, forward_only, rows);
        n_lens = 0;
    } else {
        printf("| N | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | peak RSS growth GB |\n|---|---|---|---|---|---|\n");
    }
    size_t es = wa_dtype_size(dt);
    for (int64_t li = 0; li < n_lens; li++) {
        int64_t N = lens[li];
        size_t nq = (size_t)(B * Hq * N * D) * es, nk = (size_t)(B * Hkv * N * D) * es, nl = (size_t)(B * Hq * N) * 4;
        const size_t sizes[9] = {nq, nk, nk, nq, nq, nl, nq, nk, nk};
        void *buf[9];
        size_t before = peak_rss_bytes();
        for (int i = 0; i < 9; i++)
            if (wa_malloc(ctx, dev, sizes[i], &buf[i]) != WA_OK) die("%s", wa_last_error());
        for (int i = 0; i < 4; i++) {
            if (dev == WA_DEVICE_CPU) fill_uniform(buf[i], dt, sizes[i] / es, (uint64_t)i + 1);
            else {
                void *h = xmalloc(sizes[i], "staging");
                fill_uniform(h, dt, sizes[i] / es, (uint64_t)i + 1);
                if (wa_memcpy(ctx, buf[i], dev, h, WA_DEVICE_CPU, sizes[i]) != WA_OK) die("%s", wa_last_error());
                free(h);
            }
        }
        const int64_t heads[9] = {Hq, Hkv, Hkv, Hq, Hq, Hq, Hq, Hkv, Hkv};
        wa_tensor t[9];
        for (int i = 0; i < 9; i++) {
            t[i] = i == 5 ? wa_tensor_lse(buf[i], B, Hq, N) : wa_tensor_bhnd(buf[i], dt, B, heads[i], N, D);
            t[i].device = dev;
        }
        double *fw = xmalloc((size_t)reps * 8, "times"), *bw = xmalloc((size_t)reps * 8, "times");
        size_t base = peak_rss_bytes();
        for (int64_t r = -1; r < reps; r++) { /* r = -1 is the warm-up (one call each) */
            const int64_t n_calls = r < 0 ? 1 : calls;
            double t0 = now_seconds();
            for (int64_t c = 0; c < n_calls; c++)
                if (wa_forward(ctx, &desc, &t[0], &t[1], &t[2], &t[4], &t[5]) != WA_OK) die("forward: %s", wa_last_error());
            if (wa_synchronize(ctx) != WA_OK) die("forward: %s", wa_last_error());
            double t1 = now_seconds();
            for (int64_t c = 0; c < n_calls && !forward_only; c++)
                if (wa_backward(ctx, &desc, &t[0], &t[1], &t[2], &t[4], &t[5], &t[3], &t[6], &t[7], &t[8]) != WA_OK)
                    die("backward: %s", wa_last_error());
            if (!forward_only && wa_synchronize(ctx) != WA_OK) die("backward: %s", wa_last_error());
            if (r >= 0) fw[r] = (t1 - t0) / (double)n_calls, bw[r] = (now_seconds() - t1) / (double)n_calls;
        }
        qsort(fw, (size_t)reps, 8, cmp_double), qsort(bw, (size_t)reps, 8, cmp_double);
        double f = fw[reps / 2], bb = bw[reps / 2];
        wa_window w = {N, N, left, right};
        double flops = 4.0 * (double)D * (double)wa_visible_pairs(&w) * (double)(B * Hq);
        double grow = (double)(peak_rss_bytes() - (before < base ? before : base)) / 1e9;
        if (dev == WA_DEVICE_CUDA) grow = 0;
        char bms[32] = "-", btf[32] = "-";
        if (!forward_only) snprintf(bms, sizeof bms, "%.2f", bb * 1e3), snprintf(btf, sizeof btf, "%.3f", 2.5 * flops / bb / 1e12);
        printf("| %lld | %.2f | %s | %.3f | %s | %.2f |\n", (long long)N, f * 1e3, bms, flops / f / 1e12, btf, grow);
        json_array_append_new(rows, json_pack("{s:I,s:f,s:f,s:f,s:f,s:f}", "n", (json_int_t)N, "fwd_s", f, "bwd_s",
                                              forward_only ? 0.0 : bb, "fwd_tflops", flops / f / 1e12, "bwd_tflops",
                                              forward_only ? 0.0 : 2.5 * flops / bb / 1e12, "rss_growth_gb", grow));
        for (int i = 0; i < 9; i++) wa_free_memory(ctx, dev, buf[i]);
        free(fw), free(bw);
    }
    if (json_path) {
        json_t *root = json_pack("{s:s,s:s,s:I,s:I,s:I,s:I,s:I,s:I,s:s,s:I,s:o}", "dtype", dtype_name(dt), "kernels",
                                 dev == WA_DEVICE_CUDA ? "cuda" : dense ? "dense" : wa_cpu_kernels(), "B", (json_int_t)B,
                                 "Hq", (json_int_t)Hq, "Hkv", (json_int_t)Hkv, "D", (json_int_t)D, "window_left",
                                 (json_int_t)left, "window_right", (json_int_t)right, "device",
                                 dev == WA_DEVICE_CUDA ? "cuda" : "cpu", "calls", (json_int_t)calls, "rows", rows);
        char *text = json_dumps(root, JSON_INDENT(1));
        write_file_atomic(json_path, text);
        free(text);
        json_decref(root);
    } else {
        json_decref(rows);
    }
    wa_context_destroy(ctx);
    return 0;
}

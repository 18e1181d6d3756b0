/* host_call_cost.c — the host's time inside one wa_forward and one wa_backward on CUDA tensors,
 * with nothing around them (no binding, no allocator, no autograd): how much of the host time a
 * call through winattn.torch pays (call_gap.py) is the library's own, and does it grow with the
 * length? For each case: one context, the nine tensors in fresh device memory (contents left as
 * cudaMalloc gives them: only the host's time is read), two warm-up pairs, then CALLS forward +
 * backward pairs back to back with no synchronisation (the GPU falls behind at once, so no call
 * waits on it) and CALLS pairs each from an idle GPU (synchronised before the call, the call timed
 * alone). Prints the median and the minimum host microseconds per call. On the GPU machine, from
 * the repository root after `make`:
 *   cc -O2 -Iinclude -o build/host_call_cost bench/host_call_cost.c -Lbuild -lwinattn
 *   ln -sf libwinattn.so build/libwinattn.so.0   (the library's soname; `make install` makes it)
 *   LD_LIBRARY_PATH=build build/host_call_cost [LABEL:N ...]   (LABEL: a b c cw, bench/gpu_peers.py's)
 * Another build's library: its folder in LD_LIBRARY_PATH, with the same link in it. */
#define _POSIX_C_SOURCE 200809L
#include "winattn.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { CALLS = 30 };

/* bench/gpu_peers.py's shapes: Hq, Hkv, D and the window (0 = causal) */
static const struct {
    const char *label;
    int64_t hq, hkv, d, window;
} shapes[] = {{"a", 32, 16, 256, 1024}, {"b", 32, 8, 128, 4096}, {"c", 32, 4, 512, 0}, {"cw", 32, 4, 512, 1024}};

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void check(wa_status st, const char *what) {
    if (st != WA_OK) {
        fprintf(stderr, "host_call_cost: %s: %s\n", what, wa_last_error());
        exit(1);
    }
}

static void median_min(double *us, double *med, double *min) {
    qsort(us, CALLS, sizeof *us, cmp_double);
    *med = us[CALLS / 2], *min = us[0];
}

static void run_case(const char *label, int64_t hq, int64_t hkv, int64_t d, int64_t window, int64_t n) {
    wa_context_params params = {0};
    params.threads = 1;
    wa_context *ctx = NULL;
    check(wa_context_create(&params, &ctx), "context");
    const wa_attn_desc desc = {0.0f, 0.0f, window ? window - 1 : -1, 0};
    const int64_t heads[9] = {hq, hkv, hkv, hq, hq, hq, hq, hkv, hkv}; /* q k v do o lse dq dk dv */
    void *buf[9];
    wa_tensor t[9];
    for (int i = 0; i < 9; i++) {
        const size_t bytes = (size_t)(heads[i] * n) * (i == 5 ? 4 : (size_t)d * 2);
        check(wa_malloc(ctx, WA_DEVICE_CUDA, bytes, &buf[i]), "wa_malloc");
        t[i] = i == 5 ? wa_tensor_lse(buf[i], 1, heads[i], n) : wa_tensor_bhnd(buf[i], WA_BF16, 1, heads[i], n, d);
        t[i].device = WA_DEVICE_CUDA;
    }
#define FORWARD() wa_forward(ctx, &desc, &t[0], &t[1], &t[2], &t[4], &t[5])
#define BACKWARD() wa_backward(ctx, &desc, &t[0], &t[1], &t[2], &t[4], &t[5], &t[3], &t[6], &t[7], &t[8])
    for (int w = 0; w < 2; w++) check(FORWARD(), "forward"), check(BACKWARD(), "backward");
    check(wa_synchronize(ctx), "synchronize");
    double fwd[CALLS], bwd[CALLS], fwd_idle[CALLS], bwd_idle[CALLS];
    for (int c = 0; c < CALLS; c++) { /* queued: the GPU is behind from the first call on */
        const double t0 = now_us();
        check(FORWARD(), "forward");
        const double t1 = now_us();
        check(BACKWARD(), "backward");
        fwd[c] = t1 - t0, bwd[c] = now_us() - t1;
    }
    check(wa_synchronize(ctx), "synchronize");
    for (int c = 0; c < CALLS; c++) { /* each from an idle GPU */
        double t0 = now_us();
        check(FORWARD(), "forward");
        fwd_idle[c] = now_us() - t0;
        check(wa_synchronize(ctx), "synchronize");
        t0 = now_us();
        check(BACKWARD(), "backward");
        bwd_idle[c] = now_us() - t0;
        check(wa_synchronize(ctx), "synchronize");
    }
    double m[8];
    median_min(fwd, &m[0], &m[1]), median_min(bwd, &m[2], &m[3]);
    median_min(fwd_idle, &m[4], &m[5]), median_min(bwd_idle, &m[6], &m[7]);
    printf("| %s %lld | %.1f / %.1f | %.1f / %.1f | %.1f / %.1f | %.1f / %.1f |\n", label, (long long)n, m[0], m[1], m[2],
           m[3], m[4], m[5], m[6], m[7]);
    for (int i = 0; i < 9; i++) wa_free_memory(ctx, WA_DEVICE_CUDA, buf[i]);
    wa_context_destroy(ctx);
}

int main(int argc, char **argv) {
    static const char *const defaults[] = {"b:1024", "b:8192", "b:32768", "cw:16384", "c:8192"};
    const int n_cases = argc > 1 ? argc - 1 : (int)(sizeof defaults / sizeof *defaults);
    if (!wa_device_available(WA_DEVICE_CUDA)) {
        fprintf(stderr, "host_call_cost: this build has no usable CUDA device\n");
        return 1;
    }
    printf("host us per call, median / min over %d calls\n", CALLS);
    printf("| case | fwd queued | bwd queued | fwd from idle | bwd from idle |\n|---|---|---|---|---|\n");
    for (int i = 0; i < n_cases; i++) {
        const char *arg = argc > 1 ? argv[i + 1] : defaults[i], *colon = strchr(arg, ':');
        char *end = NULL;
        const long long n = colon ? strtoll(colon + 1, &end, 10) : 0;
        size_t s = 0;
        while (colon && s < sizeof shapes / sizeof *shapes &&
               (strlen(shapes[s].label) != (size_t)(colon - arg) || strncmp(shapes[s].label, arg, (size_t)(colon - arg))))
            s++;
        if (!colon || s == sizeof shapes / sizeof *shapes || *end || n <= 0 || n > (1 << 20)) {
            fprintf(stderr, "host_call_cost: '%s': LABEL:N with LABEL one of a, b, c, cw and N from 1 to 1048576\n", arg);
            return 1;
        }
        run_case(shapes[s].label, shapes[s].hq, shapes[s].hkv, shapes[s].d, shapes[s].window, n);
    }
    return 0;
}

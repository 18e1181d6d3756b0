/* test_misuse.c — hostile and odd input to the public API, in the spirit of SQLite's and ggml's
 * tests: sizes whose products overflow, windows near INT64_MAX, outputs that share memory with
 * each other or with themselves, misaligned pointers, a context used from two threads at once,
 * malformed varlen offsets. Every case must return the documented status with a one-line message,
 * or (where the input is legal) the same results as the plain call. `make sanitize` builds this
 * with ASan and UBSan, where any undefined behaviour on these paths aborts the test. */
#define _GNU_SOURCE
#include "check.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 2, HQ = 4, HKV = 2, N = 37, D = 16 };
#define NQ_ELEMS (B * HQ * N * D)
#define NK_ELEMS (B * HKV * N * D)

static float q[NQ_ELEMS], k[NK_ELEMS], v[NK_ELEMS], go[NQ_ELEMS];
static float o_ref[NQ_ELEMS], lse_ref[B * HQ * N], dq_ref[NQ_ELEMS], dk_ref[NK_ELEMS], dv_ref[NK_ELEMS];

static void expect(wa_status got, wa_status want, const char *text, const char *what) {
    const char *msg = wa_last_error();
    int one_line = strchr(msg, '\n') == NULL && (want == WA_OK || msg[0] != '\0');
    int has_text = !text || strstr(msg, text) != NULL;
    check(got == want && one_line && has_text, "%s -> %s%s%s", what, wa_status_str(got),
          got == WA_OK ? "" : ": ", got == WA_OK ? "" : msg);
}

static wa_tensor T4(void *data, int64_t b, int64_t h, int64_t n, int64_t d) {
    return wa_tensor_bhnd(data, WA_F32, b, h, n, d);
}

static void reference(wa_context *ctx, const wa_attn_desc *desc) {
    wa_tensor tq = T4(q, B, HQ, N, D), tk = T4(k, B, HKV, N, D), tv = T4(v, B, HKV, N, D);
    wa_tensor to = T4(o_ref, B, HQ, N, D), tl = wa_tensor_lse(lse_ref, B, HQ, N), tdo = T4(go, B, HQ, N, D);
    wa_tensor tdq = T4(dq_ref, B, HQ, N, D), tdk = T4(dk_ref, B, HKV, N, D), tdv = T4(dv_ref, B, HKV, N, D);
    if (wa_forward(ctx, desc, &tq, &tk, &tv, &to, &tl) != WA_OK ||
        wa_backward(ctx, desc, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk, &tdv) != WA_OK) {
        fprintf(stderr, "reference call failed: %s\n", wa_last_error());
        exit(1);
    }
}

/* ---- windows: any int64 is valid; a side longer than the sequence is unbounded ---- */
static void test_windows(wa_context *ctx) {
    const int64_t sides[][2] = {{INT64_MAX, 0}, {INT64_MAX, INT64_MAX}, {0, INT64_MAX}, {N - 1, N - 1}, {N + 5, -1}};
    const int64_t same_as[][2] = {{-1, 0}, {-1, -1}, {0, -1}, {-1, -1}, {-1, -1}};
    static float o1[NQ_ELEMS], l1[B * HQ * N];
    for (size_t c = 0; c < sizeof sides / sizeof sides[0]; c++) {
        wa_attn_desc ref = wa_attn_desc_full(), big = wa_attn_desc_full();
        ref.window_left = same_as[c][0], ref.window_right = same_as[c][1];
        big.window_left = sides[c][0], big.window_right = sides[c][1];
        reference(ctx, &ref);
        wa_tensor tq = T4(q, B, HQ, N, D), tk = T4(k, B, HKV, N, D), tv = T4(v, B, HKV, N, D);
        wa_tensor to = T4(o1, B, HQ, N, D), tl = wa_tensor_lse(l1, B, HQ, N);
        wa_status st = wa_forward(ctx, &big, &tq, &tk, &tv, &to, &tl);
        check(st == WA_OK && memcmp(o1, o_ref, sizeof o1) == 0 && memcmp(l1, lse_ref, sizeof l1) == 0,
              "window (%lld, %lld) gives exactly the results of (%lld, %lld)", (long long)sides[c][0],
              (long long)sides[c][1], (long long)same_as[c][0], (long long)same_as[c][1]);
    }
    wa_attn_desc bad = wa_attn_desc_full();
    bad.window_left = INT64_MIN;
    wa_tensor tq = T4(q, B, HQ, N, D), tk = T4(k, B, HKV, N, D), tv = T4(v, B, HKV, N, D);
    wa_tensor to = T4(o1, B, HQ, N, D);
    expect(wa_forward(ctx, &bad, &tq, &tk, &tv, &to, NULL), WA_ERR_INVALID_ARG, "window", "window left = INT64_MIN");
}

/* ---- sizes whose products overflow, strides that address past 2^60 ---- */
static void test_sizes(wa_context *ctx) {
    static float small[64];
    wa_attn_desc desc = wa_attn_desc_causal();
    const int64_t big = (int64_t)1 << 40, heads = (int64_t)1 << 20;
    wa_tensor tq = T4(small, big, heads, 1, 64), tk = T4(small, big, heads, 1, 64), tv = tk, to = T4(small + 32, big, heads, 1, 64);
    expect(wa_forward(ctx, &desc, &tq, &tk, &tv, &to, NULL), WA_ERR_SHAPE, "exceed", "B = 2^40, H = 2^20 elements overflow");
    size_t bytes = 1;
    expect(wa_workspace_size(ctx, &desc, &tq, &tk, &tv, 1, &bytes), WA_ERR_SHAPE, "exceed",
           "wa_workspace_size on the same shapes");
    check(bytes == 0, "wa_workspace_size leaves 0 bytes on failure (%zu)", bytes);

    wa_tensor wide = T4(small, (int64_t)1 << 30, (int64_t)1 << 30, (int64_t)1 << 20, 64), wide_o = wide;
    wide_o.data = small + 32;
    expect(wa_forward(ctx, &desc, &wide, &wide, &wide, &wide_o, NULL), WA_ERR_SHAPE, "2^48",
           "2^30 x 2^30 x 2^20 x 64: each dimension fits, the product does not");
    wa_tensor huge = T4(small, 1, 1, (int64_t)1 << 32, 1);
    expect(wa_forward(ctx, &desc, &huge, &huge, &huge, &to, NULL), WA_ERR_SHAPE, "limit", "N = 2^32 exceeds the dimension limit");

    wa_tensor strided = T4(small, 1, 1, 2, 4);
    strided.stride[2] = INT64_MAX / 2;
    wa_tensor o4 = T4(small + 32, 1, 1, 2, 4);
    expect(wa_forward(ctx, &desc, &strided, &strided, &strided, &o4, NULL), WA_ERR_STRIDE, "2^60",
           "stride INT64_MAX/2 over two rows");
    wa_tensor neg = T4(small, 1, 1, 2, 4);
    neg.stride[1] = -4;
    expect(wa_forward(ctx, &desc, &neg, &neg, &neg, &o4, NULL), WA_ERR_STRIDE, "negative", "negative stride");
    wa_tensor high = T4((void *)(UINTPTR_MAX - 15), 1, 1, 2, 4);
    expect(wa_forward(ctx, &desc, &high, &high, &high, &o4, NULL), WA_ERR_STRIDE, "address space",
           "a tensor that wraps past the end of the address space");
    wa_tensor empty = T4(NULL, 0, (int64_t)1 << 30, (int64_t)1 << 30, 512), oe = empty;
    expect(wa_forward(ctx, &desc, &empty, &empty, &empty, &oe, NULL), WA_OK, NULL, "B = 0 with huge other dims: nothing to do");

    /* sizes whose rounding up to the 64-byte alignment would wrap to a tiny block */
    const size_t near_max[] = {SIZE_MAX, SIZE_MAX - 1, SIZE_MAX - 62, SIZE_MAX - 63, SIZE_MAX / 2 + 1};
    for (size_t i = 0; i < sizeof near_max / sizeof near_max[0]; i++) {
        void *p = (void *)1;
        char what[96];
        snprintf(what, sizeof what, "wa_malloc of SIZE_MAX - %zu bytes", SIZE_MAX - near_max[i]);
        expect(wa_malloc(ctx, WA_DEVICE_CPU, near_max[i], &p), WA_ERR_NO_MEMORY, "cannot allocate", what);
        check(p == NULL, "%s leaves *ptr NULL", what);
        wa_free_memory(ctx, WA_DEVICE_CPU, p);
    }
}

/* ---- outputs sharing memory ---- */
static void test_overlap(wa_context *ctx) {
    static float buf[2 * NQ_ELEMS + 64], dk[NK_ELEMS], lse[B * HQ * N];
    wa_attn_desc desc = wa_attn_desc_sliding(9);
    wa_tensor tq = T4(q, B, HQ, N, D), tk = T4(k, B, HKV, N, D), tv = T4(v, B, HKV, N, D), tdo = T4(go, B, HQ, N, D);
    reference(ctx, &desc);
    wa_tensor tl_ref = wa_tensor_lse(lse_ref, B, HQ, N), to_ref = T4(o_ref, B, HQ, N, D);

    wa_tensor to = T4(buf, B, HQ, N, D), tl_in_o = wa_tensor_lse(buf + 100, B, HQ, N);
    expect(wa_forward(ctx, &desc, &tq, &tk, &tv, &to, &tl_in_o), WA_ERR_STRIDE, "share memory", "lse inside o");

    wa_tensor tdq = T4(buf, B, HQ, N, D), tdk = T4(dk, B, HKV, N, D), tdv_same = T4(dk, B, HKV, N, D);
    expect(wa_backward(ctx, &desc, &tq, &tk, &tv, &to_ref, &tl_ref, &tdo, &tdq, &tdk, &tdv_same), WA_ERR_STRIDE,
           "share memory", "dk and dv in one buffer");
    wa_tensor tdv_half = T4(dk + NK_ELEMS / 2, B, HKV, N, D);
    tdv_half.shape[0] = 1;
    wa_tensor tdk1 = T4(dk, 1, HKV, N, D), tk1 = T4(k, 1, HKV, N, D), tv1 = T4(v, 1, HKV, N, D);
    wa_tensor tq1 = T4(q, 1, HQ, N, D), to1 = T4(o_ref, 1, HQ, N, D), tl1 = wa_tensor_lse(lse_ref, 1, HQ, N);
    wa_tensor tdo1 = T4(go, 1, HQ, N, D), tdq1 = T4(buf, 1, HQ, N, D);
    expect(wa_backward(ctx, &desc, &tq1, &tk1, &tv1, &to1, &tl1, &tdo1, &tdq1, &tdk1, &tdv_half), WA_OK, NULL,
           "dk and dv as the two halves of one buffer (adjacent, disjoint)");

    wa_tensor self = T4(buf, B, HQ, N, D);
    self.stride[2] = D / 2; /* row n+1 starts in the middle of row n */
    expect(wa_forward(ctx, &desc, &tq, &tk, &tv, &self, NULL), WA_ERR_STRIDE, "two elements at one address",
           "an output whose rows overlap each other");
    wa_tensor bcast = T4(buf, B, HQ, N, D);
    bcast.stride[1] = 0;
    expect(wa_forward(ctx, &desc, &tq, &tk, &tv, &bcast, NULL), WA_ERR_STRIDE, "two elements at one address",
           "an output with stride 0 over heads");
    wa_tensor o_over_k = T4(k, B, HQ / 2, N, D);
    wa_tensor tq_half = T4(q, B, HQ / 2, N, D);
    wa_tensor tk_half = T4(k, B, HKV / 2, N, D), tv_half = T4(v, B, HKV / 2, N, D);
    expect(wa_forward(ctx, &desc, &tq_half, &tk_half, &tv_half, &o_over_k, NULL), WA_ERR_STRIDE, "overlaps input k",
           "o on top of k");

    /* q and o as the two interleaved halves of one [B, N, 2*HQ, D] buffer: legal */
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < HQ; h++)
            for (int64_t n = 0; n < N; n++)
                memcpy(buf + ((b * N + n) * 2 * HQ + h) * D, q + ((b * HQ + h) * N + n) * D, D * sizeof(float));
    wa_tensor qi = wa_tensor_bnhd(buf, WA_F32, B, 2 * HQ, N, D), oi = qi;
    qi.shape[1] = HQ, oi.shape[1] = HQ;
    oi.data = buf + HQ * D;
    wa_tensor tl = wa_tensor_lse(lse, B, HQ, N);
    wa_status st = wa_forward(ctx, &desc, &qi, &tk, &tv, &oi, &tl);
    int same = st == WA_OK;
    for (int64_t b = 0; b < B && same; b++)
        for (int64_t h = 0; h < HQ && same; h++)
            for (int64_t n = 0; n < N && same; n++)
                same = memcmp(buf + ((b * N + n) * 2 * HQ + HQ + h) * D, o_ref + ((b * HQ + h) * N + n) * D,
                              D * sizeof(float)) == 0;
    check(same, "q and o interleaved in one [B,N,2H,D] buffer are accepted and give the plain call's o (%s)",
          st == WA_OK ? "ok" : wa_last_error());
    /* and o overlapping q's half by one head: refused */
    oi.data = buf + (HQ - 1) * D;
    expect(wa_forward(ctx, &desc, &qi, &tk, &tv, &oi, &tl), WA_ERR_STRIDE, "overlaps input q",
           "interleaved q and o sharing one head");
}

/* ---- alignment ---- */
static void test_alignment(wa_context *ctx) {
    static float buf[NQ_ELEMS + 8], o[NQ_ELEMS];
    static uint16_t half[NQ_ELEMS + 8], half_o[NQ_ELEMS];
    wa_attn_desc desc = wa_attn_desc_causal();
    wa_tensor tq = T4((char *)buf + 2, 1, 1, 8, D), to = T4(o, 1, 1, 8, D);
    expect(wa_forward(ctx, &desc, &tq, &tq, &tq, &to, NULL), WA_ERR_STRIDE, "aligned", "f32 data at a 2-byte offset");
    wa_tensor hq = wa_tensor_bhnd((char *)half + 1, WA_BF16, 1, 1, 8, D), ho = wa_tensor_bhnd(half_o, WA_BF16, 1, 1, 8, D);
    expect(wa_forward(ctx, &desc, &hq, &hq, &hq, &ho, NULL), WA_ERR_STRIDE, "aligned", "bf16 data at an odd address");
    wa_tensor ok = wa_tensor_bhnd(half + 1, WA_BF16, 1, 1, 8, D);
    memset(half, 0, sizeof half);
    expect(wa_forward(ctx, &desc, &ok, &ok, &ok, &ho, NULL), WA_OK, NULL, "bf16 data 2-byte aligned but not 4");
}

/* ---- one context, two threads ---- */
typedef struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int inside, release;
} gate;
static gate g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};

/* an allocator that holds the first caller inside the library until the test lets it go */
static void *holding_alloc(void *user, size_t bytes) {
    (void)user;
    pthread_mutex_lock(&g.mu);
    g.inside = 1;
    pthread_cond_broadcast(&g.cv);
    while (!g.release) pthread_cond_wait(&g.cv, &g.mu);
    pthread_mutex_unlock(&g.mu);
    void *p = NULL;
    return posix_memalign(&p, 64, bytes) == 0 ? p : NULL;
}
static void plain_free(void *user, void *p) {
    (void)user;
    free(p);
}

typedef struct call_args {
    wa_context *ctx;
    wa_status st;
} call_args;
static float thread_o[NQ_ELEMS];
static void *first_caller(void *arg) {
    call_args *a = arg;
    wa_attn_desc desc = wa_attn_desc_causal();
    wa_tensor tq = T4(q, B, HQ, N, D), tk = T4(k, B, HKV, N, D), tv = T4(v, B, HKV, N, D), to = T4(thread_o, B, HQ, N, D);
    a->st = wa_forward(a->ctx, &desc, &tq, &tk, &tv, &to, NULL);
    return NULL;
}

/* ---- the environment: a WINATTN_ISA no build has is refused, one this CPU lacks falls back ---- */
static void test_environment(void) {
    const char *saved = getenv("WINATTN_ISA");
    char *keep = saved ? strdup(saved) : NULL;
    wa_context *c = NULL;
    setenv("WINATTN_ISA", "bogus", 1);
    expect(wa_context_create(NULL, &c), WA_ERR_INVALID_ARG, "WINATTN_ISA=bogus", "WINATTN_ISA=bogus");
    check(c == NULL, "WINATTN_ISA=bogus: no context made");
    setenv("WINATTN_ISA", "AVX2", 1);
    expect(wa_context_create(NULL, &c), WA_ERR_INVALID_ARG, "not one of", "WINATTN_ISA=AVX2 (names are lower case)");
    setenv("WINATTN_ISA", "neon", 1); /* a name of another build: falls back, as for a CPU that lacks it */
    wa_status st = wa_context_create(NULL, &c);
    expect(st, WA_OK, NULL, "WINATTN_ISA=neon on any build");
    if (st == WA_OK) wa_context_destroy(c);
    if (keep) setenv("WINATTN_ISA", keep, 1);
    else unsetenv("WINATTN_ISA");
    free(keep);
}

static void test_threads(void) {
    wa_context_params params = {0};
    params.threads = 1, params.alloc = holding_alloc, params.free = plain_free;
    wa_context *ctx;
    g.release = 1; /* the context's own allocation passes straight through */
    if (wa_context_create(&params, &ctx) != WA_OK) {
        check_fail("context for the two-thread test: %s", wa_last_error());
        return;
    }
    g.release = 0, g.inside = 0;
    call_args a = {ctx, WA_ERR_CUDA};
    pthread_t th;
    pthread_create(&th, NULL, first_caller, &a);
    pthread_mutex_lock(&g.mu);
    while (!g.inside) pthread_cond_wait(&g.cv, &g.mu);
    pthread_mutex_unlock(&g.mu);
    static float o[NQ_ELEMS];
    wa_attn_desc desc = wa_attn_desc_causal();
    wa_tensor tq = T4(q, B, HQ, N, D), tk = T4(k, B, HKV, N, D), tv = T4(v, B, HKV, N, D), to = T4(o, B, HQ, N, D);
    wa_status second = wa_forward(ctx, &desc, &tq, &tk, &tv, &to, NULL);
    expect(second, WA_ERR_INVALID_ARG, "in use by another thread", "a second thread on a busy context");
    pthread_mutex_lock(&g.mu);
    g.release = 1;
    pthread_cond_broadcast(&g.cv);
    pthread_mutex_unlock(&g.mu);
    pthread_join(th, NULL);
    check(a.st == WA_OK, "the first thread's call completes (%s)", wa_status_str(a.st));
    expect(wa_forward(ctx, &desc, &tq, &tk, &tv, &to, NULL), WA_OK, NULL, "the context is free again afterwards");
    wa_context_destroy(ctx);
}

/* ---- varlen offsets ---- */
static void test_varlen_offsets(wa_context *ctx) {
    enum { TQ = 30, H = 2, DV = 8 };
    static float vq[TQ * H * DV], vo[TQ * H * DV], vl[H * TQ];
    wa_attn_desc desc = wa_attn_desc_sliding(4);
    wa_tensor tq = wa_tensor_thd(vq, WA_F32, TQ, H, DV), to = wa_tensor_thd(vo, WA_F32, TQ, H, DV);
    wa_tensor tl = wa_tensor_lse_varlen(vl, H, TQ);
    struct {
        int32_t cu[4];
        int64_t max;
        const char *text, *what;
    } bad[] = {
        {{0, 10, 5, 30}, 30, "decreases", "offsets that decrease"},
        {{0, 10, 20, 29}, 30, "must equal", "last offset not T"},
        {{0, -4, 20, 30}, 30, "decreases", "a negative offset"},
        {{0, 10, 20, 30}, 9, "maximum", "a sequence longer than max_seqlen"},
        {{2, 10, 20, 30}, 30, "must be 0", "first offset not 0"},
    };
    for (size_t c = 0; c < sizeof bad / sizeof bad[0]; c++) {
        wa_varlen s = {3, bad[c].cu, bad[c].cu, bad[c].max, bad[c].max};
        expect(wa_forward_varlen(ctx, &desc, &s, &tq, &tq, &tq, &to, &tl), WA_ERR_SHAPE, bad[c].text, bad[c].what);
    }
    int32_t cu[4] = {0, 10, 20, 30};
    wa_varlen s = {3, cu, cu, 10, 10};
    expect(wa_forward_varlen(ctx, &desc, NULL, &tq, &tq, &tq, &to, &tl), WA_ERR_INVALID_ARG, "NULL", "no varlen descriptor");
    wa_varlen nocu = {3, NULL, cu, 10, 10};
    expect(wa_forward_varlen(ctx, &desc, &nocu, &tq, &tq, &tq, &to, &tl), WA_ERR_INVALID_ARG, "NULL", "NULL offsets");
    wa_varlen negb = {-1, cu, cu, 10, 10};
    expect(wa_forward_varlen(ctx, &desc, &negb, &tq, &tq, &tq, &to, &tl), WA_ERR_SHAPE, "batch", "negative batch");
    wa_tensor batched = wa_tensor_bhnd(vq, WA_F32, 2, H, TQ / 2, DV), batched_o = wa_tensor_bhnd(vo, WA_F32, 2, H, TQ / 2, DV);
    expect(wa_forward_varlen(ctx, &desc, &s, &batched, &batched, &batched, &batched_o, NULL), WA_ERR_SHAPE, "batch dimension 1",
           "varlen tensors with batch 2");
    memset(vq, 0, sizeof vq);
    expect(wa_forward_varlen(ctx, &desc, &s, &tq, &tq, &tq, &to, &tl), WA_OK, NULL, "well-formed offsets");
}

int main(void) {
    wa_rng r;
    wa_rng_seed(&r, 5);
    wa_fill_normal(q, WA_F32, NQ_ELEMS, &r, 1), wa_fill_normal(k, WA_F32, NK_ELEMS, &r, 1);
    wa_fill_normal(v, WA_F32, NK_ELEMS, &r, 1), wa_fill_normal(go, WA_F32, NQ_ELEMS, &r, 1);
    wa_context *ctx;
    wa_context_params params = {0};
    params.threads = 2;
    if (wa_context_create(&params, &ctx) != WA_OK) {
        fprintf(stderr, "context: %s\n", wa_last_error());
        return 1;
    }
    test_windows(ctx);
    test_sizes(ctx);
    test_overlap(ctx);
    test_alignment(ctx);
    test_threads();
    test_environment();
    test_varlen_offsets(ctx);
    wa_context_destroy(ctx);
    return check_summary();
}

/* test_api.c — the public contract outside the numerics: every status code is reachable from
 * bad input and comes with a one-line wa_last_error(); outputs are overwritten, never
 * accumulated into; workspace is linear in the sequence length (and the dense baseline's is
 * not); custom allocators are used and their failure is reported. */
#define _GNU_SOURCE
#include "check.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 1, HQ = 4, HKV = 2, N = 40, D = 16 };
static float q[B * HQ * N * D], k[B * HKV * N * D], v[B * HKV * N * D], o[B * HQ * N * D], go[B * HQ * N * D];
static float dq[B * HQ * N * D], dk[B * HKV * N * D], dv[B * HKV * N * D], lse[B * HQ * N];

typedef struct tensors {
    wa_tensor q, k, v, o, lse, do_, dq, dk, dv;
} tensors;

static tensors fresh(void) {
    tensors t;
    t.q = wa_tensor_bhnd(q, WA_F32, B, HQ, N, D), t.k = wa_tensor_bhnd(k, WA_F32, B, HKV, N, D);
    t.v = wa_tensor_bhnd(v, WA_F32, B, HKV, N, D), t.o = wa_tensor_bhnd(o, WA_F32, B, HQ, N, D);
    t.lse = wa_tensor_lse(lse, B, HQ, N), t.do_ = wa_tensor_bhnd(go, WA_F32, B, HQ, N, D);
    t.dq = wa_tensor_bhnd(dq, WA_F32, B, HQ, N, D), t.dk = wa_tensor_bhnd(dk, WA_F32, B, HKV, N, D);
    t.dv = wa_tensor_bhnd(dv, WA_F32, B, HKV, N, D);
    return t;
}

static wa_status run_both(wa_context *ctx, const wa_attn_desc *d, tensors *t) {
    wa_status s = wa_forward(ctx, d, &t->q, &t->k, &t->v, &t->o, &t->lse);
    if (s != WA_OK) return s;
    return wa_backward(ctx, d, &t->q, &t->k, &t->v, &t->o, &t->lse, &t->do_, &t->dq, &t->dk, &t->dv);
}

static void expect(wa_status got, wa_status want, const char *what) {
    const char *msg = wa_last_error();
    int one_line = msg[0] != '\0' && strchr(msg, '\n') == NULL;
    check(got == want && (want == WA_OK || one_line), "status %-20s for %s%s%s", wa_status_str(want), what,
          got == want ? "" : " (got: ", got == want ? "" : wa_status_str(got));
    if (got != WA_OK) printf("     message: %s\n", msg);
}

static int fail_alloc_after; /* allocations allowed before failing */
static void *counting_alloc(void *user, size_t bytes) {
    (*(int *)user)++;
    if (fail_alloc_after-- <= 0) return NULL;
    void *p = NULL;
    return posix_memalign(&p, 64, bytes) == 0 ? p : NULL;
}
static void counting_free(void *user, void *p) {
    (void)user;
    free(p);
}

int main(void) {
    wa_rng g;
    wa_rng_seed(&g, 11);
    wa_fill_normal(q, WA_F32, sizeof q / 4, &g, 1), wa_fill_normal(k, WA_F32, sizeof k / 4, &g, 1);
    wa_fill_normal(v, WA_F32, sizeof v / 4, &g, 1), wa_fill_normal(go, WA_F32, sizeof go / 4, &g, 1);
    wa_context *ctx;
    expect(wa_context_create(NULL, &ctx), WA_OK, "a context with default parameters");
    wa_attn_desc d = wa_attn_desc_sliding(9);
    tensors t = fresh();
    expect(run_both(ctx, &d, &t), WA_OK, "valid f32 input");

    /* INVALID_ARG */
    expect(wa_forward(ctx, NULL, &t.q, &t.k, &t.v, &t.o, &t.lse), WA_ERR_INVALID_ARG, "a NULL descriptor");
    expect(wa_forward(NULL, &d, &t.q, &t.k, &t.v, &t.o, &t.lse), WA_ERR_INVALID_ARG, "a NULL context");
    expect(wa_forward(ctx, &d, &t.q, &t.k, NULL, &t.o, &t.lse), WA_ERR_INVALID_ARG, "v = NULL");
    wa_attn_desc bad = d;
    bad.window_left = -2;
    expect(wa_forward(ctx, &bad, &t.q, &t.k, &t.v, &t.o, &t.lse), WA_ERR_INVALID_ARG, "window_left = -2");
    bad = d, bad.window_right = -7;
    expect(wa_forward(ctx, &bad, &t.q, &t.k, &t.v, &t.o, &t.lse), WA_ERR_INVALID_ARG, "window_right = -7");
    bad = d, bad.scale = NAN;
    expect(wa_forward(ctx, &bad, &t.q, &t.k, &t.v, &t.o, &t.lse), WA_ERR_INVALID_ARG, "scale = NaN");
    bad = d, bad.softcap = -1;
    expect(wa_forward(ctx, &bad, &t.q, &t.k, &t.v, &t.o, &t.lse), WA_ERR_INVALID_ARG, "softcap = -1");
    tensors x = fresh();
    x.k.data = NULL;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_INVALID_ARG, "k.data = NULL");
    x = fresh();
    expect(wa_backward(ctx, &d, &x.q, &x.k, &x.v, &x.o, NULL, &x.do_, &x.dq, &x.dk, &x.dv), WA_ERR_INVALID_ARG,
           "backward without lse");
    wa_context_params cp = {0};
    wa_context *c2;
    cp.threads = -1;
    expect(wa_context_create(&cp, &c2), WA_ERR_INVALID_ARG, "threads = -1");
    cp.threads = 1, cp.tile_q = 5000;
    expect(wa_context_create(&cp, &c2), WA_ERR_INVALID_ARG, "tile_q = 5000");
    cp.tile_q = 0, cp.algorithm = 9;
    expect(wa_context_create(&cp, &c2), WA_ERR_INVALID_ARG, "algorithm = 9");
    cp.algorithm = WA_ALGO_TILED, cp.cuda_deterministic = 2;
    expect(wa_context_create(&cp, &c2), WA_ERR_INVALID_ARG, "cuda_deterministic = 2");

    /* SHAPE */
    x = fresh(), x.q.shape[3] = 0;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_SHAPE, "D = 0");
    x = fresh(), x.q.shape[3] = x.k.shape[3] = x.v.shape[3] = x.o.shape[3] = 513;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_SHAPE, "D = 513");
    x = fresh(), x.k.shape[3] = 8;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_SHAPE, "head dims of q and k differ");
    x = fresh(), x.q.shape[1] = x.o.shape[1] = 3, x.lse.shape[1] = 3;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_SHAPE, "Hq = 3, Hkv = 2");
    x = fresh(), x.v.shape[2] = 39;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_SHAPE, "k and v lengths differ");
    x = fresh(), x.o.shape[2] = 39;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_SHAPE, "o shape differs from q");
    x = fresh(), x.lse.shape[2] = 39;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_SHAPE, "lse shape wrong");
    x = fresh(), x.k.shape[0] = 2;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_SHAPE, "batch sizes differ");
    x = fresh(), x.q.shape[2] = -1;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_SHAPE, "negative length");
    x = fresh(), x.dk.shape[2] = 1;
    expect(wa_backward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse, &x.do_, &x.dq, &x.dk, &x.dv), WA_ERR_SHAPE,
           "dk shape differs from k");

    /* STRIDE */
    x = fresh(), x.q.stride[3] = 2;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_STRIDE, "head-dim stride 2");
    x = fresh(), x.k.stride[2] = -16;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_STRIDE, "negative stride");
    x = fresh(), x.o.data = q;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_STRIDE, "o overlapping q (in place)");
    x = fresh(), x.dq.stride[2] = 0;
    expect(wa_backward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse, &x.do_, &x.dq, &x.dk, &x.dv), WA_ERR_STRIDE,
           "dq aliasing itself (stride 0)");

    /* DTYPE */
    x = fresh(), x.v.dtype = WA_BF16;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_DTYPE, "v bf16 with q f32");
    x = fresh(), x.lse.dtype = WA_F16;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_DTYPE, "lse f16");
    x = fresh(), x.q.dtype = (wa_dtype)7;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_DTYPE, "unknown dtype 7");

    /* DEVICE */
    x = fresh(), x.k.device = WA_DEVICE_CUDA;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_DEVICE, "q on cpu, k on cuda");
    x = fresh(), x.o.device = (wa_device)5;
    expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_DEVICE, "unknown device 5");

    /* UNSUPPORTED / CUDA */
    if (!wa_device_available(WA_DEVICE_CUDA)) {
        x = fresh();
        x.q.device = x.k.device = x.v.device = x.o.device = x.lse.device = WA_DEVICE_CUDA;
        expect(wa_forward(ctx, &d, &x.q, &x.k, &x.v, &x.o, &x.lse), WA_ERR_UNSUPPORTED, "CUDA tensors without a CUDA device");
        check_skip("status %-20s needs a CUDA device (run on the GPU machine: scripts/cuda_check.sh)", wa_status_str(WA_ERR_CUDA));
    } else {
        check_skip("status %-20s: this build has a CUDA device", wa_status_str(WA_ERR_UNSUPPORTED));
        void *huge = NULL; /* 1 PiB: the runtime refuses it, and the error is not sticky */
        expect(wa_malloc(ctx, WA_DEVICE_CUDA, (size_t)1 << 50, &huge), WA_ERR_CUDA, "a CUDA allocation of 1 PiB");
    }

    /* NO_MEMORY, through a caller's allocator */
    int calls = 0;
    cp = (wa_context_params){0};
    cp.threads = 2, cp.alloc = counting_alloc, cp.free = counting_free, cp.alloc_user = &calls;
    fail_alloc_after = 1; /* the context itself succeeds, the workspace does not */
    wa_context *cmem;
    expect(wa_context_create(&cp, &cmem), WA_OK, "a context with a caller's allocator");
    x = fresh();
    expect(wa_backward(cmem, &d, &x.q, &x.k, &x.v, &x.o, &x.lse, &x.do_, &x.dq, &x.dk, &x.dv), WA_ERR_NO_MEMORY,
           "the allocator returning NULL");
    fail_alloc_after = 1000;
    int before = calls;
    expect(run_both(cmem, &d, &x), WA_OK, "the same call once the allocator works");
    check(calls > before, "workspace comes from the caller's allocator (%d calls)", calls - before);
    wa_context_destroy(cmem);

    /* status strings are distinct */
    int distinct = 1;
    for (int a = WA_OK; a <= WA_ERR_CUDA; a++)
        for (int b2 = a + 1; b2 <= WA_ERR_CUDA; b2++) distinct &= strcmp(wa_status_str(a), wa_status_str(b2)) != 0;
    check(distinct, "wa_status_str names every status differently");

    /* outputs are overwritten: garbage in the output buffers changes nothing */
    x = fresh();
    expect(run_both(ctx, &d, &x), WA_OK, "reference run");
    float ref_dq[sizeof dq / 4], ref_dk[sizeof dk / 4], ref_o[sizeof o / 4];
    memcpy(ref_dq, dq, sizeof dq), memcpy(ref_dk, dk, sizeof dk), memcpy(ref_o, o, sizeof o);
    for (size_t i = 0; i < sizeof dq / 4; i++) dq[i] = 1e3f, o[i] = -7.0f;
    for (size_t i = 0; i < sizeof dk / 4; i++) dk[i] = 5.0f, dv[i] = 5.0f;
    expect(run_both(ctx, &d, &x), WA_OK, "run into garbage-filled outputs");
    check(memcmp(ref_dq, dq, sizeof dq) == 0 && memcmp(ref_dk, dk, sizeof dk) == 0 && memcmp(ref_o, o, sizeof o) == 0,
          "outputs are overwritten, never accumulated into");

    /* workspace: linear in N for the tiled path, quadratic for the dense baseline */
    {
        wa_tensor tq8 = wa_tensor_bhnd(q, WA_BF16, 1, 32, 8192, 256), tk8 = wa_tensor_bhnd(k, WA_BF16, 1, 16, 8192, 256);
        wa_tensor tq32 = wa_tensor_bhnd(q, WA_BF16, 1, 32, 32768, 256), tk32 = wa_tensor_bhnd(k, WA_BF16, 1, 16, 32768, 256);
        wa_attn_desc w = wa_attn_desc_sliding(1024);
        size_t b8 = 0, b32 = 0, d8 = 0;
        wa_workspace_size(ctx, &w, &tq8, &tk8, &tk8, 1, &b8);
        wa_workspace_size(ctx, &w, &tq32, &tk32, &tk32, 1, &b32);
        check(b32 <= 4 * b8 + 1 && b32 < (size_t)64 << 20, "tiled backward workspace at the write-up's shape: %.1f MB at 8K, %.1f MB at 32K (linear, tiny)",
              b8 / 1e6, b32 / 1e6);
        wa_context_params dp = {0};
        dp.algorithm = WA_ALGO_DENSE;
        wa_context *dctx;
        wa_context_create(&dp, &dctx);
        wa_workspace_size(dctx, &w, &tq8, &tk8, &tk8, 1, &d8);
        check(d8 > (size_t)3 * 32 * 8192 * 8192 * 2, "dense baseline backward workspace at 8K: %.2f GB (three score-sized bf16 tensors)", d8 / 1e9);
        wa_context_destroy(dctx);
    }
    wa_context_destroy(ctx);
    return check_summary();
}

/* test_kernels.c — the tiled kernels against the float64 oracle, table-driven, with
 * FlashAttention's criterion (src/ref/case.c): every ISA this CPU runs, two tile
 * configurations, both memory layouts, windows at and around the tile size and far below the
 * sequence length, GQA, Nq < Nk and Nq > Nk, empty rows, unvisited key tiles, softcap.
 * Outputs are poisoned and guarded. Then determinism: 1, 2 and 3 threads bit-identical. */
#define _GNU_SOURCE
#include "check.h"
#include "internal.h"
#include "ref/case.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct tcase {
    int64_t B, Hq, Hkv, Nq, Nk, D, left, right;
    wa_dtype dt;
    float softcap, scale;
    int bnhd;
} tcase;

static const tcase cases[] = {
    /* B Hq Hkv  Nq   Nk   D   left right */
    {1, 2, 1, 300, 300, 64, 63, 0, WA_BF16, 0, 0, 0},     /* sliding window = tile - 1 ... */
    {1, 2, 1, 300, 300, 64, 64, 0, WA_BF16, 0, 0, 0},     /* ... = tile ... */
    {1, 2, 1, 300, 300, 64, 65, 0, WA_BF16, 0, 0, 1},     /* ... = tile + 1, bnhd */
    {2, 4, 2, 257, 257, 72, -1, 0, WA_F16, 0, 0, 0},      /* causal, odd D */
    {1, 4, 1, 130, 301, 40, 20, 5, WA_F32, 0, 0, 1},      /* Nq < Nk, two-sided: unvisited key tiles */
    {1, 2, 2, 301, 130, 33, 17, 0, WA_BF16, 0, 0, 0},     /* Nq > Nk: empty rows at the top */
    {1, 2, 1, 200, 200, 1, -1, -1, WA_F32, 0, 0, 0},      /* D = 1, full */
    {1, 8, 1, 160, 160, 96, 0, 0, WA_BF16, 0, 0, 0},      /* window 1: dq = dk = 0, dv = do */
    {1, 2, 1, 180, 180, 64, 100, 0, WA_F16, 30.0f, 0, 0}, /* softcap */
    {1, 2, 2, 150, 150, 48, -1, 30, WA_F32, 0, 1.0f, 0},  /* (-1, R): one-sided unbounded left, scale 1 */
    {1, 1, 1, 97, 97, 256, 31, 31, WA_BF16, 0, 0, 1},     /* two-sided, D=256 */
    {1, 1, 1, 33, 500, 16, 0, 0, WA_F32, 0, 0, 0},        /* most keys unvisited */
    {1, 2, 1, 0, 50, 32, -1, 0, WA_F32, 0, 0, 0},         /* Nq = 0: dk = dv = 0 */
    {1, 2, 1, 50, 0, 32, -1, -1, WA_F32, 0, 0, 0},        /* Nk = 0: o = 0, lse = -inf */
    {1, 2, 1, 70, 70, 520 - 8, 9, 0, WA_BF16, 0, 0, 0},   /* D = 512 */
    /* batches on the CUDA tensor-core path (D = 64/128/256/512, 16-bit): the batch index reaches the
     * TMA coordinates and the padded lse/δ rows there, which no other case exercises */
    {2, 4, 2, 257, 257, 128, 100, 0, WA_BF16, 0, 0, 1},  /* B = 2, GQA 2, bnhd */
    {3, 2, 1, 140, 300, 256, 40, 8, WA_F16, 0, 0, 0},     /* B = 3, Nq < Nk, two-sided */
    {2, 2, 2, 200, 200, 64, -1, 0, WA_BF16, 10.0f, 0, 0}, /* B = 2, causal, softcap */
    /* ... and on the D = 512 kernels (version 5), which split D between warps */
    {2, 4, 2, 150, 150, 512, 60, 0, WA_F16, 0, 0, 1},     /* B = 2, GQA 2, bnhd */
    {2, 2, 1, 100, 130, 512, -1, 0, WA_BF16, 0, 0, 0},    /* B = 2, Nq < Nk, causal */
    /* a negative scale: the CUDA Hopper forwards fold a positive scale into exp2 and leave these
     * to the older kernels without a softcap (src/cuda/sm90/fwd.cu); with one they take them */
    {1, 2, 1, 200, 200, 128, 60, 0, WA_BF16, 0, -0.08f, 0},  /* D = 128: version 2/3 forward */
    {1, 2, 1, 150, 150, 512, -1, 0, WA_F16, 0, -0.05f, 0},   /* D = 512: the mma.sync forward */
    {1, 2, 2, 180, 180, 64, 50, 0, WA_BF16, 20.0f, -0.1f, 1}, /* softcap: the Hopper forward */
};

static const int tile_configs[][2] = {{64, 64}, {16, 48}};

static void run_table(const char *isa, wa_device device) {
    for (size_t t = 0; t < sizeof tile_configs / sizeof *tile_configs; t++) {
        wa_context_params kp = {0}, bp = {0};
        kp.threads = 2, kp.tile_q = tile_configs[t][0], kp.tile_k = tile_configs[t][1];
        bp.threads = 2, bp.algorithm = WA_ALGO_DENSE;
        wa_context *kctx, *bctx;
        if (wa_context_create(&kp, &kctx) != WA_OK || wa_context_create(&bp, &bctx) != WA_OK) {
            check_fail("context: %s", wa_last_error());
            return;
        }
        for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
            const tcase *tc = &cases[i];
            wa_case c = {tc->B, tc->Hq, tc->Hkv, tc->Nq, tc->Nk, tc->D, tc->dt, tc->bnhd, tc->left, tc->right,
                         tc->scale, tc->softcap, 1000 + i, device, 0, NULL, NULL};
            wa_case_result r;
            char name[200];
            wa_case_name(&c, name, sizeof name);
            wa_run_case(&c, kctx, bctx, 3.0, &r);
            check(r.pass, "kernel %s tiles=%dx%d %s o=%.2g/%.2g dq=%.2g/%.2g dk=%.2g/%.2g dv=%.2g/%.2g%s%s%s", isa,
                  tile_configs[t][0], tile_configs[t][1], name, r.err[0], r.bound[0], r.err[2], r.bound[2], r.err[3],
                  r.bound[3], r.err[4], r.bound[4], r.used_grad_mult ? " (gradient bound 3x)" : "",
                  r.detail[0] ? " : " : "", r.detail);
        }
        wa_context_destroy(kctx);
        wa_context_destroy(bctx);
    }
}

/* Same inputs, 1 / 2 / 3 threads: every output byte identical. */
static void determinism(void) {
    /* long enough for several backward chunks (32 key tiles each), so both dQ paths run */
    const int64_t B = 1, Hq = 4, Hkv = 2, N = 2500, D = 80;
    size_t nq = (size_t)(B * Hq * N * D), nk = (size_t)(B * Hkv * N * D);
    wa_rng g;
    wa_rng_seed(&g, 7);
    uint16_t *q = malloc(nq * 2), *k = malloc(nk * 2), *v = malloc(nk * 2), *go = malloc(nq * 2);
    wa_fill_normal(q, WA_BF16, nq, &g, 1), wa_fill_normal(k, WA_BF16, nk, &g, 1), wa_fill_normal(v, WA_BF16, nk, &g, 1);
    wa_fill_normal(go, WA_BF16, nq, &g, 1);
    wa_tensor tq = wa_tensor_bhnd(q, WA_BF16, B, Hq, N, D), tk = wa_tensor_bhnd(k, WA_BF16, B, Hkv, N, D);
    wa_tensor tv = wa_tensor_bhnd(v, WA_BF16, B, Hkv, N, D), tdo = wa_tensor_bhnd(go, WA_BF16, B, Hq, N, D);
    wa_attn_desc desc = wa_attn_desc_sliding(77);
    uint16_t *ref[4] = {0};
    const int threads[3] = {1, 2, 3};
    for (int t = 0; t < 3; t++) {
        wa_context_params cp = {0};
        cp.threads = threads[t], cp.tile_q = 32, cp.tile_k = 32;
        wa_context *ctx;
        wa_context_create(&cp, &ctx);
        uint16_t *o = malloc(nq * 2), *dq = malloc(nq * 2), *dk = malloc(nk * 2), *dv = malloc(nk * 2);
        float *lse = malloc((size_t)(B * Hq * N) * 4);
        wa_tensor to = wa_tensor_bhnd(o, WA_BF16, B, Hq, N, D), tl = wa_tensor_lse(lse, B, Hq, N);
        wa_tensor tdq = wa_tensor_bhnd(dq, WA_BF16, B, Hq, N, D), tdk = wa_tensor_bhnd(dk, WA_BF16, B, Hkv, N, D);
        wa_tensor tdv = wa_tensor_bhnd(dv, WA_BF16, B, Hkv, N, D);
        int ok = wa_forward(ctx, &desc, &tq, &tk, &tv, &to, &tl) == WA_OK &&
                 wa_backward(ctx, &desc, &tq, &tk, &tv, &to, &tl, &tdo, &tdq, &tdk, &tdv) == WA_OK;
        uint16_t *outs[4] = {o, dq, dk, dv};
        size_t sizes[4] = {nq, nq, nk, nk};
        if (t == 0) {
            for (int i = 0; i < 4; i++) ref[i] = outs[i];
            check(ok, "determinism: reference run with 1 thread");
        } else {
            int same = ok;
            for (int i = 0; i < 4; i++) same &= memcmp(ref[i], outs[i], sizes[i] * 2) == 0;
            check(same, "determinism: %d threads bit-identical to 1 thread (o, dq, dk, dv)", threads[t]);
            for (int i = 0; i < 4; i++) free(outs[i]);
        }
        free(lse);
        wa_context_destroy(ctx);
    }
    for (int i = 0; i < 4; i++) free(ref[i]);
    free(q), free(k), free(v), free(go);
}

int main(void) {
    static const char *const isas[] = {"avx512bf16", "avx512", "avx2", "neon", "generic"};
    /* WINATTN_ISA given by the caller: that ISA's kernels only (tests/extra_checks.sh under qemu) */
    char only[32] = "";
    if (getenv("WINATTN_ISA")) snprintf(only, sizeof only, "%s", getenv("WINATTN_ISA"));
    for (size_t i = 0; i < sizeof isas / sizeof *isas; i++) {
        if (only[0] && strcmp(only, isas[i]) != 0) {
            check_skip("kernels %s: not selected (WINATTN_ISA=%s)", isas[i], only);
            continue;
        }
        setenv("WINATTN_ISA", isas[i], 1);
        if (strcmp(wa_cpu_isa(), isas[i]) != 0) {
            check_skip("kernels %s: this CPU cannot run it", isas[i]);
            continue;
        }
        run_table(isas[i], WA_DEVICE_CPU);
    }
    unsetenv("WINATTN_ISA");
    if (wa_device_available(WA_DEVICE_CUDA)) run_table("cuda", WA_DEVICE_CUDA);
    else check_skip("kernels cuda: no usable CUDA device in this build or machine");
    determinism();
    return check_summary();
}

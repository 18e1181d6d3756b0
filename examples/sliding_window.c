/* sliding_window.c — the README's example, complete: one Gemma-4-style sliding-window layer
 * (bf16, window 1024, scale 1) forward and backward through the installed library.
 * Build: cc sliding_window.c $(pkg-config --cflags --libs winattn) -o sliding_window */
#include <winattn.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static uint16_t *random_bf16(size_t n, uint32_t seed) {
    uint16_t *p = malloc(n * sizeof *p);
    for (size_t i = 0; p && i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = (uint16_t)(0x3c00u | (seed >> 25) | ((seed >> 16) & 0x8000u)); /* small values, both signs */
    }
    return p;
}

int main(void) {
    const int64_t B = 1, Hq = 8, Hkv = 4, N = 3000, D = 128;
    size_t nq = (size_t)(B * Hq * N * D), nk = (size_t)(B * Hkv * N * D);
    uint16_t *q_ptr = random_bf16(nq, 1), *k_ptr = random_bf16(nk, 2), *v_ptr = random_bf16(nk, 3);
    uint16_t *do_ptr = random_bf16(nq, 4), *o_ptr = malloc(nq * 2), *dq_ptr = malloc(nq * 2);
    uint16_t *dk_ptr = malloc(nk * 2), *dv_ptr = malloc(nk * 2);
    float *lse_ptr = malloc((size_t)(B * Hq * N) * sizeof(float));
    if (!q_ptr || !k_ptr || !v_ptr || !do_ptr || !o_ptr || !dq_ptr || !dk_ptr || !dv_ptr || !lse_ptr) return 1;

    wa_context *ctx;
    if (wa_context_create(NULL, &ctx) != WA_OK) return fprintf(stderr, "winattn: %s\n", wa_last_error()), 1;
    wa_attn_desc attn = wa_attn_desc_sliding(1024); /* window (1023, 0) */
    attn.scale = 1.0f;                              /* Gemma 4; 0 means 1/sqrt(D) */

    wa_tensor q = wa_tensor_bhnd(q_ptr, WA_BF16, B, Hq, N, D);
    wa_tensor k = wa_tensor_bhnd(k_ptr, WA_BF16, B, Hkv, N, D);
    wa_tensor v = wa_tensor_bhnd(v_ptr, WA_BF16, B, Hkv, N, D);
    wa_tensor o = wa_tensor_bhnd(o_ptr, WA_BF16, B, Hq, N, D);
    wa_tensor lse = wa_tensor_lse(lse_ptr, B, Hq, N);
    wa_tensor do_ = wa_tensor_bhnd(do_ptr, WA_BF16, B, Hq, N, D);
    wa_tensor dq = wa_tensor_bhnd(dq_ptr, WA_BF16, B, Hq, N, D);
    wa_tensor dk = wa_tensor_bhnd(dk_ptr, WA_BF16, B, Hkv, N, D);
    wa_tensor dv = wa_tensor_bhnd(dv_ptr, WA_BF16, B, Hkv, N, D);

    if (wa_forward(ctx, &attn, &q, &k, &v, &o, &lse) != WA_OK ||
        wa_backward(ctx, &attn, &q, &k, &v, &o, &lse, &do_, &dq, &dk, &dv) != WA_OK) {
        fprintf(stderr, "winattn: %s\n", wa_last_error());
        return 1;
    }
    printf("winattn %s (%s kernels): forward and backward of a %lld-token sliding-window layer done, lse[0] = %.4f\n",
           wa_version(), wa_cpu_kernels(), (long long)N, lse_ptr[0]);
    wa_context_destroy(ctx);
    free(q_ptr), free(k_ptr), free(v_ptr), free(do_ptr), free(o_ptr), free(dq_ptr), free(dk_ptr), free(dv_ptr), free(lse_ptr);
    return 0;
}

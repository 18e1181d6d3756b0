/* oracle.c — see oracle.h. Row by row, straight from the definitions in DESIGN.md section 1:
 *   s_j = softcap(scale * q_i . k_j) for visible j     p = softmax(s)     o_i = sum_j p_j v_j
 *   lse_i = log sum_j exp(s_j)
 *   dp_j = dO_i . v_j    ds_j = p_j (dp_j - sum_l p_l dp_l) * softcap'(.) * scale
 *   dq_i = sum_j ds_j k_j    dk_j += ds_j q_i    dv_j += p_j dO_i   (summed over the GQA group)
 * The backward uses the softmax VJP's own sum (sum_l p_l dp_l), not the kernels' dO . O, so the
 * two are independent derivations of the same quantity. */
#include "oracle.h"
#include "../convert.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The oracle spends its time in two loops over D: on x86-64 the compiler builds each twice, for
 * AVX2 and for the baseline ISA, and the loader picks; both builds compute the same roundings in
 * the same order, so results do not depend on the CPU. */
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define REF_HOT __attribute__((target_clones("avx2", "default")))
#define REF_X86 1
#endif
#endif
#ifndef REF_HOT
#define REF_HOT
#endif

typedef double v4d __attribute__((vector_size(32)));

/* four partial sums (lane l takes the terms d = l mod 4), combined as (s0 + s1) + (s2 + s3) */
REF_HOT static double dot(const double *a, const double *b, int64_t n) {
    v4d s = {0, 0, 0, 0}, x, y;
    int64_t d = 0;
    for (; d + 4 <= n; d += 4) {
        memcpy(&x, a + d, sizeof x), memcpy(&y, b + d, sizeof y);
        s += x * y;
    }
    double s0 = s[0];
    for (; d < n; d++) s0 += a[d] * b[d];
    return (s0 + s[1]) + (s[2] + s[3]);
}

REF_HOT static void axpy(double *y, double a, const double *x, int64_t n) {
    int64_t d = 0;
    for (; d + 4 <= n; d += 4) {
        v4d xv, yv;
        memcpy(&xv, x + d, sizeof xv), memcpy(&yv, y + d, sizeof yv);
        yv += a * xv;
        memcpy(y + d, &yv, sizeof yv);
    }
    for (; d < n; d++) y[d] += a * x[d];
}

void wa_oracle(const wa_oracle_shape *s, const double *q, const double *k, const double *v, const double *do_,
               double *o, double *lse, double *dq, double *dk, double *dv) {
    const int64_t D = s->D, Nq = s->Nq, Nk = s->Nk, group = s->Hq / s->Hkv;
    double *sc = malloc((size_t)(Nk > 0 ? Nk : 1) * sizeof *sc);  /* scores, then p */
    double *th = malloc((size_t)(Nk > 0 ? Nk : 1) * sizeof *th);  /* tanh(raw / cap) */
    double *dp = malloc((size_t)(Nk > 0 ? Nk : 1) * sizeof *dp);
    int64_t *vis = malloc((size_t)(Nk > 0 ? Nk : 1) * sizeof *vis);
    if (!sc || !th || !dp || !vis) abort(); /* test-only code: no way to continue */
    if (do_) {
        memset(dk, 0, (size_t)(s->B * s->Hkv * Nk * D) * sizeof *dk);
        memset(dv, 0, (size_t)(s->B * s->Hkv * Nk * D) * sizeof *dv);
    }
    for (int64_t b = 0; b < s->B; b++)
        for (int64_t h = 0; h < s->Hq; h++) {
            int64_t hk = h / group;
            const double *K = k + (b * s->Hkv + hk) * Nk * D, *V = v + (b * s->Hkv + hk) * Nk * D;
            for (int64_t i = 0; i < Nq; i++) {
                int64_t row = (b * s->Hq + h) * Nq + i;
                const double *Q = q + row * D;
                int64_t n = 0;
                double mx = -INFINITY;
                for (int64_t j = 0; j < Nk; j++) {
                    if (!wa_visible(&s->win, i, j)) continue;
                    double raw = s->scale * dot(Q, K + j * D, D);
                    th[n] = s->softcap > 0 ? tanh(raw / s->softcap) : 0.0;
                    sc[n] = s->softcap > 0 ? s->softcap * th[n] : raw;
                    mx = fmax(mx, sc[n]);
                    vis[n++] = j;
                }
                if (o) memset(o + row * D, 0, (size_t)D * sizeof *o);
                if (do_) memset(dq + row * D, 0, (size_t)D * sizeof *dq);
                if (n == 0) {
                    if (lse) lse[row] = -INFINITY;
                    continue;
                }
                double sum = 0;
                for (int64_t t = 0; t < n; t++) sum += sc[t] = exp(sc[t] - mx);
                for (int64_t t = 0; t < n; t++) sc[t] /= sum;
                if (lse) lse[row] = mx + log(sum);
                if (o)
                    for (int64_t t = 0; t < n; t++) axpy(o + row * D, sc[t], V + vis[t] * D, D);
                if (!do_) continue;
                const double *G = do_ + row * D;
                double pdp = 0;
                for (int64_t t = 0; t < n; t++) {
                    dp[t] = dot(G, V + vis[t] * D, D);
                    pdp += sc[t] * dp[t];
                }
                double *dK = dk + (b * s->Hkv + hk) * Nk * D, *dV = dv + (b * s->Hkv + hk) * Nk * D;
                for (int64_t t = 0; t < n; t++) {
                    double ds = sc[t] * (dp[t] - pdp) * s->scale;
                    if (s->softcap > 0) ds *= 1.0 - th[t] * th[t];
                    axpy(dq + row * D, ds, K + vis[t] * D, D);
                    axpy(dK + vis[t] * D, ds, Q, D);
                    axpy(dV + vis[t] * D, sc[t], G, D);
                }
            }
        }
    free(sc);
    free(th);
    free(dp);
    free(vis);
}

void wa_tensor_to_f64(const wa_tensor *t, double *out) {
    size_t es = wa_dtype_size(t->dtype);
    for (int64_t b = 0; b < t->shape[0]; b++)
        for (int64_t h = 0; h < t->shape[1]; h++)
            for (int64_t n = 0; n < t->shape[2]; n++) {
                const char *row = (const char *)t->data + (b * t->stride[0] + h * t->stride[1] + n * t->stride[2]) * (int64_t)es;
                for (int64_t d = 0; d < t->shape[3]; d++) {
                    double x;
                    if (t->dtype == WA_F32) {
                        float f;
                        memcpy(&f, row + d * 4, 4);
                        x = f;
                    } else {
                        uint16_t u;
                        memcpy(&u, row + d * 2, 2);
                        x = t->dtype == WA_BF16 ? wa_bf16_to_f32(u) : wa_f16_to_f32(u);
                    }
                    *out++ = x;
                }
            }
}

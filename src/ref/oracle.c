/* oracle.c — see oracle.h. Row by row, straight from the definitions in docs/design.md §1:
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

/* ---- the low-precision baseline (oracle.h: wa_baseline) ----
 * float32 arithmetic, one op at a time, with the dtype rounding at the op boundaries that
 * docs/algorithm.md section 4 lists. Dot products over D run as one fused chain (a GEMM's
 * register accumulation); longer sums over keys or query rows run in blocks of BASE_KC terms,
 * each block summed from zero and the block sums added in order (a BLAS sgemm's k-blocking);
 * row reductions over keys (softmax sum, rowsum(P dP)) keep BASE_LANES partial sums by key index
 * mod BASE_LANES, added pairwise at the end (a framework's vectorised reduction); the GQA group's
 * dK and dV are summed over heads pairwise (a framework's sum over the expanded head axis). Block
 * and lane boundaries are in absolute key and row indices, as over the full masked [Nq, Nk]
 * matrices: the masked entries a framework would add are exact zeros. */
#define BASE_KC 256
#define BASE_LANES 16

static float rnd(wa_dtype dt, float x) { return wa_round_to((int)dt, x); }

/* The baseline's two hot loops, with a*b + c rounded once (fmaf), as the FMA of a GEMM's
 * micro-kernel. On x86-64 CPUs with FMA they run 8 lanes at a time (the same fmaf per element, in
 * the same order); elsewhere fmaf is an instruction (aarch64) or a libm call. */

/* out[j] = a . B[:, j] for j in [j0, j1], B [n x ld] (a transposed K or V): each one chain of
 * fused multiply-adds over the n terms in order, as a GEMM's register accumulation */
static void dots32(float *out, const float *a, const float *B, int64_t ld, int64_t n, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j <= j1; j++) out[j] = 0.0f;
    for (int64_t d = 0; d < n; d++)
        for (int64_t j = j0; j <= j1; j++) out[j] = fmaf(a[d], B[d * ld + j], out[j]);
}

/* y += a x over n elements, one fused multiply-add each */
static void axpy32(float *y, float a, const float *x, int64_t n) {
    for (int64_t d = 0; d < n; d++) y[d] = fmaf(a, x[d], y[d]);
}

#if defined(REF_X86)
#include <immintrin.h>
__attribute__((target("avx2,fma"))) static void dots32_fma(float *out, const float *a, const float *B, int64_t ld, int64_t n,
                                                          int64_t j0, int64_t j1) {
    for (int64_t j = j0; j <= j1; j++) out[j] = 0.0f;
    for (int64_t d = 0; d < n; d++) {
        const float *row = B + d * ld;
        __m256 av = _mm256_set1_ps(a[d]);
        int64_t j = j0;
        for (; j + 8 <= j1 + 1; j += 8)
            _mm256_storeu_ps(out + j, _mm256_fmadd_ps(av, _mm256_loadu_ps(row + j), _mm256_loadu_ps(out + j)));
        for (; j <= j1; j++) out[j] = fmaf(a[d], row[j], out[j]);
    }
}
__attribute__((target("avx2,fma"))) static void axpy32_fma(float *y, float a, const float *x, int64_t n) {
    __m256 av = _mm256_set1_ps(a);
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) _mm256_storeu_ps(y + d, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
    for (; d < n; d++) y[d] = fmaf(a, x[d], y[d]);
}
static int cpu_has_fma(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#define DOTS32(fma, ...) ((fma) ? dots32_fma(__VA_ARGS__) : dots32(__VA_ARGS__))
#define AXPY32(fma, ...) ((fma) ? axpy32_fma(__VA_ARGS__) : axpy32(__VA_ARGS__))
#else
static int cpu_has_fma(void) { return 0; }
#define DOTS32(fma, ...) ((void)(fma), dots32(__VA_ARGS__))
#define AXPY32(fma, ...) ((void)(fma), axpy32(__VA_ARGS__))
#endif

/* [n x D] -> [D x n] */
static float *transposed(const float *x, int64_t n, int64_t D) {
    float *t = malloc((size_t)(n * D + 1) * sizeof *t);
    if (!t) abort();
    for (int64_t r = 0; r < n; r++)
        for (int64_t d = 0; d < D; d++) t[d * n + r] = x[r * D + d];
    return t;
}

static float lanes_sum(float *lanes) {
    for (int w = BASE_LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lanes[l] += lanes[l + w];
    return lanes[0];
}

/* acc[0..n) += blk[0..n); blk = 0: one block of a blocked sum is done */
static void flush_block(float *acc, float *blk, int64_t n) {
    for (int64_t x = 0; x < n; x++) acc[x] += blk[x], blk[x] = 0.0f;
}

/* heads[g] (group arrays of n floats each) summed pairwise into heads[0] */
static void pairwise_heads(float *heads, int64_t group, int64_t n) {
    for (int64_t step = 1; step < group; step *= 2)
        for (int64_t g = 0; g + step < group; g += 2 * step)
            for (int64_t x = 0; x < n; x++) heads[g * n + x] += heads[(g + step) * n + x];
}

static float *f32_copy(const double *src, size_t n) {
    float *dst = malloc((n ? n : 1) * sizeof *dst);
    if (!dst) abort(); /* test-only code */
    for (size_t x = 0; x < n; x++) dst[x] = (float)src[x]; /* exact: the inputs are dtype values */
    return dst;
}

void wa_baseline(const wa_oracle_shape *s, wa_dtype dt, const double *q, const double *k, const double *v,
                 const double *do_, double *o, double *lse, double *dq, double *dk, double *dv) {
    const int64_t D = s->D, Nq = s->Nq, Nk = s->Nk, group = s->Hq / s->Hkv;
    const float scale = (float)s->scale, cap = (float)s->softcap;
    const int fma = cpu_has_fma();
    const size_t nk1 = (size_t)(Nk > 0 ? Nk : 1);
    float *S = malloc(nk1 * sizeof *S), *P = malloc(nk1 * sizeof *P), *dP = malloc(nk1 * sizeof *dP);
    float *acc = malloc((size_t)(D + 1) * sizeof *acc), *blk = malloc((size_t)(D + 1) * sizeof *blk);
    float *dKh = do_ ? calloc((size_t)group * nk1 * (size_t)D + 1, sizeof *dKh) : NULL;
    float *dVh = do_ ? calloc((size_t)group * nk1 * (size_t)D + 1, sizeof *dVh) : NULL;
    float *dKb = do_ ? calloc(nk1 * (size_t)D + 1, sizeof *dKb) : NULL, *dVb = do_ ? calloc(nk1 * (size_t)D + 1, sizeof *dVb) : NULL;
    if (!S || !P || !dP || !acc || !blk || (do_ && (!dKh || !dVh || !dKb || !dVb))) abort();
    for (int64_t b = 0; b < s->B; b++)
        for (int64_t hk = 0; hk < s->Hkv; hk++) {
            size_t kv0 = (size_t)((b * s->Hkv + hk) * Nk * D);
            float *K = f32_copy(k + kv0, (size_t)(Nk * D)), *V = f32_copy(v + kv0, (size_t)(Nk * D));
            float *KT = transposed(K, Nk, D), *VT = transposed(V, Nk, D);
            if (do_) {
                memset(dKh, 0, (size_t)group * nk1 * (size_t)D * sizeof *dKh);
                memset(dVh, 0, (size_t)group * nk1 * (size_t)D * sizeof *dVh);
            }
            for (int64_t g = 0; g < group; g++) {
                int64_t h = hk * group + g;
                size_t q0 = (size_t)((b * s->Hq + h) * Nq * D);
                float *Q = f32_copy(q + q0, (size_t)(Nq * D)), *G = do_ ? f32_copy(do_ + q0, (size_t)(Nq * D)) : NULL;
                float *dKg = do_ ? dKh + (size_t)g * nk1 * (size_t)D : NULL, *dVg = do_ ? dVh + (size_t)g * nk1 * (size_t)D : NULL;
                for (int64_t i = 0; i < Nq; i++) {
                    int64_t row = (b * s->Hq + h) * Nq + i;
                    const float *Qi = Q + i * D;
                    int64_t first = Nk, last = -1; /* the visible keys, an interval (docs/algorithm.md section 1) */
                    for (int64_t j = 0; j < Nk; j++)
                        if (wa_visible(&s->win, i, j)) first = first < j ? first : j, last = j;
                    /* scores: S = round(scale * Q K^T), softcapped (rounded again); masked keys are never read */
                    DOTS32(fma, S, Qi, KT, Nk, D, first, last);
                    for (int64_t j = first; j <= last; j++) {
                        float x = rnd(dt, S[j] * scale);
                        S[j] = cap > 0 ? rnd(dt, cap * tanhf(x / cap)) : x;
                    }
                    if (o) memset(o + row * D, 0, (size_t)D * sizeof *o);
                    if (do_) memset(dq + row * D, 0, (size_t)D * sizeof *dq);
                    if (last < 0) { /* sees no key */
                        if (lse) lse[row] = -INFINITY;
                        continue;
                    }
                    /* P = round(softmax(S)), in f32 */
                    float mx = -INFINITY, lanes[BASE_LANES] = {0};
                    for (int64_t j = first; j <= last; j++) mx = fmaxf(mx, S[j]);
                    for (int64_t j = first; j <= last; j++) lanes[j % BASE_LANES] += P[j] = expf(S[j] - mx);
                    float sum = lanes_sum(lanes);
                    for (int64_t j = first; j <= last; j++) P[j] = rnd(dt, P[j] / sum);
                    if (lse) lse[row] = mx + logf(sum);
                    /* O = round(P V), blocked over keys */
                    if (o) {
                        memset(acc, 0, (size_t)D * sizeof *acc), memset(blk, 0, (size_t)D * sizeof *blk);
                        for (int64_t j = first; j <= last; j++) {
                            AXPY32(fma, blk, P[j], V + j * D, D);
                            if (j == last || (j + 1) % BASE_KC == 0) flush_block(acc, blk, D);
                        }
                        for (int64_t d = 0; d < D; d++) o[row * D + d] = rnd(dt, acc[d]);
                    }
                    if (!do_) continue;
                    /* dP = round(dO V^T); dS = round(P (dP - rowsum(P dP))), times softcap' (rounded) */
                    const float *Gi = G + i * D;
                    float pl[BASE_LANES] = {0};
                    DOTS32(fma, dP, Gi, VT, Nk, D, first, last);
                    for (int64_t j = first; j <= last; j++) {
                        dP[j] = rnd(dt, dP[j]);
                        pl[j % BASE_LANES] = fmaf(P[j], dP[j], pl[j % BASE_LANES]);
                    }
                    float pdp = lanes_sum(pl);
                    for (int64_t j = first; j <= last; j++) {
                        float ds = rnd(dt, P[j] * (dP[j] - pdp));
                        if (cap > 0) {
                            float t = S[j] / cap;
                            ds = rnd(dt, ds * (1.0f - t * t));
                        }
                        dP[j] = ds; /* dP becomes dS */
                    }
                    /* dQ = round(scale * dS K), blocked over keys */
                    memset(acc, 0, (size_t)D * sizeof *acc), memset(blk, 0, (size_t)D * sizeof *blk);
                    for (int64_t j = first; j <= last; j++) {
                        AXPY32(fma, blk, dP[j], K + j * D, D);
                        if (j == last || (j + 1) % BASE_KC == 0) flush_block(acc, blk, D);
                    }
                    for (int64_t d = 0; d < D; d++) dq[row * D + d] = rnd(dt, acc[d] * scale);
                    /* this head's dK += dS^T Q, dV += P^T dO, blocked over query rows */
                    for (int64_t j = first; j <= last; j++) {
                        AXPY32(fma, dKb + j * D, dP[j], Qi, D);
                        AXPY32(fma, dVb + j * D, P[j], Gi, D);
                    }
                    if (i == Nq - 1 || (i + 1) % BASE_KC == 0) {
                        flush_block(dKg, dKb, Nk * D);
                        flush_block(dVg, dVb, Nk * D);
                    }
                }
                free(Q), free(G);
            }
            if (do_) { /* the group's heads summed pairwise, then dK = round(scale * sum), dV = round(sum) */
                pairwise_heads(dKh, group, (int64_t)nk1 * D);
                pairwise_heads(dVh, group, (int64_t)nk1 * D);
                for (int64_t x = 0; x < Nk * D; x++) {
                    dk[kv0 + (size_t)x] = rnd(dt, dKh[x] * scale);
                    dv[kv0 + (size_t)x] = rnd(dt, dVh[x]);
                }
            }
            free(K), free(V), free(KT), free(VT);
        }
    free(S), free(P), free(dP), free(acc), free(blk), free(dKh), free(dVh), free(dKb), free(dVb);
}

/* test_oracle.c — the float64 oracle checked against central finite differences of
 * L = sum(dO * o) with respect to q, k and v, on small shapes that exercise GQA, Nq != Nk,
 * windows on both sides, empty rows and softcap. Also: softmax rows of the forward sum to one
 * (o of a constant v equals v), and empty rows give o = 0, lse = -inf. */
#include "check.h"
#include "ref/oracle.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct fd_case {
    int64_t B, Hq, Hkv, Nq, Nk, D, left, right;
    double softcap;
} fd_case;

static double loss(const wa_oracle_shape *s, const double *q, const double *k, const double *v, const double *go,
                   double *o) {
    wa_oracle(s, q, k, v, NULL, o, NULL, NULL, NULL, NULL);
    double L = 0;
    for (int64_t i = 0; i < s->B * s->Hq * s->Nq * s->D; i++) L += go[i] * o[i];
    return L;
}

static void fd_check(const fd_case *c, uint64_t seed) {
    wa_oracle_shape s = {c->B, c->Hq, c->Hkv, c->Nq, c->Nk, c->D, 1.0 / sqrt((double)c->D), c->softcap,
                         {c->Nq, c->Nk, c->left, c->right}};
    size_t nq = (size_t)(c->B * c->Hq * c->Nq * c->D), nk = (size_t)(c->B * c->Hkv * c->Nk * c->D);
    double *q = malloc(nq * 8), *k = malloc(nk * 8), *v = malloc(nk * 8), *go = malloc(nq * 8), *o = malloc(nq * 8);
    double *dq = malloc(nq * 8), *dk = malloc(nk * 8), *dv = malloc(nk * 8);
    wa_rng g;
    wa_rng_seed(&g, seed);
    for (size_t i = 0; i < nq; i++) q[i] = 1.5 * wa_rng_normal(&g), go[i] = wa_rng_normal(&g);
    for (size_t i = 0; i < nk; i++) k[i] = 1.5 * wa_rng_normal(&g), v[i] = wa_rng_normal(&g);
    wa_oracle(&s, q, k, v, go, o, NULL, dq, dk, dv);
    double *xs[3] = {q, k, v}, *gs[3] = {dq, dk, dv};
    size_t ns[3] = {nq, nk, nk};
    const char *names[3] = {"dq", "dk", "dv"};
    for (int t = 0; t < 3; t++) {
        double worst = 0, scale = 0;
        for (size_t i = 0; i < ns[t]; i++) {
            const double h = 1e-5;
            double x0 = xs[t][i];
            xs[t][i] = x0 + h;
            double lp = loss(&s, q, k, v, go, o);
            xs[t][i] = x0 - h;
            double lm = loss(&s, q, k, v, go, o);
            xs[t][i] = x0;
            double fd = (lp - lm) / (2 * h);
            worst = fmax(worst, fabs(fd - gs[t][i]));
            scale = fmax(scale, fabs(gs[t][i]));
        }
        check(worst <= 1e-7 * fmax(1.0, scale), "oracle vs finite differences %s B=%lld Hq=%lld Hkv=%lld Nq=%lld Nk=%lld D=%lld win=(%lld,%lld) cap=%g max|fd-analytic|=%.2g (max|grad|=%.2g)",
              names[t], (long long)c->B, (long long)c->Hq, (long long)c->Hkv, (long long)c->Nq, (long long)c->Nk,
              (long long)c->D, (long long)c->left, (long long)c->right, c->softcap, worst, scale);
    }
    free(q), free(k), free(v), free(go), free(o), free(dq), free(dk), free(dv);
}

static void forward_sanity(void) {
    /* v constant along keys: every nonempty row of o equals it; rows with no key are 0 / -inf */
    wa_oracle_shape s = {1, 2, 1, 9, 5, 3, 0.7, 0, {9, 5, 1, 0}};
    double q[2 * 9 * 3], k[5 * 3], v[5 * 3], o[2 * 9 * 3], lse[2 * 9];
    wa_rng g;
    wa_rng_seed(&g, 3);
    for (int i = 0; i < 54; i++) q[i] = wa_rng_normal(&g);
    for (int j = 0; j < 5; j++)
        for (int d = 0; d < 3; d++) k[j * 3 + d] = wa_rng_normal(&g), v[j * 3 + d] = d + 1.0;
    wa_oracle(&s, q, k, v, NULL, o, lse, NULL, NULL, NULL);
    int ok = 1;
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 9; i++) {
            int empty = 1;
            for (int j = 0; j < 5; j++) empty &= !wa_visible(&s.win, i, j);
            for (int d = 0; d < 3; d++) {
                double want = empty ? 0.0 : d + 1.0;
                ok &= fabs(o[(h * 9 + i) * 3 + d] - want) < 1e-14;
            }
            ok &= empty ? isinf(lse[h * 9 + i]) && lse[h * 9 + i] < 0 : isfinite(lse[h * 9 + i]);
        }
    check(ok, "oracle forward: probabilities sum to 1, empty rows (Nq > Nk) give o = 0 and lse = -inf");
}

int main(void) {
    static const fd_case cases[] = {
        {1, 1, 1, 5, 5, 4, -1, -1, 0},  /* full */
        {1, 2, 1, 6, 6, 3, -1, 0, 0},   /* causal, GQA 2 */
        {2, 4, 2, 7, 4, 2, 1, 0, 0},    /* Nq > Nk: empty rows */
        {1, 2, 2, 3, 8, 5, 2, 1, 0},    /* Nq < Nk, two-sided: unseen keys */
        {1, 2, 1, 6, 6, 4, 2, 0, 0.8},  /* softcap, small so tanh bends */
        {1, 1, 1, 5, 5, 3, 0, 0, 0},    /* window 1: dq = dk = 0 */
        {1, 1, 1, 6, 6, 3, -1, 2, 0},   /* (-1, R) */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) fd_check(&cases[i], 100 + i);
    forward_sanity();
    return check_summary();
}

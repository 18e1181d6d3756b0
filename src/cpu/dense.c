/* dense.c — the baseline: attention the way a framework's unfused fallback computes it.
 *
 * One op at a time over whole tensors: a [Nq, Nk] boolean mask, scores S [B, Hq, Nq, Nk], the
 * probabilities P, and in the backward dP and dS, each materialised in the input dtype (every
 * GEMM accumulates in f32 and rounds its output to the dtype; softmax runs in f32 on the rounded
 * scores and rounds its output; the softmax VJP rounds its output). That is what MLX's fallback
 * does for a sliding-window layer in training, and it is why the write-up measured 198 GB at
 * 32,768 tokens: peak = mask + three score-sized tensors.
 *
 * It serves three purposes: the probe's "dense" column (its memory is the point), the parity
 * sweep's low-precision baseline for f16 and bf16 (docs/design.md §4: "scores and
 * probabilities rounded to the dtype as a plain framework would"; f32 uses the independent
 * wa_baseline in src/ref, docs/algorithm.md section 5), and the trainer's dense arm. It is not
 * meant to be fast, but it uses the same GEMM micro-kernel so the probe finishes. Unlike a plain
 * framework, a NaN or an infinity reaches only the rows and keys that see it (masked entries are
 * exactly 0 and never multiply one, see mat_times_head).
 */
#define _GNU_SOURCE
#include "../convert.h"
#include "cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define ROW_BLOCK 64

/* A score-sized tensor [B, Hq, Nq, Nk] in the input dtype. */
typedef struct dense_mat {
    void *data;
    wa_dtype dtype;
} dense_mat;

static inline float mat_get(const dense_mat *m, size_t idx) {
    if (m->dtype == WA_F32) return ((const float *)m->data)[idx];
    uint16_t h = ((const uint16_t *)m->data)[idx];
    return m->dtype == WA_BF16 ? wa_bf16_to_f32(h) : wa_f16_to_f32(h);
}
static inline void mat_put(dense_mat *m, size_t idx, float x) {
    if (m->dtype == WA_F32) ((float *)m->data)[idx] = x;
    else if (m->dtype == WA_BF16) ((uint16_t *)m->data)[idx] = wa_f32_to_bf16(x);
    else ((uint16_t *)m->data)[idx] = wa_f32_to_f16(x);
}

typedef struct dense_args {
    wa_context *ctx;
    const wa_problem *p;
    int64_t Dp, Nkp;
    unsigned char *mask; /* [Nq, Nk] */
    dense_mat S, P, dP, dS;
    float *scratch; /* per worker */
    size_t scratch_floats;
} dense_args;

static int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

static size_t mat_bytes(const wa_problem *p) {
    return (size_t)p->B * (size_t)p->Hq * (size_t)p->Nq * (size_t)p->Nk * wa_dtype_size(p->dtype);
}
static size_t mask_bytes(const wa_problem *p) { return (size_t)p->Nq * (size_t)p->Nk; }

/* per worker: a whole K or V head in f32 (transposed and plain), a row block of Q / dO / scores,
 * and a [Nk, D] f32 accumulator for dK and dV */
static size_t dense_scratch_floats(const wa_problem *p, int64_t Dp, int64_t Nkp) {
    return (size_t)(2 * p->D * Nkp + 2 * Nkp * Dp + 2 * ROW_BLOCK * Dp + 2 * ROW_BLOCK * Nkp + Dp);
}

size_t wa_dense_workspace_bytes(const wa_context *ctx, const wa_problem *p, int backward) {
    int64_t Dp = round_up(p->D, WA_CPU_PAD), Nkp = round_up(p->Nk, WA_CPU_PAD);
    size_t scratch = (size_t)ctx->threads * dense_scratch_floats(p, Dp, Nkp) * sizeof(float);
    /* peak: forward S + P; backward P + dP + dS (S is freed once P exists) */
    return mask_bytes(p) + scratch + (backward ? 3 : 2) * mat_bytes(p);
}

static void load_head_rows(float *dst, int64_t ld, const wa_tensor *t, int64_t b, int64_t h, int64_t row0,
                           int64_t nrows, int64_t D) {
    for (int64_t r = 0; r < nrows; r++) {
        const void *src = wa_row_ptr(t, b, h, row0 + r);
        float *o = dst + r * ld;
        for (int64_t d = 0; d < D; d++) {
            if (t->dtype == WA_F32) o[d] = ((const float *)src)[d];
            else if (t->dtype == WA_BF16) o[d] = wa_bf16_to_f32(((const uint16_t *)src)[d]);
            else o[d] = wa_f16_to_f32(((const uint16_t *)src)[d]);
        }
        for (int64_t d = D; d < ld; d++) o[d] = 0.0f;
    }
}

static void transpose_into(float *dstT, int64_t ldT, const float *src, int64_t ld, int64_t rows, int64_t D) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t d = 0; d < D; d++) dstT[d * ldT + r] = src[r * ld + d];
    for (int64_t d = 0; d < D; d++)
        for (int64_t r = rows; r < ldT; r++) dstT[d * ldT + r] = 0.0f;
}

static void store_head_row(const wa_tensor *t, int64_t b, int64_t h, int64_t row, const float *src, int64_t D,
                           float mul) {
    void *dst = wa_row_ptr(t, b, h, row);
    for (int64_t d = 0; d < D; d++) {
        float x = src[d] * mul;
        if (t->dtype == WA_F32) ((float *)dst)[d] = x;
        else if (t->dtype == WA_BF16) ((uint16_t *)dst)[d] = wa_f32_to_bf16(x);
        else ((uint16_t *)dst)[d] = wa_f32_to_f16(x);
    }
}

static size_t mat_index(const wa_problem *p, int64_t b, int64_t h, int64_t i, int64_t j) {
    return (((size_t)b * (size_t)p->Hq + (size_t)h) * (size_t)p->Nq + (size_t)i) * (size_t)p->Nk + (size_t)j;
}

/* For one head (b, h): each block of rows of `rows` times the whole kv head transposed,
 * Sb = rows . kv^T (f32), handed to emit() one row block at a time. The shared shape of the
 * scores (Q K^T) and dP (dO V^T) passes. */
typedef void (*emit_fn)(dense_args *a, int64_t b, int64_t h, int64_t i0, int64_t m, const float *Sb);

static void rows_times_kv(dense_args *a, int worker, const wa_tensor *rows, const wa_tensor *kv, int64_t bh, emit_fn emit) {
    const wa_problem *p = a->p;
    int64_t b = bh / p->Hq, h = bh % p->Hq, hk = h / p->group, D = p->D, Dp = a->Dp, Nkp = a->Nkp;
    float *ws = a->scratch + (size_t)worker * a->scratch_floats;
    float *KT = ws, *Kf = KT + D * Nkp, *Xb = Kf + Nkp * Dp, *Sb = Xb + ROW_BLOCK * Dp;
    load_head_rows(Kf, Dp, kv, b, hk, 0, p->Nk, D);
    transpose_into(KT, Nkp, Kf, Dp, p->Nk, D);
    for (int64_t i0 = 0; i0 < p->Nq; i0 += ROW_BLOCK) {
        int64_t m = wa_min64(ROW_BLOCK, p->Nq - i0);
        load_head_rows(Xb, Dp, rows, b, h, i0, m, D);
        memset(Sb, 0, (size_t)(m * Nkp) * 4);
        wa_cpu_gemm(m, Nkp, D, Xb, Dp, 1, KT, Nkp, Sb, Nkp);
        emit(a, b, h, i0, m, Sb);
    }
}

/* S = round(scale * Q K^T), softcapped (and rounded again), -inf where the mask says so */
static void emit_scores(dense_args *a, int64_t b, int64_t h, int64_t i0, int64_t m, const float *Sb) {
    const wa_problem *p = a->p;
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < p->Nk; j++) {
            float s = wa_round_to(p->dtype, Sb[r * a->Nkp + j] * p->scale);
            if (p->softcap > 0.0f) s = wa_round_to(p->dtype, p->softcap * tanhf(s / p->softcap));
            if (!a->mask[(size_t)(i0 + r) * (size_t)p->Nk + (size_t)j]) s = -INFINITY;
            mat_put(&a->S, mat_index(p, b, h, i0 + r, j), s);
        }
}

static void scores_unit(void *arg, int64_t bh, int worker) {
    dense_args *a = arg;
    rows_times_kv(a, worker, a->p->q, a->p->k, bh, emit_scores);
}

/* P = round(softmax_f32(S)); a row with no visible key is all zeros. Writes lse when asked.
 * Masked entries of P are exactly 0 even when the row's sum is not finite (non-finite inputs:
 * a NaN in the sum must stay in its row, see mat_times_head). */
static void softmax_unit(void *arg, int64_t bh, int worker) {
    dense_args *a = arg;
    const wa_problem *p = a->p;
    int64_t b = bh / p->Hq, h = bh % p->Hq;
    float *row = a->scratch + (size_t)worker * a->scratch_floats;
    for (int64_t i = 0; i < p->Nq; i++) {
        size_t base = mat_index(p, b, h, i, 0);
        const unsigned char *mask = a->mask + (size_t)i * (size_t)p->Nk;
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < p->Nk; j++) {
            row[j] = mat_get(&a->S, base + (size_t)j);
            mx = fmaxf(mx, row[j]);
        }
        if (wa_row_first_key(&p->win, i) > wa_row_last_key(&p->win, i)) { /* sees no key */
            for (int64_t j = 0; j < p->Nk; j++) mat_put(&a->P, base + (size_t)j, 0.0f);
            if (p->lse && p->o) *(float *)wa_row_ptr(p->lse, b, h, i) = -INFINITY;
            continue;
        }
        for (int64_t j = 0; j < p->Nk; j++)
            if (mask[j]) sum += row[j] = expf(row[j] - mx);
        for (int64_t j = 0; j < p->Nk; j++) mat_put(&a->P, base + (size_t)j, mask[j] ? row[j] / sum : 0.0f);
        if (p->lse && p->o) *(float *)wa_row_ptr(p->lse, b, h, i) = mx + logf(sum);
    }
}

/* any NaN or infinity among n floats */
static int has_nonfinite(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return 1;
    return 0;
}

/* rows of out = round(mul * M V) where M is P or dS ([Nq, Nk]) and V a kv head ([Nk, D]). A masked
 * entry of M is 0, but 0 * NaN = 0 * inf is NaN: when the head holds one, each row sums over its
 * visible keys only (the same micro-kernel and order, minus exact zero terms). */
static void mat_times_head(dense_args *a, int worker, const dense_mat *M, const wa_tensor *kv, const wa_tensor *out,
                           int64_t b, int64_t h, float mul) {
    const wa_problem *p = a->p;
    int64_t hk = h / p->group, D = p->D, Dp = a->Dp, Nkp = a->Nkp;
    float *ws = a->scratch + (size_t)worker * a->scratch_floats;
    float *Vf = ws + D * Nkp + Nkp * Dp, *Ob = Vf + Nkp * Dp, *Mb = Ob + ROW_BLOCK * Dp + ROW_BLOCK * Dp;
    load_head_rows(Vf, Dp, kv, b, hk, 0, p->Nk, D);
    int bad = has_nonfinite(Vf, (size_t)(p->Nk * Dp));
    for (int64_t i0 = 0; i0 < p->Nq; i0 += ROW_BLOCK) {
        int64_t m = wa_min64(ROW_BLOCK, p->Nq - i0);
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < p->Nk; j++) Mb[r * Nkp + j] = mat_get(M, mat_index(p, b, h, i0 + r, j));
        memset(Ob, 0, (size_t)(m * Dp) * 4);
        if (!bad) wa_cpu_gemm(m, Dp, p->Nk, Mb, Nkp, 1, Vf, Dp, Ob, Dp);
        else
            for (int64_t r = 0; r < m; r++) {
                int64_t lo = wa_row_first_key(&p->win, i0 + r), hi = wa_row_last_key(&p->win, i0 + r);
                if (lo <= hi) wa_cpu_gemm(1, Dp, hi - lo + 1, Mb + r * Nkp + lo, Nkp, 1, Vf + lo * Dp, Dp, Ob + r * Dp, Dp);
            }
        for (int64_t r = 0; r < m; r++) store_head_row(out, b, h, i0 + r, Ob + r * Dp, D, mul);
    }
}

static void pv_unit(void *arg, int64_t bh, int worker) {
    dense_args *a = arg;
    mat_times_head(a, worker, &a->P, a->p->v, a->p->o, bh / a->p->Hq, bh % a->p->Hq, 1.0f);
}

static void dq_unit(void *arg, int64_t bh, int worker) {
    dense_args *a = arg;
    mat_times_head(a, worker, &a->dS, a->p->k, a->p->dq, bh / a->p->Hq, bh % a->p->Hq, a->p->scale);
}

/* dP = round(dO V^T) */
static void emit_dp(dense_args *a, int64_t b, int64_t h, int64_t i0, int64_t m, const float *Sb) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < a->p->Nk; j++) mat_put(&a->dP, mat_index(a->p, b, h, i0 + r, j), Sb[r * a->Nkp + j]);
}

static void dp_unit(void *arg, int64_t bh, int worker) {
    dense_args *a = arg;
    rows_times_kv(a, worker, a->p->do_, a->p->v, bh, emit_dp);
}

/* dS = round(P * (dP - rowsum(P * dP))), times the softcap derivative (rounded); both over the
 * visible entries only, masked dS exactly 0 (dP there may be NaN, see mat_times_head) */
static void ds_unit(void *arg, int64_t bh, int worker) {
    dense_args *a = arg;
    const wa_problem *p = a->p;
    int64_t b = bh / p->Hq, h = bh % p->Hq;
    (void)worker;
    for (int64_t i = 0; i < p->Nq; i++) {
        size_t base = mat_index(p, b, h, i, 0);
        const unsigned char *mask = a->mask + (size_t)i * (size_t)p->Nk;
        float dot = 0.0f;
        for (int64_t j = 0; j < p->Nk; j++)
            if (mask[j]) dot += mat_get(&a->P, base + (size_t)j) * mat_get(&a->dP, base + (size_t)j);
        for (int64_t j = 0; j < p->Nk; j++) {
            if (!mask[j]) {
                mat_put(&a->dS, base + (size_t)j, 0.0f);
                continue;
            }
            float pj = mat_get(&a->P, base + (size_t)j);
            float ds = wa_round_to(p->dtype, pj * (mat_get(&a->dP, base + (size_t)j) - dot));
            if (p->softcap > 0.0f) {
                float t = mat_get(&a->S, base + (size_t)j) / p->softcap; /* S kept only with softcap */
                ds = wa_round_to(p->dtype, ds * (1.0f - t * t));
            }
            mat_put(&a->dS, base + (size_t)j, ds);
        }
    }
}

/* acc[Nk x Dp] += Mb^T Xb over the row block [i0, i0 + m) (Mb: P or dS, Xb: dO or Q); when the
 * block holds a NaN or an infinity, each key sums over the rows that see it only (as in
 * mat_times_head: a masked 0 times NaN must not reach the key) */
static void keys_times_rows(dense_args *a, const float *Mb, const float *Xb, int64_t i0, int64_t m, float *acc) {
    const wa_problem *p = a->p;
    int64_t Dp = a->Dp, Nkp = a->Nkp;
    if (!has_nonfinite(Xb, (size_t)(m * Dp))) {
        wa_cpu_gemm(p->Nk, Dp, m, Mb, 1, Nkp, Xb, Dp, acc, Dp);
        return;
    }
    for (int64_t j = 0; j < p->Nk; j++) {
        int64_t r0 = wa_max64(wa_col_first_query(&p->win, j), i0) - i0, r1 = wa_min64(wa_col_last_query(&p->win, j), i0 + m - 1) - i0;
        if (r0 <= r1) wa_cpu_gemm(1, Dp, r1 - r0 + 1, Mb + r0 * Nkp + j, 1, Nkp, Xb + r0 * Dp, Dp, acc + j * Dp, Dp);
    }
}

/* dK = round(scale * sum_g dS^T Q), dV = round(sum_g P^T dO) for one kv head */
static void dkdv_unit(void *arg, int64_t bhk, int worker) {
    dense_args *a = arg;
    const wa_problem *p = a->p;
    int64_t b = bhk / p->Hkv, hk = bhk % p->Hkv, D = p->D, Dp = a->Dp, Nkp = a->Nkp;
    float *ws = a->scratch + (size_t)worker * a->scratch_floats;
    float *dK = ws, *dV = dK + Nkp * Dp, *Xb = dV + Nkp * Dp, *Mb = Xb + ROW_BLOCK * Dp;
    memset(dK, 0, (size_t)(Nkp * Dp) * 4);
    memset(dV, 0, (size_t)(Nkp * Dp) * 4);
    for (int64_t g = 0; g < p->group; g++) {
        int64_t h = hk * p->group + g;
        for (int64_t i0 = 0; i0 < p->Nq; i0 += ROW_BLOCK) {
            int64_t m = wa_min64(ROW_BLOCK, p->Nq - i0);
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = 0; j < p->Nk; j++) Mb[r * Nkp + j] = mat_get(&a->dS, mat_index(p, b, h, i0 + r, j));
            load_head_rows(Xb, Dp, p->q, b, h, i0, m, D);
            keys_times_rows(a, Mb, Xb, i0, m, dK);
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = 0; j < p->Nk; j++) Mb[r * Nkp + j] = mat_get(&a->P, mat_index(p, b, h, i0 + r, j));
            load_head_rows(Xb, Dp, p->do_, b, h, i0, m, D);
            keys_times_rows(a, Mb, Xb, i0, m, dV);
        }
    }
    for (int64_t j = 0; j < p->Nk; j++) {
        store_head_row(p->dk, b, hk, j, dK + j * Dp, D, p->scale);
        store_head_row(p->dv, b, hk, j, dV + j * Dp, D, 1.0f);
    }
}

static void *mat_alloc(dense_args *a, dense_mat *m) {
    m->dtype = a->p->dtype;
    m->data = wa_alloc(a->ctx, mat_bytes(a->p));
    return m->data;
}

static void release(dense_args *a) {
    wa_free(a->ctx, a->mask);
    wa_free(a->ctx, a->S.data);
    wa_free(a->ctx, a->P.data);
    wa_free(a->ctx, a->dP.data);
    wa_free(a->ctx, a->dS.data);
    wa_free(a->ctx, a->scratch);
}

/* mask, scratch, S, then P from S. With softcap the backward keeps S (its derivative needs it). */
static wa_status forward_common(dense_args *a, wa_context *ctx, const wa_problem *p, int keep_scores) {
    memset(a, 0, sizeof *a);
    a->ctx = ctx, a->p = p;
    a->Dp = round_up(p->D, WA_CPU_PAD), a->Nkp = round_up(p->Nk, WA_CPU_PAD);
    a->scratch_floats = dense_scratch_floats(p, a->Dp, a->Nkp);
    a->mask = wa_alloc(ctx, mask_bytes(p));
    a->scratch = wa_alloc(ctx, (size_t)ctx->threads * a->scratch_floats * sizeof(float));
    if (!a->mask || !a->scratch || !mat_alloc(a, &a->S)) goto oom;
    for (int64_t i = 0; i < p->Nq; i++)
        for (int64_t j = 0; j < p->Nk; j++) a->mask[(size_t)i * (size_t)p->Nk + (size_t)j] = (unsigned char)wa_visible(&p->win, i, j);
    wa_pool_run(ctx->pool, p->B * p->Hq, scores_unit, a);
    if (!mat_alloc(a, &a->P)) goto oom;
    wa_pool_run(ctx->pool, p->B * p->Hq, softmax_unit, a);
    if (!keep_scores) {
        wa_free(ctx, a->S.data);
        a->S.data = NULL;
    }
    return WA_OK;
oom:
    release(a);
    return wa_fail(WA_ERR_NO_MEMORY, "dense baseline: cannot allocate score-sized tensors (%zu bytes each)", mat_bytes(p));
}

wa_status wa_dense_forward(wa_context *ctx, const wa_problem *p) {
    dense_args a;
    wa_status st = forward_common(&a, ctx, p, 0);
    if (st != WA_OK) return st;
    wa_pool_run(ctx->pool, p->B * p->Hq, pv_unit, &a);
    release(&a);
    return WA_OK;
}

wa_status wa_dense_backward(wa_context *ctx, const wa_problem *p) {
    dense_args a;
    wa_problem fp = *p;
    fp.o = NULL; /* the recomputed softmax must not overwrite the caller's lse */
    wa_status st = forward_common(&a, ctx, &fp, p->softcap > 0.0f);
    if (st != WA_OK) return st;
    if (!mat_alloc(&a, &a.dP) || !mat_alloc(&a, &a.dS)) {
        release(&a);
        return wa_fail(WA_ERR_NO_MEMORY, "dense baseline: cannot allocate dP and dS (%zu bytes each)", mat_bytes(p));
    }
    wa_pool_run(ctx->pool, p->B * p->Hq, dp_unit, &a);
    wa_pool_run(ctx->pool, p->B * p->Hq, ds_unit, &a);
    wa_pool_run(ctx->pool, p->B * p->Hq, dq_unit, &a);
    wa_pool_run(ctx->pool, p->B * p->Hkv, dkdv_unit, &a);
    release(&a);
    return WA_OK;
}

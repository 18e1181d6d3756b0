/* case.c — see case.h. */
#define _GNU_SOURCE
#include "case.h"
#include "oracle.h"
#include "../convert.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *const wa_out_names[WA_N_OUT] = {"o", "lse", "dq", "dk", "dv"};

/* 0xFF bytes are a NaN in f32, f16 and bf16 alike: no kernel produces that pattern from
 * finite inputs, so an element still holding it was never written. */
#define POISON 0xFF
#define GUARD 256

typedef struct buf {
    unsigned char *base;
    void *data;
    size_t bytes;
} buf;

static void *buf_alloc(buf *b, size_t bytes) {
    b->bytes = bytes;
    b->base = malloc(bytes + 2 * GUARD);
    if (!b->base) return b->data = NULL;
    memset(b->base, POISON, bytes + 2 * GUARD);
    return b->data = b->base + GUARD;
}
static int buf_guards_ok(const buf *b) {
    for (size_t i = 0; i < GUARD; i++)
        if (b->base[i] != POISON || b->base[GUARD + b->bytes + i] != POISON) return 0;
    return 1;
}

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void wa_rng_seed(wa_rng *r, uint64_t seed) { r->s = seed * 0x9E3779B97F4A7C15ull + 12345; }

static uint64_t next(wa_rng *r) {
    uint64_t x = r->s;
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return r->s = x;
}

double wa_rng_normal(wa_rng *r) {
    double u1 = (double)(next(r) >> 11) * (1.0 / 9007199254740992.0), u2 = (double)(next(r) >> 11) * (1.0 / 9007199254740992.0);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

void wa_fill_normal(void *data, wa_dtype dt, size_t n, wa_rng *r, double scale) {
    for (size_t i = 0; i < n; i++) {
        float x = (float)(wa_rng_normal(r) * scale);
        if (dt == WA_F32) ((float *)data)[i] = x;
        else if (dt == WA_BF16) ((uint16_t *)data)[i] = wa_f32_to_bf16(x);
        else ((uint16_t *)data)[i] = wa_f32_to_f16(x);
    }
}

static wa_tensor make_tensor(void *data, wa_dtype dt, int bnhd, int64_t B, int64_t H, int64_t N, int64_t D) {
    return bnhd ? wa_tensor_bnhd(data, dt, B, H, N, D) : wa_tensor_bhnd(data, dt, B, H, N, D);
}

double wa_rounding_atol(const double *ref, size_t n) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(ref[i])) continue;
        double noise = fabs((double)(float)(ref[i] + 0.3) - 0.3 - ref[i]);
        if (noise > worst) worst = noise;
    }
    return 2 * worst;
}

/* max |got - ref| over two contiguous arrays, equal infinities count as 0, NaN as
 * infinite error */
static double max_err_f64(const double *got, const double *ref, size_t n) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        double e;
        if (isnan(got[i]) || isnan(ref[i])) e = isnan(got[i]) && isnan(ref[i]) ? 0 : INFINITY;
        else if (isinf(got[i]) || isinf(ref[i])) e = got[i] == ref[i] ? 0 : INFINITY;
        else e = fabs(got[i] - ref[i]);
        if (e > worst) worst = e;
    }
    return worst;
}

/* max |t - ref| over a strided tensor, with max_err_f64's conventions.
 * Also reports elements still holding the poison pattern (never written). */
static double max_err(const wa_tensor *t, const double *ref, int *unwritten) {
    double *got = malloc((size_t)(t->shape[0] * t->shape[1] * t->shape[2] * t->shape[3]) * sizeof *got + 8);
    size_t n = (size_t)(t->shape[0] * t->shape[1] * t->shape[2] * t->shape[3]);
    wa_tensor_to_f64(t, got);
    size_t es = wa_dtype_size(t->dtype);
    for (int64_t b = 0; b < t->shape[0]; b++)
        for (int64_t h = 0; h < t->shape[1]; h++)
            for (int64_t r = 0; r < t->shape[2]; r++)
                for (int64_t d = 0; d < t->shape[3]; d++) {
                    const unsigned char *e =
                        (const unsigned char *)t->data + (b * t->stride[0] + h * t->stride[1] + r * t->stride[2] + d * t->stride[3]) * (int64_t)es;
                    int poisoned = 1;
                    for (size_t k = 0; k < es; k++) poisoned &= e[k] == POISON;
                    if (poisoned) *unwritten = 1;
                }
    double worst = max_err_f64(got, ref, n);
    free(got);
    return worst;
}

void wa_case_name(const wa_case *c, char *out, size_t n) {
    static const char *const dt[3] = {"f32", "f16", "bf16"};
    char cap[32] = "";
    if (c->softcap > 0) snprintf(cap, sizeof cap, " cap=%g", (double)c->softcap);
    char sc[32] = "";
    if (c->scale != 0) snprintf(sc, sizeof sc, " scale=%g", (double)c->scale);
    char seqs[48] = "";
    if (c->nseq > 0) {
        int32_t longest = 0;
        for (int b = 0; b < c->nseq; b++) longest = c->seq_q[b] > longest ? c->seq_q[b] : longest;
        snprintf(seqs, sizeof seqs, " varlen seqs=%d longest=%d", c->nseq, (int)longest);
    }
    snprintf(out, n, "%s%s B=%lld Hq=%lld Hkv=%lld Nq=%lld Nk=%lld D=%lld win=(%lld,%lld)%s%s%s%s",
             c->device == WA_DEVICE_CUDA ? "cuda " : "", dt[c->dtype],
             (long long)c->B, (long long)c->Hq, (long long)c->Hkv, (long long)c->Nq, (long long)c->Nk, (long long)c->D,
             (long long)c->left, (long long)c->right, cap, sc, c->bnhd && !c->nseq ? " bnhd" : "", seqs);
}

void wa_case_varlen(wa_case *c, int nseq, const int32_t *seq_q, const int32_t *seq_k) {
    c->nseq = nseq, c->seq_q = seq_q, c->seq_k = seq_k;
    c->B = 1, c->bnhd = 1, c->Nq = 0, c->Nk = 0;
    for (int b = 0; b < nseq; b++) c->Nq += seq_q[b], c->Nk += seq_k[b];
}

typedef struct outputs {
    buf o, lse, dq, dk, dv;
    wa_tensor to, tlse, tdq, tdk, tdv;
    void *dev[5]; /* CUDA: device copies of the guarded buffers (guards included) */
} outputs;

/* CUDA kernels under test: mirror each guarded host buffer (poison and guards included) on the
 * device and point the tensors there; after the run, copy everything back so the host-side
 * checks (unwritten elements, guard bytes) see what the kernel did. */
static int outputs_to_device(outputs *x, wa_context *ctx) {
    buf *bufs[5] = {&x->o, &x->lse, &x->dq, &x->dk, &x->dv};
    wa_tensor *ts[5] = {&x->to, &x->tlse, &x->tdq, &x->tdk, &x->tdv};
    for (int i = 0; i < 5; i++) {
        size_t total = bufs[i]->bytes + 2 * GUARD;
        if (wa_malloc(ctx, WA_DEVICE_CUDA, total, &x->dev[i]) != WA_OK ||
            wa_memcpy(ctx, x->dev[i], WA_DEVICE_CUDA, bufs[i]->base, WA_DEVICE_CPU, total) != WA_OK)
            return 0;
        ts[i]->data = (char *)x->dev[i] + GUARD;
        ts[i]->device = WA_DEVICE_CUDA;
    }
    return 1;
}
static int outputs_from_device(outputs *x, wa_context *ctx) {
    buf *bufs[5] = {&x->o, &x->lse, &x->dq, &x->dk, &x->dv};
    wa_tensor *ts[5] = {&x->to, &x->tlse, &x->tdq, &x->tdk, &x->tdv};
    int ok = 1;
    for (int i = 0; i < 5; i++) {
        if (!x->dev[i]) continue;
        ok &= wa_memcpy(ctx, bufs[i]->base, WA_DEVICE_CPU, x->dev[i], WA_DEVICE_CUDA, bufs[i]->bytes + 2 * GUARD) == WA_OK;
        wa_free_memory(ctx, WA_DEVICE_CUDA, x->dev[i]);
        x->dev[i] = NULL;
        ts[i]->data = bufs[i]->data;
        ts[i]->device = WA_DEVICE_CPU;
    }
    return ok;
}

/* a device copy of an input tensor's whole buffer, or NULL */
static void *input_to_device(wa_context *ctx, const void *host, size_t bytes) {
    void *d = NULL;
    if (wa_malloc(ctx, WA_DEVICE_CUDA, bytes ? bytes : 1, &d) != WA_OK) return NULL;
    if (wa_memcpy(ctx, d, WA_DEVICE_CUDA, host, WA_DEVICE_CPU, bytes) != WA_OK) {
        wa_free_memory(ctx, WA_DEVICE_CUDA, d);
        return NULL;
    }
    return d;
}

static int outputs_alloc(outputs *x, const wa_case *c) {
    size_t es = wa_dtype_size(c->dtype);
    size_t nq = (size_t)(c->B * c->Hq * c->Nq * c->D), nk = (size_t)(c->B * c->Hkv * c->Nk * c->D);
    memset(x, 0, sizeof *x);
    if (!buf_alloc(&x->o, nq * es) || !buf_alloc(&x->lse, (size_t)(c->B * c->Hq * c->Nq) * 4) ||
        !buf_alloc(&x->dq, nq * es) || !buf_alloc(&x->dk, nk * es) || !buf_alloc(&x->dv, nk * es))
        return 0;
    x->to = make_tensor(x->o.data, c->dtype, c->bnhd, c->B, c->Hq, c->Nq, c->D);
    x->tlse = wa_tensor_lse(x->lse.data, c->B, c->Hq, c->Nq);
    x->tdq = make_tensor(x->dq.data, c->dtype, c->bnhd, c->B, c->Hq, c->Nq, c->D);
    x->tdk = make_tensor(x->dk.data, c->dtype, c->bnhd, c->B, c->Hkv, c->Nk, c->D);
    x->tdv = make_tensor(x->dv.data, c->dtype, c->bnhd, c->B, c->Hkv, c->Nk, c->D);
    return 1;
}
static void outputs_free(outputs *x) {
    free(x->o.base), free(x->lse.base), free(x->dq.base), free(x->dk.base), free(x->dv.base);
}
static int outputs_guards_ok(const outputs *x) {
    return buf_guards_ok(&x->o) && buf_guards_ok(&x->lse) && buf_guards_ok(&x->dq) && buf_guards_ok(&x->dk) &&
           buf_guards_ok(&x->dv);
}

static void note(wa_case_result *r, const char *fmt, const char *a, double x) {
    if (r->detail[0]) return;
    snprintf(r->detail, sizeof r->detail, fmt, a, x);
}

/* Rows [r0, r0 + len) of every head of a contiguous [1, H, T, D] f64 array, to or from a
 * contiguous [1, H, len, D] one: one sequence of a packed batch, for the per-sequence oracle. */
static void move_rows(double *full, double *part, int64_t H, int64_t T, int64_t D, int64_t r0, int64_t len, int gather) {
    for (int64_t h = 0; h < H; h++) {
        double *f = full + (h * T + r0) * D, *p = part + h * len * D;
        if (gather) memcpy(p, f, (size_t)(len * D) * sizeof *p);
        else memcpy(f, p, (size_t)(len * D) * sizeof *p);
    }
}

/* One of the references (oracle.h) over shape s: the float64 oracle (baseline = 0) or the
 * low-precision baseline in the case's dtype. */
static void reference(const wa_case *c, int baseline, const wa_oracle_shape *s, const double *q, const double *k,
                      const double *v, const double *do_, double *o, double *lse, double *dq, double *dk, double *dv) {
    if (baseline) wa_baseline(s, c->dtype, q, k, v, do_, o, lse, dq, dk, dv);
    else wa_oracle(s, q, k, v, do_, o, lse, dq, dk, dv);
}

/* A reference over a case: once over the whole tensors, or per sequence of a packed batch (each
 * sequence gathered into its own arrays, its results scattered back). 0 if out of memory. */
static int run_reference(const wa_case *c, int baseline, const wa_oracle_shape *whole, const double *q, const double *k,
                         const double *v, const double *do_, double *o, double *lse, double *dq, double *dk, double *dv) {
    if (c->nseq == 0) {
        reference(c, baseline, whole, q, k, v, do_, o, lse, dq, dk, dv);
        return 1;
    }
    int64_t Hq = c->Hq, Hkv = c->Hkv, D = c->D, longest_q = 0, longest_k = 0;
    for (int b = 0; b < c->nseq; b++) {
        longest_q = c->seq_q[b] > longest_q ? c->seq_q[b] : longest_q;
        longest_k = c->seq_k[b] > longest_k ? c->seq_k[b] : longest_k;
    }
    size_t nq = (size_t)(Hq * longest_q * D) + 1, nk = (size_t)(Hkv * longest_k * D) + 1;
    double *pq = malloc(nq * 8), *pdo = malloc(nq * 8), *po = malloc(nq * 8), *pdq = malloc(nq * 8);
    double *plse = malloc((size_t)(Hq * longest_q + 1) * 8), *pk = malloc(nk * 8), *pv = malloc(nk * 8);
    double *pdk = malloc(nk * 8), *pdv = malloc(nk * 8);
    int ok = pq && pdo && po && pdq && plse && pk && pv && pdk && pdv;
    for (int64_t b = 0, q0 = 0, k0 = 0; ok && b < c->nseq; q0 += c->seq_q[b], k0 += c->seq_k[b], b++) {
        int64_t nqb = c->seq_q[b], nkb = c->seq_k[b];
        move_rows((double *)q, pq, Hq, c->Nq, D, q0, nqb, 1), move_rows((double *)do_, pdo, Hq, c->Nq, D, q0, nqb, 1);
        move_rows((double *)k, pk, Hkv, c->Nk, D, k0, nkb, 1), move_rows((double *)v, pv, Hkv, c->Nk, D, k0, nkb, 1);
        wa_oracle_shape s = *whole;
        s.B = 1, s.Nq = nqb, s.Nk = nkb, s.win.Nq = nqb, s.win.Nk = nkb;
        reference(c, baseline, &s, pq, pk, pv, pdo, po, plse, pdq, pdk, pdv);
        move_rows(o, po, Hq, c->Nq, D, q0, nqb, 0), move_rows(dq, pdq, Hq, c->Nq, D, q0, nqb, 0);
        move_rows(lse, plse, Hq, c->Nq, 1, q0, nqb, 0);
        move_rows(dk, pdk, Hkv, c->Nk, D, k0, nkb, 0), move_rows(dv, pdv, Hkv, c->Nk, D, k0, nkb, 0);
    }
    free(pq), free(pdo), free(po), free(pdq), free(plse), free(pk), free(pv), free(pdk), free(pdv);
    return ok;
}

/* Whether key row j (of the whole packed tensor) is seen by some query of its own sequence. */
static int key_seen(const wa_case *c, int64_t j) {
    int64_t k0 = 0, b = 0, nqb = c->Nq, nkb = c->Nk;
    if (c->nseq > 0) {
        while (b < c->nseq && j >= k0 + c->seq_k[b]) k0 += c->seq_k[b++];
        if (b == c->nseq) return 0;
        nqb = c->seq_q[b], nkb = c->seq_k[b];
    }
    wa_window w = {nqb, nkb, c->left, c->right};
    for (int64_t i = 0; i < nqb; i++)
        if (wa_visible(&w, i, j - k0)) return 1;
    return 0;
}

void wa_run_case(const wa_case *c, wa_context *kernel, wa_context *baseline, double grad_mult, wa_case_result *r) {
    memset(r, 0, sizeof *r);
    int32_t *cu = NULL; /* a packed batch's offsets */
    size_t es = wa_dtype_size(c->dtype);
    size_t nq = (size_t)(c->B * c->Hq * c->Nq * c->D), nk = (size_t)(c->B * c->Hkv * c->Nk * c->D);
    size_t nrows = (size_t)(c->B * c->Hq * c->Nq);
    wa_rng g;
    wa_rng_seed(&g, c->seed);
    void *q = malloc(nq * es + 8), *k = malloc(nk * es + 8), *v = malloc(nk * es + 8), *go = malloc(nq * es + 8);
    double *rq = malloc(nq * 8 + 8), *rk = malloc(nk * 8 + 8), *rv = malloc(nk * 8 + 8), *rdo = malloc(nq * 8 + 8);
    double *ro = malloc(nq * 8 + 8), *rlse = malloc(nrows * 8 + 8), *rdq = malloc(nq * 8 + 8);
    double *rdk = malloc(nk * 8 + 8), *rdv = malloc(nk * 8 + 8);
    double *xo = malloc(nq * 8 + 8), *xlse = malloc(nrows * 8 + 8), *xdq = malloc(nq * 8 + 8);
    double *xdk = malloc(nk * 8 + 8), *xdv = malloc(nk * 8 + 8);
    outputs ker;
    int have_ker = outputs_alloc(&ker, c);
    if (!q || !k || !v || !go || !rq || !rk || !rv || !rdo || !ro || !rlse || !rdq || !rdk || !rdv || !xo || !xlse || !xdq ||
        !xdk || !xdv || !have_ker) {
        r->status = WA_ERR_NO_MEMORY;
        snprintf(r->detail, sizeof r->detail, "test harness out of memory");
        goto done;
    }
    wa_fill_normal(q, c->dtype, nq, &g, 1), wa_fill_normal(k, c->dtype, nk, &g, 1), wa_fill_normal(v, c->dtype, nk, &g, 1);
    wa_fill_normal(go, c->dtype, nq, &g, 1);
    wa_tensor tq = make_tensor(q, c->dtype, c->bnhd, c->B, c->Hq, c->Nq, c->D);
    wa_tensor tk = make_tensor(k, c->dtype, c->bnhd, c->B, c->Hkv, c->Nk, c->D);
    wa_tensor tv = make_tensor(v, c->dtype, c->bnhd, c->B, c->Hkv, c->Nk, c->D);
    wa_tensor tdo = make_tensor(go, c->dtype, c->bnhd, c->B, c->Hq, c->Nq, c->D);
    wa_attn_desc desc = {c->scale, c->softcap, c->left, c->right};
    /* a packed batch: offsets on the host (baseline) and, for CUDA, on the device */
    cu = c->nseq > 0 ? malloc(2 * (size_t)(c->nseq + 1) * sizeof *cu) : NULL;
    wa_varlen seqs = {0}, kseqs = {0};
    void *dcu = NULL;
    if (c->nseq > 0) {
        if (!cu) {
            r->status = WA_ERR_NO_MEMORY;
            snprintf(r->detail, sizeof r->detail, "test harness out of memory");
            goto done;
        }
        int32_t *cu_q = cu, *cu_k = cu + c->nseq + 1, mq = 0, mk = 0;
        cu_q[0] = cu_k[0] = 0;
        for (int b = 0; b < c->nseq; b++) {
            cu_q[b + 1] = cu_q[b] + c->seq_q[b], cu_k[b + 1] = cu_k[b] + c->seq_k[b];
            mq = c->seq_q[b] > mq ? c->seq_q[b] : mq, mk = c->seq_k[b] > mk ? c->seq_k[b] : mk;
        }
        seqs = (wa_varlen){c->nseq, cu_q, cu_k, mq, mk};
        kseqs = seqs;
    }

    wa_tensor kq = tq, kk = tk, kv = tv, kdo = tdo;
    void *dq_in = NULL, *dk_in = NULL, *dv_in = NULL, *ddo_in = NULL;
    if (c->device == WA_DEVICE_CUDA) {
        dq_in = input_to_device(kernel, q, nq * es), dk_in = input_to_device(kernel, k, nk * es);
        dv_in = input_to_device(kernel, v, nk * es), ddo_in = input_to_device(kernel, go, nq * es);
        if (!dq_in || !dk_in || !dv_in || !ddo_in || !outputs_to_device(&ker, kernel)) {
            r->status = WA_ERR_CUDA;
            snprintf(r->detail, sizeof r->detail, "cannot stage the case on the GPU: %s", wa_last_error());
        }
        kq.data = dq_in, kk.data = dk_in, kv.data = dv_in, kdo.data = ddo_in;
        kq.device = kk.device = kv.device = kdo.device = WA_DEVICE_CUDA;
        if (c->nseq > 0) {
            dcu = input_to_device(kernel, cu, 2 * (size_t)(c->nseq + 1) * sizeof *cu);
            if (!dcu && r->status == WA_OK) {
                r->status = WA_ERR_CUDA;
                snprintf(r->detail, sizeof r->detail, "cannot stage the offsets on the GPU: %s", wa_last_error());
            }
            kseqs.cu_seqlens_q = dcu, kseqs.cu_seqlens_k = (const int32_t *)dcu + c->nseq + 1;
        }
    }
    double t0 = seconds(), t1 = t0;
    if (r->status == WA_OK) {
        r->status = c->nseq > 0 ? wa_forward_varlen(kernel, &desc, &kseqs, &kq, &kk, &kv, &ker.to, &ker.tlse)
                                : wa_forward(kernel, &desc, &kq, &kk, &kv, &ker.to, &ker.tlse);
        if (r->status == WA_OK) r->status = wa_synchronize(kernel);
        t1 = seconds();
        if (r->status == WA_OK)
            r->status = c->nseq > 0 ? wa_backward_varlen(kernel, &desc, &kseqs, &kq, &kk, &kv, &ker.to, &ker.tlse, &kdo,
                                                         &ker.tdq, &ker.tdk, &ker.tdv)
                                    : wa_backward(kernel, &desc, &kq, &kk, &kv, &ker.to, &ker.tlse, &kdo, &ker.tdq, &ker.tdk,
                                                  &ker.tdv);
        if (r->status == WA_OK) r->status = wa_synchronize(kernel);
    }
    double t2 = seconds();
    r->fwd_seconds = t1 - t0, r->bwd_seconds = t2 - t1;
    if (r->status != WA_OK) snprintf(r->detail, sizeof r->detail, "%s: %s", wa_status_str(r->status), wa_last_error());
    if (c->device == WA_DEVICE_CUDA) {
        if (!outputs_from_device(&ker, kernel) && r->status == WA_OK) {
            r->status = WA_ERR_CUDA;
            snprintf(r->detail, sizeof r->detail, "cannot copy results back: %s", wa_last_error());
        }
        wa_free_memory(kernel, WA_DEVICE_CUDA, dq_in), wa_free_memory(kernel, WA_DEVICE_CUDA, dk_in);
        wa_free_memory(kernel, WA_DEVICE_CUDA, dv_in), wa_free_memory(kernel, WA_DEVICE_CUDA, ddo_in);
        wa_free_memory(kernel, WA_DEVICE_CUDA, dcu);
    }
    if (r->status != WA_OK) goto done;
    wa_tensor_to_f64(&tq, rq), wa_tensor_to_f64(&tk, rk), wa_tensor_to_f64(&tv, rv), wa_tensor_to_f64(&tdo, rdo);
    wa_oracle_shape s = {c->B, c->Hq, c->Hkv, c->Nq, c->Nk, c->D,
                         c->scale != 0 ? (double)c->scale : 1.0 / sqrt((double)c->D), c->softcap,
                         {c->Nq, c->Nk, c->left, c->right}};
    /* the kernel's scale is a float: use exactly that value */
    s.scale = (double)(c->scale != 0 ? c->scale : (float)(1.0 / sqrt((double)c->D)));
    /* the criterion's baseline (docs/design.md §4): for f32 the independent one in oracle.c
     * (wa_baseline); for f16 and bf16 the library's dense path, through its varlen call for a
     * packed batch (docs/algorithm.md section 5 says why) */
    double tb = seconds();
    if (c->dtype == WA_F32 || !baseline) {
        if (!run_reference(c, 1, &s, rq, rk, rv, rdo, xo, xlse, xdq, xdk, xdv)) {
            snprintf(r->detail, sizeof r->detail, "test harness out of memory (baseline)");
            goto done;
        }
    } else {
        outputs base;
        if (!outputs_alloc(&base, c)) {
            outputs_free(&base);
            snprintf(r->detail, sizeof r->detail, "test harness out of memory (baseline)");
            goto done;
        }
        wa_status bs = c->nseq > 0 ? wa_forward_varlen(baseline, &desc, &seqs, &tq, &tk, &tv, &base.to, &base.tlse)
                                   : wa_forward(baseline, &desc, &tq, &tk, &tv, &base.to, &base.tlse);
        if (bs == WA_OK)
            bs = c->nseq > 0 ? wa_backward_varlen(baseline, &desc, &seqs, &tq, &tk, &tv, &base.to, &base.tlse, &tdo,
                                                  &base.tdq, &base.tdk, &base.tdv)
                             : wa_backward(baseline, &desc, &tq, &tk, &tv, &base.to, &base.tlse, &tdo, &base.tdq,
                                           &base.tdk, &base.tdv);
        if (bs == WA_OK) {
            wa_tensor_to_f64(&base.to, xo), wa_tensor_to_f64(&base.tlse, xlse), wa_tensor_to_f64(&base.tdq, xdq);
            wa_tensor_to_f64(&base.tdk, xdk), wa_tensor_to_f64(&base.tdv, xdv);
        }
        outputs_free(&base);
        if (bs != WA_OK) {
            snprintf(r->detail, sizeof r->detail, "baseline failed: %s: %s", wa_status_str(bs), wa_last_error());
            goto done;
        }
    }
    double to = seconds();
    if (!run_reference(c, 0, &s, rq, rk, rv, rdo, ro, rlse, rdq, rdk, rdv)) {
        snprintf(r->detail, sizeof r->detail, "test harness out of memory (oracle)");
        goto done;
    }
    r->base_seconds = to - tb, r->oracle_seconds = seconds() - to;

    /* oracle arrays are contiguous bhnd; compare through bhnd views of the same order */
    const double *refs[WA_N_OUT] = {ro, rlse, rdq, rdk, rdv};
    size_t counts[WA_N_OUT] = {nq, nrows, nq, nk, nk};
    const wa_tensor *kt[WA_N_OUT] = {&ker.to, &ker.tlse, &ker.tdq, &ker.tdk, &ker.tdv};
    const double *bases[WA_N_OUT] = {xo, xlse, xdq, xdk, xdv};
    r->pass = 1;
    for (int t = 0; t < WA_N_OUT; t++) {
        int unwritten = 0;
        r->err[t] = max_err(kt[t], refs[t], &unwritten);
        r->base_err[t] = max_err_f64(bases[t], refs[t], counts[t]);
        r->atol[t] = wa_rounding_atol(refs[t], counts[t]);
        r->mult[t] = 2.0;
        r->bound[t] = 2.0 * r->base_err[t] + r->atol[t];
        if (t >= WA_OUT_DQ && grad_mult > 2.0 && !(r->err[t] <= r->bound[t])) {
            /* docs/design.md §4: gradients may use the looser multiple; the case says so */
            r->mult[t] = grad_mult;
            r->bound[t] = grad_mult * r->base_err[t] + r->atol[t];
            if (r->err[t] <= r->bound[t]) r->used_grad_mult = 1;
        }
        if (unwritten) {
            r->pass = 0;
            note(r, "%s has elements the kernel never wrote%.0f", wa_out_names[t], 0);
        }
        if (!(r->err[t] <= r->bound[t])) {
            r->pass = 0;
            note(r, "%s error %.3g above bound", wa_out_names[t], r->err[t]);
        }
    }
    if (!outputs_guards_ok(&ker)) {
        r->pass = 0;
        note(r, "%s: a write landed outside an output buffer%.0f", "guard bytes", 0);
    }
    /* exact contracts: rows that see no key, keys no query sees */
    double *got = malloc((nq > nk ? nq : nk) * 8 + 8);
    if (got) {
        wa_tensor_to_f64(&ker.to, got);
        for (size_t row = 0; row < nrows; row++)
            if (isinf(rlse[row])) {
                for (int64_t d = 0; d < c->D; d++)
                    if (got[row * (size_t)c->D + (size_t)d] != 0.0) {
                        r->pass = 0;
                        note(r, "%s: a row with no visible key has o != 0 (%g)", "o", got[row * (size_t)c->D + (size_t)d]);
                    }
            }
        wa_tensor_to_f64(&ker.tdk, got);
        for (int64_t j = 0; j < c->Nk; j++) {
            if (key_seen(c, j)) continue;
            for (int64_t bh = 0; bh < c->B * c->Hkv; bh++)
                for (int64_t d = 0; d < c->D; d++)
                    if (got[((size_t)bh * (size_t)c->Nk + (size_t)j) * (size_t)c->D + (size_t)d] != 0.0) {
                        r->pass = 0;
                        note(r, "%s: a key no query sees has dk != 0 (%g)", "dk", got[((size_t)bh * (size_t)c->Nk + (size_t)j) * (size_t)c->D + (size_t)d]);
                    }
        }
        free(got);
    }
done:
    free(cu);
    free(q), free(k), free(v), free(go), free(rq), free(rk), free(rv), free(rdo), free(ro), free(rlse), free(rdq);
    free(rdk), free(rdv), free(xo), free(xlse), free(xdq), free(xdk), free(xdv);
    if (have_ker) outputs_free(&ker);
}

/* cuda_varlen_test.c — packed variable-length batches on CUDA against the same sequences one by one.
 *
 * Each case packs a few sequences (empty ones, length 1, Nq_b != Nk_b, windows longer than some
 * sequences) into [1, H, T, D] tensors, runs wa_forward_varlen and wa_backward_varlen on CUDA, and
 * compares every output with rectangular wa_forward / wa_backward calls on CUDA, one per sequence,
 * on views into the same packed inputs. Both go through the same kernels, so o, lse, dk, dv (and
 * dq with cuda_deterministic = 1) must agree exactly; dq with atomic adds may differ in its last
 * bits (tolerance 2^-6 of the largest |dq|). Outputs are poisoned first: every element must be
 * written, and the padding inside rows and the guard rows after T must be left alone.
 *   --big        B = 70,000 sequences of 0 or 1 tokens (more than a grid's 65,535 in z), checked
 *                against what one key gives: o = v, dv = do, dq = dk = 0, lse = scale q.k
 *   --malformed  offsets that decrease, pass T, exceed max_seqlen or are negative: the calls must
 *                return and leave no CUDA error (run it under compute-sanitizer memcheck)
 *   --quick      every third case; --case N runs one; --device cpu runs the same on the CPU (which
 *                checks the harness: the CPU runs varlen calls sequence by sequence); --malformed
 *                needs CUDA (the CPU refuses such offsets)
 * Prints one line per case (PASS|FAIL|SKIP), then "N passed, N failed"; exits 1 on any failure.
 * scripts/cuda_check.sh builds it into build/cuda_varlen_test and runs it (its varlen and sm80 stages).
 */
#include "winattn.h"
#include "convert.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                                                 \
    do {                                                                                                            \
        wa_status st_ = (call);                                                                                     \
        if (st_ != WA_OK) {                                                                                         \
            fprintf(stderr, "cuda_varlen_test: %s failed: %s (%s:%d)\n", #call, wa_last_error(), __FILE__, __LINE__);   \
            exit(2);                                                                                                \
        }                                                                                                           \
    } while (0)

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "cuda_varlen_test: out of host memory (%zu bytes)\n", n);
        exit(2);
    }
    return p;
}

/* ---- elements ---- */

static float get_elem(const void *buf, wa_dtype dt, int64_t i) {
    if (dt == WA_F32) return ((const float *)buf)[i];
    uint16_t h = ((const uint16_t *)buf)[i];
    return dt == WA_BF16 ? wa_bf16_to_f32(h) : wa_f16_to_f32(h);
}
static void put_elem(void *buf, wa_dtype dt, int64_t i, float x) {
    if (dt == WA_F32) ((float *)buf)[i] = x;
    else ((uint16_t *)buf)[i] = dt == WA_BF16 ? wa_f32_to_bf16(x) : wa_f32_to_f16(x);
}
/* the poison every output starts as (all bits set: NaN in every dtype) */
static int poisoned(const void *buf, wa_dtype dt, int64_t i) {
    const unsigned char *b = (const unsigned char *)buf + i * (int64_t)wa_dtype_size(dt);
    for (size_t k = 0; k < wa_dtype_size(dt); k++)
        if (b[k] != 0xFF) return 0;
    return 1;
}

static wa_device dev = WA_DEVICE_CUDA; /* --device cpu checks this harness without a GPU */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static float uniform(void) { /* in [-1, 1) */
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) & 0xFFFFFF) / 8388608.0f - 1.0f;
}

/* ---- a packed tensor: host copy, device copy, and its element layout ---- */

typedef struct {
    wa_tensor t;   /* as the library sees it (device pointer) */
    void *host;    /* the whole buffer, guard and padding included */
    size_t elems;  /* of the whole buffer */
    wa_dtype dt;
} buf;

enum { GUARD = 4, PAD = 8 };

/* [1, H, T, D] in one of two layouts, with GUARD rows after T and (layout 0) PAD elements after
 * each token's heads: 0 = packed [T, H, D] with padded rows (wa_tensor_thd's order), 1 = [H, T, D] */
static buf make_buf(wa_context *ctx, wa_dtype dt, int64_t H, int64_t T, int64_t D, int layout, int is_lse) {
    buf b;
    memset(&b, 0, sizeof b);
    b.dt = dt;
    int64_t s0, s1, s2, s3 = 1;
    if (is_lse) {
        s2 = 1, s1 = T + GUARD, s0 = H * s1;
        b.elems = (size_t)(H * (T + GUARD));
    } else if (layout == 0) {
        s2 = H * D + PAD, s1 = D, s0 = (T + GUARD) * s2;
        b.elems = (size_t)((T + GUARD) * s2);
    } else {
        s2 = D, s1 = (T + GUARD) * D, s0 = H * s1;
        b.elems = (size_t)(H * (T + GUARD) * D);
    }
    wa_tensor t = {NULL, dt, dev, {1, H, T, is_lse ? 1 : D}, {s0, s1, s2, s3}};
    size_t bytes = b.elems * wa_dtype_size(dt);
    CHECK(wa_malloc(ctx, dev, bytes, &t.data));
    b.t = t;
    b.host = xmalloc(bytes);
    return b;
}
static void free_buf(wa_context *ctx, buf *b) {
    wa_free_memory(ctx, dev, b->t.data);
    free(b->host);
}
static size_t buf_bytes(const buf *b) { return b->elems * wa_dtype_size(b->dt); }
static int64_t at(const buf *b, int64_t h, int64_t n, int64_t d) { return h * b->t.stride[1] + n * b->t.stride[2] + d; }

/* random inputs in every element of the tensor (padding and guard too: they must never matter) */
static void fill_random(wa_context *ctx, buf *b) {
    for (size_t i = 0; i < b->elems; i++) put_elem(b->host, b->dt, (int64_t)i, uniform());
    CHECK(wa_memcpy(ctx, b->t.data, dev, b->host, WA_DEVICE_CPU, buf_bytes(b)));
}
static void poison(wa_context *ctx, buf *b) {
    memset(b->host, 0xFF, buf_bytes(b));
    CHECK(wa_memcpy(ctx, b->t.data, dev, b->host, WA_DEVICE_CPU, buf_bytes(b)));
}
static void download(wa_context *ctx, buf *b) {
    CHECK(wa_memcpy(ctx, b->host, WA_DEVICE_CPU, b->t.data, dev, buf_bytes(b)));
}
/* rows [start, start + len) of b as a rectangular [1, H, len, D] tensor */
static wa_tensor rows_view(const buf *b, int64_t start, int64_t len) {
    wa_tensor v = b->t;
    v.data = (char *)b->t.data + start * b->t.stride[2] * (int64_t)wa_dtype_size(b->dt);
    v.shape[2] = len;
    return v;
}

/* ---- comparison ---- */

typedef struct {
    double maxabs, refmax;
    int unwritten, clobbered, nonfinite, mismatched;
} diff;

/* varlen output a against the reference r (same layout): every element of the tensor written and
 * equal (within tol · max |r|), every other byte of a's buffer still the poison */
static void compare(const buf *a, const buf *r, double tol_rel, diff *out) {
    memset(out, 0, sizeof *out);
    const int64_t H = a->t.shape[1], T = a->t.shape[2], D = a->t.shape[3];
    unsigned char *inside = (unsigned char *)calloc(a->elems, 1);
    if (!inside) exit(2);
    for (int64_t h = 0; h < H; h++)
        for (int64_t n = 0; n < T; n++)
            for (int64_t d = 0; d < D; d++) {
                int64_t i = at(a, h, n, d);
                inside[i] = 1;
                float y = get_elem(r->host, r->dt, i);
                if (fabs(y) > out->refmax && isfinite(y)) out->refmax = fabs(y);
            }
    const double tol = tol_rel * out->refmax;
    for (size_t i = 0; i < a->elems; i++) {
        if (!inside[i]) {
            if (!poisoned(a->host, a->dt, (int64_t)i)) out->clobbered++;
            continue;
        }
        if (poisoned(a->host, a->dt, (int64_t)i)) {
            out->unwritten++;
            continue;
        }
        float x = get_elem(a->host, a->dt, (int64_t)i), y = get_elem(r->host, r->dt, (int64_t)i);
        if (isnan(x) || isnan(y)) {
            out->nonfinite++;
            continue;
        }
        if (x == y) continue; /* also -inf == -inf (rows that see nothing) */
        double e = isinf(x) || isinf(y) ? INFINITY : fabs((double)x - (double)y);
        if (e > out->maxabs) out->maxabs = e;
        if (e > tol) out->mismatched++;
    }
    free(inside);
}
static int diff_ok(const diff *d) { return !d->unwritten && !d->clobbered && !d->nonfinite && !d->mismatched; }

/* ---- the case table ---- */

typedef struct {
    int n;
    int q[8], k[8];
} mix;
static const mix MIXES[] = {
    {7, {5, 0, 1, 130, 64, 257, 33}, {5, 0, 1, 130, 64, 257, 33}}, /* A: Nq_b = Nk_b, empty and one-token sequences */
    {6, {3, 100, 0, 64, 1, 150}, {7, 50, 20, 0, 200, 129}},         /* B: Nq_b != Nk_b, no keys, no queries */
    {4, {700, 1, 2, 0}, {690, 1, 3, 0}},                            /* C: one long, three tiny */
};
static const char MIX_NAMES[] = "ABC";

typedef struct {
    wa_dtype dt;
    int D;
} dtype_dim;
static const dtype_dim DIMS[] = {{WA_BF16, 64}, {WA_BF16, 128}, {WA_BF16, 256}, {WA_BF16, 512}, {WA_BF16, 72},
                                 {WA_F16, 128},  {WA_F32, 64},   {WA_F32, 72},   {WA_F32, 128}};
static const int64_t WINDOWS[][2] = {{-1, 0}, {15, 0}, {99, 0}, {8, 4}, {-1, -1}};
enum { N_DIMS = sizeof DIMS / sizeof DIMS[0], N_WINDOWS = sizeof WINDOWS / sizeof WINDOWS[0], N_MIXES = 3 };
enum { N_CASES = N_DIMS * N_WINDOWS * N_MIXES * 2 };

typedef struct {
    wa_dtype dt;
    int D, Hq, Hkv, det, mix, layout, slack;
    int64_t left, right;
    float softcap;
} vcase;

static vcase case_of(int idx) {
    vcase c;
    int det = idx % 2, m = idx / 2 % N_MIXES, w = idx / 2 / N_MIXES % N_WINDOWS, dd = idx / 2 / N_MIXES / N_WINDOWS;
    c.dt = DIMS[dd].dt, c.D = DIMS[dd].D, c.det = det, c.mix = m;
    c.left = WINDOWS[w][0], c.right = WINDOWS[w][1];
    c.Hq = w % 2 ? 4 : 2, c.Hkv = w % 2 ? 1 : 2; /* GQA 4 on every other window */
    c.softcap = m == 1 ? 20.0f : 0.0f;
    c.layout = (w + m) % 2;
    c.slack = (w + m + dd) % 3 == 0 ? 37 : 0; /* max_seqlen an upper bound, not the longest */
    return c;
}

static const char *dt_name(wa_dtype dt) { return dt == WA_F32 ? "f32" : dt == WA_F16 ? "f16" : "bf16"; }

static int run_case(wa_context *ctxs[2], int idx) {
    const vcase c = case_of(idx);
    wa_context *ctx = ctxs[c.det];
    const mix *mx = &MIXES[c.mix];
    const int B = mx->n;
    int32_t cu_q[9], cu_k[9];
    int maxq = 0, maxk = 0;
    cu_q[0] = cu_k[0] = 0;
    for (int b = 0; b < B; b++) {
        cu_q[b + 1] = cu_q[b] + mx->q[b], cu_k[b + 1] = cu_k[b] + mx->k[b];
        if (mx->q[b] > maxq) maxq = mx->q[b];
        if (mx->k[b] > maxk) maxk = mx->k[b];
    }
    const int64_t Tq = cu_q[B], Tk = cu_k[B], D = c.D;

    buf q = make_buf(ctx, c.dt, c.Hq, Tq, D, c.layout, 0), k = make_buf(ctx, c.dt, c.Hkv, Tk, D, c.layout, 0);
    buf v = make_buf(ctx, c.dt, c.Hkv, Tk, D, c.layout, 0), g = make_buf(ctx, c.dt, c.Hq, Tq, D, c.layout, 0);
    fill_random(ctx, &q), fill_random(ctx, &k), fill_random(ctx, &v), fill_random(ctx, &g);
    /* outputs: [0] varlen, [1] the reference */
    buf o[2], lse[2], dq[2], dk[2], dv[2];
    for (int i = 0; i < 2; i++) {
        o[i] = make_buf(ctx, c.dt, c.Hq, Tq, D, c.layout, 0), lse[i] = make_buf(ctx, WA_F32, c.Hq, Tq, 1, c.layout, 1);
        dq[i] = make_buf(ctx, c.dt, c.Hq, Tq, D, c.layout, 0), dk[i] = make_buf(ctx, c.dt, c.Hkv, Tk, D, c.layout, 0);
        dv[i] = make_buf(ctx, c.dt, c.Hkv, Tk, D, c.layout, 0);
        poison(ctx, &o[i]), poison(ctx, &lse[i]), poison(ctx, &dq[i]), poison(ctx, &dk[i]), poison(ctx, &dv[i]);
    }
    int32_t *cu_dev = NULL;
    CHECK(wa_malloc(ctx, dev, sizeof cu_q + sizeof cu_k, (void **)&cu_dev));
    CHECK(wa_memcpy(ctx, cu_dev, dev, cu_q, WA_DEVICE_CPU, sizeof cu_q));
    CHECK(wa_memcpy(ctx, cu_dev + 9, dev, cu_k, WA_DEVICE_CPU, sizeof cu_k));

    wa_attn_desc desc = {0.0f, c.softcap, c.left, c.right};
    wa_varlen seqs = {B, cu_dev, cu_dev + 9, maxq + c.slack, maxk + c.slack};

    /* the reference: each sequence alone, rectangular, forward then backward from its own o, lse */
    for (int b = 0; b < B; b++) {
        const int64_t q0 = cu_q[b], nq = mx->q[b], k0 = cu_k[b], nk = mx->k[b];
        wa_tensor qb = rows_view(&q, q0, nq), kb = rows_view(&k, k0, nk), vb = rows_view(&v, k0, nk), gb = rows_view(&g, q0, nq);
        wa_tensor ob = rows_view(&o[1], q0, nq), lb = rows_view(&lse[1], q0, nq), dqb = rows_view(&dq[1], q0, nq);
        wa_tensor dkb = rows_view(&dk[1], k0, nk), dvb = rows_view(&dv[1], k0, nk);
        CHECK(wa_forward(ctx, &desc, &qb, &kb, &vb, &ob, &lb));
        CHECK(wa_backward(ctx, &desc, &qb, &kb, &vb, &ob, &lb, &gb, &dqb, &dkb, &dvb));
    }
    /* varlen: the forward, and the backward from the reference's o and lse (so that it is compared alone) */
    wa_status fst = wa_forward_varlen(ctx, &desc, &seqs, &q.t, &k.t, &v.t, &o[0].t, &lse[0].t);
    wa_status bst = fst == WA_OK ? wa_backward_varlen(ctx, &desc, &seqs, &q.t, &k.t, &v.t, &o[1].t, &lse[1].t, &g.t, &dq[0].t,
                                                      &dk[0].t, &dv[0].t)
                                 : fst;
    char err[300] = "";
    if (bst != WA_OK) snprintf(err, sizeof err, "%s", wa_last_error());
    if (bst == WA_OK) bst = wa_synchronize(ctx);

    int ok = bst == WA_OK;
    double worst = 0.0, refmax = 0.0;
    char what[200] = "";
    if (ok) {
        buf *outs[5][2] = {{&o[0], &o[1]}, {&lse[0], &lse[1]}, {&dq[0], &dq[1]}, {&dk[0], &dk[1]}, {&dv[0], &dv[1]}};
        static const char *names[5] = {"o", "lse", "dq", "dk", "dv"};
        for (int i = 0; i < 5; i++) {
            download(ctx, outs[i][0]), download(ctx, outs[i][1]);
            diff d;
            /* dq with atomic adds lands in another order than the reference's */
            compare(outs[i][0], outs[i][1], i == 2 && !c.det ? 1.0 / 64 : 0.0, &d);
            if (d.maxabs > worst) worst = d.maxabs;
            if (d.refmax > refmax) refmax = d.refmax;
            if (!diff_ok(&d)) {
                ok = 0;
                size_t len = strlen(what);
                snprintf(what + len, sizeof what - len, " %s(unwritten=%d clobbered=%d nan=%d mismatched=%d)", names[i], d.unwritten,
                         d.clobbered, d.nonfinite, d.mismatched);
            }
        }
    }
    printf("%s case %d %s D=%d Hq=%d Hkv=%d win=(%lld,%lld) cap=%g mix=%c %s %s%s maxabs=%.3g ref=%.3g%s%s\n", ok ? "PASS" : "FAIL", idx,
           dt_name(c.dt), c.D, c.Hq, c.Hkv, (long long)c.left, (long long)c.right, (double)c.softcap, MIX_NAMES[c.mix],
           c.det ? "deterministic" : "atomic-dq", c.layout ? "hnd" : "thd+pad", c.slack ? " max+37" : "", worst, refmax, what,
           bst != WA_OK ? err : "");
    fflush(stdout);

    buf *all[14] = {&q, &k, &v, &g, &o[0], &o[1], &lse[0], &lse[1], &dq[0], &dq[1], &dk[0], &dk[1], &dv[0], &dv[1]};
    for (int i = 0; i < 14; i++) free_buf(ctx, all[i]);
    wa_free_memory(ctx, dev, cu_dev);
    return ok;
}

/* ---- B = 70,000: grid z in chunks ---- */

static int run_big(wa_context *ctxs[2], wa_dtype dt, int det) {
    wa_context *ctx = ctxs[det];
    const int B = 70000, D = 64;
    int32_t *cu = (int32_t *)xmalloc(sizeof(int32_t) * (B + 1));
    cu[0] = 0;
    for (int b = 0; b < B; b++) cu[b + 1] = cu[b] + (b % 3 == 2 ? 0 : 1);
    const int64_t T = cu[B];
    buf q = make_buf(ctx, dt, 1, T, D, 0, 0), k = make_buf(ctx, dt, 1, T, D, 0, 0), v = make_buf(ctx, dt, 1, T, D, 0, 0);
    buf g = make_buf(ctx, dt, 1, T, D, 0, 0), o = make_buf(ctx, dt, 1, T, D, 0, 0), lse = make_buf(ctx, WA_F32, 1, T, 1, 0, 1);
    buf dq = make_buf(ctx, dt, 1, T, D, 0, 0), dk = make_buf(ctx, dt, 1, T, D, 0, 0), dv = make_buf(ctx, dt, 1, T, D, 0, 0);
    fill_random(ctx, &q), fill_random(ctx, &k), fill_random(ctx, &v), fill_random(ctx, &g);
    poison(ctx, &o), poison(ctx, &lse), poison(ctx, &dq), poison(ctx, &dk), poison(ctx, &dv);
    int32_t *cu_dev = NULL;
    CHECK(wa_malloc(ctx, dev, sizeof(int32_t) * (B + 1), (void **)&cu_dev));
    CHECK(wa_memcpy(ctx, cu_dev, dev, cu, WA_DEVICE_CPU, sizeof(int32_t) * (B + 1)));
    wa_attn_desc desc = wa_attn_desc_causal();
    wa_varlen seqs = {B, cu_dev, cu_dev, 1, 1};
    wa_status st = wa_forward_varlen(ctx, &desc, &seqs, &q.t, &k.t, &v.t, &o.t, &lse.t);
    if (st == WA_OK) st = wa_backward_varlen(ctx, &desc, &seqs, &q.t, &k.t, &v.t, &o.t, &lse.t, &g.t, &dq.t, &dk.t, &dv.t);
    if (st == WA_OK) st = wa_synchronize(ctx);
    int bad = 0;
    double worst_lse = 0.0;
    if (st == WA_OK) {
        download(ctx, &o), download(ctx, &lse), download(ctx, &dq), download(ctx, &dk), download(ctx, &dv);
        const double scale = 1.0 / sqrt((double)D);
        for (int64_t n = 0; n < T; n++) {
            double s = 0.0;
            for (int d = 0; d < D; d++) {
                int64_t i = at(&q, 0, n, d);
                if (poisoned(o.host, dt, i) || poisoned(dq.host, dt, i) || poisoned(dk.host, dt, i) || poisoned(dv.host, dt, i)) {
                    bad++;
                    continue;
                }
                float ov = get_elem(o.host, dt, i), vv = get_elem(v.host, dt, i), dvv = get_elem(dv.host, dt, i);
                float gv = get_elem(g.host, dt, i);
                if (fabsf(ov - vv) > 1e-6f * fabsf(vv) || dvv != gv || get_elem(dq.host, dt, i) != 0.0f || get_elem(dk.host, dt, i) != 0.0f)
                    bad++;
                s += (double)get_elem(q.host, dt, i) * (double)get_elem(k.host, dt, i);
            }
            int64_t li = at(&lse, 0, n, 0);
            double e = poisoned(lse.host, WA_F32, li) ? INFINITY : fabs(((float *)lse.host)[li] - s * scale);
            if (e > worst_lse) worst_lse = e;
            if (!(e <= 1e-4 + 1e-4 * fabs(s * scale))) bad++;
        }
    }
    int ok = st == WA_OK && bad == 0;
    printf("%s big B=%d T=%lld %s D=%d %s bad=%d lse_maxabs=%.3g%s%s\n", ok ? "PASS" : "FAIL", B, (long long)T, dt_name(dt), D,
           det ? "deterministic" : "atomic-dq", bad, worst_lse, st != WA_OK ? " " : "", st != WA_OK ? wa_last_error() : "");
    fflush(stdout);
    buf *all[9] = {&q, &k, &v, &g, &o, &lse, &dq, &dk, &dv};
    for (int i = 0; i < 9; i++) free_buf(ctx, all[i]);
    wa_free_memory(ctx, dev, cu_dev);
    free(cu);
    return ok;
}

/* ---- malformed offsets: no fault, no CUDA error ---- */

static int run_malformed(wa_context *ctxs[2], int which, int cfg) {
    static const struct {
        wa_dtype dt;
        int D, det;
    } CFG[] = {{WA_BF16, 64, 0}, {WA_BF16, 128, 1}, {WA_BF16, 128, 0}, {WA_BF16, 256, 0}, {WA_BF16, 512, 0}, {WA_F32, 64, 0}, {WA_BF16, 72, 0}};
    const int64_t T = 300;
    /* 5 sequences of Tq = Tk = 300 rows, max_seqlen 100 */
    static const int32_t OFFS[][6] = {
        {0, 250, 20, 290, 10, 300},                                /* decreasing */
        {0, 10, 800, 1200, 5, 300},                                /* past T */
        {0, 300, 300, 300, 300, 300},                              /* the first longer than max_seqlen */
        {-100, -5, 30, 100, 299, 300},                             /* negative */
        {INT32_MAX, INT32_MIN, 0, INT32_MAX, INT32_MIN, INT32_MAX}, /* extremes */
    };
    static const char *names[] = {"decreasing", "past-T", "longer-than-max", "negative", "extremes"};
    wa_context *ctx = ctxs[CFG[cfg].det];
    const wa_dtype dt = CFG[cfg].dt;
    const int D = CFG[cfg].D;
    buf q = make_buf(ctx, dt, 2, T, D, 0, 0), k = make_buf(ctx, dt, 1, T, D, 0, 0), v = make_buf(ctx, dt, 1, T, D, 0, 0);
    buf g = make_buf(ctx, dt, 2, T, D, 0, 0), o = make_buf(ctx, dt, 2, T, D, 0, 0), lse = make_buf(ctx, WA_F32, 2, T, 1, 0, 1);
    buf dq = make_buf(ctx, dt, 2, T, D, 0, 0), dk = make_buf(ctx, dt, 1, T, D, 0, 0), dv = make_buf(ctx, dt, 1, T, D, 0, 0);
    fill_random(ctx, &q), fill_random(ctx, &k), fill_random(ctx, &v), fill_random(ctx, &g);
    fill_random(ctx, &o), fill_random(ctx, &lse);
    int32_t *cu_dev = NULL;
    CHECK(wa_malloc(ctx, dev, sizeof OFFS[0], (void **)&cu_dev));
    CHECK(wa_memcpy(ctx, cu_dev, dev, OFFS[which], WA_DEVICE_CPU, sizeof OFFS[0]));
    wa_attn_desc desc = wa_attn_desc_sliding(40);
    wa_varlen seqs = {5, cu_dev, cu_dev, 100, 100};
    wa_status st = wa_forward_varlen(ctx, &desc, &seqs, &q.t, &k.t, &v.t, &o.t, &lse.t);
    if (st == WA_OK) st = wa_synchronize(ctx);
    fill_random(ctx, &lse); /* finite lse for the backward, whatever the forward left */
    if (st == WA_OK) st = wa_backward_varlen(ctx, &desc, &seqs, &q.t, &k.t, &v.t, &o.t, &lse.t, &g.t, &dq.t, &dk.t, &dv.t);
    if (st == WA_OK) st = wa_synchronize(ctx);
    printf("%s malformed %s %s D=%d %s%s%s\n", st == WA_OK ? "PASS" : "FAIL", names[which], dt_name(dt), D,
           CFG[cfg].det ? "deterministic" : "atomic-dq", st != WA_OK ? " " : "", st != WA_OK ? wa_last_error() : "");
    fflush(stdout);
    buf *all[9] = {&q, &k, &v, &g, &o, &lse, &dq, &dk, &dv};
    for (int i = 0; i < 9; i++) free_buf(ctx, all[i]);
    wa_free_memory(ctx, dev, cu_dev);
    return st == WA_OK;
}

int main(int argc, char **argv) {
    int quick = 0, big = 0, malformed = 0, only = -1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--big")) big = 1;
        else if (!strcmp(argv[i], "--malformed")) malformed = 1;
        else if (!strcmp(argv[i], "--case") && i + 1 < argc) only = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--device") && i + 1 < argc && !strcmp(argv[i + 1], "cpu")) dev = WA_DEVICE_CPU, i++;
        else if (!strcmp(argv[i], "--device") && i + 1 < argc && !strcmp(argv[i + 1], "cuda")) dev = WA_DEVICE_CUDA, i++;
        else {
            fprintf(stderr, "usage: cuda_varlen_test [--device cpu|cuda] [--quick] [--case N] [--big] [--malformed]\n");
            return 2;
        }
    }
    if (!wa_device_available(dev)) {
        printf("SKIP cuda_varlen_test: no usable %s device\n0 passed, 0 failed\n", dev == WA_DEVICE_CPU ? "CPU" : "CUDA");
        return 0;
    }
    wa_context *ctxs[2];
    for (int det = 0; det < 2; det++) {
        wa_context_params params;
        memset(&params, 0, sizeof params);
        params.threads = dev == WA_DEVICE_CPU ? 0 : 1;
        params.cuda_deterministic = det;
        CHECK(wa_context_create(&params, &ctxs[det]));
    }
    int pass = 0, fail = 0;
    if (malformed && dev == WA_DEVICE_CPU) {
        printf("SKIP malformed: the CPU checks the offsets and refuses them\n");
    } else if (malformed) {
        for (int cfg = 0; cfg < 7; cfg++)
            for (int w = 0; w < 5; w++) run_malformed(ctxs, w, cfg) ? pass++ : fail++;
    } else if (big) {
        const wa_dtype dts[2] = {WA_BF16, WA_F32};
        for (int i = 0; i < 2; i++)
            for (int det = 0; det < 2; det++) run_big(ctxs, dts[i], det) ? pass++ : fail++;
    } else {
        for (int idx = 0; idx < N_CASES; idx++) {
            if (only >= 0 && idx != only) continue;
            if (only < 0 && quick && idx % 3) continue;
            run_case(ctxs, idx) ? pass++ : fail++;
        }
    }
    wa_context_destroy(ctxs[0]);
    wa_context_destroy(ctxs[1]);
    printf("%d passed, %d failed\n", pass, fail);
    return fail ? 1 : 0;
}

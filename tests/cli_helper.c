/* cli_helper.c — inputs and checks for tests/test_cli.sh.
 *   cli_helper gen DIR          write valid and malformed IN files for `winattn attn` into DIR
 *   cli_helper verify IN OUT L R LAYOUT
 *                               recompute with the library (window (L, R)) and check OUT holds
 *                               exactly the same o, lse (and dq, dk, dv when IN has do), with the
 *                               right names, dtypes and shapes. Exit 0 when it does. */
#define _GNU_SOURCE
#include "check.h"
#include "safetensors.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 1, HQ = 4, HKV = 2, N = 300, D = 64 };

static void write_or_die(const char *dir, const char *name, const st_out *t, int n) {
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (st_write(path, t, n, NULL, err, sizeof err) != 0) {
        fprintf(stderr, "cli_helper: %s\n", err);
        exit(1);
    }
}

/* DIR/NAME holding a[0..na) then b[0..nb); 0, or 1 with a message */
static int put(const char *dir, const char *name, const void *a, size_t na, const void *b, size_t nb) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) return fprintf(stderr, "cli_helper: cannot write %s\n", path), 1;
    int ok = fwrite(a, 1, na, f) == na && (nb == 0 || fwrite(b, 1, nb, f) == nb);
    ok &= fclose(f) == 0;
    if (!ok) fprintf(stderr, "cli_helper: cannot write %s\n", path);
    return !ok;
}

static st_out tensor(const char *name, st_dtype dt, int64_t a, int64_t b, int64_t c, int64_t d, const void *data) {
    st_out t;
    memset(&t, 0, sizeof t);
    t.name = name, t.dtype = dt, t.rank = 4, t.data = data;
    t.shape[0] = a, t.shape[1] = b, t.shape[2] = c, t.shape[3] = d;
    return t;
}

static int gen(const char *dir) {
    static uint16_t q[B * HQ * N * D], k[B * HKV * N * D], v[B * HKV * N * D], g[B * HQ * N * D];
    static int32_t ints[B * HQ * N * D];
    wa_rng r;
    wa_rng_seed(&r, 5);
    wa_fill_normal(q, WA_BF16, sizeof q / 2, &r, 1), wa_fill_normal(k, WA_BF16, sizeof k / 2, &r, 1);
    wa_fill_normal(v, WA_BF16, sizeof v / 2, &r, 1), wa_fill_normal(g, WA_BF16, sizeof g / 2, &r, 1);
    st_out ok[4] = {tensor("q", ST_BF16, B, HQ, N, D, q), tensor("k", ST_BF16, B, HKV, N, D, k),
                    tensor("v", ST_BF16, B, HKV, N, D, v), tensor("do", ST_BF16, B, HQ, N, D, g)};
    write_or_die(dir, "ok_bhnd.safetensors", ok, 4);
    write_or_die(dir, "ok_fwd_only.safetensors", ok, 3);
    st_out bn[4] = {tensor("q", ST_BF16, B, N, HQ, D, q), tensor("k", ST_BF16, B, N, HKV, D, k),
                    tensor("v", ST_BF16, B, N, HKV, D, v), tensor("do", ST_BF16, B, N, HQ, D, g)};
    write_or_die(dir, "ok_bnhd.safetensors", bn, 4);

    st_out bad[4];
    memcpy(bad, ok, sizeof bad);
    bad[0].rank = 3, bad[0].shape[2] = N * D, bad[0].shape[3] = 0;
    write_or_die(dir, "bad_rank.safetensors", bad, 3);
    memcpy(bad, ok, sizeof bad);
    bad[2].dtype = ST_F16;
    write_or_die(dir, "bad_dtype_mix.safetensors", bad, 3);
    memcpy(bad, ok, sizeof bad);
    bad[0] = tensor("q", ST_I32, B, HQ, N, D / 2, ints);
    write_or_die(dir, "bad_dtype_i32.safetensors", bad, 3);
    memcpy(bad, ok, sizeof bad);
    bad[0].shape[1] = 3, bad[3].shape[1] = 3;
    write_or_die(dir, "bad_gqa.safetensors", bad, 4);
    memcpy(bad, ok, sizeof bad);
    bad[1].shape[3] = 32, bad[1].shape[2] = 2 * N;
    write_or_die(dir, "bad_headdim.safetensors", bad, 3);
    memcpy(bad, ok, sizeof bad);
    bad[3].shape[2] = N / 2;
    write_or_die(dir, "bad_do_shape.safetensors", bad, 4);
    memcpy(bad, ok, sizeof bad);
    bad[3].name = "dO";
    write_or_die(dir, "bad_extra_tensor.safetensors", bad, 4);
    write_or_die(dir, "bad_missing_v.safetensors", ok, 2);
    /* no bytes at all, yet dimensions whose products (lse: B x H x N floats) reach petabytes or
     * overflow: refused on the shapes before any output is allocated */
    st_out empty_huge[3] = {tensor("q", ST_BF16, 1, (int64_t)1 << 24, (int64_t)1 << 24, 0, q),
                      tensor("k", ST_BF16, 1, (int64_t)1 << 24, (int64_t)1 << 24, 0, k),
                      tensor("v", ST_BF16, 1, (int64_t)1 << 24, (int64_t)1 << 24, 0, v)};
    write_or_die(dir, "bad_zero_huge.safetensors", empty_huge, 3);
    empty_huge[0].shape[1] = empty_huge[0].shape[2] = (int64_t)1 << 31;
    empty_huge[1].shape[1] = empty_huge[1].shape[2] = empty_huge[2].shape[1] = empty_huge[2].shape[2] = (int64_t)1 << 31;
    write_or_die(dir, "bad_zero_overflow.safetensors", empty_huge, 3);

    /* byte-level damage to a valid file */
    char path[512];
    snprintf(path, sizeof path, "%s/ok_fwd_only.safetensors", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return 1;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *bytes = len > 8 ? malloc((size_t)len) : NULL;
    int got = bytes && fread(bytes, 1, (size_t)len, f) == (size_t)len;
    fclose(f);
    if (!got) {
        free(bytes);
        return 1;
    }
    uint64_t huge = (uint64_t)len * 4;
    unsigned char le[8];
    for (int i = 0; i < 8; i++) le[i] = (unsigned char)(huge >> (8 * i));
    int failed = put(dir, "bad_truncated.safetensors", bytes, (size_t)len / 2, NULL, 0);
    failed |= put(dir, "bad_lying_header.safetensors", le, 8, bytes + 8, (size_t)len - 8);
    failed |= put(dir, "bad_short.safetensors", bytes, 5, NULL, 0);
    free(bytes);
    return failed;
}

static wa_tensor view(const st_tensor *t, int bnhd) {
    wa_dtype dt = t->dtype == ST_F32 ? WA_F32 : t->dtype == ST_F16 ? WA_F16 : WA_BF16;
    const int64_t *s = t->shape;
    return bnhd ? wa_tensor_bnhd((void *)t->data, dt, s[0], s[2], s[1], s[3]) : wa_tensor_bhnd((void *)t->data, dt, s[0], s[1], s[2], s[3]);
}

static int same_shape(const st_tensor *t, const st_tensor *ref) {
    if (t->rank != ref->rank || t->dtype != ref->dtype) return 0;
    for (int i = 0; i < t->rank; i++)
        if (t->shape[i] != ref->shape[i]) return 0;
    return 1;
}

/* Every exit goes through the end, so that the helper runs clean under LeakSanitizer. */
static int verify(const char *in, const char *out, int64_t left, int64_t right, int bnhd) {
    st_file fi, fo;
    memset(&fi, 0, sizeof fi), memset(&fo, 0, sizeof fo); /* st_close is safe on a zeroed st_file */
    char err[512];
    void *o = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
    float *lse = NULL;
    wa_context *ctx = NULL;
    int same = 0;
    if (st_open(in, &fi, err, sizeof err) || st_open(out, &fo, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        goto done;
    }
    const st_tensor *sq = st_find(&fi, "q"), *sk = st_find(&fi, "k"), *sv = st_find(&fi, "v"), *sg = st_find(&fi, "do");
    const st_tensor *so = st_find(&fo, "o"), *sl = st_find(&fo, "lse");
    if (!sq || !sk || !sv || !so || !sl || !same_shape(so, sq) || sl->dtype != ST_F32 || sl->rank != 3) {
        fprintf(stderr, "verify: o or lse missing or shaped wrong\n");
        goto done;
    }
    if ((st_find(&fo, "dq") != NULL) != (sg != NULL)) {
        fprintf(stderr, "verify: dq present=%d but do present=%d\n", st_find(&fo, "dq") != NULL, sg != NULL);
        goto done;
    }
    wa_tensor q = view(sq, bnhd), k = view(sk, bnhd), v = view(sv, bnhd);
    size_t nq = st_numel(sq), nk = st_numel(sk), es = st_dtype_size(sq->dtype);
    const int64_t *s = q.shape, *sk4 = k.shape;
    size_t nl = (size_t)(s[0] * s[1] * s[2]);
    o = malloc(nq * es), dq = malloc(nq * es), dk = malloc(nk * es), dv = malloc(nk * es), lse = malloc(nl * 4);
    if (!o || !dq || !dk || !dv || !lse) {
        fprintf(stderr, "verify: out of memory\n");
        goto done;
    }
    wa_tensor to = bnhd ? wa_tensor_bnhd(o, q.dtype, s[0], s[1], s[2], s[3]) : wa_tensor_bhnd(o, q.dtype, s[0], s[1], s[2], s[3]);
    wa_tensor tl = wa_tensor_lse(lse, s[0], s[1], s[2]);
    wa_attn_desc d = {0, 0, left, right};
    if (wa_context_create(NULL, &ctx) != WA_OK || wa_forward(ctx, &d, &q, &k, &v, &to, &tl) != WA_OK) {
        fprintf(stderr, "%s\n", wa_last_error());
        goto done;
    }
    same = memcmp(o, so->data, nq * es) == 0 && memcmp(lse, sl->data, nl * 4) == 0;
    if (sg) {
        wa_tensor g = view(sg, bnhd);
        wa_tensor tdq = bnhd ? wa_tensor_bnhd(dq, q.dtype, s[0], s[1], s[2], s[3]) : wa_tensor_bhnd(dq, q.dtype, s[0], s[1], s[2], s[3]);
        wa_tensor tdk = bnhd ? wa_tensor_bnhd(dk, q.dtype, sk4[0], sk4[1], sk4[2], sk4[3]) : wa_tensor_bhnd(dk, q.dtype, sk4[0], sk4[1], sk4[2], sk4[3]);
        wa_tensor tdv = bnhd ? wa_tensor_bnhd(dv, q.dtype, sk4[0], sk4[1], sk4[2], sk4[3]) : wa_tensor_bhnd(dv, q.dtype, sk4[0], sk4[1], sk4[2], sk4[3]);
        if (wa_backward(ctx, &d, &q, &k, &v, &to, &tl, &g, &tdq, &tdk, &tdv) != WA_OK) {
            fprintf(stderr, "%s\n", wa_last_error());
            same = 0;
            goto done;
        }
        const st_tensor *odq = st_find(&fo, "dq"), *odk = st_find(&fo, "dk"), *odv = st_find(&fo, "dv");
        same = same && odq && odk && odv && same_shape(odq, sq) && same_shape(odk, sk) && same_shape(odv, sv) &&
               memcmp(dq, odq->data, nq * es) == 0 && memcmp(dk, odk->data, nk * es) == 0 && memcmp(dv, odv->data, nk * es) == 0;
    }
    if (!same) fprintf(stderr, "verify: OUT differs from the library's own result\n");
done:
    if (ctx) wa_context_destroy(ctx);
    free(o), free(dq), free(dk), free(dv), free(lse);
    st_close(&fi), st_close(&fo);
    return same ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "gen") == 0) return gen(argv[2]);
    if (argc == 7 && strcmp(argv[1], "verify") == 0)
        return verify(argv[2], argv[3], atoll(argv[4]), atoll(argv[5]), strcmp(argv[6], "bnhd") == 0);
    fprintf(stderr, "usage: cli_helper gen DIR | verify IN OUT L R bhnd|bnhd\n");
    return 2;
}

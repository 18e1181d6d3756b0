/* check.c — see check.h. */
#define _GNU_SOURCE
#include "check.h"
#include "convert.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int n_pass, n_fail, n_skip;

static void report(const char *tag, const char *fmt, va_list ap) {
    printf("%s ", tag);
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
}

void check_pass(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report("PASS", fmt, ap);
    va_end(ap);
    n_pass++;
}
void check_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report("FAIL", fmt, ap);
    va_end(ap);
    n_fail++;
}
void check_skip(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report("SKIP", fmt, ap);
    va_end(ap);
    n_skip++;
}
int check(int ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report(ok ? "PASS" : "FAIL", fmt, ap);
    va_end(ap);
    if (ok) n_pass++;
    else n_fail++;
    return ok;
}
int check_summary(void) {
    if (n_skip) printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
    else printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

void rng_seed(rng *r, uint64_t seed) { r->s = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull; }
static uint64_t rng_next(rng *r) {
    uint64_t x = r->s;
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return r->s = x;
}
double rng_uniform(rng *r) { return (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0); }
double rng_normal(rng *r) {
    double u1 = rng_uniform(r), u2 = rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

void *guarded_alloc(guarded *g, size_t bytes) {
    g->bytes = bytes;
    g->base = malloc(bytes + 2 * GUARD_BYTES + 64);
    if (!g->base) return g->data = NULL;
    memset(g->base, POISON_BYTE, bytes + 2 * GUARD_BYTES + 64);
    g->data = g->base + GUARD_BYTES; /* 256 keeps 64-byte alignment relative to malloc's 16 */
    return g->data;
}
int guarded_intact(const guarded *g) {
    const unsigned char *lo = g->base, *hi = g->base + GUARD_BYTES + g->bytes;
    for (size_t i = 0; i < GUARD_BYTES; i++)
        if (lo[i] != POISON_BYTE || hi[i] != POISON_BYTE) return 0;
    return 1;
}
void guarded_free(guarded *g) {
    free(g->base);
    g->base = NULL;
    g->data = NULL;
}

void fill_normal(void *data, wa_dtype dt, size_t n, rng *r, double scale) {
    for (size_t i = 0; i < n; i++) {
        float x = (float)(rng_normal(r) * scale);
        if (dt == WA_F32) ((float *)data)[i] = x;
        else if (dt == WA_BF16) ((uint16_t *)data)[i] = wa_f32_to_bf16(x);
        else ((uint16_t *)data)[i] = wa_f32_to_f16(x);
    }
}

double elem_get(const void *data, wa_dtype dt, size_t i) {
    if (dt == WA_F32) return ((const float *)data)[i];
    uint16_t u = ((const uint16_t *)data)[i];
    return dt == WA_BF16 ? wa_bf16_to_f32(u) : wa_f16_to_f32(u);
}

int elem_poisoned(const void *data, wa_dtype dt, size_t i) {
    size_t es = wa_dtype_size(dt);
    const unsigned char *p = (const unsigned char *)data + i * es;
    for (size_t b = 0; b < es; b++)
        if (p[b] != POISON_BYTE) return 0;
    return 1;
}

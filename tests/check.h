/* check.h — the small harness every C test shares: one line per case
 * (PASS|FAIL|SKIP name detail), counters, a closing "N passed, N failed" line and the exit code;
 * seeded random fills; guarded buffers that catch writes outside an output. */
#ifndef WA_CHECK_H
#define WA_CHECK_H

#include "winattn.h"

#include <stddef.h>
#include <stdint.h>

void check_pass(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void check_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void check_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* PASS or FAIL depending on ok; returns ok. */
int check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prints "N passed, N failed" and returns the process exit code. */
int check_summary(void);

/* xorshift-based generator: reproducible across platforms */
typedef struct rng { uint64_t s; } rng;
void rng_seed(rng *r, uint64_t seed);
double rng_uniform(rng *r);  /* [0, 1) */
double rng_normal(rng *r);

/* A buffer with poisoned guard bytes on both sides, and the output area itself poisoned
 * (NaN-like pattern) so unwritten elements are caught. */
typedef struct guarded {
    unsigned char *base;
    void *data;
    size_t bytes;
} guarded;
#define GUARD_BYTES 256
void *guarded_alloc(guarded *g, size_t bytes);
int guarded_intact(const guarded *g); /* guards untouched */
void guarded_free(guarded *g);

/* Fill a dtype buffer of n elements with N(0, 1) * scale, rounded to the dtype. */
void fill_normal(void *data, wa_dtype dt, size_t n, rng *r, double scale);
/* element i of a dtype buffer as double */
double elem_get(const void *data, wa_dtype dt, size_t i);
/* 1 if element i is the poison pattern (i.e. never written) */
int elem_poisoned(const void *data, wa_dtype dt, size_t i);
#define POISON_BYTE 0xA5

#endif

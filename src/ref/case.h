/* case.h — one correctness case, run the same way by the unit tests and `winattn parity`:
 * fresh random inputs, the kernel under test (forward and backward, outputs guarded and
 * poisoned), the float64 oracle, the low-precision baseline, and FlashAttention's criterion
 * (docs/design.md §4) per output tensor. */
#ifndef WA_CASE_H
#define WA_CASE_H

#include "winattn.h"

typedef struct wa_case {
    int64_t B, Hq, Hkv, Nq, Nk, D;
    wa_dtype dtype;
    int bnhd;             /* 1: [B,N,H,D] memory, 0: [B,H,N,D] */
    int64_t left, right;  /* window */
    float scale;          /* 0: 1/sqrt(D) */
    float softcap;
    uint64_t seed;
    wa_device device;     /* where the kernel under test runs; the oracle and baseline run on the CPU */
    /* A packed varlen batch when nseq > 0: nseq sequences of seq_q[b] queries and seq_k[b] keys,
     * packed [T, H, D]; then B = 1, bnhd = 1, Nq and Nk are the totals (wa_case_varlen sets them).
     * The oracle runs per sequence; the baseline is the dense path through the varlen call. */
    int nseq;
    const int32_t *seq_q, *seq_k;
} wa_case;

/* c as the packed batch of these lengths (B, bnhd, Nq, Nk set from them) */
void wa_case_varlen(wa_case *c, int nseq, const int32_t *seq_q, const int32_t *seq_k);

enum { WA_OUT_O, WA_OUT_LSE, WA_OUT_DQ, WA_OUT_DK, WA_OUT_DV, WA_N_OUT };
extern const char *const wa_out_names[WA_N_OUT];

typedef struct wa_case_result {
    wa_status status;     /* of the kernel under test; WA_OK when it ran */
    char detail[256];     /* first problem found, "" if none */
    double err[WA_N_OUT];      /* max |kernel - oracle| */
    double base_err[WA_N_OUT]; /* max |baseline - oracle| */
    double atol[WA_N_OUT];
    double bound[WA_N_OUT];    /* mult * base_err + atol */
    double mult[WA_N_OUT];
    int pass;
    int used_grad_mult;        /* a gradient passed only under grad_mult x, not 2x */
    double fwd_seconds, bwd_seconds, base_seconds, oracle_seconds;
} wa_case_result;

/* The criterion's multiple is 2 for every output; a gradient that misses 2x but meets
 * grad_mult x (3 in FlashAttention-2's tests) passes with used_grad_mult set. The baseline is
 * wa_baseline (oracle.h) for f32, and for f16 and bf16 the dense path run on `baseline` (a
 * context with WA_ALGO_DENSE; NULL: wa_baseline for every dtype). docs/algorithm.md section 5
 * says why. */
void wa_run_case(const wa_case *c, wa_context *kernel, wa_context *baseline, double grad_mult, wa_case_result *r);
void wa_case_name(const wa_case *c, char *buf, size_t n);

/* Seeded xorshift generator, reproducible on every platform: the cases' inputs and the tests'. */
typedef struct wa_rng {
    uint64_t s;
} wa_rng;
void wa_rng_seed(wa_rng *r, uint64_t seed);
double wa_rng_normal(wa_rng *r);
/* n elements of N(0, 1) * scale, rounded to the dtype */
void wa_fill_normal(void *data, wa_dtype dt, size_t n, wa_rng *r, double scale);

/* 2 * max |fl32(x + 0.3) - 0.3 - x|: FlashAttention's rounding-noise atol. */
double wa_rounding_atol(const double *ref, size_t n);

#endif

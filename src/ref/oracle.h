/* oracle.h — the references: the float64 dense oracle, forward and backward over the mask
 * predicate wa_visible(), written for clarity and never tuned to match a kernel; and the
 * low-precision baseline of the acceptance criterion (wa_baseline). tests/test_oracle.c
 * checks it against central finite differences; everything else is checked against it.
 * Not part of libwinattn: tests and tools link it from build/ref. */
#ifndef WA_ORACLE_H
#define WA_ORACLE_H

#include "winattn.h"
#include "../tile_geometry.h"

typedef struct wa_oracle_shape {
    int64_t B, Hq, Hkv, Nq, Nk, D;
    double scale;   /* the actual scale (no 0-means-default here) */
    double softcap; /* 0 = off */
    wa_window win;
} wa_oracle_shape;

/* All arrays contiguous [B, H, N, D] (lse [B, Hq, Nq]). do_ may be NULL (forward only); then
 * dq, dk, dv are not touched. o and lse may be NULL when only gradients are wanted. */
void wa_oracle(const wa_oracle_shape *s, const double *q, const double *k, const double *v, const double *do_,
               double *o, double *lse, double *dq, double *dk, double *dv);

/* The criterion's low-precision baseline (docs/design.md §4): attention computed the way a
 * framework's unfused fallback computes it, in float32 with every op's output rounded to dt
 * (docs/algorithm.md section 4 lists where), in plain loops that share no code with the library's
 * kernels or its dense path, so that an accuracy loss common to both cannot hide in the bound.
 * Same arrays and conventions as wa_oracle (inputs are dt values held exactly in doubles; outputs
 * are dt values, lse an f32 value). */
void wa_baseline(const wa_oracle_shape *s, wa_dtype dt, const double *q, const double *k, const double *v,
                 const double *do_, double *o, double *lse, double *dq, double *dk, double *dv);

/* Copy a strided wa_tensor (any dtype) into a contiguous double array: exact. */
void wa_tensor_to_f64(const wa_tensor *t, double *out);

#endif

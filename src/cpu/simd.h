/* simd.h — the small vector vocabulary the CPU kernels are written in, one definition per ISA.
 *
 * A kernel translation unit defines exactly one of WA_ISA_AVX512, WA_ISA_AVX2, WA_ISA_NEON,
 * WA_ISA_GENERIC (the Makefile compiles src/cpu/attn_cpu.c once per ISA with the matching -m
 * flags; NEON is baseline on aarch64 and needs none) and includes this header. Vectors are
 * GCC/Clang vector extensions, so + - * and comparisons work on them directly; only the fused
 * multiply-add goes through an intrinsic, because the kernels need to know exactly where
 * rounding happens (see vfma below).
 */
#ifndef WA_SIMD_H
#define WA_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(WA_ISA_AVX512)
#include <immintrin.h>
#define VW 16
#if defined(WA_BF16_DOT) /* the same kernels plus AVX512-BF16 dot products in the bf16 forward */
#define WA_ISA_SUFFIX avx512bf16
#else
#define WA_ISA_SUFFIX avx512
#endif
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));
static inline vf vfma(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
static inline float sfma(float a, float b, float c) { return fmaf(a, b, c); }
#elif defined(WA_ISA_AVX2)
#include <immintrin.h>
#define VW 8
#define WA_ISA_SUFFIX avx2
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint16_t vu16 __attribute__((vector_size(16)));
static inline vf vfma(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
static inline float sfma(float a, float b, float c) { return fmaf(a, b, c); }
#elif defined(WA_ISA_NEON)
/* aarch64: 4 lanes, the same width as the generic build, but with a real fused multiply-add
 * (FMLA); sfma is fmaf, a single FMADD there. docs/portability.md has the design. */
#include <arm_neon.h>
#define VW 4
#define WA_ISA_SUFFIX neon
typedef float vf __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(16)));
typedef uint16_t vu16 __attribute__((vector_size(8)));
static inline vf vfma(vf a, vf b, vf c) { return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b); }
static inline float sfma(float a, float b, float c) { return fmaf(a, b, c); }
#elif defined(WA_ISA_GENERIC)
#define VW 4
#define WA_ISA_SUFFIX generic
typedef float vf __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(16)));
typedef uint16_t vu16 __attribute__((vector_size(8)));
/* No guaranteed FMA here: multiply, round, add, round. sfma matches it exactly, provided the
 * compiler fuses neither (clang fuses a * b + c by default: the Makefile passes -ffp-contract=off). */
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline float sfma(float a, float b, float c) {
    float prod = a * b;
    return prod + c;
}
#else
#error "define one of WA_ISA_AVX512, WA_ISA_AVX2, WA_ISA_NEON, WA_ISA_GENERIC"
#endif

/* Why vfma and sfma must agree: with a one-key window the exact dS is 0, because
 * dP = dO.v and the preprocess term delta = dO.o are the same dot product (o == v bitwise).
 * The GEMM computes dP with vfma and the preprocess computes delta with sfma, in the same order
 * over d, so they round identically and dS comes out exactly 0, as the oracle's does. */

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vsplat(float x) { return (vf){0} + x; }

static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

static inline float vhmax(vf v) {
    float m = v[0];
    for (int i = 1; i < VW; i++) m = v[i] > m ? v[i] : m;
    return m;
}
static inline float vhsum(vf v) {
    /* pairwise, fixed order: deterministic and a little more accurate than a chain */
    float t[VW];
    memcpy(t, &v, sizeof t);
    for (int w = VW / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
}

/* exp(x) in f32, about 1 ulp over the normal range (Cody-Waite reduction, Cephes' degree-6
 * minimax polynomial). exp(0) == 1 exactly; x < -87.3 (including -inf) gives 0 (results that
 * would be subnormal are flushed: they are below 2^-126 of the row maximum's weight);
 * x > 88.72 gives +inf; NaN stays NaN. */
static inline vf vexp(vf x) {
    const vf lo = vsplat(-87.33654f), hi = vsplat(88.72283f);
    vi underflow = x < lo, overflow = x > hi;
    vf xc = vselect(underflow, lo, x);
    xc = vselect(overflow, hi, xc);
    /* n = round(x / ln2) via the 1.5 * 2^23 trick; r = x - n ln2 in two steps */
    const vf magic = vsplat(12582912.0f);
    vf t = xc * vsplat(1.44269504088896341f) + magic;
    vf n = t - magic;
    vf r = xc - n * vsplat(0.693359375f);
    r = r - n * vsplat(-2.12194440e-4f);
    vf p = vsplat(1.9875691500E-4f);
    p = p * r + vsplat(1.3981999507E-3f);
    p = p * r + vsplat(8.3334519073E-3f);
    p = p * r + vsplat(4.1665795894E-2f);
    p = p * r + vsplat(1.6666665459E-1f);
    p = p * r + vsplat(5.0000001201E-1f);
    p = p * (r * r) + r + vsplat(1.0f);
    /* 2^n as two factors, so n up to 128 (x near 88.72) stays representable */
    vi ni = (vi)t - (vi)magic;
    vi n1 = ni >> 1, n2 = ni - n1;
    vf y = p * (vf)((n1 + 127) << 23) * (vf)((n2 + 127) << 23);
    y = vselect(underflow, vsplat(0.0f), y);
    y = vselect(overflow, vsplat(INFINITY), y);
    return y;
}

static inline float sexp(float x) {
    vf v = vsplat(x);
    return vexp(v)[0];
}

#endif /* WA_SIMD_H */

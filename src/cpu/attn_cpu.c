/* attn_cpu.c — tiled attention forward and backward on the CPU, compiled once per ISA.
 *
 * The Makefile builds this file three times (-DWA_ISA_AVX512, -DWA_ISA_AVX2, -DWA_ISA_GENERIC,
 * each with its -m flags); dispatch.c picks one at run time. Each build exports
 * wa_cpu_{forward,backward}_<isa>.
 *
 * Algorithm (docs/algorithm.md has the derivation):
 *   forward   one unit per (b, kv head, group of query heads, query tile). Visit only the key
 *             tiles the window lets the tile see (tile_geometry.h), mask only edge tiles, online
 *             softmax in f32 on transposed score tiles, write o and lse.
 *   backward  a preprocess delta_i = dO_i . O_i (f32: the row statistics pass), then two kinds
 *             of units in one parallel run: (b, kv head, chunk of 32 key tiles) owns dK, dV of
 *             its keys, and dQ of the query tiles whose keys all lie in the chunk (rolling
 *             slots); (b, h, query tile) owns the dQ of every other query tile. Every output
 *             element has exactly one owner and the split does not depend on the thread count,
 *             so results are bit-identical for any number of threads; the workspace is delta
 *             (B*Hq*Nq floats) plus per-thread tiles and f64 slots (at most 16 MB).
 *   sums      anything longer than a tile is an f64 sum of f32 tile partials (see acc_f64), and
 *             a NaN or infinity in an input reaches only the rows and keys that see it (see
 *             tile_nonfinite).
 *
 * All tiles live in per-thread f32 scratch with rows padded to a multiple of 16 floats and
 * zero-filled padding, so the GEMM micro-kernel never needs a column tail.
 */
#define _GNU_SOURCE
#include "../convert.h"
#include "../internal.h"
#include "cpu.h"
#include "simd.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define EXPORT(name) CAT(name, CAT(_, WA_ISA_SUFFIX))

/* ---- tile loads and stores: dtype conversion happens here, once per element ---- */

static void load_row(float *dst, const void *src, wa_dtype dt, int64_t D) {
    if (dt == WA_F32) {
        memcpy(dst, src, (size_t)D * 4);
    } else if (dt == WA_BF16) {
        /* bf16 is the top half of an f32: widen and shift, VW lanes at a time */
        const uint16_t *s = src;
        int64_t d = 0;
        for (; d + VW <= D; d += VW) {
            vu16 h;
            memcpy(&h, s + d, sizeof h);
            vi w = __builtin_convertvector(h, vi) << 16;
            vstore(dst + d, (vf)w);
        }
        for (; d < D; d++) dst[d] = wa_bf16_to_f32(s[d]);
    } else {
        const uint16_t *s = src;
        int64_t d = 0;
#if defined(WA_ISA_AVX512)
        for (; d + 16 <= D; d += 16) _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + d))));
#endif
        for (; d < D; d++) dst[d] = wa_f16_to_f32(s[d]);
    }
}

static void store_row(void *dst, wa_dtype dt, const float *src, int64_t D) {
    if (dt == WA_F32) {
        memcpy(dst, src, (size_t)D * 4);
    } else if (dt == WA_BF16) {
        uint16_t *o = dst;
        for (int64_t d = 0; d < D; d++) o[d] = wa_f32_to_bf16(src[d]);
    } else {
        uint16_t *o = dst;
        for (int64_t d = 0; d < D; d++) o[d] = wa_f32_to_f16(src[d]);
    }
}

/* rows [row0, row0+nrows) of head (b, h) into dst[r*ld + d]; columns D..ld-1 and rows
 * nrows..pad_rows-1 zeroed. */
static void load_tile(float *dst, int64_t ld, const wa_tensor *t, int64_t b, int64_t h, int64_t row0, int64_t nrows,
                      int64_t D, int64_t pad_rows) {
    for (int64_t r = 0; r < nrows; r++) {
        float *row = dst + r * ld;
        load_row(row, wa_row_ptr(t, b, h, row0 + r), t->dtype, D);
        memset(row + D, 0, (size_t)(ld - D) * 4);
    }
    if (pad_rows > nrows) memset(dst + nrows * ld, 0, (size_t)((pad_rows - nrows) * ld) * 4);
}

/* The same rows transposed: dst[d*ld + r] for d < D; columns nrows..ld-1 zeroed. */
static void load_tile_transposed(float *dst, int64_t ld, const wa_tensor *t, int64_t b, int64_t h, int64_t row0,
                                 int64_t nrows, int64_t D, float *row_buf) {
    for (int64_t r = 0; r < nrows; r++) {
        load_row(row_buf, wa_row_ptr(t, b, h, row0 + r), t->dtype, D);
        for (int64_t d = 0; d < D; d++) dst[d * ld + r] = row_buf[d];
    }
    for (int64_t d = 0; d < D; d++)
        for (int64_t r = nrows; r < ld; r++) dst[d * ld + r] = 0.0f;
}

/* ---- the GEMM micro-kernel: C[m x n] (+)= A[m x k] . B[k x n] ----
 * A is read through strides (A(r, t) = A[r*ars + t*acs]) so that P^T and dS^T need no
 * transposed copy; B and C are row-major, n is a multiple of VW. Every C element accumulates
 * over t in order with vfma, whatever the blocking: see simd.h for why that matters. With
 * from_zero the sums start at 0 instead of C's contents (a tile partial, see acc_f64). */
__attribute__((always_inline)) static inline void gemm_tile(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars,
                                                            int64_t acs, const float *B, int64_t ldb, float *C,
                                                            int64_t ldc, int from_zero) {
#define LOADC(ptr) (from_zero ? vsplat(0.0f) : vload(ptr))
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {
        const float *a0 = A + r * ars, *a1 = a0 + ars, *a2 = a1 + ars, *a3 = a2 + ars;
        float *c0 = C + r * ldc, *c1 = c0 + ldc, *c2 = c1 + ldc, *c3 = c2 + ldc;
        int64_t c = 0;
        for (; c + 2 * VW <= n; c += 2 * VW) {
            vf x00 = LOADC(c0 + c), x01 = LOADC(c0 + c + VW), x10 = LOADC(c1 + c), x11 = LOADC(c1 + c + VW);
            vf x20 = LOADC(c2 + c), x21 = LOADC(c2 + c + VW), x30 = LOADC(c3 + c), x31 = LOADC(c3 + c + VW);
            const float *bp = B + c;
            for (int64_t t = 0; t < k; t++, bp += ldb) {
                vf b0 = vload(bp), b1 = vload(bp + VW);
                vf y0 = vsplat(a0[t * acs]), y1 = vsplat(a1[t * acs]);
                vf y2 = vsplat(a2[t * acs]), y3 = vsplat(a3[t * acs]);
                x00 = vfma(y0, b0, x00), x01 = vfma(y0, b1, x01);
                x10 = vfma(y1, b0, x10), x11 = vfma(y1, b1, x11);
                x20 = vfma(y2, b0, x20), x21 = vfma(y2, b1, x21);
                x30 = vfma(y3, b0, x30), x31 = vfma(y3, b1, x31);
            }
            vstore(c0 + c, x00), vstore(c0 + c + VW, x01), vstore(c1 + c, x10), vstore(c1 + c + VW, x11);
            vstore(c2 + c, x20), vstore(c2 + c + VW, x21), vstore(c3 + c, x30), vstore(c3 + c + VW, x31);
        }
        for (; c < n; c += VW) {
            vf x0 = LOADC(c0 + c), x1 = LOADC(c1 + c), x2 = LOADC(c2 + c), x3 = LOADC(c3 + c);
            const float *bp = B + c;
            for (int64_t t = 0; t < k; t++, bp += ldb) {
                vf b0 = vload(bp);
                x0 = vfma(vsplat(a0[t * acs]), b0, x0), x1 = vfma(vsplat(a1[t * acs]), b0, x1);
                x2 = vfma(vsplat(a2[t * acs]), b0, x2), x3 = vfma(vsplat(a3[t * acs]), b0, x3);
            }
            vstore(c0 + c, x0), vstore(c1 + c, x1), vstore(c2 + c, x2), vstore(c3 + c, x3);
        }
    }
    for (; r < m; r++) {
        const float *a0 = A + r * ars;
        float *c0 = C + r * ldc;
        for (int64_t c = 0; c < n; c += VW) {
            vf x0 = LOADC(c0 + c);
            const float *bp = B + c;
            for (int64_t t = 0; t < k; t++, bp += ldb) x0 = vfma(vsplat(a0[t * acs]), vload(bp), x0);
            vstore(c0 + c, x0);
        }
    }
#undef LOADC
}

static void gemm_acc(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                     int64_t ldb, float *C, int64_t ldc) {
    gemm_tile(m, n, k, A, ars, acs, B, ldb, C, ldc, 0);
}
static void gemm_set(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                     int64_t ldb, float *C, int64_t ldc) {
    gemm_tile(m, n, k, A, ars, acs, B, ldb, C, ldc, 1);
}

/* ---- accumulation across tiles (docs/algorithm.md section 6) ----
 * A sum longer than one tile (o over a row's key tiles, dQ likewise, dK and dV over the GQA
 * group's heads and the query tiles) is blocked: an f32 partial accumulates the GEMMs of
 * WA_TILES_PER_F64 consecutive tiles from zero, the partials are added in f64, and the f32
 * result is rounded once at the end. One f32 accumulator over thousands of terms lost up to
 * ~40 ulp where a framework's blocked sgemm loses a few. */
/* How many tiles one f32 partial spans before it is added in f64: the partial's f32 chain is then
 * at most this many tiles of terms (128 with 64-row tiles; a BLAS sgemm's k-blocking is 256 and
 * more), and the f64 additions, memory-bound, cost half what they would per tile. */
#define WA_TILES_PER_F64 2

/* f64 lanes, as many as vf has: twice a native vector in every build. No function takes or
 * returns one by value (an AVX-sized vector passed without AVX enabled changes the psABI, which
 * clang and GCC flag under -Wpsabi): values move through memory (vdload, vdstore) and the
 * conversions are macros. */
typedef double vd __attribute__((vector_size(VW * 8)));
#define VWIDEN(x) __builtin_convertvector((x), vd)
#define VNARROW(x) __builtin_convertvector((x), vf)
static inline void vdload(vd *v, const double *p) { memcpy(v, p, sizeof *v); }
static inline void vdstore(double *p, const vd *v) { memcpy(p, v, sizeof *v); }

/* dst += src, n elements (a multiple of VW) */
static void acc_f64(double *dst, const float *src, int64_t n) {
    for (int64_t x = 0; x < n; x += VW) {
        vd d;
        vdload(&d, dst + x);
        d += VWIDEN(vload(src + x));
        vdstore(dst + x, &d);
    }
}
/* dst = src rounded to f32, n elements (a multiple of VW) */
static void narrow_f64(float *dst, const double *src, int64_t n) {
    for (int64_t x = 0; x < n; x += VW) {
        vd d;
        vdload(&d, src + x);
        vstore(dst + x, VNARROW(d));
    }
}

/* ---- non-finite inputs (docs/algorithm.md section 7) ----
 * A masked pair has P = dS = 0 exactly, but a GEMM over a tile still multiplies that 0 by the
 * other operand's row, and 0 * NaN = 0 * inf = NaN would reach a row that cannot see the key (or
 * a key no row of that pair sees). So on edge tiles, when the operand summed over holds a NaN or
 * an infinity, the contraction runs row by row over each row's visible range only: the same
 * micro-kernel in the same order, minus exact zero terms, so finite results do not change. */
static int tile_nonfinite(const float *x, int64_t rows, int64_t cols, int64_t ld) {
    vf acc = vsplat(0.0f);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c += VW) acc += vload(x + r * ld + c) * vsplat(0.0f); /* 0 unless NaN or inf */
    for (int l = 0; l < VW; l++)
        if (acc[l] != 0.0f) return 1;
    return 0;
}

/* ---- scores: s = softcap(scale * q.k), -inf outside the window and in padding ---- */

/* Columns of row i (global) visible inside key tile [j0, j0+n): [*lo, *hi] in tile coordinates. */
static void row_visible_cols(const wa_window *w, int64_t i, int64_t j0, int64_t n, int edge, int64_t *lo, int64_t *hi) {
    *lo = 0, *hi = n - 1;
    if (edge) {
        *lo = wa_max64(*lo, wa_row_first_key(w, i) - j0);
        *hi = wa_min64(*hi, wa_row_last_key(w, i) - j0);
    }
}

/* s = softcap(scale * dot) over a row of raw dot products: ld entries scaled, the first
 * `live` of them capped (the rest are padding). */
static void scale_and_cap(const wa_problem *p, float *s, int64_t ld, int64_t live) {
    for (int64_t c = 0; c < ld; c += VW) vstore(s + c, vload(s + c) * vsplat(p->scale));
    if (p->softcap > 0.0f)
        for (int64_t c = 0; c < live; c++) s[c] = p->softcap * tanhf(s[c] / p->softcap);
}

static void finish_scores(const cpu_tile_args *a, float *S, int64_t ld, int64_t i0, int64_t m, int64_t j0, int64_t n,
                          int edge) {
    for (int64_t r = 0; r < m; r++) {
        float *s = S + r * ld;
        scale_and_cap(a->p, s, ld, n);
        int64_t lo, hi;
        row_visible_cols(&a->p->win, i0 + r, j0, n, edge, &lo, &hi);
        for (int64_t c = 0; c < ld; c++)
            if (c < lo || c > hi) s[c] = -INFINITY;
    }
}

/* S^T (keys as rows, n of them; queries as columns, ld wide): s = softcap(scale * k.q), and on
 * edge tiles -inf outside each query's visible keys. Padding columns (queries past the tile)
 * are left finite: nothing reads them. */
static void scores_transposed(const cpu_tile_args *a, float *ST, int64_t ld, int64_t i0, int64_t m, int64_t j0, int64_t n,
                              int edge) {
    for (int64_t j = 0; j < n; j++) scale_and_cap(a->p, ST + j * ld, ld, m);
    if (!edge) return;
    for (int64_t c = 0; c < m; c++) {
        int64_t lo, hi;
        row_visible_cols(&a->p->win, i0 + c, j0, n, 1, &lo, &hi);
        for (int64_t j = 0; j < n; j++)
            if (j < lo || j > hi) ST[j * ld + c] = -INFINITY;
    }
}

#if defined(WA_BF16_DOT)
/* ---- bf16 dot products (AVX512-BF16), for the forward of bf16 inputs ----
 * vdpbf16ps multiplies two pairs of bf16 per f32 lane and adds both products to the lane: twice
 * the multiply-adds of an f32 FMA per instruction, on operands that need no widening. Operands
 * are packed as 32-bit words holding two consecutive elements along the reduction (the lower
 * half is the even one). Q and K are bf16 already; P is rounded to bf16 before P·V, as
 * FlashAttention's GPU kernels do (the row sums stay f32 and unrounded). The backward keeps its
 * f32 FMAs: its recomputed scores differ from these by rounding order only. */
typedef uint32_t bfpair;

/* C[m x n] (+)= A . B over kp pairs: A(r, t) = A[r*ars + t*acs] (a pair), B rows of n pairs
 * (ldb in pairs), C row-major f32; n a multiple of VW. Same blocking and from_zero as gemm_tile. */
__attribute__((always_inline)) static inline void gemm_bf16_tile(int64_t m, int64_t n, int64_t kp, const bfpair *A,
                                                                 int64_t ars, int64_t acs, const bfpair *B, int64_t ldb,
                                                                 float *C, int64_t ldc, int from_zero) {
#define DOT(acc, a, bv) acc = _mm512_dpbf16_ps(acc, (__m512bh)(bv), (__m512bh)_mm512_set1_epi32((int)(a)))
#define LOADC(ptr) (from_zero ? _mm512_setzero_ps() : _mm512_loadu_ps(ptr))
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {
        const bfpair *a0 = A + r * ars, *a1 = a0 + ars, *a2 = a1 + ars, *a3 = a2 + ars;
        float *c0 = C + r * ldc, *c1 = c0 + ldc, *c2 = c1 + ldc, *c3 = c2 + ldc;
        int64_t c = 0;
        for (; c + 32 <= n; c += 32) {
            __m512 x00 = LOADC(c0 + c), x01 = LOADC(c0 + c + 16);
            __m512 x10 = LOADC(c1 + c), x11 = LOADC(c1 + c + 16);
            __m512 x20 = LOADC(c2 + c), x21 = LOADC(c2 + c + 16);
            __m512 x30 = LOADC(c3 + c), x31 = LOADC(c3 + c + 16);
            const bfpair *bp = B + c;
            for (int64_t t = 0; t < kp; t++, bp += ldb) {
                __m512i b0 = _mm512_loadu_si512(bp), b1 = _mm512_loadu_si512(bp + 16);
                bfpair y0 = a0[t * acs], y1 = a1[t * acs], y2 = a2[t * acs], y3 = a3[t * acs];
                DOT(x00, y0, b0), DOT(x01, y0, b1), DOT(x10, y1, b0), DOT(x11, y1, b1);
                DOT(x20, y2, b0), DOT(x21, y2, b1), DOT(x30, y3, b0), DOT(x31, y3, b1);
            }
            _mm512_storeu_ps(c0 + c, x00), _mm512_storeu_ps(c0 + c + 16, x01);
            _mm512_storeu_ps(c1 + c, x10), _mm512_storeu_ps(c1 + c + 16, x11);
            _mm512_storeu_ps(c2 + c, x20), _mm512_storeu_ps(c2 + c + 16, x21);
            _mm512_storeu_ps(c3 + c, x30), _mm512_storeu_ps(c3 + c + 16, x31);
        }
        for (; c < n; c += 16) {
            __m512 x0 = LOADC(c0 + c), x1 = LOADC(c1 + c);
            __m512 x2 = LOADC(c2 + c), x3 = LOADC(c3 + c);
            const bfpair *bp = B + c;
            for (int64_t t = 0; t < kp; t++, bp += ldb) {
                __m512i b0 = _mm512_loadu_si512(bp);
                DOT(x0, a0[t * acs], b0), DOT(x1, a1[t * acs], b0), DOT(x2, a2[t * acs], b0), DOT(x3, a3[t * acs], b0);
            }
            _mm512_storeu_ps(c0 + c, x0), _mm512_storeu_ps(c1 + c, x1);
            _mm512_storeu_ps(c2 + c, x2), _mm512_storeu_ps(c3 + c, x3);
        }
    }
    for (; r < m; r++) {
        const bfpair *a0 = A + r * ars;
        float *c0 = C + r * ldc;
        for (int64_t c = 0; c < n; c += 16) {
            __m512 x0 = LOADC(c0 + c);
            const bfpair *bp = B + c;
            for (int64_t t = 0; t < kp; t++, bp += ldb) DOT(x0, a0[t * acs], _mm512_loadu_si512(bp));
            _mm512_storeu_ps(c0 + c, x0);
        }
    }
#undef DOT
#undef LOADC
}

static void gemm_bf16_acc(int64_t m, int64_t n, int64_t kp, const bfpair *A, int64_t ars, int64_t acs,
                          const bfpair *B, int64_t ldb, float *C, int64_t ldc) {
    gemm_bf16_tile(m, n, kp, A, ars, acs, B, ldb, C, ldc, 0);
}
static void gemm_bf16_set(int64_t m, int64_t n, int64_t kp, const bfpair *A, int64_t ars, int64_t acs,
                          const bfpair *B, int64_t ldb, float *C, int64_t ldc) {
    gemm_bf16_tile(m, n, kp, A, ars, acs, B, ldb, C, ldc, 1);
}

/* Rows [row0, row0+nrows) of head (b, h) as rows of pairs along D: dst[r*ldp + t] holds
 * elements (2t, 2t+1); pairs past D (and the odd element of an odd D) are zero, as are rows
 * nrows..pad_rows-1. */
static void pack_rows_bf16(bfpair *dst, int64_t ldp, const wa_tensor *tt, int64_t b, int64_t h, int64_t row0,
                           int64_t nrows, int64_t D, int64_t pad_rows) {
    for (int64_t r = 0; r < pad_rows; r++) {
        bfpair *row = dst + r * ldp;
        memset(row, 0, (size_t)ldp * sizeof *row);
        if (r < nrows) memcpy(row, wa_row_ptr(tt, b, h, row0 + r), (size_t)D * 2);
    }
}

/* The same rows transposed by pairs: dst[t*ld + r] = pair t of row r; columns nrows..ld-1 zero. */
static void pack_rows_bf16_transposed(bfpair *dst, int64_t ld, const wa_tensor *tt, int64_t b, int64_t h,
                                      int64_t row0, int64_t nrows, int64_t D, bfpair *row_buf) {
    int64_t kp = (D + 1) / 2;
    for (int64_t r = 0; r < ld; r++) {
        pack_rows_bf16(row_buf, kp, tt, b, h, row0 + r, r < nrows ? 1 : 0, D, 1);
        for (int64_t t = 0; t < kp; t++) dst[t * ld + r] = row_buf[t];
    }
}

/* Pairs along rows of a row-major bf16 tile: dst[t*ld + c] = (row 2t, row 2t+1) at column c,
 * from the V rows [row0, row0+nrows) of head (b, h); a missing odd row and columns past D are
 * zero. */
static void pack_v_pairs(bfpair *dst, int64_t ld, const wa_tensor *tt, int64_t b, int64_t h, int64_t row0,
                         int64_t nrows, int64_t D) {
    for (int64_t t = 0; 2 * t < nrows; t++) {
        const uint16_t *lo = wa_row_ptr(tt, b, h, row0 + 2 * t);
        const uint16_t *hi = 2 * t + 1 < nrows ? wa_row_ptr(tt, b, h, row0 + 2 * t + 1) : NULL;
        bfpair *out = dst + t * ld;
        int64_t c = 0;
        for (; c + 16 <= D; c += 16) {
            __m512i l = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(lo + c)));
            __m512i u = hi ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(hi + c))), 16)
                           : _mm512_setzero_si512();
            _mm512_storeu_si512(out + c, _mm512_or_si512(l, u));
        }
        for (; c < D; c++) out[c] = lo[c] | (hi ? (bfpair)hi[c] << 16 : 0);
        for (; c < ld; c++) out[c] = 0;
    }
}

/* The probabilities P^T [n x ld] (f32, keys as rows) rounded to bf16 and paired along keys, in
 * place: row t of the result holds keys (2t, 2t+1). Writing pair row t only touches S^T rows
 * <= t, which are consumed by then (row t is read in the same step before it is written). */
static void pack_p_pairs(float *ST, int64_t ld, int64_t n) {
    bfpair *out = (bfpair *)ST;
    for (int64_t t = 0; 2 * t < n; t++)
        for (int64_t c = 0; c < ld; c += 16) {
            __m512 lo = _mm512_loadu_ps(ST + 2 * t * ld + c);
            __m512 hi = 2 * t + 1 < n ? _mm512_loadu_ps(ST + (2 * t + 1) * ld + c) : _mm512_setzero_ps();
            __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
            __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi)), 16);
            _mm512_storeu_si512(out + t * ld + c, _mm512_or_si512(l, u));
        }
}

/* One row of the P.V partial (out = or, with add, out +=) over keys [lo, hi] only (the non-finite
 * path, see tile_nonfinite): a pair that holds one key of the range and one outside it gets the
 * outside key's V zeroed, since P = 0 there does not make 0 * NaN vanish. tmp holds Dp pairs. */
static void pv_row_bf16(float *out, int add, const bfpair *PT, int64_t Bqp, int64_t r, const bfpair *Vs, int64_t Dp,
                        int64_t lo, int64_t hi, bfpair *tmp) {
    if (!add) memset(out, 0, (size_t)Dp * 4);
    for (int64_t t = lo / 2; lo <= hi && t <= hi / 2; t++) {
        const bfpair *vp = Vs + t * Dp;
        bfpair keep = (2 * t >= lo ? 0x0000FFFFu : 0u) | (2 * t + 1 <= hi ? 0xFFFF0000u : 0u);
        if (keep != 0xFFFFFFFFu) {
            for (int64_t d = 0; d < Dp; d++) tmp[d] = vp[d] & keep;
            vp = tmp;
        }
        gemm_bf16_acc(1, Dp, 1, PT + t * Bqp + r, 1, Bqp, vp, Dp, out, Dp);
    }
}

/* any bf16 NaN or infinity among n pairs */
static int pairs_nonfinite(const bfpair *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if ((x[i] & 0x7F800000u) == 0x7F800000u || (x[i] & 0x7F80u) == 0x7F80u) return 1;
    return 0;
}
#endif /* WA_BF16_DOT */

/* One key tile of the column-wise online softmax: ST [n x Bqp] holds the tile's scores and
 * becomes its unnormalised probabilities exp(s - new max); the running max and (f64) sum of each
 * query column are updated, and alpha gets each column's rescale factor for the running
 * numerators (forward_unit applies it). */
static void online_softmax_step(float *ST, int64_t Bqp, int64_t n, float *mx, double *sum, float *alpha) {
    for (int64_t c = 0; c < Bqp; c += VW) {
        vf m_old = vload(mx + c), m_new = m_old;
        for (int64_t j = 0; j < n; j++) m_new = vmax(m_new, vload(ST + j * Bqp + c));
        /* columns that have seen nothing yet keep shift 0, so exp(-inf - 0) = 0, never NaN */
        vf shift = vselect(m_new == vsplat(-INFINITY), vsplat(0.0f), m_new);
        vf al = vexp(m_old - shift), acc = vsplat(0.0f);
        for (int64_t j = 0; j < n; j++) {
            vf e = vexp(vload(ST + j * Bqp + c) - shift);
            vstore(ST + j * Bqp + c, e);
            acc += e;
        }
        vd s;
        vdload(&s, sum + c);
        s = s * VWIDEN(al) + VWIDEN(acc);
        vdstore(sum + c, &s);
        vstore(mx + c, m_new);
        vstore(alpha + c, al);
    }
}

/* O = scale O + partial for the first m rows (O in f64, the partial in f32) */
static void flush_partial(double *O, const float *partial, const double *scale, int64_t m, int64_t Dp) {
    for (int64_t r = 0; r < m; r++) {
        double *o = O + r * Dp;
        const float *x = partial + r * Dp;
        vd sc = VWIDEN(vsplat(0.0f)) + scale[r];
        for (int64_t c = 0; c < Dp; c += VW) {
            vd d;
            vdload(&d, o + c);
            d = d * sc + VWIDEN(vload(x + c));
            vdstore(o + c, &d);
        }
    }
}

/* The two contractions of a tile pair into an f32 partial (part = or, with add, part +=; the
 * partials are added in f64 every WA_TILES_PER_F64 tiles). M(r, c) = M[r*mrs + c*mcs] is P or dS
 * for query rows r < m and keys c < n.
 *   rows_partial:  part [m x Dp] (+)= M X,   X [n x Dp] (V or K): the sum over keys, for o and dQ
 *   keys_partial:  part [n x Dp] (+)= M^T X, X [m x Dp] (dO or Q): the sum over rows, for dV and dK
 * only_visible: each output row sums over the pairs it is part of and nothing else (the
 * non-finite path, see tile_nonfinite). */
static void rows_partial(const cpu_tile_args *a, float *part, int add, const float *M, int64_t mrs, int64_t mcs,
                         const float *X, int64_t i0, int64_t m, int64_t j0, int64_t n, int only_visible) {
    const int64_t Dp = a->Dp;
    if (!only_visible) {
        if (add) gemm_acc(m, Dp, n, M, mrs, mcs, X, Dp, part, Dp);
        else gemm_set(m, Dp, n, M, mrs, mcs, X, Dp, part, Dp);
        return;
    }
    for (int64_t r = 0; r < m; r++) {
        int64_t lo, hi;
        row_visible_cols(&a->p->win, i0 + r, j0, n, 1, &lo, &hi);
        if (!add) memset(part + r * Dp, 0, (size_t)Dp * 4);
        if (lo <= hi) gemm_acc(1, Dp, hi - lo + 1, M + r * mrs + lo * mcs, mrs, mcs, X + lo * Dp, Dp, part + r * Dp, Dp);
    }
}

static void keys_partial(const cpu_tile_args *a, float *part, int add, const float *M, int64_t mrs, int64_t mcs,
                         const float *X, int64_t i0, int64_t m, int64_t j0, int64_t n, int only_visible) {
    const wa_window *w = &a->p->win;
    const int64_t Dp = a->Dp;
    if (!only_visible) {
        if (add) gemm_acc(n, Dp, m, M, mcs, mrs, X, Dp, part, Dp);
        else gemm_set(n, Dp, m, M, mcs, mrs, X, Dp, part, Dp);
        return;
    }
    for (int64_t c = 0; c < n; c++) {
        int64_t r0 = wa_max64(wa_col_first_query(w, j0 + c), i0) - i0;
        int64_t r1 = wa_min64(wa_col_last_query(w, j0 + c), i0 + m - 1) - i0;
        if (!add) memset(part + c * Dp, 0, (size_t)Dp * 4);
        if (r0 <= r1) gemm_acc(1, Dp, r1 - r0 + 1, M + r0 * mrs + c * mcs, mcs, mrs, X + r0 * Dp, Dp, part + c * Dp, Dp);
    }
}

/* ---- forward ----
 * Scores are computed transposed, S^T = K Q^T (keys as rows, queries as columns), for two
 * reasons: K is used as stored (row-major) while Q^T is built once per unit, so no tile is
 * transposed per key tile; and the online softmax runs down columns, so the per-query
 * maximum, sum and rescale are plain vector operations across queries, with no horizontal
 * reductions. One unit is (b, kv head, group of up to WA_FWD_HEADS query heads, query tile):
 * each K and V tile is converted once and used by every query head of its GQA group. */

#define WA_FWD_HEADS 8

static void forward_unit(void *arg, int64_t u, int worker) {
    const cpu_tile_args *a = arg;
    const wa_problem *p = a->p;
    const int64_t Bq = a->tile_q, Bk = a->tile_k, D = p->D, Dp = a->Dp, Bkp = a->Bkp, Bqp = a->Bqp;
    const int64_t chunks = (p->group + WA_FWD_HEADS - 1) / WA_FWD_HEADS;
    int64_t qt = a->n_qtiles - 1 - u % a->n_qtiles; /* longest (causal) tiles first */
    int64_t rest = u / a->n_qtiles, chunk = rest % chunks, bhk = rest / chunks, b = bhk / p->Hkv, hk = bhk % p->Hkv;
    int64_t h0 = hk * p->group + chunk * WA_FWD_HEADS, nh = wa_min64(WA_FWD_HEADS, p->group - chunk * WA_FWD_HEADS);
    int64_t i0 = qt * Bq, m = wa_min64(Bq, p->Nq - i0), rb, re;
    wa_nonempty_rows(&p->win, &rb, &re);

    /* dispatch.c: plan() sizes this layout */
    float *ws = a->scratch + (size_t)worker * a->scratch_floats;
    float *Ks = ws, *Vs = Ks + Bkp * Dp, *ST = Vs + Bkp * Dp, *row_buf = ST + Bkp * Bqp, *alpha = row_buf + wa_max64(Dp, Bqp);
    float *heads = alpha + Bqp;
    /* per head: Q^T; the f32 partial of the numerators and its rescale since the last f64 add
     * (f64); the numerators O (f64); running max; running sum (f64) */
    const int64_t per_head = D * Bqp + Bq * Dp + 2 * Bqp + 2 * Bq * Dp + Bqp + 2 * Bqp;
#define HEAD(g, QT, part, pscale, O, mx, sum)                                                                          \
    float *QT = heads + (g) * per_head, *part = QT + D * Bqp;                                                         \
    double *pscale = (double *)(part + Bq * Dp), *O = pscale + Bqp;                                                   \
    float *mx = (float *)(O + Bq * Dp);                                                                                \
    double *sum = (double *)(mx + Bqp)

#if defined(WA_BF16_DOT)
    const int dot = p->dtype == WA_BF16; /* bf16 pairs in the two GEMMs (see gemm_bf16_acc) */
#endif
    for (int64_t g = 0; g < nh; g++) {
        HEAD(g, QT, part, pscale, O, mx, sum);
        (void)part, (void)pscale;
#if defined(WA_BF16_DOT)
        if (dot) pack_rows_bf16_transposed((bfpair *)QT, Bqp, p->q, b, h0 + g, i0, m, D, (bfpair *)row_buf);
        else
#endif
            load_tile_transposed(QT, Bqp, p->q, b, h0 + g, i0, m, D, row_buf);
        memset(O, 0, (size_t)(m * Dp) * sizeof *O);
        for (int64_t c = 0; c < Bqp; c++) mx[c] = -INFINITY, sum[c] = 0.0;
    }
    int64_t kt0, kt1;
    wa_key_tiles_for_rows(&p->win, i0, i0 + m, Bk, &kt0, &kt1);
    for (int64_t kt = kt0; kt < kt1; kt++) {
        int64_t j0 = kt * Bk, n = wa_min64(Bk, p->Nk - j0);
        int edge = wa_tile_needs_mask(&p->win, i0, i0 + m, j0, j0 + n), v_bad;
        /* the partials span WA_TILES_PER_F64 key tiles: the first of them starts it from zero, the
         * last adds it to O in f64 */
        int first = (kt - kt0) % WA_TILES_PER_F64 == 0, last = (kt - kt0 + 1) % WA_TILES_PER_F64 == 0 || kt == kt1 - 1;
#if defined(WA_BF16_DOT)
        if (dot) {
            pack_rows_bf16((bfpair *)Ks, Dp / 2, p->k, b, hk, j0, n, D, n);
            pack_v_pairs((bfpair *)Vs, Dp, p->v, b, hk, j0, n, D);
            v_bad = edge && pairs_nonfinite((const bfpair *)Vs, (n + 1) / 2 * Dp);
        } else
#endif
        {
            load_tile(Ks, Dp, p->k, b, hk, j0, n, D, n);
            load_tile(Vs, Dp, p->v, b, hk, j0, n, D, n);
            v_bad = edge && tile_nonfinite(Vs, n, Dp, Dp);
        }
        for (int64_t g = 0; g < nh; g++) {
            HEAD(g, QT, part, pscale, O, mx, sum);
            memset(ST, 0, (size_t)(n * Bqp) * 4);
#if defined(WA_BF16_DOT)
            if (dot) gemm_bf16_acc(n, Bqp, (D + 1) / 2, (const bfpair *)Ks, Dp / 2, 1, (const bfpair *)QT, Bqp, ST, Bqp);
            else
#endif
                gemm_acc(n, Bqp, D, Ks, Dp, 1, QT, Bqp, ST, Bqp);
            scores_transposed(a, ST, Bqp, i0, m, j0, n, edge);
            online_softmax_step(ST, Bqp, n, mx, sum, alpha);
            /* the partial's rows rescaled to the new maxima (a fresh one needs nothing); pscale
             * collects the rescale O itself needs when the partial is added */
            for (int64_t r = 0; r < m; r++) {
                pscale[r] = first ? (double)alpha[r] : pscale[r] * alpha[r];
                if (!first && alpha[r] != 1.0f)
                    for (int64_t c = 0; c < Dp; c += VW) vstore(part + r * Dp + c, vload(part + r * Dp + c) * vsplat(alpha[r]));
            }
            /* part (+)= P V, P read through S^T's strides */
#if defined(WA_BF16_DOT)
            if (dot) {
                pack_p_pairs(ST, Bqp, n);
                if (!v_bad) {
                    if (first) gemm_bf16_set(m, Dp, (n + 1) / 2, (const bfpair *)ST, 1, Bqp, (const bfpair *)Vs, Dp, part, Dp);
                    else gemm_bf16_acc(m, Dp, (n + 1) / 2, (const bfpair *)ST, 1, Bqp, (const bfpair *)Vs, Dp, part, Dp);
                } else {
                    for (int64_t r = 0; r < m; r++) {
                        int64_t lo, hi;
                        row_visible_cols(&p->win, i0 + r, j0, n, 1, &lo, &hi);
                        pv_row_bf16(part + r * Dp, !first, (const bfpair *)ST, Bqp, r, (const bfpair *)Vs, Dp, lo, hi,
                                    (bfpair *)row_buf);
                    }
                }
            } else
#endif
                rows_partial(a, part, !first, ST, 1, Bqp, Vs, i0, m, j0, n, v_bad);
            if (last) flush_partial(O, part, pscale, m, Dp);
        }
    }
    for (int64_t g = 0; g < nh; g++) {
        HEAD(g, QT, part, pscale, O, mx, sum);
        (void)QT, (void)part, (void)pscale;
        for (int64_t r = 0; r < m; r++) {
            float *o = row_buf;
            float *lse = p->lse ? (float *)wa_row_ptr(p->lse, b, h0 + g, i0 + r) : NULL;
            if (i0 + r < rb || i0 + r >= re) { /* sees no key */
                memset(o, 0, (size_t)Dp * 4);
                if (lse) *lse = -INFINITY;
            } else { /* a row whose visible scores are all -inf (non-finite inputs) gets 0 / 0 = NaN */
                vd l = VWIDEN(vsplat(0.0f)) + sum[r];
                for (int64_t c = 0; c < Dp; c += VW) {
                    vd d;
                    vdload(&d, O + r * Dp + c);
                    vstore(o + c, VNARROW(d / l));
                }
                if (lse) *lse = (float)((double)mx[r] + log(sum[r]));
            }
            store_row(wa_row_ptr(p->o, b, h0 + g, i0 + r), p->dtype, o, D);
        }
    }
#undef HEAD
}

wa_status EXPORT(wa_cpu_forward)(wa_context *ctx, const wa_problem *p, cpu_tile_args *a) {
    (void)ctx;
    int64_t chunks = (p->group + WA_FWD_HEADS - 1) / WA_FWD_HEADS;
    wa_pool_run(a->pool, p->B * p->Hkv * chunks * a->n_qtiles, forward_unit, a);
    return WA_OK;
}

/* ---- backward ---- */

/* delta_i = sum_d dO[i,d] * O[i,d], accumulated exactly like the GEMM accumulates dP. */
static void delta_unit(void *arg, int64_t bh, int worker) {
    const cpu_tile_args *a = arg;
    const wa_problem *p = a->p;
    int64_t b = bh / p->Hq, h = bh % p->Hq, D = p->D;
    float *ws = a->scratch + (size_t)worker * a->scratch_floats;
    float *o = ws, *g = ws + a->Dp;
    float *delta = a->delta + bh * p->Nq;
    for (int64_t i = 0; i < p->Nq; i++) {
        load_row(o, wa_row_ptr(p->o, b, h, i), p->dtype, D);
        load_row(g, wa_row_ptr(p->do_, b, h, i), p->dtype, D);
        float acc = 0.0f;
        for (int64_t d = 0; d < D; d++) acc = sfma(g[d], o[d], acc);
        delta[i] = acc;
    }
}

/* The one place P and dS are formed from a score s, dP, and the row's lse, delta and renormaliser
 * rn (1 outside f32): P = exp(s - lse) * rn, dS = P (dP - delta) * softcap'(s) * scale, the
 * gradient with respect to the raw q.k. Both backward layouts call it, so they round alike. */
static inline vf score_grad(vf sv, vf dpv, vf lse, vf delta, vf rn, float cap, float scale, vf *p_out) {
    vf pv = vexp(sv - lse) * rn;
    vf ds = pv * (dpv - delta);
    if (cap > 0.0f) {
        vf t = sv * vsplat(1.0f / cap);
        ds = ds * (vsplat(1.0f) - t * t);
        /* masked entries: s = -inf makes t*t = inf and ds = 0 * -inf; P = 0 there */
        ds = vselect(pv == vsplat(0.0f), vsplat(0.0f), ds);
    }
    *p_out = pv;
    return ds * vsplat(scale);
}

/* For query rows [i0, i0+m) against key tile [j0, j0+n): S (in) becomes P, dP (in) becomes dS,
 * the gradient with respect to the raw dot product q.k (softcap derivative and scale included).
 * On edge tiles P and dS are set to exactly 0 outside each row's visible keys: exp(-inf - lse)
 * is 0 only while lse is finite, and a NaN there must not reach the keys the row cannot see. */
static void scores_to_grads(const cpu_tile_args *a, float *S, float *dP, int64_t i0, int64_t m, int64_t j0, int64_t n,
                            int edge, const float *lse, const float *delta, const float *rnorm) {
    const wa_problem *p = a->p;
    const int64_t ld = a->Bkp;
    const float scale = p->scale, cap = p->softcap;
    int64_t rb, re;
    wa_nonempty_rows(&p->win, &rb, &re);
    for (int64_t r = 0; r < m; r++) {
        float *s = S + r * ld, *dp = dP + r * ld;
        int64_t i = i0 + r, lo, hi;
        if (i < rb || i >= re) { /* sees no key: P = 0, and lse = -inf must not be touched */
            memset(s, 0, (size_t)ld * 4);
            memset(dp, 0, (size_t)ld * 4);
            continue;
        }
        vf lv = vsplat(lse[r]), dv = vsplat(delta[r]), rv = vsplat(rnorm ? rnorm[r] : 1.0f);
        for (int64_t c = 0; c < ld; c += VW) {
            vf pv, ds = score_grad(vload(s + c), vload(dp + c), lv, dv, rv, cap, scale, &pv);
            vstore(s + c, pv);
            vstore(dp + c, ds);
        }
        if (!edge) continue;
        row_visible_cols(&p->win, i, j0, n, 1, &lo, &hi);
        for (int64_t c = 0; c < ld; c++)
            if (c < lo || c > hi) s[c] = dp[c] = 0.0f;
    }
}

/* Recompute P and dS for one (query tile, key tile) pair into S and dP. Qs, dOs hold the query
 * tile; KT, VT the key tile transposed. */
static void tile_pair_grads(const cpu_tile_args *a, const float *Qs, const float *dOs, const float *KT, const float *VT,
                            float *S, float *dP, int64_t i0, int64_t m, int64_t j0, int64_t n, int edge,
                            const float *lse, const float *delta, const float *rnorm) {
    const wa_problem *p = a->p;
    const int64_t D = p->D, Dp = a->Dp, Bkp = a->Bkp;
    memset(S, 0, (size_t)(m * Bkp) * 4);
    memset(dP, 0, (size_t)(m * Bkp) * 4);
    gemm_acc(m, Bkp, D, Qs, Dp, 1, KT, Bkp, S, Bkp);
    finish_scores(a, S, Bkp, i0, m, j0, n, edge);
    gemm_acc(m, Bkp, D, dOs, Dp, 1, VT, Bkp, dP, Bkp);
    scores_to_grads(a, S, dP, i0, m, j0, n, edge, lse, delta, rnorm);
}

/* rows of an f64 accumulator rounded to f32 and stored (row_buf: Dp floats) */
static void store_rows_f64(const wa_tensor *t, int64_t b, int64_t h, int64_t row0, int64_t nrows, const double *acc,
                           int64_t Dp, int64_t D, wa_dtype dt, float *row_buf) {
    for (int64_t r = 0; r < nrows; r++) {
        narrow_f64(row_buf, acc + r * Dp, Dp);
        store_row(wa_row_ptr(t, b, h, row0 + r), dt, row_buf, D);
    }
}

static void load_lse_delta(const cpu_tile_args *a, int64_t b, int64_t h, int64_t i0, int64_t m, float *lse,
                           const float **delta, const float **rnorm) {
    const wa_problem *p = a->p;
    for (int64_t r = 0; r < m; r++) lse[r] = *(const float *)wa_row_ptr(p->lse, b, h, i0 + r);
    *delta = a->delta + (b * p->Hq + h) * p->Nq + i0;
    *rnorm = a->rnorm ? a->rnorm + (b * p->Hq + h) * p->Nq + i0 : NULL;
}

/* The backward's per-thread scratch; plan() in dispatch.c sizes it. After the shared part,
 * `rest` holds the key-tile units' f64 dK, dV, the f32 partials of dK, dV and dQ, K, and the f64
 * dQ slots, or the row statistics' f64 sums. */
static void backward_scratch(const cpu_tile_args *a, float *ws, float **KT, float **VT, float **Qs, float **dOs,
                             float **S, float **dP, float **lse, float **row_buf, float **rest) {
    const int64_t Bq = a->tile_q, D = a->p->D, Dp = a->Dp, Bkp = a->Bkp;
    *KT = ws, *VT = *KT + D * Bkp, *Qs = *VT + D * Bkp, *dOs = *Qs + Bq * Dp, *S = *dOs + Bq * Dp;
    *dP = *S + Bq * Bkp, *lse = *dP + Bq * Bkp, *row_buf = *lse + a->Bqp, *rest = *row_buf + Dp;
}

/* Does the key-tile unit own query tile qt's dQ? Yes when dQ fusion is on and every key tile qt
 * sees lies in one chunk: then that chunk's unit visits all of them in order and can finish dQ
 * in a rolling buffer. Other query tiles ("straddlers") get their dQ from dq_unit. Chunks are a
 * fixed number of key tiles, independent of the thread count, so the split (and every rounding)
 * is the same for any number of threads. */
static int dq_fused(const cpu_tile_args *a, int64_t qt, int64_t *k0, int64_t *k1) {
    const wa_problem *p = a->p;
    int64_t i0 = qt * a->tile_q;
    wa_key_tiles_for_rows(&p->win, i0, wa_min64(i0 + a->tile_q, p->Nq), a->tile_k, k0, k1);
    return a->dq_slots > 0 && *k0 < *k1 && *k0 / a->chunk_tiles == (*k1 - 1) / a->chunk_tiles;
}

/* Owner of dK, dV for the key tiles of one chunk of kv head hk, visited in order; with dQ
 * fusion also the owner of dQ for the query tiles whose keys all lie in the chunk: their dQ
 * accumulates in a ring of slots (slot qt % dq_slots), zeroed at the first key tile the query
 * tile sees and written out after the last. Five tile GEMMs per pair instead of seven. dK and dV
 * are f64 sums of f32 partials of WA_TILES_PER_F64 pairs each, the slots f64 sums of one pair's
 * (a partial per slot would cost more memory than the ring is allowed). */
static void dkdv_unit(const cpu_tile_args *a, int64_t u, float *ws) {
    const wa_problem *p = a->p;
    const int64_t Bq = a->tile_q, Bk = a->tile_k, D = p->D, Dp = a->Dp, Bkp = a->Bkp;
    int64_t chunk = u % a->n_chunks, bhk = u / a->n_chunks, b = bhk / p->Hkv, hk = bhk % p->Hkv;
    int64_t kt_begin = chunk * a->chunk_tiles, kt_end = wa_min64(kt_begin + a->chunk_tiles, a->n_ktiles);

    float *KT, *VT, *Qs, *dOs, *S, *dP, *lse, *row_buf, *rest;
    backward_scratch(a, ws, &KT, &VT, &Qs, &dOs, &S, &dP, &lse, &row_buf, &rest);
    double *dK = (double *)rest, *dV = dK + Bkp * Dp;
    float *partK = (float *)(dV + Bkp * Dp), *partV = partK + Bkp * Dp, *partQ = partV + Bkp * Dp, *Ks = partQ + Bq * Dp;
    double *slots = (double *)(Ks + Bkp * Dp);

    for (int64_t kt = kt_begin; kt < kt_end; kt++) {
        int64_t j0 = kt * Bk, n = wa_min64(Bk, p->Nk - j0);
        memset(dK, 0, (size_t)(n * Dp) * sizeof *dK);
        memset(dV, 0, (size_t)(n * Dp) * sizeof *dV);
        int64_t qt0, qt1;
        int k_bad = -1; /* K holds a NaN or infinity: worked out when an edge pair first asks */
        wa_query_tiles_for_cols(&p->win, j0, j0 + n, Bq, &qt0, &qt1);
        if (qt0 < qt1) {
            load_tile_transposed(KT, Bkp, p->k, b, hk, j0, n, D, row_buf);
            load_tile_transposed(VT, Bkp, p->v, b, hk, j0, n, D, row_buf);
            if (a->dq_slots) load_tile(Ks, Dp, p->k, b, hk, j0, n, D, n);
        }
        const int64_t pairs = p->group * (qt1 - qt0);
        for (int64_t g = 0; g < p->group; g++) {
            int64_t h = hk * p->group + g;
            for (int64_t qt = qt0; qt < qt1; qt++) {
                int64_t i0 = qt * Bq, m = wa_min64(Bq, p->Nq - i0), k0, k1, pair = g * (qt1 - qt0) + qt - qt0;
                int edge = wa_tile_needs_mask(&p->win, i0, i0 + m, j0, j0 + n);
                int add = pair % WA_TILES_PER_F64 != 0, last = (pair + 1) % WA_TILES_PER_F64 == 0 || pair == pairs - 1;
                const float *delta, *rnorm;
                load_tile(Qs, Dp, p->q, b, h, i0, m, D, m);
                load_tile(dOs, Dp, p->do_, b, h, i0, m, D, m);
                load_lse_delta(a, b, h, i0, m, lse, &delta, &rnorm);
                tile_pair_grads(a, Qs, dOs, KT, VT, S, dP, i0, m, j0, n, edge, lse, delta, rnorm);
                keys_partial(a, partV, add, S, Bkp, 1, dOs, i0, m, j0, n, edge && tile_nonfinite(dOs, m, Dp, Dp)); /* P^T dO */
                keys_partial(a, partK, add, dP, Bkp, 1, Qs, i0, m, j0, n, edge && tile_nonfinite(Qs, m, Dp, Dp)); /* dS^T Q */
                if (last) acc_f64(dV, partV, n * Dp), acc_f64(dK, partK, n * Dp);
                if (!dq_fused(a, qt, &k0, &k1)) continue;
                double *dQ = slots + ((qt % a->dq_slots) * p->group + g) * Bq * Dp;
                if (kt == k0) memset(dQ, 0, (size_t)(m * Dp) * sizeof *dQ); /* first key tile this query tile sees */
                if (edge && k_bad < 0) k_bad = tile_nonfinite(Ks, n, Dp, Dp);
                rows_partial(a, partQ, 0, dP, Bkp, 1, Ks, i0, m, j0, n, edge && k_bad); /* dS K */
                acc_f64(dQ, partQ, m * Dp);
                if (kt == k1 - 1) store_rows_f64(p->dq, b, h, i0, m, dQ, Dp, D, p->dtype, row_buf); /* its last */
            }
        }
        store_rows_f64(p->dk, b, hk, j0, n, dK, Dp, D, p->dtype, row_buf);
        store_rows_f64(p->dv, b, hk, j0, n, dV, Dp, D, p->dtype, row_buf);
    }
}

/* Owner of dQ for rows [i0, i0+m) of query head h. Works on transposed tiles like the forward:
 * S^T = K Q^T and dP^T = V dO^T, so K and V are used as stored and only Q^T, dO^T are built,
 * once per unit; P and dS are formed down columns with per-query statistics as vectors. */
static void dq_unit(const cpu_tile_args *a, int64_t u, float *ws) {
    const wa_problem *p = a->p;
    const int64_t Bq = a->tile_q, Bk = a->tile_k, D = p->D, Dp = a->Dp, Bkp = a->Bkp, Bqp = a->Bqp;
    int64_t qt = a->n_qtiles - 1 - u % a->n_qtiles, bh = u / a->n_qtiles, b = bh / p->Hq, h = bh % p->Hq;
    int64_t hk = h / p->group, i0 = qt * Bq, m = wa_min64(Bq, p->Nq - i0);
    const float scale = p->scale, cap = p->softcap;
    int64_t fk0, fk1;
    if (dq_fused(a, qt, &fk0, &fk1)) return; /* its key-tile unit writes this dQ */

    float *QT = ws, *dOT = QT + D * Bqp, *Ks = dOT + D * Bqp, *Vs = Ks + Bkp * Dp, *ST = Vs + Bkp * Dp;
    float *dPT = ST + Bkp * Bqp, *part = dPT + Bkp * Bqp, *lse = part + Bq * Dp, *delta = lse + Bqp, *rnorm = delta + Bqp;
    float *row_buf = rnorm + Bqp;
    double *dQ = (double *)(row_buf + wa_max64(Dp, Bqp));
    memset(dQ, 0, (size_t)(m * Dp) * sizeof *dQ);

    int64_t kt0, kt1, rb, re;
    wa_key_tiles_for_rows(&p->win, i0, i0 + m, Bk, &kt0, &kt1);
    if (kt0 < kt1) {
        wa_nonempty_rows(&p->win, &rb, &re);
        const float *dl = a->delta + (b * p->Hq + h) * p->Nq + i0;
        const float *rn = a->rnorm ? a->rnorm + (b * p->Hq + h) * p->Nq + i0 : NULL;
        /* columns past the tile or seeing no key get lse = +inf, so P = exp(s - inf) = 0 there */
        for (int64_t c = 0; c < Bqp; c++) {
            int live = c < m && i0 + c >= rb && i0 + c < re;
            lse[c] = live ? *(const float *)wa_row_ptr(p->lse, b, h, i0 + c) : INFINITY;
            delta[c] = live ? dl[c] : 0.0f;
            rnorm[c] = live ? (rn ? rn[c] : 1.0f) : 0.0f;
        }
        load_tile_transposed(QT, Bqp, p->q, b, h, i0, m, D, row_buf);
        load_tile_transposed(dOT, Bqp, p->do_, b, h, i0, m, D, row_buf);
        for (int64_t kt = kt0; kt < kt1; kt++) {
            int64_t j0 = kt * Bk, n = wa_min64(Bk, p->Nk - j0);
            int edge = wa_tile_needs_mask(&p->win, i0, i0 + m, j0, j0 + n);
            load_tile(Ks, Dp, p->k, b, hk, j0, n, D, n);
            load_tile(Vs, Dp, p->v, b, hk, j0, n, D, n);
            memset(ST, 0, (size_t)(n * Bqp) * 4);
            memset(dPT, 0, (size_t)(n * Bqp) * 4);
            gemm_acc(n, Bqp, D, Ks, Dp, 1, QT, Bqp, ST, Bqp);
            scores_transposed(a, ST, Bqp, i0, m, j0, n, edge);
            gemm_acc(n, Bqp, D, Vs, Dp, 1, dOT, Bqp, dPT, Bqp);
            for (int64_t j = 0; j < n; j++)
                for (int64_t c = 0; c < Bqp; c += VW) {
                    vf pv, ds = score_grad(vload(ST + j * Bqp + c), vload(dPT + j * Bqp + c), vload(lse + c),
                                           vload(delta + c), vload(rnorm + c), cap, scale, &pv);
                    vstore(dPT + j * Bqp + c, ds);
                }
            if (edge) /* dS exactly 0 outside each column's visible keys (see scores_to_grads) */
                for (int64_t c = 0; c < m; c++) {
                    int64_t lo, hi;
                    row_visible_cols(&p->win, i0 + c, j0, n, 1, &lo, &hi);
                    for (int64_t j = 0; j < n; j++)
                        if (j < lo || j > hi) dPT[j * Bqp + c] = 0.0f;
                }
            int add = (kt - kt0) % WA_TILES_PER_F64 != 0, last = (kt - kt0 + 1) % WA_TILES_PER_F64 == 0 || kt == kt1 - 1;
            rows_partial(a, part, add, dPT, 1, Bqp, Ks, i0, m, j0, n, edge && tile_nonfinite(Ks, n, Dp, Dp)); /* dS K */
            if (last) acc_f64(dQ, part, m * Dp);
        }
    }
    store_rows_f64(p->dq, b, h, i0, m, dQ, Dp, D, p->dtype, row_buf);
}

/* f32 only: the row statistics recomputed from the scores instead of taken from O and lse.
 *   r_i     = 1 / sum_j exp(s_ij - lse_i)                     (exactly 1 in exact arithmetic)
 *   delta_i = r_i * sum_j exp(s_ij - lse_i) * dP_ij           (= dO_i . O_i in exact arithmetic)
 * Why: dS = P (dP - delta) cancels. With delta = dO . O (the bf16/f16 path, FlashAttention's) the
 * rounding of dP_ij and of delta are independent, so a row whose probability sits on one or two
 * keys keeps an error of ~ulp(|dP|) that a dense f32 softmax VJP (which subtracts sum_l P dP
 * built from the same dP values) mostly cancels: the parity sweep measured up to 4.4x the dense
 * f32 error. Taking delta from the same dP values the tile passes recompute (bit for bit: same
 * micro-kernel, same inputs) restores the cancellation, and r_i removes the f32 rounding of lse.
 * Both sums run over key tiles in f64. Cost: two more tile GEMMs (S and dP) over the visible
 * pairs, in f32 only; in bf16/f16 the inputs' own rounding dwarfs both effects.
 * docs/algorithm.md has the measurements. */
static void rowstats_unit(void *arg, int64_t u, int worker) {
    const cpu_tile_args *a = arg;
    const wa_problem *p = a->p;
    const int64_t Bq = a->tile_q, Bk = a->tile_k, D = p->D, Dp = a->Dp, Bkp = a->Bkp;
    int64_t qt = u % a->n_qtiles, bh = u / a->n_qtiles, b = bh / p->Hq, h = bh % p->Hq, hk = h / p->group;
    int64_t i0 = qt * Bq, m = wa_min64(Bq, p->Nq - i0);
    float *KT, *VT, *Qs, *dOs, *S, *dP, *lse, *row_buf, *rest;
    backward_scratch(a, a->scratch + (size_t)worker * a->scratch_floats, &KT, &VT, &Qs, &dOs, &S, &dP, &lse, &row_buf, &rest);
    double *sums = (double *)rest, *dots = sums + a->Bqp;
    for (int64_t r = 0; r < m; r++) sums[r] = dots[r] = 0.0, lse[r] = *(const float *)wa_row_ptr(p->lse, b, h, i0 + r);
    int64_t kt0, kt1;
    wa_key_tiles_for_rows(&p->win, i0, i0 + m, Bk, &kt0, &kt1);
    if (kt0 < kt1) {
        load_tile(Qs, Dp, p->q, b, h, i0, m, D, m);
        load_tile(dOs, Dp, p->do_, b, h, i0, m, D, m);
    }
    for (int64_t kt = kt0; kt < kt1; kt++) {
        int64_t j0 = kt * Bk, n = wa_min64(Bk, p->Nk - j0);
        int edge = wa_tile_needs_mask(&p->win, i0, i0 + m, j0, j0 + n);
        load_tile_transposed(KT, Bkp, p->k, b, hk, j0, n, D, row_buf);
        load_tile_transposed(VT, Bkp, p->v, b, hk, j0, n, D, row_buf);
        memset(S, 0, (size_t)(m * Bkp) * 4);
        memset(dP, 0, (size_t)(m * Bkp) * 4);
        gemm_acc(m, Bkp, D, Qs, Dp, 1, KT, Bkp, S, Bkp);
        finish_scores(a, S, Bkp, i0, m, j0, n, edge);
        gemm_acc(m, Bkp, D, dOs, Dp, 1, VT, Bkp, dP, Bkp);
        for (int64_t r = 0; r < m; r++) {
            int64_t lo, hi;
            row_visible_cols(&p->win, i0 + r, j0, n, 1, &lo, &hi);
            for (int64_t c = 0; edge && c < Bkp; c++) /* exp(-inf - lse) = 0 masks P, but 0 * NaN would not mask dP */
                if (c < lo || c > hi) dP[r * Bkp + c] = 0.0f;
            vf acc = vsplat(0.0f), dot = vsplat(0.0f), lv = vsplat(lse[r]);
            for (int64_t c = 0; c < Bkp; c += VW) {
                vf e = vexp(vload(S + r * Bkp + c) - lv);
                acc += e;
                dot += e * vload(dP + r * Bkp + c);
            }
            sums[r] += vhsum(acc);
            dots[r] += vhsum(dot);
        }
    }
    float *rn = a->rnorm + bh * p->Nq + i0, *delta = a->delta + bh * p->Nq + i0;
    for (int64_t r = 0; r < m; r++) { /* rows that see no key: sums = 0, and r = delta = 0 */
        rn[r] = sums[r] != 0.0 ? (float)(1.0 / sums[r]) : 0.0f;
        delta[r] = sums[r] != 0.0 ? (float)(dots[r] / sums[r]) : 0.0f;
    }
}

static void backward_unit(void *arg, int64_t u, int worker) {
    const cpu_tile_args *a = arg;
    float *ws = a->scratch + (size_t)worker * a->scratch_floats;
    if (u < a->n_dkdv_units) dkdv_unit(a, u, ws);
    else dq_unit(a, u - a->n_dkdv_units, ws);
}

wa_status EXPORT(wa_cpu_backward)(wa_context *ctx, const wa_problem *p, cpu_tile_args *a) {
    (void)ctx;
    if (a->rnorm) wa_pool_run(a->pool, p->B * p->Hq * a->n_qtiles, rowstats_unit, a);
    else wa_pool_run(a->pool, p->B * p->Hq, delta_unit, a);
    wa_pool_run(a->pool, a->n_dkdv_units + p->B * p->Hq * a->n_qtiles, backward_unit, a);
    return WA_OK;
}

/* The micro-kernel for the dense baseline (dense.c), through dispatch.c's wa_cpu_gemm(). */
void EXPORT(wa_cpu_gemm)(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B,
                         int64_t ldb, float *C, int64_t ldc) {
    gemm_acc(m, n, k, A, ars, acs, B, ldb, C, ldc);
}

#if defined(WA_BF16_DOT)
/* The bf16-pair micro-kernel, for bench/tile_gemm.c's comparison with OpenBLAS sbgemm. */
void wa_cpu_gemm_bf16pairs(int64_t m, int64_t n, int64_t kp, const uint32_t *A, int64_t ars, int64_t acs,
                           const uint32_t *B, int64_t ldb, float *C, int64_t ldc) {
    gemm_bf16_acc(m, n, kp, A, ars, acs, B, ldb, C, ldc);
}
#endif

/* cpu.h — what dispatch.c hands the per-ISA kernels in attn_cpu.c: the problem, tile sizes
 * rounded for the vector width, the thread pool, and the workspace it carved out. */
#ifndef WA_CPU_H
#define WA_CPU_H

#include "../internal.h"

/* Every padded size is a multiple of this many floats (the widest vector, AVX-512), so one
 * workspace layout serves every ISA and every buffer starts 64-byte aligned. */
#define WA_CPU_PAD 16

typedef struct cpu_tile_args {
    const wa_problem *p;
    wa_pool *pool;
    int64_t tile_q, tile_k;  /* Bq, Bk */
    int64_t Dp, Bkp, Bqp;    /* D, Bk, Bq rounded up to WA_CPU_PAD */
    int64_t n_qtiles, n_ktiles;
    int64_t n_dkdv_units;    /* backward: B * Hkv * n_chunks key-tile units, then B * Hq * n_qtiles dQ units */
    int64_t chunk_tiles;     /* key tiles per backward unit (fixed: results must not depend on threads) */
    int64_t n_chunks;        /* ceil(n_ktiles / chunk_tiles) */
    int64_t dq_slots;        /* rolling dQ slots per GQA head; 0 = dQ fusion off (attn_cpu.c: dq_fused) */
    float *scratch;          /* threads * scratch_floats */
    size_t scratch_floats;
    float *delta;            /* backward: [B, Hq, Nq] rowsum(dO * O) */
    float *rnorm;            /* backward, f32 only: [B, Hq, Nq] row renormalisation (attn_cpu.c) */
} cpu_tile_args;

#define WA_DECLARE_ISA(isa)                                                                   \
    wa_status wa_cpu_forward_##isa(wa_context *ctx, const wa_problem *p, cpu_tile_args *a);  \
    wa_status wa_cpu_backward_##isa(wa_context *ctx, const wa_problem *p, cpu_tile_args *a);  \
    void wa_cpu_gemm_##isa(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, \
                           const float *B, int64_t ldb, float *C, int64_t ldc);
WA_DECLARE_ISA(avx512bf16)
WA_DECLARE_ISA(avx512)
WA_DECLARE_ISA(avx2)
WA_DECLARE_ISA(neon)
WA_DECLARE_ISA(generic)

/* The AVX512-BF16 build's micro-kernel on bf16 pairs (x86 builds only; the caller checks the CPU):
 * C[m x n] += A . B over kp pairs, A(r, t) = A[r*ars + t*acs], B rows of n pairs. */
void wa_cpu_gemm_bf16pairs(int64_t m, int64_t n, int64_t kp, const uint32_t *A, int64_t ars, int64_t acs,
                           const uint32_t *B, int64_t ldb, float *C, int64_t ldc);

/* C[m x n] += A . B with the selected ISA's micro-kernel; n a multiple of WA_CPU_PAD,
 * A(r, t) = A[r*ars + t*acs], B and C row-major. */
void wa_cpu_gemm(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B, int64_t ldb,
                 float *C, int64_t ldc);

#endif /* WA_CPU_H */

/* dispatch.c — sizes the CPU workspace, picks the kernels this CPU can run (x86-64: AVX-512 with
 * AVX512-BF16 dot products, AVX-512, AVX2+FMA; aarch64: NEON; anywhere: the portable build of the
 * same source) and hands them a cpu_tile_args.
 *
 * WINATTN_ISA=avx512bf16|avx512|avx2|neon|generic in the environment forces a choice (tests use it
 * to run every path the machine supports); asking for one the CPU lacks falls back to the best available.
 */
#define _GNU_SOURCE
#include "cpu.h"

#include <stdlib.h>
#include <string.h>

typedef struct cpu_isa {
    const char *name;
    wa_status (*forward)(wa_context *, const wa_problem *, cpu_tile_args *);
    wa_status (*backward)(wa_context *, const wa_problem *, cpu_tile_args *);
    void (*gemm)(int64_t, int64_t, int64_t, const float *, int64_t, int64_t, const float *, int64_t, float *, int64_t);
    int (*supported)(void);
} cpu_isa;

static int have_generic(void) { return 1; }

#if defined(WA_HAVE_X86_KERNELS) && defined(__x86_64__)
static int have_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
}
static int have_avx512bf16(void) { return have_avx512() && __builtin_cpu_supports("avx512bf16"); }
static int have_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
static const cpu_isa isas[] = {
    {"avx512bf16", wa_cpu_forward_avx512bf16, wa_cpu_backward_avx512bf16, wa_cpu_gemm_avx512bf16, have_avx512bf16},
    {"avx512", wa_cpu_forward_avx512, wa_cpu_backward_avx512, wa_cpu_gemm_avx512, have_avx512},
    {"avx2", wa_cpu_forward_avx2, wa_cpu_backward_avx2, wa_cpu_gemm_avx2, have_avx2},
    {"generic", wa_cpu_forward_generic, wa_cpu_backward_generic, wa_cpu_gemm_generic, have_generic},
};
#elif defined(WA_HAVE_NEON_KERNELS) && defined(__aarch64__)
/* Advanced SIMD is part of the aarch64 base architecture: every such CPU runs the NEON build. */
static int have_neon(void) { return 1; }
static const cpu_isa isas[] = {
    {"neon", wa_cpu_forward_neon, wa_cpu_backward_neon, wa_cpu_gemm_neon, have_neon},
    {"generic", wa_cpu_forward_generic, wa_cpu_backward_generic, wa_cpu_gemm_generic, have_generic},
};
#else
static const cpu_isa isas[] = {
    {"generic", wa_cpu_forward_generic, wa_cpu_backward_generic, wa_cpu_gemm_generic, have_generic},
};
#endif

static const cpu_isa *pick_isa(void) {
    const char *want = getenv("WINATTN_ISA");
    size_t n = sizeof isas / sizeof isas[0];
    if (want)
        for (size_t i = 0; i < n; i++)
            if (strcmp(isas[i].name, want) == 0 && isas[i].supported()) return &isas[i];
    for (size_t i = 0; i < n; i++)
        if (isas[i].supported()) return &isas[i];
    return &isas[n - 1];
}

const char *wa_cpu_isa(void) { return pick_isa()->name; }

/* Every name WINATTN_ISA may hold on any build: one this build or CPU lacks falls back, a name
 * outside this list is a mistake the caller should hear about (wa_context_create refuses it). */
const char *wa_cpu_isa_env_error(void) {
    static const char *known[] = {"avx512bf16", "avx512", "avx2", "neon", "generic"};
    const char *want = getenv("WINATTN_ISA");
    if (!want) return NULL;
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (strcmp(known[i], want) == 0) return NULL;
    return want;
}

void wa_cpu_gemm(int64_t m, int64_t n, int64_t k, const float *A, int64_t ars, int64_t acs, const float *B, int64_t ldb,
                 float *C, int64_t ldc) {
    pick_isa()->gemm(m, n, k, A, ars, acs, B, ldb, C, ldc);
}

static int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

#define WA_CHUNK_TILES_MIN 32                /* key tiles per backward unit: bounds */
#define WA_CHUNK_TILES_MAX 256
#define WA_DQ_RING_BYTES ((size_t)16 << 20)  /* per-thread budget for rolling dQ slots (f64: 8 MB of f32) */

static void plan(const wa_context *ctx, const wa_problem *p, cpu_tile_args *a) {
    memset(a, 0, sizeof *a);
    a->p = p;
    a->pool = ctx->pool;
    a->tile_q = ctx->tile_q;
    a->tile_k = ctx->tile_k;
    a->Dp = round_up(p->D, WA_CPU_PAD);
    a->Bkp = round_up(a->tile_k, WA_CPU_PAD);
    a->Bqp = round_up(a->tile_q, WA_CPU_PAD);
    a->n_qtiles = (p->Nq + a->tile_q - 1) / a->tile_q;
    a->n_ktiles = (p->Nk + a->tile_k - 1) / a->tile_k;
    /* backward key-tile units cover chunk_tiles key tiles each, so a query tile whose keys fit
     * in one chunk gets its dQ from that unit (5 tile GEMMs instead of 7) */
    /* A query tile straddles a chunk boundary with probability about span / chunk, so chunks are
     * made several times the longest span (the shape decides, never the thread count). */
    int64_t span = 1;
    for (int64_t qt = 0; qt < a->n_qtiles; qt++) {
        int64_t k0, k1;
        wa_key_tiles_for_rows(&p->win, qt * a->tile_q, wa_min64((qt + 1) * a->tile_q, p->Nq), a->tile_k, &k0, &k1);
        span = wa_max64(span, k1 - k0);
    }
    a->chunk_tiles = wa_min64(WA_CHUNK_TILES_MAX, wa_max64(WA_CHUNK_TILES_MIN, 8 * span));
    a->n_chunks = (a->n_ktiles + a->chunk_tiles - 1) / a->chunk_tiles;
    a->n_dkdv_units = p->B * p->Hkv * a->n_chunks;
    /* ring size: the most query tiles that see one key tile (an owned tile is open exactly
     * while its key tiles are visited, and the open ones are consecutive) */
    int64_t most = 0;
    for (int64_t kt = 0; kt < a->n_ktiles; kt++) {
        int64_t q0, q1;
        wa_query_tiles_for_cols(&p->win, kt * a->tile_k, wa_min64((kt + 1) * a->tile_k, p->Nk), a->tile_q, &q0, &q1);
        most = wa_max64(most, q1 - q0);
    }
    /* fusion only where the ring stays small: windowed layers; unbounded causal rows span the
     * whole sequence, and their dQ comes from the dQ units as before. The slots are f64. */
    size_t ring = (size_t)(most * p->group * a->tile_q * round_up(p->D, WA_CPU_PAD)) * sizeof(double);
    a->dq_slots = most > 0 && ring <= WA_DQ_RING_BYTES ? most : 0;
    /* per-thread scratch, the largest of the layouts in attn_cpu.c (in floats; an f64 array
     * counts two): forward_unit, dkdv_unit / rowstats_unit (backward_scratch), dq_unit */
    int64_t Bq = a->tile_q, D = p->D, Dp = a->Dp, Bkp = a->Bkp, Bqp = a->Bqp;
    int64_t heads = wa_min64(p->group, 8); /* WA_FWD_HEADS in attn_cpu.c */
    int64_t fwd = 2 * Bkp * Dp + Bkp * Bqp + wa_max64(Dp, Bqp) + Bqp + heads * (D * Bqp + 3 * Bq * Dp + 5 * Bqp);
    int64_t bwd_shared = 2 * D * Bkp + 2 * Bq * Dp + 2 * Bq * Bkp + Bqp + Dp;
    int64_t dkdv = 4 * Bkp * Dp + 2 * Bkp * Dp + Bq * Dp + Bkp * Dp + 2 * a->dq_slots * p->group * Bq * Dp;
    int64_t bwd = bwd_shared + wa_max64(dkdv, 4 * Bqp);
    int64_t dq = 2 * D * Bqp + 2 * Bkp * Dp + 2 * Bkp * Bqp + Bq * Dp + 3 * Bqp + wa_max64(Dp, Bqp) + 2 * Bq * Dp;
    bwd = wa_max64(bwd, dq);
    a->scratch_floats = (size_t)round_up(wa_max64(fwd, bwd), WA_CPU_PAD);
}

static size_t delta_bytes(const wa_problem *p) { return (size_t)(p->B * p->Hq * p->Nq) * sizeof(float); }

size_t wa_cpu_workspace_bytes(const wa_context *ctx, const wa_problem *p, int backward) {
    cpu_tile_args a;
    plan(ctx, p, &a);
    size_t bytes = (size_t)ctx->threads * a.scratch_floats * sizeof(float);
    if (backward) bytes += (delta_bytes(p) + 63) & ~(size_t)63;
    if (backward && p->dtype == WA_F32) bytes += (delta_bytes(p) + 63) & ~(size_t)63; /* rnorm */
    return bytes;
}

static wa_status run(wa_context *ctx, const wa_problem *p, int backward) {
    if (p->B == 0 || p->Hq == 0 || (p->Nq == 0 && p->Nk == 0)) return WA_OK;
    cpu_tile_args a;
    plan(ctx, p, &a);
    size_t scratch_bytes = (size_t)ctx->threads * a.scratch_floats * sizeof(float);
    size_t total = wa_cpu_workspace_bytes(ctx, p, backward);
    char *ws = wa_alloc(ctx, total);
    if (!ws) return wa_fail(WA_ERR_NO_MEMORY, "cannot allocate %zu bytes of CPU workspace", total);
    a.scratch = (float *)ws;
    a.delta = backward ? (float *)(ws + scratch_bytes) : NULL;
    if (backward && p->dtype == WA_F32) a.rnorm = (float *)(ws + scratch_bytes + ((delta_bytes(p) + 63) & ~(size_t)63));
    const cpu_isa *isa = pick_isa();
    wa_status st = backward ? isa->backward(ctx, p, &a) : isa->forward(ctx, p, &a);
    wa_free(ctx, ws);
    return st;
}

wa_status wa_cpu_forward(wa_context *ctx, const wa_problem *p) { return run(ctx, p, 0); }
wa_status wa_cpu_backward(wa_context *ctx, const wa_problem *p) { return run(ctx, p, 1); }

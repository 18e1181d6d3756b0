/* tile_gemm.c — winattn's tile micro-kernels against OpenBLAS on the tile shapes the kernels
 * multiply (the CPU-speed issue asks which is faster; docs/cpu.md keeps the result).
 *
 * One thread each (the kernels run one tile per thread). Shapes, for D = 256 and 64×64 tiles:
 *   S  = K·Qᵀ : [64 × 64] += [64 × 256]·[256 × 64]
 *   PV = P·V  : [64 × 256] += [64 × 64]·[64 × 256]
 * f32: wa_cpu_gemm (the FMA micro-kernel of the best ISA) vs cblas_sgemm. bf16: the AVX512-BF16
 * pair kernel is timed too, but Debian's OpenBLAS (0.3.21, built without BUILD_BFLOAT16) exports
 * no cblas_sbgemm to set against it. Built by `make tile-gemm` when OpenBLAS links; prints
 * GFLOP/s, the median of 7 runs. */
#define _GNU_SOURCE
#include "cpu/cpu.h"

#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef void (*run_fn)(void *ctx);

/* median GFLOP/s of 7 timings, each enough repetitions for ~20 ms */
static double rate(run_fn fn, void *ctx, double flops) {
    int reps = 1;
    for (double t = 0; t < 0.02; reps *= 2) {
        double t0 = now();
        for (int i = 0; i < reps; i++) fn(ctx);
        t = now() - t0;
    }
    double g[7];
    for (int k = 0; k < 7; k++) {
        double t0 = now();
        for (int i = 0; i < reps; i++) fn(ctx);
        g[k] = flops * reps / (now() - t0) / 1e9;
    }
    qsort(g, 7, sizeof *g, cmp);
    return g[3];
}

typedef struct gemm_case {
    int m, n, k;
    float *A, *B, *C;
    uint16_t *Ab, *Bb;       /* bf16 row-major */
    uint32_t *Ap, *Bp;       /* bf16 pairs along k, for the pair kernel */
} gemm_case;

static void run_wa_f32(void *p) {
    gemm_case *c = p;
    wa_cpu_gemm(c->m, c->n, c->k, c->A, c->k, 1, c->B, c->n, c->C, c->n);
}
static void run_blas_f32(void *p) {
    gemm_case *c = p;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, c->m, c->n, c->k, 1.0f, c->A, c->k, c->B, c->n, 1.0f, c->C,
                c->n);
}
static void run_wa_bf16(void *p) {
    gemm_case *c = p;
    wa_cpu_gemm_bf16pairs(c->m, c->n, c->k / 2, c->Ap, c->k / 2, 1, c->Bp, c->n, c->C, c->n);
}

static uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

int main(void) {
    openblas_set_num_threads(1);
    const struct { const char *name; int m, n, k; } shapes[] = {{"S = K Q^T  64x64x256", 64, 64, 256},
                                                                {"PV        64x256x64", 64, 256, 64}};
    printf("CPU kernels: %s; BLAS: %s\n", wa_cpu_kernels(), openblas_get_config());
    printf("| tile GEMM (m x n x k) | winattn f32 | OpenBLAS sgemm | winattn bf16 pairs |\n|---|---|---|---|\n");
    for (int s = 0; s < 2; s++) {
        gemm_case c = {.m = shapes[s].m, .n = shapes[s].n, .k = shapes[s].k};
        c.A = malloc(sizeof(float) * c.m * c.k), c.B = malloc(sizeof(float) * c.k * c.n), c.C = calloc(c.m * c.n, 4);
        c.Ab = malloc(2 * c.m * c.k), c.Bb = malloc(2 * c.k * c.n);
        c.Ap = malloc(4 * c.m * c.k / 2), c.Bp = malloc(4 * c.k / 2 * c.n);
        srand(1);
        for (int i = 0; i < c.m * c.k; i++) c.A[i] = (float)rand() / RAND_MAX - 0.5f, c.Ab[i] = to_bf16(c.A[i]);
        for (int i = 0; i < c.k * c.n; i++) c.B[i] = (float)rand() / RAND_MAX - 0.5f, c.Bb[i] = to_bf16(c.B[i]);
        for (int r = 0; r < c.m; r++) /* pairs along k: row r's (2t, 2t+1) */
            for (int t = 0; t < c.k / 2; t++) c.Ap[r * c.k / 2 + t] = c.Ab[r * c.k + 2 * t] | (uint32_t)c.Ab[r * c.k + 2 * t + 1] << 16;
        for (int t = 0; t < c.k / 2; t++)
            for (int j = 0; j < c.n; j++) c.Bp[t * c.n + j] = c.Bb[2 * t * c.n + j] | (uint32_t)c.Bb[(2 * t + 1) * c.n + j] << 16;
        double flops = 2.0 * c.m * c.n * c.k;
        int bf16 = strcmp(wa_cpu_kernels(), "avx512bf16") == 0;
        printf("| %s | %.1f | %.1f | %s%.1f |\n", shapes[s].name, rate(run_wa_f32, &c, flops),
               rate(run_blas_f32, &c, flops), bf16 ? "" : "n/a ", bf16 ? rate(run_wa_bf16, &c, flops) : 0.0);
    }
    printf("(GFLOP/s, one thread, median of 7)\n");
    return 0;
}

/* linalg.h — the matrix products the trainer needs, row-major, in float and double.
 *
 * C = alpha · op(A) · op(B) + beta · C with op = transpose when the flag is set; A is M×K after
 * op, B is K×N after op, leading dimensions as in BLAS. With OpenBLAS (WA_HAVE_CBLAS, set by the
 * Makefile when <cblas.h> is found) these are cblas_sgemm / cblas_dgemm; without it a plain loop
 * nest keeps the trainer correct (and slow) on any machine, e.g. the GPU box without BLAS. */
#ifndef WA_TRAIN_LINALG_H
#define WA_TRAIN_LINALG_H

void mm_f32(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
            int ldb, float beta, float *C, int ldc);
void mm_f64(int trans_a, int trans_b, int M, int N, int K, double alpha, const double *A, int lda, const double *B,
            int ldb, double beta, double *C, int ldc);

/* Threads the BLAS may use (no-op without OpenBLAS). */
void linalg_set_threads(int threads);
/* "OpenBLAS 0.3.21 ..." or "built-in loops". */
const char *linalg_backend(void);

#endif

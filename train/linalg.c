/* linalg.c — see linalg.h. */
#include "linalg.h"

#ifdef WA_HAVE_CBLAS
#include <cblas.h>

void mm_f32(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
            int ldb, float beta, float *C, int ldc) {
    if (M == 0 || N == 0) return;
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
                alpha, A, lda, B, ldb, beta, C, ldc);
}

void mm_f64(int trans_a, int trans_b, int M, int N, int K, double alpha, const double *A, int lda, const double *B,
            int ldb, double beta, double *C, int ldc) {
    if (M == 0 || N == 0) return;
    cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
                alpha, A, lda, B, ldb, beta, C, ldc);
}

void linalg_set_threads(int threads) { openblas_set_num_threads(threads); }
const char *linalg_backend(void) { return openblas_get_config(); }

#else

/* i-k-j order so the inner loop runs along contiguous rows of B and C when B is not transposed */
#define DEFINE_MM(NAME, T)                                                                                    \
    void NAME(int trans_a, int trans_b, int M, int N, int K, T alpha, const T *A, int lda, const T *B, int ldb, \
              T beta, T *C, int ldc) {                                                                        \
        for (int i = 0; i < M; i++) {                                                                         \
            T *c = C + (long)i * ldc;                                                                         \
            for (int j = 0; j < N; j++) c[j] = beta == 0 ? 0 : beta * c[j];                                   \
            for (int k = 0; k < K; k++) {                                                                     \
                T a = alpha * (trans_a ? A[(long)k * lda + i] : A[(long)i * lda + k]);                        \
                if (trans_b)                                                                                  \
                    for (int j = 0; j < N; j++) c[j] += a * B[(long)j * ldb + k];                             \
                else                                                                                          \
                    for (int j = 0; j < N; j++) c[j] += a * B[(long)k * ldb + j];                             \
            }                                                                                                 \
        }                                                                                                     \
    }
DEFINE_MM(mm_f32, float)
DEFINE_MM(mm_f64, double)

void linalg_set_threads(int threads) { (void)threads; }
const char *linalg_backend(void) { return "built-in loops (no OpenBLAS at build time)"; }

#endif

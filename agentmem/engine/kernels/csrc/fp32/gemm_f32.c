/* Few fp32 rows times fp32 weights as they are: agentmem_avx2_gemm_f32. */
#include "common.h"

/* fp32 weights as they are ([N, K], rows K apart) times a few fp32 rows: y[M, N] = x w^T (+ b), x rows
   ldx apart, N a multiple of 4 and K of 8. A tile is 4 outputs by up to 3 rows: 12 accumulators of
   8 products along K, summed across their lanes at the end; the 4 weight rows (9 KB at K = 1,536)
   stay in L1 while every row tile passes over them, so the weights stream from memory once. A row's
   sums do not depend on the other rows: the same bits at any M. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t ldx, const float *w, int64_t K,
                                                           const int mb, float *y, int64_t N, const float *b) {
    __m256 acc[3][4];
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + K + k);
        const __m256 w2 = _mm256_loadu_ps(w + 2 * K + k), w3 = _mm256_loadu_ps(w + 3 * K + k);
        for (int i = 0; i < mb; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
            acc[i][2] = _mm256_fmadd_ps(xv, w2, acc[i][2]);
            acc[i][3] = _mm256_fmadd_ps(xv, w3, acc[i][3]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < 4; j++) y[i * N + j] = hsum8(acc[i][j]) + (b ? b[j] : 0.0f);
}

void agentmem_avx2_gemm_f32(const float *x, int64_t ldx, const float *w, float *y, const float *b, int64_t M,
                            int64_t N, int64_t K, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 4)
        for (int64_t m0 = 0; m0 < M; m0 += 3) {
            const float *xm = x + m0 * ldx, *wn = w + n0 * K, *bn = b ? b + n0 : NULL;
            float *ym = y + m0 * N + n0;
            switch (M - m0 < 3 ? M - m0 : 3) {
                case 3: tile_f32(xm, ldx, wn, K, 3, ym, N, bn); break;
                case 2: tile_f32(xm, ldx, wn, K, 2, ym, N, bn); break;
                default: tile_f32(xm, ldx, wn, K, 1, ym, N, bn);
            }
        }
}

/* SwiGLU's silu(gate) * up of fp32 rows: agentmem_avx2_silu_mul_f32. */
#include "common.h"

/* silu(gate) * up of one row gu = [gate (I), up (I)] into y [I]: silu(x) = x * sigmoid(x),
   sigmoid from t = e^-|x| (exp8 of a non-positive argument): 1 / (1 + t) for x >= 0, t / (1 + t)
   below. */
static void silu_mul_row(const float *gu, int64_t I, float *y) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
        const __m256 x = _mm256_loadu_ps(gu + i);
        const __m256 t = exp8(_mm256_or_ps(x, sign));  /* e^-|x| */
        const __m256 num = _mm256_blendv_ps(one, t, x);  /* sign bit of x set: t */
        const __m256 sg = _mm256_div_ps(num, _mm256_add_ps(one, t));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(x, sg), _mm256_loadu_ps(gu + I + i)));
    }
    for (; i < I; i++) y[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[I + i];
}

/* silu(g) * u of fp32 rows gu [N, 2I] (rows ld apart) into y [N, I]: `silu_mul_row` a row, rows
   shared by the threads past 16 (Block.finish's fp32 rows, so that the fused layer below and the
   separate calls compute the same bits). */
void agentmem_avx2_silu_mul_f32(const float *gu, int64_t ld, float *y, int64_t N, int64_t I) {
    #pragma omp parallel for if (N > 16) schedule(static)
    for (int64_t n = 0; n < N; n++) silu_mul_row(gu + n * ld, I, y + n * I);
}

/* RMSNorm of fp32 rows: agentmem_avx2_rms_norm_f32. */
#include "common.h"

/* RMSNorm of fp32 rows: y = x / sqrt(mean(x^2) + eps) * w (rows ldx apart, y contiguous). */
void agentmem_avx2_rms_norm_f32(const float *x, int64_t ldx, const float *w, float *y, int64_t M, int64_t D,
                                float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        float *ym = y + m * D;
        __m256 acc = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
            const __m256 v = _mm256_loadu_ps(xm + d);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (; d < D; d++) ss += xm[d] * xm[d];
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        const __m256 rv = _mm256_set1_ps(r);
        for (d = 0; d + 8 <= D; d += 8)
            _mm256_storeu_ps(ym + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xm + d), rv), _mm256_loadu_ps(w + d)));
        for (; d < D; d++) ym[d] = xm[d] * r * w[d];
    }
}

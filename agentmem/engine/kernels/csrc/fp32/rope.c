/* RoPE of fp32 rows: agentmem_avx2_rope_f32. */
#include "common.h"

/* RoPE of fp32 rows as `layers.rotate` computes it: y = x * cos + swap(x) * sin (swap exchanges
   the two halves of a head; the sin table is signed). x [N, heads, hd] with rows ldx apart and
   heads hd apart, cos/sin [N, hd], y [N, heads, hd] contiguous; hd a multiple of 16. */
void agentmem_avx2_rope_f32(const float *x, int64_t ldx, const float *cs, const float *sn, float *y, int64_t N,
                            int64_t heads, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t n = 0; n < N; n++) {
        const float *c = cs + n * hd, *s = sn + n * hd;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + n * ldx + h * hd;
            float *yr = y + (n * heads + h) * hd;
            for (int64_t d = 0; d < half; d += 8) {
                const __m256 a = _mm256_loadu_ps(xr + d), b = _mm256_loadu_ps(xr + half + d);
                _mm256_storeu_ps(yr + d, _mm256_fmadd_ps(b, _mm256_loadu_ps(s + d),
                                                         _mm256_mul_ps(a, _mm256_loadu_ps(c + d))));
                _mm256_storeu_ps(yr + half + d, _mm256_fmadd_ps(a, _mm256_loadu_ps(s + half + d),
                                                                _mm256_mul_ps(b, _mm256_loadu_ps(c + half + d))));
            }
        }
    }
}

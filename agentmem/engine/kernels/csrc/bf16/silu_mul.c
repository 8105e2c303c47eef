/* SwiGLU's silu(gate) * up of bf16 rows: agentmem_silu_mul_bf16. */
#include "common.h"

/* SwiGLU's gate: y = silu(g) * u for bf16 rows gu [N, 2I] (g the first I of a row, u the rest:
   the fused gate/up projection's output, rows ld apart), y [N, I] contiguous. Rounded as
   torch's two ops round: silu(g) in fp32 to bf16, then its product with u to bf16. One call
   instead of two torch ops and their temporaries (2,048 rows: 2.4 ms a layer in torch). */
void agentmem_silu_mul_bf16(const uint16_t *gu, int64_t ld, uint16_t *y, int64_t N, int64_t I) {
    #pragma omp parallel for if (N > 16) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *g = gu + n * ld, *u = g + I;
        uint16_t *yr = y + n * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) {
            const __m512 x = load_bf16(g + i);
            const __m512 sg = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            const __m512 s16 = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(sg));  /* silu's own bf16 rounding */
            _mm256_storeu_si256((__m256i *)(yr + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s16, load_bf16(u + i))));
        }
        for (; i < I; i++) {
            const float x = bf16_to_f32(g[i]);
            const float sg = bf16_to_f32(to_bf16(x / (1.0f + expf(-x))));
            yr[i] = to_bf16(sg * bf16_to_f32(u[i]));
        }
    }
}

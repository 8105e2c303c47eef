/* RMSNorm of bf16 rows: agentmem_rms_norm_bf16. */
#include "common.h"

/* RMSNorm of bf16 rows as the engine's bf16 path computes it: normalised in fp32, rounded to
   bf16, then multiplied by the bf16 weight and rounded again. x, y [M, D] bf16 (rows ldx and D
   apart), w [D] bf16. One call instead of four torch ops per norm (61 a decode token); rows
   shared out past 16 (a 2,048-row prefill: 0.5 ms serial against torch's 2.8, AMX Xeon VM). */
void agentmem_rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y, int64_t M,
                            int64_t D, float eps) {
    #pragma omp parallel for if (M > 16) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xm = x + m * ldx;
        uint16_t *ym = y + m * D;
        __m512 acc = _mm512_setzero_ps();
        int64_t d = 0;
        for (; d + 16 <= D; d += 16) {
            __m512 v = load_bf16(xm + d);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        float ss = _mm512_reduce_add_ps(acc);
        for (; d < D; d++) {
            uint32_t u = (uint32_t)xm[d] << 16;
            float v;
            memcpy(&v, &u, 4);
            ss += v * v;
        }
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        for (d = 0; d < D; d++) {
            uint32_t u = (uint32_t)xm[d] << 16, uw = (uint32_t)w[d] << 16, ut;
            float v, wf, t;
            memcpy(&v, &u, 4);
            memcpy(&wf, &uw, 4);
            ut = (uint32_t)to_bf16(v * r) << 16;
            memcpy(&t, &ut, 4);
            ym[d] = to_bf16(t * wf);
        }
    }
}

/* RoPE of bf16 rows (agentmem_rope_bf16), and kvreuse's drift correction, rotated the same way
   (agentmem_drift_bf16). */
#include "common.h"

/* RoPE of bf16 rows as `layers.rotate` computes it: y = x * cos + swap(x) * sin in fp32 (swap
   exchanges the two halves of a head; the sin table is signed), rounded to bf16. x [N, heads,
   hd] with rows ldx elements apart and heads hd apart (q and k inside the fused qkv output),
   cos/sin [N, hd] fp32, y [N, heads, hd] contiguous; hd a multiple of 32. One call instead of
   six torch ops per layer of a decode token. */
void agentmem_rope_bf16(const uint16_t *x, int64_t ldx, const float *cs, const float *sn, uint16_t *y,
                        int64_t N, int64_t heads, int64_t hd) {
    const int64_t half = hd / 2;
    #pragma omp parallel for if (N > 16) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *c = cs + n * hd, *s = sn + n * hd;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xr = x + n * ldx + h * hd;
            uint16_t *yr = y + (n * heads + h) * hd;
            for (int64_t d = 0; d < half; d += 16) {
                __m512 a = load_bf16(xr + d), b = load_bf16(xr + half + d);
                __m512 lo = _mm512_add_ps(_mm512_mul_ps(a, _mm512_loadu_ps(c + d)),
                                          _mm512_mul_ps(b, _mm512_loadu_ps(s + d)));
                __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(c + half + d)),
                                          _mm512_mul_ps(a, _mm512_loadu_ps(s + half + d)));
                _mm256_storeu_si256((__m256i *)(yr + d), (__m256i)_mm512_cvtneps_pbh(lo));
                _mm256_storeu_si256((__m256i *)(yr + half + d), (__m256i)_mm512_cvtneps_pbh(hi));
            }
        }
    }
}

/* The kvreuse drift correction of one layer (kvreuse/fuser.py `_Drift.apply`): every token t
   of group g's span [spans[2g], spans[2g+1]) of k, v (bf16 [T, KV, hd], in place) gets that
   group's mean drift: v += dv[g], and k += dk[g] rotated to t, i.e. dk * cos[t] + swap(dk) *
   sin[t] (swap exchanges a head's halves; cs/sn are the model's fp32 RoPE tables [positions,
   hd], the sin signed), summed in fp32 and rounded once. dk, dv fp32 [G, KV, hd]; hd a multiple
   of 32. One call a layer instead of three torch ops per group. */
void agentmem_drift_bf16(uint16_t *k, uint16_t *v, const int64_t *spans, int64_t G, const float *dk,
                         const float *dv, const float *cs, const float *sn, int64_t KV, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t g = 0; g < G; g++) {
        const int64_t lo = spans[2 * g], hi = spans[2 * g + 1];
        const float *dkg = dk + g * KV * hd, *dvg = dv + g * KV * hd;
        #pragma omp parallel for if (hi - lo > 64) schedule(static)
        for (int64_t t = lo; t < hi; t++) {
            const float *c = cs + t * hd, *s = sn + t * hd;
            for (int64_t h = 0; h < KV; h++) {
                uint16_t *kr = k + (t * KV + h) * hd, *vr = v + (t * KV + h) * hd;
                const float *a = dkg + h * hd, *dvh = dvg + h * hd;
                for (int64_t d = 0; d < half; d += 16) {
                    const __m512 a0 = _mm512_loadu_ps(a + d), a1 = _mm512_loadu_ps(a + half + d);
                    __m512 lo_ = _mm512_add_ps(load_bf16(kr + d), _mm512_add_ps(_mm512_mul_ps(a0, _mm512_loadu_ps(c + d)),
                                                                              _mm512_mul_ps(a1, _mm512_loadu_ps(s + d))));
                    __m512 hi_ = _mm512_add_ps(load_bf16(kr + half + d),
                                               _mm512_add_ps(_mm512_mul_ps(a1, _mm512_loadu_ps(c + half + d)),
                                                             _mm512_mul_ps(a0, _mm512_loadu_ps(s + half + d))));
                    _mm256_storeu_si256((__m256i *)(kr + d), (__m256i)_mm512_cvtneps_pbh(lo_));
                    _mm256_storeu_si256((__m256i *)(kr + half + d), (__m256i)_mm512_cvtneps_pbh(hi_));
                }
                for (int64_t d = 0; d < hd; d += 16) {
                    const __m512 x = _mm512_add_ps(load_bf16(vr + d), _mm512_loadu_ps(dvh + d));
                    _mm256_storeu_si256((__m256i *)(vr + d), (__m256i)_mm512_cvtneps_pbh(x));
                }
            }
        }
    }
}

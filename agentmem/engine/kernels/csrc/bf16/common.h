/* What the bf16 library's kernels share: bf16 conversions and loads, e^x, and the product tiles'
   store and row-count switch. */
#ifndef AGENTMEM_BF16_COMMON_H
#define AGENTMEM_BF16_COMMON_H

#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* 16 bf16 -> 16 fp32 */
static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* e^x for 16 floats (x <= 0 here: scores minus their max): 2^n * p(r), r = x - n ln 2 in
   [-ln2/2, ln2/2], p of degree 6 (relative error ~2e-7); below -87 the result is 0. */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}

/* 16 sums (+ bias) to y[0..15], fp32 or bf16 */
static inline void store(void *y, int64_t off, __m512 v, const float *b, int f32) {
    if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b));
    if (f32) {
        _mm512_storeu_ps((float *)y + off, v);
        return;
    }
    float t[16];
    _mm512_storeu_ps(t, v);
    for (int j = 0; j < 16; j++) ((uint16_t *)y)[off + j] = to_bf16(t[j]);
}

/* CALL(mb) for the input rows left (1-8), with mb a constant in each case: the tiles unroll */
#define BY_ROWS(left, CALL) switch ((left) < 8 ? (left) : 8) { \
    case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break; case 5: CALL(5); break; \
    case 4: CALL(4); break; case 3: CALL(3); break; case 2: CALL(2); break; default: CALL(1); break; }

#endif

/* Few-row products of bf16 weights, and of int8 ones widened to bf16 (`vdpbf16ps`): agentmem_gemv. */
#include "common.h"

/* int8 weights, one fp32 scale per output (`q8`): w[n, k] = s[n] * q[n, k], q packed in the
   same layout, 32 bytes holding the input pair (k, k+1) for 16 outputs. They are widened to
   bf16 in registers (int8 values are exact in bf16) and summed with `vdpbf16ps` as bf16
   weights are: half the weight bytes read, five more instructions per 32 bytes, which 8 input
   rows share. */
static inline __attribute__((always_inline)) __m512bh widen(const int8_t *p) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    /* lo holds pairs 0-7 (16 values), hi pairs 8-15: one bf16 vector, lo in the low half */
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* 16 outputs x an input pair of the packed weight, from element `off` on, as bf16 */
static inline __attribute__((always_inline)) __m512bh weights(const void *w, int64_t off, const int q8) {
    return q8 ? widen((const int8_t *)w + off) : (__m512bh)_mm512_loadu_si512((const uint16_t *)w + off);
}

/* How far ahead the int8 product asks for its weights (software prefetch). The int8 weights are
   consumed at half the bytes per instruction of bf16 ones, and the hardware prefetcher alone
   kept them at ~23 GB/s cold; asked for 2 KB ahead, a model's 120 products at one row took
   3.6-3.7 against 4.5-4.8 ms, at eight rows 4.5 against 6.5 (Zen 5 EPYC, 2 threads, the two
   builds timed in alternation in one process). bf16 weights gained nothing from it. */
#define Q8_AHEAD 2048

/* One 32-output block against `mb` (1-8) input rows: up to 16 accumulators, 2 weight vectors
   and an input pair broadcast per step. Inlined with constant `mb` and `q8`, the loops unroll
   and the weight format's branch goes. */
static inline __attribute__((always_inline)) void tile(const void *wb, const int q8, int64_t K, const uint16_t *x,
                                                       int64_t ldx, const int mb, void *y, int64_t N,
                                                       int64_t n, const float *s, const float *b, int f32) {
    __m512 acc[8][2];
    for (int i = 0; i < mb; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        if (q8 && (k & 3) == 0) {  /* int8: each of the two weight streams a line ahead by Q8_AHEAD bytes */
            _mm_prefetch((const char *)wb + 16 * k + Q8_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char *)wb + 16 * K + 16 * k + Q8_AHEAD, _MM_HINT_T0);
        }
        __m512bh w0 = weights(wb, 16 * k, q8), w1 = weights(wb, 16 * K + 16 * k, q8);
        for (int i = 0; i < mb; i++) {
            int32_t pair;
            memcpy(&pair, x + i * ldx + k, 4);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, xv);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, xv);
        }
    }
    for (int i = 0; i < mb; i++) {
        if (q8) {
            acc[i][0] = _mm512_mul_ps(acc[i][0], _mm512_loadu_ps(s + n));
            acc[i][1] = _mm512_mul_ps(acc[i][1], _mm512_loadu_ps(s + n + 16));
        }
        store(y, i * N + n, acc[i][0], b ? b + n : 0, f32);
        store(y, i * N + n + 16, acc[i][1], b ? b + n + 16 : 0, f32);
    }
}

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]), w packed as [N/16][K/2][16][2] (N a multiple
   of 32, K even): bf16 weights (scale NULL), or int8 ones with y scaled by scale[n]. x bf16
   [M, K] with rows `ldx` apart, y [M, N] (fp32 if f32, else bf16). The threads split the
   32-output blocks; each block runs every input row, up to 8 at a time. */
void agentmem_gemv(const void *w, const float *scale, const uint16_t *x, int64_t ldx, void *y, const float *b,
                  int64_t M, int64_t N, int64_t K, int f32, int threads) {
    const int64_t blocks = N / 32;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            const int64_t left = M - m0, n = blk * 32;
            const uint16_t *xm = x + m0 * ldx;
            char *ym = f32 ? (char *)y + m0 * N * 4 : (char *)y + m0 * N * 2;
            if (scale) {
                #define TILE(mb) tile((const int8_t *)w + blk * 32 * K, 1, K, xm, ldx, mb, ym, N, n, scale, b, f32)
                BY_ROWS(left, TILE)
                #undef TILE
            } else {
                #define TILE(mb) tile((const uint16_t *)w + blk * 32 * K, 0, K, xm, ldx, mb, ym, N, n, 0, b, f32)
                BY_ROWS(left, TILE)
                #undef TILE
            }
        }
    }
}

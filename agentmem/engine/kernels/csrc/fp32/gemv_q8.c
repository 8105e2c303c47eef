/* Few-row products of int8 weights against fp32 rows quantized to int16 (`vpmaddwd`; on AVX-512
   `vpdpwssd` or 512-bit `vpmaddwd`): agentmem_avx2_gemv_q8. */
#include "common.h"

#define I16_MAX 8191
#define I16_CHUNK 2048  /* 127 * 8191 * 2048 < 2^31: a lane's int32 sum of a chunk cannot overflow */
#define STACK 16384     /* int16 inputs quantized on the stack; more are malloc'd */

/* Row xr (fp32, K inputs) to int16 q at step *xs = amax / I16_MAX (round to nearest even). */
static void quantize(const float *xr, int64_t K, int16_t *q, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + k)));
    float top = hmax8(amax);
    for (; k < K; k++) top = fmaxf(top, fabsf(xr[k]));
    const float step = top > 0.0f ? top / I16_MAX : 1.0f, inv = 1.0f / step;
    *xs = step;
    const __m256 iv = _mm256_set1_ps(inv);
    for (k = 0; k + 16 <= K; k += 16) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k), iv));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k + 8), iv));
        /* packs works per 128-bit lane: a0-3 b0-3 a4-7 b4-7, put back in order */
        _mm256_storeu_si256((__m256i *)(q + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
    for (; k < K; k++) q[k] = (int16_t)lrintf(xr[k] * inv);
}

#ifdef AGENTMEM_AVX512
/* The products on AVX-512 (`vnni512`: a CPU with AVX-512 and VNNI but no AVX512-BF16, where the
   engine runs fp32 on this library; `avx512bw`: AVX-512 without VNNI, Skylake-SP): the same int16
   rows and int8 weights in the same layout, the 32 bytes of an input pair's 16 outputs
   sign-extended into one 512-bit register (`vpmovsxbw`) and multiplied into 16 int32 sums by one
   `vpdpwssd` a row (VNNI), or one 512-bit `vpmaddwd` and add, where AVX2 takes two of each; 8
   rows at a time (16 accumulators of AVX-512's 32 registers). The int32 sums are the AVX2 code's,
   and their fp32 arithmetic is too, lane for lane: the same bits. */
#define TILE_ROWS 8
#ifdef AGENTMEM_VNNI512
/* in asm: the intrinsic made GCC copy every accumulator a step (a register move per product) */
#define DPWSSD(acc, w, x) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x))
#else
#define DPWSSD(acc, w, x) ((acc) = _mm512_add_epi32((acc), _mm512_madd_epi16((w), (x))))
#endif
static inline __attribute__((always_inline)) void tile(const int8_t *wg, int64_t K, const int16_t *x, const int mb,
                                                       float *y, int64_t N, int64_t n, const float *s,
                                                       const float *xs, const float *b, const float *r) {
    __m512 f[8];
    for (int i = 0; i < mb; i++) f[i] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += I16_CHUNK) {
        const int64_t k1 = K - k0 < I16_CHUNK ? K : k0 + I16_CHUNK;
        __m512i acc[8];
        for (int i = 0; i < mb; i++) acc[i] = _mm512_setzero_si512();
        for (int64_t k = k0; k < k1; k += 2) {
            if ((k & 3) == 0) _mm_prefetch((const char *)wg + 16 * k + AHEAD, _MM_HINT_T0);
            const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wg + 16 * k)));
            for (int i = 0; i < mb; i++) {
                int32_t pair;
                memcpy(&pair, x + i * K + k, 4);
                DPWSSD(acc[i], w, _mm512_set1_epi32(pair));
            }
        }
        for (int i = 0; i < mb; i++) f[i] = _mm512_add_ps(f[i], _mm512_cvtepi32_ps(acc[i]));
    }
    const __m512 sv = _mm512_loadu_ps(s + n);
    for (int i = 0; i < mb; i++) {
        __m512 v = _mm512_mul_ps(f[i], _mm512_mul_ps(sv, _mm512_set1_ps(xs[i])));
        if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b + n));
        if (r) v = _mm512_add_ps(v, _mm512_loadu_ps(r + i * N + n));
        _mm512_storeu_ps(y + i * N + n, v);
    }
}
#else
/* `mb` (1-4) int16 rows of a 16-output group (wg: [K/2][16][2] int8) into y (fp32):
   y = sum * s[n] * xs[i] (+ b[n]) (+ r[i, n]: a residual, rows N apart like y's). */
static inline __attribute__((always_inline)) void tile(const int8_t *wg, int64_t K, const int16_t *x, const int mb,
                                                       float *y, int64_t N, int64_t n, const float *s,
                                                       const float *xs, const float *b, const float *r) {
    __m256 f[4][2];
    for (int i = 0; i < mb; i++) f[i][0] = f[i][1] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += I16_CHUNK) {
        const int64_t k1 = K - k0 < I16_CHUNK ? K : k0 + I16_CHUNK;
        __m256i acc[4][2];
        for (int i = 0; i < mb; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
        for (int64_t k = k0; k < k1; k += 2) {
            if ((k & 3) == 0) _mm_prefetch((const char *)wg + 16 * k + AHEAD, _MM_HINT_T0);
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wg + 16 * k)));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wg + 16 * k + 16)));
            for (int i = 0; i < mb; i++) {
                int32_t pair;
                memcpy(&pair, x + i * K + k, 4);
                const __m256i xv = _mm256_set1_epi32(pair);
                acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(w0, xv));
                acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(w1, xv));
            }
        }
        for (int i = 0; i < mb; i++) {
            f[i][0] = _mm256_add_ps(f[i][0], _mm256_cvtepi32_ps(acc[i][0]));
            f[i][1] = _mm256_add_ps(f[i][1], _mm256_cvtepi32_ps(acc[i][1]));
        }
    }
    for (int i = 0; i < mb; i++) {
        const __m256 sc = _mm256_set1_ps(xs[i]);
        for (int h = 0; h < 2; h++) {
            __m256 v = _mm256_mul_ps(f[i][h], _mm256_mul_ps(_mm256_loadu_ps(s + n + 8 * h), sc));
            if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + n + 8 * h));
            if (r) v = _mm256_add_ps(v, _mm256_loadu_ps(r + i * N + n + 8 * h));
            _mm256_storeu_ps(y + i * N + n + 8 * h, v);
        }
    }
}

#define TILE_ROWS 4
#endif

/* Every row of 16-output group g: the rows TILE_ROWS at a time. */
static void group(const int8_t *w, const float *scale, const int16_t *xq, const float *xs, float *y,
                  const float *b, const float *r, int64_t M, int64_t N, int64_t K, int64_t g) {
    const int8_t *wg = w + g * 16 * K;
    for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
        const int16_t *xm = xq + m0 * K;
        float *ym = y + m0 * N;
        const float *rm = r ? r + m0 * N : NULL;
        #define T(mb) case mb: tile(wg, K, xm, mb, ym, N, g * 16, scale, xs + m0, b, rm); break;
        switch (M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS) {
#if TILE_ROWS == 8
            T(8) T(7) T(6) T(5)
#endif
            T(4) T(3) T(2) default: tile(wg, K, xm, 1, ym, N, g * 16, scale, xs + m0, b, rm); break;
        }
        #undef T
    }
}

/* For the calling team: y = x q^T * scale (+ b) (+ r) of rows xq already quantized (xs their steps);
   the threads split the 16-output groups. */
static void team_groups(const int8_t *w, const float *scale, const int16_t *xq, const float *xs, float *y,
                        const float *b, const float *r, int64_t M, int64_t N, int64_t K) {
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < N / 16; g++) group(w, scale, xq, xs, y, b, r, M, N, K, g);
}

/* y[m, n] = sum_k x[m, k] * q[n, k] * scale[n] (+ b[n]) for fp32 x [M, K] (rows ldx apart),
   q packed by cpu_bf16.pack (N a multiple of 16, K even), y fp32 [M, N]. The threads split
   the 16-output groups; each group runs every input row, 4 at a time. */
void agentmem_avx2_gemv_q8(const int8_t *w, const float *scale, const float *x, int64_t ldx, float *y,
                           const float *b, int64_t M, int64_t N, int64_t K, int threads) {
    int16_t stack[M * K <= STACK ? M * K + 1 : 1] __attribute__((aligned(32)));
    int16_t *xq = M * K <= STACK ? stack : (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
    float xs[M > 0 ? M : 1];
    for (int64_t m = 0; m < M; m++) quantize(x + m * ldx, K, xq + m * K, xs + m);
    #pragma omp parallel num_threads(threads)
    team_groups(w, scale, xq, xs, y, b, NULL, M, N, K);
    if (xq != stack) free(xq);
}

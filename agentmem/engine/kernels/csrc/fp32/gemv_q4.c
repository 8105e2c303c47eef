/* 4-bit weights (llama.cpp's Q4_1 groups) against fp32 rows quantized to int8 (`vpmaddubsw`; on
   AVX-512 q4_vnni.h's group loop): agentmem_avx2_gemv_q4. */
#include "common.h"

/* 4-bit weights (`cpu_bf16.pack_q4`'s layout, llama.cpp's Q4_1 groups: w = d q + m per Q4_GROUP
   inputs, d and m fp16, q in 0..15), for fp32 rows: the rows quantized to int8 with a step per
   Q8_BLOCK inputs (as the AVX-512 u8 route does), and q, unsigned, multiplied by them with
   `vpmaddubsw`, which sums two byte products into an int16. With q <= 15 and |x| <= 127 a pair
   is at most 3,810, so the eight pairs a lane gathers over a group (32 inputs) add up in int16
   (<= 30,480) before one `vpmaddwd` by ones widens them: per row and 8 outputs x 32 inputs eight
   `vpmaddubsw` and eight adds, where the int8 tile above takes 32 `vpmaddwd` and 32 adds for
   them. Per group and row, d S + m X (S the group's sum, X the row's quantized sum over it).
   A tile is 8 outputs (one half of a 16-output group; the halves run in turn over the group's
   weights, which stay in L1) by up to Q4_ROWS rows: 4 accumulators, 4 sums, the two weight
   operands and two broadcasts fit AVX2's 16 registers. */
#define Q4_GROUP 32  /* as in q4_vnni.h, which the AVX-512 builds include below */
#define Q8_BLOCK 64

/* Row xr (fp32, K inputs, K a multiple of Q8_BLOCK) to int8 q with a step per Q8_BLOCK inputs
   xs[K / Q8_BLOCK] (amax / 127, round to nearest even) and xsum[K / Q4_GROUP] = step * (sum of
   the group's q). */
static void quantize8(const float *xr, int64_t K, int8_t *q, float *xs, float *xsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += Q8_BLOCK, b++) {
        __m256 amax = _mm256_setzero_ps();
        for (int j = 0; j < Q8_BLOCK; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + k0 + j)));
        const float top = hmax8(amax), step = top > 0.0f ? top / 127.0f : 1.0f;
        const __m256 iv = _mm256_set1_ps(1.0f / step);
        xs[b] = step;
        for (int j = 0; j < Q8_BLOCK; j += 32) {
            __m256i v[4];
            for (int u = 0; u < 4; u++) v[u] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k0 + j + 8 * u), iv));
            const __m256i t = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
            __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
            xsum[(k0 + j) / Q4_GROUP] = step * (float)_mm_cvtsi128_si32(h);
            /* packs works per 128-bit lane: dwords a0-3 b0-3 c0-3 d0-3 | a4-7 ..., put back in order */
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
            _mm256_storeu_si256((__m256i *)(q + k0 + j), _mm256_permutevar8x32_epi32(p, order));
        }
    }
}

#ifdef AGENTMEM_AVX512
/* On AVX512-VNNI (`vnni512`): the 16 outputs in one register and `vpdpbusd` (q against four int8
   inputs into each int32 lane), 8 rows a tile: the bf16 library's group loop (q4_vnni.h's
   `q4_tile_sums`). On AVX-512 without VNNI (`avx512bw`) the AVX2 tile's `vpmaddubsw` pair sums in
   int16, widened by one `vpmaddwd` a group, over all 16 outputs at once. The group sums are the same integers as
   the AVX2 tile's and their fp32 arithmetic is too, lane for lane: the same bits. */
#define Q4_ROWS 8
#define Q4_AHEAD AHEAD  /* this library's products fetch AHEAD into L1 (8 KB into L2 measured 2-6% slower here) */
#define Q4_HINT _MM_HINT_T0
#ifndef AGENTMEM_VNNI512  /* the group loop's step without VNNI: the AVX2 tile's int16 pair sums */
#define Q4_TARGET
#define Q4_STEP(acc, lo, hi, x0, x1) do { \
        acc = _mm512_add_epi16(acc, _mm512_maddubs_epi16(lo, x0)); \
        acc = _mm512_add_epi16(acc, _mm512_maddubs_epi16(hi, x1)); \
    } while (0)
#define Q4_WIDEN(acc) _mm512_madd_epi16(acc, _mm512_set1_epi16(1))
#endif
#include "../q4_vnni.h"

static inline __attribute__((always_inline)) void tile_q4(const uint8_t *wg, const uint16_t *dmg, int64_t K,
                                                          const int8_t *x, const int mb, float *y, int64_t N,
                                                          int64_t n, const float *xs, const float *xsum,
                                                          const float *b, const float *r) {
    __m512 f[Q4_ROWS];
    q4_tile_sums(wg, dmg, K, x, K, mb, xs, xsum, f);
    for (int i = 0; i < mb; i++) {
        __m512 v = f[i];
        if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b + n));
        if (r) v = _mm512_add_ps(v, _mm512_loadu_ps(r + i * N + n));
        _mm512_storeu_ps(y + i * N + n, v);
    }
}
#else
#define Q4_ROWS 4
/* y (+ b) (+ r) for `mb` (1-Q4_ROWS) int8 rows x (K apart) and the 16-output group at n (`wg`:
   [K/8][16][4] bytes, `dmg`: [K/Q4_GROUP][2][16] fp16). */
static inline __attribute__((always_inline)) void tile_q4(const uint8_t *wg, const uint16_t *dmg, int64_t K,
                                                          const int8_t *x, const int mb, float *y, int64_t N,
                                                          int64_t n, const float *xs, const float *xsum,
                                                          const float *b, const float *r) {
    const int64_t nb = K / Q8_BLOCK, ng = K / Q4_GROUP;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256 f[Q4_ROWS];
        for (int i = 0; i < mb; i++) f[i] = _mm256_setzero_ps();
        for (int64_t k0 = 0, g = 0; k0 < K; k0 += Q4_GROUP, g++) {
            __m256i acc[Q4_ROWS];
            for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_si256();
            for (int64_t k = k0; k < k0 + Q4_GROUP; k += 8) {
                if (h == 0) _mm_prefetch((const char *)wg + 8 * k + AHEAD, _MM_HINT_T0);
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + 8 * k + 32 * h));
                const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                for (int i = 0; i < mb; i++) {
                    int32_t q0, q1;
                    memcpy(&q0, x + i * K + k, 4);
                    memcpy(&q1, x + i * K + k + 4, 4);
                    acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(q0)));
                    acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(q1)));
                }
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dmg + g * 32 + 8 * h)));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dmg + g * 32 + 16 + 8 * h)));
            for (int i = 0; i < mb; i++) {
                const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[i], ones)),
                                               _mm256_set1_ps(xs[i * nb + k0 / Q8_BLOCK]));
                f[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[i * ng + g]), _mm256_fmadd_ps(s, d, f[i]));
            }
        }
        for (int i = 0; i < mb; i++) {
            __m256 v = f[i];
            if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + n + 8 * h));
            if (r) v = _mm256_add_ps(v, _mm256_loadu_ps(r + i * N + n + 8 * h));
            _mm256_storeu_ps(y + i * N + n + 8 * h, v);
        }
    }
}
#endif

/* For the calling team: y = the q4 product (+ b) (+ r) of rows xq already quantized by `quantize8`
   (xs, xsum theirs); the threads split the 16-output groups. */
static void team_groups_q4(const uint8_t *w, const uint16_t *dm, const int8_t *xq, const float *xs,
                           const float *xsum, float *y, const float *b, const float *r, int64_t M, int64_t N,
                           int64_t K) {
    const int64_t nb = K / Q8_BLOCK, ng = K / Q4_GROUP;
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < N / 16; g++) {
        for (int64_t m0 = 0; m0 < M; m0 += Q4_ROWS) {
            #define T(mb) case mb: tile_q4(w + g * 8 * K, dm + g * K, K, xq + m0 * K, mb, y + m0 * N, N, g * 16, \
                                           xs + m0 * nb, xsum + m0 * ng, b, r ? r + m0 * N : NULL); break;
            switch (M - m0 < Q4_ROWS ? M - m0 : Q4_ROWS) {
#if Q4_ROWS == 8
                T(8) T(7) T(6) T(5)
#endif
                T(4) T(3) T(2) default: T(1)
            }
            #undef T
        }
    }
}

/* y = x w^T (+ b) for fp32 x [M, K] (rows ldx apart) and w held by `cpu_bf16.pack_q4` (N a multiple
   of 16, K of Q8_BLOCK), y fp32 [M, N]. */
void agentmem_avx2_gemv_q4(const uint8_t *w, const uint16_t *dm, const float *x, int64_t ldx, float *y,
                           const float *b, int64_t M, int64_t N, int64_t K, int threads) {
    int8_t *xq = (int8_t *)malloc((size_t)(M * K) + 32);
    float *xs = (float *)malloc(sizeof(float) * (size_t)(M * (K / Q8_BLOCK) + 1));
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(M * (K / Q4_GROUP) + 1));
    for (int64_t m = 0; m < M; m++)
        quantize8(x + m * ldx, K, xq + m * K, xs + m * (K / Q8_BLOCK), xsum + m * (K / Q4_GROUP));
    #pragma omp parallel num_threads(threads)
    team_groups_q4(w, dm, xq, xs, xsum, y, b, NULL, M, N, K);
    free(xsum);
    free(xs);
    free(xq);
}

/* int8 weights against the rows quantized to int16 (`vpdpwssd`, AVX512-VNNI): agentmem_gemv_q8i16.
   Follows gemv_bf16.c in bf16.c (its Q8_AHEAD). */
#include "common.h"

/* int8 weights against int16 activations on AVX512-VNNI (`i16`): each input row quantized to
   int16 with its own scale (|x| <= I16_MAX), the weights sign-extended to int16 in registers
   (one instruction per 32 bytes, where widening them to bf16 takes five) and multiplied in
   pairs into int32 with `vpdpwssd`, which matches the packed layout: a 32-bit lane holds one
   output's input pair. |q| <= 8191 and |w| <= 127 keep a lane's sum of I16_CHUNK inputs
   below 2^31 (127 * 8191 * 2048 = 2.13e9); each chunk's sums go to fp32 before the next. */
#define I16_MAX 8191
#define I16_CHUNK 2048

/* acc += pairwise products of w and x (vpdpwssd), in place: GCC 12's intrinsic for it is not
   tied to its accumulator, and its loops copied every sum twice a step (~30 register moves
   per input pair at eight rows). */
#define DPWSSD(acc, w, x) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x))

/* The int32 sums of `mb` int16 rows over inputs k0..k1 of a 32-output block, as fp32. */
#define I16_SUMS(mb, k0, k1, out) do { \
        __m512i acc_[8][2]; \
        for (int i_ = 0; i_ < (mb); i_++) acc_[i_][0] = acc_[i_][1] = _mm512_setzero_si512(); \
        for (int64_t k = (k0); k < (k1); k += 2) { \
            if ((k & 3) == 0) { \
                _mm_prefetch((const char *)wb + 16 * k + Q8_AHEAD, _MM_HINT_T0); \
                _mm_prefetch((const char *)wb + 16 * K + 16 * k + Q8_AHEAD, _MM_HINT_T0); \
            } \
            __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wb + 16 * k))); \
            __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wb + 16 * K + 16 * k))); \
            for (int i_ = 0; i_ < (mb); i_++) { \
                int32_t pair_; \
                memcpy(&pair_, x + i_ * ldx + k, 4); \
                __m512i xv_ = _mm512_set1_epi32(pair_); \
                DPWSSD(acc_[i_][0], w0, xv_); \
                DPWSSD(acc_[i_][1], w1, xv_); \
            } \
        } \
        for (int i_ = 0; i_ < (mb); i_++) { \
            out[i_][0] = _mm512_cvtepi32_ps(acc_[i_][0]); \
            out[i_][1] = _mm512_cvtepi32_ps(acc_[i_][1]); \
        } \
    } while (0)

/* y for `mb` (1-8) int16 rows of a 32-output block: w * s[n] * xs[i] (+ b). Up to I16_CHUNK
   inputs, one pass of int32 sums (16 of them and the two weight vectors fit the registers as
   `tile`'s do); past it, per chunk into fp32 sums kept in memory, so the registers stay the
   int32 ones (with both in registers, GCC's loop spent ~30 register moves a step). */
__attribute__((target("avx512vnni")))
static inline __attribute__((always_inline)) void tile_i16(const int8_t *wb, int64_t K, const int16_t *x,
                                                           int64_t ldx, const int mb, void *y, int64_t N, int64_t n,
                                                           const float *s, const float *xs, const float *b, int f32) {
    __m512 sums[8][2];
    if (K <= I16_CHUNK) {
        I16_SUMS(mb, 0, K, sums);
    } else {
        float part[8][2][16] __attribute__((aligned(64)));
        memset(part, 0, sizeof part);
        for (int64_t k0 = 0; k0 < K; k0 += I16_CHUNK) {
            __m512 c[8][2];
            I16_SUMS(mb, k0, K - k0 < I16_CHUNK ? K : k0 + I16_CHUNK, c);
            for (int i = 0; i < mb; i++)
                for (int h = 0; h < 2; h++)
                    _mm512_store_ps(part[i][h], _mm512_add_ps(_mm512_load_ps(part[i][h]), c[i][h]));
            __asm__ volatile("" ::: "memory");  /* the fp32 sums stay in memory between chunks */
        }
        for (int i = 0; i < mb; i++)
            for (int h = 0; h < 2; h++) sums[i][h] = _mm512_load_ps(part[i][h]);
    }
    for (int i = 0; i < mb; i++) {
        const __m512 r = _mm512_set1_ps(xs[i]);
        store(y, i * N + n, _mm512_mul_ps(sums[i][0], _mm512_mul_ps(_mm512_loadu_ps(s + n), r)), b ? b + n : 0, f32);
        store(y, i * N + n + 16, _mm512_mul_ps(sums[i][1], _mm512_mul_ps(_mm512_loadu_ps(s + n + 16), r)),
              b ? b + n + 16 : 0, f32);
    }
}

/* Row m of x (bf16, K inputs) quantized to int16 at step xs[m] = amax / I16_MAX, 32 inputs an
   instruction (a scalar loop took ~3 ns an input: 2.4 ms of a model's 120 products at eight
   rows, a third of the step's GEMV time). Rounded to nearest even, as lrintf. */
__attribute__((target("avx512vnni")))
static void quantize_i16(const uint16_t *xr, int64_t K, int16_t *q, float *xs) {
    __m512 amax = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16(xr + k)));
    float top = _mm512_reduce_max_ps(amax);
    for (; k < K; k++) {
        uint32_t u = (uint32_t)xr[k] << 16;
        float f;
        memcpy(&f, &u, 4);
        top = fmaxf(top, fabsf(f));
    }
    const float step = top > 0.0f ? top / I16_MAX : 1.0f, inv = 1.0f / step;
    *xs = step;
    const __m512 iv = _mm512_set1_ps(inv);
    for (k = 0; k + 16 <= K; k += 16)
        _mm256_storeu_si256((__m256i *)(q + k),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(load_bf16(xr + k), iv))));
    for (; k < K; k++) {
        uint32_t u = (uint32_t)xr[k] << 16;
        float f;
        memcpy(&f, &u, 4);
        q[k] = (int16_t)lrintf(f * inv);
    }
}

#define I16_STACK 16384  /* int16 inputs quantized on the stack (8 rows of 2,048); more are malloc'd */

/* `agentmem_gemv` for int8 weights on AVX512-VNNI: the bf16 input rows are quantized to int16
   (symmetric, one scale per row) here, then every 32-output block runs them 8 at a time. */
__attribute__((target("avx512vnni")))
void agentmem_gemv_q8i16(const int8_t *w, const float *scale, const uint16_t *x, int64_t ldx, void *y,
                         const float *b, int64_t M, int64_t N, int64_t K, int f32, int threads) {
    int16_t stack[M * K <= I16_STACK ? M * K + 1 : 1] __attribute__((aligned(64)));
    int16_t *xq = M * K <= I16_STACK ? stack : (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
    float xs[M > 0 ? M : 1];
    for (int64_t m = 0; m < M; m++) quantize_i16(x + m * ldx, K, xq + m * K, xs + m);
    const int64_t blocks = N / 32;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            const int64_t left = M - m0, n = blk * 32;
            char *ym = f32 ? (char *)y + m0 * N * 4 : (char *)y + m0 * N * 2;
            #define TILE(mb) tile_i16(w + blk * 32 * K, K, xq + m0 * K, K, mb, ym, N, n, scale, xs + m0, b, f32)
            BY_ROWS(left, TILE)
            #undef TILE
        }
    }
    if (xq != stack) free(xq);
}

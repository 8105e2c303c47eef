/* int8 weights against the rows quantized to int8 in blocks (`vpdpbusd`, AVX512-VNNI): agentmem_gemv_q8u8. */
#include "common.h"

/* int8 weights against int8 activations on AVX512-VNNI (`u8`): `vpdpbusd` multiplies four
   unsigned bytes by four signed ones into each int32 lane, 64 products an instruction where
   `vpdpwssd` makes 32; on the Xeon VMs either runs on one port, so eight rows take half the
   instructions. The weights are stored offset by 128 as unsigned bytes (u = q + 128, the sign
   bit flipped), packed [N/16][K/4][16][4] so that a 32-bit lane holds one output's four
   inputs. The input rows are quantized to int8 with a scale per U8_BLOCK inputs (one scale per
   row cost SmolLM2 3% of decode perplexity: an outlier channel leaves the rest of its row a
   few levels) and broadcast four at a time as the signed operand. Each block's int32 sums
   go to fp32 at its scale. sum u * x = sum q * x + 128 * sum x: the 128 * sum x of a row's
   blocks, at their scales, is one number per row (`corr`) taken off at the end. */
#define U8_BLOCK 64
/* How far ahead tile_u8 fetches its weight stream, and to where: 8 KB into L2. With eight rows
   a 64-byte line feeds eight `vpdpbusd`, so the loop consumes lines slower than one row's but
   still faster than memory delivers them; 2 KB ahead into L1 (Q8_AHEAD, the other tiles') left
   too few lines in flight. Cold 3,072 x 576 products on a 2-core Zen 4 VM (2026-11-28, best of
   15): eight rows 73.9 -> 62.6 us (24.0 -> 28.3 GB/s), one row 56.9 -> 60.0 (within that VM's
   run-to-run spread); 8 decode streams 685-910 -> 877-962 tok/s, alternated in one process. */
#define U8_AHEAD 8192
#define DPBUSD(acc, u, x) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(x))

/* Row x (bf16, K inputs, K a multiple of U8_BLOCK) to int8 q, a scale per block xs[K / U8_BLOCK]
   and the row's offset correction *corr. */
__attribute__((target("avx512vnni")))
static void quantize_i8(const uint16_t *xr, int64_t K, int8_t *q, float *xs, float *corr) {
    float c = 0.0f;
    for (int64_t k0 = 0, blk = 0; k0 < K; k0 += U8_BLOCK, blk++) {
        __m512 v[U8_BLOCK / 16], amax = _mm512_setzero_ps();
        for (int j = 0; j < U8_BLOCK / 16; j++) {
            v[j] = load_bf16(xr + k0 + 16 * j);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(v[j]));
        }
        const float top = _mm512_reduce_max_ps(amax);
        const float step = top > 0.0f ? top / 127.0f : 1.0f;
        const __m512 iv = _mm512_set1_ps(1.0f / step);
        __m512i sum = _mm512_setzero_si512();
        for (int j = 0; j < U8_BLOCK / 16; j++) {
            const __m512i t = _mm512_cvtps_epi32(_mm512_mul_ps(v[j], iv));
            sum = _mm512_add_epi32(sum, t);
            _mm_storeu_si128((__m128i *)(q + k0 + 16 * j), _mm512_cvtsepi32_epi8(t));
        }
        xs[blk] = step;
        c += step * 128.0f * (float)_mm512_reduce_add_epi32(sum);
    }
    *corr = c;
}

/* y for `mb` (1-8) int8 rows of a 16-output group (`wg`: [K/4][16][4] bytes): per block,
   int32 sums (8 registers) scaled into fp32 ones (8 more). */
__attribute__((target("avx512vnni")))
static inline __attribute__((always_inline)) void tile_u8(const uint8_t *wg, int64_t K, const int8_t *x,
                                                          int64_t ldx, const int mb, void *y, int64_t N, int64_t n,
                                                          const float *s, const float *xs, const float *corr,
                                                          const float *b, int f32) {
    const int64_t nb = K / U8_BLOCK;
    __m512 f[8];
    for (int i = 0; i < mb; i++) f[i] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += U8_BLOCK) {
        __m512i acc[8];
        for (int i = 0; i < mb; i++) acc[i] = _mm512_setzero_si512();
        for (int64_t k = k0; k < k0 + U8_BLOCK; k += 4) {
            _mm_prefetch((const char *)wg + 16 * k + U8_AHEAD, _MM_HINT_T1);
            const __m512i u = _mm512_loadu_si512(wg + 16 * k);
            for (int i = 0; i < mb; i++) {
                int32_t quad;
                memcpy(&quad, x + i * ldx + k, 4);
                DPBUSD(acc[i], u, _mm512_set1_epi32(quad));
            }
        }
        for (int i = 0; i < mb; i++)
            f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), _mm512_set1_ps(xs[i * nb + k0 / U8_BLOCK]), f[i]);
    }
    const __m512 sn = _mm512_loadu_ps(s + n);
    for (int i = 0; i < mb; i++)
        store(y, i * N + n, _mm512_mul_ps(_mm512_sub_ps(f[i], _mm512_set1_ps(corr[i])), sn), b ? b + n : 0, f32);
}

#define I8_STACK 32768  /* int8 inputs quantized on the stack; more are malloc'd */
#define Q4_SCALES_STACK 4096  /* floats of the q4 rows' scales and group sums kept on the stack */

/* `agentmem_gemv` for int8 weights packed by `pack_u8` (K a multiple of U8_BLOCK): the bf16
   input rows are quantized to int8 here, then every 32-output block runs them 8 at a time,
   one 16-output group after the other. */
__attribute__((target("avx512vnni")))
void agentmem_gemv_q8u8(const uint8_t *w, const float *scale, const uint16_t *x, int64_t ldx, void *y,
                        const float *b, int64_t M, int64_t N, int64_t K, int f32, int threads) {
    const int64_t nb = K / U8_BLOCK;
    int8_t stack[M * K <= I8_STACK ? M * K + 1 : 1] __attribute__((aligned(64)));
    int8_t *xq = M * K <= I8_STACK ? stack : (int8_t *)malloc((size_t)(M * K));
    float xs[M * nb > 0 ? M * nb : 1], corr[M > 0 ? M : 1];
    for (int64_t m = 0; m < M; m++) quantize_i8(x + m * ldx, K, xq + m * K, xs + m * nb, corr + m);
    const int64_t groups = N / 16;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            const int64_t left = M - m0, n = g * 16;
            char *ym = f32 ? (char *)y + m0 * N * 4 : (char *)y + m0 * N * 2;
            #define TILE(mb) tile_u8(w + g * 16 * K, K, xq + m0 * K, K, mb, ym, N, n, scale, xs + m0 * nb, corr + m0, b, f32)
            BY_ROWS(left, TILE)
            #undef TILE
        }
    }
    if (xq != stack) free(xq);
}

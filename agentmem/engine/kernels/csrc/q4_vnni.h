/* The group loop of the 4-bit products on AVX-512 (bf16/gemv_q4.c, and fp32/gemv_q4.c in its
   AVX-512 builds): one 16-output group of 4-bit weights against `mb` int8 rows, the fp32 sums per
   row left in f[] for the includer to store its own way. The includer may set Q4_GROUP, Q4_AHEAD
   and Q4_HINT, and Q4_STEP, Q4_WIDEN and Q4_TARGET for a build without VNNI, before it includes
   this. */
#ifndef AGENTMEM_Q4_VNNI_H
#define AGENTMEM_Q4_VNNI_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#ifndef Q4_GROUP
#define Q4_GROUP 32  /* inputs per d and m */
#endif
#define Q4_XBLOCK 64  /* inputs per step of the int8 rows */
#ifndef Q4_AHEAD  /* bytes of weights fetched ahead, and to where: 8 KB into L2 as the u8 tile's (U8_AHEAD) */
#define Q4_AHEAD 8192
#define Q4_HINT _MM_HINT_T1
#endif
#define Q4_DPBUSD(acc, u, x) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(x))
#ifndef Q4_STEP  /* a step's products (8 inputs of a row into acc) and a group's widening to int32 */
#define Q4_TARGET __attribute__((target("avx512vnni")))
#define Q4_STEP(acc, lo, hi, x0, x1) do { Q4_DPBUSD(acc, lo, x0); Q4_DPBUSD(acc, hi, x1); } while (0)
#define Q4_WIDEN(acc) (acc)
#endif

/* f[i] (1 <= mb <= 8) = sum over groups of d S + m X for int8 row i (x, rows ldx apart; xs its
   steps per Q4_XBLOCK, xsum its group sums) and the 16 outputs of `wg` ([K/8][16][4] bytes: a
   32-bit lane holds one output's inputs k..k+3 in its low nibbles, k+4..k+7 in its high ones)
   with `dmg` ([K/Q4_GROUP][2][16] fp16). q (0..15) is `vpdpbusd`'s unsigned operand as it is (an
   includer without VNNI defines Q4_STEP, Q4_WIDEN and Q4_TARGET its own way: the fp32
   library's `avx512bw` build). */
Q4_TARGET
static inline __attribute__((always_inline)) void q4_tile_sums(const uint8_t *wg, const uint16_t *dmg, int64_t K,
                                                               const int8_t *x, int64_t ldx, const int mb,
                                                               const float *xs, const float *xsum, __m512 *f) {
    const int64_t nb = K / Q4_XBLOCK, ng = K / Q4_GROUP;
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int i = 0; i < mb; i++) f[i] = _mm512_setzero_ps();
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += Q4_GROUP, g++) {
        __m512i acc[8];
        for (int i = 0; i < mb; i++) acc[i] = _mm512_setzero_si512();
        for (int64_t k = k0; k < k0 + Q4_GROUP; k += 8) {
            const uint8_t *p = wg + 8 * k;
            _mm_prefetch((const char *)p + Q4_AHEAD, Q4_HINT);
            const __m512i v = _mm512_loadu_si512(p);
            const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int i = 0; i < mb; i++) {
                int32_t q0, q1;
                memcpy(&q0, x + i * ldx + k, 4);
                memcpy(&q1, x + i * ldx + k + 4, 4);
                Q4_STEP(acc[i], lo, hi, _mm512_set1_epi32(q0), _mm512_set1_epi32(q1));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dmg + g * 32)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dmg + g * 32 + 16)));
        for (int i = 0; i < mb; i++) {
            const __m512 sx = _mm512_mul_ps(_mm512_cvtepi32_ps(Q4_WIDEN(acc[i])), _mm512_set1_ps(xs[i * nb + k0 / Q4_XBLOCK]));
            f[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[i * ng + g]), _mm512_fmadd_ps(sx, d, f[i]));
        }
    }
}
#endif

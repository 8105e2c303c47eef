/* 4-bit weights (llama.cpp's Q4_1 groups) against int8 rows (`vpdpbusd`, AVX512-VNNI): agentmem_gemv_q4u8.
   Follows gemv_q8u8.c in bf16.c (its quantize_i8, U8_BLOCK and stack sizes). */
#include "common.h"

/* 4-bit weights on AVX512-VNNI (`q4`, `AGENTMEM_WEIGHTS=int4`): the weights in groups of
   Q4_GROUP inputs, each group with an fp16 scale d and minimum m per output, w = d * q + m with q
   in 0..15: the layout of llama.cpp's Q4_1 blocks, so a model read from a Q4_1 GGUF keeps its
   own weights exactly (linear.py). q is the unsigned operand of `vpdpbusd` as it is (no offset),
   against the same int8 input rows as the u8 route (scales per U8_BLOCK). Packed [N/16][K/8][16][4]
   bytes: a 32-bit lane holds one output's inputs k..k+3 in its low nibbles and k+4..k+7 in its
   high ones, so one 64-byte load feeds two `vpdpbusd` after a mask and a shift; d and m
   [N/16][K/Q4_GROUP][2][16] fp16. Per group and row: sum_k (d q_k + m) x_k = d S + m X, with S the
   group's int32 sum and X = sum_k x_k (`quantize_q4`, once per row). Half the bytes of int8 for the
   same `vpdpbusd` count; the group's fp32 work (a convert and three FMAs a row) comes every 32
   inputs instead of 64. The group loop is `q4_tile_sums` (q4_vnni.h), shared with the fp32 library. */
#include "../q4_vnni.h"

/* Row x (bf16, K inputs) to int8 q as the u8 route quantizes it (steps xs per U8_BLOCK; its
   offset correction is not needed: q4 weights are unsigned as they are), and its group sums
   xsum[g] = xs[block of g] * (sum of the row's q in group g). */
__attribute__((target("avx512vnni")))
static void quantize_q4(const uint16_t *x, int64_t K, int8_t *q, float *xs, float *xsum) {
    float corr;
    quantize_i8(x, K, q, xs, &corr);
    for (int64_t g = 0; g < K / Q4_GROUP; g++) {
        int32_t t = 0;
        for (int64_t k = g * Q4_GROUP; k < (g + 1) * Q4_GROUP; k++) t += q[k];
        xsum[g] = xs[g * Q4_GROUP / U8_BLOCK] * (float)t;
    }
}

/* y for `mb` (1-8) int8 rows of a 16-output group (`q4_tile_sums`), stored as bf16 or fp32. */
__attribute__((target("avx512vnni")))
static inline __attribute__((always_inline)) void tile_q4(const uint8_t *wg, const uint16_t *dmg, int64_t K,
                                                          const int8_t *x, int64_t ldx, const int mb, void *y,
                                                          int64_t N, int64_t n, const float *xs, const float *xsum,
                                                          const float *b, int f32) {
    __m512 f[8];
    q4_tile_sums(wg, dmg, K, x, ldx, mb, xs, xsum, f);
    for (int i = 0; i < mb; i++) store(y, i * N + n, f[i], b ? b + n : 0, f32);
}

/* `agentmem_gemv_q8u8` for 4-bit weights packed by `pack_q4` (K a multiple of U8_BLOCK). */
__attribute__((target("avx512vnni")))
void agentmem_gemv_q4u8(const uint8_t *w, const uint16_t *dm, const uint16_t *x, int64_t ldx, void *y,
                        const float *b, int64_t M, int64_t N, int64_t K, int f32, int threads) {
    const int64_t nb = K / U8_BLOCK, ng = K / Q4_GROUP;
    int8_t stack[M * K <= I8_STACK ? M * K + 1 : 1] __attribute__((aligned(64)));
    int8_t *xq = M * K <= I8_STACK ? stack : (int8_t *)malloc((size_t)(M * K));
    /* the rows' scales and group sums: on the stack for decode rows, malloc'd for a prefill's */
    const int small = M * (nb + ng) <= Q4_SCALES_STACK;
    float scales[small ? M * (nb + ng) + 1 : 1];
    float *xs = small ? scales : (float *)malloc(sizeof(float) * (size_t)(M * (nb + ng))), *xsum = xs + M * nb;
    #pragma omp parallel for num_threads(threads) schedule(static) if (M >= 64)
    for (int64_t m = 0; m < M; m++) quantize_q4(x + m * ldx, K, xq + m * K, xs + m * nb, xsum + m * ng);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < N / 16; g++) {
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            const int64_t left = M - m0, n = g * 16;
            char *ym = f32 ? (char *)y + m0 * N * 4 : (char *)y + m0 * N * 2;
            #define TILE(mb) tile_q4(w + g * 8 * K, dm + g * K, K, xq + m0 * K, K, mb, ym, N, n, xs + m0 * nb, \
                                     xsum + m0 * ng, b, f32)
            BY_ROWS(left, TILE)
            #undef TILE
        }
    }
    if (xq != stack) free(xq);
    if (!small) free(xs);
}

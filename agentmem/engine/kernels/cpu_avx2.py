"""An int8-weight matrix-vector product for CPUs with AVX2 but no AVX-512: decode's weights
read at a quarter of fp32's bytes on the VMs where the engine runs fp32.

On an AVX2-only CPU the engine runs fp32 (bf16 products there are 8x slower), and a decode
step reads every fp32 weight once: 540 MB per token of SmolLM2-135M, so one stream is bound
by memory bandwidth. torch's own int8 product (`_weight_int8pack_mm`) reads a quarter of
that but runs no faster than fp32 on few rows here. This kernel takes the int8 weights in
`cpu_gemv.pack`'s layout ([N/16, K/2, 16, 2]: 32 bytes hold the input pair (k, k+1) for 16
outputs), quantizes each fp32 input row to int16 with its own scale (|x| <= 8191, as the
AVX-512 `i16` route does), sign-extends the weights to int16 in registers (`vpmovsxbw`) and
multiplies pairs into int32 sums with `vpmaddwd`, which matches the layout: a 32-bit lane
holds one output's input pair. Each 16-output group runs its input rows 4 at a time (8 int32
accumulators, 2 weight vectors and the broadcast pair fit AVX2's 16 registers); each chunk
of I16_CHUNK inputs goes to fp32 before the next, so no int32 sum can overflow.

4-bit weights (`AGENTMEM_WEIGHTS=int4`, `cpu_gemv.pack_q4`'s Q4_1 groups) have their own product
here (`gemv_q4`, and the same `q4` flag through the fused layer calls): the rows quantized to int8
per 64 inputs and multiplied with `vpmaddubsw` (see `tile_q4` in the source).

Where the CPU has AVX-512 but no AVX512-BF16 (the engine runs fp32 there too), the same source is
built with 512-bit tiles (`choose_tile`, `wide_tile`): `vnni512` on AVX512-VNNI (Cascade Lake, Ice
Lake), `avx512bw` on AVX-512 without VNNI (Skylake-SP): 16 outputs and 8 rows a tile, the same
integer sums and fp32 arithmetic, so the same bits as the AVX2 tiles.

Built once by the system's C compiler into the cache dir and loaded with ctypes
(`cpu_gemv.load_once`), as the AVX-512 library is; without AVX2/FMA or a compiler, `load`
returns None, says why, and int8 stays with torch's product.

The same library holds fp32 RMSNorm, RoPE, SiLU x up, the paged decode attention (over an
fp32 or an fp16 pool: `Engine.kv_dtype`), the causal attention of fp32 query rows (prefill chunks,
a blend's rows and its probe's key shares: `rows_attention`), a few fp32 rows on fp32 weights
(`gemm_f32`), and a decoder layer of decode rows as one call
(`layer_q8`) and every layer of a decode step as one call (`layers_q8`), built from the same
functions so that they give the separate calls' bits; their Python wrappers are `cpu_gemv`'s,
given this library's C functions and fp32.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

import torch

from ..measured import cpu_flags, remembered, simd_flags
from . import cpu_gemv

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define I16_MAX 8191
#define I16_CHUNK 2048  /* 127 * 8191 * 2048 < 2^31: a lane's int32 sum of a chunk cannot overflow */
#define AHEAD 1024      /* bytes of weights asked for ahead of the product (software prefetch) */
#define STACK 16384     /* int16 inputs quantized on the stack; more are malloc'd */

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

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
   q packed by cpu_gemv.pack (N a multiple of 16, K even), y fp32 [M, N]. The threads split
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

/* 4-bit weights (`cpu_gemv.pack_q4`'s layout, llama.cpp's Q4_1 groups: w = d q + m per Q4_GROUP
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
#define Q4_GROUP 32  /* as in cpu_gemv's Q4_VNNI_C, which the VNNI build includes below */
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
   inputs into each int32 lane), 8 rows a tile: cpu_gemv's group loop (`q4_tile_sums`). On
   AVX-512 without VNNI (`avx512bw`) the AVX2 tile's `vpmaddubsw` pair sums in int16, widened by
   one `vpmaddwd` a group, over all 16 outputs at once. The group sums are the same integers as
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
@Q4_VNNI@
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

/* fp32 weights as they are ([N, K], rows K apart) times a few fp32 rows: y[M, N] = x w^T (+ b), x rows
   ldx apart, N a multiple of 4 and K of 8. A tile is 4 outputs by up to 3 rows: 12 accumulators of
   8 products along K, summed across their lanes at the end; the 4 weight rows (9 KB at K = 1,536)
   stay in L1 while every row tile passes over them, so the weights stream from memory once. A row's
   sums do not depend on the other rows: the same bits at any M. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t ldx, const float *w, int64_t K,
                                                           const int mb, float *y, int64_t N, const float *b) {
    __m256 acc[3][4];
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + K + k);
        const __m256 w2 = _mm256_loadu_ps(w + 2 * K + k), w3 = _mm256_loadu_ps(w + 3 * K + k);
        for (int i = 0; i < mb; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
            acc[i][2] = _mm256_fmadd_ps(xv, w2, acc[i][2]);
            acc[i][3] = _mm256_fmadd_ps(xv, w3, acc[i][3]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < 4; j++) y[i * N + j] = hsum8(acc[i][j]) + (b ? b[j] : 0.0f);
}

void agentmem_avx2_gemm_f32(const float *x, int64_t ldx, const float *w, float *y, const float *b, int64_t M,
                            int64_t N, int64_t K, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 4)
        for (int64_t m0 = 0; m0 < M; m0 += 3) {
            const float *xm = x + m0 * ldx, *wn = w + n0 * K, *bn = b ? b + n0 : NULL;
            float *ym = y + m0 * N + n0;
            switch (M - m0 < 3 ? M - m0 : 3) {
                case 3: tile_f32(xm, ldx, wn, K, 3, ym, N, bn); break;
                case 2: tile_f32(xm, ldx, wn, K, 2, ym, N, bn); break;
                default: tile_f32(xm, ldx, wn, K, 1, ym, N, bn);
            }
        }
}

/* y = x w^T (+ b) for fp32 x [M, K] (rows ldx apart) and w held by `cpu_gemv.pack_q4` (N a multiple
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

/* RMSNorm of fp32 rows: y = x / sqrt(mean(x^2) + eps) * w (rows ldx apart, y contiguous). */
void agentmem_avx2_rms_norm_f32(const float *x, int64_t ldx, const float *w, float *y, int64_t M, int64_t D,
                                float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        float *ym = y + m * D;
        __m256 acc = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
            const __m256 v = _mm256_loadu_ps(xm + d);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum8(acc);
        for (; d < D; d++) ss += xm[d] * xm[d];
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        const __m256 rv = _mm256_set1_ps(r);
        for (d = 0; d + 8 <= D; d += 8)
            _mm256_storeu_ps(ym + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xm + d), rv), _mm256_loadu_ps(w + d)));
        for (; d < D; d++) ym[d] = xm[d] * r * w[d];
    }
}

/* RoPE of fp32 rows as `layers.rotate` computes it: y = x * cos + swap(x) * sin (swap exchanges
   the two halves of a head; the sin table is signed). x [N, heads, hd] with rows ldx apart and
   heads hd apart, cos/sin [N, hd], y [N, heads, hd] contiguous; hd a multiple of 16. */
void agentmem_avx2_rope_f32(const float *x, int64_t ldx, const float *cs, const float *sn, float *y, int64_t N,
                            int64_t heads, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t n = 0; n < N; n++) {
        const float *c = cs + n * hd, *s = sn + n * hd;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + n * ldx + h * hd;
            float *yr = y + (n * heads + h) * hd;
            for (int64_t d = 0; d < half; d += 8) {
                const __m256 a = _mm256_loadu_ps(xr + d), b = _mm256_loadu_ps(xr + half + d);
                _mm256_storeu_ps(yr + d, _mm256_fmadd_ps(b, _mm256_loadu_ps(s + d),
                                                         _mm256_mul_ps(a, _mm256_loadu_ps(c + d))));
                _mm256_storeu_ps(yr + half + d, _mm256_fmadd_ps(a, _mm256_loadu_ps(s + half + d),
                                                                _mm256_mul_ps(b, _mm256_loadu_ps(c + half + d))));
            }
        }
    }
}

/* e^x for 8 floats (x <= 0: scores minus their max): 2^n * p(r), r = x - n ln 2, p of degree 6;
   below -87 the result is 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* The sums of 8 vectors, as one vector (lane j: the sum of a[j]'s lanes). */
static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* One fp32 decode query per row over its keys read from the paged pool: q [B, H, hd], pools
   [slots, KV, hd], idx [B, W] flat slots, keep [B, W] which of them row b sees; out [B, H, hd]
   (zeros for a row that keeps no key). hd a multiple of 8, up to 256; any number of query
   heads per KV head. The design of `cpu_gemv`'s `agentmem_decode_attn_bf16` in AVX2: a row's
   keys are cut into chunks of `ch` (`da_chunk`: about four chunks a thread over all the rows,
   32 to DA_MAX keys), and each (row, chunk) item computes, for every head, the chunk's score
   maximum, its sum of exp(score - max) and the unnormalised sum of V (`da_item`); a merge
   rescales the chunks to the row's maximum (`da_merge`). Items are shared out as they come
   (dynamic, 1), the merge statically. So one row's long history is shared by all the threads
   (it used to be one task per (row, KV head): SmolLM2's 3 KV heads at one stream are 3 tasks
   for 2 threads), each item reads whole pool rows (all KV heads of a key) while they are in
   cache, the next 8 keys' K and V lines are prefetched while the scores of these are summed, the
   scores' maximum is taken 8 at a time (it was a scalar loop; a kept-key count not a multiple of
   8 is padded with the last key, scored -inf), and the weighted sum of V reads each key's V once
   for up to 4 heads, its accumulators in registers (`pv_heads`, unrolled per head count and
   width; at most 10 accumulators, as 3 heads x 24 dims: 3 x 32 spilled some of AVX2's 16
   registers and was 5-10% slower). With one chunk the result is that of a single softmax pass.
   Measured here on the AVX2 code path of the 2-core AMX Xeon VM (2 threads, SmolLM2's 9 heads
   of 64 over 3 KV, pools of 16,384 slots (12 MB each, in L3), rows of whole 16-slot blocks;
   us a call from Python with ctypes (~1 us of it), best of 5 x 200, two alternated runs):
   B=1 W=300 15-16 -> 11; B=1 W=2000 157-171 -> 52-71; B=8 W=100 27-28 -> 22; B=8 W=1000
   420-458 -> 289-319 (pools of 256 slots, in L2: 216 -> 166). Prefetching every other line
   (B=8 W=1000 ~10% slower), 16 keys ahead, whole pool rows at the first KV head, or chunks of at
   most 128 keys gained nothing. */
@DA_CHUNK@
#define DA_HB 16    /* query heads of a KV head scored together (the score buffer on the stack) */

/* 8 pool elements from element i of a pool of fp32 (H16 = 0) or fp16 (H16 = 1: F16C's vcvtph2ps)
   values. The pool functions below take H16 as a constant (inlined down from `da_item_f32` and
   `da_item_f16`), so each element type has its own code and no branch per load. */
static inline __attribute__((always_inline)) __m256 ld8(const void *pool, int64_t i, const int H16) {
    return H16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)pool + i)))
               : _mm256_loadu_ps((const float *)pool + i);
}

/* acc[g][d] += s[g][t] * v_t over the n keys, for GN heads (score rows ls apart) and ND x 8
   dims of V from `off` in each pool row (ldv elements); the sums go to o (heads ldo apart).
   Inlined with constant GN, ND: the accumulators stay in registers. */
static inline __attribute__((always_inline)) void pv_heads(const void *vp, const int64_t *slot, int64_t n,
                                                           int64_t ldv, int64_t off, const float *s, int64_t ls,
                                                           const int GN, const int ND, float *o, int64_t ldo,
                                                           const int H16) {
    __m256 acc[10];
    for (int i = 0; i < GN * ND; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const int64_t v = slot[t] * ldv + off;
        __m256 p[4];
        for (int g = 0; g < GN; g++) p[g] = _mm256_broadcast_ss(s + g * ls + t);
        for (int d = 0; d < ND; d++) {
            const __m256 vv = ld8(vp, v + 8 * d, H16);
            for (int g = 0; g < GN; g++) acc[g * ND + d] = _mm256_fmadd_ps(p[g], vv, acc[g * ND + d]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int d = 0; d < ND; d++) _mm256_storeu_ps(o + g * ldo + 8 * d, acc[g * ND + d]);
}

/* The widest pass of V (in 8-dim vectors) for gn heads: GN * ND <= 10 accumulators, the broadcast
   scores and one V vector in AVX2's 16 registers. */
static inline int pv_width(int gn) { return gn == 1 ? 8 : gn == 2 ? 5 : gn == 3 ? 3 : 2; }

static inline __attribute__((always_inline)) void pv_any(const void *vp, const int64_t *slot, int64_t n,
                                                         int64_t ldv, int64_t off, const float *s, int64_t ls, int gn,
                                                         int nd, float *o, int64_t ldo, const int H16) {
    #define PV(GN, ND) case GN * 16 + ND: pv_heads(vp, slot, n, ldv, off, s, ls, GN, ND, o, ldo, H16); break;
    switch (gn * 16 + nd) {
        PV(1, 1) PV(1, 2) PV(1, 3) PV(1, 4) PV(1, 5) PV(1, 6) PV(1, 7) PV(1, 8)
        PV(2, 1) PV(2, 2) PV(2, 3) PV(2, 4) PV(2, 5) PV(3, 1) PV(3, 2) PV(3, 3) PV(4, 1) PV(4, 2)
    }
    #undef PV
}

/* The scores of 8 keys (pool rows ldv elements apart, from `off`) against one query head qg of
   ND x 8 dims, times sc, into s[0..7]: one transposed sum of 8 dot products. */
static inline __attribute__((always_inline)) void scores8(const void *kp, const int64_t *slot, int64_t ldv,
                                                          int64_t off, const float *qg, const int64_t ND,
                                                          __m256 sc, float *s, const int H16) {
    int64_t k[8];
    for (int j = 0; j < 8; j++) k[j] = slot[j] * ldv + off;
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < ND; d++) {
        const __m256 qv = _mm256_loadu_ps(qg + 8 * d);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(ld8(kp, k[j] + 8 * d, H16), qv, a[j]);
    }
    _mm256_storeu_ps(s, _mm256_mul_ps(hsum8x8(a), sc));
}

static inline __attribute__((always_inline)) void scores_any(const void *kp, const int64_t *slot, int64_t ldv,
                                                             int64_t off, const float *qg, int64_t nd, __m256 sc,
                                                             float *s, const int H16) {
    switch (nd) {  /* SmolLM2's 64 dims and 128 unrolled; others by a loop */
        case 8: scores8(kp, slot, ldv, off, qg, 8, sc, s, H16); break;
        case 16: scores8(kp, slot, ldv, off, qg, 16, sc, s, H16); break;
        default: scores8(kp, slot, ldv, off, qg, nd, sc, s, H16); break;
    }
}

#ifdef AGENTMEM_AVX512
/* The same two steps 16 dims a vector, in the library built for AVX-512 (`vnni512`, `avx512bw`), for a head
   dimension that is a multiple of 16: a key's dot product takes half the instructions, and the
   weighted sum of V holds up to 4 heads x 64 dims in registers (16 of AVX-512's 32), one pass
   over the keys where AVX2 made three for SmolLM2's 3 heads of 64. Their sums run in another
   order than the AVX2 code's (16 lanes folded to 8), so the bits differ from that build's by
   rounding; within this build the fused layer and the separate calls agree as before. */
static inline __attribute__((always_inline)) __m512 ld16(const void *pool, int64_t i, const int H16) {
    return H16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + i)))
               : _mm512_loadu_ps((const float *)pool + i);
}

static inline __attribute__((always_inline)) __m256 fold16(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

static inline __attribute__((always_inline)) void scores8_16(const void *kp, const int64_t *slot, int64_t ldv,
                                                             int64_t off, const float *qg, const int64_t N16,
                                                             __m256 sc, float *s, const int H16) {
    int64_t k[8];
    for (int j = 0; j < 8; j++) k[j] = slot[j] * ldv + off;
    __m512 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < N16; d++) {
        const __m512 qv = _mm512_loadu_ps(qg + 16 * d);
        for (int j = 0; j < 8; j++) a[j] = _mm512_fmadd_ps(ld16(kp, k[j] + 16 * d, H16), qv, a[j]);
    }
    __m256 h[8];
    for (int j = 0; j < 8; j++) h[j] = fold16(a[j]);
    _mm256_storeu_ps(s, _mm256_mul_ps(hsum8x8(h), sc));
}

static inline __attribute__((always_inline)) void scores_any16(const void *kp, const int64_t *slot, int64_t ldv,
                                                               int64_t off, const float *qg, int64_t n16,
                                                               __m256 sc, float *s, const int H16) {
    switch (n16) {
        case 4: scores8_16(kp, slot, ldv, off, qg, 4, sc, s, H16); break;
        case 8: scores8_16(kp, slot, ldv, off, qg, 8, sc, s, H16); break;
        default: scores8_16(kp, slot, ldv, off, qg, n16, sc, s, H16); break;
    }
}

static inline __attribute__((always_inline)) void pv_heads16(const void *vp, const int64_t *slot, int64_t n,
                                                             int64_t ldv, int64_t off, const float *s, int64_t ls,
                                                             const int GN, const int ND, float *o, int64_t ldo,
                                                             const int H16) {
    __m512 acc[16];
    for (int i = 0; i < GN * ND; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const int64_t v = slot[t] * ldv + off;
        __m512 p[4];
        for (int g = 0; g < GN; g++) p[g] = _mm512_set1_ps(s[g * ls + t]);
        for (int d = 0; d < ND; d++) {
            const __m512 vv = ld16(vp, v + 16 * d, H16);
            for (int g = 0; g < GN; g++) acc[g * ND + d] = _mm512_fmadd_ps(p[g], vv, acc[g * ND + d]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int d = 0; d < ND; d++) _mm512_storeu_ps(o + g * ldo + 16 * d, acc[g * ND + d]);
}

#define PV16_WIDTH 4  /* 16-dim vectors a pass: 4 heads x 4 accumulators, 4 scores and one V in 32 registers */
static inline __attribute__((always_inline)) void pv_any16(const void *vp, const int64_t *slot, int64_t n,
                                                           int64_t ldv, int64_t off, const float *s, int64_t ls,
                                                           int gn, int nd, float *o, int64_t ldo, const int H16) {
    #define PV(GN, ND) case GN * 16 + ND: pv_heads16(vp, slot, n, ldv, off, s, ls, GN, ND, o, ldo, H16); break;
    switch (gn * 16 + nd) {
        PV(1, 1) PV(1, 2) PV(1, 3) PV(1, 4) PV(2, 1) PV(2, 2) PV(2, 3) PV(2, 4)
        PV(3, 1) PV(3, 2) PV(3, 3) PV(3, 4) PV(4, 1) PV(4, 2) PV(4, 3) PV(4, 4)
    }
    #undef PV
}
#endif

/* Item (b, c): row b's keys [c * ch, (c + 1) * ch) of W; per head h, part[h * (hd + 2)] holds the
   chunk's score maximum, its exp sum and its unnormalised V sum [hd] (sum 0: no key kept). The
   kept keys' slots are padded to a multiple of 8 with the last one, so every 8 keys are scored
   together; the padding's scores are set to -inf (exp 0) and the V sums stop at n. */
static inline __attribute__((always_inline)) void da_item(const float *q, int64_t ldq, const void *kp,
                                                          const void *vp, const int64_t *idx, const uint8_t *keep,
                                                          int64_t b, int64_t c, int64_t ch, int64_t H, int64_t KV,
                                                          int64_t hd, int64_t W, float scale, float *part,
                                                          const int H16) {
    const int64_t G = H / KV, lo = c * ch, hi = lo + ch < W ? lo + ch : W, ldv = KV * hd, ldp = hd + 2;
    const int64_t es = H16 ? 2 : 4, nd = hd / 8, lines = hd * es / 64 > 0 ? hd * es / 64 : 1;
    int64_t slot[DA_MAX + 8], n = 0;
    for (int64_t j = lo; j < hi; j++)
        if (keep[b * W + j]) slot[n++] = idx[b * W + j];
    if (n == 0) {
        for (int64_t h = 0; h < H; h++) part[h * ldp] = -INFINITY, part[h * ldp + 1] = 0.0f;
        return;
    }
    const int64_t n8 = (n + 7) / 8 * 8;  /* <= ch: ch is a multiple of 16 */
    for (int64_t j = n; j < n8; j++) slot[j] = slot[n - 1];
    const int64_t hb = G < DA_HB ? G : DA_HB;
    float s[hb * ch + 8];
    const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t kvh = 0; kvh < KV; kvh++)
        for (int64_t g0 = 0; g0 < G; g0 += hb) {
            const int64_t gb = G - g0 < hb ? G - g0 : hb, h0 = kvh * G + g0;
            const float *qg = q + b * ldq + h0 * hd;
            for (int64_t t0 = 0; t0 < n8; t0 += 8) {
                if (g0 == 0)
                    for (int64_t j = t0 + 8; j < t0 + 16 && j < n; j++)  /* the next keys, while these are summed */
                        for (int64_t l = 0; l < lines; l++) {
                            _mm_prefetch((const char *)kp + (slot[j] * ldv + kvh * hd) * es + 64 * l, _MM_HINT_T0);
                            _mm_prefetch((const char *)vp + (slot[j] * ldv + kvh * hd) * es + 64 * l, _MM_HINT_T0);
                        }
#ifdef AGENTMEM_AVX512
                if (hd % 16 == 0) {
                    for (int64_t g = 0; g < gb; g++)
                        scores_any16(kp, slot + t0, ldv, kvh * hd, qg + g * hd, hd / 16, sc, s + g * ch + t0, H16);
                    continue;
                }
#endif
                for (int64_t g = 0; g < gb; g++) scores_any(kp, slot + t0, ldv, kvh * hd, qg + g * hd, nd, sc, s + g * ch + t0, H16);
            }
            for (int64_t g = 0; g < gb; g++) {  /* softmax numerators in place, their maximum and sum */
                float *sg = s + g * ch, *p = part + (h0 + g) * ldp;
                for (int64_t t = n; t < n8; t++) sg[t] = -INFINITY;
                __m256 mx = ninf;
                for (int64_t t = 0; t < n8; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + t));
                const float m = hmax8(mx);
                const __m256 mv = _mm256_set1_ps(m);
                __m256 acc = _mm256_setzero_ps();
                for (int64_t t = 0; t < n8; t += 8) {
                    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
                    _mm256_storeu_ps(sg + t, e);
                    acc = _mm256_add_ps(acc, e);
                }
                p[0] = m;
                p[1] = hsum8(acc);
            }
            for (int64_t i = 0; i < gb;) {  /* the weighted sum of V: up to 4 heads a pass over the keys */
                const int64_t left = gb - i, gn = left <= 4 ? left : left == 5 || left == 6 ? 3 : 4;
#ifdef AGENTMEM_AVX512
                if (hd % 16 == 0) {
                    const int64_t n16 = hd / 16;
                    for (int64_t d0 = 0; d0 < n16; d0 += PV16_WIDTH)
                        pv_any16(vp, slot, n, ldv, kvh * hd + 16 * d0, s + i * ch, ch, (int)gn,
                                 (int)(n16 - d0 < PV16_WIDTH ? n16 - d0 : PV16_WIDTH), part + (h0 + i) * ldp + 2 + 16 * d0,
                                 ldp, H16);
                    i += gn;
                    continue;
                }
#endif
                const int64_t w = pv_width((int)gn);
                for (int64_t d0 = 0; d0 < nd; d0 += w)
                    pv_any(vp, slot, n, ldv, kvh * hd + 8 * d0, s + i * ch, ch, (int)gn,
                           (int)(nd - d0 < w ? nd - d0 : w), part + (h0 + i) * ldp + 2 + 8 * d0, ldp, H16);
                i += gn;
            }
        }
}

static void da_item_f32(const float *q, int64_t ldq, const void *kp, const void *vp, const int64_t *idx,
                       const uint8_t *keep, int64_t b, int64_t c, int64_t ch, int64_t H, int64_t KV, int64_t hd,
                       int64_t W, float scale, float *part) {
    da_item(q, ldq, kp, vp, idx, keep, b, c, ch, H, KV, hd, W, scale, part, 0);
}

static void da_item_f16(const float *q, int64_t ldq, const void *kp, const void *vp, const int64_t *idx,
                       const uint8_t *keep, int64_t b, int64_t c, int64_t ch, int64_t H, int64_t KV, int64_t hd,
                       int64_t W, float scale, float *part) {
    da_item(q, ldq, kp, vp, idx, keep, b, c, ch, H, KV, hd, W, scale, part, 1);
}

/* out[b, h] from row b's nc chunk items: each chunk's sums rescaled to the row's maximum. */
static void da_merge(const float *part, int64_t nc, int64_t H, int64_t hd, int64_t b, int64_t h, float *out,
                     int64_t ldo) {
    const int64_t ldp = hd + 2, nd = hd / 8;
    float w[nc + 1];
    da_weights(part, nc, H, ldp, b, h, w);
    __m256 o[32];
    for (int64_t d = 0; d < nd; d++) o[d] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        if (w[c] == 0.0f) continue;
        const float *p = part + ((b * nc + c) * H + h) * ldp;
        const __m256 wv = _mm256_set1_ps(w[c]);
        for (int64_t d = 0; d < nd; d++) o[d] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(p + 2 + 8 * d), o[d]);
    }
    float *oh = out + b * ldo + h * hd;
    for (int64_t d = 0; d < nd; d++) _mm256_storeu_ps(oh + 8 * d, o[d]);
}

/* For the calling team: the decode attention of B query rows (q: rows ldq apart, heads hd apart)
   into out (rows ldo apart), chunks of ch keys, part: B * nc * H * (hd + 2) floats. */
static void team_decode_attn(const float *q, int64_t ldq, const void *kp, const void *vp, const int64_t *idx,
                             const uint8_t *keep, float *out, int64_t ldo, int64_t B, int64_t H, int64_t KV,
                             int64_t hd, int64_t W, float scale, int64_t ch, float *part, int h16) {
    const int64_t nc = (W + ch - 1) / ch;
    void (*item)(const float *, int64_t, const void *, const void *, const int64_t *, const uint8_t *, int64_t,
                 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float *) = h16 ? da_item_f16 : da_item_f32;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < B * nc; it++)
        item(q, ldq, kp, vp, idx, keep, it / nc, it % nc, ch, H, KV, hd, W, scale, part + it * H * (hd + 2));
    #pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) da_merge(part, nc, H, hd, bh / H, bh % H, out, ldo);
}

static float *da_part(int64_t B, int64_t W, int64_t H, int64_t hd, int64_t ch) {
    return (float *)malloc(sizeof(float) * (size_t)(B * ((W + ch - 1) / ch) * H * (hd + 2) + 1));
}

static void decode_attn(const float *q, const void *kp, const void *vp, const int64_t *idx, const uint8_t *keep,
                        float *out, int64_t B, int64_t H, int64_t KV, int64_t hd, int64_t W, float scale, int threads,
                        int h16) {
    if (B <= 0) return;
    const int64_t ch = da_chunk(B, W, threads);
    float *part = da_part(B, W, H, hd, ch);
    #pragma omp parallel num_threads(threads)
    team_decode_attn(q, H * hd, kp, vp, idx, keep, out, H * hd, B, H, KV, hd, W, scale, ch, part, h16);
    free(part);
}

void agentmem_avx2_decode_attn_f32(const float *q, const float *kp, const float *vp, const int64_t *idx,
                                   const uint8_t *keep, float *out, int64_t B, int64_t H, int64_t KV, int64_t hd,
                                   int64_t W, float scale, int threads) {
    decode_attn(q, kp, vp, idx, keep, out, B, H, KV, hd, W, scale, threads, 0);
}

/* The same over an fp16 pool (fp32 queries and output): half the bytes of K and V read a step. */
void agentmem_avx2_decode_attn_f16kv(const float *q, const uint16_t *kp, const uint16_t *vp, const int64_t *idx,
                                     const uint8_t *keep, float *out, int64_t B, int64_t H, int64_t KV, int64_t hd,
                                     int64_t W, float scale, int threads) {
    decode_attn(q, kp, vp, idx, keep, out, B, H, KV, hd, W, scale, threads, 1);
}

/* n fp32 values to fp16 (round to nearest even, as torch's .to(float16) rounds); n a multiple of 8. */
static void to_f16(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
}

/* silu(gate) * up of one row gu = [gate (I), up (I)] into y [I]: silu(x) = x * sigmoid(x),
   sigmoid from t = e^-|x| (exp8 of a non-positive argument): 1 / (1 + t) for x >= 0, t / (1 + t)
   below. */
static void silu_mul_row(const float *gu, int64_t I, float *y) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
        const __m256 x = _mm256_loadu_ps(gu + i);
        const __m256 t = exp8(_mm256_or_ps(x, sign));  /* e^-|x| */
        const __m256 num = _mm256_blendv_ps(one, t, x);  /* sign bit of x set: t */
        const __m256 sg = _mm256_div_ps(num, _mm256_add_ps(one, t));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(x, sg), _mm256_loadu_ps(gu + I + i)));
    }
    for (; i < I; i++) y[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[I + i];
}

/* silu(g) * u of fp32 rows gu [N, 2I] (rows ld apart) into y [N, I]: `silu_mul_row` a row, rows
   shared by the threads past 16 (Block.finish's fp32 rows, so that the fused layer below and the
   separate calls compute the same bits). */
void agentmem_avx2_silu_mul_f32(const float *gu, int64_t ld, float *y, int64_t N, int64_t I) {
    #pragma omp parallel for if (N > 16) schedule(static)
    for (int64_t n = 0; n < N; n++) silu_mul_row(gu + n * ld, I, y + n * I);
}

/* Scratch of the layer functions below for M rows: quantized rows and their steps, the fp32
   intermediates, and the attention's chunk sums (da_part, chunks of ch keys). Allocated once a
   call: `agentmem_avx2_layers_q8` shares it across its layers. */
typedef struct {
    int16_t *xq;
    int8_t *xq8;  /* the q4 products' int8 rows, their steps and group sums */
    float *xs, *xs8, *xsum, *nx, *qkv, *qk, *attn, *h2, *gu, *part;
    int64_t ch;
} LayerScratch;

static LayerScratch layer_scratch(int64_t M, int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t I, int64_t W,
                                  int threads) {
    const int64_t QK = H + KV, NQKV = (QK + KV) * hd, HD = H * hd;
    const int64_t K = D > HD ? (D > I ? D : I) : (HD > I ? HD : I);
    LayerScratch t;
    t.xq = (int16_t *)aligned_alloc(32, (size_t)((M * K * 2 + 31) / 32 * 32));
    t.xs = (float *)malloc(sizeof(float) * (size_t)M);
    t.xq8 = (int8_t *)malloc((size_t)(M * K) + 32);
    t.xs8 = (float *)malloc(sizeof(float) * (size_t)(M * (K / Q8_BLOCK) + 1));
    t.xsum = (float *)malloc(sizeof(float) * (size_t)(M * (K / Q4_GROUP) + 1));
    t.nx = (float *)malloc(sizeof(float) * (size_t)(M * D));
    t.qkv = (float *)malloc(sizeof(float) * (size_t)(M * NQKV));
    t.qk = (float *)malloc(sizeof(float) * (size_t)(M * QK * hd));
    t.attn = (float *)malloc(sizeof(float) * (size_t)(M * HD));
    t.h2 = (float *)malloc(sizeof(float) * (size_t)(M * D));
    t.gu = (float *)malloc(sizeof(float) * (size_t)(M * 2 * I));
    t.ch = da_chunk(M, W, threads);
    t.part = da_part(M, W, H, hd, t.ch);
    return t;
}

static void layer_scratch_free(LayerScratch *t) {
    free(t->part); free(t->gu); free(t->h2); free(t->attn); free(t->qk); free(t->qkv); free(t->nx); free(t->xs);
    free(t->xq); free(t->xq8); free(t->xs8); free(t->xsum);
}

/* Row m of x (K inputs) quantized for the layer's products: int16 for int8 weights, int8 in
   blocks for 4-bit ones (`q4`). */
static inline void quant_row(int q4, const float *x, int64_t K, int64_t m, const LayerScratch *t) {
    if (q4) quantize8(x, K, t->xq8 + m * K, t->xs8 + m * (K / Q8_BLOCK), t->xsum + m * (K / Q4_GROUP));
    else quantize(x, K, t->xq + m * K, t->xs + m);
}

/* For the calling team: one of the layer's products of the rows `quant_row` made (w, s: int8
   weights and their fp32 scales, or with `q4` 4-bit ones and their fp16 d and m). */
static void team_product(int q4, const void *w, const void *s, float *y, const float *b, const float *r, int64_t M,
                         int64_t N, int64_t K, const LayerScratch *t) {
    if (q4) team_groups_q4((const uint8_t *)w, (const uint16_t *)s, t->xq8, t->xs8, t->xsum, y, b, r, M, N, K);
    else team_groups((const int8_t *)w, (const float *)s, t->xq, t->xs, y, b, r, M, N, K);
}

/* For the calling team: one decoder layer of M decode rows (`agentmem_avx2_layer_q8` says what). */
static void team_layer(const float *h, float *out, const float *nw1, const float *nw2, float eps,
                       const void *wqkv, const void *sqkv, const float *bqkv, const float *cs, const float *sn,
                       void *kp, void *vp, int h16, const int64_t *wslot, const int64_t *idx, const uint8_t *keep,
                       int64_t W, float scale, const void *wo, const void *so, const float *bo,
                       const void *wgu, const void *sgu, const void *wd, const void *sd, int64_t M,
                       int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t I, int q4, const LayerScratch *t) {
    const int64_t QK = H + KV, NQKV = (QK + KV) * hd, HD = H * hd, row = KV * hd;
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        agentmem_avx2_rms_norm_f32(h + m * D, D, nw1, t->nx + m * D, 1, D, eps);
        quant_row(q4, t->nx + m * D, D, m, t);
    }
    team_product(q4, wqkv, sqkv, t->qkv, bqkv, NULL, M, NQKV, D, t);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *qkv = t->qkv + m * NQKV;
        float *qk = t->qk + m * QK * hd;
        agentmem_avx2_rope_f32(qkv, NQKV, cs + m * hd, sn + m * hd, qk, 1, QK, hd);
        if (h16) {
            to_f16(qk + HD, (uint16_t *)kp + wslot[m] * row, row);
            to_f16(qkv + QK * hd, (uint16_t *)vp + wslot[m] * row, row);
        } else {
            memcpy((float *)kp + wslot[m] * row, qk + HD, sizeof(float) * (size_t)row);
            memcpy((float *)vp + wslot[m] * row, qkv + QK * hd, sizeof(float) * (size_t)row);
        }
    }
    team_decode_attn(t->qk, QK * hd, kp, vp, idx, keep, t->attn, HD, M, H, KV, hd, W, scale, t->ch, t->part, h16);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) quant_row(q4, t->attn + m * HD, HD, m, t);
    team_product(q4, wo, so, t->h2, bo, h, M, D, HD, t);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        agentmem_avx2_rms_norm_f32(t->h2 + m * D, D, nw2, t->nx + m * D, 1, D, eps);
        quant_row(q4, t->nx + m * D, D, m, t);
    }
    team_product(q4, wgu, sgu, t->gu, NULL, NULL, M, 2 * I, D, t);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        float *gu = t->gu + m * 2 * I;
        silu_mul_row(gu, I, gu);  /* in place: y[i..i+8) is written after gu[i..i+8) and gu[I+i..) are read */
        quant_row(q4, gu, I, m, t);
    }
    team_product(q4, wd, sd, out, NULL, t->h2, M, D, I, t);  /* ends in the team's barrier */
}

/* A whole decoder layer for M decode rows (one query each) of fp32 hidden states h [M, D], every
   product int8 on this kernel (packed by cpu_gemv.pack, fp32 scales, optional fp32 biases of qkv
   and o), in one call and one team of threads instead of about fifteen calls and five teams:
     rows normed (nw1) and quantized; qkv = wqkv(.) (+ bqkv) [M, (H + 2 KV) hd];
     q and k heads rotated (tables cs/sn [M, hd]) into qk; the row's rotated k and its v written
       to this layer's pool (kp/vp [slots, KV, hd], fp32, or fp16 where h16) at wslot[m];
     the decode attention of each row over its keys (idx/keep [M, W], as the call above);
     h2 = h + o(attn) (+ bo); rows of h2 normed (nw2); gu = wgu(.); out = h2 + down(silu(gate) * up).
   The same arithmetic as the separate calls (each step's rounding included), in another order
   of threads only where the separate calls also split work. */
void agentmem_avx2_layer_q8(const float *h, float *out, const float *nw1, const float *nw2, float eps,
                            const void *wqkv, const void *sqkv, const float *bqkv, const float *cs, const float *sn,
                            void *kp, void *vp, int h16, const int64_t *wslot, const int64_t *idx, const uint8_t *keep,
                            int64_t W, float scale, const void *wo, const void *so, const float *bo,
                            const void *wgu, const void *sgu, const void *wd, const void *sd, int64_t M,
                            int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t I, int q4, int threads) {
    LayerScratch t = layer_scratch(M, D, H, KV, hd, I, W, threads);
    #pragma omp parallel num_threads(threads)
    team_layer(h, out, nw1, nw2, eps, wqkv, sqkv, bqkv, cs, sn, kp, vp, h16, wslot, idx, keep, W, scale, wo, so, bo,
               wgu, sgu, wd, sd, M, D, H, KV, hd, I, q4, &t);
    layer_scratch_free(&t);
}

/* Every layer of a decode step in one call and one team of threads: `team_layer` for layers
   0..L-1 in turn (the scratch allocated once), each from the last one's output (two rows of
   buffers ping-pong; the last layer writes out). Layer l's weights are w[l * LAYER_PTRS + j] in
   the order of `agentmem_avx2_layer_q8`'s arguments (nw1, nw2, wqkv, sqkv, bqkv, wo, so, bo,
   wgu, sgu, wd, sd; a bias may be NULL), its pool K/V at kp/vp + l * pstride elements (fp16
   where h16). */
#define LAYER_PTRS 12
void agentmem_avx2_layers_q8(const float *h, float *out, int64_t L, void *const *w, float eps, const float *cs,
                             const float *sn, void *kp, void *vp, int64_t pstride, int h16, const int64_t *wslot,
                             const int64_t *idx, const uint8_t *keep, int64_t W, float scale, int64_t M, int64_t D,
                             int64_t H, int64_t KV, int64_t hd, int64_t I, int q4, int threads) {
    LayerScratch t = layer_scratch(M, D, H, KV, hd, I, W, threads);
    float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * M * D));
    const int64_t es = h16 ? 2 : 4;
    #pragma omp parallel num_threads(threads)
    for (int64_t l = 0; l < L; l++) {  /* every thread walks the same layers; team_layer's barriers order them */
        void *const *p = w + l * LAYER_PTRS;
        const float *x = l == 0 ? h : buf + ((l - 1) & 1) * M * D;
        float *y = l == L - 1 ? out : buf + (l & 1) * M * D;
        team_layer(x, y, p[0], p[1], eps, p[2], p[3], p[4], cs, sn, (char *)kp + l * pstride * es,
                   (char *)vp + l * pstride * es, h16, wslot, idx, keep, W, scale, p[5], p[6], p[7], p[8], p[9],
                   p[10], p[11], M, D, H, KV, hd, I, q4, &t);
    }
    free(buf);
    layer_scratch_free(&t);
}

/* Causal attention of fp32 query rows over a whole fp32 K/V (prefill chunks, CacheBlend's
   recomputed rows), on AVX-512 (`vnni512` and `avx512bw` builds) and on AVX2 (below): out[i, h] =
   softmax over keys j <= qpos[i] of (q[i, h] . k[j, h / G] * scale), times V. q/out [Nq, H, hd], qpos int64 [Nq] ascending, k/v [T, KV, hd] at positions
   0..T-1, hd a multiple of 16 up to 256. K is packed per KV head as [T16/16, hd, 16] (16 keys in
   the lanes of one vector), so the scores of 32 keys and 8 query rows are 16 accumulators fed by two
   K loads and 8 broadcast FMAs a dim, with no horizontal sums; each task (KV head, query head, 8
   rows) sees only the keys up to its last row (rows ascend) and takes an exact two-pass softmax in
   fp32; P V runs the 8 rows and 32 dims a pass over V, each V row loaded once for them. Returns 1
   where it ran. */
#ifdef AGENTMEM_AVX512
/* P V of `n4` (1-8) rows (p: their softmax numerators, ldp apart; inv: 1 / their sums) over keys
   0..kmax-1 for ND (1-2, a constant: the accumulators stay in registers) 16-dim vectors of V (v: key
   0's, keys ldv apart) into out (rows ldo apart). */
static inline __attribute__((always_inline)) void ra_pv(const float *v, int64_t ldv, const float *p, int64_t ldp,
                                                        int64_t kmax, const int n4, const float *inv, float *out,
                                                        int64_t ldo, const int ND) {
    __m512 o[8][2];
    for (int r = 0; r < 8; r++)
        for (int d = 0; d < ND; d++) o[r][d] = _mm512_setzero_ps();
    for (int64_t t = 0; t < kmax; t++) {
        __m512 vv[2];
        for (int d = 0; d < ND; d++) vv[d] = _mm512_loadu_ps(v + t * ldv + 16 * d);
        for (int r = 0; r < n4; r++) {
            const __m512 pr = _mm512_set1_ps(p[r * ldp + t]);
            for (int d = 0; d < ND; d++) o[r][d] = _mm512_fmadd_ps(pr, vv[d], o[r][d]);
        }
    }
    for (int r = 0; r < n4; r++) {
        const __m512 iv = _mm512_set1_ps(inv[r]);
        for (int d = 0; d < ND; d++) _mm512_storeu_ps(out + r * ldo + 16 * d, _mm512_mul_ps(o[r][d], iv));
    }
}
#endif

/* A row of `nk` scores (nk a multiple of 8, 32-byte aligned; masked keys -inf) to its softmax
   numerators in place, exp(s - max); returns 1 / their sum. */
static inline float softmax_numerators(float *sr, int64_t nk) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < nk; t += 8) mx = _mm256_max_ps(mx, _mm256_load_ps(sr + t));
    const __m256 m8 = _mm256_set1_ps(hmax8(mx));
    __m256 acc = _mm256_setzero_ps();
    for (int64_t t = 0; t < nk; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(sr + t), m8));
        _mm256_store_ps(sr + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    return 1.0f / hsum8(acc);
}

/* The rows kernel's packed K: a buffer kept by the calling thread and grown as needed (a fresh
   1.5 MB for 2k keys each call cost its page faults and unmapping at every layer); NULL where it
   cannot be had. */
static float *packed_k_buffer(size_t floats) {
    static __thread float *buf = NULL;
    static __thread size_t cap = 0;
    if (floats > cap) {
        free(buf);
        buf = (float *)aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
        cap = buf ? floats : 0;
    }
    return buf;
}

int agentmem_avx2_rows_attn_f32(const float *q, const int64_t *qpos, const float *k, const float *v, float *out,
                                int64_t Nq, int64_t H, int64_t KV, int64_t hd, int64_t T, float scale, int threads,
                                float *share) {
#ifdef AGENTMEM_AVX512
    if (share) return 0;  /* each key's share: the AVX2 build's (the caller computes it with torch) */
    if (Nq <= 0 || T <= 0) return 1;
    if (hd % 16 || hd > 256 || H % KV) return 0;
    /* only the keys the last row sees are read */
    if (qpos[Nq - 1] + 1 < T) T = qpos[Nq - 1] + 1;
    const int64_t G = H / KV, T16 = (T + 15) / 16 * 16, nblk = T16 / 16, nd = hd / 16;
    float *kpk = packed_k_buffer((size_t)KV * T16 * hd);
    if (!kpk) return 0;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < KV * nblk; blk++) {  /* pack K, zero past T: 16 keys x 16 dims at a time */
        const int64_t kvh = blk / nblk, b = blk % nblk;
        float *kd = kpk + (kvh * nblk + b) * hd * 16;
        for (int64_t d0 = 0; d0 < hd; d0 += 16) {
            float tile[16][16] __attribute__((aligned(64)));
            for (int64_t t = 0; t < 16; t++) {
                const int64_t j = b * 16 + t;
                _mm512_store_ps(tile[t], j < T ? _mm512_loadu_ps(k + (j * KV + kvh) * hd + d0) : _mm512_setzero_ps());
            }
            for (int64_t d = 0; d < 16; d++) {
                const __m512i col = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
                _mm512_store_ps(kd + (d0 + d) * 16, _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32((int)d)), &tile[0][0], 4));
            }
        }
    }
    const int64_t nb = (Nq + 7) / 8;
    #pragma omp parallel num_threads(threads)
    {
        float *sbuf = (float *)aligned_alloc(64, (size_t)8 * T16 * 4);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < KV * G * nb; task++) {
            const int64_t rb = nb - 1 - task / (KV * G), kvh = (task % (KV * G)) / G, g = task % G;
            const int64_t r0 = rb * 8, nr = Nq - r0 < 8 ? Nq - r0 : 8, h = kvh * G + g;
            int64_t lim[8];
            const float *qr[8];
            for (int64_t r = 0; r < 8; r++) {
                const int64_t i = r0 + (r < nr ? r : nr - 1);
                lim[r] = qpos[i] + 1 < T ? qpos[i] + 1 : T;
                qr[r] = q + (i * H + h) * hd;
            }
            const int64_t nk = (lim[nr - 1] + 15) / 16 * 16;
            const float *kh = kpk + kvh * nblk * hd * 16;
            const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
            const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            for (int64_t t0 = 0; t0 < nk; t0 += 32) {  /* scores of 32 keys (16 at the end) for the 8 rows */
                const int two = t0 + 16 < nk;
                __m512 a[8], b[8];
                for (int r = 0; r < 8; r++) a[r] = b[r] = _mm512_setzero_ps();
                const float *kb = kh + (t0 / 16) * hd * 16;
                if (two)
                    for (int64_t d = 0; d < hd; d++) {
                        const __m512 k0 = _mm512_load_ps(kb + d * 16), k1 = _mm512_load_ps(kb + hd * 16 + d * 16);
                        for (int r = 0; r < 8; r++) {
                            const __m512 x = _mm512_set1_ps(qr[r][d]);
                            a[r] = _mm512_fmadd_ps(x, k0, a[r]);
                            b[r] = _mm512_fmadd_ps(x, k1, b[r]);
                        }
                    }
                else
                    for (int64_t d = 0; d < hd; d++) {
                        const __m512 k0 = _mm512_load_ps(kb + d * 16);
                        for (int r = 0; r < 8; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), k0, a[r]);
                    }
                const __m512i kpos = _mm512_add_epi32(lane, _mm512_set1_epi32((int)t0));
                const __m512i kpos1 = _mm512_add_epi32(kpos, _mm512_set1_epi32(16));
                for (int r = 0; r < 8; r++) {
                    const __m512i lr = _mm512_set1_epi32((int)lim[r]);
                    _mm512_store_ps(sbuf + r * T16 + t0, _mm512_mask_mul_ps(ninf, _mm512_cmplt_epi32_mask(kpos, lr), a[r], sc));
                    if (two)
                        _mm512_store_ps(sbuf + r * T16 + t0 + 16,
                                        _mm512_mask_mul_ps(ninf, _mm512_cmplt_epi32_mask(kpos1, lr), b[r], sc));
                }
            }
            float inv[8];
            for (int64_t r = 0; r < nr; r++) inv[r] = softmax_numerators(sbuf + r * T16, nk);
            for (int64_t d0 = 0; d0 < nd; d0 += 2) {  /* P V, the 8 rows and 32 dims a pass over V */
                const float *vb = v + kvh * hd + 16 * d0;
                float *ob = out + r0 * H * hd + h * hd + 16 * d0;
                if (nd - d0 >= 2 && nr == 8) ra_pv(vb, KV * hd, sbuf, T16, lim[7], 8, inv, ob, H * hd, 2);
                else if (nd - d0 >= 2) ra_pv(vb, KV * hd, sbuf, T16, lim[nr - 1], (int)nr, inv, ob, H * hd, 2);
                else ra_pv(vb, KV * hd, sbuf, T16, lim[nr - 1], (int)nr, inv, ob, H * hd, 1);
            }
        }
        free(sbuf);
    }
    return 1;
#else
    /* AVX2: the same two-pass softmax with 8 keys in a vector. K is packed per KV head as [T8/8, hd,
       8]; the scores of 16 keys and 4 query rows are 8 accumulators fed by two K loads and 4
       broadcast FMAs a dim. A task is 8 rows of one KV head with all its query heads, each 4 rows
       in turn over the same 16 keys (in L1); P V runs 4 rows and 16 dims a pass over V. */
    if (Nq <= 0 || T <= 0) return 1;
    if (hd % 16 || hd > 256 || H % KV) return 0;
    if (qpos[Nq - 1] + 1 < T) T = qpos[Nq - 1] + 1;
    const int64_t G = H / KV, T8 = (T + 7) / 8 * 8, nblk = T8 / 8;
    float *kpk = packed_k_buffer((size_t)KV * T8 * hd);
    if (!kpk) return 0;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < KV * nblk; blk++) {  /* pack K, zero past T: an 8 x 8 transpose at a time */
        const int64_t kvh = blk / nblk, b = blk % nblk;
        float *kd = kpk + (kvh * nblk + b) * hd * 8;
        for (int64_t d0 = 0; d0 < hd; d0 += 8) {
            __m256 r[8];
            for (int t = 0; t < 8; t++) {
                const int64_t j = b * 8 + t;
                r[t] = j < T ? _mm256_loadu_ps(k + (j * KV + kvh) * hd + d0) : _mm256_setzero_ps();
            }
            const __m256 a0 = _mm256_unpacklo_ps(r[0], r[1]), a1 = _mm256_unpackhi_ps(r[0], r[1]);
            const __m256 a2 = _mm256_unpacklo_ps(r[2], r[3]), a3 = _mm256_unpackhi_ps(r[2], r[3]);
            const __m256 a4 = _mm256_unpacklo_ps(r[4], r[5]), a5 = _mm256_unpackhi_ps(r[4], r[5]);
            const __m256 a6 = _mm256_unpacklo_ps(r[6], r[7]), a7 = _mm256_unpackhi_ps(r[6], r[7]);
            const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
            const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
            const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
            const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
            float *o = kd + d0 * 8;
            _mm256_store_ps(o + 0, _mm256_permute2f128_ps(b0, b4, 0x20));
            _mm256_store_ps(o + 8, _mm256_permute2f128_ps(b1, b5, 0x20));
            _mm256_store_ps(o + 16, _mm256_permute2f128_ps(b2, b6, 0x20));
            _mm256_store_ps(o + 24, _mm256_permute2f128_ps(b3, b7, 0x20));
            _mm256_store_ps(o + 32, _mm256_permute2f128_ps(b0, b4, 0x31));
            _mm256_store_ps(o + 40, _mm256_permute2f128_ps(b1, b5, 0x31));
            _mm256_store_ps(o + 48, _mm256_permute2f128_ps(b2, b6, 0x31));
            _mm256_store_ps(o + 56, _mm256_permute2f128_ps(b3, b7, 0x31));
        }
    }
    const int64_t nb = (Nq + 7) / 8, T16 = (T8 + 15) / 16 * 16;
    /* with `share`: what each key adds to the rows' outputs (the blend's probe), the attention paid
       to it times its value's norm, summed over rows and heads, added into share[0..T-1]; each
       thread sums its tasks' into its own row of `part`, added up after */
    float *vnorm = NULL, *part = NULL;
    if (share) {
        vnorm = (float *)aligned_alloc(32, (size_t)KV * T16 * 4);
        part = (float *)aligned_alloc(32, (size_t)threads * T16 * 4);
        if (!vnorm || !part) { free(vnorm); free(part); return 0; }
        memset(part, 0, (size_t)threads * T16 * 4);
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < T16; t++)  /* each key's value norm per KV head, 8 dims a step */
            for (int64_t kvh = 0; kvh < KV; kvh++) {
                __m256 ss = _mm256_setzero_ps();
                if (t < T)
                    for (int64_t d = 0; d < hd; d += 8) {
                        const __m256 x = _mm256_loadu_ps(v + (t * KV + kvh) * hd + d);
                        ss = _mm256_fmadd_ps(x, x, ss);
                    }
                vnorm[kvh * T16 + t] = sqrtf(hsum8(ss));
            }
    }
    #pragma omp parallel num_threads(threads)
    {
        /* a task is (8 rows, KV head) with every query head of that KV head: each 16-key block of K
           (4 KB) serves G x 8 rows from L1, and V's slices serve them from L2 */
        float *sbuf = (float *)aligned_alloc(32, (size_t)G * 8 * T16 * 4);
        float *inv = (float *)malloc(sizeof(float) * (size_t)G * 8);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < KV * nb; task++) {
            const int64_t rb = nb - 1 - task / KV, kvh = task % KV;
            const int64_t r0 = rb * 8, nr = Nq - r0 < 8 ? Nq - r0 : 8;
            int64_t lim[8], row[8];
            for (int64_t r = 0; r < 8; r++) {
                row[r] = r0 + (r < nr ? r : nr - 1);
                lim[r] = qpos[row[r]] + 1 < T ? qpos[row[r]] + 1 : T;
            }
            const int64_t nk = (lim[nr - 1] + 7) / 8 * 8;
            const float *kh = kpk + kvh * nblk * hd * 8;
            const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            for (int64_t t0 = 0; t0 < nk; t0 += 16) {  /* scores of 16 keys (8 at the end), 4 rows at a time */
                const int two = t0 + 8 < nk;
                const float *kb = kh + (t0 / 8) * hd * 8;
                const __m256i kpos = _mm256_add_epi32(lane, _mm256_set1_epi32((int)t0));
                const __m256i kpos1 = _mm256_add_epi32(kpos, _mm256_set1_epi32(8));
                for (int64_t g = 0; g < G; g++)
                    for (int r4 = 0; r4 < nr; r4 += 4) {
                        const float *q0 = q + (row[r4] * H + kvh * G + g) * hd, *q1 = q + (row[r4 + 1] * H + kvh * G + g) * hd;
                        const float *q2 = q + (row[r4 + 2] * H + kvh * G + g) * hd, *q3 = q + (row[r4 + 3] * H + kvh * G + g) * hd;
                        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
                        if (two)
                            for (int64_t d = 0; d < hd; d++) {
                                const __m256 k0 = _mm256_load_ps(kb + d * 8), k1 = _mm256_load_ps(kb + hd * 8 + d * 8);
                                __m256 x = _mm256_broadcast_ss(q0 + d);
                                a0 = _mm256_fmadd_ps(x, k0, a0); b0 = _mm256_fmadd_ps(x, k1, b0);
                                x = _mm256_broadcast_ss(q1 + d);
                                a1 = _mm256_fmadd_ps(x, k0, a1); b1 = _mm256_fmadd_ps(x, k1, b1);
                                x = _mm256_broadcast_ss(q2 + d);
                                a2 = _mm256_fmadd_ps(x, k0, a2); b2 = _mm256_fmadd_ps(x, k1, b2);
                                x = _mm256_broadcast_ss(q3 + d);
                                a3 = _mm256_fmadd_ps(x, k0, a3); b3 = _mm256_fmadd_ps(x, k1, b3);
                            }
                        else
                            for (int64_t d = 0; d < hd; d++) {
                                const __m256 k0 = _mm256_load_ps(kb + d * 8);
                                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(q0 + d), k0, a0);
                                a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(q1 + d), k0, a1);
                                a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(q2 + d), k0, a2);
                                a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(q3 + d), k0, a3);
                            }
                        const __m256 a[4] = {a0, a1, a2, a3}, b[4] = {b0, b1, b2, b3};
                        for (int r = 0; r < 4; r++) {
                            const __m256i lr = _mm256_set1_epi32((int)lim[r4 + r]);
                            float *sr = sbuf + (g * 8 + r4 + r) * T16 + t0;
                            _mm256_store_ps(sr, _mm256_blendv_ps(ninf, _mm256_mul_ps(a[r], sc),
                                                                 _mm256_castsi256_ps(_mm256_cmpgt_epi32(lr, kpos))));
                            if (two)
                                _mm256_store_ps(sr + 8, _mm256_blendv_ps(ninf, _mm256_mul_ps(b[r], sc),
                                                                         _mm256_castsi256_ps(_mm256_cmpgt_epi32(lr, kpos1))));
                        }
                    }
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t r = 0; r < nr; r++) inv[g * 8 + r] = softmax_numerators(sbuf + (g * 8 + r) * T16, nk);
            if (share) {
                float *mine = part + (int64_t)omp_get_thread_num() * T16;
                const float *vn = vnorm + kvh * T16;
                for (int64_t t = 0; t < nk; t += 8) {
                    __m256 acc = _mm256_setzero_ps();
                    for (int64_t g = 0; g < G; g++)
                        for (int64_t r = 0; r < nr; r++)
                            acc = _mm256_fmadd_ps(_mm256_load_ps(sbuf + (g * 8 + r) * T16 + t), _mm256_set1_ps(inv[g * 8 + r]), acc);
                    _mm256_store_ps(mine + t, _mm256_fmadd_ps(acc, _mm256_load_ps(vn + t), _mm256_load_ps(mine + t)));
                }
            }
            /* P V: 4 rows and 16 dims a pass over V's keys; each 16-dim slice of V (64 bytes a key)
               serves every query head's rows while it is in L2 */
            for (int64_t d0 = 0; d0 < hd; d0 += 16) {
                const float *vb = v + kvh * hd + d0;
                for (int64_t g = 0; g < G; g++)
                    for (int r4 = 0; r4 < nr; r4 += 4) {
                        const int n4 = nr - r4 < 4 ? (int)(nr - r4) : 4;
                        const int64_t kmax = lim[r4 + n4 - 1];
                        const float *pr = sbuf + (g * 8 + r4) * T16;
                        __m256 o[4][2];
                        if (n4 == 4) {  /* the accumulators named, so that they stay in registers */
                            __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, e0 = c0, e1 = c0, e2 = c0, e3 = c0;
                            for (int64_t t = 0; t < kmax; t++) {
                                const __m256 v0 = _mm256_loadu_ps(vb + t * KV * hd), v1 = _mm256_loadu_ps(vb + t * KV * hd + 8);
                                __m256 p = _mm256_broadcast_ss(pr + t);
                                c0 = _mm256_fmadd_ps(p, v0, c0); e0 = _mm256_fmadd_ps(p, v1, e0);
                                p = _mm256_broadcast_ss(pr + T16 + t);
                                c1 = _mm256_fmadd_ps(p, v0, c1); e1 = _mm256_fmadd_ps(p, v1, e1);
                                p = _mm256_broadcast_ss(pr + 2 * T16 + t);
                                c2 = _mm256_fmadd_ps(p, v0, c2); e2 = _mm256_fmadd_ps(p, v1, e2);
                                p = _mm256_broadcast_ss(pr + 3 * T16 + t);
                                c3 = _mm256_fmadd_ps(p, v0, c3); e3 = _mm256_fmadd_ps(p, v1, e3);
                            }
                            o[0][0] = c0; o[0][1] = e0; o[1][0] = c1; o[1][1] = e1;
                            o[2][0] = c2; o[2][1] = e2; o[3][0] = c3; o[3][1] = e3;
                        } else {
                            for (int r = 0; r < 4; r++) o[r][0] = o[r][1] = _mm256_setzero_ps();
                            for (int64_t t = 0; t < kmax; t++) {
                                const __m256 v0 = _mm256_loadu_ps(vb + t * KV * hd), v1 = _mm256_loadu_ps(vb + t * KV * hd + 8);
                                for (int r = 0; r < n4; r++) {
                                    const __m256 p = _mm256_broadcast_ss(pr + r * T16 + t);
                                    o[r][0] = _mm256_fmadd_ps(p, v0, o[r][0]);
                                    o[r][1] = _mm256_fmadd_ps(p, v1, o[r][1]);
                                }
                            }
                        }
                        for (int r = 0; r < n4; r++) {
                            const __m256 iv = _mm256_set1_ps(inv[g * 8 + r4 + r]);
                            float *ob = out + ((r0 + r4 + r) * H + kvh * G + g) * hd + d0;
                            _mm256_storeu_ps(ob, _mm256_mul_ps(o[r][0], iv));
                            _mm256_storeu_ps(ob + 8, _mm256_mul_ps(o[r][1], iv));
                        }
                    }
            }
        }
        free(inv);
        free(sbuf);
    }
    if (share) {
        for (int i = 0; i < threads; i++)
            for (int64_t t = 0; t < T; t++) share[t] += part[(int64_t)i * T16 + t];
        free(part);
        free(vnorm);
    }
    return 1;
#endif
}
""".replace("@DA_CHUNK@", cpu_gemv.DECODE_CHUNK_C).replace("@Q4_VNNI@", cpu_gemv.Q4_VNNI_C)

# -ffp-contract=off: no product and sum merged into an FMA behind the code's back, so that an inlined
# function rounds alike at every call site (the fused layer and the separate calls give the same bits)
_AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-DAGENTMEM_AVX512"]
VNNI512_FLAGS = _AVX512_FLAGS + ["-mavx512vnni", "-DAGENTMEM_VNNI512"]
AVX512BW_FLAGS = _AVX512_FLAGS + ["-DAGENTMEM_AVX512BW"]


def vnni512_ok() -> bool:
    """Whether the CPU can run the products' AVX512-VNNI tile."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags()


def avx512bw_ok() -> bool:
    """Whether the CPU can run the products' AVX-512 tile without VNNI (`avx512bw`)."""
    return {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags()


def wide_tile() -> tuple[str, list[str]] | None:
    """The AVX-512 tile this CPU can run and its extra build flags: `vnni512` where it has
    AVX512-VNNI, else `avx512bw` where it has AVX-512 (F, BW, VL; Skylake-SP), else None."""
    if vnni512_ok():
        return "vnni512", VNNI512_FLAGS
    if avx512bw_ok():
        return "avx512bw", AVX512BW_FLAGS
    return None


_FLAGS = _AVX2_FLAGS  # the loaded library's flags: `load` adds `wide_tile`'s where `choose_tile` takes it
_P, _I, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "agentmem_avx2_gemv_q8": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I32],
    "agentmem_avx2_gemv_q4": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I32],
    "agentmem_avx2_gemm_f32": [_P, _I, _P, _P, _P, _I, _I, _I, _I32],
    "agentmem_avx2_rms_norm_f32": [_P, _I, _P, _P, _I, _I, ctypes.c_float],
    "agentmem_avx2_rope_f32": [_P, _I, _P, _P, _P, _I, _I, _I],
    "agentmem_avx2_decode_attn_f32": [_P] * 6 + [_I] * 5 + [ctypes.c_float, _I32],
    "agentmem_avx2_decode_attn_f16kv": [_P] * 6 + [_I] * 5 + [ctypes.c_float, _I32],
    "agentmem_avx2_silu_mul_f32": [_P, _I, _P, _I, _I],
    "agentmem_avx2_rows_attn_f32": ([_P] * 5 + [_I] * 5 + [ctypes.c_float, _I32, _P], ctypes.c_int),
    "agentmem_avx2_layers_q8": [_P, _P, _I, _P, ctypes.c_float, _P, _P, _P, _P, _I, _I32, _P, _P, _P, _I,
                                ctypes.c_float] + [_I] * 6 + [_I32, _I32],
    "agentmem_avx2_layer_q8": [_P, _P, _P, _P, ctypes.c_float] + [_P] * 7 + [_I32] + [_P] * 3 + [_I, ctypes.c_float]
                              + [_P] * 7
                              + [_I] * 6 + [_I32, _I32],
}
MAX_ROWS = cpu_gemv.MAX_ROWS  # rows up to which RMSNorm takes the kernel (decode batches)
# Rows up to which Proj's int8 product takes the kernel: past decode's 16, a blend probe's
# question rows and a short prompt's too. On the Zen 3 VM (session 30, 2 threads) the kernel
# against the fp32 copy's torch.mm at 16 / 24 / 32 / 48 / 64 rows: gate_up (3072 x 576) 0.49 /
# 0.61 / 0.82 / 1.28 / 1.63 ms against 0.78 / 0.90 / 1.16 / 1.54 / 2.04; down (576 x 1536) 0.21 /
# 0.32 / 0.42 / 0.63 / 0.92 against 0.28 / 0.39 / 0.48 / 0.70 / 0.79; qkv (960 x 576) even at 64.
# With the AVX512-VNNI tile the kernel wins at every row count (a 2-core Xeon VM, Cascade Lake:
# avx512_vnni, no avx512_bf16, session 38): alone, kernel / torch.mm in ms, best of 20, gate_up
# at 64 / 128 / 256 / 512 rows 1.25 / 2.17 / 4.35 / 8.88 against 2.53 / 3.13 / 5.98 / 7.53, down
# 0.67 / 0.70 / 1.79 / 4.71 against 1.08 / 1.14 / 2.41 / 5.56, qkv 0.32 / 0.67 / 1.32 / 2.88
# against 0.55 / 0.81 / 1.57 / 3.45; inside the forward, where the fp32 copy streams four times
# the int8 bytes, time to first token (alternated, min of 3) 0.55-0.59 -> 0.43 s at 350 tokens,
# 0.77-0.93 -> 0.62-0.64 at 500, 1.52-1.89 -> 1.29-1.75 at 1,000, and a 2,048-token prefill
# 4.87-5.40 -> 4.03-4.72 s. So there every row takes it and no fp32 copy is made (int8 is then a
# memory format too).
PRODUCT_MAX_ROWS = 48
# fp32 rows up to which fp32 weights take `gemm_f32` (more: MKL's sgemm). Session 48, Zen 3 VM, ms,
# MKL on the transposed weight / the kernel, hot: 18 rows 0.26 / 0.14 (960 x 576), 0.92 / 0.37
# (3,072 x 576), 0.38 / 0.20 (576 x 1,536); 48 rows 1.49 / 0.97 (3,072 x 576).
F32_MAX_ROWS = 48
Q4_MAX_ROWS = 48  # fp32 rows up to which 4-bit weights take `gemv_q4` (more: an fp32 copy, exact as prefill is)
VNNI512_PRODUCT_MAX_ROWS = 1 << 62  # `load` sets PRODUCT_MAX_ROWS to this with the VNNI tile
_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()
why_not: str | None = None  # why the kernel is not in use, once `load` has been tried


def cpu_ok() -> bool:
    """AVX2, FMA and F16C (which every AVX2 CPU has: the fp16 pool's loads and stores). The engine
    loads this library only for fp32 rows (`Engine.load`: on a CPU with AVX512-BF16 it runs bf16
    and `cpu_gemv`'s kernels), but it builds and runs on any."""
    return {"avx2", "fma", "f16c"} <= cpu_flags()


def load(cache_dir: Path | str | None = None) -> ctypes.CDLL | None:
    """The compiled kernel (built into `<cache_dir>/kernels` the first time), or None. Its
    products' tile is `choose_tile`'s."""
    global _FLAGS, PRODUCT_MAX_ROWS
    with _lock:
        if not _tried and cpu_ok() and os.environ.get("AGENTMEM_GEMV", "on") != "off" and choose_tile(cache_dir):
            name, flags = wide_tile()
            _FLAGS = _AVX2_FLAGS + flags
            if name == "vnni512":
                PRODUCT_MAX_ROWS = VNNI512_PRODUCT_MAX_ROWS
    return cpu_gemv.load_once(sys.modules[__name__], "gemv_avx2", cpu_ok, "AVX2/FMA/F16C", cache_dir)


def choose_tile(cache_dir: Path | str | None) -> bool:
    """Whether the products take the AVX-512 tile (`wide_tile`: AVX512-VNNI's, or plain AVX-512's
    where the CPU has no VNNI): AGENTMEM_GEMV_VNNI512 = auto (the default: on a CPU that has
    AVX-512, both builds' products timed in turns over cold weights, one row and eight together,
    once per machine and remembered under `cache_dir`) | on | off. The two give the same bits, so
    this is a choice of speed alone. On the Cascade Lake VM of session 38 the VNNI tile took eight
    rows' products from 16.2 to 8.7-10.9 ms and one row's from 7.4-7.8 to 7.2-7.6."""
    mode = os.environ.get("AGENTMEM_GEMV_VNNI512", "auto")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"AGENTMEM_GEMV_VNNI512 must be auto, on or off, got {mode!r}")
    wide = wide_tile()
    if mode == "off" or wide is None:
        return False
    if mode == "on":
        return True
    cache_dir = cpu_gemv.kernel_cache(cache_dir)
    key = f"avx2-tile|{cpu_gemv.source_tag('t', _SOURCE, _AVX2_FLAGS + wide[1])}|{torch.get_num_threads()}|{simd_flags()}"

    def measure() -> dict:
        libs = {}
        for name, flags in (("avx2", _AVX2_FLAGS), (wide[0], _AVX2_FLAGS + wide[1])):
            libs[name], why = cpu_gemv.build("gemv_avx2", _SOURCE, flags, _SIGNATURES, cache_dir)  # load's file
            if libs[name] is None:
                return {"tile": "avx2", "why": why}
        times = cpu_gemv.cold_int8_seconds({t: (cpu_gemv.pack, lambda p, scale, x, lib=lib: gemv_q8(lib, p, scale, x))
                                            for t, lib in libs.items()}, torch.float32)
        us = {t: round(v * 1e6, 1) for t, v in times.items()}
        return {"tile": min(us, key=us.get), "us": us}

    return remembered(cache_dir, "avx2-tile-choice.json", key, measure)["tile"] == wide[0]


def loaded() -> ctypes.CDLL | None:
    return _lib


def tag() -> str:
    """The kernel's identity, for keys of measurements of it."""
    return cpu_gemv.source_tag("gemv-avx2", _SOURCE, _FLAGS)


def gemv_q8(lib: ctypes.CDLL, qp: torch.Tensor, scale: torch.Tensor, x: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] (fp32) @ (q * scale[:, None]).T (+ bias) -> [M, out] fp32, for `qp` =
    cpu_gemv.pack(q) of int8 weights q [out, in] and fp32 scale [out]."""
    n, k = qp.shape[0] * 16, qp.shape[1] * 2
    if x.dim() != 2 or x.shape[-1] != k or x.dtype != torch.float32 or qp.dtype != torch.int8:
        raise ValueError(f"gemv_q8: x must be fp32 [M, {k}] and the weight int8, got {x.dtype} {tuple(x.shape)}")
    return cpu_gemv.run_product(lib.agentmem_avx2_gemv_q8, qp, scale, x, bias, n, torch.float32, out_flag=False)


def gemv_q4(lib: ctypes.CDLL, wp: torch.Tensor, dm: torch.Tensor, x: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] (fp32) @ w.T (+ bias) -> [M, out] fp32, for w held as `cpu_gemv.pack_q4(w)`
    (`agentmem_avx2_gemv_q4`: the rows quantized to int8 per 64 inputs, `vpmaddubsw`)."""
    n, k = wp.shape[0] * 16, wp.shape[1] * 8
    if x.dim() != 2 or x.shape[-1] != k or x.dtype != torch.float32 or wp.dtype != torch.uint8 or k % 64:
        raise ValueError(f"gemv_q4: x must be fp32 [M, {k}] and the weight packed by pack_q4, got {x.dtype} "
                         f"{tuple(x.shape)}")
    return cpu_gemv.run_product(lib.agentmem_avx2_gemv_q4, wp, dm, x, bias, n, torch.float32, out_flag=False)


def gemm_f32(lib: ctypes.CDLL, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None
             ) -> torch.Tensor | None:
    """x [M, in] (fp32) @ w.T (+ bias) for an fp32 weight w [out, in] as it is
    (`agentmem_avx2_gemm_f32`): [M, out] fp32, or None where the shapes are not its (out a
    multiple of 4, in of 8, contiguous weight and rows)."""
    n, k = w.shape
    if (x.dtype != torch.float32 or w.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or n % 4 or k % 8
            or not w.is_contiguous() or x.stride(1) != 1 or (bias is not None and bias.dtype != torch.float32)):
        return None
    y = torch.empty(x.shape[0], n)
    b = bias.contiguous() if bias is not None else None
    lib.agentmem_avx2_gemm_f32(x.data_ptr(), x.stride(0), w.data_ptr(), y.data_ptr(), b.data_ptr() if b is not None else None,
                               x.shape[0], n, k, torch.get_num_threads())
    return y


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of fp32 rows x [M, D] by an fp32 weight [D] (what F.rms_norm computes, in one call)."""
    return cpu_gemv.norm_rows(lib.agentmem_avx2_rms_norm_f32, torch.float32, x, weight, eps)


def rope_usable(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rope` takes x [N, heads, hd] (fp32 on the CPU, each head's dims contiguous and
    heads adjacent, hd a multiple of 16) with fp32 tables [N, hd]."""
    return cpu_gemv.rope_takes(x, cos, torch.float32, 16)


def rope(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, hd] rotated by its positions' tables, as `layers.rotate` computes it, into a
    new contiguous tensor (`rope_usable` must hold)."""
    return cpu_gemv.rotate_rows(lib.agentmem_avx2_rope_f32, torch.float32, x, cos, sin)


def rope_into(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """`rope` of x [N, heads, hd] written into `out` (a contiguous fp32 tensor of x's shape, e.g. a
    slice of the blend's K of one layer) instead of a new tensor (`rope_usable` must hold)."""
    if not (rope_usable(x, cos) and out.dtype == torch.float32 and out.shape == x.shape and out.is_contiguous()):
        raise ValueError(f"rope_into: x {x.dtype} {tuple(x.shape)}, out {out.dtype} {tuple(out.shape)}")
    cpu_gemv.rotate_rows(lib.agentmem_avx2_rope_f32, torch.float32, x, cos, sin, out=out)


KV_DTYPES = (torch.float32, torch.float16)  # the pools `decode_attention` and `layer_q8` read (fp32 queries)


def attention_usable(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `decode_attention` takes such a pool (`dtype`: fp32 or fp16) with fp32 queries: on
    the CPU, head_dim a multiple of 8 up to 256 (any number of query heads per KV head)."""
    return dtype in KV_DTYPES and cpu_gemv.attention_takes(torch.float32, device, heads, kv_heads, head_dim,
                                                           torch.float32, 8, None)


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     idx: torch.Tensor, keep: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """`cpu_gemv.decode_attention` for fp32 queries: one decode query per row over its keys in
    the paged pool (q [B, H, hd]; pools [..., KV, hd], contiguous, fp32 or fp16; idx [B * W] flat
    slots; keep [B, W] which of them the row sees). Returns [B, H, hd] fp32."""
    if q.dtype != torch.float32 or k_pool.dtype != v_pool.dtype or k_pool.dtype not in KV_DTYPES:
        raise ValueError(f"decode_attention: fp32 queries over an fp32 or fp16 pool, got {q.dtype} over "
                         f"{k_pool.dtype}/{v_pool.dtype}")
    fn = lib.agentmem_avx2_decode_attn_f16kv if k_pool.dtype == torch.float16 else lib.agentmem_avx2_decode_attn_f32
    return cpu_gemv.attend_pool(fn, q, k_pool, v_pool, idx, keep, scale)


ROWS_MIN = 8  # fewer rows go to SDPA: the kernel computes 8 rows a task whatever their number
# Keys past which the AVX2 build's rows go to SDPA: a head's packed K (256 bytes a key at hd 64)
# leaves L2. Session 48, Zen 3 VM, 512 rows after 7,680 keys: 142.2 ms a layer against SDPA's
# 123.6; after 3,584: 53.7 against 66.9 (prefill chunks and a blend's rows alike).
AVX2_ROWS_MAX_KEYS = 4096


def rows_kernel(q: torch.Tensor, k: torch.Tensor) -> ctypes.CDLL | None:
    """The loaded library where `rows_attention` takes these rows: fp32 CPU tensors, a head dim it
    takes (either build: AVX-512's 16 keys a vector, AVX2's 8), and on the AVX2 build at most
    AVX2_ROWS_MAX_KEYS keys. AGENTMEM_ATTN_KERNEL=off leaves them to torch's SDPA, as it does bf16
    rows."""
    if (q.dtype != torch.float32 or q.device.type != "cpu" or q.dim() != 3 or k.dim() != 3 or q.shape[0] < ROWS_MIN
            or q.shape[2] % 16 or q.shape[2] > 256 or os.environ.get("AGENTMEM_ATTN_KERNEL") == "off"
            or (rows_build() == "avx2" and k.shape[0] > AVX2_ROWS_MAX_KEYS)):
        return None
    return loaded()


def f32_kernel() -> ctypes.CDLL | None:
    """The loaded library where few fp32 rows on fp32 weights take `gemm_f32`: the AVX2 build, on
    the AVX2-only CPUs it was measured on (session 48); an AVX-512 CPU keeps MKL's 512-bit sgemm,
    not measured against it."""
    return loaded() if rows_build() == "avx2" else None


def rows_build() -> str:
    """Which build's rows kernel the loaded library holds: `avx512` or `avx2`."""
    return "avx512" if "-DAGENTMEM_AVX512" in _FLAGS else "avx2"


def rows_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   q_pos: torch.Tensor, scale: float | None = None, share: torch.Tensor | None = None
                   ) -> torch.Tensor | None:
    """Causal attention of fp32 query rows q [Nq, H, hd] at ascending positions `q_pos` over k/v
    [T, KV, hd] at 0..T-1 (`agentmem_avx2_rows_attn_f32`): [Nq, H, hd] fp32, or None where the
    shapes are not its (the caller runs SDPA). With `share` (fp32 [T], contiguous; the AVX2 build
    only), what each key adds to the rows' outputs, the attention paid to it times its value's
    norm summed over rows and heads, is added into it, as the blend's probe computes it
    (`fuser._attend_and_share`); where the build has none: None and `share` untouched."""
    nq, h, hd = q.shape
    t, kv = k.shape[0], k.shape[1]
    if (q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32
            or k.shape != v.shape or k.shape[2] != hd or h % kv or hd % 16 or hd > 256 or q_pos.shape != (nq,)):
        return None
    if share is not None and (share.dtype != torch.float32 or share.shape != (t,) or not share.is_contiguous()):
        raise ValueError(f"share must be a contiguous fp32 [{t}] tensor, got {share.dtype} {tuple(share.shape)}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    pos = q_pos.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    done = lib.agentmem_avx2_rows_attn_f32(q.data_ptr(), pos.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                           nq, h, kv, hd, t, hd ** -0.5 if scale is None else scale,
                                           torch.get_num_threads(), share.data_ptr() if share is not None else None)
    return out if done else None


def silu_mul(lib: ctypes.CDLL, gu: torch.Tensor) -> torch.Tensor:
    """silu(g) * u of fp32 rows gu [N, 2I] (g = gu[:, :I], u = gu[:, I:]; each row contiguous) in
    one call: [N, I] fp32, the bits the fused layer computes (SiLU's exponential within ~1e-7 of
    torch's)."""
    return cpu_gemv.silu_rows(lib.agentmem_avx2_silu_mul_f32, torch.float32, gu)


def _on_kernel(*projs) -> bool:
    """Whether every `Proj` is on one of this library's product routes (its GEMV layout built):
    int8 (`avx2`) or 4-bit (`q4` with fp32 rows: `gemv_q4`)."""
    routes = {p.q8_route if p is not None and p.fmt in ("int8", "int4") else None for p in projs}
    return len(routes) == 1 and routes <= {"avx2", "q4"} and all(p.w_gemv is not None for p in projs)



def _fp32_or_none(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous())


def _block_takes(block) -> bool:
    """The parts of `layer_q8`'s conditions that depend on the block alone (its weights' formats,
    biases and options): what `layers_q8` checks once per model."""
    a = block.args
    projs = (block.qkv_p, block.o_p, block.gate_up_p, block.down_p)
    return (_on_kernel(*projs) and block.gate_up_p.bias is None and block.down_p.bias is None
            and _fp32_or_none(block.qkv_p.bias) and _fp32_or_none(block.o_p.bias) and block.q_norm is None
            and block.input_norm.eps == block.post_norm.eps
            and block.input_norm.weight.dtype == block.post_norm.weight.dtype == torch.float32
            and block.input_norm.weight.is_contiguous() and block.post_norm.weight.is_contiguous()
            and a.sliding_window is None and a.head_dim % 16 == 0 and a.head_dim <= cpu_gemv.MAX_HEAD_DIM
            and a.n_heads % a.n_kv_heads == 0)


def _step_takes(h: torch.Tensor, hd: int, *pool_and_tables: torch.Tensor) -> bool:
    """The parts that depend on the step (`cpu_gemv.decode_step_takes`): fp32 decode rows, an fp32
    or fp16 pool, their tables and the key slots."""
    return cpu_gemv.decode_step_takes(h, torch.float32, MAX_ROWS, KV_DTYPES, hd, *pool_and_tables)


def _layer_ptrs(block) -> list[int | None]:
    """A block's weights in `agentmem_avx2_layer_q8`'s order (LAYER_PTRS of them)."""
    def ptr(t):
        return None if t is None else t.data_ptr()

    q, o, gu, d = block.qkv_p, block.o_p, block.gate_up_p, block.down_p
    return [ptr(block.input_norm.weight), ptr(block.post_norm.weight), ptr(q.w_gemv), ptr(q.scale), ptr(q.bias),
            ptr(o.w_gemv), ptr(o.scale), ptr(o.bias), ptr(gu.w_gemv), ptr(gu.scale), ptr(d.w_gemv), ptr(d.scale)]


def layers_q8(lib: ctypes.CDLL, model, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool,
              slots: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
    """Every decoder layer of a decode step (`Transformer.forward`'s loop) in one C call
    (`agentmem_avx2_layers_q8`: `layer_q8` a layer, no Python between them): fp32 rows h [M, D]
    in, the last layer's out; pool: the runner's KVPool (k/v [L, slots, KV, hd]). The table of
    the layers' weight pointers is built once a model (`model._avx2_layers`, reset by `pack`);
    None where a layer or the step is not taken (the caller runs the layers one by one)."""
    table = cpu_gemv.layer_table(model, "_avx2_layers", _block_takes, _layer_ptrs)
    a = model.args
    if table is False or not _step_takes(h, a.head_dim, cos, pool.k, pool.v, slots, idx, keep):
        return None
    m = h.shape[0]
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty_like(h)
    lib.agentmem_avx2_layers_q8(
        h.data_ptr(), out.data_ptr(), a.n_layers, table, model.layers[0].input_norm.eps, cos.data_ptr(),
        sin.data_ptr(), pool.k.data_ptr(), pool.v.data_ptr(), pool.k[0].numel(), int(pool.k.dtype == torch.float16),
        slots.contiguous().data_ptr(), idx.data_ptr(), keep.data_ptr(), keep.numel() // m, a.head_dim ** -0.5, m,
        h.shape[1], a.n_heads, a.n_kv_heads, a.head_dim, model.layers[0].down_p.in_features,
        cpu_gemv.q4_flag(model.layers[0].down_p),
        torch.get_num_threads())
    return out


def layer_q8(lib: ctypes.CDLL, block, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor,
             keep: torch.Tensor) -> torch.Tensor | None:
    """A whole decoder layer (`Block.forward`) for fp32 decode rows h [M, D] in one call
    (`agentmem_avx2_layer_q8`): norm, qkv (+ its bias), RoPE, the rows' K/V written to this layer's
    paged pool (k_pool/v_pool [..., KV, hd], fp32 or fp16) at `slots` [M], the decode attention over each
    row's keys (idx [M * W] flat slots, keep [M, W] uint8, as `decode_attention`), then
    `Block.finish`. The separate calls' arithmetic, except SiLU's exponential (this library's
    polynomial, within ~1e-7 of torch's). None where it does not take these (the caller runs the
    separate calls)."""
    a = block.args
    m = h.shape[0] if h.dim() == 2 else 0
    w = keep.numel() // max(m, 1)
    if not (_step_takes(h, a.head_dim, cos, k_pool, v_pool, slots, idx, keep) and _block_takes(block)):
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = slots.contiguous()
    out = torch.empty_like(h)
    bq, bo = block.qkv_p.bias, block.o_p.bias
    lib.agentmem_avx2_layer_q8(
        h.data_ptr(), out.data_ptr(), block.input_norm.weight.data_ptr(), block.post_norm.weight.data_ptr(),
        block.input_norm.eps, block.qkv_p.w_gemv.data_ptr(), block.qkv_p.scale.data_ptr(),
        None if bq is None else bq.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
        int(k_pool.dtype == torch.float16), slots.data_ptr(), idx.data_ptr(), keep.data_ptr(), w, a.head_dim ** -0.5, block.o_p.w_gemv.data_ptr(),
        block.o_p.scale.data_ptr(), None if bo is None else bo.data_ptr(), block.gate_up_p.w_gemv.data_ptr(),
        block.gate_up_p.scale.data_ptr(), block.down_p.w_gemv.data_ptr(), block.down_p.scale.data_ptr(), m,
        h.shape[1], a.n_heads, a.n_kv_heads, a.head_dim, block.down_p.in_features, cpu_gemv.q4_flag(block.down_p),
        torch.get_num_threads())
    return out

"""A bf16 matrix-vector product for few-row products on CPUs with AVX512-BF16: what a decode
step spends most of its time in.

A decode step multiplies one row (one per stream) by every weight of the model, so it is
bound by the bytes of weights read. oneDNN's packed bf16 product, the engine's default for
many rows, reads them well below the machine's bandwidth over a whole SmolLM2-135M token
(121 products of 0.6-3.5 MB and the 56 MB LM head): each product is short and pays a fixed
set-up cost. This kernel reads its own layout, packed once at load (`pack`): the weight
[N, K] as [N/16, K/2, 16, 2], so that one 64-byte load holds an input pair (k, k+1) for 16
outputs and `vdpbf16ps` (bf16 pairs multiplied and summed into fp32) adds it into 16 fp32
sums against the input pair broadcast: no horizontal sums, and each thread streams whole
contiguous 32-output blocks (36 KB at K = 576), which the hardware prefetcher follows (a
software prefetch measured no better). Each block runs every input row while it is in
cache, up to 8 at a time (16 accumulators), so 8 rows cost little more than one.

Measured over a whole token of SmolLM2-135M's products (cold weights, 2 threads, the AMD EPYC
VM with AVX-512 + avx512_bf16, best of 7; /tmp dev scripts): in one run, packed 1 row 12.7 ms
against 17.5 for the earlier kernel over the plain row-major weight and 18.8 for oneDNN, 8 rows
16.4 against 22.3 and 21.7 (a noisy neighbour then; in a quiet run packed 1 row 9.6 ms, 28 GB/s);
8 rows at a time rather than 4, in another run: 8 rows 11.7 against 12.7 ms, 16 rows 16.9
against 17.8. So it takes every decode batch the compiled buckets have (up to MAX_ROWS);
prefill chunks stay with oneDNN.

It is C compiled once by the system's C compiler (the one inductor uses) into the cache dir
and loaded with ctypes (`Engine.load` does it; `loaded` is what Proj uses); without a
compiler, AVX512-BF16, or where the build fails, `load` returns None, says why once, and the
engine keeps oneDNN.

The same library holds the decode attention kernel (`decode_attention`): one query per
sequence over its keys read straight from the paged KV pool, which the engine's attention on
the CPU calls in place of gathering the keys, copying them to fp32 and calling SDPA.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Callable
from pathlib import Path

import torch

from ..measured import best_seconds_each, cpu_flags, remembered, simd_flags

log = logging.getLogger("agentmem.engine")

MAX_ROWS = 16  # input rows up to which Proj uses the kernel (the largest decode bucket)
BLOCK = 32  # outputs per block: a weight's out_features must be a multiple


# Shared by both libraries' decode attention (this one's bf16, cpu_avx2's fp32): the keys of a
# (row, chunk) item, about four chunks a thread over all the rows, 32 to DA_MAX keys.
DECODE_CHUNK_C = r"""#define DA_MAX 256  /* keys of a chunk at most */
static int64_t da_chunk(int64_t B, int64_t W, int threads) {
    int64_t ch = (W * B + 4 * (int64_t)threads - 1) / (4 * (int64_t)(threads > 0 ? threads : 1));
    ch = (ch + 15) / 16 * 16;
    return ch < 32 ? 32 : ch > DA_MAX ? DA_MAX : ch;
}

/* The weight of each of row b's nc chunk items for head h in the merged output (part: per item
   and head the chunk's score maximum, exp sum and ldp - 2 V sums): exp(max - row max) over the
   row's total exp sum, 0 for a chunk that kept no key (all 0 for a row that kept none). */
static void da_weights(const float *part, int64_t nc, int64_t H, int64_t ldp, int64_t b, int64_t h, float *w) {
    float mx = -INFINITY, L = 0.0f;
    for (int64_t c = 0; c < nc; c++) {
        const float *p = part + ((b * nc + c) * H + h) * ldp;
        if (p[1] > 0.0f && p[0] > mx) mx = p[0];
    }
    for (int64_t c = 0; c < nc; c++) {
        const float *p = part + ((b * nc + c) * H + h) * ldp;
        w[c] = p[1] > 0.0f ? expf(p[0] - mx) : 0.0f;
        L += w[c] * p[1];
    }
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int64_t c = 0; c < nc; c++) w[c] *= inv;
}
"""

# Shared by both libraries' AVX512-VNNI 4-bit products (this one's bf16 rows, cpu_avx2's fp32 rows in its
# VNNI build): one 16-output group of 4-bit weights against `mb` int8 rows, the fp32 sums per
# row left in f[] for the caller to store its own way.
Q4_VNNI_C = r"""#ifndef Q4_GROUP
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
   includer without VNNI defines Q4_STEP, Q4_WIDEN and Q4_TARGET its own way: cpu_avx2's
   `avx512bw` build). */
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
"""

_SOURCE = r"""
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

/* 16 bf16 -> 16 fp32 */
static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
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
   too few lines in flight. Cold 3,072 x 576 products on a 2-core Zen 4 VM (session 40, best of
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
   inputs instead of 64. The group loop is `q4_tile_sums` (Q4_VNNI_C), shared with cpu_avx2. */
@Q4_VNNI@

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

/* SwiGLU's gate: y = silu(g) * u for bf16 rows gu [N, 2I] (g the first I of a row, u the rest:
   the fused gate/up projection's output, rows ld apart), y [N, I] contiguous. Rounded as
   torch's two ops round: silu(g) in fp32 to bf16, then its product with u to bf16. One call
   instead of two torch ops and their temporaries (2,048 rows: 2.4 ms a layer in torch). */
void agentmem_silu_mul_bf16(const uint16_t *gu, int64_t ld, uint16_t *y, int64_t N, int64_t I) {
    #pragma omp parallel for if (N > 16) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *g = gu + n * ld, *u = g + I;
        uint16_t *yr = y + n * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) {
            const __m512 x = load_bf16(g + i);
            const __m512 sg = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            const __m512 s16 = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(sg));  /* silu's own bf16 rounding */
            _mm256_storeu_si256((__m256i *)(yr + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s16, load_bf16(u + i))));
        }
        for (; i < I; i++) {
            const float x = bf16_to_f32(g[i]);
            const float sg = bf16_to_f32(to_bf16(x / (1.0f + expf(-x))));
            yr[i] = to_bf16(sg * bf16_to_f32(u[i]));
        }
    }
}

/* RMSNorm of bf16 rows as the engine's bf16 path computes it: normalised in fp32, rounded to
   bf16, then multiplied by the bf16 weight and rounded again. x, y [M, D] bf16 (rows ldx and D
   apart), w [D] bf16. One call instead of four torch ops per norm (61 a decode token); rows
   shared out past 16 (a 2,048-row prefill: 0.5 ms serial against torch's 2.8, AMX Xeon VM). */
void agentmem_rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, uint16_t *y, int64_t M,
                            int64_t D, float eps) {
    #pragma omp parallel for if (M > 16) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xm = x + m * ldx;
        uint16_t *ym = y + m * D;
        __m512 acc = _mm512_setzero_ps();
        int64_t d = 0;
        for (; d + 16 <= D; d += 16) {
            __m512 v = load_bf16(xm + d);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        float ss = _mm512_reduce_add_ps(acc);
        for (; d < D; d++) {
            uint32_t u = (uint32_t)xm[d] << 16;
            float v;
            memcpy(&v, &u, 4);
            ss += v * v;
        }
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        for (d = 0; d < D; d++) {
            uint32_t u = (uint32_t)xm[d] << 16, uw = (uint32_t)w[d] << 16, ut;
            float v, wf, t;
            memcpy(&v, &u, 4);
            memcpy(&wf, &uw, 4);
            ut = (uint32_t)to_bf16(v * r) << 16;
            memcpy(&t, &ut, 4);
            ym[d] = to_bf16(t * wf);
        }
    }
}

/* The lane sums of 16 vectors at once: lane j of the result is the sum of v[j]'s 16 lanes.
   A tree of in-lane unpacks and 128-bit shuffles, ~3 instructions a vector where a reduction
   of each alone takes ~9 (scores of 16 keys: 16 dot products, one sum pass). */
static inline __m512 hsum16(const __m512 v[16]) {
    __m512 x[8], y[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit chunk: v[2i]'s partial sums at lanes 0 and 2, v[2i+1]'s at 1 and 3 */
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per chunk c: the chunk sums of v[4i .. 4i+3] */
        const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* y[i] holds 4 chunks of v[4i .. 4i+3]'s sums: add the chunks, y[i]'s total into chunk i */
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x44), _mm512_shuffle_f32x4(y[0], y[1], 0xEE));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x44), _mm512_shuffle_f32x4(y[2], y[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

/* One decode query per sequence over its keys in the paged pool: out[b, h] = softmax(q[b, h] . K
   * scale) V over the keys j of row b with keep[b, j], at flat pool slots idx[b, j]. q/out bf16
   [B, H, hd]; kp/vp bf16 [slots, KV, hd]; hd a multiple of 32 (at most 256), H a multiple of KV.
   The scores are fp32 sums of exact bf16 products (vdpbf16ps), the softmax and the weighted sum
   of V fp32.
   A row's keys are cut into chunks of `ch` (`da_chunk`: about four chunks a thread over all the
   rows, 32 to DA_MAX keys), and each (row, chunk) item computes, for every head, the chunk's
   score maximum, its sum of exp(score - max) and the unnormalised sum of V (`da_item`); a merge
   rescales the chunks to the row's maximum (`da_merge`). So one row's long history is shared by
   all the threads (it used to be one task per (row, KV head): 3 tasks for 2 threads at one
   stream), each item reads whole pool rows (all KV heads of a key) while they are in cache, the
   next keys are prefetched while the scores of these are summed, and the weighted sum of V keeps
   its accumulators in registers (`pv_heads`, unrolled per head count and width). With one chunk
   the result is that of a single softmax pass. Session 32, 2-core AMX Xeon VM, SmolLM2-135M's
   heads (9 of 64, 3 KV), the layer's pool cold: see docs/engine.md. */
@DA_CHUNK@
/* acc[g][d] += s[g][t] * v_t over the n keys, for GN heads (score rows ls apart) and ND x 16
   dims of V from `off` in each pool row (ldv elements); the sums go to o (heads ldo apart).
   Inlined with constant GN, ND: the accumulators stay in registers. */
static inline __attribute__((always_inline)) void pv_heads(const uint16_t *vp, const int64_t *slot, int64_t n,
                                                           int64_t ldv, int64_t off, const float *s, int64_t ls,
                                                           const int GN, const int ND, float *o, int64_t ldo) {
    __m512 acc[16];
    for (int i = 0; i < GN * ND; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *v = vp + slot[t] * ldv + off;
        for (int d = 0; d < ND; d++) {
            const __m512 vv = load_bf16(v + 16 * d);
            for (int g = 0; g < GN; g++)
                acc[g * ND + d] = _mm512_fmadd_ps(_mm512_set1_ps(s[g * ls + t]), vv, acc[g * ND + d]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int d = 0; d < ND; d++) _mm512_storeu_ps(o + g * ldo + 16 * d, acc[g * ND + d]);
}

static void pv_any(const uint16_t *vp, const int64_t *slot, int64_t n, int64_t ldv, int64_t off, const float *s,
                   int64_t ls, int gn, int nd, float *o, int64_t ldo) {
    #define PV(GN, ND) case GN * 8 + ND: pv_heads(vp, slot, n, ldv, off, s, ls, GN, ND, o, ldo); break;
    switch (gn * 8 + nd) {
        PV(1, 2) PV(2, 2) PV(3, 2) PV(4, 2) PV(1, 4) PV(2, 4) PV(3, 4) PV(4, 4)
    }
    #undef PV
}

/* The scores of 16 keys (pool rows ldv elements apart, from `off`) against one query head qg of
   NK x 32 dims, times sc, into s[0..15]. Inlined with constant NK: q stays in registers. */
static inline __attribute__((always_inline)) void scores16(const uint16_t *kp, const int64_t *slot, int64_t ldv,
                                                           int64_t off, const uint16_t *qg, const int NK,
                                                           __m512 sc, float *s) {
    __m512bh qv[8];
    for (int d = 0; d < NK; d++) qv[d] = (__m512bh)_mm512_loadu_si512(qg + 32 * d);
    __m512 a[16];
    for (int j = 0; j < 16; j++) {
        const uint16_t *k = kp + slot[j] * ldv + off;
        a[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(k), qv[0]);
        for (int d = 1; d < NK; d++) a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_loadu_si512(k + 32 * d), qv[d]);
    }
    _mm512_storeu_ps(s, _mm512_mul_ps(hsum16(a), sc));
}

static void scores_any(const uint16_t *kp, const int64_t *slot, int64_t ldv, int64_t off, const uint16_t *qg,
                       int nk, __m512 sc, float *s) {
    #define SC(NK) case NK: scores16(kp, slot, ldv, off, qg, NK, sc, s); break;
    switch (nk) { SC(1) SC(2) SC(3) SC(4) SC(5) SC(6) SC(7) SC(8) }
    #undef SC
}

/* The pool's K and V rows of one key (all KV heads: ldv elements each) fetched into L1. The first
   pass of an item (KV head 0) fetches whole rows DA_AHEAD keys ahead, so the passes of the other
   KV heads and the weighted sum of V find them in cache: a decode step's pool is cold (the layer
   weights streamed through the caches since this layer's last step). Session 36, Zen 4 VM, all
   30 layers of a step in one call, best of 5: 1 row over 2,048 keys 8.39 -> 7.43 ms, 8 rows over
   400 keys 11.18 -> 9.61; 16 keys ahead by KV head (before) was the slowest, 64 and 128 whole
   rows no better than 32, nor prefetching into L2 only. */
#define DA_AHEAD 32
static inline void da_fetch(const uint16_t *kp, const uint16_t *vp, int64_t slot, int64_t ldv) {
    for (int64_t l = 0; l < (ldv * 2 + 63) / 64; l++) {
        _mm_prefetch((const char *)(kp + slot * ldv) + 64 * l, _MM_HINT_T0);
        _mm_prefetch((const char *)(vp + slot * ldv) + 64 * l, _MM_HINT_T0);
    }
}

/* Item (b, c): row b's keys [c * ch, (c + 1) * ch) of W; per head h, part[h * (hd + 2)] holds the
   chunk's score maximum, its exp sum and its unnormalised V sum [hd] (sum 0: no key kept). */
static void da_item(const uint16_t *q, int64_t ldq, const uint16_t *kp, const uint16_t *vp, const int64_t *idx,
                    const uint8_t *keep, int64_t b, int64_t c, int64_t ch, int64_t H, int64_t KV, int64_t hd,
                    int64_t W, float scale, float *part) {
    const int64_t G = H / KV, lo = c * ch, hi = lo + ch < W ? lo + ch : W, ldv = KV * hd, ldp = hd + 2;
    int64_t slot[DA_MAX], n = 0;
    for (int64_t j = lo; j < hi; j++)
        if (keep[b * W + j]) slot[n++] = idx[b * W + j];
    for (int64_t j = 0; j < DA_AHEAD && j < n; j++) da_fetch(kp, vp, slot[j], ldv);
    if (n == 0) {
        for (int64_t h = 0; h < H; h++) part[h * ldp] = -INFINITY, part[h * ldp + 1] = 0.0f;
        return;
    }
    float s[G * ch + 16];
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t kvh = 0; kvh < KV; kvh++) {
        const uint16_t *qg = q + b * ldq + kvh * G * hd;
        int64_t t0 = 0;
        for (; t0 + 16 <= n; t0 += 16) {  /* scores of 16 keys at a time, summed across lanes together */
            if (kvh == 0)  /* whole pool rows (every KV head's K and V) DA_AHEAD keys ahead */
                for (int64_t j = t0 + DA_AHEAD; j < t0 + DA_AHEAD + 16 && j < n; j++) da_fetch(kp, vp, slot[j], ldv);
            for (int64_t g = 0; g < G; g++)
                scores_any(kp, slot + t0, ldv, kvh * hd, qg + g * hd, (int)(hd / 32), sc, s + g * ch + t0);
        }
        for (int64_t t = t0; t < n; t++) {  /* the last keys one at a time, each read once for the G heads */
            const uint16_t *k = kp + slot[t] * ldv + kvh * hd;
            for (int64_t g = 0; g < G; g++) {
                __m512 a = _mm512_setzero_ps();
                for (int64_t d = 0; d < hd; d += 32)
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(k + d),
                                         (__m512bh)_mm512_loadu_si512(qg + g * hd + d));
                s[g * ch + t] = _mm512_reduce_add_ps(a) * scale;
            }
        }
        for (int64_t g = 0; g < G; g++) {  /* softmax numerators in place, their maximum and sum */
            float *sg = s + g * ch, *p = part + (kvh * G + g) * ldp;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            int64_t t = 0;
            for (; t + 16 <= n; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
            if (t < n) mx = _mm512_mask_max_ps(mx, (__mmask16)((1u << (n - t)) - 1), mx, _mm512_maskz_loadu_ps((__mmask16)((1u << (n - t)) - 1), sg + t));
            const float m = _mm512_reduce_max_ps(mx);
            __m512 acc = _mm512_setzero_ps(), mv = _mm512_set1_ps(m);
            t = 0;
            for (; t + 16 <= n; t += 16) {
                __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mv));
                _mm512_storeu_ps(sg + t, e);
                acc = _mm512_add_ps(acc, e);
            }
            if (t < n) {
                __mmask16 mk = (__mmask16)((1u << (n - t)) - 1);
                __m512 e = _mm512_maskz_mov_ps(mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + t), mv)));
                _mm512_mask_storeu_ps(sg + t, mk, e);
                acc = _mm512_add_ps(acc, e);
            }
            p[0] = m;
            p[1] = _mm512_reduce_add_ps(acc);
        }
        for (int64_t g0 = 0; g0 < G; g0 += 4)  /* the weighted sum of V, up to 4 heads and 64 dims a pass */
            for (int64_t d0 = 0; d0 < hd; d0 += 64)
                pv_any(vp, slot, n, ldv, kvh * hd + d0, s + g0 * ch, ch, G - g0 < 4 ? (int)(G - g0) : 4,
                       hd - d0 >= 64 ? 4 : 2, part + (kvh * G + g0) * ldp + 2 + d0, ldp);
    }
}

/* out[b, h] from row b's nc chunk items: each chunk's sums rescaled to the row's maximum. */
static void da_merge(const float *part, int64_t nc, int64_t H, int64_t hd, int64_t b, int64_t h, uint16_t *out,
                     int64_t ldo) {
    const int64_t ldp = hd + 2, nd = hd / 16;
    float w[nc + 1];
    da_weights(part, nc, H, ldp, b, h, w);
    __m512 o[16];
    for (int64_t d = 0; d < nd; d++) o[d] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        if (w[c] == 0.0f) continue;
        const float *p = part + ((b * nc + c) * H + h) * ldp;
        const __m512 wv = _mm512_set1_ps(w[c]);
        for (int64_t d = 0; d < nd; d++) o[d] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(p + 2 + 16 * d), o[d]);
    }
    uint16_t *oh = out + b * ldo + h * hd;
    float tmp[16];
    for (int64_t d = 0; d < nd; d++) {
        _mm512_storeu_ps(tmp, o[d]);
        for (int i = 0; i < 16; i++) oh[16 * d + i] = to_bf16(tmp[i]);
    }
}

/* The decode attention of B rows for the calling team of threads: the items shared out as they
   come (rows may keep different numbers of keys), then the merge; part: B * nc * H * (hd + 2)
   floats, nc = ceil(W / ch). out's rows ldo elements apart. */
static void team_decode_attn(const uint16_t *q, int64_t ldq, const uint16_t *kp, const uint16_t *vp,
                             const int64_t *idx, const uint8_t *keep, uint16_t *out, int64_t ldo, int64_t B,
                             int64_t H, int64_t KV, int64_t hd, int64_t W, float scale, int64_t ch, float *part) {
    const int64_t nc = (W + ch - 1) / ch;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < B * nc; it++)
        da_item(q, ldq, kp, vp, idx, keep, it / nc, it % nc, ch, H, KV, hd, W, scale, part + it * H * (hd + 2));
    #pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) da_merge(part, nc, H, hd, bh / H, bh % H, out, ldo);
}

static float *da_part(int64_t B, int64_t W, int64_t H, int64_t hd, int64_t ch) {
    return (float *)malloc(sizeof(float) * (size_t)(B * ((W + ch - 1) / ch) * H * (hd + 2) + 1));
}

void agentmem_decode_attn_bf16(const uint16_t *q, const uint16_t *kp, const uint16_t *vp, const int64_t *idx,
                               const uint8_t *keep, uint16_t *out, int64_t B, int64_t H, int64_t KV,
                               int64_t hd, int64_t W, float scale, int threads) {
    if (B <= 0) return;
    const int64_t ch = da_chunk(B, W, threads);
    float *part = da_part(B, W, H, hd, ch);
    #pragma omp parallel num_threads(threads)
    team_decode_attn(q, H * hd, kp, vp, idx, keep, out, H * hd, B, H, KV, hd, W, scale, ch, part);
    free(part);
}

/* Causal attention of query rows over a whole K/V (prefill chunks, CacheBlend's recomputed
   rows): out[i, h] = softmax over keys j <= qpos[i] of (q[i, h] . k[j, h / G] * scale), times V.
   q/out bf16 [Nq, H, hd], qpos int64 [Nq] ascending, k/v bf16 [T, KV, hd] at positions 0..T-1.
   K is first packed per KV head as [T16/16, hd/2, 16, 2] (a key pair of dims for 16 keys in one
   64-byte vector) and V as [T2, hd, 2] (two keys' values of each dim side by side), so both
   products run on vdpbf16ps without horizontal sums: scores for 16 keys of 8 query rows per
   pass over a K block, and P times V two keys per instruction, P (the fp32 softmax
   numerators) as the sum of two bf16 (hi, and the rest), so the weights keep ~16 bits.
   Each task is (KV head, query head of its group, 8 rows): its scores go to a per-thread
   buffer (exact two-pass softmax in fp32), then its outputs are summed over V 4 rows at a
   time (each V load serves 4 rows). Against torch's SDPA in bf16, on 2,048 causal tokens of
   SmolLM2's heads (9 of 64, 3 KV; AMD EPYC, 2 threads): 11.5 against 34.8 ms, and a lower
   mean error against an fp32 reference (7.8e-5 against 1.2e-4). Session 29 (AMD EPYC Zen 4
   VM, 400 GFLOP/s bf16, 2 threads; 2,048 causal tokens): 22-24 ms, of which P V (two products
   per key pair) ~12 ms; with P as one bf16, 17-19 ms, and through the whole bf16 model the
   same KL against fp32 (512 tokens: 8.01e-4 against 8.03e-4; 2,048: 7.22e-4 against 7.13e-4).
   But `bench memory`'s answers (15 questions, the 135M model, one sampling seed) went 0.60 ->
   0.33 with it (reflected 0.73 -> 0.60), bisected to this change alone; so hi + lo stays until
   a run over several sampling seeds says the drop is noise.
   `share` (NULL: none) [T] fp32 is added to, per key, what it gives the outputs: its attention
   weight times the norm of its value, summed over the rows and heads (the kvreuse probe's
   selection signal, which otherwise materialises every weight in torch). */
#define ROWS 8
#define PV_ROWS 4

/* e[w][d] += sum over key pairs t2 < n2 of row w's weights (ph: bf16 pairs; with `split`, plus
   pl, the rest of each weight) times V's pairs vh [T2][ldv] (uint32: two keys of one dim), for
   16 * nd dims. A constant `split` at the call compiles each case without a branch. */
static inline __attribute__((always_inline)) void ra_pv_bf16(const uint32_t *vh, int64_t ldv, int64_t nd, int64_t n2,
                                                             const uint32_t *const *ph, const uint32_t *const *pl,
                                                             const int split, __m512 e[][4]) {
    for (int64_t t2 = 0; t2 < n2; t2++) {
        __m512bh a[PV_ROWS], al[PV_ROWS];
        for (int w = 0; w < PV_ROWS; w++) {
            a[w] = (__m512bh)_mm512_set1_epi32((int)ph[w][t2]);
            if (split) al[w] = (__m512bh)_mm512_set1_epi32((int)pl[w][t2]);
        }
        const uint32_t *v0 = vh + t2 * ldv;
        for (int d = 0; d < nd; d++) {
            const __m512bh vv = (__m512bh)_mm512_loadu_si512(v0 + 16 * d);
            for (int w = 0; w < PV_ROWS; w++) {
                e[w][d] = _mm512_dpbf16_ps(e[w][d], a[w], vv);
                if (split) e[w][d] = _mm512_dpbf16_ps(e[w][d], al[w], vv);
            }
        }
    }
}
/* |v| of each key's value vector per KV head, for the kvreuse probe's share: vn[kvh * stride + t]
   over v bf16 [T, KV, hd], 0 for t in [T, stride) (the rows and AMX kernels' padded keys). */
static void bf16_value_norms(const uint16_t *v, int64_t T, int64_t KV, int64_t hd, float *vn, int64_t stride,
                             int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < KV * stride; i++) {
        const int64_t kvh = i / stride, t = i % stride;
        __m512 n2 = _mm512_setzero_ps();
        for (int64_t d = 0; t < T && d < hd; d += 16) {
            const __mmask16 m = hd - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (hd - d)) - 1);
            const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm256_maskz_loadu_epi16(m, v + (t * KV + kvh) * hd + d)), 16));
            n2 = _mm512_fmadd_ps(x, x, n2);
        }
        vn[i] = sqrtf(_mm512_reduce_add_ps(n2));
    }
}
void agentmem_rows_attn_bf16(const uint16_t *q, const int64_t *qpos, const uint16_t *k, const uint16_t *v,
                             uint16_t *out, int64_t Nq, int64_t H, int64_t KV, int64_t hd, int64_t T, float scale,
                             int threads, float *share, int split) {
    if (Nq <= 0 || T <= 0) return;
    const int64_t G = H / KV, np = hd / 2, T16 = (T + 15) / 16 * 16, T2 = T16 / 2;
    uint32_t *kpk = (uint32_t *)aligned_alloc(64, (size_t)KV * T16 * np * 4);
    uint32_t *vpk = (uint32_t *)aligned_alloc(64, (size_t)KV * T2 * hd * 4);
    float *vn = share ? (float *)aligned_alloc(64, (size_t)KV * T16 * 4) : NULL;  /* |v| per KV head and key */
    const uint16_t *ku = k, *vu = v;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < KV * (T16 / 16); blk++) {  /* pack K and V, zero past T */
        const int64_t kvh = blk / (T16 / 16), b = blk % (T16 / 16);
        uint32_t *kd = kpk + ((kvh * (T16 / 16) + b) * np) * 16;
        for (int64_t p = 0; p < np; p++)
            for (int64_t t = 0; t < 16; t++) {
                const int64_t j = b * 16 + t;
                kd[p * 16 + t] = j < T ? *(const uint32_t *)(ku + (j * KV + kvh) * hd + 2 * p) : 0u;
            }
        for (int64_t t2 = b * 8; t2 < b * 8 + 8; t2++) {
            uint32_t *vd = vpk + (kvh * T2 + t2) * hd;
            const int64_t j0 = 2 * t2, j1 = 2 * t2 + 1;
            for (int64_t d = 0; d < hd; d++) {
                const uint32_t lo = j0 < T ? vu[(j0 * KV + kvh) * hd + d] : 0u;
                const uint32_t hi = j1 < T ? vu[(j1 * KV + kvh) * hd + d] : 0u;
                vd[d] = lo | (hi << 16);
            }
        }
    }
    if (vn) bf16_value_norms(v, T, KV, hd, vn, T16, threads);
    const int64_t nb = (Nq + ROWS - 1) / ROWS;
    #pragma omp parallel num_threads(threads)
    {
        float *sbuf = (float *)aligned_alloc(64, (size_t)ROWS * T16 * 4);
        uint32_t *pbuf = (uint32_t *)aligned_alloc(64, (size_t)ROWS * T2 * 4);
        uint32_t *plo = split ? (uint32_t *)aligned_alloc(64, (size_t)ROWS * T2 * 4) : NULL;
        float *acc_t = share ? (float *)calloc((size_t)T16, 4) : NULL;  /* this thread's part of `share` */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < KV * G * nb; task++) {
            const int64_t rb = nb - 1 - task / (KV * G), kvh = (task % (KV * G)) / G, g = task % G;
            const int64_t r0 = rb * ROWS, nr = Nq - r0 < ROWS ? Nq - r0 : ROWS, h = kvh * G + g;
            int64_t lim[ROWS];  /* keys each row sees: 0..lim-1 */
            const uint32_t *qr[ROWS];
            for (int64_t r = 0; r < ROWS; r++) {
                const int64_t i = r0 + (r < nr ? r : nr - 1);
                lim[r] = qpos[i] + 1 < T ? qpos[i] + 1 : T;
                qr[r] = (const uint32_t *)(q + (i * H + h) * hd);
            }
            const int64_t nk = (lim[nr - 1] + 15) / 16 * 16;  /* rows ascend: the last sees most */
            const uint32_t *kh = kpk + kvh * (T16 / 16) * np * 16;
            const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            for (int64_t t0 = 0; t0 < nk; t0 += 16) {  /* scores */
                __m512 a[ROWS];
                for (int r = 0; r < ROWS; r++) a[r] = _mm512_setzero_ps();
                const uint32_t *kb = kh + (t0 / 16) * np * 16;
                for (int64_t p = 0; p < np; p++) {
                    const __m512bh kv = (__m512bh)_mm512_load_si512(kb + p * 16);
                    for (int r = 0; r < ROWS; r++)
                        a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32((int)qr[r][p]), kv);
                }
                const __m512i jv = _mm512_add_epi32(lane, _mm512_set1_epi32((int)t0));
                for (int r = 0; r < ROWS; r++) {
                    __mmask16 vis = _mm512_cmplt_epi32_mask(jv, _mm512_set1_epi32((int)lim[r]));
                    _mm512_store_ps(sbuf + r * T16 + t0,
                                    _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), vis, _mm512_mul_ps(a[r], _mm512_set1_ps(scale))));
                }
            }
            float inv[ROWS];
            for (int r = 0; r < nr; r++) {  /* softmax numerators as bf16 key pairs, and their sums */
                float *sr = sbuf + r * T16;
                const int64_t n16 = (lim[r] + 15) / 16 * 16;
                __m512 mv = _mm512_set1_ps(-INFINITY);
                for (int64_t t = 0; t < n16; t += 16) mv = _mm512_max_ps(mv, _mm512_load_ps(sr + t));
                mv = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
                __m512 acc = _mm512_setzero_ps();
                uint32_t *pr = pbuf + r * T2, *pl = split ? plo + r * T2 : NULL;
                for (int64_t t = 0; t < n16; t += 16) {
                    __m512 e = exp16(_mm512_sub_ps(_mm512_load_ps(sr + t), mv));
                    acc = _mm512_add_ps(acc, e);
                    if (share) _mm512_store_ps(sr + t, e);
                    /* e in bf16 (16 bf16 = 8 key pairs); with `split` as hi + lo, both bf16: ~16 bits */
                    __m256bh hi = _mm512_cvtneps_pbh(e);
                    _mm256_storeu_si256((__m256i *)(pr + t / 2), (__m256i)hi);
                    if (split) {
                        __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(e, _mm512_cvtpbh_ps(hi)));
                        _mm256_storeu_si256((__m256i *)(pl + t / 2), (__m256i)lo);
                    }
                }
                inv[r] = 1.0f / _mm512_reduce_add_ps(acc);
                if (share) {  /* weight x |v| of each key this row sees */
                    const __m512 iv = _mm512_set1_ps(inv[r]);
                    const float *vr = vn + kvh * T16;
                    for (int64_t t = 0; t < n16; t += 16)
                        _mm512_storeu_ps(acc_t + t, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_load_ps(sr + t), iv),
                                                                    _mm512_load_ps(vr + t), _mm512_loadu_ps(acc_t + t)));
                }
            }
            const uint32_t *vh = vpk + kvh * T2 * hd;
            for (int r = 0; r < nr; r += PV_ROWS) {  /* P V for PV_ROWS rows at a time: each V load serves them all */
                const int m = nr - r < PV_ROWS ? nr - r : PV_ROWS;
                const int64_t n2 = (lim[r + m - 1] + 15) / 16 * 8;  /* rows ascend: the last sees most */
                const uint32_t *ph[PV_ROWS], *pl[PV_ROWS];
                for (int w = 0; w < PV_ROWS; w++) {
                    const int64_t rw = r + (w < m ? w : m - 1), own = (lim[rw] + 15) / 16 * 8;
                    if (own < n2) {  /* a row's weights past its own keys are 0 */
                        memset(pbuf + rw * T2 + own, 0, (size_t)(n2 - own) * 4);
                        if (split) memset(plo + rw * T2 + own, 0, (size_t)(n2 - own) * 4);
                    }
                    ph[w] = pbuf + rw * T2;
                    pl[w] = split ? plo + rw * T2 : NULL;
                }
                for (int64_t d0 = 0; d0 < hd; d0 += 64) {
                    const int64_t nd = hd - d0 < 64 ? (hd - d0) / 16 : 4;
                    __m512 e[PV_ROWS][4];
                    for (int w = 0; w < PV_ROWS; w++)
                        for (int d = 0; d < 4; d++) e[w][d] = _mm512_setzero_ps();
                    if (split)
                        ra_pv_bf16(vh + d0, hd, nd, n2, ph, pl, 1, e);
                    else
                        ra_pv_bf16(vh + d0, hd, nd, n2, ph, pl, 0, e);
                    for (int w = 0; w < m; w++) {
                        const __m512 iv = _mm512_set1_ps(inv[r + w]);
                        uint16_t *o = out + ((r0 + r + w) * H + h) * hd + d0;
                        for (int d = 0; d < nd; d++) {
                            __m256bh b16 = _mm512_cvtneps_pbh(_mm512_mul_ps(e[w][d], iv));
                            _mm256_storeu_si256((__m256i *)(o + 16 * d), (__m256i)b16);
                        }
                    }
                }
            }
        }
        if (share) {
            #pragma omp critical
            for (int64_t t = 0; t < T; t++) share[t] += acc_t[t];
            free(acc_t);
        }
        free(sbuf);
        free(pbuf);
        free(plo);
    }
    free(kpk);
    free(vpk);
    free(vn);
}

/* u8-route products of the few bf16 rows in x [M, K] (M <= 8) into y [M, N] bf16, for the
   calling team of threads: xq/xs/corr are the rows quantized by one thread, then the 16-output
   groups are shared out (`omp for`, which ends on a barrier). */
__attribute__((target("avx512vnni")))
static void team_q8u8(const uint8_t *w, const float *scale, const uint16_t *x, int64_t ldx, uint16_t *y,
                      int64_t M, int64_t N, int64_t K, int8_t *xq, float *xs, float *corr) {
    const int64_t nb = K / U8_BLOCK;
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) quantize_i8(x + m * ldx, K, xq + m * K, xs + m * nb, corr + m);
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < N / 16; g++) {
        #define TILE(mb) tile_u8(w + g * 16 * K, K, xq, K, mb, y, N, g * 16, scale, xs, corr, 0, 0)
        BY_ROWS(M, TILE)
        #undef TILE
    }
}

__attribute__((target("avx512vnni")))
static void team_q4u8(const uint8_t *w, const uint16_t *dm, const uint16_t *x, int64_t ldx, uint16_t *y,
                      int64_t M, int64_t N, int64_t K, int8_t *xq, float *xs, float *xsum) {
    const int64_t nb = K / U8_BLOCK, ng = K / Q4_GROUP;
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) quantize_q4(x + m * ldx, K, xq + m * K, xs + m * nb, xsum + m * ng);
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < N / 16; g++) {
        #define TILE(mb) tile_q4(w + g * 8 * K, dm + g * K, K, xq, K, mb, y, N, g * 16, xs, xsum, 0, 0)
        BY_ROWS(M, TILE)
        #undef TILE
    }
}

/* Scratch of the fused layer functions for M <= 8 rows of at most K inputs (K >= every
   product's input and output width it is used for): the quantized rows and their scales, and
   the bf16 intermediates. */
typedef struct {
    int8_t *xq;
    float *xs, *xsum, corr[8];
    uint16_t *nx, *h2, *gu, *sx, *qkv, *qk, *attn;
} Scratch;

static Scratch scratch_new(int64_t M, int64_t K, int64_t I, int64_t NQKV) {
    Scratch t;
    t.xq = (int8_t *)aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    t.xs = (float *)malloc(sizeof(float) * (size_t)(M * (K / U8_BLOCK) + 1));
    t.xsum = (float *)malloc(sizeof(float) * (size_t)(M * (K / Q4_GROUP) + 1));
    t.nx = (uint16_t *)malloc(2 * (size_t)(M * K));
    t.h2 = (uint16_t *)malloc(2 * (size_t)(M * K));
    t.gu = (uint16_t *)malloc(4 * (size_t)(M * I));
    t.sx = (uint16_t *)malloc(2 * (size_t)(M * I));
    t.qkv = (uint16_t *)malloc(2 * (size_t)(M * NQKV + 1));
    t.qk = (uint16_t *)malloc(2 * (size_t)(M * NQKV + 1));
    t.attn = (uint16_t *)malloc(2 * (size_t)(M * NQKV + 1));
    return t;
}

static void scratch_free(Scratch *t) {
    free(t->xq); free(t->xs); free(t->xsum); free(t->nx); free(t->h2); free(t->gu); free(t->sx);
    free(t->qkv); free(t->qk); free(t->attn);
}

/* One product of the fused layer functions for the calling team: u8 (int8 weights, fp32 scales
   `s`) or, with `q4`, 4-bit weights (`s`: their fp16 scales and minima). */
__attribute__((target("avx512vnni")))
static void team_proj(int q4, const uint8_t *w, const void *s, const uint16_t *x, int64_t ldx, uint16_t *y,
                      int64_t M, int64_t N, int64_t K, Scratch *t) {
    if (q4) team_q4u8(w, (const uint16_t *)s, x, ldx, y, M, N, K, t->xq, t->xs, t->xsum);
    else team_q8u8(w, (const float *)s, x, ldx, y, M, N, K, t->xq, t->xs, t->corr);
}

/* For the calling team: qkv = wqkv(rms_norm(h)) [M, NQKV] bf16, then the first QK heads of
   each row (q and k) rotated into qk [M, QK, hd] (`agentmem_rope_bf16`'s tables and rounding). */
__attribute__((target("avx512vnni")))
static void team_qkv(const uint16_t *h, const uint16_t *nw, float eps, const uint8_t *w, const void *s,
                     const float *cs, const float *sn, uint16_t *qkv, uint16_t *qk, int64_t M, int64_t D,
                     int64_t NQKV, int64_t QK, int64_t hd, int q4, Scratch *t) {
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) agentmem_rms_norm_bf16(h + m * D, D, nw, t->nx + m * D, 1, D, eps);
    team_proj(q4, w, s, t->nx, D, qkv, M, NQKV, D, t);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        agentmem_rope_bf16(qkv + m * NQKV, NQKV, cs + m * hd, sn + m * hd, qk + m * QK * hd, 1, QK, hd);
}

/* For the calling team, `Block.finish`: h2 = h + o(a); out = h2 + down(silu(gate) * up) of
   rms_norm(h2), gate/up = gu(norm), each step rounded to bf16 where the separate calls round. */
__attribute__((target("avx512vnni")))
static void team_finish(const uint16_t *a, int64_t lda, const uint16_t *h, uint16_t *out, const uint8_t *wo,
                        const void *so, const uint16_t *nw, float eps, const uint8_t *wgu, const void *sgu,
                        const uint8_t *wd, const void *sd, int64_t M, int64_t HD, int64_t D, int64_t I,
                        int q4, Scratch *t) {
    team_proj(q4, wo, so, a, lda, t->h2, M, D, HD, t);  /* o(a), then h2 = h + o(a) */
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        uint16_t *r = t->h2 + m * D;
        for (int64_t i = 0; i < D; i++) r[i] = to_bf16(bf16_to_f32(h[m * D + i]) + bf16_to_f32(r[i]));
        agentmem_rms_norm_bf16(r, D, nw, t->nx + m * D, 1, D, eps);
    }
    team_proj(q4, wgu, sgu, t->nx, D, t->gu, M, 2 * I, D, t);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) agentmem_silu_mul_bf16(t->gu + m * 2 * I, 2 * I, t->sx + m * I, 1, I);
    team_proj(q4, wd, sd, t->sx, I, out, M, D, I, t);  /* down, then out = h2 + down */
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < M * D; i++) out[i] = to_bf16(bf16_to_f32(t->h2[i]) + bf16_to_f32(out[i]));
}

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* The first half of a decoder layer's products for M <= 8 bf16 rows on the u8 route, in one
   call and one team of threads (`team_qkv`), bit-identical to the three separate calls. */
__attribute__((target("avx512vnni")))
void agentmem_qkv_q8u8(const uint16_t *h, const uint16_t *nw, float eps, const uint8_t *w, const void *s,
                       const float *cs, const float *sn, uint16_t *qkv, uint16_t *qk, int64_t M, int64_t D,
                       int64_t NQKV, int64_t QK, int64_t hd, int q4, int threads) {
    Scratch t = scratch_new(M, D, 1, 1);
    #pragma omp parallel num_threads(threads)
    team_qkv(h, nw, eps, w, s, cs, sn, qkv, qk, M, D, NQKV, QK, hd, q4, &t);
    scratch_free(&t);
}

/* The second half of a decoder layer (`Block.finish`) for M <= 8 bf16 rows with every weight
   on the u8 route, in one call and one team of threads instead of seven calls and three
   (`team_finish`), bit-identical to them. a [M, HD] (rows lda apart), h/out [M, D], nw [D]
   bf16; o [D, HD], gu [2I, D], down [D, I] packed by `pack_u8` with their scales. */
__attribute__((target("avx512vnni")))
void agentmem_finish_q8u8(const uint16_t *a, int64_t lda, const uint16_t *h, uint16_t *out,
                          const uint8_t *wo, const void *so, const uint16_t *nw, float eps,
                          const uint8_t *wgu, const void *sgu, const uint8_t *wd, const void *sd,
                          int64_t M, int64_t HD, int64_t D, int64_t I, int q4, int threads) {
    Scratch t = scratch_new(M, max3(HD, D, I), I, 1);
    #pragma omp parallel num_threads(threads)
    team_finish(a, lda, h, out, wo, so, nw, eps, wgu, sgu, wd, sd, M, HD, D, I, q4, &t);
    scratch_free(&t);
}

/* A whole decoder layer for M <= 8 decode rows (one query each) on the u8 route, for the calling
   team of threads: `team_qkv`; each row's rotated k and its v written to the paged pool at
   wslot[m] (kp/vp: this layer's pool, [slots, KV, hd]); the decode attention of each row over its
   keys (idx/keep [M, W], as `agentmem_decode_attn_bf16`: `team_decode_attn`, its item buffer
   `part` for chunks of ch keys); `team_finish`. Ends on the barrier of its last `omp for`. */
__attribute__((target("avx512vnni")))
static void team_layer_u8(const uint16_t *h, uint16_t *out, const uint16_t *nw1, const uint16_t *nw2, float eps,
                          const uint8_t *wqkv, const void *sqkv, const float *cs, const float *sn,
                          uint16_t *kp, uint16_t *vp, const int64_t *wslot, const int64_t *idx, const uint8_t *keep,
                          int64_t W, float scale, const uint8_t *wo, const void *so, const uint8_t *wgu,
                          const void *sgu, const uint8_t *wd, const void *sd, int64_t M, int64_t D, int64_t H,
                          int64_t KV, int64_t hd, int64_t I, int64_t ch, float *part, int q4, Scratch *t) {
    const int64_t NQKV = (H + 2 * KV) * hd, QK = H + KV, row = KV * hd;
    team_qkv(h, nw1, eps, wqkv, sqkv, cs, sn, t->qkv, t->qk, M, D, NQKV, QK, hd, q4, t);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        memcpy(kp + wslot[m] * row, t->qk + m * QK * hd + H * hd, 2 * (size_t)row);
        memcpy(vp + wslot[m] * row, t->qkv + m * NQKV + QK * hd, 2 * (size_t)row);
    }
    team_decode_attn(t->qk, QK * hd, kp, vp, idx, keep, t->attn, H * hd, M, H, KV, hd, W, scale, ch, part);
    team_finish(t->attn, H * hd, h, out, wo, so, nw2, eps, wgu, sgu, wd, sd, M, H * hd, D, I, q4, t);
}

/* A whole decoder layer (`team_layer_u8`) in one call and one team of threads, bit-identical to
   the separate calls. */
__attribute__((target("avx512vnni")))
void agentmem_layer_q8u8(const uint16_t *h, uint16_t *out, const uint16_t *nw1, const uint16_t *nw2, float eps,
                         const uint8_t *wqkv, const void *sqkv, const float *cs, const float *sn,
                         uint16_t *kp, uint16_t *vp, const int64_t *wslot, const int64_t *idx, const uint8_t *keep,
                         int64_t W, float scale, const uint8_t *wo, const void *so, const uint8_t *wgu,
                         const void *sgu, const uint8_t *wd, const void *sd, int64_t M, int64_t D, int64_t H,
                         int64_t KV, int64_t hd, int64_t I, int q4, int threads) {
    Scratch t = scratch_new(M, max3(H * hd, D, I), I, (H + 2 * KV) * hd);
    const int64_t ch = da_chunk(M, W, threads);
    float *part = da_part(M, W, H, hd, ch);
    #pragma omp parallel num_threads(threads)
    team_layer_u8(h, out, nw1, nw2, eps, wqkv, sqkv, cs, sn, kp, vp, wslot, idx, keep, W, scale, wo, so, wgu, sgu,
                  wd, sd, M, D, H, KV, hd, I, ch, part, q4, &t);
    free(part);
    scratch_free(&t);
}

/* Every layer of a decode step in one call and one team of threads: `team_layer_u8` for layers
   0..L-1 in turn, the scratch and the attention's item buffer allocated once, each layer from
   the last one's output (two rows of buffers ping-pong; the last layer writes out). Layer l's
   weights are w[l * U8_LAYER_PTRS + j] in the order of `agentmem_layer_q8u8`'s arguments (nw1,
   nw2, wqkv, sqkv, wo, so, wgu, sgu, wd, sd), its pool K/V at kp/vp + l * pstride elements.
   Bit-identical to the layers one by one: the per-layer call's work, without a team started, nine
   buffers allocated and a Python call made 30 times a step. */
#define U8_LAYER_PTRS 10
__attribute__((target("avx512vnni")))
void agentmem_layers_q8u8(const uint16_t *h, uint16_t *out, int64_t L, void *const *w, float eps,
                          const float *cs, const float *sn, uint16_t *kp, uint16_t *vp, int64_t pstride,
                          const int64_t *wslot, const int64_t *idx, const uint8_t *keep, int64_t W, float scale,
                          int64_t M, int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t I, int q4, int threads) {
    Scratch t = scratch_new(M, max3(H * hd, D, I), I, (H + 2 * KV) * hd);
    const int64_t ch = da_chunk(M, W, threads);
    float *part = da_part(M, W, H, hd, ch);
    uint16_t *buf = (uint16_t *)malloc(2 * (size_t)(2 * M * D));
    #pragma omp parallel num_threads(threads)
    for (int64_t l = 0; l < L; l++) {  /* every thread walks the same layers; the layer's barriers order them */
        void *const *p = w + l * U8_LAYER_PTRS;
        const uint16_t *x = l == 0 ? h : buf + ((l - 1) & 1) * M * D;
        uint16_t *y = l == L - 1 ? out : buf + (l & 1) * M * D;
        team_layer_u8(x, y, p[0], p[1], eps, p[2], p[3], cs, sn, kp + l * pstride, vp + l * pstride, wslot, idx,
                      keep, W, scale, p[4], p[5], p[6], p[7], p[8], p[9], M, D, H, KV, hd, I, ch, part, q4, &t);
    }
    free(buf);
    free(part);
    scratch_free(&t);
}

/* ---- Causal attention of query rows on AMX tiles (`rows_attention_amx`) ----
   What `agentmem_rows_attn_bf16` computes (without `share`), flash-attention style with the
   products on the tile unit (TDPBF16PS) and the softmax on AVX-512. A task is one query head
   and 16 query rows (rows past Nq repeat the last one; heaviest row blocks first); it runs over
   key blocks of AMX_KB = 64 keys up to its last row's position. All in the transposed
   orientation, so that a row's softmax is one lane of a zmm and needs no horizontal max or sum:
     S^T [64 keys x 16 rows] = K . Q^T: K's rows straight from k (A tiles, 16 keys x 32 dims,
       KV*hd apart; the partial last block from a zero-padded copy), Q^T packed per task as
       [hd/2, 16 rows, 2] (the B-tile layout), stored fp32;
     online softmax: 2^(s c - M) with c = scale*log2 e, M the running max per row lane (times c),
       set from block 0 and raised only where a block's scores pass it by more than 8: the
       weights stay below 2^8 and O is rescaled (and the block's weights redone) only then,
       rarely after block 0; the check is a max fused into the weights loop. 2^x is a degree-4
       polynomial (relative error 2.7e-6). Keys past a row's position are masked only in the
       blocks that reach past the task's first row;
     P^T as bf16 key pairs [32, 16 rows, 2] (a B tile per 32 keys): the weight truncated to bf16
       (its upper half, paired by one vpermt2w) and the exact remainder as a second bf16,
       truncated too (hi + lo within 2^-16 of the weight: the vdpbf16ps kernel's
       ~16 bits, and the same errors against an fp32 reference);
     O^T [hd x 16 rows] += V^T . P^T (+ V^T . P_lo^T): V^T packed per call as [KV, TP/32, hd, 32]
       (A tiles of 16 dims x 32 keys, 1 KB contiguous); O^T in an fp32 buffer, each 16-dim tile
       loaded, accumulated over the block's two 32-key halves and stored back.
   The tile work is split into key tiles (S) and dim tiles (P V) and interleaved with the
   weights: after each 16 keys' weights of block kb come one key tile of block kb+1's scores
   and a share of block kb-1's P V, for the tile unit to run while the vector units go on.
   Session 32's AMX Xeon VM (2 threads; 2,048 tokens of 9/3 heads of 64 in four 512-row chunks,
   as `choose_rows_route` times them): 4.75 ms against 12 for bf16 SDPA and 39 for the vdpbf16ps
   kernel; a first version (a separate max pass, degree-6 2^x, whole blocks in turn) took 6.0,
   the whole-block order with the scores one block ahead 4.9. Measured there with the parts
   left out, the weights take ~1.8 ms and the tile work ~2.3 (their sum: they hardly overlap),
   of which ~1 ms is K and V coming from L2. Tried and dropped: 128- or 32-key blocks, two row
   tiles stepping through the keys together (K/V reused from L1), software prefetch of the next
   block, separate hi and lo O tiles: each no faster or slower. One bf16 a weight (no lo part)
   took 4.1 ms but 1.3-1.5x the mean error of hi + lo, a little above bf16 SDPA's.
   With `share` (the kvreuse probe's signal: per key, its weight times |v| summed over the rows
   and heads), a row tile whose softmax is final goes over its keys once more: the scores again
   on the tiles, the normalised weights, summed over the row lanes into the thread's own [T]
   buffer, added to `share` once the team is done (session 49, AMX Xeon VM: 24 probe rows over
   2,056 keys 0.52 ms a layer against 3.8 for torch's bmm and softmax and 1.06 for the vdpbf16ps
   kernel's share).
   Tile config (all 8 tiles 16 rows x 64 bytes) is loaded by each thread of the team, released
   at its end. AMX needs the process's permission first: `agentmem_amx_ok`. */
#include <unistd.h>
#include <sys/syscall.h>

int agentmem_amx_ok(void) {  /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: 1 if granted */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

#ifndef AMX_KB
#define AMX_KB 64  /* keys a block: 4 S tiles */
#endif
#ifndef AMX_AHEAD
#define AMX_AHEAD 1  /* blocks whose scores are computed ahead of the weights */
#endif
#ifndef AMX_RT
#define AMX_RT 1  /* 16-row tiles a task steps through the keys with */
#endif
#define AMX_TGT __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

typedef struct {
    uint8_t palette, start_row, rsv[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

/* 2^x for 16 floats: 2^n * p(r), r = x - n in [-1/2, 1/2], p the degree-6 Taylor series of
   2^r (relative error ~1.2e-7); x = -inf gives NaN (callers mask those lanes after) */
static inline __m512 exp2_16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618129107628477e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550410866482158e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.2402265069591007f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931471805599453f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 2^x for the weights: as exp2_16 with a near-minimax polynomial of degree 4 (relative error
   2.7e-6, below the 2^-16 that hi + lo keep) */
static inline __m512 exp2w_16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(0.009570101276040077f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.05591786280274391f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.240247443318367f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931217908859253f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.9999992847442627f));
    return _mm512_scalef_ps(p, n);
}

typedef struct {
    const uint16_t *q, *k, *kt, *vt;
    const int64_t *qpos;
    uint16_t *out;
    int64_t Nq, H, KV, hd, T, TP;
    float c;  /* scale * log2 e */
    const float *vn;  /* |v| per KV head and key ([KV][TP]), where a share is asked for */
    float *share;     /* [T]: added to, per key, its weight times |v| over the rows and heads; or NULL */
} amx_args;

/* The weights of keys j0..j1-1 of a block (S^T in sb, [KB][16] fp32; j0, j1 even) as
   2^(s c - M) (M: the running max per row lane, times c) into pb: bf16 key pairs
   [KB/2][16][2], then the remainders ([KB/2][16][2] more). The hi part is p truncated to bf16
   (its upper 16 bits, paired by one vpermt2w), the lo part the exact rest truncated too: hi +
   lo within 2^-16 of p.
   Adds the weights to *l and raises *xm to the max of s c - M over the visible keys (diag:
   keys past a row's lim masked, their weights 0). */
AMX_TGT static inline void amx_weights(const float *sb, uint32_t *pb, __m512 cv, __m512 M, int diag,
                                       __m512i limv, int64_t k0, int j0, int j1, __m512 *l, __m512 *xm) {
    /* upper words of p0 (0-31) and p1 (32-63) paired: (p0[r] >> 16, p1[r] >> 16) */
    const __m512i upper = _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19, 49, 17,
                                           47, 15, 45, 13, 43, 11, 41, 9, 39, 7, 37, 5, 35, 3, 33, 1);
    const __m512i himask = _mm512_set1_epi32((int)0xffff0000u);
    __m512 x0m = *xm, x1m = x0m, s0 = _mm512_setzero_ps(), s1 = s0;
    for (int j = j0; j < j1; j += 2) {
        const __m512 x0 = _mm512_fmsub_ps(_mm512_load_ps(sb + j * 16), cv, M);
        const __m512 x1 = _mm512_fmsub_ps(_mm512_load_ps(sb + (j + 1) * 16), cv, M);
        __m512 p0 = exp2w_16(x0), p1 = exp2w_16(x1);
        if (diag) {
            const __mmask16 v0 = _mm512_cmpgt_epi32_mask(limv, _mm512_set1_epi32((int)(k0 + j)));
            const __mmask16 v1 = _mm512_cmpgt_epi32_mask(limv, _mm512_set1_epi32((int)(k0 + j + 1)));
            x0m = _mm512_mask_max_ps(x0m, v0, x0m, x0);
            x1m = _mm512_mask_max_ps(x1m, v1, x1m, x1);
            p0 = _mm512_maskz_mov_ps(v0, p0);
            p1 = _mm512_maskz_mov_ps(v1, p1);
        } else {
            x0m = _mm512_max_ps(x0m, x0);
            x1m = _mm512_max_ps(x1m, x1);
        }
        s0 = _mm512_add_ps(s0, p0);
        s1 = _mm512_add_ps(s1, p1);
        const __m512i i0 = _mm512_castps_si512(p0), i1 = _mm512_castps_si512(p1);
        _mm512_store_si512(pb + j / 2 * 16, _mm512_permutex2var_epi16(i0, upper, i1));
        const __m512 r0 = _mm512_sub_ps(p0, _mm512_castsi512_ps(_mm512_and_si512(i0, himask)));
        const __m512 r1 = _mm512_sub_ps(p1, _mm512_castsi512_ps(_mm512_and_si512(i1, himask)));
        _mm512_store_si512(pb + AMX_KB / 2 * 16 + j / 2 * 16,
                           _mm512_permutex2var_epi16(_mm512_castps_si512(r0), upper, _mm512_castps_si512(r1)));
    }
    *l = _mm512_add_ps(*l, _mm512_add_ps(s0, s1));
    *xm = _mm512_max_ps(x0m, x1m);
}

#define AMX_PB (AMX_KB / 2 * 16 * 2)  /* uint32 of a block's weights (hi and lo) */

/* Tiles: 0 an S^T tile (16 keys x 16 rows), 1 a Q^T tile (32 dims), 2 a K tile; 3 an O^T tile
   (16 dims x 16 rows), 4 and 5 P^T tiles (32 keys, hi and lo), 6 a V^T tile. The S and P V
   work of a block is split into the key tiles and dim tiles that make it, so that the two can
   be interleaved with the weights on the vector units (`amx_attn_team`). */

/* S^T of the 16 keys k0 + 16 i.. into sb + 16 i * 16 */
AMX_TGT static inline void amx_score_tile(const amx_args *a, const uint32_t *qt, float *sb, int64_t k0, int64_t kvh,
                                          int i) {
    const int64_t hd = a->hd;
    const uint8_t *kb;
    int64_t ks;  /* bytes between keys */
    if (k0 + AMX_KB <= a->T) {
        kb = (const uint8_t *)(a->k + ((k0 + 16 * i) * a->KV + kvh) * hd);
        ks = a->KV * hd * 2;
    } else {  /* the partial last block, zero padded */
        kb = (const uint8_t *)(a->kt + (kvh * AMX_KB + 16 * i) * hd);
        ks = hd * 2;
    }
    _tile_zero(0);
    if (hd == 64 && AMX_RT == 1) {  /* Q^T in tiles 1 and 7 since the task began */
        _tile_loadd(2, kb, ks);
        _tile_dpbf16ps(0, 2, 1);
        _tile_loadd(2, kb + 64, ks);
        _tile_dpbf16ps(0, 2, 7);
    } else {
        for (int64_t cc = 0; cc < hd; cc += 32) {
            _tile_loadd(1, qt + cc / 2 * 16, 64);
            _tile_loadd(2, kb + cc * 2, ks);
            _tile_dpbf16ps(0, 2, 1);
        }
    }
    _tile_stored(0, sb + 16 * i * 16, 64);
}

/* O^T dims 16 t.. (ob, [hd][16] fp32) += V^T P^T over the keys k0.. (AMX_KB) */
AMX_TGT static inline void amx_pv_tile(const amx_args *a, const uint32_t *pb, float *ob, int64_t k0, int64_t kvh,
                                       int64_t t) {
    float *o = ob + t * 16 * 16;
    _tile_loadd(3, o, 64);
    for (int j = 0; j < AMX_KB; j += 32) {
        _tile_loadd(6, a->vt + ((kvh * (a->TP / 32) + (k0 + j) / 32) * a->hd + 16 * t) * 32, 64);
        _tile_loadd(4, pb + j / 2 * 16, 64);
        _tile_dpbf16ps(3, 6, 4);
        _tile_loadd(5, pb + AMX_KB / 2 * 16 + j / 2 * 16, 64);
        _tile_dpbf16ps(3, 6, 5);
    }
    _tile_stored(3, o, 64);
}

/* Each key's share of a finished row tile (rows r0.. of head h, its final M and 1/l per row
   lane): the keys' scores again, a tile at a time, their normalised weights 2^(s c - M) / l
   (masked past each row's position and in the lanes past its nr rows), summed over the lanes
   and times |v|, added to acc[key]. */
AMX_TGT static void amx_share_pass(const amx_args *a, const uint32_t *qt, float *sb, int64_t kvh, int64_t nkb,
                                   __m512 M, __m512 inv, __m512i limv, int64_t nr, float *acc) {
    const __m512 cv = _mm512_set1_ps(a->c);
    const __mmask16 live = (__mmask16)((1u << nr) - 1);
    const float *vn = a->vn + kvh * a->TP;
    for (int64_t kb = 0; kb < nkb; kb++) {
        const int64_t k0 = kb * AMX_KB;
        for (int i = 0; i < AMX_KB / 16; i++) amx_score_tile(a, qt, sb, k0, kvh, i);
        const int64_t nj = a->T - k0 < AMX_KB ? a->T - k0 : AMX_KB;
        for (int64_t j = 0; j < nj; j++) {
            const __mmask16 vis = live & _mm512_cmpgt_epi32_mask(limv, _mm512_set1_epi32((int)(k0 + j)));
            const __m512 x = _mm512_fmsub_ps(_mm512_load_ps(sb + j * 16), cv, M);
            const __m512 p = _mm512_maskz_mul_ps(vis, exp2w_16(x), inv);
            acc[k0 + j] += _mm512_reduce_add_ps(p) * vn[k0 + j];
        }
    }
}

/* One 16-row tile of a task: its rows' state while the task steps through the key blocks */
typedef struct {
    int64_t r0, nr, lmin, nkb;  /* first row, rows (the rest repeat the last), keys the first row sees, blocks */
    __m512i limv;               /* keys each row sees */
    __m512 M, l;                /* running max (times c) and sum of weights, per row lane */
    float *sbuf, *ob;           /* S^T ring [AHEAD+1][KB][16]; O^T [hd][16] */
    uint32_t *pt, *qt;          /* P^T (hi, lo) of two blocks; Q^T [hd/2][16] */
} amx_rows;

AMX_TGT static void amx_attn_team(const amx_args *a) {
    const int64_t H = a->H, KV = a->KV, hd = a->hd, T = a->T, G = H / KV, np = hd / 2, ndt = hd / 16;
    const int64_t nb = (a->Nq + 16 * AMX_RT - 1) / (16 * AMX_RT);
    enum { NKT = AMX_KB / 16 };  /* key tiles a block */
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
    amx_rows R[AMX_RT];
    for (int u = 0; u < AMX_RT; u++) {
        R[u].sbuf = (float *)aligned_alloc(64, (AMX_AHEAD + 1) * AMX_KB * 16 * 4);
        R[u].pt = (uint32_t *)aligned_alloc(64, 2 * AMX_PB * 4);
        R[u].qt = (uint32_t *)aligned_alloc(64, (size_t)np * 16 * 4);
        R[u].ob = (float *)aligned_alloc(64, (size_t)hd * 16 * 4);
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 cv = _mm512_set1_ps(a->c), th = _mm512_set1_ps(8.0f);
    float *acc = a->share ? (float *)calloc((size_t)T, 4) : NULL;  /* this thread's shares */
    #pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < H * nb; task++) {
        const int64_t rb = nb - 1 - task / H, h = task % H, kvh = h / G;
        int nu = 0;  /* row tiles of this task */
        int64_t nkb = 0;
        for (int u = 0; u < AMX_RT; u++) {
            amx_rows *x = &R[u];
            x->r0 = (rb * AMX_RT + u) * 16;
            if (x->r0 >= a->Nq) break;
            nu++;
            x->nr = a->Nq - x->r0 < 16 ? a->Nq - x->r0 : 16;
            int32_t lim[16];
            for (int r = 0; r < 16; r++) {
                const int64_t p = a->qpos[x->r0 + (r < x->nr ? r : x->nr - 1)] + 1;
                lim[r] = (int32_t)(p < T ? p : T);
            }
            x->limv = _mm512_loadu_si512(lim);
            x->lmin = lim[0];
            x->nkb = (lim[15] + AMX_KB - 1) / AMX_KB;  /* rows ascend: the last sees most */
            nkb = x->nkb;
            /* Q^T: dims (2p, 2p+1) of the 16 rows */
            const uint32_t *qb = (const uint32_t *)(a->q + (x->r0 * H + h) * hd);
            const __m512i rows = _mm512_min_epi32(lane, _mm512_set1_epi32((int)x->nr - 1));
            const __m512i idx = _mm512_mullo_epi32(rows, _mm512_set1_epi32((int)(H * np)));
            for (int64_t p = 0; p < np; p++)
                _mm512_store_si512(x->qt + p * 16, _mm512_i32gather_epi32(_mm512_add_epi32(idx, _mm512_set1_epi32((int)p)), qb, 4));
            if (hd == 64 && AMX_RT == 1) {
                _tile_loadd(1, x->qt, 64);
                _tile_loadd(7, x->qt + 256, 64);
            }
            for (int64_t d = 0; d < hd; d++) _mm512_store_ps(x->ob + d * 16, _mm512_setzero_ps());
            x->l = _mm512_setzero_ps();
            for (int64_t kb = 0; kb < AMX_AHEAD && kb < x->nkb; kb++)
                for (int i = 0; i < NKT; i++) amx_score_tile(a, x->qt, x->sbuf + kb * AMX_KB * 16, kb * AMX_KB, kvh, i);
        }
        /* block kb of each row tile: its weights on the vector units, a key tile at a time, and
           after each, a key tile of block kb + AMX_AHEAD's scores and a share of block kb - 1's
           P V dims on the tile unit, which runs them while the vector units go on; the row tiles
           take each block in turn, the second reading its keys and values from L1 */
        for (int64_t kb = 0; kb < nkb; kb++) {
            const int64_t k0 = kb * AMX_KB;
            for (int u = 0; u < nu; u++) {
                amx_rows *x = &R[u];
                if (kb >= x->nkb) continue;
                const float *sb = x->sbuf + (kb % (AMX_AHEAD + 1)) * AMX_KB * 16;
                uint32_t *pb = x->pt + (kb & 1) * AMX_PB;
                const uint32_t *pprev = x->pt + ((kb + 1) & 1) * AMX_PB;
                float *snext = x->sbuf + ((kb + AMX_AHEAD) % (AMX_AHEAD + 1)) * AMX_KB * 16;
                const int diag = k0 + AMX_KB > x->lmin;  /* some row does not see the whole block */
                if (kb == 0) {  /* the running max from block 0's scores (every row sees key 0) */
                    __m512 bm = _mm512_set1_ps(-INFINITY);
                    for (int j = 0; j < AMX_KB; j++) {
                        const __mmask16 vis = _mm512_cmpgt_epi32_mask(x->limv, _mm512_set1_epi32(j));
                        bm = _mm512_mask_max_ps(bm, vis, bm, _mm512_load_ps(sb + j * 16));
                    }
                    x->M = _mm512_mul_ps(bm, cv);
                }
                __m512 lb = _mm512_setzero_ps(), xm = _mm512_set1_ps(-INFINITY);
                for (int i = 0; i < NKT; i++) {
                    amx_weights(sb, pb, cv, x->M, diag, x->limv, k0, 16 * i, 16 * i + 16, &lb, &xm);
                    if (kb + AMX_AHEAD < x->nkb) amx_score_tile(a, x->qt, snext, k0 + AMX_AHEAD * AMX_KB, kvh, i);
                    if (kb > 0)
                        for (int64_t t = i; t < ndt; t += NKT) amx_pv_tile(a, pprev, x->ob, k0 - AMX_KB, kvh, t);
                }
                /* the max stays where it is unless a row's scores pass it by more than 8 (2^8): then
                   O (through block kb - 1) is rescaled and this block's weights redone (rare after block 0) */
                const __mmask16 up = _mm512_cmp_ps_mask(xm, th, _CMP_GT_OQ);
                if (up) {
                    const __m512 Mn = _mm512_mask_add_ps(x->M, up, x->M, xm);
                    const __m512 al = exp2_16(_mm512_sub_ps(x->M, Mn));
                    x->l = _mm512_mul_ps(x->l, al);
                    for (int64_t d = 0; d < hd; d++)
                        _mm512_store_ps(x->ob + d * 16, _mm512_mul_ps(_mm512_load_ps(x->ob + d * 16), al));
                    x->M = Mn;
                    lb = _mm512_setzero_ps();
                    amx_weights(sb, pb, cv, x->M, diag, x->limv, k0, 0, AMX_KB, &lb, &xm);
                }
                x->l = _mm512_add_ps(x->l, lb);
                if (kb + 1 < x->nkb) continue;
                /* the row tile's last block: its P V, then the rows out */
                for (int64_t t = 0; t < ndt; t++) amx_pv_tile(a, pb, x->ob, k0, kvh, t);
                const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), x->l);
                for (int64_t d = 0; d < hd; d++)
                    _mm512_store_ps(x->ob + d * 16, _mm512_mul_ps(_mm512_load_ps(x->ob + d * 16), inv));
                if (acc) amx_share_pass(a, x->qt, x->sbuf, kvh, x->nkb, x->M, inv, x->limv, x->nr, acc);
                const __m512i didx = _mm512_mullo_epi32(lane, _mm512_set1_epi32(16));
                for (int64_t r = 0; r < x->nr; r++) {  /* O^T -> the rows of out */
                    uint16_t *orow = a->out + ((x->r0 + r) * H + h) * hd;
                    for (int64_t d0 = 0; d0 < hd; d0 += 16) {
                        const __m512 o = _mm512_i32gather_ps(_mm512_add_epi32(didx, _mm512_set1_epi32((int)r)), x->ob + d0 * 16, 4);
                        _mm256_storeu_si256((__m256i *)(orow + d0), (__m256i)_mm512_cvtneps_pbh(o));
                    }
                }
            }
        }
    }
    _tile_release();
    if (acc) {  /* after the loop's barrier: every task is done */
        #pragma omp critical
        for (int64_t t = 0; t < T; t++) a->share[t] += acc[t];
        free(acc);
    }
    for (int u = 0; u < AMX_RT; u++) {
        free(R[u].sbuf);
        free(R[u].pt);
        free(R[u].qt);
        free(R[u].ob);
    }
}
#undef AMX_PB

/* q/out bf16 [Nq, H, hd], qpos [Nq] ascending, k/v bf16 [T, KV, hd]; hd a multiple of 32 up to
   256, H a multiple of KV, scale > 0. Only where `agentmem_amx_ok` returned 1. */
void agentmem_rows_attn_amx(const uint16_t *q, const int64_t *qpos, const uint16_t *k, const uint16_t *v,
                            uint16_t *out, int64_t Nq, int64_t H, int64_t KV, int64_t hd, int64_t T, float scale,
                            int threads, float *share) {
    if (Nq <= 0 || T <= 0) return;
    const int64_t TP = (T + AMX_KB - 1) / AMX_KB * AMX_KB, np = hd / 2, nc = TP / 32;
    uint16_t *vt = (uint16_t *)aligned_alloc(64, (size_t)KV * TP * hd * 2);
    float *vn = share ? (float *)aligned_alloc(64, (size_t)KV * TP * 4) : NULL;  /* |v| per KV head and key */
    if (vn) bf16_value_norms(v, T, KV, hd, vn, TP, threads);
    uint16_t *kt = (uint16_t *)aligned_alloc(64, (size_t)KV * AMX_KB * hd * 2);
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                          30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < KV * nc; blk++) {  /* V^T in 32-key chunks: [KV][TP/32][hd][32] */
        const int64_t kvh = blk / nc, t0 = (blk % nc) * 32;
        uint16_t *dst = vt + blk * hd * 32;
        const int64_t n = T - t0;  /* keys of the chunk that exist */
        const __mmask16 m0 = n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
        const __mmask16 m1 = n >= 32 ? 0xffff : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1);
        const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32((int)(KV * np)));
        const uint32_t *b0 = (const uint32_t *)(v + (t0 * KV + kvh) * hd);
        const uint32_t *b1 = (const uint32_t *)(v + ((t0 + 16) * KV + kvh) * hd);
        for (int64_t p = 0; p < np; p++) {
            const __m512i ip = _mm512_add_epi32(idx, _mm512_set1_epi32((int)p));
            const __m512i g0 = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m0, ip, b0, 4);
            const __m512i g1 = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m1, ip, b1, 4);
            _mm512_store_si512(dst + 2 * p * 32, _mm512_permutex2var_epi16(g0, even, g1));
            _mm512_store_si512(dst + (2 * p + 1) * 32, _mm512_permutex2var_epi16(g0, odd, g1));
        }
    }
    const int64_t tail0 = T / AMX_KB * AMX_KB;  /* the partial block's keys, zero padded: [KV][KB][hd] */
    for (int64_t kvh = 0; kvh < KV; kvh++)
        for (int64_t j = 0; j < AMX_KB; j++) {
            uint16_t *dst = kt + (kvh * AMX_KB + j) * hd;
            if (tail0 + j < T) memcpy(dst, k + ((tail0 + j) * KV + kvh) * hd, (size_t)hd * 2);
            else memset(dst, 0, (size_t)hd * 2);
        }
    amx_args a = {q, k, kt, vt, qpos, out, Nq, H, KV, hd, T, TP, scale * 1.4426950408889634f, vn, share};
    #pragma omp parallel num_threads(threads)
    amx_attn_team(&a);
    free(vt);
    free(kt);
    free(vn);
}
""".replace("@DA_CHUNK@", DECODE_CHUNK_C).replace("@Q4_VNNI@", Q4_VNNI_C)

_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]
_P, _I, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {  # the library's functions and their arguments
    "agentmem_gemv": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I32, _I32],
    "agentmem_gemv_q8i16": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I32, _I32],
    "agentmem_gemv_q8u8": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I32, _I32],
    "agentmem_rms_norm_bf16": [_P, _I, _P, _P, _I, _I, ctypes.c_float],
    "agentmem_rope_bf16": [_P, _I, _P, _P, _P, _I, _I, _I],
    "agentmem_decode_attn_bf16": [_P] * 6 + [_I] * 5 + [ctypes.c_float, _I32],
    "agentmem_rows_attn_bf16": [_P] * 5 + [_I] * 5 + [ctypes.c_float, _I32, _P, _I32],
    "agentmem_rows_attn_amx": [_P] * 5 + [_I] * 5 + [ctypes.c_float, _I32, _P],
    "agentmem_amx_ok": ([], _I32),
    "agentmem_drift_bf16": [_P, _P, _P, _I, _P, _P, _P, _P, _I, _I],
    "agentmem_silu_mul_bf16": [_P, _I, _P, _I, _I],
    "agentmem_gemv_q4u8": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I32, _I32],
    "agentmem_qkv_q8u8": [_P, _P, ctypes.c_float, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I32, _I32],
    "agentmem_layer_q8u8": [_P, _P, _P, _P, ctypes.c_float, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I,
                            ctypes.c_float, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I32, _I32],
    "agentmem_finish_q8u8": [_P, _I, _P, _P, _P, _P, _P, ctypes.c_float, _P, _P, _P, _P, _I, _I, _I, _I, _I32,
                             _I32],
    "agentmem_layers_q8u8": [_P, _P, _I, _P, ctypes.c_float, _P, _P, _P, _P, _I, _P, _P, _P, _I, ctypes.c_float]
                            + [_I] * 6 + [_I32, _I32],
}
_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()
why_not: str | None = None  # why the kernel is not in use, once `load` has been tried


def _cpu_ok() -> bool:
    return "avx512_bf16" in cpu_flags()


def load(cache_dir: Path | str | None = None) -> ctypes.CDLL | None:
    """The compiled kernel (built into `<cache_dir>/kernels` the first time), or None."""
    return load_once(sys.modules[__name__], "gemv_bf16", _cpu_ok, "AVX512-BF16", cache_dir)


def load_once(module: types.ModuleType, name: str, cpu_ok: Callable[[], bool], needs: str,
              cache_dir: Path | str | None) -> ctypes.CDLL | None:
    """`load` of a kernel module (this one, `cpu_avx2`): the library of its `_SOURCE`, `_FLAGS`
    and `_SIGNATURES` (`build`, as `name`), or None. Tried once a process, under the module's
    `_lock`: the library stays in its `_lib` (what `loaded` returns) and why there is none in its
    `why_not`. AGENTMEM_GEMV=off, or a CPU without what the kernels need (`cpu_ok` false; `needs`
    names it), leaves None without building."""
    with module._lock:
        if module._tried:
            return module._lib
        module._tried = True
        if os.environ.get("AGENTMEM_GEMV", "on") == "off":
            module.why_not = "AGENTMEM_GEMV=off"
            return None
        if not cpu_ok():
            module.why_not = f"the CPU has no {needs}"
            return None
        module._lib, module.why_not = build(name, module._SOURCE, module._FLAGS, module._SIGNATURES, cache_dir)
        return module._lib


def build(name: str, source: str, flags: list[str], signatures: dict, cache_dir: Path | str | None
          ) -> tuple[ctypes.CDLL | None, str | None]:
    """C `source` compiled with `flags` by the system's compiler into `<cache_dir>/kernels/<name>-<hash>.so`
    (once: the file is kept) and loaded, its functions typed by `signatures` (name -> argtypes,
    or (argtypes, restype) for one that returns a value); (library, None), or (None, why not)
    with a warning."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        why = "no C compiler (cc/gcc) on PATH"
        log.info("agentmem: %s kernels off: %s", name, why)
        return None, why
    tag = hashlib.sha256((source + " ".join(flags) + cc).encode()).hexdigest()[:16]
    base = kernel_cache(cache_dir)
    so = base / "kernels" / f"{name}-{tag}.so"
    try:
        if not so.exists():
            so.parent.mkdir(parents=True, exist_ok=True)
            src = so.with_suffix(".c")
            src.write_text(source)
            tmp = so.with_suffix(f".{os.getpid()}.tmp")
            subprocess.run([cc, *flags, str(src), "-o", str(tmp)], check=True, capture_output=True, timeout=120)
            os.replace(tmp, so)
        lib = ctypes.CDLL(str(so))
        for fn_name, spec in signatures.items():  # argument types, or (argument types, return type)
            fn = getattr(lib, fn_name)
            fn.argtypes, fn.restype = spec if isinstance(spec, tuple) else (spec, None)
        return lib, None
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        why = f"{type(exc).__name__}: {exc} {err.decode(errors='replace')[:300]}".strip()
        log.warning("agentmem: %s kernels off, using torch's products: %s", name, why)
        return None, why


def kernel_cache(cache_dir: Path | str | None) -> Path:
    """Where kernel builds and their timings go: `cache_dir`, or a folder of the temp dir."""
    return Path(cache_dir).expanduser() if cache_dir is not None else Path(tempfile.gettempdir()) / "agentmem"


COLD_COPIES = 48  # 85 MB of int8 weights: more than a last-level cache, as a decode streams them


def cold_int8_seconds(candidates: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., object]]],
                      dtype: torch.dtype) -> dict[str, float]:
    """Seconds per product of each candidate `name -> (pack, multiply)` over COLD_COPIES
    3,072 x 576 int8 weights read cold, one row's product plus eight rows' (rows in `dtype`),
    every (candidate, rows) timed in turns (`best_seconds_each`): what the int8 route and tile
    choices compare. `multiply(packed, scale, x)` runs one product."""
    g = torch.Generator().manual_seed(0)
    n, k = 3072, 576
    q = [torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8) for _ in range(COLD_COPIES)]
    scale = torch.full((n,), 1e-3)
    rows = {m: torch.randn(m, k, generator=g).to(dtype) for m in (1, 8)}
    packed = {c: [pack_fn(w) for w in q] for c, (pack_fn, _) in candidates.items()}
    runs = {(c, m): (lambda c=c, x=x: [candidates[c][1](p, scale, x) for p in packed[c]])
            for c in candidates for m, x in rows.items()}
    each = best_seconds_each(runs, 6, COLD_COPIES)
    return {c: sum(t for (c_, _m), t in each.items() if c_ == c) for c in candidates}


def source_tag(prefix: str, source: str, flags: list[str]) -> str:
    """A kernel library's identity (a hash of its source and build flags)."""
    return prefix + "-" + hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:12]


Q8_ROUTES = ("bf16", "i16", "u8")
# how int8 weights multiply few rows: widened to bf16, or the rows quantized to int16 or int8
# on VNNI (`choose_q8`); a projection's GEMV layout follows the route when it is built
q8_route = "bf16"


def vnni() -> bool:
    return "avx512_vnni" in cpu_flags()


U8_FUSED_SLACK = 1.25  # u8's products may be this much slower than the fastest route's: it has the fused layer


def pick_q8(times: dict[str, float]) -> str:
    """The route `choose_q8` takes from its products' times: u8 unless another is more than
    U8_FUSED_SLACK faster."""
    best = min(times, key=times.get)
    return "u8" if "u8" in times and times["u8"] <= U8_FUSED_SLACK * times[best] else best


def choose_q8(cache_dir: Path | str) -> str:
    """How the int8 GEMV multiplies, for `q8_route`: "bf16" (the weights widened to bf16 in
    registers, `vdpbf16ps`), "i16" (the input rows quantized to int16, `vpdpwssd`) or "u8"
    (the rows quantized to int8 in blocks of U8_BLOCK inputs, `vpdpbusd`); the last two need
    AVX512-VNNI. AGENTMEM_GEMV_Q8 = auto (the default: the fastest over cold weights, one-row
    and eight-row products timed together, once per machine and remembered under `cache_dir`)
    | bf16 | i16 | u8.

    On a 2-core Xeon VM (avx512_bf16, no AMX) a model's 120 int8 products took, at one row,
    6.3-6.8 ms widened, 3.7-4.5 as i16 and 2.9-3.7 as u8; at eight rows 16.3-17.3, 5.8-6.0
    and 4.6-5.2: widening costs five instructions per 32 weights, sign-extending to int16 one,
    and `vpdpbusd` makes twice the products of `vpdpwssd` on the one port both run on. The
    int16 rows keep 14 bits per row's largest value; the int8 ones 8 bits per block's, which
    cost SmolLM2 +0.5% decode perplexity against i16 (8.491 against 8.452, teacher-forced one
    token a step; bf16 weights 8.486), and one scale per whole row +3% (so: blocks).
    `bench engine` measures the route it runs (`decode_perplexity`).

    Only the u8 route has the fused decode layer (`layer_q8u8`, `qkv_q8u8`, `finish_q8u8`: a
    layer of decode rows in one C call), which the products alone do not time. So u8 is taken
    unless another route's products are U8_FUSED_SLACK faster. On a 2-core Zen 4 VM the three
    routes' products were within 8% of each other (i16 180, u8 186, bf16 194 us), i16 was
    taken, and decode ran at 71-74 tok/s against u8's 122 (session 33)."""
    global q8_route
    mode = os.environ.get("AGENTMEM_GEMV_Q8", "auto")
    if mode not in ("auto", *Q8_ROUTES):
        raise ValueError(f"AGENTMEM_GEMV_Q8 must be auto, bf16, i16 or u8, got {mode!r}")
    if _lib is None or not vnni():
        q8_route = "bf16"
        return q8_route
    if mode != "auto":
        q8_route = mode
        return q8_route
    key = f"q8-fused|{tag()}|{torch.get_num_threads()}|{simd_flags()}"

    def measure() -> dict:
        times = cold_int8_seconds({r: (pack_u8 if r == "u8" else pack,
                                       lambda p, scale, x, r=r: gemv(_lib, p, x, scale=scale, i16=r == "i16"))
                                   for r in Q8_ROUTES}, torch.bfloat16)
        return {"route": pick_q8(times), "us": {r: round(t * 1e6, 1) for r, t in times.items()}}

    q8_route = remembered(cache_dir, "gemv-choice.json", key, measure)["route"]
    return q8_route


def tag() -> str:
    """The kernels' identity (a hash of their source and build flags): what a measurement of
    them is keyed by."""
    return source_tag("gemv", _SOURCE, _FLAGS)


def loaded() -> ctypes.CDLL | None:
    return _lib


def fits_shape(shape: tuple[int, ...]) -> bool:
    """Whether the kernels' layout takes a weight of this shape: [out, in] with out % 32 == 0
    and in even."""
    return len(shape) == 2 and shape[0] % BLOCK == 0 and shape[1] % 2 == 0


def fits(w: torch.Tensor) -> bool:
    """Whether the kernels' layout takes this weight (on the CPU, `fits_shape`), whatever its dtype."""
    return w.device.type == "cpu" and fits_shape(tuple(w.shape))


def usable(w: torch.Tensor) -> bool:
    """Whether `w` [out, in] can go through the bf16 kernel (bf16, and `fits`)."""
    return w.dtype == torch.bfloat16 and fits(w)


def pack(w: torch.Tensor) -> torch.Tensor:
    """The kernels' layout of `w` [N, K] (bf16, or int8 for `gemv_int8`): [N/16, K/2, 16, 2] (a copy)."""
    n, k = w.shape
    return w.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_u8(q: torch.Tensor) -> torch.Tensor:
    """The u8 route's layout of int8 weights q [N, K] (`agentmem_gemv_q8u8`): q + 128 as uint8,
    [N/16, K/4, 16, 4] (a 32-bit lane holds one output's four inputs)."""
    n, k = q.shape
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    return u.reshape(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


Q4_GROUP = 32  # inputs per scale and minimum of the q4 route's 4-bit weights (the C source's Q4_GROUP)


def pack_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The q4 route's layout of a weight w [N, K] as 4-bit groups of Q4_GROUP inputs (llama.cpp's
    Q4_1): per output and group an fp16 scale d = (max - min) / 15 and minimum m = min, q =
    round((w - m) / d) in 0..15, w ~ d q + m. Returns (q packed [N/16, K/8, 16, 4] uint8: the
    bytes of a 32-bit lane hold one output's inputs k..k+3 in their low nibbles and k+4..k+7 in
    their high ones; dm [N/16, K/Q4_GROUP, 2, 16] fp16: d then m for 16 outputs). A weight that
    is already of this form (read from a Q4_1 GGUF) is recovered exactly: its group's smallest
    and largest values are m and m + 15 d."""
    n, k = w.shape
    g = w.float().view(n, k // Q4_GROUP, Q4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d, m = ((hi - lo) / 15).half(), lo.half()
    df, mf = d.float()[..., None], m.float()[..., None]
    q = torch.where(df > 0, (g - mf) / torch.where(df > 0, df, 1.0), 0.0).round().clamp(0, 15).to(torch.uint8)
    qq = q.view(n // 16, 16, k // 8, 2, 4)
    packed = (qq[:, :, :, 0] | (qq[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    dm = torch.stack([d.view(n // 16, 16, -1), m.view(n // 16, 16, -1)], 2).permute(0, 3, 2, 1).contiguous()
    return packed, dm


def unpack_q4(packed: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] that `pack_q4`'s layout holds: d q + m."""
    g16, k8 = packed.shape[0], packed.shape[1]
    lo, hi = packed & 15, packed >> 4  # [N/16, K/8, 16, 4]
    q = torch.stack([lo, hi], 3).permute(0, 2, 1, 3, 4).reshape(g16 * 16, k8 * 8).float()
    n, k = q.shape
    d = dm[:, :, 0].permute(0, 2, 1).reshape(n, -1).float()
    m = dm[:, :, 1].permute(0, 2, 1).reshape(n, -1).float()
    return (q.view(n, -1, Q4_GROUP) * d[..., None] + m[..., None]).view(n, k)


def gemv_q4(lib: ctypes.CDLL, wp: torch.Tensor, dm: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, in] (bf16) @ w.T (+ bias) -> [M, out] (bf16, or fp32 with `out_dtype`) for w held
    as `pack_q4(w)` (`agentmem_gemv_q4u8`: the rows quantized to int8 as on the u8 route)."""
    n, k = wp.shape[0] * 16, wp.shape[1] * 8
    if x.shape[-1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"gemv_q4: x must be bf16 with {k} inputs, got {x.dtype} with {x.shape[-1]}")
    return run_product(lib.agentmem_gemv_q4u8, wp, dm, x, bias, n, out_dtype or x.dtype)


def run_product(fn, w: torch.Tensor, s: torch.Tensor | None, x: torch.Tensor, bias: torch.Tensor | None, n: int,
                out_dtype: torch.dtype, out_flag: bool = True) -> torch.Tensor:
    """y [M, n] in `out_dtype` from a product function of either library, called as
    fn(w, s, x, ldx, y, bias, M, n, k[, fp32 out], threads) (`out_flag`: it takes the output's
    dtype; the AVX2 library's write fp32 only), the rows' last dimension contiguous and the bias
    fp32."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=out_dtype)
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    flag = (int(out_dtype == torch.float32),) if out_flag else ()
    fn(w.data_ptr(), None if s is None else s.data_ptr(), x.data_ptr(), x.stride(0), y.data_ptr(),
       None if bias is None else bias.data_ptr(), x.shape[0], n, x.shape[1], *flag, torch.get_num_threads())
    return y


def fits_u8(w: torch.Tensor) -> bool:
    """Whether the u8 route takes a weight of this shape (`fits`, and in a multiple of its
    quantization block)."""
    return fits(w) and w.shape[1] % U8_BLOCK == 0


U8_BLOCK = 64  # inputs per scale of the u8 route's int8 rows (the C source's U8_BLOCK)


def gemv(lib: ctypes.CDLL, wp: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, scale: torch.Tensor | None = None, i16: bool = False) -> torch.Tensor:
    """x [M, in] (bf16) @ w.T (+ bias) -> [M, out] in `out_dtype` (bf16 or fp32), for `wp` =
    pack(w) of a bf16 weight, or of int8 weights q with `scale` (fp32 [out]): w = q * scale[:, None]
    (`wp` = pack(q), or pack_u8(q) for the u8 route: the input rows quantized to int8)."""
    u8 = wp.dtype == torch.uint8
    n, k = wp.shape[0] * 16, wp.shape[1] * (4 if u8 else 2)
    if x.shape[-1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"gemv: x must be bf16 with {k} inputs, got {x.dtype} with {x.shape[-1]}")
    if (scale is None) != (wp.dtype == torch.bfloat16) or (u8 and k % U8_BLOCK):
        raise ValueError(f"gemv: a {wp.dtype} weight {'takes no' if scale is not None else 'needs a'} scale")
    fn = (lib.agentmem_gemv_q8u8 if u8 else lib.agentmem_gemv_q8i16 if i16 and scale is not None
          else lib.agentmem_gemv)
    return run_product(fn, wp, scale, x, bias, n, out_dtype or x.dtype)


def gemv_int8(lib: ctypes.CDLL, qp: torch.Tensor, scale: torch.Tensor, x: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, i16: bool = False) -> torch.Tensor:
    """`gemv` of int8 weights: x @ (q * scale[:, None]).T (+ bias), for `qp` = pack(q). With
    `i16` (AVX512-VNNI, `vnni()`), the input rows are quantized to int16 and multiplied on
    vpdpwssd (`agentmem_gemv_q8i16`) instead of the weights being widened to bf16."""
    return gemv(lib, qp, x, bias, out_dtype, scale=scale, i16=i16)


# The ops both libraries hold, for bf16 rows here and fp32 rows in `cpu_avx2`: one function an
# op, given the library's C function (and the dtype of the rows it reads), serves both; each
# library's public wrapper names its own.


def norm_rows(fn: Callable[..., None], dtype: torch.dtype, x: torch.Tensor, weight: torch.Tensor,
              eps: float) -> torch.Tensor:
    """RMSNorm of rows x [M, D] (`dtype`, as `weight` [D]) by `fn` (a library's
    `agentmem_*rms_norm*`) in one call, into a new contiguous [M, D] tensor of `dtype`."""
    if x.dim() != 2 or x.stride(-1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty(x.shape, dtype=dtype)
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
    return y


def rope_takes(x: torch.Tensor, cos: torch.Tensor, dtype: torch.dtype, multiple: int) -> bool:
    """Whether a library's `rope` takes x [N, heads, hd] (`dtype` on the CPU, each head's dims
    contiguous and heads adjacent, hd a multiple of `multiple`) with fp32 tables [N, hd]."""
    return (x.dtype == dtype and x.device.type == "cpu" and x.dim() == 3 and cos.dim() == 2
            and x.shape[-1] % multiple == 0 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
            and cos.dtype == torch.float32 and cos.shape == (x.shape[0], x.shape[-1]))


def rotate_rows(fn: Callable[..., None], dtype: torch.dtype, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, heads, hd] (`dtype`) rotated by its positions' tables (`Rotary.cos_sin`) by `fn` (a
    library's `agentmem_*rope*`), into `out` (contiguous, x's shape and `dtype`) or a new
    contiguous tensor (`rope_takes` must hold)."""
    n, heads, hd = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty(n, heads, hd, dtype=dtype) if out is None else out
    fn(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), n, heads, hd)
    return y


MAX_GROUP = 32  # query heads per KV head the bf16 attention kernel takes (the fp32 one, any)
MAX_HEAD_DIM = 256


def attention_takes(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int,
                    kernel_dtype: torch.dtype, multiple: int, max_group: int | None) -> bool:
    """Whether a library's `decode_attention` takes such a query and pool: `kernel_dtype` on the
    CPU, head_dim a multiple of `multiple` up to MAX_HEAD_DIM, query heads a multiple of the KV
    heads and at most `max_group` of them per KV head (None: any number)."""
    return (dtype == kernel_dtype and device.type == "cpu" and head_dim % multiple == 0
            and head_dim <= MAX_HEAD_DIM and heads % kv_heads == 0
            and (max_group is None or heads // kv_heads <= max_group))


def attend_pool(fn: Callable[..., None], q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                idx: torch.Tensor, keep: torch.Tensor, scale: float | None) -> torch.Tensor:
    """One decode query per row over its keys in the paged pool by `fn` (a library's
    `agentmem_decode_attn_*`): q [B, H, hd]; k_pool/v_pool [..., KV, hd] (contiguous, q's dtype);
    idx [B * W] flat slots; keep [B, W] (or [B, 1, 1, W]) which of them the row sees. Returns
    [B, H, hd] in q's dtype."""
    b, h, hd = q.shape
    kv = k_pool.shape[-2]
    w = keep.numel() // b
    if idx.numel() != b * w:
        raise ValueError(f"decode_attention: {idx.numel()} slots for {b} rows of {w} keys")
    if keep.numel() != b * w:
        raise ValueError(f"decode_attention: {keep.numel()} keep flags for {b} rows")
    # the engine passes idx (int64) and keep (uint8), contiguous, made once a step: no conversions then
    if idx.dtype != torch.int64 or not idx.is_contiguous():
        idx = idx.to(torch.int64).contiguous()
    if keep.dtype != torch.uint8 or not keep.is_contiguous():
        keep = keep.to(torch.uint8).contiguous()
    if not q.is_contiguous():
        q = q.contiguous()
    out = torch.empty_like(q)
    fn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), idx.data_ptr(), keep.data_ptr(), out.data_ptr(),
       b, h, kv, hd, w, hd ** -0.5 if scale is None else scale, torch.get_num_threads())
    return out


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of bf16 rows x [M, D] by a bf16 weight [D], rounded as `layers.rms_norm` rounds."""
    return norm_rows(lib.agentmem_rms_norm_bf16, torch.bfloat16, x, weight, eps)


def rope_usable(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rope` takes x [N, heads, hd] (bf16 on the CPU, each head's dims contiguous and
    heads adjacent, hd a multiple of 32) with fp32 tables [N, hd]."""
    return rope_takes(x, cos, torch.bfloat16, 32)


def rope(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, hd] rotated by its positions' tables (`Rotary.cos_sin`), as `layers.rotate`
    computes it, into a new contiguous bf16 tensor (`rope_usable` must hold)."""
    return rotate_rows(lib.agentmem_rope_bf16, torch.bfloat16, x, cos, sin)


def rope_into(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """`rope` of x [N, heads, hd] written into `out` (a contiguous bf16 tensor of x's shape, e.g. a
    slice of the blend's K of one layer) instead of a new tensor (`rope_usable` must hold)."""
    if not (rope_usable(x, cos) and out.dtype == torch.bfloat16 and out.shape == x.shape and out.is_contiguous()):
        raise ValueError(f"rope_into: x {x.dtype} {tuple(x.shape)}, out {out.dtype} {tuple(out.shape)}")
    rotate_rows(lib.agentmem_rope_bf16, torch.bfloat16, x, cos, sin, out=out)


def silu_mul(lib: ctypes.CDLL, gu: torch.Tensor) -> torch.Tensor:
    """silu(g) * u of bf16 rows gu [N, 2I] (g = gu[:, :I], u = gu[:, I:]; each row contiguous),
    as torch's two ops compute and round it, in one call: [N, I] bf16."""
    return silu_rows(lib.agentmem_silu_mul_bf16, torch.bfloat16, gu)


def silu_rows(fn: Callable[..., None], dtype: torch.dtype, gu: torch.Tensor) -> torch.Tensor:
    """silu(g) * u of rows gu [N, 2I] (`dtype` on the CPU, each row contiguous) by `fn` (a
    library's `agentmem_*silu_mul*`) in one call: [N, I] of `dtype`."""
    n, two_i = gu.shape
    if gu.dtype != dtype or gu.device.type != "cpu" or two_i % 2 or gu.stride(1) != 1:
        raise ValueError(f"silu_mul: gu {gu.dtype} {tuple(gu.shape)} strides {gu.stride()}")
    y = torch.empty(n, two_i // 2, dtype=dtype)
    fn(gu.data_ptr(), gu.stride(0), y.data_ptr(), n, two_i // 2)
    return y


MAX_FINISH_ROWS = 8  # the fused halves' rows (one tile of the u8 products)


def _fused_rows(h: torch.Tensor, norm_w: torch.Tensor) -> bool:
    """Rows the fused layer functions take: 1 to MAX_FINISH_ROWS contiguous bf16 rows on the
    CPU, normed by a bf16 weight."""
    return (h.dtype == norm_w.dtype == torch.bfloat16 and h.device.type == "cpu" and h.dim() == 2
            and 0 < h.shape[0] <= MAX_FINISH_ROWS and h.is_contiguous())


def _on_u8(*projs) -> bool:
    """Whether every `Proj` is on one route of the fused layer functions, without a bias: int8
    on the u8 route, or int4 on the q4 route (their GEMV layouts built)."""
    routes = {p.q8_route if p.fmt in ("int8", "int4") else None for p in projs}
    return (len(routes) == 1 and routes <= {"u8", "q4"}
            and all(p.w_gemv is not None and p.bias is None for p in projs))


def q4_flag(p) -> int:
    """Both libraries' fused layer calls' `q4` argument for a projection on their routes: 1 for
    4-bit weights (the q4 layout), 0 for int8."""
    return int(p.q8_route == "q4")


def finish_takes(h: torch.Tensor, attn: torch.Tensor, projs: tuple, norm_w: torch.Tensor) -> bool:
    """Whether `finish_q8u8` takes this layer's second half: `_fused_rows`, contiguous bf16
    attention rows, and o, gate/up and down all `_on_u8`."""
    return _fused_rows(h, norm_w) and attn.dtype == torch.bfloat16 and attn.is_contiguous() and _on_u8(*projs)


def qkv_takes(h: torch.Tensor, qkv, norm_w: torch.Tensor, cos: torch.Tensor, hd: int) -> bool:
    """Whether `qkv_q8u8` takes these rows: `_fused_rows`, the fused qkv projection `_on_u8`,
    and fp32 RoPE tables [M, hd] (hd a multiple of 32)."""
    return (_fused_rows(h, norm_w) and _on_u8(qkv) and hd % 32 == 0
            and cos.dtype == torch.float32 and cos.shape == (h.shape[0], hd))


def qkv_q8u8(lib: ctypes.CDLL, h: torch.Tensor, norm_w: torch.Tensor, eps: float, qkv, cos: torch.Tensor,
             sin: torch.Tensor, qk_heads: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The un-rotated q, k, v of decode rows h [M, D] ([M, heads, hd], as `Block.qkv_fused`)
    and the first `qk_heads` of them (q and k) rotated ([M, qk_heads, hd], as `rotate`), in one
    call (`agentmem_qkv_q8u8`, `qkv_takes`), bit-identical to the three calls it replaces."""
    m, d = h.shape
    out = torch.empty(m, qkv.out_features // hd, hd, dtype=torch.bfloat16)
    qk = torch.empty(m, qk_heads, hd, dtype=torch.bfloat16)
    cos, sin = cos.contiguous(), sin.contiguous()
    lib.agentmem_qkv_q8u8(h.data_ptr(), norm_w.data_ptr(), eps, qkv.w_gemv.data_ptr(), qkv.scale.data_ptr(),
                          cos.data_ptr(), sin.data_ptr(), out.data_ptr(), qk.data_ptr(), m, d, qkv.out_features,
                          qk_heads, hd, q4_flag(qkv), torch.get_num_threads())
    return out, qk


def finish_q8u8(lib: ctypes.CDLL, h: torch.Tensor, attn: torch.Tensor, o, gate_up, down, norm_w: torch.Tensor,
                eps: float) -> torch.Tensor:
    """`Block.finish` of few decode rows in one C call (`agentmem_finish_q8u8`): h + o(attn),
    then the SwiGLU MLP of its RMSNorm added, bit-identical to the separate calls. h [M, D] and
    attn [M, H*hd] bf16 (`finish_takes`); o, gate_up, down: the layer's int8 `Proj`s."""
    m, d = h.shape
    out = torch.empty_like(h)
    lib.agentmem_finish_q8u8(attn.data_ptr(), attn.shape[1], h.data_ptr(), out.data_ptr(),
                             o.w_gemv.data_ptr(), o.scale.data_ptr(), norm_w.data_ptr(), eps,
                             gate_up.w_gemv.data_ptr(), gate_up.scale.data_ptr(), down.w_gemv.data_ptr(),
                             down.scale.data_ptr(), m, attn.shape[1], d, down.in_features, q4_flag(down),
                             torch.get_num_threads())
    return out


def _u8_block_takes(block) -> bool:
    """The parts of `layer_q8u8`'s conditions that depend on the block alone (its weights'
    formats and options): what `layers_q8u8` checks once per model."""
    a = block.args
    return (_on_u8(block.qkv_p, block.o_p, block.gate_up_p, block.down_p) and block.q_norm is None
            and block.input_norm.eps == block.post_norm.eps
            and block.input_norm.weight.dtype == block.post_norm.weight.dtype == torch.bfloat16
            and block.input_norm.weight.is_contiguous() and block.post_norm.weight.is_contiguous()
            and a.sliding_window is None and a.head_dim % 32 == 0 and a.head_dim <= MAX_HEAD_DIM
            and a.n_heads % a.n_kv_heads == 0 and a.n_heads // a.n_kv_heads <= MAX_GROUP)


def decode_step_takes(h: torch.Tensor, dtype: torch.dtype, max_rows: int, pool_dtypes: tuple, hd: int,
                      cos: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                      idx: torch.Tensor, keep: torch.Tensor) -> bool:
    """Whether a fused decode call (a layer, or every layer of the step) takes this step: 1 to
    `max_rows` contiguous rows of `dtype` on the CPU, fp32 RoPE tables [M, hd], a contiguous
    pool in one of `pool_dtypes` (K and V alike), and the rows' slot tables. This library's
    calls (bf16 rows and pool) and cpu_avx2's (fp32 rows, fp32 or fp16 pool) share it."""
    m = h.shape[0] if h.dim() == 2 else 0
    w = keep.numel() // max(m, 1)
    return (h.dtype == dtype and h.device.type == "cpu" and 0 < m <= max_rows and h.is_contiguous()
            and cos.dtype == torch.float32 and cos.shape == (m, hd)
            and k_pool.dtype == v_pool.dtype and k_pool.dtype in pool_dtypes and k_pool.is_contiguous()
            and v_pool.is_contiguous() and slots.dtype == idx.dtype == torch.int64 and keep.dtype == torch.uint8
            and slots.numel() == m and idx.numel() == keep.numel() == m * w and idx.is_contiguous()
            and keep.is_contiguous())


def _u8_step_takes(h: torch.Tensor, hd: int, *pool_and_tables: torch.Tensor) -> bool:
    """`decode_step_takes` for bf16 rows (at most MAX_FINISH_ROWS) over a bf16 pool."""
    return decode_step_takes(h, torch.bfloat16, MAX_FINISH_ROWS, (torch.bfloat16,), hd, *pool_and_tables)


def layer_q8u8(lib: ctypes.CDLL, block, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor,
               keep: torch.Tensor) -> torch.Tensor | None:
    """A whole decoder layer (`Block.forward`) for decode rows h [M, D] in one call
    (`agentmem_layer_q8u8`): norm, qkv, RoPE, the rows' K/V written to this layer's paged pool
    (k_pool/v_pool [..., KV, hd]) at `slots` [M], the decode attention over each row's keys
    (idx [M * W] flat slots, keep [M, W] uint8, as `decode_attention`), then `finish`;
    bit-identical to the separate calls. None where it does not take these (the caller runs
    the separate calls)."""
    a = block.args
    m = h.shape[0] if h.dim() == 2 else 0
    w = keep.numel() // max(m, 1)
    if not (_u8_step_takes(h, a.head_dim, cos, k_pool, v_pool, slots, idx, keep) and _u8_block_takes(block)):
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = slots.contiguous()
    out = torch.empty_like(h)
    lib.agentmem_layer_q8u8(h.data_ptr(), out.data_ptr(), block.input_norm.weight.data_ptr(),
                            block.post_norm.weight.data_ptr(), block.input_norm.eps, block.qkv_p.w_gemv.data_ptr(),
                            block.qkv_p.scale.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_pool.data_ptr(),
                            v_pool.data_ptr(), slots.data_ptr(), idx.data_ptr(), keep.data_ptr(), w,
                            a.head_dim ** -0.5, block.o_p.w_gemv.data_ptr(), block.o_p.scale.data_ptr(),
                            block.gate_up_p.w_gemv.data_ptr(), block.gate_up_p.scale.data_ptr(),
                            block.down_p.w_gemv.data_ptr(), block.down_p.scale.data_ptr(), m, h.shape[1],
                            a.n_heads, a.n_kv_heads, a.head_dim, block.down_p.in_features, q4_flag(block.down_p),
                            torch.get_num_threads())
    return out


def layer_table(model, attr: str, takes: Callable, ptrs: Callable):
    """The table of every layer's weight pointers a whole-step decode call reads (`ptrs(block)`
    a layer, side by side), kept on the model as `attr` (reset by `Transformer.pack`); False,
    kept too, when a layer is not taken (`takes(block)`), or the layers' norms differ in eps or
    their weights in format (the call takes one `q4` flag for all: `q4_flag`)."""
    table = getattr(model, attr, None)
    if table is None:
        blocks = list(model.layers)
        ok = (bool(blocks) and all(takes(b) for b in blocks) and len({b.input_norm.eps for b in blocks}) == 1
              and len({q4_flag(p) for b in blocks for p in (b.qkv_p, b.o_p, b.gate_up_p, b.down_p)}) == 1)
        flat = [p for b in blocks for p in ptrs(b)] if ok else []
        table = (ctypes.c_void_p * len(flat))(*flat) if ok else False
        setattr(model, attr, table)
    return table


def _u8_layer_ptrs(block) -> list[int]:
    """A block's weights in `agentmem_layer_q8u8`'s order (U8_LAYER_PTRS of them)."""
    q, o, gu, d = block.qkv_p, block.o_p, block.gate_up_p, block.down_p
    return [block.input_norm.weight.data_ptr(), block.post_norm.weight.data_ptr(), q.w_gemv.data_ptr(),
            q.scale.data_ptr(), o.w_gemv.data_ptr(), o.scale.data_ptr(), gu.w_gemv.data_ptr(), gu.scale.data_ptr(),
            d.w_gemv.data_ptr(), d.scale.data_ptr()]


def layers_q8u8(lib: ctypes.CDLL, model, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool,
                slots: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
    """Every decoder layer of a decode step (`Transformer.forward`'s loop) in one C call
    (`agentmem_layers_q8u8`: `layer_q8u8` a layer, one team of threads and one scratch for the
    step, no Python between the layers): bf16 rows h [M, D] in, the last layer's out; pool: the
    runner's KVPool (k/v [L, slots, KV, hd]). The table of the layers' weight pointers is built
    once a model (`model._u8_layers`, reset by `pack`); None where a layer or the step is not
    taken (the caller runs the layers one by one). Bit-identical to them."""
    table = layer_table(model, "_u8_layers", _u8_block_takes, _u8_layer_ptrs)
    a = model.args
    if table is False or not _u8_step_takes(h, a.head_dim, cos, pool.k, pool.v, slots, idx, keep):
        return None
    m = h.shape[0]
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty_like(h)
    lib.agentmem_layers_q8u8(
        h.data_ptr(), out.data_ptr(), a.n_layers, table, model.layers[0].input_norm.eps, cos.data_ptr(),
        sin.data_ptr(), pool.k.data_ptr(), pool.v.data_ptr(), pool.k[0].numel(), slots.contiguous().data_ptr(),
        idx.data_ptr(), keep.data_ptr(), keep.numel() // m, a.head_dim ** -0.5, m, h.shape[1], a.n_heads,
        a.n_kv_heads, a.head_dim, model.layers[0].down_p.in_features, q4_flag(model.layers[0].down_p),
        torch.get_num_threads())
    return out


def drift_usable(k: torch.Tensor) -> bool:
    """Whether `drift` takes a layer's K (and V) [T, KV, hd]: bf16, contiguous, on the CPU, hd a
    multiple of 32."""
    return (k.dtype == torch.bfloat16 and k.device.type == "cpu" and k.dim() == 3 and k.is_contiguous()
            and k.shape[-1] % 32 == 0)


def drift(lib: ctypes.CDLL, k: torch.Tensor, v: torch.Tensor, spans: torch.Tensor, dk: torch.Tensor,
          dv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> None:
    """Add each group's mean drift to its span of one layer's k, v [T, KV, hd] in place (bf16;
    `drift_usable`): v += dv[g], k += dk[g] rotated to each position by the fp32 tables
    [positions, hd] (`Rotary`'s whole tables). spans int64 [G, 2] (first, end); dk, dv fp32
    [G, KV, hd]. What kvreuse's `_Drift.apply` computes in torch, in one call."""
    g = spans.shape[0]
    if not (drift_usable(k) and v.shape == k.shape and v.dtype == k.dtype and v.is_contiguous()
            and dk.shape == dv.shape == (g, *k.shape[1:]) and dk.dtype == dv.dtype == torch.float32
            and cos_table.dtype == sin_table.dtype == torch.float32 and cos_table.shape[-1] == k.shape[-1]
            and (g == 0 or int(spans.max()) <= min(k.shape[0], cos_table.shape[0]))):
        raise ValueError(f"drift: k {k.dtype} {tuple(k.shape)}, v {tuple(v.shape)}, spans {tuple(spans.shape)}, "
                         f"dk {dk.dtype} {tuple(dk.shape)}, tables {tuple(cos_table.shape)}")
    spans = spans.to(torch.int64).contiguous()
    dk, dv = dk.contiguous(), dv.contiguous()
    cos_table, sin_table = cos_table.contiguous(), sin_table.contiguous()
    lib.agentmem_drift_bf16(k.data_ptr(), v.data_ptr(), spans.data_ptr(), g, dk.data_ptr(), dv.data_ptr(),
                            cos_table.data_ptr(), sin_table.data_ptr(), k.shape[1], k.shape[2])


def attention_usable(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `decode_attention` takes such a query and pool: bf16 on the CPU, head_dim a
    multiple of 32 up to 256, at most 32 query heads per KV head."""
    return attention_takes(dtype, device, heads, kv_heads, head_dim, torch.bfloat16, 32, MAX_GROUP)


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     idx: torch.Tensor, keep: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One decode query per row over its keys in the paged pool: q [B, H, hd]; k_pool/v_pool
    [..., KV, hd] (contiguous); idx [B * W] flat slots; keep [B, W] (or [B, 1, 1, W]) which of
    them the row sees. Returns [B, H, hd] (bf16). What `paged_attention` computes with
    gathers and SDPA, in one pass over the keys (attention_usable must hold). idx as int64
    and keep as uint8, both contiguous, are used as they are (the engine makes them once a step)."""
    return attend_pool(lib.agentmem_decode_attn_bf16, q, k_pool, v_pool, idx, keep, scale)


def rows_kernel(q: torch.Tensor, k: torch.Tensor, route: str = "kernel") -> ctypes.CDLL | None:
    """The library where `rows_attention` ("kernel") or `rows_attention_amx` ("amx") takes such
    q [Nq, H, hd] and k [T, KV, hd] (bf16 on the CPU, `attention_usable`) and is this machine's
    way for them (`rows_route`), else None."""
    lib = _lib
    if lib is None or q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or q.dim() != 3 or k.dim() != 3:
        return None
    if not attention_usable(q.dtype, q.device, q.shape[1], k.shape[1], q.shape[2]):
        return None
    return lib if rows_route(q.shape[1], k.shape[1], q.shape[2]) == route else None


def rows_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                share: torch.Tensor | None = None) -> torch.Tensor | None:
    """Causal attention of bf16 query rows at `q_pos` over k/v by this machine's C way for the
    shapes (`rows_route`: the vdpbf16ps kernel, or AMX tiles where they measured faster), or
    None where the route is torch's SDPA (the caller runs it). Both C ways add the kvreuse
    probe's per-key signal to `share` where it is given."""
    if (lib := rows_kernel(q, k)) is not None:
        return rows_attention(lib, q, k, v, q_pos, share=share)
    if (lib := rows_kernel(q, k, "amx")) is not None:
        return rows_attention_amx(lib, q, k, v, q_pos, share=share)
    return None


def widen_rows(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether bf16 rows attention of these shapes runs faster widened to fp32 (SDPA) here."""
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.dim() == 3 and k.dim() == 3
            and rows_route(q.shape[1], k.shape[1], q.shape[2]) == "fp32")


ATTN_MODES = {"on": "kernel", "off": "bf16", "bf16": "bf16", "fp32": "fp32", "amx": "amx"}  # AGENTMEM_ATTN_KERNEL -> route
_ROUTES: dict[tuple[int, int, int], str] = {}  # (heads, kv_heads, head_dim) -> the route measured


def rows_route(heads: int, kv_heads: int, head_dim: int) -> str:
    """How causal attention of bf16 query rows runs: "kernel" (`rows_attention`), "amx"
    (`rows_attention_amx`, AMX tiles), "fp32" (q, k and v widened for torch's SDPA) or "bf16"
    (SDPA in bf16). AGENTMEM_ATTN_KERNEL = auto (the default: what `choose_rows_route` measured
    for these shapes, else the kernel) | on (the kernel) | off (SDPA in bf16) | fp32 | amx (where
    `amx_usable`, else bf16 SDPA)."""
    mode = os.environ.get("AGENTMEM_ATTN_KERNEL", "auto")
    if mode == "auto":
        return _ROUTES.get((heads, kv_heads, head_dim), "kernel")
    if mode not in ATTN_MODES:
        raise ValueError(f"AGENTMEM_ATTN_KERNEL must be auto, {', '.join(ATTN_MODES)}, got {mode!r}")
    if mode == "amx" and not amx_usable(_lib):
        return "bf16"
    return ATTN_MODES[mode]


def choose_rows_route(cache_dir: Path | str, heads: int, kv_heads: int, head_dim: int) -> str:
    """Time a 2,048-token causal prefill's attention (four 512-row chunks) with the kernel,
    widened to fp32, through SDPA in bf16 and on AMX tiles (`amx_usable`), once per machine and shape (remembered under
    `cache_dir`), and keep the fastest for `rows_route`. No way wins everywhere: on the AMD
    EPYC VMs the kernel ran 2,048 tokens 3x faster than SDPA; on a Xeon VM with avx512_bf16
    (no AMX), where vdpbf16ps issues at half the rate of fp32 FMAs, it took 50 ms a layer
    against fp32 SDPA's 36; on a Xeon VM with AMX, bf16 SDPA (oneDNN's AMX flash attention)
    took 13 ms against the kernel's 40 and fp32's 33 (session 31), and where AMX is usable the
    engine's own AMX kernel is a fourth candidate: 4.7-5.2 ms against bf16 SDPA's 12 there
    (session 32)."""
    if _lib is None or not attention_usable(torch.bfloat16, torch.device("cpu"), heads, kv_heads, head_dim):
        return "bf16"
    from ..model_runner import sdpa_chunk  # lazy: the runner imports this module

    key = f"rows-attention-4|{tag()}|{torch.__version__}|{heads},{kv_heads},{head_dim}|{torch.get_num_threads()}|" \
          + simd_flags()

    def measure() -> dict:
        n, chunk = 2048, 512
        g = torch.Generator().manual_seed(0)
        q = torch.randn(n, heads, head_dim, generator=g).to(torch.bfloat16)
        k = torch.randn(n, kv_heads, head_dim, generator=g).to(torch.bfloat16)
        v = torch.randn(n, kv_heads, head_dim, generator=g).to(torch.bfloat16)
        pos = torch.arange(n)

        def kernel():
            for s in range(0, n, chunk):
                rows_attention(_lib, q[s:s + chunk], k[:s + chunk], v[:s + chunk], pos[s:s + chunk])

        def widened():
            qf, kf, vf = q.float(), k.float(), v.float()
            for s in range(0, n, chunk):  # what attend_chunk does with the route fp32
                sdpa_chunk(qf[s:s + chunk], kf[:s + chunk], vf[:s + chunk], s).to(torch.bfloat16)

        def bf16():
            for s in range(0, n, chunk):  # the route bf16
                sdpa_chunk(q[s:s + chunk], k[:s + chunk], v[:s + chunk], s)

        def amx():
            for s in range(0, n, chunk):
                rows_attention_amx(_lib, q[s:s + chunk], k[:s + chunk], v[:s + chunk], pos[s:s + chunk])

        runs = (("kernel", kernel), ("fp32", widened), ("bf16", bf16)) + ((("amx", amx),) if amx_usable(_lib) else ())
        times = best_seconds_each(dict(runs), 3)
        return {"route": min(times, key=times.get), "ms": {k_: round(t * 1e3, 2) for k_, t in times.items()}}

    route = remembered(cache_dir, "attention-choice.json", key, measure)["route"]
    _ROUTES[(heads, kv_heads, head_dim)] = route
    return route


def p_split() -> bool:
    """Whether `rows_attention` multiplies V by each softmax weight as two bf16 (hi + lo, ~16 bits:
    AGENTMEM_ATTN_P=split) or as one (bf16, the default), as flash attention does on GPUs."""
    mode = os.environ.get("AGENTMEM_ATTN_P", "bf16")
    if mode not in ("bf16", "split"):
        raise ValueError(f"AGENTMEM_ATTN_P must be bf16 or split, got {mode!r}")
    return mode == "split"


def rows_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                   scale: float | None = None, share: torch.Tensor | None = None,
                   split: bool | None = None) -> torch.Tensor:
    """Causal attention of query rows q [Nq, H, hd] at ascending positions `q_pos` [Nq] over
    keys k/v [T, KV, hd] at positions 0..T-1 (a query sees the keys at or before its own
    position): a prefill chunk (q_pos = start..start+n-1) or CacheBlend's recomputed rows.
    bf16 in and out, fp32 scores and softmax (`attention_usable` must hold for the shapes).
    What `sdpa` with a causal mask computes, on vdpbf16ps (kernels/cpu_gemv.py's C source).
    `share` (fp32 [T], contiguous): added to, per key, its attention weight times the norm of
    its value, summed over the rows and heads (what the kvreuse probe ranks cached tokens by)."""
    nq, h, hd = q.shape
    t, kv = k.shape[0], k.shape[1]
    if v.shape != k.shape or k.shape[-1] != hd or q_pos.shape != (nq,):
        raise ValueError(f"rows_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"q_pos {tuple(q_pos.shape)}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_pos = q_pos.to(torch.int64).contiguous()
    if share is not None and (share.dtype != torch.float32 or share.shape != (t,) or not share.is_contiguous()):
        raise ValueError(f"rows_attention: share must be a contiguous fp32 [{t}], got {share.dtype} "
                         f"{tuple(share.shape)}")
    out = torch.empty_like(q)
    lib.agentmem_rows_attn_bf16(q.data_ptr(), q_pos.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                nq, h, kv, hd, t, hd ** -0.5 if scale is None else scale, torch.get_num_threads(),
                                None if share is None else share.data_ptr(), int(p_split() if split is None else split))
    return out


_amx: bool | None = None  # `amx_usable`, once asked of a loaded library


def amx_usable(lib: ctypes.CDLL | None = None) -> bool:
    """Whether `rows_attention_amx` runs here: the CPU has AMX (amx_bf16 and amx_tile) and the
    kernel's library (`lib`, else the loaded one) got the process's permission to use the tiles
    (`agentmem_amx_ok`: Linux asks each process to request it). Asked once a process; False,
    not remembered, while no library is loaded."""
    global _amx
    if _amx is None:
        lib = lib if lib is not None else _lib
        if lib is None:
            return False
        flags = cpu_flags()
        ok = False
        if "amx_bf16" in flags and "amx_tile" in flags:
            ok = lib.agentmem_amx_ok() == 1
        _amx = ok
    return _amx


def rows_attention_amx(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                       scale: float | None = None, share: torch.Tensor | None = None) -> torch.Tensor:
    """`rows_attention` on AMX tiles: causal attention of bf16 query rows q [Nq, H, hd] at
    ascending positions `q_pos` [Nq] over keys k/v [T, KV, hd] at 0..T-1, fp32 scores and
    softmax, bf16 out; flash-attention style (QK^T and PV on TDPBF16PS, the online softmax in
    AVX-512; see the C source). head_dim a multiple of 32 up to 256, H a multiple of KV, scale
    > 0; only where `amx_usable()` holds. `share` (fp32 [T], contiguous), as `rows_attention`'s:
    added to, per key, its attention weight times the norm of its value, summed over the rows
    and heads (the kvreuse probe's signal; a second pass over each row tile's keys once its
    softmax is final)."""
    nq, h, hd = q.shape
    t, kv = k.shape[0], k.shape[1]
    if v.shape != k.shape or k.shape[-1] != hd or q_pos.shape != (nq,):
        raise ValueError(f"rows_attention_amx: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"q_pos {tuple(q_pos.shape)}")
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or q.device.type != "cpu":
        raise ValueError(f"rows_attention_amx: bf16 CPU tensors only, got {q.dtype}, {k.dtype}, {v.dtype} on {q.device}")
    if hd % 32 or not 0 < hd <= 256 or kv == 0 or h % kv:
        raise ValueError(f"rows_attention_amx: head_dim {hd} (a multiple of 32 up to 256), heads {h}, kv_heads {kv}")
    scale = hd ** -0.5 if scale is None else scale
    if not scale > 0:
        raise ValueError(f"rows_attention_amx: scale must be > 0, got {scale}")
    if share is not None and (share.dtype != torch.float32 or share.shape != (t,) or not share.is_contiguous()
                              or share.device.type != "cpu"):
        raise ValueError(f"rows_attention_amx: share must be a contiguous fp32 [{t}] on the CPU, got {share.dtype} "
                         f"{tuple(share.shape)}")
    if not amx_usable(lib):  # the tile instructions would fault
        raise RuntimeError("rows_attention_amx: no AMX here (see amx_usable)")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_pos = q_pos.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    lib.agentmem_rows_attn_amx(q.data_ptr(), q_pos.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                               nq, h, kv, hd, t, scale, torch.get_num_threads(),
                               None if share is None else share.data_ptr())
    return out


# decode attention as one opaque op, so that the compiled decode step (compiled.py) calls the
# kernel too; it reads the pool after the step's K/V write, which the graph orders before it
_OPS = torch.library.Library("agentmem", "FRAGMENT")
_OPS.define("decode_attn(Tensor q, Tensor k_pool, Tensor v_pool, Tensor idx, Tensor keep) -> Tensor")


def _decode_attn(q, k_pool, v_pool, idx, keep):
    if q.dtype == torch.float32:  # fp32 rows: the AVX2 library's kernel (compiled.paged_attention)
        from . import cpu_avx2

        return cpu_avx2.decode_attention(cpu_avx2.loaded(), q, k_pool, v_pool, idx, keep)
    return decode_attention(_lib, q, k_pool, v_pool, idx, keep)


_OPS.impl("decode_attn", _decode_attn, "CPU")


@torch.library.register_fake("agentmem::decode_attn")
def _(q, k_pool, v_pool, idx, keep):
    return torch.empty_like(q)

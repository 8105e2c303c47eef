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

Built once by the system's C compiler into the cache dir and loaded with ctypes
(`cpu_gemv.build`), as the AVX-512 library is; without AVX2/FMA or a compiler, `load` returns
None, says why, and int8 stays with torch's product.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from ..measured import cpu_flags
from . import cpu_gemv

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
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

/* `mb` (1-4) int16 rows of a 16-output group (wg: [K/2][16][2] int8) into y (fp32):
   y = sum * s[n] * xs[i] (+ b[n]). */
static inline __attribute__((always_inline)) void tile(const int8_t *wg, int64_t K, const int16_t *x, const int mb,
                                                       float *y, int64_t N, int64_t n, const float *s,
                                                       const float *xs, const float *b) {
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
        const __m256 r = _mm256_set1_ps(xs[i]);
        for (int h = 0; h < 2; h++) {
            __m256 v = _mm256_mul_ps(f[i][h], _mm256_mul_ps(_mm256_loadu_ps(s + n + 8 * h), r));
            if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + n + 8 * h));
            _mm256_storeu_ps(y + i * N + n + 8 * h, v);
        }
    }
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
    const int64_t groups = N / 16;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *wg = w + g * 16 * K;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int16_t *xm = xq + m0 * K;
            float *ym = y + m0 * N;
            switch (M - m0 < 4 ? M - m0 : 4) {
                case 4: tile(wg, K, xm, 4, ym, N, g * 16, scale, xs + m0, b); break;
                case 3: tile(wg, K, xm, 3, ym, N, g * 16, scale, xs + m0, b); break;
                case 2: tile(wg, K, xm, 2, ym, N, g * 16, scale, xs + m0, b); break;
                default: tile(wg, K, xm, 1, ym, N, g * 16, scale, xs + m0, b); break;
            }
        }
    }
    if (xq != stack) free(xq);
}
"""

_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
_P, _I, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {"agentmem_avx2_gemv_q8": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I32]}
MAX_ROWS = cpu_gemv.MAX_ROWS  # input rows up to which Proj uses the kernel (decode batches)
_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()
why_not: str | None = None  # why the kernel is not in use, once `load` has been tried


def cpu_ok() -> bool:
    """AVX2 and FMA. The engine loads this library only for fp32 rows (`Engine.load`: on a CPU
    with AVX512-BF16 it runs bf16 and `cpu_gemv`'s kernels), but it builds and runs on any."""
    return {"avx2", "fma"} <= cpu_flags()


def load(cache_dir: Path | str | None = None) -> ctypes.CDLL | None:
    """The compiled kernel (built into `<cache_dir>/kernels` the first time), or None."""
    global _lib, _tried, why_not
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("AGENTMEM_GEMV", "on") == "off":
            why_not = "AGENTMEM_GEMV=off"
            return None
        if not cpu_ok():
            why_not = "the CPU has no AVX2/FMA"
            return None
        _lib, why_not = cpu_gemv.build("gemv_avx2", _SOURCE, _FLAGS, _SIGNATURES, cache_dir)
        return _lib


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
    if x.stride(-1) != 1:
        x = x.contiguous()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    lib.agentmem_avx2_gemv_q8(qp.data_ptr(), scale.data_ptr(), x.data_ptr(), x.stride(0), y.data_ptr(),
                              None if bias is None else bias.data_ptr(), x.shape[0], n, k,
                              torch.get_num_threads())
    return y

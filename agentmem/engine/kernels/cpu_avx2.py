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
(`cpu_gemv.load_once`), as the AVX-512 library is; without AVX2/FMA or a compiler, `load`
returns None, says why, and int8 stays with torch's product.

The same library holds fp32 RMSNorm, RoPE and decode attention; their Python wrappers are
`cpu_gemv`'s, given this library's C functions and fp32.
"""

from __future__ import annotations

import ctypes
import sys
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
   [slots, KV, hd], idx [B, W] flat slots, keep [B, W] which of them row b sees; out [B, H, hd].
   A task is one (row, KV head) and its G = H / KV query heads: scores 8 keys at a time (one
   transposed sum), the softmax in place, then the weighted sum of V 64 dims at a time in
   registers. hd a multiple of 8, up to 256. */
void agentmem_avx2_decode_attn_f32(const float *q, const float *kp, const float *vp, const int64_t *idx,
                                   const uint8_t *keep, float *out, int64_t B, int64_t H, int64_t KV, int64_t hd,
                                   int64_t W, float scale, int threads) {
    const int64_t G = H / KV, nd = hd / 8;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < B * KV; task++) {
        const int64_t b = task / KV, kvh = task % KV;
        int64_t *slot = (int64_t *)malloc((W + 8) * sizeof(int64_t));
        float *s = (float *)malloc((G * W + 8) * sizeof(float));
        int64_t nv = 0;
        for (int64_t j = 0; j < W; j++)
            if (keep[b * W + j]) slot[nv++] = idx[b * W + j];
        const float *qg = q + (b * H + kvh * G) * hd;
        int64_t t0 = 0;
        for (; t0 + 8 <= nv; t0 += 8) {
            const float *k[8];
            for (int j = 0; j < 8; j++) k[j] = kp + (slot[t0 + j] * KV + kvh) * hd;
            for (int64_t g = 0; g < G; g++) {
                __m256 a[8];
                for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
                for (int64_t d = 0; d < hd; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qg + g * hd + d);
                    for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(k[j] + d), qv, a[j]);
                }
                _mm256_storeu_ps(s + g * W + t0, _mm256_mul_ps(hsum8x8(a), _mm256_set1_ps(scale)));
            }
        }
        for (int64_t t = t0; t < nv; t++) {  /* the last keys one at a time */
            const float *k = kp + (slot[t] * KV + kvh) * hd;
            for (int64_t g = 0; g < G; g++) {
                __m256 a = _mm256_setzero_ps();
                for (int64_t d = 0; d < hd; d += 8)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(k + d), _mm256_loadu_ps(qg + g * hd + d), a);
                s[g * W + t] = hsum8(a) * scale;
            }
        }
        for (int64_t g = 0; g < G; g++) {  /* softmax in place */
            float *sg = s + g * W;
            float m = -INFINITY, sum = 0.0f;
            for (int64_t t = 0; t < nv; t++) m = sg[t] > m ? sg[t] : m;
            const __m256 mv = _mm256_set1_ps(m);
            __m256 acc = _mm256_setzero_ps();
            int64_t t = 0;
            for (; t + 8 <= nv; t += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
                _mm256_storeu_ps(sg + t, e);
                acc = _mm256_add_ps(acc, e);
            }
            sum = hsum8(acc);
            for (; t < nv; t++) {
                sg[t] = expf(sg[t] - m);
                sum += sg[t];
            }
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            const __m256 iv = _mm256_set1_ps(inv);
            for (t = 0; t + 8 <= nv; t += 8) _mm256_storeu_ps(sg + t, _mm256_mul_ps(_mm256_loadu_ps(sg + t), iv));
            for (; t < nv; t++) sg[t] *= inv;
        }
        for (int64_t g = 0; g < G; g++) {  /* the weighted sum of V, 8 vectors of dims at a time */
            float *og = out + (b * H + kvh * G + g) * hd;
            const float *sg = s + g * W;
            for (int64_t d0 = 0; d0 < nd; d0 += 8) {
                const int64_t n8 = nd - d0 < 8 ? nd - d0 : 8;
                __m256 o[8];
                for (int j = 0; j < 8; j++) o[j] = _mm256_setzero_ps();
                for (int64_t t = 0; t < nv; t++) {
                    const float *v = vp + (slot[t] * KV + kvh) * hd + 8 * d0;
                    const __m256 p = _mm256_set1_ps(sg[t]);
                    if (n8 == 8) {
                        for (int j = 0; j < 8; j++) o[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * j), o[j]);
                    } else {
                        for (int j = 0; j < n8; j++) o[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * j), o[j]);
                    }
                }
                for (int j = 0; j < n8; j++) _mm256_storeu_ps(og + 8 * (d0 + j), o[j]);
            }
        }
        free(slot);
        free(s);
    }
}
"""

_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
_P, _I, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "agentmem_avx2_gemv_q8": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I32],
    "agentmem_avx2_rms_norm_f32": [_P, _I, _P, _P, _I, _I, ctypes.c_float],
    "agentmem_avx2_rope_f32": [_P, _I, _P, _P, _P, _I, _I, _I],
    "agentmem_avx2_decode_attn_f32": [_P] * 6 + [_I] * 5 + [ctypes.c_float, _I32],
}
MAX_ROWS = cpu_gemv.MAX_ROWS  # rows up to which RMSNorm takes the kernel (decode batches)
# Rows up to which Proj's int8 product takes the kernel: past decode's 16, a blend probe's
# question rows and a short prompt's too. On the Zen 3 VM (session 30, 2 threads) the kernel
# against the fp32 copy's torch.mm at 16 / 24 / 32 / 48 / 64 rows: gate_up (3072 x 576) 0.49 /
# 0.61 / 0.82 / 1.28 / 1.63 ms against 0.78 / 0.90 / 1.16 / 1.54 / 2.04; down (576 x 1536) 0.21 /
# 0.32 / 0.42 / 0.63 / 0.92 against 0.28 / 0.39 / 0.48 / 0.70 / 0.79; qkv (960 x 576) even at 64.
PRODUCT_MAX_ROWS = 48
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
    return cpu_gemv.load_once(sys.modules[__name__], "gemv_avx2", cpu_ok, "AVX2/FMA", cache_dir)


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


def attention_usable(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `decode_attention` takes such a query and pool: fp32 on the CPU, head_dim a
    multiple of 8 up to 256 (any number of query heads per KV head)."""
    return cpu_gemv.attention_takes(dtype, device, heads, kv_heads, head_dim, torch.float32, 8, None)


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     idx: torch.Tensor, keep: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """`cpu_gemv.decode_attention` for fp32: one decode query per row over its keys in the
    paged pool (q [B, H, hd]; pools [..., KV, hd], contiguous; idx [B * W] flat slots; keep
    [B, W] which of them the row sees). Returns [B, H, hd]."""
    return cpu_gemv.attend_pool(lib.agentmem_avx2_decode_attn_f32, q, k_pool, v_pool, idx, keep, scale)

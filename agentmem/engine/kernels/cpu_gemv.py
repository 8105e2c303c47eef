"""A bf16 matrix-vector product for few-row products on CPUs with AVX512-BF16: what a decode
step spends most of its time in.

A decode step multiplies one row (one per stream) by every weight of the model, so it is
bound by the bytes of weights read. oneDNN's packed bf16 product, the engine's default,
read them at 19 GB/s over a whole SmolLM2-135M token (121 products, 13.9 ms) on the 2-core
AMD EPYC where a plain read runs at 34 GB/s: each product is short (0.6-3.5 MB) and pays a
fixed set-up cost. This one reads them at 22 GB/s (12.0 ms); the 56 MB LM head alone at
32 GB/s, the layers' small products stay slower (huge pages for them gave 24 GB/s). This kernel reads the weight [out, in] as stored, four rows at a time, with
`vdpbf16ps` (bf16 pairs multiplied and summed into fp32) for each of up to 16 input rows,
the rows split between the OpenMP threads torch uses (the same libgomp, so the same pool).

It is C compiled once by the system's C compiler (the one inductor uses) into the cache dir
and loaded with ctypes (`Engine.load` does it; `loaded` is what Proj uses); without a compiler, AVX512-BF16, or where the build fails, `load`
returns None, says why once, and the engine keeps oneDNN.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("agentmem.engine")

# input rows up to which the kernel beats oneDNN: over a whole SmolLM2-135M token of bf16
# products (cold weights), 1 row 12.0 ms against 13.9, 8 rows 17.6 against 15.6
MAX_ROWS = 4

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

static inline void put(void *y, int64_t i, float v, int f32) {
    if (f32) ((float *)y)[i] = v;
    else ((uint16_t *)y)[i] = to_bf16(v);
}

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]): w bf16 [N, K] row-major, x bf16 [M, K] with
   rows `ldx` apart, y [M, N] (fp32 if f32, else bf16); K a multiple of 32. */
void agentmem_gemv_bf16(const uint16_t *w, const uint16_t *x, int64_t ldx, void *y, const float *b,
                        int64_t M, int64_t N, int64_t K, int f32, int threads) {
    const int64_t blocks = (N + 3) / 4;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t n = blk * 4;
        if (n + 4 <= N) {
            const uint16_t *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
            for (int64_t m = 0; m < M; m++) {
                const uint16_t *xm = x + m * ldx;
                __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
                __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
                for (int64_t k = 0; k < K; k += 32) {
                    __m512bh xk = (__m512bh)_mm512_loadu_si512(xm + k);
                    if (m == 0) {  /* the rows 8 ahead: the prefetcher stops at each 4 KB page */
                        _mm_prefetch((const char *)(w0 + 8 * K + k), _MM_HINT_T0);
                        _mm_prefetch((const char *)(w1 + 8 * K + k), _MM_HINT_T0);
                        _mm_prefetch((const char *)(w2 + 8 * K + k), _MM_HINT_T0);
                        _mm_prefetch((const char *)(w3 + 8 * K + k), _MM_HINT_T0);
                    }
                    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w0 + k), xk);
                    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w1 + k), xk);
                    a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w2 + k), xk);
                    a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w3 + k), xk);
                }
                float r0 = _mm512_reduce_add_ps(a0), r1 = _mm512_reduce_add_ps(a1);
                float r2 = _mm512_reduce_add_ps(a2), r3 = _mm512_reduce_add_ps(a3);
                if (b) { r0 += b[n]; r1 += b[n + 1]; r2 += b[n + 2]; r3 += b[n + 3]; }
                put(y, m * N + n, r0, f32);
                put(y, m * N + n + 1, r1, f32);
                put(y, m * N + n + 2, r2, f32);
                put(y, m * N + n + 3, r3, f32);
            }
        } else {
            for (int64_t r = n; r < N; r++) {
                for (int64_t m = 0; m < M; m++) {
                    __m512 a = _mm512_setzero_ps();
                    for (int64_t k = 0; k < K; k += 32)
                        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + r * K + k),
                                             (__m512bh)_mm512_loadu_si512(x + m * ldx + k));
                    put(y, m * N + r, _mm512_reduce_add_ps(a) + (b ? b[r] : 0.0f), f32);
                }
            }
        }
    }
}
"""

_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()
why_not: str | None = None  # why the kernel is not in use, once `load` has been tried


def _cpu_ok() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


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
        if not _cpu_ok():
            why_not = "the CPU has no AVX512-BF16"
            return None
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            why_not = "no C compiler (cc/gcc) on PATH"
            log.info("agentmem: bf16 GEMV kernel off: %s", why_not)
            return None
        tag = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + cc).encode()).hexdigest()[:16]
        base = Path(cache_dir).expanduser() if cache_dir is not None else Path(tempfile.gettempdir()) / "agentmem"
        so = base / "kernels" / f"gemv_bf16-{tag}.so"
        try:
            if not so.exists():
                so.parent.mkdir(parents=True, exist_ok=True)
                src = so.with_suffix(".c")
                src.write_text(_SOURCE)
                tmp = so.with_suffix(f".{os.getpid()}.tmp")
                subprocess.run([cc, *_FLAGS, str(src), "-o", str(tmp)], check=True, capture_output=True, timeout=120)
                os.replace(tmp, so)
            lib = ctypes.CDLL(str(so))
            fn = lib.agentmem_gemv_bf16
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
            fn.restype = None
            _lib = lib
        except (OSError, subprocess.SubprocessError) as exc:
            err = getattr(exc, "stderr", b"") or b""
            why_not = f"{type(exc).__name__}: {exc} {err.decode(errors='replace')[:300]}".strip()
            log.warning("agentmem: bf16 GEMV kernel off, using oneDNN: %s", why_not)
        return _lib


def loaded() -> ctypes.CDLL | None:
    return _lib


def usable(w: torch.Tensor) -> bool:
    """Whether `w` [out, in] can go through the kernel (bf16, CPU, contiguous, in % 32 == 0)."""
    return (w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2 and w.is_contiguous()
            and w.shape[1] % 32 == 0)


def gemv(lib: ctypes.CDLL, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, in] (bf16, M <= MAX_ROWS) @ w.T (+ bias) -> [M, out] in `out_dtype` (bf16 or fp32)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out_dtype = out_dtype or x.dtype
    m, n = x.shape[0], w.shape[0]
    y = torch.empty(m, n, dtype=out_dtype)
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    lib.agentmem_gemv_bf16(w.data_ptr(), x.data_ptr(), x.stride(0), y.data_ptr(),
                           None if bias is None else bias.data_ptr(), m, n, w.shape[1],
                           int(out_dtype == torch.float32), torch.get_num_threads())
    return y

"""Compiles the CPU kernel libraries from their C sources (`csrc/`) and loads them with ctypes.

Each library is one translation unit, `csrc/bf16.c` (bf16 rows, AVX512-BF16) or `csrc/fp32.c`
(fp32 rows, AVX2), that #includes its kernel files; a variant is that file built with its own
flags (`VARIANTS`). The system's C compiler (the one inductor uses) builds each variant once into
`<cache_dir>/kernels/<name>-<hash>.so`, the hash taken over the text of every source file the
unit includes, the flags and the compiler, so an edited source or another compiler builds anew
and an unchanged one is loaded as it is. Without a compiler, or where the build or the load
fails, there is no library: the caller says why once and the engine keeps torch's ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import types
from collections.abc import Callable
from pathlib import Path

from ...config import engine_switch

log = logging.getLogger("agentmem.engine")

CSRC = Path(__file__).with_name("csrc")
BF16_SOURCE = CSRC / "bf16.c"
FP32_SOURCE = CSRC / "fp32.c"
BF16_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]
# -ffp-contract=off: no product and sum merged into an FMA behind the code's back, so that an inlined
# function rounds alike at every call site (the fused layer and the separate calls give the same bits)
AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-DAGENTMEM_AVX512"]
# the fp32 library's AVX-512 product tiles, added to AVX2_FLAGS (`cpu_fp32.wide_tile`)
VNNI512_FLAGS = _AVX512_FLAGS + ["-mavx512vnni", "-DAGENTMEM_VNNI512"]
AVX512BW_FLAGS = _AVX512_FLAGS + ["-DAGENTMEM_AVX512BW"]
VARIANTS = {  # every build the engine may load: (cache name, translation unit, flags)
    "bf16": ("gemv_bf16", BF16_SOURCE, BF16_FLAGS),
    "avx2": ("gemv_avx2", FP32_SOURCE, AVX2_FLAGS),
    "vnni512": ("gemv_avx2", FP32_SOURCE, AVX2_FLAGS + VNNI512_FLAGS),
    "avx512bw": ("gemv_avx2", FP32_SOURCE, AVX2_FLAGS + AVX512BW_FLAGS),
}

_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def sources(unit: Path) -> list[Path]:
    """The files a translation unit is built from: itself and every file it includes with quotes,
    transitively, each once, in the order they are first included."""
    seen: list[Path] = []

    def visit(path: Path) -> None:
        path = path.resolve()
        if path in seen:
            return
        seen.append(path)
        for name in _LOCAL_INCLUDE.findall(path.read_text()):
            visit(path.parent / name)

    visit(unit)
    return seen


def _digest(unit: Path) -> str:
    """A hash of the text of every file `unit` is built from, each named relative to the unit."""
    h = hashlib.sha256()
    top = unit.resolve().parent
    for path in sources(unit):
        h.update(f"{os.path.relpath(path, top)}\n".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def source_tag(prefix: str, unit: Path, flags: list[str]) -> str:
    """A kernel library's identity (a hash of its sources and build flags): what measurements of
    it are keyed by."""
    return prefix + "-" + hashlib.sha256((_digest(unit) + " ".join(flags)).encode()).hexdigest()[:12]


def kernel_cache(cache_dir: Path | str | None) -> Path:
    """Where kernel builds and their timings go: `cache_dir`, or a folder of the temp dir."""
    return Path(cache_dir).expanduser() if cache_dir is not None else Path(tempfile.gettempdir()) / "agentmem"


def build(name: str, unit: Path, flags: list[str], signatures: dict, cache_dir: Path | str | None,
          timeout: float = 120) -> tuple[ctypes.CDLL | None, str | None]:
    """The translation unit `unit` compiled with `flags` by the system's compiler into
    `<cache_dir>/kernels/<name>-<hash>.so` (once: the file is kept) and loaded, its functions
    typed by `signatures` (name -> argtypes, or (argtypes, restype) for one that returns a value);
    (library, None), or (None, why not) with a warning, also where the compiler takes more than
    `timeout` seconds."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        why = "no C compiler (cc/gcc) on PATH"
        log.info("agentmem: %s kernels off: %s", name, why)
        return None, why
    try:
        tag = hashlib.sha256((_digest(unit) + " ".join(flags) + cc).encode()).hexdigest()[:16]
        so = kernel_cache(cache_dir) / "kernels" / f"{name}-{tag}.so"
        if not so.exists():
            so.parent.mkdir(parents=True, exist_ok=True)
            tmp = so.with_suffix(f".{os.getpid()}.tmp")
            subprocess.run([cc, *flags, str(unit), "-o", str(tmp)], check=True, capture_output=True,
                           timeout=timeout)
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


def load_once(module: types.ModuleType, name: str, cpu_ok: Callable[[], bool], needs: str,
              cache_dir: Path | str | None) -> ctypes.CDLL | None:
    """`load` of a kernel library module (`cpu_bf16`, `cpu_fp32`): the library of its `_SOURCE`,
    `_FLAGS` and `_SIGNATURES` (`build`, as `name`), or None. Tried once a process, under the
    module's `_lock`: the library stays in its `_lib` (what `loaded` returns) and why there is
    none in its `why_not`. AGENTMEM_GEMV=off, or a CPU without what the kernels need (`cpu_ok`
    false; `needs` names it), leaves None without building."""
    with module._lock:
        if module._tried:
            return module._lib
        module._tried = True
        if engine_switch("GEMV") == "off":
            module.why_not = "AGENTMEM_GEMV=off"
            return None
        if not cpu_ok():
            module.why_not = f"the CPU has no {needs}"
            return None
        module._lib, module.why_not = build(name, module._SOURCE, module._FLAGS, module._SIGNATURES,
                                            cache_dir)
        return module._lib

"""Choices the engine makes by timing this machine once, remembered under the cache dir.

The fastest way to run a path differs between CPUs that report the same features (oneDNN's
bf16 GEMM is 2.5x fp32 on a Zen 5 EPYC and half of it on a Xeon without AMX), so the engine
times the candidates on first use and keeps the answer in a small JSON file per kind of
choice (`weights-choice.json`, `gemv-choice.json`, `attention-choice.json`), keyed by what
would change it: the torch version, the shapes, the threads, the CPU's SIMD flags and the
kernels' source. A file that cannot be read is measured again; one that cannot be written
costs a measurement per process, nothing else.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux; empty elsewhere), read once: the int8 prefill product
    asks at every call whether oneDNN has native bf16, and reading /proc/cpuinfo takes ~50 us."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def simd_flags() -> str:
    """The CPU's avx / amx / fma flags, sorted: what a measurement is keyed by."""
    return " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))))


def remembered(cache_dir: Path | str, name: str, key: str, measure: Callable[[], dict],
               valid: Callable[[dict], bool] = lambda entry: True) -> dict:
    """The entry `key` of `<cache_dir>/<name>`, made by `measure()` (and saved) when absent or
    not `valid` (e.g. made by an earlier rule)."""
    memo = Path(cache_dir).expanduser() / name
    try:
        saved = json.loads(memo.read_text())
    except (OSError, ValueError):
        saved = {}
    entry = saved.get(key)
    if isinstance(entry, dict) and valid(entry):
        return entry
    saved[key] = entry = measure()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(json.dumps(saved, indent=1))
    except OSError:
        pass
    return entry


def best_seconds(fn: Callable[[], object], repeats: int, per: int = 1) -> float:
    """The best of `repeats` wall-clock timings of `fn()` (after one warm-up call), divided by `per`."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best / per

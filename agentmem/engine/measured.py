"""Choices the engine makes by timing this machine once, remembered under the cache dir.

The fastest way to run a path differs between CPUs that report the same features (oneDNN's
bf16 GEMM is 2.5x fp32 on a Zen 5 EPYC and half of it on a Xeon without AMX), so the engine
times the candidates on first use and keeps the answer in a small JSON file per kind of
choice (`weights-choice.json`, `gemv-choice.json`, `attention-choice.json`), keyed by what
would change it: the torch version, the shapes, the threads, the CPU's SIMD flags and the
kernels' source. A file that cannot be read is measured again; one that cannot be written
costs a measurement per process, nothing else.

A choice timed while other work holds the machine (its 1-minute load average above its core
count) is used by this process only and not saved: on a Zen 3 VM (2026-11-26) a choice made
beside another benchmark timed int8's one-row product at 577 us against fp32's 477 (quiet:
150 against 381) and, remembered, kept every later process on fp32 at a third of int8's
decode speed.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("agentmem.engine")
_UNSAVED: dict[tuple[str, str], dict] = {}  # (file, key) -> a choice timed on a busy machine, this process only


def machine_busy() -> str | None:
    """Why a timing taken now would not speak for this machine (more runnable work than cores
    over the last minute), else None; None where the load average cannot be read."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return None
    cores = os.cpu_count() or 1
    return f"load average {load:.1f} on {cores} cores" if load > cores else None


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
    not `valid` (e.g. made by an earlier rule). Measured while `machine_busy`: kept for this
    process only (the entry says why under "unsaved")."""
    memo = Path(cache_dir).expanduser() / name
    saved = read_memo(memo)
    entry = saved.get(key)
    if isinstance(entry, dict) and valid(entry):
        return entry
    entry = _UNSAVED.get((str(memo), key))
    if entry is not None and valid(entry):
        return entry
    busy = machine_busy()  # asked before timing: the timing itself adds to the load
    saved[key] = entry = measure()
    if busy is not None:
        entry["unsaved"] = busy
        _UNSAVED[(str(memo), key)] = entry
        log.warning("agentmem: %s measured while the machine was busy (%s): used by this process, not saved",
                    name, busy)
        return entry
    write_memo(memo, saved)
    return entry


def read_memo(memo: Path) -> dict:
    """A choice file's entries; {} when it is missing or cannot be read."""
    try:
        saved = json.loads(memo.read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def write_memo(memo: Path, saved: dict) -> None:
    """Write a choice file; one that cannot be written costs a measurement per process, nothing else."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(json.dumps(saved, indent=1))
    except OSError:
        pass


def best_seconds(fn: Callable[[], object], repeats: int, per: int = 1) -> float:
    """The best of `repeats` wall-clock timings of `fn()` (after one warm-up call), divided by `per`."""
    return best_seconds_each({"": fn}, repeats, per)[""]


def best_seconds_each(fns: dict[str, Callable[[], object]], repeats: int, per: int = 1) -> dict[str, float]:
    """`best_seconds` of each candidate, timed in turns (one call of each, `repeats` rounds), so
    that a burst of load from a neighbour on a shared host slows every candidate alike. Timed
    one after another instead, a 2-core Xeon VM (2026-11-27, bf16 products swinging 970-2,500
    GFLOP/s from one second to the next) ranked the int8 routes backwards: u8 238 us, i16 142,
    against 199 and 222 for the same products taken in turns."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: t / per for name, t in best.items()}

"""The OpenMP thread pools of the threads that call the engine.

torch's CPU kernels parallelise with OpenMP, and GNU OpenMP (libgomp, which torch's Linux
wheels bundle) gives every thread that starts a parallel region a pool of its own workers.
Its workers spin a while after a region before they sleep, which is what makes the many
small parallel regions of a decode step cheap; but once libgomp manages more threads than
the CPUs it may use, it stops spinning almost at once (its "throttled" spin count). On a
2-CPU machine the caller's thread (the pool it made while loading the model) and the engine
loop's thread are already one worker too many: every small kernel of the loop then waits
for a sleeping worker to wake, and decode ran at 29 tok/s instead of 42 (SmolLM2-135M,
bf16, 2-core AMD EPYC; a `silu` over 64x2048 took 73 us instead of 30).

`release_omp_pool` frees the calling thread's pool (`omp_pause_resource_all`, OpenMP 5.0).
It is called wherever a thread stops running torch work for a while: a caller handing work
to the loop and waiting, an engine loop going idle (so a second engine, e.g. an int8 one or a
benchmark's peer loop, does not slow the first), and the embedder after each call, on the
request thread or its bulk worker. A thread that runs parallel torch work again gets a new
pool (tens of microseconds). Measured on the 2-core Xeon VM (bf16): one stream decoded at
58 tok/s alone and at 29 with two other threads' idle pools alive; 57 once they released them.
GOMP_SPINCOUNT and OMP_WAIT_POLICY do not help: libgomp's throttled spin count is fixed.
"""

from __future__ import annotations

import ctypes
import os
import threading

# torch.compile traces with torch.fx, which replaces nn.Module.__call__ and __getattr__ for the
# whole process while it runs: a module called from another thread meanwhile is routed into the
# compile's tracer and fails ("module is not installed as a submodule"; session 30: the embedder,
# while the decode step compiled in the background, killed `bench memory`). So a compile holds
# this lock, and agentmem's other module calls take it: an engine loop step, Engine.logits and
# prefill_dense, the blend (kvreuse.fuse), the compressor's forward and the embedder. They wait
# out a compile (seconds, once per decode bucket and machine) instead of failing.
TRACE_LOCK = threading.RLock()

_lib: ctypes.CDLL | None | bool = None  # None: not looked up yet; False: no libgomp here
_lookup = threading.Lock()


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch already loaded (never a second copy), or None."""
    global _lib
    with _lookup:
        if _lib is None:
            _lib = False
            try:
                with open("/proc/self/maps") as f:
                    paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
                for path in sorted(paths):
                    lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                    if hasattr(lib, "omp_pause_resource_all"):
                        lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                        _lib = lib
                        break
            except (OSError, AttributeError):
                pass
        return _lib or None


def release_omp_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (no-op without libgomp, or inside a
    parallel region); True if it was released."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(1) == 0  # 1: omp_pause_soft

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

`omp_threads(n)` runs a block with `n` OpenMP threads on the calling thread only. torch's
own `torch.set_num_threads` is not per-thread state: besides this thread's OpenMP setting it
stores the count in a process-wide default that every thread copies the first time it runs
parallel torch work, so a count set around one call leaks into threads that start later (a
new request thread, an engine loop started afterwards). libgomp's `omp_set_num_threads`,
called directly, changes only the calling thread's setting (its own copy of the OpenMP
internal control variables), and torch reads that back (`at::get_num_threads` is
`omp_get_max_threads` of the calling thread; oneDNN and MKL ask the same) once the thread has
made its first torch call, which `omp_threads` makes first.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading


class TraceLock:
    """Shared by module calls, exclusive for a torch.compile trace.

    torch.compile traces with torch.fx, which replaces nn.Module.__call__ and __getattr__ for
    the whole process while it runs: a module called from another thread meanwhile is routed
    into the compile's tracer and fails ("module is not installed as a submodule"; once
    the embedder, while the decode step compiled in the background, killed `bench memory`). So
    a compile takes this lock `exclusive`, and agentmem's module calls take it `shared`: an
    engine loop step, Engine.logits and prefill_dense, the blend (kvreuse.fuse), the
    compressor's forward and the embedder. Shared holders run together (the loop decodes while
    the embedder embeds, as before); a compile waits for those in flight, new ones wait for it
    (seconds, once per decode bucket and machine), and a waiting compile goes first. A thread
    already inside (a nested call, or a loop step that compiles in the foreground) never waits
    on itself."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0  # threads inside `shared` (each counted once, however nested)
        self._writer: int | None = None
        self._waiting = 0  # compiles waiting for `exclusive`
        self._local = threading.local()

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    @contextlib.contextmanager
    def shared(self):
        me = threading.get_ident()
        if self._depth() or self._writer == me:
            self._local.depth = self._depth() + 1
            try:
                yield
            finally:
                self._local.depth -= 1
            return
        with self._cond:
            while self._writer is not None or self._waiting:
                self._cond.wait()
            self._shared += 1
        self._local.depth = 1
        try:
            yield
        finally:
            self._local.depth = 0
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        me = threading.get_ident()
        mine = 1 if self._depth() else 0  # this thread's own shared hold (a foreground compile)
        with self._cond:
            self._waiting += 1
            try:
                while self._writer is not None or self._shared - mine > 0:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._writer = me
        try:
            yield
        finally:
            with self._cond:
                self._writer = None
                self._cond.notify_all()


TRACE_LOCK = TraceLock()

_lib: ctypes.CDLL | None | bool = None  # None: not looked up yet; False: no libgomp here
_lookup = threading.Lock()


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch already loaded (never a second copy), or None.

    Other wheels bundle their own libgomp (scikit-learn, which sentence-transformers imports,
    loads `scikit_learn.libs/libgomp-*.so`): each copy is a runtime of its own, with its own
    thread pools and settings, so only torch's may be asked. Taking the first copy
    by path, as this once did, took scikit-learn's wherever the embedder had been loaded before the first
    call: pools were released and thread counts set in a runtime torch does not use."""
    global _lib
    with _lookup:
        if _lib is None:
            _lib = False
            try:
                import torch

                torch_dir = os.path.realpath(os.path.dirname(torch.__file__))
                with open("/proc/self/maps") as f:
                    paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
                mine = [p for p in paths if os.path.realpath(p).startswith(torch_dir + os.sep)]
                # a torch built against the system's libgomp has none in its own folder: then
                # the one copy loaded, if only one is
                for path in mine or (sorted(paths) if len(paths) == 1 else []):
                    lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                    if hasattr(lib, "omp_pause_resource_all"):
                        lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                        _lib = lib
                        break
            except (OSError, AttributeError, ImportError):
                pass
        return _lib or None


def release_omp_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (no-op without libgomp, or inside a
    parallel region); True if it was released."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(1) == 0  # 1: omp_pause_soft


def _set_threads(lib: ctypes.CDLL, n: int) -> None:
    lib.omp_set_num_threads(ctypes.c_int(n))


@contextlib.contextmanager
def omp_threads(n: int | None):
    """Run the block with `n` OpenMP threads on this thread, and on no other (see the module's
    docstring); n None: unchanged. Without libgomp (another OpenMP runtime), unchanged too:
    torch.set_num_threads would leak, and a slower query beats a process on one thread."""
    lib = _libgomp() if n is not None else None
    if lib is None or not hasattr(lib, "omp_set_num_threads"):
        yield
        return
    import torch

    torch.get_num_threads()  # this thread's lazy torch set-up first: it would overwrite ours
    before = int(lib.omp_get_max_threads())
    n = max(1, int(n))
    if n == before:
        yield
        return
    _set_threads(lib, n)
    try:
        yield
    finally:
        _set_threads(lib, before)

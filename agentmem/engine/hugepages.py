"""CPU tensors that a decode step streams, in memory backed by transparent huge pages.

A decode token reads every weight once (134.5 MB of int8 for SmolLM2-135M): far more than the
last-level cache, so it streams from DRAM. In 4 KB pages that stream crosses a page every 4 KB:
the CPU's hardware prefetchers stop at each page boundary, and the TLB (3,072 entries on Zen 4,
12 MB) misses all along. torch's allocator hands out 4 KB pages (THP in `madvise` mode, the
Debian default, never backs them with huge ones). So the GEMV layouts of a model's projections
are copied, in the order a decode step reads them (each layer's qkv, o, gate/up, down; then the
LM head), into one anonymous mapping advised `MADV_HUGEPAGE` and aligned to 2 MB, and the
projections use views of it. Zen 4 VM, 2026-11-27, 2 threads, the 30 layers and the LM head of
one decode token, best of 6 alternated: 6.25 -> 5.61 ms for one row, 7.98 -> 7.38 for eight.

`AGENTMEM_HUGEPAGES=off` keeps torch's own allocations (an A/B switch, read at use). Where the
kernel has no THP (or not Linux), the mapping is ordinary memory: still one sequential block.
"""

from __future__ import annotations

import logging
import mmap

import torch

from ..config import engine_switch

log = logging.getLogger(__name__)

HUGE = 2 << 20  # the x86-64 transparent huge page
ALIGN = 64  # each tensor starts on a cache line


def enabled() -> bool:
    return engine_switch("HUGEPAGES") != "off"


class Arena:
    """One block of memory holding copies of CPU tensors back to back; `views` are the copies
    (same dtypes and shapes). The block lives as long as this object or any view of it."""

    def __init__(self, tensors: list[torch.Tensor]):
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at += (n + ALIGN - 1) // ALIGN * ALIGN
        self.nbytes = at
        self.huge = False
        self._map = mmap.mmap(-1, max(at, 1) + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advise = getattr(mmap, "MADV_HUGEPAGE", None)
        if advise is not None:
            try:
                self._map.madvise(advise)
                self.huge = True
            except OSError as exc:  # a kernel built without THP
                log.info("agentmem: no transparent huge pages for the weights: %s", exc)
        block = torch.frombuffer(self._map, dtype=torch.uint8)
        start = (-block.data_ptr()) % HUGE  # the views begin on a huge page boundary
        self.views = []
        for t, off, n in zip(tensors, offsets, sizes, strict=True):
            v = block[start + off : start + off + n].view(t.dtype).view(t.shape)
            v.copy_(t)
            self.views.append(v)


def gather_weights(model) -> Arena | None:
    """Move the GEMV layouts (`Proj.w_gemv`) of `model`'s projections, in decode order, into one
    huge-page `Arena`; the projections then hold views of it. None (nothing moved) when switched
    off, when the model is not on the CPU or when no projection has such a layout."""
    if not enabled():
        return None
    projs = [p for p in model.projections() if p is not None and p.w_gemv is not None
             and p.w_gemv.device.type == "cpu" and p.w_gemv.is_contiguous()]
    if not projs:
        return None
    # 4-bit weights (the q4 route) read their groups' scales and minima beside them: those go
    # right after their projection's layout, in the same stream
    q4 = [p.q8_route == "q4" and p.scale.is_contiguous() for p in projs]
    tensors = [t for p, s in zip(projs, q4, strict=True) for t in ((p.w_gemv, p.scale) if s else (p.w_gemv,))]
    arena = Arena(tensors)
    views = iter(arena.views)
    for p, s in zip(projs, q4, strict=True):
        p.w_gemv = next(views)
        if s:
            p.scale = next(views)
    return arena

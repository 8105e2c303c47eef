"""The decode step on CUDA, replayed from captured CUDA graphs.

On a GPU a decode step of this project's small models is bound by launching kernels, not by
reading weights: SmolLM2-135M runs ~25 kernels a layer, 30 layers, and each eager launch costs
Python and driver time. On an H200 (2026-11-26) the eager engine decoded 72 tok/s against a
bandwidth bound of 14,500, HF transformers 57. torch.compile's "reduce-overhead" mode did not
help: inductor skips CUDA graphs for a graph that writes its inputs (the paged pool's K/V
`index_copy_`), so compile=on decoded 70 tok/s.

So the whole step (embedding, every layer with its pool writes and the paged Triton attention,
the LM head) is captured once per bucket with torch.cuda.CUDAGraph and replayed: one launch a
step. A bucket is (rows, table width): the batch padded to 1, 2, 4, 8, 16 or 32 rows, each
sequence's block table padded to a power of two of blocks (from 16). Every input lives in one
static int64 buffer that a step fills with one host-to-device copy; padded rows write their
K/V to the pool's scratch slot and attend to it alone. Capturing a bucket takes a warm-up run
(Triton compiles its kernels for the shape there, outside the capture) and one recorded run;
the buckets share one memory pool. A capture that raises leaves decode eager, and says why.

The engine uses it under `compile` auto or on when the device is CUDA (loop.compiled_decode);
`compile=off` decodes eagerly. Same greedy tokens as eager: tests/engine/test_cuda.py.
"""

from __future__ import annotations

import logging
import sys
import time

import torch

from .kernels import paged_decode_attention
from .kv_pool import KVPool
from .model import Transformer

log = logging.getLogger("agentmem.engine")

ROWS = (1, 2, 4, 8, 16, 32)
MIN_BLOCKS = 16


class GraphDecode:
    """Captured decode steps of one model over one KV pool, by bucket. The interface is
    CompiledDecode's (get / prefer / record / ready / failed / compile_s / measure / background),
    so the loop and the benchmark treat both alike; `run` takes block tables where
    CompiledDecode takes key slots (the runner tells them apart by type)."""

    def __init__(self, model: Transformer, pool: KVPool):
        self.model, self.pool = model, pool
        self.measure = False
        self.background = False  # captures are quick and run in the loop's thread
        self.ready: set[tuple[int, int]] = set()
        self.failed: str | None = None
        self.compile_s = 0.0  # seconds spent capturing
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._mempool = None  # one memory pool for every bucket's graph, made at the first capture
        self._scratch_block = pool.num_blocks  # KVPool keeps one block past those handed out

    @staticmethod
    def bucket(batch: int, blocks: int) -> tuple[int, int] | None:
        rows = next((r for r in ROWS if r >= batch), None)
        return None if rows is None else (rows, max(MIN_BLOCKS, 1 << max(0, blocks - 1).bit_length()))

    def get(self, batch: int, blocks: int) -> tuple[int, int] | None:
        """The bucket for `batch` rows whose longest block table has `blocks` blocks, captured
        now if it was not; None when it cannot be (too many rows, a failed capture)."""
        if self.failed is not None:
            return None
        bucket = self.bucket(batch, blocks)
        if bucket is None or bucket[1] > self.pool.num_blocks + 1:
            return None
        if bucket not in self.ready:
            self._capture(bucket)
        return bucket if bucket in self.ready else None

    def prefer(self, bucket: tuple[int, int]) -> bool:
        return True

    def record(self, bucket: tuple[int, int], compiled: bool, seconds: float) -> None:
        pass

    def _views(self, buf: torch.Tensor, rows: int, width: int):
        ids, pos, slots, lens = buf[:rows], buf[rows : 2 * rows], buf[2 * rows : 3 * rows], buf[3 * rows : 4 * rows]
        return ids, pos, slots, lens, buf[4 * rows :].view(rows, width)

    def _forward(self, buf: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        ids, pos, slots, lens, tables = self._views(buf, rows, width)
        lens32, tables32 = lens.to(torch.int32), tables.to(torch.int32)
        pool = self.pool

        def attn(i, q, k_raw, k_rot, v):
            pool.write(i, slots, k_rot, v)
            return paged_decode_attention(q, pool.k[i], pool.v[i], tables32, lens32)

        return self.model(ids, pos, attn)

    def _fill(self, buf: torch.Tensor, rows: int, width: int, ids, pos, slots, tables, lens) -> None:
        n = len(ids)
        pad = rows - n
        scratch = self.pool.scratch_slot
        host = list(ids) + [0] * pad + list(pos) + [0] * pad + list(slots) + [scratch] * pad
        host += list(lens) + [1] * pad
        for t in tables:
            host += t + [self._scratch_block] * (width - len(t))
        host += [self._scratch_block] * (width * pad)
        buf.copy_(torch.tensor(host, dtype=torch.long))

    @torch.inference_mode()
    def _capture(self, bucket: tuple[int, int]) -> None:
        rows, width = bucket
        t0 = time.perf_counter()
        try:
            dev = self.pool.k.device
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            buf = torch.zeros(4 * rows + rows * width, dtype=torch.long, device=dev)
            self._fill(buf, rows, width, [], [], [], [], [])  # every row a padded one: the scratch block
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
                self._forward(buf, rows, width)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                out = self._forward(buf, rows, width)
            graph.replay()
            torch.cuda.synchronize(dev)
        except Exception as exc:  # noqa: BLE001 - any capture failure: decode stays eager
            self.failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            log.warning("agentmem: CUDA graph decode is off, decoding eagerly: %s", self.failed)
            return
        finally:
            self.compile_s += time.perf_counter() - t0
        self._graphs[bucket] = (graph, buf, out)
        self.ready.add(bucket)
        print(f"agentmem: decode step for {rows} row(s), block tables of {width}, captured as a CUDA graph in "
              f"{time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)

    def run(self, bucket: tuple[int, int], ids: list[int], pos: list[int], slots: list[int],
            tables: list[list[int]], lens: list[int]) -> torch.Tensor:
        """Logits [n, V] of one decode row for each of n sequences: their token, position and
        pool slot, block table and the number of keys each sees (its own included)."""
        graph, buf, out = self._graphs[bucket]
        rows, width = bucket
        self._fill(buf, rows, width, ids, pos, slots, tables, lens)
        graph.replay()
        return out[: len(ids)].clone()

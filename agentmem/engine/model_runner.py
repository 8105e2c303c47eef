"""One forward for a scheduled batch: decode tokens of many sequences and prefill chunks, all
in the model's flat token layout, against the paged pool."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from .block_manager import BlockManager
from .compiled import CompiledDecode, paged_attention
from .cuda_graph import GraphDecode
from .kernels import cpu_bf16, cpu_fp32, paged_decode_attention
from .kernels.reference import sdpa
from .kv_pool import KVPool, slot_runs
from .layers import visible
from .model import Transformer
from .scheduler import Scheduled
from .sequence import Sequence

# Keys up to which a prompt chunk of fp32 rows takes the AVX-512 build of cpu_fp32's rows kernel
# rather than torch's SDPA (the AVX2 build's own bound, `cpu_fp32.AVX2_ROWS_MAX_KEYS`, is in
# `rows_kernel`, for a blend's rows too). Skylake-SP VM, 2026-11-28, 512-row chunks of a 2,048-token
# prompt, ms a layer, SDPA against the kernel, alternated: keys 512 5.7 / 3.6, 1,024 14.1 / 13.0,
# 1,536 20.9 / 17.9, 2,048 28.5 / 29.9 (SDPA's flash kernel on a dense causal chunk catches up); a
# 350-token prompt 4.1 / 1.8. The AVX2 build, Zen 3 VM, 2026-11-29, the same chunks, SDPA / kernel:
# keys 512 5.8 / 2.5, 1,024 12.5 / 8.2, 2,048 25.1-26.4 / 20.4-22.2, 4,096 66.9 / 53.7, 8,192
# 123.6 / 142.2 (the packed K of a head no longer stays in L2); 350 rows 3.1 / 1.2.
FP32_ROWS_KERNEL_MAX_KEYS = 1536


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None = None
                 ) -> torch.Tensor:
    """Causal attention of a prompt chunk at positions start.. over keys 0..start+n-1 (only
    the last `window` of them, with a sliding window). q [n,H,hd], k/v [start+n,KV,hd] -> [n,H,hd]."""
    n = q.shape[0]
    if window is None and (out := cpu_bf16.rows_attend(q, k, v, torch.arange(start, start + n))) is not None:
        return out
    if window is None and (lib := cpu_fp32.rows_kernel(q, k)) is not None \
            and (cpu_fp32.rows_build() == "avx2" or start + n <= FP32_ROWS_KERNEL_MAX_KEYS) \
            and (out := cpu_fp32.rows_attention(lib, q, k, v, torch.arange(start, start + n))) is not None:
        return out  # fp32 rows (a CPU without bf16)
    if cpu_bf16.widen_rows(q, k):  # this machine runs fp32 SDPA faster than its bf16 ways
        return sdpa_chunk(q.float(), k.float(), v.float(), start, window).to(q.dtype)
    return sdpa_chunk(q, k, v, start, window)


def sdpa_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None = None
               ) -> torch.Tensor:
    """`attend_chunk` through torch's SDPA in the dtype of q (on a CPU with AMX, bf16 SDPA is
    oneDNN's AMX flash attention: ~4x the engine's vdpbf16ps kernel)."""
    n = q.shape[0]
    if window is not None and start + n > window:
        pos = torch.arange(start + n, device=q.device)
        return sdpa(q, k, v, visible(pos[start:], pos, window))
    if start == 0:
        return sdpa(q, k, v)
    if start < n and not q.is_cuda:
        # the causal kernel skips the masked half that a mask makes the CPU compute; padding
        # the `start` earlier rows with zero queries is cheaper than that while start < n
        padded = torch.cat([q.new_zeros(start, *q.shape[1:]), q])
        return sdpa(padded, k, v)[start:]
    pos = torch.arange(start + n, device=q.device)
    return sdpa(q, k, v, pos[None, :] <= pos[start:, None])


class ModelRunner:
    def __init__(self, model: Transformer, pool: KVPool, blocks: BlockManager, device: torch.device,
                 compiled: CompiledDecode | GraphDecode | None = None):
        self.model = model
        self.pool = pool
        self.blocks = blocks
        self.device = device
        self.compiled = compiled  # the compiled decode step, used for batches of decodes only

    def _tensor(self, xs, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(xs, dtype=dtype, device=self.device)

    def _decode_attention(self, seqs: list[Sequence]) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """attn(layer, q [B,H,hd]) for one decode query per sequence over its paged keys.

        On CUDA it is the paged Triton kernel (full attention only: a sliding-window model
        takes the gather path below, whose mask also applies the window). Elsewhere the work that does not depend on the
        layer is done once per step: the flat pool slots of every sequence's keys (padded with
        its own first slot, then masked) and the mask; each layer is then one gather of K and
        of V and one SDPA call. Only written slots are ever read, so the garbage of a fresh
        block (the pool is not zeroed) cannot leak NaN into the softmax."""
        lens = [s.num_computed + 1 for s in seqs]
        pool = self.pool
        window = self.model.args.sliding_window
        if self.device.type == "cuda" and window is None:
            width = max(len(s.block_table) for s in seqs)
            tables = self._tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], torch.int32)
            lens_t = self._tensor(lens, torch.int32)
            return lambda i, q: paged_decode_attention(q, pool.k[i], pool.v[i], tables, lens_t)
        width = max(lens)
        # made in numpy from the sequences' kept slots (few torch calls a step), then one tensor each
        # (copied to the device off the CPU: a sliding-window model on CUDA)
        on_device = (lambda t: t) if self.device.type == "cpu" else (lambda t: t.to(self.device))
        idx_t = on_device(torch.from_numpy(self._key_slots_kept(seqs, lens, width)))
        mask = seen = None
        if min(lens) < width or (window is not None and width > window):
            slot, lens_a = np.arange(width)[None, :], np.asarray(lens)[:, None]
            seen = slot < lens_a
            if window is not None:  # a decode query at position n-1 sees keys n-window..n-1
                seen &= slot >= lens_a - window
            mask = on_device(torch.from_numpy(seen))[:, None, None, :]

        a = self.model.args
        for kernels in (cpu_bf16, cpu_fp32):  # bf16 rows (AVX512-BF16), fp32 rows (AVX2)
            if (lib := kernels.loaded()) is not None and kernels.attention_usable(
                    pool.k.dtype, self.device, a.n_heads, a.n_kv_heads, a.head_dim):
                # the CPU kernel, called directly: its inputs are made once a step, not per layer
                keep = torch.from_numpy(seen.astype(np.uint8) if seen is not None
                                        else np.ones((len(seqs), width), dtype=np.uint8))

                def kernel_attn(i, q, kernels=kernels, lib=lib, keep=keep):
                    return kernels.decode_attention(lib, q, pool.k[i], pool.v[i], idx_t, keep)

                # a layer of decode rows may run whole in C (Block.forward: `layer_q8u8` on bf16 rows,
                # `cpu_fp32.layer_q8` on fp32 ones)
                kernel_attn.paged = (idx_t, keep)
                return kernel_attn

        def attn(i: int, q: torch.Tensor) -> torch.Tensor:
            return paged_attention(q, pool.k[i], pool.v[i], idx_t, mask, width)

        return attn

    def _key_slots(self, seqs: list[Sequence], lens: list[int], width: int) -> list[int]:
        """The flat pool slots of each sequence's keys, each row padded to `width` with its own
        first slot (masked)."""
        idx: list[int] = []
        for s, n in zip(seqs, lens, strict=True):
            slots = self.blocks.slots(s, 0, n)
            idx += slots + slots[:1] * (width - n)
        return idx

    def _key_slots_kept(self, seqs: list[Sequence], lens: list[int], width: int) -> np.ndarray:
        """`_key_slots` as an int64 array, from each sequence's kept slots (`BlockManager.key_slots`:
        only a step's new positions are computed)."""
        rows = []
        for s, n in zip(seqs, lens, strict=True):
            slots = self.blocks.key_slots(s, n)
            rows.append(slots)
            if n < width:
                rows.append(np.full(width - n, slots[0], dtype=np.int64))
        return rows[0].copy() if len(rows) == 1 else np.concatenate(rows)

    @torch.inference_mode()
    def run(self, batch: list[Scheduled]) -> tuple[torch.Tensor, list[Sequence]]:
        """Run the batch (decodes, i.e. n == 1, first); return logits [M, V] for the M
        sequences whose last pending token ran, and those sequences."""
        batch = sorted(batch, key=lambda s: s.n != 1)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        done: list[Sequence] = []
        for sc in batch:
            seq, c = sc.seq, sc.seq.num_computed
            ids += seq.token_ids[c : c + sc.n]
            pos += range(c, c + sc.n)
            slots += self.blocks.slots(seq, c, c + sc.n)
            if c + sc.n == len(seq.token_ids):
                rows.append(len(ids) - 1)
                done.append(seq)
        decodes = [sc.seq for sc in batch if sc.n == 1]
        n_dec = len(decodes)
        trial = None  # a compiled bucket whose eager step is being timed against it
        if n_dec == len(batch) and self.compiled is not None:
            lens = [s.num_computed + 1 for s in decodes]
            paged = isinstance(self.compiled, GraphDecode)  # CUDA graphs read block tables
            bucket = self.compiled.get(n_dec, max(len(s.block_table) for s in decodes) if paged else max(lens))
            if bucket is not None and self.compiled.prefer(bucket):
                t0 = time.perf_counter()
                if paged:
                    logits = self.compiled.run(bucket, ids, pos, slots, [s.block_table for s in decodes], lens)
                else:
                    logits = self.compiled.run(bucket, self._tensor(ids), self._tensor(pos), self._tensor(slots),
                                               self._key_slots(decodes, lens, max(lens)), lens,
                                               self.model.args.sliding_window)
                self.compiled.record(bucket, True, time.perf_counter() - t0)
                for seq in decodes:
                    seq.num_computed += 1
                return logits, done
            if bucket is not None:
                trial = (bucket, time.perf_counter())
        decode_attn = self._decode_attention(decodes) if n_dec else None
        chunks = []  # (row offset, n, start position, block table)
        row = n_dec
        for sc in batch[n_dec:]:
            chunks.append((row, sc.n, sc.seq.num_computed, self._tensor(sc.seq.block_table)))
            row += sc.n
        slots_t = self._tensor(slots)
        runs = slot_runs(slots) if self.device.type == "cpu" else None
        pool = self.pool
        window = self.model.args.sliding_window

        def attn(i, q, k_raw, k_rot, v):
            pool.write(i, slots_t if runs is None else runs, k_rot, v)
            if not chunks:
                return decode_attn(i, q)
            if n_dec == 0 and len(chunks) == 1 and chunks[0][2] == 0:
                return attend_chunk(q, k_rot, v, 0, window)  # a first chunk sees only itself
            out = torch.empty_like(q)
            if n_dec:
                out[:n_dec] = decode_attn(i, q[:n_dec])
            for off, n, start, table in chunks:
                k, vv = pool.gather(i, table, start + n)
                if k.dtype != q.dtype:  # an fp16 pool under an fp32 engine (Engine.kv_dtype)
                    k, vv = k.to(q.dtype), vv.to(q.dtype)
                out[off : off + n] = attend_chunk(q[off : off + n], k, vv, start, window)
            return out

        if not chunks and (paged := getattr(decode_attn, "paged", None)) is not None:
            attn.decode_pool = (pool, slots_t, *paged)  # the K/V write and attention a fused layer does itself
        every_row = len(rows) == len(ids)  # decodes only: each row's logits, in order (no gather)
        logits = self.model(self._tensor(ids), self._tensor(pos), attn,
                            logits_at=None if every_row else self._tensor(rows))
        if trial is not None:
            self.compiled.record(trial[0], False, time.perf_counter() - trial[1])
        for sc in batch:
            sc.seq.num_computed += sc.n
        return logits, done

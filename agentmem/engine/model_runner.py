"""One forward for a scheduled batch: decode tokens of many sequences and prefill chunks, all
in the model's flat token layout, against the paged pool."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .block_manager import BlockManager
from .kernels import paged_decode_attention
from .kv_pool import KVPool
from .model import Transformer
from .scheduler import Scheduled
from .sequence import Sequence


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of a prompt chunk at positions start.. over keys 0..start+n-1.
    q [n,H,hd], k/v [start+n,KV,hd] -> [n,H,hd]."""
    n = q.shape[0]
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if start == 0:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    else:
        pos = torch.arange(start + n, device=q.device)
        mask = pos[None, :] <= pos[start:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1)


class ModelRunner:
    def __init__(self, model: Transformer, pool: KVPool, blocks: BlockManager, device: torch.device):
        self.model = model
        self.pool = pool
        self.blocks = blocks
        self.device = device

    def _tensor(self, xs, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(xs, dtype=dtype, device=self.device)

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
        if n_dec:
            width = max(len(s.block_table) for s in decodes)
            tables = self._tensor([s.block_table + [0] * (width - len(s.block_table)) for s in decodes], torch.int32)
            lens = self._tensor([s.num_computed + 1 for s in decodes], torch.int32)
        chunks = []  # (row offset, n, start position, block table)
        row = n_dec
        for sc in batch[n_dec:]:
            chunks.append((row, sc.n, sc.seq.num_computed, self._tensor(sc.seq.block_table)))
            row += sc.n
        slots_t = self._tensor(slots)
        pool = self.pool

        def attn(i, q, k_raw, k_rot, v):
            pool.write(i, slots_t, k_rot, v)
            if not chunks:
                return paged_decode_attention(q, pool.k[i], pool.v[i], tables, lens)
            if n_dec == 0 and len(chunks) == 1 and chunks[0][2] == 0:
                return attend_chunk(q, k_rot, v, 0)  # a first chunk sees only itself
            out = torch.empty_like(q)
            if n_dec:
                out[:n_dec] = paged_decode_attention(q[:n_dec], pool.k[i], pool.v[i], tables, lens)
            for off, n, start, table in chunks:
                k, vv = pool.gather(i, table, start + n)
                out[off : off + n] = attend_chunk(q[off : off + n], k, vv, start)
            return out

        logits = self.model(self._tensor(ids), self._tensor(pos), attn, logits_at=self._tensor(rows))
        for sc in batch:
            sc.seq.num_computed += sc.n
        return logits, done

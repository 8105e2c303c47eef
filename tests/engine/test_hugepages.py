"""The projections' GEMV layouts gathered into one huge-page block (engine/hugepages.py)."""

from __future__ import annotations

import torch

from agentmem.engine import hugepages
from agentmem.engine import model as M


def _tiny(fmt: str) -> M.Transformer:
    args = M.ModelArgs(vocab_size=96, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=192, head_dim=32)
    torch.manual_seed(1)
    model = M.Transformer(args).to(torch.bfloat16 if fmt in ("bf16", "int8") else torch.float32)
    for blk in model.layers:
        blk.fuse()
    return model


def test_an_arena_holds_equal_copies_back_to_back_from_a_huge_page_boundary():
    ts = [torch.randn(3, 5), torch.arange(7, dtype=torch.int8), torch.randn(4, 16).bfloat16(), torch.zeros(0)]
    arena = hugepages.Arena(ts)
    assert [v.dtype for v in arena.views] == [t.dtype for t in ts]
    assert all(torch.equal(v, t) for v, t in zip(arena.views, ts, strict=True))
    assert all(v.data_ptr() != t.data_ptr() for v, t in zip(arena.views[:3], ts[:3], strict=True))  # copies
    ptrs = [v.data_ptr() for v in arena.views[:3]]
    assert ptrs[0] % hugepages.HUGE == 0 and all(p % hugepages.ALIGN == 0 for p in ptrs)
    assert ptrs[1] == ptrs[0] + 64 and ptrs[2] == ptrs[1] + 64  # 60 bytes, then 7, each padded to a line
    arena.views[0].add_(1)  # writable, and the copy only
    assert torch.equal(arena.views[0], ts[0] + 1)
    view = arena.views[2]
    del arena  # a view keeps the block alive
    assert torch.equal(view, ts[2])


def test_the_decode_weights_gather_in_read_order_and_change_no_output(monkeypatch):
    for fmt in ("int8", "fp32"):
        model = _tiny(fmt)
        ids, pos = torch.tensor([3, 9, 27]), torch.arange(3)

        def attn(i, q, k_raw, k_rot, v):
            return q  # any attention: the products are what moved

        monkeypatch.setenv("AGENTMEM_HUGEPAGES", "off")
        model.pack(fmt)
        model.gather_weights()
        assert model._weights_arena is None
        before = [model(ids[:n], pos[:n], attn) for n in (1, 3)]
        monkeypatch.setenv("AGENTMEM_HUGEPAGES", "on")
        model.pack(fmt)
        assert model._weights_arena is None  # pack made new layouts
        model.gather_weights()
        moved = [p for p in model.projections() if p.w_gemv is not None]
        if not moved:  # no GEMV kernel on this CPU: nothing to gather
            assert model._weights_arena is None
            continue
        arena = model._weights_arena
        assert [p.w_gemv.data_ptr() for p in moved] == [v.data_ptr() for v in arena.views]
        assert sorted(v.data_ptr() for v in arena.views) == [v.data_ptr() for v in arena.views]  # decode's order
        assert moved[-1] is model.head_p or model.head_p.w_gemv is None
        after = [model(ids[:n], pos[:n], attn) for n in (1, 3)]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))

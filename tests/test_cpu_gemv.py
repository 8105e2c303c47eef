"""kernels/cpu_gemv.py: the AVX512-BF16 few-row product against torch, and Proj's use of it."""

from __future__ import annotations

import pytest
import torch

from agentmem.engine.kernels import cpu_gemv
from agentmem.engine.linear import Proj, onednn_bf16


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = cpu_gemv.load(tmp_path_factory.mktemp("cache"))
    if lib is None:
        pytest.skip(f"no bf16 GEMV kernel here: {cpu_gemv.why_not}")
    return lib


@pytest.mark.parametrize("rows,out,inp", [(1, 960, 576), (3, 963, 576), (4, 576, 1536), (16, 7, 64)])
def test_gemv_matches_torch(lib, rows, out, inp):
    g = torch.Generator().manual_seed(rows * out)
    w = torch.randn(out, inp, generator=g).bfloat16()
    x = torch.randn(rows, inp, generator=g).bfloat16()
    b = torch.randn(out, generator=g).bfloat16()
    ref = x.float() @ w.float().t() + b.float()
    y32 = cpu_gemv.gemv(lib, w, x, b, torch.float32)
    assert y32.shape == (rows, out) and y32.dtype == torch.float32
    assert (y32 - ref).abs().max() < 1e-4 * ref.abs().max()  # fp32 sums of exact bf16 products
    y16 = cpu_gemv.gemv(lib, w, x, b)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16, y32.to(torch.bfloat16))  # rounded to nearest even, as torch rounds


def test_gemv_reads_strided_rows(lib):
    w = torch.randn(64, 96).bfloat16()
    x = torch.randn(2, 192).bfloat16()[:, :96]  # rows 192 apart
    assert torch.allclose(cpu_gemv.gemv(lib, w, x, out_dtype=torch.float32), x.float() @ w.float().t(), atol=1e-3)


def test_proj_uses_the_kernel_for_few_rows_only(lib, monkeypatch):
    if not onednn_bf16():
        pytest.skip("bf16 projections are oneDNN-packed only with native bf16")
    w = torch.randn(256, 128).bfloat16()
    p = Proj(w)
    calls = []
    real = cpu_gemv.gemv
    monkeypatch.setattr(cpu_gemv, "gemv", lambda *a, **k: calls.append(a[2].shape[0]) or real(*a, **k))
    for rows in (1, cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS + 1, 64):
        x = torch.randn(rows, 128).bfloat16()
        assert torch.allclose(p(x).float(), x.float() @ w.float().t(), atol=0.1, rtol=0.02)
    assert calls == [1, cpu_gemv.MAX_ROWS]

"""Triton kernels for the engine's hot paths on CUDA, and the host functions that launch them.

Imported only when a dispatcher sees CUDA tensors (or by the tests, under TRITON_INTERPRET=1
on CPU tensors). All arithmetic that decides the result runs in fp32: the RoPE angle in
float64, scores and softmax in fp32 with exp2, the PV accumulator in fp32. fp32 inputs use
IEEE dots (never TF32), so fp32 results match the torch reference to rounding.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_MIN_DOT = 16  # smallest tl.dot dimension


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(max(1, n)))


def _qk_scale(hd: int, scale: float | None) -> float:
    """Softmax scale with log2(e) folded in, for exp2."""
    return (1.0 / math.sqrt(hd) if scale is None else scale) * _LOG2E


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _dot_upcast(dtype: torch.dtype) -> bool:
    """The interpreter's tl.dot multiplies bf16 bit patterns as integers (triton 3.9), so
    under it half-precision operands are widened first. Products of half-precision values
    are exact in fp32, so this only changes the summation order against a GPU's MMA."""
    knobs = getattr(triton, "knobs", None)
    interpreted = knobs.runtime.interpret if knobs else os.environ.get("TRITON_INTERPRET") == "1"
    return bool(interpreted) and dtype != torch.float32


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


# --- RoPE at arbitrary positions -----------------------------------------------------------


@triton.jit
def _rope_kernel(
    x_ptr, out_ptr, pos_ptr, inv_freq_ptr,
    heads, half,
    sx_n, sx_h, sx_d, so_n, so_h, so_d,
    BLOCK_H: tl.constexpr, HALF: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF)
    imask = i < half
    mask = (h[:, None] < heads) & imask[None, :]

    pos = tl.load(pos_ptr + n).to(tl.float64)
    angle = pos * tl.load(inv_freq_ptr + i, mask=imask, other=0.0).to(tl.float64)
    # reduce to [-pi, pi] in float64 so the fp32 cos/sin see a small argument at any position
    # (re-rotation deltas may be negative)
    turns = tl.floor(angle * (1.0 / (2.0 * math.pi)) + 0.5)
    angle = (angle - turns * (2.0 * math.pi)).to(tl.float32)
    cos = tl.cos(angle)[None, :]
    sin = tl.sin(angle)[None, :]

    x1_ptrs = x_ptr + n * sx_n + h[:, None] * sx_h + i[None, :] * sx_d
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + half * sx_d, mask=mask, other=0.0).to(tl.float32)
    o1_ptrs = out_ptr + n * so_n + h[:, None] * so_h + i[None, :] * so_d
    tl.store(o1_ptrs, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o1_ptrs + half * so_d, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    n, heads, hd = x.shape
    out = torch.empty((n, heads, hd), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block_h = min(_pow2(heads), 16)
    grid = (n, triton.cdiv(heads, block_h))
    _rope_kernel[grid](
        x, out, positions, inv_freq.contiguous(),
        heads, hd // 2,
        *x.stride(), *out.stride(),
        BLOCK_H=block_h, HALF=_pow2(hd // 2),
    )
    return out


# --- paged decode attention ----------------------------------------------------------------


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, m_ptr, l_ptr,
    hd, block_size, split_len, qk_scale,
    sq_b, sq_h, sq_d,
    sk_blk, sk_slot, sk_h, sk_d,
    sv_blk, sv_slot, sv_h, sv_d,
    st_b, st_j,
    so_b, so_h, so_s, so_d,
    sm_b, sm_h, sm_s,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program = one sequence x one KV head (all GROUP query heads that share it, padded
    to a tl.dot-sized tile) x one split of the keys. With SPLIT the partial (max, sum,
    unnormalised acc) are written for a host-side merge; without, the final output."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < hd
    heads = kvh * GROUP + g

    seq_len = tl.load(lens_ptr + b)
    start = s * split_len
    end = tl.minimum(seq_len, start + split_len)

    q = tl.load(
        q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :] * sq_d,
        mask=gmask[:, None] & dmask[None, :], other=0.0,
    )
    m_i = tl.full([G_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        jmask = j < end
        blk = tl.load(table_ptr + b * st_b + (j // block_size) * st_j, mask=jmask, other=0).to(tl.int64)
        slot = j % block_size
        kv_mask = jmask[:, None] & dmask[None, :]
        k = tl.load(
            k_ptr + blk[:, None] * sk_blk + slot[:, None] * sk_slot + kvh * sk_h + d[None, :] * sk_d,
            mask=kv_mask, other=0.0,
        )
        scores = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
        scores = tl.where(jmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + blk[:, None] * sv_blk + slot[:, None] * sv_slot + kvh * sv_h + d[None, :] * sv_d,
            mask=kv_mask, other=0.0,
        )
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    out_mask = gmask[:, None] & dmask[None, :]
    out_ptrs = out_ptr + b * so_b + heads[:, None] * so_h + s * so_s + d[None, :] * so_d
    if SPLIT:
        tl.store(out_ptrs, acc, mask=out_mask)
        tl.store(m_ptr + b * sm_b + heads * sm_h + s * sm_s, m_i, mask=gmask)
        tl.store(l_ptr + b * sm_b + heads * sm_h + s * sm_s, l_i, mask=gmask)
    else:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _num_splits(batch: int, kv_heads: int, max_len: int, split_len: int) -> int:
    """Split the keys (flash-decoding) only when sequences x KV heads cannot fill the GPU."""
    if batch * kv_heads >= 128:
        return 1
    return max(1, min(triton.cdiv(max_len, split_len), 32))


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None,
    split_len: int = 256,
    block_n: int = 64,
) -> torch.Tensor:
    """The launch is planned from the table's capacity, an upper bound of every seq_len, so
    it needs no device sync; splits past a sequence's end exit at once. `split_len` and
    `block_n` are exposed so tests can force the split path on tiny inputs."""
    batch, heads, hd = q.shape
    kv_heads = k_pool.shape[2]
    group = heads // kv_heads
    if batch == 0:
        return torch.empty_like(q)
    max_seq_len = block_tables.shape[1] * k_pool.shape[1]
    splits = _num_splits(batch, kv_heads, max_seq_len, split_len)
    if splits == 1:
        split_len = max(max_seq_len, 1)
    common = dict(
        GROUP=group, G_PAD=_pow2(group, _MIN_DOT), D_PAD=_pow2(hd, _MIN_DOT), BLOCK_N=_pow2(block_n, _MIN_DOT),
        SPLIT=splits > 1, PRECISION=_dot_precision(q.dtype), UPCAST=_dot_upcast(q.dtype),
    )
    grid = (batch, kv_heads, splits)
    args = (
        hd, k_pool.shape[1], split_len, _qk_scale(hd, scale),
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *block_tables.stride(),
    )
    if splits == 1:
        out = torch.empty_like(q)
        _paged_decode_kernel[grid](
            q, k_pool, v_pool, block_tables, seq_lens, out, out, out,
            *args, out.stride(0), out.stride(1), 0, out.stride(2), 0, 0, 0, **common,
        )
        return out
    part = torch.empty(batch, heads, splits, hd, dtype=torch.float32, device=q.device)
    m = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    _paged_decode_kernel[grid](
        q, k_pool, v_pool, block_tables, seq_lens, part, m, l_sum,
        *args, *part.stride(), *m.stride(), **common,
    )
    # merge the splits: rescale each partial to the global max (empty splits carry l = 0)
    w = torch.exp2(m - m.amax(dim=2, keepdim=True))
    den = (l_sum * w).sum(dim=2)
    out = (part * w[..., None]).sum(dim=2) / torch.where(den == 0, 1.0, den)[..., None]
    return out.to(q.dtype)


# --- attention of selected query positions -------------------------------------------------


@triton.jit
def _selected_attention_kernel(
    q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, out_ptr,
    n_q, n_k, hd, qk_scale,
    sq_n, sq_h, sq_d, sk_n, sk_h, sk_d, sv_n, sv_h, sv_d, so_n, so_h, so_d,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program = BLOCK_M queries x one query head, streaming all key tiles with an online
    softmax. The mask is by position, not by index, so any subset and order of positions is
    exact; a key tile whose smallest position is after every query's is skipped, which makes
    sorted (causal) inputs cost half."""
    h = tl.program_id(1)
    kvh = h // GROUP
    m_offs = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    mmask = m_offs < n_q
    dmask = d < hd

    q_pos = tl.load(qpos_ptr + m_offs, mask=mmask, other=-1).to(tl.int64)
    q_last = tl.max(q_pos, axis=0)
    q = tl.load(
        q_ptr + m_offs[:, None] * sq_n + h * sq_h + d[None, :] * sq_d,
        mask=mmask[:, None] & dmask[None, :], other=0.0,
    )
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for n0 in range(0, n_k, BLOCK_N):
        n_offs = n0 + tl.arange(0, BLOCK_N)
        nmask = n_offs < n_k
        k_pos = tl.load(kpos_ptr + n_offs, mask=nmask, other=0).to(tl.int64)
        k_first = tl.min(tl.where(nmask, k_pos, q_last + 1), axis=0)
        if k_first <= q_last:
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + n_offs[:, None] * sk_n + kvh * sk_h + d[None, :] * sk_d, mask=kv_mask, other=0.0)
            scores = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
            visible = nmask[None, :] & (k_pos[None, :] <= q_pos[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + n_offs[:, None] * sv_n + kvh * sv_h + d[None, :] * sv_d, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
            m_i = m_new

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + m_offs[:, None] * so_n + h * so_h + d[None, :] * so_d,
        acc.to(out_ptr.dtype.element_ty),
        mask=mmask[:, None] & dmask[None, :],
    )


def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float | None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    n_q, heads, hd = q.shape
    n_k, kv_heads = k.shape[0], k.shape[1]
    out = torch.empty_like(q)
    if n_q == 0:
        return out
    block_m = min(_pow2(block_m, _MIN_DOT), _pow2(n_q, _MIN_DOT))
    grid = (triton.cdiv(n_q, block_m), heads)
    _selected_attention_kernel[grid](
        q, k, v, q_pos, k_pos, out,
        n_q, n_k, hd, _qk_scale(hd, scale),
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        GROUP=heads // kv_heads, BLOCK_M=block_m, BLOCK_N=_pow2(block_n, _MIN_DOT), D_PAD=_pow2(hd, _MIN_DOT),
        PRECISION=_dot_precision(q.dtype), UPCAST=_dot_upcast(q.dtype),
    )
    return out

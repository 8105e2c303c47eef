"""Triton kernels against their torch references, on the CPU through the Triton interpreter.

TRITON_INTERPRET is read when triton creates its JIT functions, its own standard library
(tl.max, tl.sum, ...) included, so it must be set before triton is first imported. Other
tests in the same pytest process may import triton first; so the kernels run in a spawned
worker process that sets the variable before importing anything from triton, and the tests
send it CPU tensors. Sizes are tiny (the interpreter is slow) but cross every tile boundary
that matters.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from agentmem.engine import attend, kernels
from agentmem.engine.model import Rotary

HD = 64


def _interpreter_worker_init() -> None:
    if "triton" in sys.modules:
        raise RuntimeError("triton was imported before TRITON_INTERPRET could be set")
    os.environ["TRITON_INTERPRET"] = "1"


def _run_kernel(name: str, *args, **kwargs) -> torch.Tensor:
    from agentmem.engine.kernels import triton_ops

    return getattr(triton_ops, name)(*args, **kwargs)


class _InterpretedKernels:
    """`tk.rope(...)` runs `triton_ops.rope(...)` in the interpreter worker."""

    def __init__(self, pool: ProcessPoolExecutor):
        self._pool = pool

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self._pool.submit(_run_kernel, name, *args, **kwargs).result()


@pytest.fixture(scope="module")
def tk():
    """The Triton kernels, running on CPU tensors in the interpreter."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_interpreter_worker_init) as pool:
        yield _InterpretedKernels(pool)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}


def _up(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in ts]


# --- RoPE ----------------------------------------------------------------------------------


def test_rope_kernel_equals_engine_rotary_at_arbitrary_positions(tk):
    rotary = Rotary(HD, 100000.0)
    positions = torch.tensor([0, 1, 7, 300, 4095, 8191])
    # q and k side by side in one fused projection, as the engine lays them out: a strided view
    fused = torch.randn(6, 9 + 3 + 3, HD, generator=_gen(0))
    qk = fused[:, :12]
    expected = rotary.apply(qk, positions)
    torch.testing.assert_close(tk.rope(qk, positions, rotary.inv_freq), expected, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(kernels.rope_ref(qk, positions, rotary.inv_freq), expected, atol=2e-6, rtol=1e-6)


def test_rope_rerotates_cached_keys_to_new_positions(tk):
    """A key rotated to p, then rotated again by d, equals the key rotated to p + d: how
    CacheBlend moves a cached chunk to where it lands in a new prompt."""
    inv_freq = Rotary(HD, 100000.0).inv_freq.float()
    k = torch.randn(5, 3, HD, generator=_gen(1))
    old = torch.tensor([0, 1, 2, 3, 4000])
    new = torch.tensor([40, 41, 42, 43, 7])  # a chunk may move later or earlier
    moved = tk.rope(tk.rope(k, old, inv_freq), new - old, inv_freq)
    torch.testing.assert_close(moved, kernels.rope_ref(k, new, inv_freq), atol=1e-5, rtol=1e-5)


def test_rope_bf16_matches_fp32_reference(tk):
    inv_freq = Rotary(HD, 10000.0).inv_freq
    x = torch.randn(7, 5, HD, generator=_gen(2)).bfloat16()
    positions = torch.tensor([3, 9, 11, 60, 61, 200, 2048], dtype=torch.int32)
    out = tk.rope(x, positions, inv_freq)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    torch.testing.assert_close(out.float(), kernels.rope_ref(x.float(), positions, inv_freq), **_tol(torch.bfloat16))


# --- paged decode attention ----------------------------------------------------------------


def _paged_case(seq_lens: list[int], heads: int, kv_heads: int, block_size: int, dtype: torch.dtype, seed: int):
    """A pool whose blocks are handed out to sequences in shuffled order; table padding is -1."""
    g = _gen(seed)
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    k_pool = torch.randn(num_blocks, block_size, kv_heads, HD, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, HD, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seq_lens), max(need)), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[used : used + n]
        used += n
    q = torch.randn(len(seq_lens), heads, HD, generator=g).to(dtype)
    return q, k_pool, v_pool, tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-keys"])
def test_paged_decode_ragged_gqa(tk, dtype, split):
    # SmolLM2 head layout (9 query heads over 3 KV heads); lengths off every block multiple
    q, k_pool, v_pool, tables, lens = _paged_case([1, 16, 37, 70], 9, 3, 16, dtype, seed=3)
    kwargs = {"split_len": 32, "block_n": 16} if split else {}
    out = tk.paged_decode_attention(q, k_pool, v_pool, tables, lens, None, **kwargs)
    assert out.dtype == dtype and out.shape == q.shape
    expected = kernels.paged_decode_attention_ref(*_up(q, k_pool, v_pool), tables, lens)
    torch.testing.assert_close(out.float(), expected, **_tol(dtype))


def test_paged_decode_odd_block_size_and_scale(tk):
    q, k_pool, v_pool, tables, lens = _paged_case([5, 23, 11], 4, 2, 5, torch.float32, seed=4)
    out = tk.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.3)
    torch.testing.assert_close(out, kernels.paged_decode_attention_ref(q, k_pool, v_pool, tables, lens, 0.3), **_tol(torch.float32))


def test_paged_decode_reference_equals_dense_attention():
    """The paged reference is itself checked against plain attention over gathered keys."""
    q, k_pool, v_pool, tables, lens = _paged_case([3, 21], 6, 2, 8, torch.float32, seed=5)
    out = kernels.paged_decode_attention_ref(q, k_pool, v_pool, tables, lens)
    for b, n in enumerate(lens.tolist()):
        j = torch.arange(n)
        blocks = tables[b, j // 8].long()
        k, v = k_pool[blocks, j % 8], v_pool[blocks, j % 8]
        dense = attend(q[b : b + 1], k, v, torch.tensor([n - 1]), j)
        torch.testing.assert_close(out[b : b + 1], dense, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-keys"])
def test_paged_decode_never_reads_past_seq_len(tk, split):
    """Slots after seq_len in the last block (and whole unused blocks) hold garbage; changing
    it must not change the output."""
    q, k_pool, v_pool, tables, lens = _paged_case([13, 30], 6, 2, 16, torch.float32, seed=6)
    kwargs = {"split_len": 16, "block_n": 16} if split else {}
    clean = tk.paged_decode_attention(q, k_pool, v_pool, tables, lens, None, **kwargs)
    for b, n in enumerate(lens.tolist()):
        last = int(tables[b, (n - 1) // 16])
        k_pool[last, n % 16 :] = 1e4
        v_pool[last, n % 16 :] = 1e4
    out = tk.paged_decode_attention(q, k_pool, v_pool, tables, lens, None, **kwargs)
    torch.testing.assert_close(out, clean, atol=0, rtol=0)
    torch.testing.assert_close(out, kernels.paged_decode_attention_ref(q, k_pool, v_pool, tables, lens), **_tol(torch.float32))


def test_paged_decode_empty_sequence_gives_zeros(tk):
    q, k_pool, v_pool, tables, lens = _paged_case([9, 4], 2, 1, 4, torch.float32, seed=7)
    lens[1] = 0
    out = tk.paged_decode_attention(q, k_pool, v_pool, tables, lens, None)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out, kernels.paged_decode_attention_ref(q, k_pool, v_pool, tables, lens), **_tol(torch.float32))


# --- attention of selected query positions -------------------------------------------------


def _qkv(n_q: int, n_k: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int):
    g = _gen(seed)
    return (
        torch.randn(n_q, heads, HD, generator=g).to(dtype),
        torch.randn(n_k, kv_heads, HD, generator=g).to(dtype),
        torch.randn(n_k, kv_heads, HD, generator=g).to(dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selected_attention_of_sparse_positions(tk, dtype):
    """CacheBlend's case: a few selected tokens (positions with gaps) against the whole
    context; lengths cross several 16-wide tiles and end mid-tile."""
    n_k = 77
    q_pos = torch.tensor([0, 2, 3, 17, 18, 40, 41, 42, 63, 64, 65, 70, 75, 76, 5, 33, 50])  # not sorted either
    q, k, v = _qkv(len(q_pos), n_k, 9, 3, dtype, seed=8)
    k_pos = torch.arange(n_k)
    out = tk.selected_attention(q, k, v, q_pos, k_pos, None, block_m=16, block_n=16)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), attend(*_up(q, k, v), q_pos, k_pos), **_tol(dtype))


def test_selected_attention_full_prefill_equals_attend(tk):
    q, k, v = _qkv(50, 50, 6, 2, torch.float32, seed=9)
    pos = torch.arange(50, dtype=torch.int32)
    out = tk.selected_attention(q, k, v, pos, pos, None, block_m=16, block_n=16)
    torch.testing.assert_close(out, attend(q, k, v, pos, pos), **_tol(torch.float32))


def test_selected_attention_keys_with_gaps_and_shuffled(tk):
    """Keys need not be contiguous or ordered: the mask is by position, never by index."""
    q, k, v = _qkv(9, 40, 4, 4, torch.float32, seed=10)
    g = _gen(11)
    k_pos = torch.randperm(200, generator=g)[:40]
    q_pos = torch.randint(0, 200, (9,), generator=g)
    q_pos[0] = int(k_pos.min())  # sees exactly one key
    out = tk.selected_attention(q, k, v, q_pos, k_pos, 0.2, block_m=16, block_n=16)
    torch.testing.assert_close(out, kernels.selected_attention_ref(q, k, v, q_pos, k_pos, 0.2), **_tol(torch.float32))
    torch.testing.assert_close(out[0], v[k_pos.argmin()], atol=1e-6, rtol=1e-6)


def test_selected_attention_query_never_sees_a_later_key(tk):
    q, k, v = _qkv(3, 40, 2, 1, torch.float32, seed=12)
    q_pos = torch.tensor([10, 25, 39])
    k_pos = torch.arange(40)
    before = tk.selected_attention(q, k, v, q_pos, k_pos, None, block_m=16, block_n=16)
    k[11:], v[11:] = k[11:] * 5 + 3, v[11:] * 5 + 3  # only keys after the first query's position
    after = tk.selected_attention(q, k, v, q_pos, k_pos, None, block_m=16, block_n=16)
    torch.testing.assert_close(after[0], before[0], atol=0, rtol=0)
    assert not torch.allclose(after[1:], before[1:])


def test_selected_attention_query_without_visible_key_gives_zeros(tk):
    q, k, v = _qkv(2, 8, 2, 2, torch.float32, seed=13)
    out = tk.selected_attention(q, k, v, torch.tensor([4, 20]), torch.arange(10, 18), None)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:], attend(q[1:], k, v, torch.tensor([20]), torch.arange(10, 18)), **_tol(torch.float32))


# --- dispatchers ---------------------------------------------------------------------------


def test_dispatchers_on_cpu_run_the_references():
    inv_freq = Rotary(HD, 10000.0).inv_freq
    x, pos = torch.randn(4, 3, HD, generator=_gen(14)), torch.tensor([0, 5, 6, 9])
    assert torch.equal(kernels.rope(x, pos, inv_freq), kernels.rope_ref(x, pos, inv_freq))
    q, k, v = _qkv(4, 10, 4, 2, torch.float32, seed=15)
    kp = torch.arange(10)
    assert torch.equal(kernels.selected_attention(q, k, v, pos, kp), kernels.selected_attention_ref(q, k, v, pos, kp))
    case = _paged_case([3, 12], 4, 2, 4, torch.float32, seed=16)
    assert torch.equal(kernels.paged_decode_attention(*case), kernels.paged_decode_attention_ref(*case))


def test_dispatchers_reject_bad_input():
    q, k, v = _qkv(4, 10, 4, 3, torch.float32, seed=17)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        kernels.selected_attention(q, k, v, torch.arange(4), torch.arange(10))
    q, k, v = _qkv(4, 10, 4, 2, torch.float32, seed=17)
    with pytest.raises(ValueError, match="integer"):
        kernels.selected_attention(q, k, v, torch.arange(4.0), torch.arange(10))
    with pytest.raises(ValueError, match=r"k_pos must have shape \(10,\)"):
        kernels.selected_attention(q, k, v, torch.arange(4), torch.arange(9))
    with pytest.raises(ValueError, match="one device"):
        kernels.selected_attention(q, k.to("meta"), v, torch.arange(4), torch.arange(10))
    with pytest.raises(ValueError, match="inv_freq"):
        kernels.rope(q, torch.arange(4), torch.ones(HD))
    q, k_pool, v_pool, tables, lens = _paged_case([3], 4, 2, 4, torch.float32, seed=18)
    with pytest.raises(ValueError, match="share a dtype"):
        kernels.paged_decode_attention(q.bfloat16(), k_pool, v_pool, tables, lens)
    with pytest.raises(ValueError, match="block_tables"):
        kernels.paged_decode_attention(q, k_pool, v_pool, tables[0], lens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_kernels_match_references(dtype):
    """On a GPU the dispatchers run the compiled kernels; the references run on the CPU."""
    assert kernels.triton_available()
    cuda = torch.device("cuda")
    inv_freq = Rotary(HD, 100000.0).inv_freq
    x, pos = torch.randn(300, 12, HD, generator=_gen(19)).to(dtype), torch.randint(0, 8192, (300,), generator=_gen(19))
    torch.testing.assert_close(
        kernels.rope(x.to(cuda), pos.to(cuda), inv_freq.to(cuda)).cpu().float(),
        kernels.rope_ref(x.float(), pos, inv_freq), **_tol(dtype),
    )
    case = _paged_case([1, 100, 1000, 3000], 9, 3, 16, dtype, seed=20)
    out = kernels.paged_decode_attention(*(t.to(cuda) for t in case)).cpu()
    expected = kernels.paged_decode_attention_ref(*_up(*case[:3]), *case[3:])
    torch.testing.assert_close(out.float(), expected, **_tol(dtype))
    q, k, v = _qkv(200, 1500, 9, 3, dtype, seed=21)
    q_pos, k_pos = torch.randperm(1500, generator=_gen(22))[:200], torch.arange(1500)
    out = kernels.selected_attention(*(t.to(cuda) for t in (q, k, v, q_pos, k_pos))).cpu()
    torch.testing.assert_close(out.float(), attend(*_up(q, k, v), q_pos, k_pos), **_tol(dtype))


def _compile_for_hopper(fn, pointers: dict[str, str], constexprs: dict) -> None:
    """Compile a kernel to a cubin for sm_90 without a GPU (triton bundles ptxas): what the
    interpreter cannot check (typing of the compiled IR, dot layouts, fp64 math) is checked
    here. Arguments not named are i32, except the fp32 softmax scale."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        name: pointers.get(name) or ("constexpr" if name in constexprs else "fp32" if name == "qk_scale" else "i32")
        for name in fn.arg_names
    }
    kernel = triton_compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles, so needs triton uninterpreted")
def test_bf16_kernels_compile_for_hopper():
    from agentmem.engine.kernels import triton_ops as t

    bf16 = "*bf16"
    _compile_for_hopper(
        t._rope_kernel,
        {"x_ptr": bf16, "out_ptr": bf16, "pos_ptr": "*i64", "inv_freq_ptr": "*fp64"},
        {"BLOCK_H": 16, "HALF": 32},
    )
    attn = {"GROUP": 3, "D_PAD": 64, "BLOCK_N": 64, "PRECISION": "tf32", "UPCAST": False}
    for split in (False, True):
        _compile_for_hopper(
            t._paged_decode_kernel,
            {"q_ptr": bf16, "k_ptr": bf16, "v_ptr": bf16, "table_ptr": "*i32", "lens_ptr": "*i32",
             "out_ptr": "*fp32" if split else bf16, "m_ptr": "*fp32", "l_ptr": "*fp32"},
            {**attn, "G_PAD": 16, "SPLIT": split},
        )
    _compile_for_hopper(
        t._selected_attention_kernel,
        {"q_ptr": bf16, "k_ptr": bf16, "v_ptr": bf16, "qpos_ptr": "*i64", "kpos_ptr": "*i64", "out_ptr": bf16},
        {**attn, "BLOCK_M": 64},
    )

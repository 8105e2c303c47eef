"""The CacheBlend fuser: one prefill that places cached chunk KV at its new positions and
recomputes only what it must.

Modes:
- `full`: every token runs through every layer (plain prefill; the baseline).
- `reuse`: cached KV is re-rotated to its positions and used as is; only uncached tokens
  (and the last token, whose logits are needed) run.
- `blend`: pick the top `ratio` of the cached tokens, plus every uncached token and the last
  token; run only those and scatter their K/V over the cached K/V. What ranks the cached
  tokens is the metric:
  - `k` / `v` / `kv` (CacheBlend's rule): layers 0..check_layer (default 1) run every token
    after the exact prefix, and the deviation of the recomputed K or V from the cached one at
    the check layer ranks them; `attn` / `vattn` use the question's attention there instead
    (alone, or times the V deviation).
  - `auto` (the default): `query` once AUTO_QUERY_MIN_TOKENS tokens are cached, `v` below.
  - `query`: a cheap probe runs only the uncached tail (the question) through
    the layers against the cached KV, as `reuse` would, and ranks the cached tokens by what
    they add to its attention outputs (attention x value norm, summed over layers and heads):
    the tokens the question actually reads. Its default check_layer is -1: no layer runs
    every token. Layer-0 K/V depends on the token alone, so recomputing it for every token
    (as check_layer 0 would) changes nothing; the probe starts from the embeddings.
- `drift` (a share of each chunk, default 0.03 via Config.blend_drift): besides the top
  tokens, a few evenly spaced tokens of every cached chunk are always recomputed, and at
  every blended layer the mean of their (recomputed - cached) K and V, per chunk, is added
  to that chunk's tokens that are not recomputed (see `_Drift`). A chunk's cached KV misses
  the text that now precedes it, and much of that error is shared by all its tokens; top-r
  selection alone cannot fix an error spread over every token. The drift samples count
  inside `ratio`: the recompute budget is unchanged.

On the blend benchmark (2k-token prompts, r = 0.15) the KL of the next-token distribution
against full prefill is: reuse 0.194, `v` 0.114, `query` 0.076, `query` + drift 0.022, at
the same cost (docs/kvreuse.md has the runs, and the experiments behind drift).

Attention is exact and causal by position (query at p sees keys at <= p). With ratio 1.0
every token runs every layer, in the same calls `full` makes, so the logits are the same.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..engine.kernels import cpu_bf16, cpu_fp32, rope, selected_attention
from ..engine.kernels.reference import sdpa
from ..engine.layers import half_swapped, visible
from ..engine.model import Transformer
from ..engine.model_runner import attend_chunk
from ..engine.threads import TRACE_LOCK
from .store import ChunkKV

MODES = ("full", "reuse", "blend")
DRIFT_MIN_SAMPLES = 12  # see _Drift.sample; 8-16 measured alike (docs/kvreuse.md)
METRICS = ("auto", "k", "v", "kv", "attn", "vattn", "query")
# `auto` (the default) uses `query` once this many tokens are cached, `v` below: on short
# prompts the probe's fixed cost and too few drift samples leave `v` ahead (310-token prompts
# of short chunks: KL 0.318 vs 0.35, 2.4x vs 1.8x); on long ones `query` + drift is far
# closer to full prefill (2k tokens: KL 0.022 vs 0.114 at the same cost). 400 is also where
# the default drift (3%, 12 samples a group) first has a group.
AUTO_QUERY_MIN_TOKENS = 400


@dataclass
class Piece:
    """A run of prompt tokens [start, start + n) and the cached KV to place there (None:
    compute it). `exact` pieces (a prefix computed after exactly these tokens) are never
    recomputed; they must come first."""

    start: int
    n: int
    kv: ChunkKV | None = None
    exact: bool = False


@dataclass
class Fused:
    k: torch.Tensor  # [L, T, KV, hd], rotated at positions 0..T-1
    v: torch.Tensor
    last_logits: torch.Tensor  # [V] fp32
    ran: torch.Tensor  # bool [T]: tokens computed at every layer (recomputed or prefilled)
    new_k_raw: torch.Tensor | None  # [L, n_new, KV, hd]: K before RoPE of the uncached tokens
    new_idx: torch.Tensor  # their positions


class Clock:
    """Seconds per part of one prefill, lap by lap: `lap(part)` charges the time since the
    previous lap to `part`, so the parts tile the measured span with nothing counted twice
    (what `agentmem bench blend` prints as `blend_breakdown_s`). On CUDA each lap waits for
    the device first. Pass `None` where no breakdown is wanted: `lap` is then never called."""

    PARTS = ("lookup", "place", "probe", "select", "drift", "layers", "attention", "logits", "finish")

    def __init__(self, cuda: bool = False):
        self.parts: dict[str, float] = {}
        self.cuda = cuda
        self.t = time.perf_counter()

    def lap(self, part: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + now - self.t
        self.t = now


def _no_lap(part: str) -> None:
    pass


def place_k(model: Transformer, k: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Rotate pre-RoPE K [L, n, KV, hd] of every layer to `positions` [n] in one call, with
    that model's RoPE (its scaling included): the Triton kernel on CUDA (fed the model's
    inverse frequencies); on the CPU the model's own Rotary, bit-identical to its forward (in
    bf16 on an AVX512-BF16 CPU and fp32 on an AVX2 one, the engine's RoPE kernel a layer at a
    time, written straight into `out`: Zen 4 VM, 2026-11-26, a 2k-token blend's 8 chunks 38 ->
    9 ms in one check; in `bench blend` the place part stayed ~27 ms, which also holds
    allocating the blend's K/V).
    With `out` ([L, n, KV, hd], e.g. the blend's K at the chunk's place) the result goes there."""
    layers, n, kv_heads, hd = k.shape
    if k.is_cuda:
        x = rope(k.transpose(0, 1).reshape(n, layers * kv_heads, hd), positions, model.rotary.inv_freq)
        x = x.view(n, layers, kv_heads, hd).transpose(0, 1)
    else:
        cos, sin = model.rotary.cos_sin(positions)
        for kernels in (cpu_bf16, cpu_fp32):  # bf16 (AVX512-BF16) or fp32 (AVX2) rows
            lib = kernels.loaded()
            if (lib is not None and out is not None and out.dtype == k.dtype and layers
                    and kernels.rope_usable(k[0], cos) and all(out[i].is_contiguous() for i in range(layers))):
                for i in range(layers):
                    kernels.rope_into(lib, k[i], cos, sin, out[i])
                return out
        x = model.rotary.apply(k, positions, (cos, sin))
    if out is not None:
        out.copy_(x)
        return out
    return x


_BUFFERS = threading.local()  # per thread: the last blend's K/V buffer (`kv_buffers`)


def _only_holder(t: torch.Tensor) -> bool:
    """Whether no tensor but `t` uses its storage (no view of it is alive). torch counts the
    storage's users: `t` and the temporary storage object asked here make 2."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count is not None and use_count(t.untyped_storage()._cdata) == 2


def kv_buffers(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The blend's K and V [L, T, KV, hd] (uninitialised). On the CPU, views of one buffer per
    thread that the next prefill takes again once nothing holds the last one's K/V (the engine
    loop writes them into its pool and drops them), instead of fresh memory: an fp32 2k-token
    blend's K/V are 2 x 47 MB, past glibc's mmap threshold, so each prefill's came from new
    pages and took their page faults on first touch (Zen 3 VM, 2026-11-27: placing the chunks
    65-70 ms a prefill in fresh memory, 15 ms in reused). A caller that keeps a result (two blends
    compared) makes the next one allocate. On CUDA the caching allocator already reuses."""
    n = math.prod(shape)
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
    buf = getattr(_BUFFERS, "kv", None)
    if (buf is None or buf.dtype != dtype or buf.numel() < 2 * n or not _only_holder(buf)
            or buf.is_inference() != torch.is_inference_mode_enabled()):  # an inference tensor is
        # written in place only inside inference mode (and a normal one made there would be kept)
        buf = torch.empty(2 * n, dtype=dtype, device=device)
        _BUFFERS.kv = buf
    return buf[:n].view(shape), buf[n : 2 * n].view(shape)


def fold_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Queries [N, H, hd] -> [KV, g*N, hd]: the g = H // KV query heads that read KV head j
    become rows of batch j, ordered (group, query), the row order of `causal_bias`."""
    n, heads, hd = q.shape
    g = heads // kv_heads
    return q.view(n, kv_heads, g, hd).permute(1, 2, 0, 3).reshape(kv_heads, g * n, hd)


def unfold_heads(o: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `fold_heads`: [KV, g*N, hd] -> [N, H, hd]."""
    kv_heads, rows, hd = o.shape
    g = rows // n
    return o.view(kv_heads, g, n, hd).permute(2, 0, 1, 3).reshape(n, kv_heads * g, hd)


class RowAttention:
    """Exact causal attention of a fixed set of query rows (sorted positions `q_pos`) over keys
    at 0..n_keys-1, for every layer of one prefill. The rows are the same at every layer, so
    what depends only on them (the blocks and their masks) is built once.

    On the CPU the rows go in `blocks` groups, each against the keys up to its last row only
    (which spares most of the masked work: 8% is left on the blend benchmark's rows), and the
    g query heads that share a KV head are folded into the rows ([KV, g*m, hd] against
    [KV, keys, hd]), so SDPA runs as plain multi-head attention instead of expanding K/V to
    every query head as `enable_gqa` does. On the benchmark's rows (~320 of 2k tokens, skewed
    late) this takes ~20% less time than the per-head layout with a mask built per call.
    On CUDA the Triton kernel skips masked keys itself (a sliding-window model takes SDPA
    with the window's mask there). In bf16 on an AVX512-BF16 CPU, the engine's own kernel
    (`cpu_bf16.rows_attention`) takes the rows: scores and P V on vdpbf16ps, masked keys
    skipped per block of 8 rows; on the blend benchmark's shapes ~3x faster than SDPA."""

    def __init__(self, q_pos: torch.Tensor, n_keys: int, dtype: torch.dtype, blocks: int = 4,
                 window: int | None = None):
        self.q_pos = q_pos
        self.blocks = blocks
        self.k_pos = torch.arange(n_keys, device=q_pos.device)
        self.window = window
        self.parts: list[tuple[int, int, int, torch.Tensor]] = []
        # cpu_bf16.rows_attention, where it takes the rows' tensors (bf16 on an AVX512-BF16 CPU)
        self.kernel = dtype == torch.bfloat16 and window is None and not q_pos.is_cuda
        self.widen = False
        # the grouped SDPA blocks (`parts`) are planned at the first CPU call no kernel takes
        # (fp32 rows on cpu_fp32's kernel never need them), once

    def _plan(self, group: int, dtype: torch.dtype) -> None:
        """The CPU row blocks and their masks (the grouped SDPA path)."""
        n = len(self.q_pos)
        blocks = max(1, min(self.blocks, n // 32))
        cuts = [round(n * i / blocks) for i in range(blocks + 1)]
        for s, e in zip(cuts, cuts[1:], strict=False):
            end = int(self.q_pos[e - 1]) + 1
            _, bias = causal_bias(self.q_pos[s:e], end, group, dtype, first=0, window=self.window)
            self.parts.append((s, e, end, bias[None, None]))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [Nq,H,hd] at the rows, k/v [n_keys,KV,hd] -> [Nq,H,hd]."""
        if self.kernel and (out := cpu_bf16.rows_attend(q, k, v, self.q_pos)) is not None:
            return out
        # fp32 rows on a CPU without bf16, cpu_fp32's kernel (Skylake-SP VM, AVX-512, 2026-11-28:
        # ~320 late rows over 2k keys 17.2 -> 12.3 ms a layer against this grouped SDPA; Zen 3 VM,
        # AVX2, 2026-11-29: ~310 rows over 2k keys 10.2 -> 7.7 ms)
        if self.window is None and (lib := cpu_fp32.rows_kernel(q, k)) is not None and \
                (out := cpu_fp32.rows_attention(lib, q, k, v, self.q_pos)) is not None:
            return out
        if self.kernel:  # the kernel does not take these tensors after all: the grouped SDPA path
            self.kernel = False
            self.widen = cpu_bf16.widen_rows(q, k)  # in fp32 where this machine runs that faster
            self._plan(q.shape[1] // k.shape[1], torch.float32 if self.widen else q.dtype)
        elif not self.parts and not q.is_cuda:
            self._plan(q.shape[1] // k.shape[1], q.dtype)
        if self.widen and q.dtype != torch.float32:
            return self(q.float(), k.float(), v.float()).to(q.dtype)
        if not self.parts:
            if self.window is not None:
                return sdpa(q, k, v, visible(self.q_pos, self.k_pos, self.window))
            return selected_attention(q, k, v, self.q_pos, self.k_pos)
        kv_heads = k.shape[1]
        out = torch.empty_like(q)
        kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        for s, e, end, bias in self.parts:
            qg = fold_heads(q[s:e], kv_heads)[None]
            o = F.scaled_dot_product_attention(qg, kt[:, :, :end], vt[:, :, :end], attn_mask=bias)
            out[s:e] = unfold_heads(o[0], e - s)
        return out


def causal_bias(q_pos: torch.Tensor, n_keys: int, group: int, dtype: torch.dtype = torch.float32,
                first: int | None = None, window: int | None = None) -> tuple[int, torch.Tensor]:
    """The additive causal mask of queries at `q_pos` over keys first..n_keys-1, in the
    grouped row order (group, query): [g*Nq, n_keys - first]. Keys before the first query's
    position are seen by every query (without a sliding `window`), so by default the mask
    starts there; `first` = 0 gives the whole mask (no queries: an empty one)."""
    if first is None:
        first = 0 if window is not None else int(q_pos.min()) if len(q_pos) else n_keys
    k_pos = torch.arange(first, n_keys, device=q_pos.device)
    bias = torch.zeros(len(q_pos), n_keys - first, device=q_pos.device, dtype=dtype)
    bias.masked_fill_(~visible(q_pos, k_pos, window), float("-inf"))
    return first, bias.repeat(group, 1)


def _attention_probs(q: torch.Tensor, k: torch.Tensor, bias: tuple[int, torch.Tensor]) -> torch.Tensor:
    """Exact causal attention weights (fp32) of queries q [Nq,H,hd] over keys k [T,KV,hd]:
    [KV, g*Nq, T], rows ordered (group, query) with g = H // KV (query head h uses KV head
    h // g). `bias` is `causal_bias` of the queries (built once where the rows repeat).
    The scores are multiplied in the keys' dtype (these weights only rank the cached tokens:
    in bf16 that spares a float copy of every key at every layer, a third of the probe's
    time) and the softmax is taken in fp32."""
    qg = fold_heads(q.to(k.dtype) * q.shape[-1] ** -0.5, k.shape[1])
    scores = torch.bmm(qg, k.permute(1, 2, 0)).float()
    first, b = bias
    scores[:, :, first:] += b
    return torch.softmax(scores, dim=-1)


def _attention_share(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, window: int | None = None
                     ) -> torch.Tensor:
    """How much attention queries q [Nq,H,hd] at q_pos pay to each key of k [T,KV,hd] (at
    0..T-1), summed over queries and heads: [T]."""
    bias = causal_bias(q_pos, k.shape[0], q.shape[1] // k.shape[1], window=window)
    return _attention_probs(q, k, bias).sum((0, 1))


def _attend_and_share(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      bias: tuple[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact causal attention of a few queries q [Nq,H,hd] over k/v [T,KV,hd] (keys at
    0..T-1; `bias` is `causal_bias` of the queries' positions), and what each key adds to
    their outputs: the attention paid to it times the norm of its value, summed over queries
    and heads. Returns ([Nq,H,hd], [T])."""
    probs = _attention_probs(q, k, bias)
    out = unfold_heads(torch.bmm(probs.to(v.dtype), v.transpose(0, 1)), q.shape[0])
    share = (probs.sum(1) * torch.linalg.vector_norm(v, dim=-1, dtype=torch.float32).T).sum(0)
    return out, share


def _probe(model: Transformer, h: torch.Tensor, rows: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
           first_layer: int) -> torch.Tensor:
    """The `query` selection signal. Run only `rows` (the uncached tail: the question and
    the last token), from hidden states h at `first_layer`, through the remaining layers
    against the cached K/V placed there (as `reuse` would), and return per key what it adds
    to their attention outputs: the tokens the question actually reads in the deep layers,
    where the cached KV is stale. Their K/V is written into k_all/v_all; the blend pass
    overwrites it at every layer."""
    cos_sin = model.rotary.cos_sin(rows)  # rows are positions
    window = model.args.sliding_window
    bias = None
    share = torch.zeros(k_all.shape[1], device=k_all.device)
    for layer in model.layers[first_layer:]:
        def attn(idx, q, k_raw, k_rot, v):
            nonlocal bias
            k_l, v_l = k_all[idx], v_all[idx]
            k_l.index_copy_(0, rows, k_rot)
            v_l.index_copy_(0, rows, v)
            if window is None and (out := cpu_bf16.rows_attend(q, k_l, v_l, rows, share=share)) is not None:
                # bf16 on an AVX512-BF16 CPU: the rows' attention and each key's share in one C
                # call, no weights materialised (6.2 -> 0.9 ms a layer for 40 rows over 2k keys
                # on a Zen 4 VM, 2026-11-26), on AMX tiles where that is the machine's route
                return out
            if window is None and (lib := cpu_fp32.rows_kernel(q, k_l)) is not None and \
                    (out := cpu_fp32.rows_attention(lib, q, k_l, v_l, rows, share=share)) is not None:
                # fp32 on cpu_fp32's AVX2 build, likewise (Zen 3 VM, 2026-11-29: the probe's
                # attention 45 -> ~10 ms of a 2k-token blend)
                return out
            if bias is None:
                bias = causal_bias(rows, k_all.shape[1], model.args.n_heads // model.args.n_kv_heads, window=window)
            out, s = _attend_and_share(q, k_l, v_l, bias)
            share.add_(s)
            return out

        h = layer(h, rows, model.rotary, attn, cos_sin)
    return share


def check_blend_settings(metric: str, check_layer: int | None, drift: float, n_layers: int,
                         prefix: str = "") -> None:
    """Raise ValueError for a bad selection metric, check layer or drift share. `prefix` names
    them as the caller knows them (ChunkReuse passes "blend_", the Config field prefix)."""
    if metric not in METRICS:
        raise ValueError(f"{prefix}metric must be one of {METRICS}, got {metric!r}")
    if not 0.0 <= drift <= 1.0:
        raise ValueError(f"{prefix}drift must be in [0, 1], got {drift}")
    if check_layer is None:
        return
    if metric == "auto":
        raise ValueError(f"{prefix}check_layer must be unset with {prefix}metric 'auto' (it picks -1 for query, "
                         f"1 for v); got {check_layer}")
    if not (0 <= check_layer < n_layers or (check_layer == -1 and metric == "query")):
        raise ValueError(f"{prefix}check_layer must be in [0, {n_layers}) (or -1 with {prefix}metric 'query'), "
                         f"got {check_layer} with {metric!r}")


def resolve_check_layer(metric: str, check_layer: int | None) -> int | None:
    """None means the metric's default: -1 (no layer runs every token) for `query`, 1 for the
    others; `auto` decides per prompt, so it stays None."""
    if check_layer is None and metric != "auto":
        return -1 if metric == "query" else 1
    return check_layer


def _unselected(cached: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    keep = cached.clone()
    keep[rows] = False
    return keep.nonzero()[:, 0]


def _top(cached_idx: torch.Tensor, score: torch.Tensor, ratio: float) -> torch.Tensor:
    """The `ratio` share of cached positions with the highest score (rounded up)."""
    n_pick = min(len(cached_idx), math.ceil(ratio * len(cached_idx) - 1e-9))
    return cached_idx[score.topk(n_pick).indices]


@dataclass
class _Drift:
    """The mean drift of each cached chunk's KV. A chunk's cached KV was computed without the
    text that now precedes it; part of the error is common to all its tokens. A few tokens
    per chunk, evenly spaced (`sample`), are always recomputed; at every blended layer the
    mean of their (recomputed - cached) K before RoPE and V, per chunk, is added to that
    chunk's tokens that are not recomputed (K rotated to their positions)."""

    pos: torch.Tensor  # [S] sampled positions, sorted
    group: torch.Tensor  # [S] chunk of each sample
    k_raw: torch.Tensor  # [L, S, KV, hd] cached K before RoPE at the samples
    v: torch.Tensor  # [L, S, KV, hd] cached V at the samples
    token_group: torch.Tensor  # [T] chunk of each position (-1: not a blended chunk)
    n_groups: int

    @staticmethod
    def sample(pieces: list[Piece], share: float, n_tok: int, device, min_samples: int | None = None
               ) -> _Drift | None:
        """Group consecutive cached chunks until a group gives `min_samples` samples at `share`
        (a short chunk alone gives too few for a mean: one sample's delta is mostly its own
        token's, and applying it to the rest hurts), and pick `share` of each group's tokens,
        evenly spaced, as its samples. None when all cached chunks together give fewer."""
        min_samples = DRIFT_MIN_SAMPLES if min_samples is None else min_samples
        group_tokens = math.ceil(min_samples / share - 1e-9)
        groups: list[list[Piece]] = [[]]
        for p in pieces:
            if p.kv is None or p.exact or not p.n:
                continue
            if groups[-1] and sum(q.n for q in groups[-1]) >= group_tokens:
                groups.append([])
            groups[-1].append(p)
        if len(groups) > 1 and sum(q.n for q in groups[-1]) < group_tokens:
            rest = groups.pop()
            groups[-1] += rest  # a short remainder joins the group before it
        if sum(q.n for q in groups[0]) < group_tokens:
            return None
        token_group = torch.full((n_tok,), -1, dtype=torch.long, device=device)
        pos, group, ks, vs = [], [], [], []
        for g, members in enumerate(groups):
            at = torch.cat([torch.arange(p.start, p.start + p.n, device=device) for p in members])
            n_s = max(1, round(share * len(at)))
            pick = ((torch.arange(n_s, device=device) + 0.5) * len(at) / n_s).long()
            token_group[at] = g
            pos.append(at[pick])
            group.append(torch.full((n_s,), g, dtype=torch.long, device=device))
            for p in members:
                local = at[pick] - p.start
                local = local[(local >= 0) & (local < p.n)].to(p.kv.k.device)
                ks.append(p.kv.k[:, local].to(device))
                vs.append(p.kv.v[:, local].to(device))
        return _Drift(torch.cat(pos), torch.cat(group), torch.cat(ks, 1), torch.cat(vs, 1), token_group,
                      len(groups))

    def bind(self, model: Transformer, rows: torch.Tensor) -> None:
        """Fix, once the selection is made, what every layer's `apply` reuses: where the samples
        are among the rows, each group's span of positions (first to last token: the tokens
        of no group inside it are rows) and the model's whole RoPE tables (a span's rows are a
        slice of them)."""
        self.rows_at = torch.searchsorted(rows, self.pos)
        self.inv_count = (1.0 / torch.bincount(self.group, minlength=self.n_groups).float())[:, None, None]
        self.spans = []
        for g in range(self.n_groups):
            at = (self.token_group == g).nonzero()[:, 0]
            self.spans.append((int(at[0]), int(at[-1]) + 1))
        self.span_t = torch.tensor(self.spans, dtype=torch.int64).view(-1, 2)
        self.tables = model.rotary.tables()
        # the engine's C kernel where it takes the layers' K (bf16 on an AVX512-BF16 CPU): one
        # call a layer, reading the tables by position (Zen 4 VM, 2026-11-26: the drift part
        # of `bench blend` 0.030 -> 0.014 s)
        self.lib = cpu_bf16.loaded() if model.embed_tokens.weight.device.type == "cpu" else None

    def apply(self, idx: int, k_raw: torch.Tensor, v: torch.Tensor, k_l: torch.Tensor, v_l: torch.Tensor) -> None:
        """Layer `idx`: given the rows' fresh K before RoPE and V, shift k_l / v_l in place by
        their group's mean drift, K rotated to each position (RoPE of a constant d at p is
        d * cos(p) + swap(d) * sin(p), two broadcast multiply-adds per group). Every token of
        a group's span is shifted, the rows too: the pass overwrites them with their fresh
        K/V right after, and in-place slices cost far less than scattering into the others."""
        shape = (self.n_groups, *k_raw.shape[1:])
        r = self.rows_at
        dk = torch.zeros(shape, device=v.device).index_add_(0, self.group, (k_raw[r] - self.k_raw[idx]).float())
        dv = torch.zeros(shape, device=v.device).index_add_(0, self.group, (v[r] - self.v[idx]).float())
        dk *= self.inv_count
        dv *= self.inv_count
        if self.lib is not None and cpu_bf16.drift_usable(k_l):
            cpu_bf16.drift(self.lib, k_l, v_l, self.span_t, dk, dv, *self.tables)
            return
        swapped = half_swapped(dk)
        cos, sin = self.tables
        for g, (lo, hi) in enumerate(self.spans):
            k_g = k_l[lo:hi]
            k_g.addcmul_(cos[lo:hi, None, :], dk[g])
            k_g.addcmul_(sin[lo:hi, None, :], swapped[g])
            v_l[lo:hi] += dv[g]


def _pick(cached_idx: torch.Tensor, score: torch.Tensor, ratio: float, drift: _Drift | None) -> torch.Tensor:
    """The top `ratio` of cached positions by score, the drift samples always among them."""
    if drift is not None:
        score = score.clone()
        score[torch.searchsorted(cached_idx, drift.pos)] = float("inf")
    return _top(cached_idx, score, ratio)


def _deviation(old_k, old_v, new_k, new_v, metric: str) -> torch.Tensor:
    dev = torch.zeros(new_k.shape[0], device=new_k.device)
    if metric in ("k", "kv"):
        dev += (new_k.float() - old_k.float()).square().sum((1, 2))
    if metric in ("v", "kv", "vattn"):
        dev += (new_v.float() - old_v.float()).square().sum((1, 2))
    return dev


@torch.inference_mode()
def fuse(*args, **kwargs) -> Fused:
    """`_fuse`, not while torch.compile traces in another thread (engine/threads.py)."""
    with TRACE_LOCK.shared():
        return _fuse(*args, **kwargs)


def _fuse(
    model: Transformer,
    ids: list[int],
    pieces: list[Piece],
    mode: str = "blend",
    ratio: float = 0.15,
    check_layer: int | None = None,
    metric: str = "auto",
    keep_raw: bool = False,
    drift: float = 0.0,
    clock: Clock | None = None,
) -> Fused:
    """The prefill as its steps: place the cached K/V at their positions; plan which rows run
    first; select the cached tokens to recompute (before any layer for `query` with no check
    layer, else at the check layer, by the metric's scorer in `_SCORERS`); run the layers,
    narrowing to the selected rows after the check layer; the last token's logits."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    check_blend_settings(metric, check_layer, drift, model.args.n_layers)
    run = _Pass(model, ids, clock.lap if clock is not None else _no_lap)
    run.place(pieces if mode != "full" else [])
    if metric == "auto":
        metric = "query" if len(run.cached_idx) >= AUTO_QUERY_MIN_TOKENS else "v"
    check = run.plan(mode, resolve_check_layer(metric, check_layer), ratio, min(drift, ratio), pieces)
    if check == -1:  # no layer runs every token: the probe reads the cached KV from layer 0 on
        tail = run.tail()
        share = _probe(model, model.embed_tokens(run.ids_t[tail]), tail, run.k_all, run.v_all, 0)
        run.select(share[run.cached_idx], "probe")
    h = run.embed(keep_raw)
    for i, layer in enumerate(model.layers):
        at_check = i == check
        h = run.layer(layer, h, _SCORERS.get(metric) if at_check else None)
        if at_check and metric == "query":
            tail = run.tail()
            share = _probe(model, h[torch.searchsorted(run.rows, tail)], tail, run.k_all, run.v_all, i + 1)
            run.pick(share[run.cached_idx], "probe")
        if at_check and i + 1 < model.args.n_layers:
            h = run.narrow(h)  # everything picked: the contiguous path again where it can
    return run.finish(h)


def _deviation_score(metric: str):
    """A scorer for the check layer, one score per cached token: the deviation of the rows'
    fresh K and/or V from its cached K/V (CacheBlend's rule), or the question's attention
    share there (`attn`), or both multiplied (`vattn`)."""
    def score(run: _Pass, q, k_rot, v, k_l, v_l) -> torch.Tensor:
        crow = torch.searchsorted(run.rows, run.cached_idx)
        d = _deviation(k_l[run.cached_idx], v_l[run.cached_idx], k_rot[crow], v[crow], metric)
        if metric in ("attn", "vattn"):
            k_now = k_l.clone()
            k_now[run.start:] = k_rot
            share = _attention_share(q[run.new_rows], k_now, run.pos[run.new_idx],
                                     run.model.args.sliding_window)[run.cached_idx]
            d = share if metric == "attn" else d * share
        return d
    return score


# What ranks the cached tokens, read inside the check layer's attention (before its fresh K/V
# overwrite the cached); `query` ranks them after the layer, by `_probe`, and has no entry.
_SCORERS = {m: _deviation_score(m) for m in ("k", "v", "kv", "attn", "vattn")}


class _Pass:
    """One prefill's state, phase by phase (`_fuse`): the K/V buffers, which positions are
    cached, the rows that run (`rows`, and `start` when they are every token from there on),
    the selection, the drift samples and what every layer reuses while the rows stay the
    same (their RoPE tables and attention plan)."""

    def __init__(self, model: Transformer, ids: list[int], lap):
        self.model, self.lap = model, lap
        a = model.args
        self.dev = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.n_tok = len(ids)
        self.pos = torch.arange(self.n_tok, device=self.dev)
        self.k_all, self.v_all = kv_buffers((a.n_layers, self.n_tok, a.n_kv_heads, a.head_dim), self.dtype, self.dev)
        self.cached = torch.zeros(self.n_tok, dtype=torch.bool, device=self.dev)
        self.ids_t = torch.tensor(ids, device=self.dev)
        self.last = torch.tensor([self.n_tok - 1], device=self.dev)
        self.picked: list[torch.Tensor] = []
        self.drifts: _Drift | None = None
        self.unsel: torch.Tensor | None = None  # cached positions not recomputed, once selected
        self.new_k_raw: torch.Tensor | None = None

    def place(self, pieces: list[Piece]) -> None:
        """Phase 1: each piece's cached K rotated to its positions and its V, into the buffers;
        `prefix` is where the exact pieces end (never recomputed), `cached` the rest placed."""
        prefix = 0
        for p in pieces:
            if p.kv is None:
                continue
            sl = slice(p.start, p.start + p.n)
            place_k(self.model, p.kv.k.to(self.dev, self.dtype), self.pos[sl], out=self.k_all[:, sl])
            self.v_all[:, sl] = p.kv.v.to(self.dev, self.dtype)
            if p.exact:
                if p.start != prefix:
                    raise ValueError("exact pieces must form a prefix of the prompt")
                prefix = p.start + p.n
            else:
                self.cached[sl] = True
        self.lap("place")
        if prefix >= self.n_tok:  # the last token must run to give logits
            prefix = self.n_tok - 1
            self.cached[prefix:] = False
        new = ~self.cached
        new[:prefix] = False
        self.prefix = prefix
        self.new_idx = new.nonzero()[:, 0]
        self.cached_idx = self.cached.nonzero()[:, 0]

    def plan(self, mode: str, check_layer: int | None, ratio: float, drift_share: float,
             pieces: list[Piece]) -> int | None:
        """Phase 2: the rows that run first (`reuse`: the uncached ones and the last; else every
        token after the prefix) and the check layer where a blend selects (None: no selection);
        the drift samples, which count inside the recompute budget."""
        if mode == "reuse":
            self.rows, self.start = torch.unique(torch.cat([self.new_idx, self.last])), None
        else:
            self.rows, self.start = self.pos[self.prefix:], self.prefix
        self.ratio = ratio
        check = check_layer if mode == "blend" and len(self.cached_idx) else None
        self.lap("select")
        if check is not None and drift_share > 0:
            self.drifts = _Drift.sample(pieces, drift_share, self.n_tok, self.dev)
        self.lap("drift")
        return check

    def tail(self) -> torch.Tensor:
        """The uncached tokens and the last: the question the `query` probe runs."""
        return torch.unique(torch.cat([self.new_idx, self.last]))

    def pick(self, score: torch.Tensor, part: str | None) -> None:
        """The top `ratio` of the cached tokens by `score` (one per cached token), drift samples
        always among them; `part`: the clock's part for the time up to here (None: no lap)."""
        if part is not None:
            self.lap(part)
        self.picked.append(_pick(self.cached_idx, score, self.ratio, self.drifts))

    def select(self, score: torch.Tensor, part: str) -> None:
        """`pick`, and the rows run from here on: picked + uncached + last."""
        self.pick(score, part)
        self._narrow_rows()

    def _narrow_rows(self) -> None:
        sel = torch.unique(torch.cat([self.picked[0], self.new_idx, self.last]))
        self.unsel = _unselected(self.cached, sel)
        if self.drifts is not None:
            self.drifts.bind(self.model, sel)
        self.rows, self.start = sel, (self.prefix if len(sel) == self.n_tok - self.prefix else None)

    def embed(self, keep_raw: bool) -> torch.Tensor:
        """The rows' embeddings, and what every layer reuses while the rows stay the same."""
        a = self.model.args
        h = self.model.embed_tokens(self.ids_t[self.rows])
        if keep_raw:
            self.new_k_raw = torch.empty(a.n_layers, len(self.new_idx), a.n_kv_heads, a.head_dim, device=self.dev,
                                         dtype=self.dtype)
        self._row_tables()
        return h

    def _row_tables(self) -> None:
        """The rows' RoPE tables, and their attention plan when they are not one contiguous run."""
        self.new_rows = torch.searchsorted(self.rows, self.new_idx)
        self.cos_sin = self.model.rotary.cos_sin(self.rows)
        self.row_attn = None if self.start is not None else RowAttention(
            self.rows, self.n_tok, self.dtype, window=self.model.args.sliding_window)
        self.lap("select")

    def narrow(self, h: torch.Tensor) -> torch.Tensor:
        """After the check layer: only the selected rows run on."""
        old = self.rows
        self._narrow_rows()
        h = h[torch.searchsorted(old, self.rows)]
        self._row_tables()
        return h

    def layer(self, layer, h: torch.Tensor, scorer) -> torch.Tensor:
        """Phase 3, one layer over the rows: `scorer` (at the check layer) ranks the cached
        tokens from their fresh K/V before it overwrites the cached; the drift correction
        shifts the tokens not recomputed; the rows' K/V are written and attended."""
        def attn(idx, q, k_raw, k_rot, v):
            self.lap("layers")
            k_l, v_l = self.k_all[idx], self.v_all[idx]
            if scorer is not None:
                self.pick(scorer(self, q, k_rot, v, k_l, v_l), None)
                self.lap("select")
            if self.drifts is not None and self.unsel is not None and len(self.unsel):
                self.drifts.apply(idx, k_raw, v, k_l, v_l)
                self.lap("drift")
            start = self.start
            if start is not None:
                k_l[start:] = k_rot
                v_l[start:] = v
            else:
                k_l.index_copy_(0, self.rows, k_rot)
                v_l.index_copy_(0, self.rows, v)
            if self.new_k_raw is not None:
                self.new_k_raw[idx] = k_raw[self.new_rows]
            if start is not None:
                out = attend_chunk(q, k_l[: start + len(q)], v_l[: start + len(q)], start,
                                   self.model.args.sliding_window)
            else:
                out = self.row_attn(q, k_l, v_l)
            self.lap("attention")
            return out

        h = layer(h, self.rows, self.model.rotary, attn, self.cos_sin)
        self.lap("layers")
        return h

    def finish(self, h: torch.Tensor) -> Fused:
        """Phase 4: which tokens ran, and the last token's logits."""
        ran = torch.zeros(self.n_tok, dtype=torch.bool, device=self.dev)
        ran[self.rows] = True
        logits = self.model.logits(h[-1:])[0]
        self.lap("logits")
        return Fused(self.k_all, self.v_all, logits, ran, self.new_k_raw, self.new_idx)

"""The decode step compiled with torch.compile (inductor's C++/OpenMP kernels on the CPU).

A decode layer (norm, q/k/v product, q/k norms, RoPE, the paged-KV write and gather,
attention, o, norm, gate/up, SwiGLU, down, both residuals) is one compiled graph, and the
same graph runs every layer: the layers differ only in their tensors, which are its
arguments, and the projections are called through `agentmem::proj` (linear.py), so a
oneDNN-packed or int8 weight needs no graph input of its own. The ~45 eager calls of a layer
become ~9: four products and the attention as library calls, the rest fused into a few C++
loops. One graph per layer rather than one for the whole model: the whole 30-layer graph took
234 s to compile on the busy 2-core VM, one layer 24 s, and both run the same kernels.

Shapes are static buckets: the batch is padded to 1, 2, 4, 8 or 16 rows and the KV width to a
power of two from 256; padded rows write their K/V to the pool's scratch block and padded
keys are masked. Each bucket compiles once; inductor keeps the result on disk under
`<cache_dir>/inductor`, so a later process loads it in seconds.

Compilation runs in a background thread (the loop decodes eagerly meanwhile), one bucket at
a time as the loop first needs it. A compile that raises, or runs past `timeout_s`, leaves the
engine on the eager path, and says why (logged, and in `failed`).

Compiled is not always faster: the padded KV width costs attention over up to twice the keys,
and the four products are the same library calls either way. On the 2-core Intel Xeon VM
with AMX (bf16, 2026-11-24) one stream decoded at 26.7 tok/s compiled against 30.3 eager; on
the AMD EPYC VM before, 14.4 against 14.2. So with `measure` (compile=auto on the CPU) the
first steps of each bucket alternate the two paths, TRIALS timed steps each, and the bucket
keeps the faster by its best step (`prefer`, `record`; the choice is logged and kept in
`chosen`). The choice is also remembered under the cache dir (`decode-path-choice.json`, keyed
by torch, the model's shape, dtype and weight format, the threads, the CPU's SIMD flags and the
kernels' source; not saved while the machine is busy, measured.py), and a bucket remembered as
eager (or not yet measured, where every measured width of its batch size went eager) is never
compiled again on this machine: with the fused C decode step eager decodes
2.6x faster than compiled on the AMX Xeon VM (167 against 65 tok/s, 2026-11-27), and the
compile, even from inductor's disk cache, held the first reply of every process for ~5 s
(its trace takes the lock the eager steps take, threads.py). Eager won on every CPU
measured, so with a fused C decode step `auto` builds no CompiledDecode at all
(loop.compiled_decode); this class then serves `compile=on` and unfused models.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .kernels import cpu_bf16, cpu_fp32
from .kv_pool import KVPool
from .layers import rms_norm, rotate
from .linear import kernels_tag
from .measured import machine_busy, read_memo, simd_flags, write_memo
from .model import Transformer
from .threads import TRACE_LOCK

log = logging.getLogger("agentmem.engine")

BATCHES = (1, 2, 4, 8, 16)
TRIALS = 3  # timed decode steps of each path per bucket before the faster one is kept
# inductor's disk cache is one per process (an environment setting it reads at each compile):
# the cache dir's unless the user named one before agentmem ran
_USER_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
MIN_WIDTH = 256
CHOICE_FILE = "decode-path-choice.json"  # each bucket's measured path, per machine and setting

# Background compiles in flight. A process that exits while one runs inside dynamo/inductor
# aborted ("terminate called without an active exception", exit status 134, about every other
# run of a short script): the interpreter finalizes under a daemon thread that holds C++
# state. At exit no compile starts and the ones in flight are waited for (one bucket: seconds;
# bounded by EXIT_WAIT_S).
EXIT_WAIT_S = 120.0
_in_flight: set[threading.Thread] = set()
_exiting = False


def wait_for_compiles(timeout_s: float = EXIT_WAIT_S) -> bool:
    """Start no more background compiles and wait for those in flight; True if none is left.
    Registered with atexit."""
    global _exiting
    _exiting = True
    deadline = time.monotonic() + timeout_s
    for t in list(_in_flight):
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in _in_flight)


atexit.register(wait_for_compiles)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, idx: torch.Tensor,
                    mask: torch.Tensor | None, width: int) -> torch.Tensor:
    """One decode query per sequence over its keys gathered from the pool: q [B,H,hd];
    k_pool/v_pool [blocks, block_size, KV, hd]; idx [B*width] flat slots; mask [B,1,1,width]
    (None: every gathered key is visible). Returns [B,H,hd].

    bf16 runs in fp32 on the CPU: torch's CPU attention kernel takes 150 us for one bf16 query
    over 128 keys and 574 us over 512, against 37 and 101 us in fp32 (1 thread, 9 heads of 64),
    and the gather copies the keys anyway."""
    b, kv_heads, hd = q.shape[0], k_pool.shape[-2], k_pool.shape[-1]
    if any(k.loaded() is not None and k.attention_usable(q.dtype, q.device, q.shape[1], kv_heads, hd)
           for k in (cpu_bf16, cpu_fp32)):  # the op picks the library by dtype
        keep = mask if mask is not None else torch.ones(b, width, dtype=torch.bool, device=q.device)
        return torch.ops.agentmem.decode_attn(q, k_pool, v_pool, idx, keep)
    up = q.dtype == torch.bfloat16 and q.device.type == "cpu"
    k = k_pool.view(-1, kv_heads, hd).index_select(0, idx).view(b, width, kv_heads, hd)
    v = v_pool.view(-1, kv_heads, hd).index_select(0, idx).view(b, width, kv_heads, hd)
    if up:
        q, k, v = q.float(), k.float(), v.float()
    elif k.dtype != q.dtype:  # an fp16 pool under an fp32 engine (Engine.kv_dtype)
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         enable_gqa=True)[:, :, 0]
    return out.to(torch.bfloat16) if up else out


def _decoder_layer(shape: tuple[int, int, int, int, float], h, cos, sin, slots, idx, mask, k_pool, v_pool,
                   in_norm, post_norm, q_norm, k_norm, qkv, o, gate_up, down):
    """Block.forward for one decode row per sequence, as a function of tensors only (the
    projections are `agentmem::proj` keys); equal tokens to the eager path are tested."""
    n_heads, n_kv, hd, hidden, eps = shape
    b = h.shape[0]
    x = torch.ops.agentmem.proj(rms_norm(h, in_norm, eps), qkv, (n_heads + 2 * n_kv) * hd).view(b, -1, hd)
    q, k, v = x.split([n_heads, n_kv, n_kv], dim=1)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    k_pool.view(-1, n_kv, hd).index_copy_(0, slots, k.to(k_pool.dtype))  # an fp16 pool under fp32 rows
    v_pool.view(-1, n_kv, hd).index_copy_(0, slots, v.to(v_pool.dtype))
    attn = paged_attention(q, k_pool, v_pool, idx, mask, mask.shape[-1]).reshape(b, n_heads * hd)
    h = h + torch.ops.agentmem.proj(attn, o, h.shape[1])
    gate, up = torch.ops.agentmem.proj(rms_norm(h, post_norm, eps), gate_up, 2 * hidden).chunk(2, dim=-1)
    return h + torch.ops.agentmem.proj(F.silu(gate) * up, down, h.shape[1])


class CompiledDecode:
    """Compiled decode steps of one model over one KV pool; see the module docstring."""

    def __init__(self, model: Transformer, pool: KVPool, cache_dir: Path, timeout_s: float = 600.0,
                 mode: str | None = None, background: bool = True, measure: bool = False):
        a = model.args
        self.measure = measure
        self.chosen: dict[tuple[int, int], bool] = {}  # bucket -> compiled (True) or eager, once measured
        self._memo = Path(cache_dir).expanduser() / CHOICE_FILE
        self._memo_key = "|".join([
            torch.__version__, f"{a.n_layers}x{a.dim}x{a.hidden_dim}|{a.n_heads},{a.n_kv_heads},{a.head_dim}",
            str(model.embed_tokens.weight.dtype), str(pool.k.dtype), getattr(model, "weights", "?"),
            f"{torch.get_num_threads()} threads", simd_flags(), kernels_tag()])
        if measure:
            self.chosen.update(self._remembered())
        self._trials: dict[tuple[int, int], tuple[list[float], list[float]]] = {}
        self.model, self.pool, self.timeout_s, self.background = model, pool, timeout_s, background
        self.shape = (a.n_heads, a.n_kv_heads, a.head_dim, a.hidden_dim, a.norm_eps)
        self.layers = [
            (blk.input_norm.weight, blk.post_norm.weight, blk.q_norm.weight if blk.q_norm is not None else None,
             blk.k_norm.weight if blk.k_norm is not None else None, blk.qkv_p.key, blk.o_p.key,
             blk.gate_up_p.key, blk.down_p.key)
            for blk in model.layers
        ]
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _USER_CACHE or str(Path(cache_dir).expanduser() / "inductor")
        self._mode = mode
        self._fn = None  # torch.compile's wrapper, made at the first compile: importing dynamo and
        # inductor costs ~1 s, which a process whose buckets are all remembered eager never pays
        self.ready: set[tuple[int, int]] = set()
        self.failed: str | None = None
        self.compile_s = 0.0  # seconds spent compiling (or loading compiled code from the disk cache)
        self._busy: tuple[tuple[int, int], float] | None = None  # (bucket, start time) of the compile in flight
        self._lock = threading.Lock()

    def _layer(self, h, cos, sin, slots, idx, mask, k_pool, v_pool, *weights):
        return _decoder_layer(self.shape, h, cos, sin, slots, idx, mask, k_pool, v_pool, *weights)

    @staticmethod
    def bucket(batch: int, width: int) -> tuple[int, int] | None:
        b = next((x for x in BATCHES if x >= batch), None)
        return None if b is None else (b, max(MIN_WIDTH, 1 << (width - 1).bit_length()))

    def get(self, batch: int, width: int) -> tuple[int, int] | None:
        """The bucket to run `batch` rows over `width` keys in, if it is compiled; else None,
        after starting its compile (in the background) unless one is in flight or compiling failed."""
        if self.failed is not None:
            return None
        bucket = self.bucket(batch, width)
        if bucket is None or bucket[1] > self.pool.scratch_slot:
            return None
        if self.measure and self._eager(bucket):
            return None  # measured eager here (now or by an earlier process): never compiled
        if bucket in self.ready:
            return bucket
        with self._lock:
            if self._busy is not None:
                if time.monotonic() - self._busy[1] > self.timeout_s:
                    self._fail(f"compiling bucket {self._busy[0]} took over {self.timeout_s:.0f} s")
                return None
            if self.background and _exiting:
                return None
            self._busy = (bucket, time.monotonic())
        if self.background:
            t = threading.Thread(target=self._compile_in_background, args=(bucket,), name="agentmem-compile",
                                 daemon=True)
            _in_flight.add(t)
            t.start()
            return None
        self.compile(bucket)
        return bucket if bucket in self.ready else None

    def prefer(self, bucket: tuple[int, int]) -> bool:
        """Whether this step of a compiled bucket runs compiled: always without `measure`;
        with it, the paths alternate until each has TRIALS timed steps, then the faster."""
        if not self.measure:
            return True
        if bucket in self.chosen:
            return self.chosen[bucket]
        compiled, eager = self._trials.setdefault(bucket, ([], []))
        return len(compiled) <= len(eager)

    def record(self, bucket: tuple[int, int], compiled: bool, seconds: float) -> None:
        """One timed step of `bucket` on one path (see `prefer`)."""
        if not self.measure or bucket in self.chosen:
            return
        times = self._trials.setdefault(bucket, ([], []))
        times[0 if compiled else 1].append(seconds)
        if min(map(len, times)) >= TRIALS:
            fast, slow = min(times[0]), min(times[1])
            self.chosen[bucket] = fast <= slow
            self._remember(bucket, fast <= slow)
            log.info("agentmem: decode bucket %s runs %s (best step %.1f ms compiled, %.1f ms eager)", bucket,
                     "compiled" if fast <= slow else "eager", fast * 1e3, slow * 1e3)

    def _eager(self, bucket: tuple[int, int]) -> bool:
        """Whether `bucket` runs eager without compiling: it measured eager, or it is unmeasured
        and every measured width of its batch size went eager (a short first reply may end
        before a bucket's trials do, so the demo's first question compiled its bucket in every
        process while the next one's, measured, was eager)."""
        if bucket in self.chosen:
            return not self.chosen[bucket]
        same = [v for (b, _), v in self.chosen.items() if b == bucket[0]]
        return bool(same) and not any(same)

    def _remembered(self) -> dict[tuple[int, int], bool]:
        """This machine's earlier choices for this model and setting; {} when none or unreadable."""
        try:
            entry = read_memo(self._memo).get(self._memo_key, {})
            return {tuple(int(x) for x in b.split(",")): bool(v) for b, v in entry.items()}
        except (ValueError, AttributeError, TypeError):  # an entry of another shape: measured again
            return {}

    def _remember(self, bucket: tuple[int, int], compiled: bool) -> None:
        """Save a bucket's choice, unless it was timed on a busy machine (measured.py)."""
        if machine_busy() is not None:
            return
        saved = read_memo(self._memo)
        entry = saved.get(self._memo_key)
        saved[self._memo_key] = entry = entry if isinstance(entry, dict) else {}
        entry[f"{bucket[0]},{bucket[1]}"] = compiled
        write_memo(self._memo, saved)

    def _fail(self, reason: str) -> None:
        self.failed = reason
        log.warning("agentmem: the compiled decode step is off, decoding eagerly: %s", reason)

    def _compile_in_background(self, bucket: tuple[int, int]) -> None:
        try:
            self.compile(bucket)
        finally:
            _in_flight.discard(threading.current_thread())

    @torch.inference_mode()
    def compile(self, bucket: tuple[int, int]) -> None:
        """Compile (or load from the disk cache) one bucket by running it on the scratch block."""
        b, width = bucket
        t0 = time.perf_counter()
        print(f"agentmem: compiling the decode step for {b} row(s) over {width} keys (once; cached under "
              f"{os.environ['TORCHINDUCTOR_CACHE_DIR']}) ...", file=sys.stderr, flush=True)
        try:
            h = torch.zeros(b, self.model.args.dim, dtype=self.model.embed_tokens.weight.dtype,
                            device=self.pool.k.device)
            pos = torch.zeros(b, dtype=torch.long, device=h.device)
            slots = torch.full((b,), self.pool.scratch_slot, dtype=torch.long, device=h.device)
            with TRACE_LOCK.exclusive():  # fx patches nn.Module process-wide while it traces (threads.py)
                self._run_layers(h, pos, slots, slots.repeat_interleave(width),
                                 self._mask(slots[:, None] * 0 + 1, width))
        except Exception as exc:  # any failure of dynamo/inductor/the C++ compiler: eager it is
            self._fail(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
            return
        finally:
            dt = time.perf_counter() - t0
            self.compile_s += dt
            with self._lock:
                self._busy = None
        if self.failed is None:
            self.ready.add(bucket)
            print(f"agentmem: decode step for {b} row(s) over {width} keys compiled in {dt:.1f} s",
                  file=sys.stderr, flush=True)

    def _mask(self, lens: torch.Tensor, width: int) -> torch.Tensor:
        return (torch.arange(width, device=lens.device)[None, :] < lens)[:, None, None, :]

    def _run_layers(self, h, pos, slots, idx, mask) -> torch.Tensor:
        cos, sin = self.model.rotary.cos_sin(pos)
        if self._fn is None:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._fn = torch.compile(self._layer, fullgraph=True, dynamic=False, mode=self._mode)
        for i, weights in enumerate(self.layers):
            h = self._fn(h, cos, sin, slots, idx, mask, self.pool.k[i], self.pool.v[i], *weights)
        return h

    def run(self, bucket: tuple[int, int], ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
            idx: list[int], lens: list[int], window: int | None) -> torch.Tensor:
        """Logits [B, V] of one decode row per sequence: ids/pos/slots [B]; idx the flat pool
        slots of each sequence's keys, `width` per row (padded by the caller); lens the keys each
        row sees (the last `window` of them, with a sliding window)."""
        rows, width = bucket
        n = ids.shape[0]
        dev = ids.device
        pad = rows - n
        scratch = self.pool.scratch_slot
        ids = F.pad(ids, (0, pad))
        pos = F.pad(pos, (0, pad))
        slots = F.pad(slots, (0, pad), value=scratch)
        per_row = len(idx) // n
        idx_t = torch.tensor(idx, device=dev).view(n, per_row)
        idx_t = F.pad(idx_t, (0, width - per_row, 0, pad), value=scratch).view(-1)
        lens_t = F.pad(torch.tensor(lens, device=dev), (0, pad), value=1)[:, None]
        slot = torch.arange(width, device=dev)[None, :]
        keep = slot < lens_t
        if window is not None:
            keep &= slot >= lens_t - window
        pad_rows = torch.arange(rows, device=dev)[:, None] >= n
        keep = keep | (pad_rows & (slot == 0))  # a padded row sees its one scratch key: no empty softmax
        h = self._run_layers(self.model.embed_tokens(ids), pos, slots, idx_t, keep[:, None, None, :])
        return self.model.logits(h[:n])

"""The engine's one background thread: it owns the KV pool and the scheduler, and turns the
requests of every calling thread into batched forward steps.

Callers never touch tensors of the loop: they put a `Sequence` in the inbox and read text
pieces (then a `Generation`, or an exception) from the sequence's own queue. So
`Engine.generate` is thread-safe, and concurrent requests share decode steps.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

import torch

from .block_manager import BlockManager
from .compiled import CompiledDecode
from .cuda_graph import GraphDecode
from .detokenize import ReplyText
from .fused_decode import Bf16Fused, Fp32Fused
from .kv_pool import KVPool, slot_runs
from .model_runner import ModelRunner
from .results import Generation, GenerationStats
from .sampler import argmax, penalize, sample_row, top_logprobs
from .scheduler import Scheduled, Scheduler
from .sequence import Sequence
from .threads import TRACE_LOCK, release_omp_pool

if TYPE_CHECKING:
    from ..config import Config
    from .engine import PrefillResult
    from .model import Transformer


class LoopHost(Protocol):
    """What an `EngineLoop` uses of the engine it serves, and nothing more: the model and where
    it runs, the sizes in its config, its stop tokens, its detokenizer, and its prefill planner
    (`plan_prefill`: the K/V of a prompt with cacheable segments). The engine owns the loop;
    the loop reaches back only through these members (`Engine` has them)."""

    model: Transformer
    device: torch.device
    kv_dtype: torch.dtype
    config: Config
    eos_ids: set[int]

    def decode(self, ids: Seq[int]) -> str: ...

    def plan_prefill(self, parts: list) -> PrefillResult: ...

# Loops whose thread may be running. The thread is a daemon (an app need not close the engine),
# and a process that exited while it was still finishing a step aborted about every other run
# of a short script ("terminate called without an active exception", status 134): at
# finalization a daemon thread that releases the GIL inside torch's C++ (freeing a tensor) is
# ended by pthread_exit, whose forced unwind cannot pass torch's noexcept frames. At exit each
# loop stops after its current step and its thread is joined (bounded by CLOSE_WAIT_S).
CLOSE_WAIT_S = 10.0
_loops: weakref.WeakSet[EngineLoop] = weakref.WeakSet()


def close_all(timeout_s: float = CLOSE_WAIT_S) -> None:
    """Close every engine loop of the process (registered with atexit)."""
    deadline = time.monotonic() + timeout_s
    for loop in list(_loops):
        loop.close(max(0.0, deadline - time.monotonic()))


atexit.register(close_all)


class EngineLoop:
    def __init__(
        self,
        engine: LoopHost,
        *,
        block_size: int | None = None,
        pool_tokens: int | None = None,
        max_batch: int | None = None,
        prefill_chunk: int | None = None,
    ):
        """Sizes default to the engine's Config (kv_block_size, kv_pool_tokens, max_batch,
        prefill_chunk)."""
        cfg = engine.config
        self.engine = engine
        block_size = block_size or cfg.kv_block_size
        num_blocks = max(1, (pool_tokens or cfg.kv_pool_tokens) // block_size)
        self.blocks = BlockManager(num_blocks, block_size)
        self.pool = KVPool(engine.model.args, num_blocks, block_size, engine.device, engine.kv_dtype)
        self.scheduler = Scheduler(self.blocks, max_batch or cfg.max_batch, prefill_chunk or cfg.prefill_chunk,
                                   tenant_cap=cfg.max_batch_per_tenant)
        self.runner = ModelRunner(engine.model, self.pool, self.blocks, engine.device, compiled_decode(engine, self.pool))
        self._inbox: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._kv_used = 0
        self._kv_allocated = 0
        self.steps = 0
        self._closed = False

    # --- callers' side -------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        with self._start_lock:  # close() takes it too: nothing is queued after the loop's last look
            if self._closed:
                raise RuntimeError("this engine loop is closed")
            self._inbox.put(seq)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="agentmem-engine", daemon=True)
                _loops.add(self)
                self._thread.start()

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> bool:
        """Stop the loop's thread after its current step; requests still in it fail with
        RuntimeError. True if the thread is gone within `timeout_s`. Idempotent."""
        with self._start_lock:
            self._closed = True
            self._inbox.put(None)  # wakes an idle loop
            t = self._thread
        if t is None or t is threading.current_thread():
            return True
        t.join(timeout_s)
        return not t.is_alive()

    def kv_utilization(self) -> float:
        """Used / allocated KV bytes over the running sequences, summed over steps since the
        last reset: how much of the memory handed to requests holds real tokens."""
        return self._kv_used / self._kv_allocated if self._kv_allocated else 0.0

    def reset_stats(self) -> None:
        self._kv_used = self._kv_allocated = 0
        self.steps = 0

    # --- the loop thread -----------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(torch.get_num_threads())
        while not self._closed:
            if not self.scheduler.has_work():
                # idle: this thread's OpenMP workers would only slow the threads that work now
                # (another engine's loop, the embedder; engine/threads.py)
                release_omp_pool()
                self._take(self._inbox.get())
            while True:
                try:
                    self._take(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if self._closed:
                break
            try:
                self.step()
            except Exception as exc:  # a failed forward fails its requests, not the loop
                self._fail_all(exc)
        self._fail_all(RuntimeError("the engine loop was closed"), inbox=True)

    def _take(self, seq: Sequence | None) -> None:
        if seq is not None:  # None: close()'s wake-up
            self.scheduler.add(seq)

    def _fail_all(self, exc: Exception, inbox: bool = False) -> None:
        """Fail every request in the scheduler (and, with `inbox`, those still queued)."""
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.remove(seq)
            seq.out.put(exc)
        while inbox:
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            if seq is not None:
                seq.out.put(exc)

    def step(self) -> None:
        with TRACE_LOCK.shared():  # not while torch.compile traces in another thread (threads.py)
            self._step()

    @torch.inference_mode()
    def _step(self) -> None:
        for seq in [s for s in (*self.scheduler.running, *self.scheduler.waiting) if s.cancelled]:
            self._finish(seq, "cancelled")
        batch = self.scheduler.schedule()
        if not batch:
            return
        self.steps += 1
        planned: list[tuple[Sequence, torch.Tensor]] = []
        for sc in batch:
            if sc.plan:
                logits = self._plan(sc)
                if logits is not None:
                    planned.append((sc.seq, logits))
        # a planned prompt's first token goes out now, not after the others' forward
        if planned:
            self._sample([seq for seq, _ in planned], torch.stack([lg for _, lg in planned]))
        model_batch = [sc for sc in batch if not sc.plan]
        logits, seqs = None, []
        if model_batch:
            logits, seqs = self.runner.run(model_batch)
            for sc in model_batch:
                seq = sc.seq
                if seq.num_computed == seq.prompt_len and not seq.generated:  # its prompt is in
                    seq.reused, seq.prefilled = seq.num_cached, seq.prompt_len - seq.num_cached
                self.blocks.register(seq)
        used, allocated = self.blocks.utilization(self.scheduler.running)
        self._kv_used += used
        self._kv_allocated += allocated
        if seqs:
            self._sample(seqs, logits)

    def _plan(self, sc: Scheduled) -> torch.Tensor | None:
        """Fill the sequence's blocks with the planner's K/V; its last logits come back."""
        seq, e = sc.seq, self.engine
        try:
            r = e.plan_prefill(seq.parts)
            n = r.k[0].shape[0]
            if n != seq.num_pending:
                raise ValueError(f"the prefill planner returned K/V for {n} tokens, the prompt has {seq.num_pending}")
            slot_list = self.blocks.slots(seq, 0, n)
            runs = slot_runs(slot_list) if e.device.type == "cpu" else None
            slots = torch.tensor(slot_list, device=e.device) if runs is None else runs
            for i in range(len(r.k)):
                self.pool.write(i, slots, r.k[i], r.v[i])
        except Exception as exc:
            self.scheduler.remove(seq)
            seq.out.put(exc)
            return None
        seq.num_computed = n
        seq.reused, seq.recomputed, seq.prefilled, seq.segments = r.reused, r.recomputed, r.prefilled, r.segments
        return r.last_logits

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """The next token of each sequence from its row of logits [len(seqs), V] (the forward's
        own tensor, not rows stacked again: for 8 streams a copy of 1.5 MB after the step's
        weights had passed through the caches, ~6% of the step)."""
        logits = logits.float()
        greedy = argmax(logits).tolist()
        for j, seq in enumerate(seqs):
            p = seq.params
            tok = greedy[j] if p.plain_greedy else self._choose(seq, logits[j])
            if p.logprobs:
                lp, alts = top_logprobs(logits[j], tok, p.top_logprobs)
                seq.logprobs.append((tok, lp, alts))
            self._advance(seq, tok)

    @staticmethod
    def _choose(seq: Sequence, row: torch.Tensor) -> int:
        """The sequence's own settings on its own row: penalties, grammar mask, sampling."""
        p = seq.params
        x = penalize(row, p, seq.prompt_set() if p.repetition_penalty != 1.0 else None, seq.generated)
        if seq.loop_ban:
            x[list(seq.loop_ban)] -= 100.0
        n = p.copy_ngram
        if seq.copies and len(seq.generated) >= n - 1:
            banned = seq.copies.get(tuple(seq.generated[len(seq.generated) - n + 1 :]))
            if banned:
                x[list(banned)] -= 100.0  # not -inf: a grammar may allow nothing else
        if seq.matcher is not None:
            seq.matcher.mask(x, p.logit_bias)
        return sample_row(x, p, seq.generator)

    def _advance(self, seq: Sequence, tok: int) -> None:
        e, p = self.engine, seq.params
        if not seq.generated and not seq.ttft_s:
            seq.ttft_s = time.perf_counter() - seq.t_submit
        if tok in e.eos_ids and not p.ignore_eos:
            return self._finish(seq, "stop")
        seq.token_ids.append(tok)
        if seq.matcher is not None:
            seq.matcher.consume(tok)
        if p.stop_loops and self._looped(seq, tok):
            return self._finish(seq, "repetition")
        if seq.reply_text is None:
            seq.reply_text, seq.head_text = ReplyText(e.decode), ReplyText(e.decode)
        text = seq.reply_text.text(seq.generated)
        cut = _stop_cut(text, p.stop)
        if cut is not None:
            seq.text = text[:cut]
            return self._finish(seq, "stop")
        seq.text = text
        # hold back what could be the start of a stop string or a partial UTF-8 character,
        # and what the loop detector may still cut: what is streamed is what is stored
        safe = len(text) - _holdback(text, p.stop)
        settled = seq.loops.settled() if p.stop_loops and seq.matcher is None else len(seq.generated)
        if settled < len(seq.generated):
            head = seq.head_text.text(seq.generated[:settled])
            safe = min(safe, len(head) - _holdback(head, []))
        complete = seq.matcher is not None and self._complete(seq)
        if seq.matcher is not None and not complete and seq.complete_at[0]:
            safe = min(safe, seq.complete_at[1])  # a further item is sent once it is whole
        if safe > seq.emitted:
            seq.out.put(text[seq.emitted : safe])
            seq.emitted = safe
        left = seq.max_new - len(seq.generated)
        if seq.matcher is not None and seq.matcher.done:
            self._finish(seq, "stop")
        elif complete and 0 < left < seq.longest_item:
            self._finish(seq, "budget")  # another item as long as the longest would not fit
        elif left <= 0:
            if seq.matcher is not None and not complete and seq.complete_at[0]:
                self._roll_back(seq, seq.complete_at[0])  # never a half item after whole ones
            self._finish(seq, "length")

    @staticmethod
    def _complete(seq: Sequence) -> bool:
        """Whether a grammar-bound reply could end here (the grammar accepts it: a closed tool
        call in a list that allows more, say); such points are remembered, with the longest
        stretch between two of them, which is what one more item is expected to cost."""
        if not seq.matcher.accepting:
            return False
        n = len(seq.generated)
        seq.longest_item = max(seq.longest_item, n - seq.complete_at[0])
        seq.complete_at = (n, len(seq.text))
        return True

    def _roll_back(self, seq: Sequence, n: int) -> None:
        """Drop the generated tokens after the first `n` (and their text and logprobs)."""
        del seq.token_ids[seq.prompt_len + n :]
        if seq.logprobs:
            del seq.logprobs[n:]
        seq.text = self.engine.decode(seq.generated)

    def _looped(self, seq: Sequence, tok: int) -> bool:
        """Whether the reply just closed a repeated cycle. A free reply is cut to the text
        before the loop plus one cycle; a grammar-bound one cannot stop mid-value, so the
        cycle's tokens are pushed down from now on and it goes on to close its value."""
        keep = seq.loops.push(tok)
        if keep is None:
            return False
        if seq.matcher is not None:
            seq.loop_ban.update(seq.generated[keep:])
            return False
        self._roll_back(seq, keep)
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        if len(seq.text) > seq.emitted:
            seq.out.put(seq.text[seq.emitted :])
            seq.emitted = len(seq.text)
        stats = GenerationStats(
            prompt_tokens=seq.prompt_len,
            completion_tokens=len(seq.generated),
            reused_tokens=seq.reused,
            recomputed_tokens=seq.recomputed,
            prefilled_tokens=seq.prefilled,
            ttft_s=seq.ttft_s,
            total_s=time.perf_counter() - seq.t_submit,
            finish_reason=reason,
            segments=seq.segments,
        )
        seq.out.put(Generation(seq.text, list(seq.generated), stats, list(seq.logprobs) if seq.params.logprobs else None))


def auto_compiles(engine: LoopHost) -> bool:
    """Whether compile=auto builds a compiled CPU decode step for this engine's model: not
    where it decodes through a fused C layer step (see `compiled_decode`)."""
    return not isinstance(getattr(engine.model, "kernels", None), (Bf16Fused, Fp32Fused))


def compiled_decode(engine: LoopHost, pool: KVPool) -> CompiledDecode | GraphDecode | None:
    """The compiled decode step the config asks for. On the CPU: `compile` auto (each bucket
    kept compiled only where its steps measure faster than eager), on (always compiled), off.
    On CUDA, auto and on replay the whole step from captured CUDA graphs (cuda_graph.py; a
    sliding-window model decodes eagerly: its attention is not the paged kernel), off is eager.

    auto compiles nothing where the model decodes through a fused C layer step
    (fused_decode.Bf16Fused / Fp32Fused, the default int4 and int8 weights on AVX2 or
    AVX512): eager was the faster path on every CPU measured (`bench engine`, one stream
    1.2-4.5x, eight streams 1.4-2.7x: Skylake, Cascade Lake, Sapphire Rapids with and
    without AMX, Zen 3, Zen 4, Zen 5, 2026-11-25 to 2026-12-03), so the measured choice only
    ever paid for the compile, which holds every other request's steps while it traces."""
    cfg = engine.config
    if cfg.compile not in ("auto", "on", "off"):
        raise ValueError(f"compile must be auto, on or off, got {cfg.compile!r}")
    if cfg.compile == "off":
        return None
    if engine.device.type == "cuda":
        return GraphDecode(engine.model, pool) if engine.model.args.sliding_window is None else None
    if cfg.compile == "auto" and not auto_compiles(engine):
        return None
    return CompiledDecode(engine.model, pool, cfg.cache_dir, cfg.compile_timeout_s, measure=cfg.compile == "auto")


def _stop_cut(text: str, stops: list[str]) -> int | None:
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(cuts) if cuts else None


def _holdback(text: str, stops: list[str]) -> int:
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold

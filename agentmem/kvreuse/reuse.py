"""ChunkReuse: the engine's prefill planner. It looks each segment up in the chunk store,
fuses the cached KV into one prefill (see fuser), and stores the KV of new segments after
the turn, so no memory is prefilled twice.

A segment is used as is when its entry was computed exactly after the same preceding
segments (prefix reuse); otherwise its cached KV is re-rotated and, in `blend` mode,
partly recomputed. New segments are stored with the context they were computed in when
that computation was exact (every segment before them exact too), else as approximations
that are only ever blended. An entry that came back through the lossy codec keeps its
context and counts as exact for this (`kv_quantized_prefix`; see docs/kvreuse.md).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import Config, resolve_kv_mode
from ..engine.engine import Engine, PrefillResult, Segment
from .fuser import MODES, Clock, Fused, Piece, check_blend_settings, fuse
from .identity import ROOT_CONTEXT, chunk_key, next_context
from .policy import Rates, make_policy
from .store import ChunkKV, ChunkStore


def store_from_config(config: Config, device: torch.device) -> ChunkStore:
    """The store the settings describe: tiers and budgets, codec, policy."""
    tiers: list[tuple[torch.device | str, int]] = []
    if device.type == "cuda":
        tiers.append((device, config.kv_gpu_bytes))
    tiers.append(("cpu", config.kv_ram_bytes))
    disk = config.kv_disk_dir or Path(config.data_dir) / "chunks"
    shared = None
    if config.redis_url:
        from ..cluster import redis_link
        from .shared_tier import SharedTier

        shared = SharedTier(redis_link(config.redis_url), config.redis_kv_bytes)
    rates = Rates(recompute_share=config.blend_ratio)
    policy = make_policy(config.kv_policy, rates=rates, half_life_s=config.kv_half_life_s,
                         min_tokens=config.kv_min_tokens) if config.kv_policy == "value" else \
        make_policy(config.kv_policy, rates=rates)
    return ChunkStore(tiers, disk, config.kv_disk_bytes, shared=shared, policy=policy, codec=config.kv_codec,
                      ram_codec=config.kv_ram_codec, write_behind=config.kv_disk_write_behind)


class ChunkReuse:
    """Chunk-KV reuse for one engine. Call it as the engine's prefill planner."""

    def __init__(self, engine: Engine, config: Config | None = None, store: ChunkStore | None = None):
        cfg = config or engine.config
        mode = resolve_kv_mode(cfg.kv_mode, engine.device.type)
        if mode not in MODES:
            raise ValueError(f"kv_mode must be auto or one of {MODES}, got {cfg.kv_mode!r}")
        check_blend_settings(cfg.blend_metric, cfg.blend_check_layer, cfg.blend_drift, engine.model.args.n_layers,
                             prefix="blend_")
        self.engine = engine
        self.mode = mode
        self.ratio = cfg.blend_ratio
        self.check_layer = cfg.blend_check_layer
        self.metric = cfg.blend_metric
        self.drift = cfg.blend_drift
        self.store = store if store is not None else store_from_config(cfg, engine.device)
        self.pin_s = cfg.tool_pin_s
        self.quantized_prefix = cfg.kv_quantized_prefix
        self._anchor: ChunkKV | None = None
        self._anchor_ids: list[int] = []
        # the last plan's new entries, so that `pin` can keep one the store did not admit
        self._last_new: dict[str, tuple[str, ChunkKV]] = {}

    def _key(self, ids: list[int], namespace: str) -> str:
        e = self.engine
        return chunk_key(e.model_id, e.dtype, ids, namespace)

    # --- the planner -----------------------------------------------------------------------
    def __call__(self, engine: Engine, parts: list[tuple[list[int], bool, Segment]]) -> PrefillResult:
        return self.plan(parts)

    def plan(
        self,
        parts: list[tuple[list[int], bool, Segment]],
        mode: str | None = None,
        ratio: float | None = None,
        store: bool = True,
        clock: Clock | None = None,
        user: str | None = None,
    ) -> PrefillResult:
        """Prefill tokenized segments (as `Engine.tokenize_prompt` gives them). `mode` and
        `ratio` override the configured ones (the benchmark compares modes this way);
        `store=False` leaves the store as it was (no new entries, no counters); `clock`
        collects seconds per part (see `fuser.Clock`); `user` is who asked (the store's
        policy counts a chunk's users). Each segment's trace says where its KV came from
        (`kv_tier`), whether a pin held it or was broken (`kv_pin`: held / evicted) and whether
        a slow tier's copy was left for a recompute (`kv_choice`)."""
        mode = mode or self.mode
        ratio = self.ratio if ratio is None else ratio
        t_start = time.perf_counter()
        ids = [t for p in parts for t in p[0]]
        pieces, keys, how, found = [], [], [], []
        context, exact_so_far, prefix_exact, start = ROOT_CONTEXT, True, True, 0
        for seg_ids, cacheable, seg in parts:
            n = len(seg_ids)
            key = self._key(seg_ids, seg.namespace) if cacheable and n else None
            kv, where = None, {}
            if key is not None and mode != "full":
                kv, where = self.store.lookup(key, count=store, tokens=n, kind=seg.tier, user=user)
                if kv is not None and (kv.k.shape[1] != n or kv.k.shape[0] != self.engine.model.args.n_layers):
                    kv = None
            # an exact piece must follow exact pieces only (a segment missing before it, one
            # too short to be cached say, runs in the pass: what follows it is blended)
            exact = (kv is not None and exact_so_far and prefix_exact and kv.context == context
                     and (self.quantized_prefix or not kv.quantized))
            if kv is not None and kv.quantized:
                where = where | {"quantized": True}
            prefix_exact = prefix_exact and exact
            exact_so_far = exact or (exact_so_far and kv is None and mode != "full")
            pieces.append(Piece(start, n, kv, exact))
            found.append(where)
            keys.append((key, context if exact_so_far else None))
            how.append("reused" if exact or (kv is not None and mode == "reuse")
                       else "blended" if kv is not None else "prefilled")
            context = next_context(context, seg_ids)
            start += n
        if clock is not None:
            clock.lap("lookup")
        fused = fuse(self.engine.model, ids, pieces, mode, ratio, self.check_layer, self.metric,
                     keep_raw=store and mode != "full", drift=self.drift, clock=clock)
        ran = fused.ran.tolist()
        segments, reused, recomputed, prefilled = [], 0, 0, 0
        for (_, _, seg), p, h, where in zip(parts, pieces, how, found, strict=True):
            n_ran = sum(ran[p.start : p.start + p.n])
            if p.kv is None:
                prefilled += p.n
                info = {"tokens": p.n, "how": "prefilled", "recomputed": 0}
            else:
                recomputed += n_ran
                reused += p.n - n_ran
                info = {"tokens": p.n, "how": h, "recomputed": n_ran}
            segments.append(info | {"tier": seg.tier, "ref": seg.ref} | {f"kv_{k}": v for k, v in where.items()})
        if store and mode != "full":
            self.store.rates.prefill(recomputed + prefilled, time.perf_counter() - t_start)
            self._store_new(parts, pieces, keys, fused)
        result = PrefillResult(list(fused.k.unbind(0)), list(fused.v.unbind(0)), fused.last_logits,
                               reused=reused, recomputed=recomputed, prefilled=prefilled, segments=segments)
        if clock is not None:
            clock.lap("finish")
        return result

    def _store_new(self, parts, pieces: list[Piece], keys, fused: Fused) -> None:
        offset = 0  # into fused.new_k_raw: uncached tokens in prompt order
        self._last_new = {}
        for (_, _, seg), p, (key, context) in zip(parts, pieces, keys, strict=True):
            if p.kv is not None:
                continue
            if key is not None:
                k = fused.new_k_raw[:, offset : offset + p.n].clone()
                v = fused.v[:, p.start : p.start + p.n].clone()
                entry = ChunkKV(k, v, context)
                self.store.put(key, seg.namespace, entry, kind=seg.tier)
                self._last_new[key] = (seg.namespace, entry)
            offset += p.n

    # --- the public surface ----------------------------------------------------------------
    def precompute(self, segments: list[Segment]) -> int:
        """Compute and store the KV of every cacheable segment not yet cached (each in its own
        Segment.namespace); return how many tokens were computed. Each chunk is computed right
        after the chat format's system opener, so its first tokens see the same attention
        sink they will see inside a real prompt."""
        e = self.engine
        anchor_ids = e.encode(e.chat.wraps["system"][0])
        if self._anchor is None or self._anchor_ids != anchor_ids:
            fused = fuse(e.model, anchor_ids, [Piece(0, len(anchor_ids))], "full", keep_raw=True)
            self._anchor, self._anchor_ids = ChunkKV(fused.new_k_raw, fused.v), anchor_ids
        done, n_anchor = 0, len(anchor_ids)
        for seg in segments:
            ids = e.encode(seg.text)
            if not seg.cacheable or not ids:
                continue
            key = self._key(ids, seg.namespace)
            if key in self.store:
                continue
            pieces = [Piece(0, n_anchor, self._anchor, exact=True), Piece(n_anchor, len(ids))]
            fused = fuse(e.model, anchor_ids + ids, pieces, "blend", keep_raw=True)
            self.store.put(key, seg.namespace, ChunkKV(fused.new_k_raw.clone(), fused.v[:, n_anchor:].clone()), kind=seg.tier)
            done += len(ids)
        return done

    def pin(self, parts: list[tuple[list[int], bool, Segment]], seconds: float | None = None) -> dict:
        """A turn ended in a tool call: keep its prompt's chunks in memory for `seconds`
        (default `tool_pin_s`), so that the continuation, which sends the same prompt and the
        tool's result, reuses them. An entry the store did not admit is taken from the last
        plan's (call this right after the turn's prefill). Returns {"pinned": n, "missing": n}.
        Memory pressure from other pins may still evict one; the continuation's trace then
        says so (`kv_pin: evicted`)."""
        seconds = self.pin_s if seconds is None else seconds
        out = {"pinned": 0, "missing": 0}
        if seconds <= 0:
            return out
        for seg_ids, cacheable, seg in parts:
            if not cacheable or not seg_ids:
                continue
            key = self._key(seg_ids, seg.namespace)
            ns, kv = self._last_new.get(key, (seg.namespace, None))
            out["pinned" if self.store.pin(key, seconds, kv, ns) else "missing"] += 1
        return out

    def drop_namespace(self, namespace: str) -> int:
        """Remove every cached entry of `namespace` (a deleted tenant or user) from every tier."""
        return self.store.drop_namespace(namespace)

    def stats(self) -> dict:
        return self.store.stats()


def enable_chunk_reuse(engine: Engine, config: Config | None = None) -> ChunkReuse:
    """Install chunk-KV reuse as the engine's prefill planner (once: a second call returns the
    same object) and set `engine.chunk_reuse`."""
    reuse = get_reuse(engine)
    if reuse is None:
        reuse = ChunkReuse(engine, config)
        engine.chunk_reuse = reuse
        engine.set_prefill_planner(reuse)
    return reuse


def get_reuse(engine: Engine) -> ChunkReuse | None:
    return getattr(engine, "chunk_reuse", None)

"""Constrained decoding on the engine's model: the model may only emit what the output's
grammar allows, so a 135M model cannot produce malformed or invented structure.

Two grammars cover what reflection asks of the model:
- `choose`: exactly one of a fixed list of options (greedy walk down the options' token
  trie; logits of tokens that leave the trie are masked out);
- `copy_span`: a contiguous span of a source text, ended by a newline; a value is always a
  verbatim piece of what the user said, never a paraphrase the model made up.

A few-shot prefix shared by many calls is prefilled once (`Prefix`) and its KV copied into
each call, so a call costs only its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine import DenseKV, Engine


@dataclass
class Prefix:
    """A prompt prefix prefilled once; `run` continues it with a call's own text."""

    engine: Engine
    text: str

    def __post_init__(self) -> None:
        self.ids = self.engine.encode(self.text)
        kv = DenseKV(self.engine.model, max(1, len(self.ids)), self.engine.device, self.engine.dtype)
        if self.ids:
            self.engine.prefill_dense(self.ids, kv)
        self._k, self._v = kv.k, kv.v

    def start(self, text: str, room: int) -> tuple[DenseKV, torch.Tensor]:
        """KV of prefix + `text` with `room` free slots, and the next-token logits."""
        ids = self.engine.encode(text)
        if not self.ids and not ids:
            raise ValueError("constrained decoding needs a non-empty prompt")
        n = len(self.ids)
        kv = DenseKV(self.engine.model, n + len(ids) + room, self.engine.device, self.engine.dtype)
        if n:
            kv.load(self._k, self._v)
        return kv, self.engine.prefill_dense(ids, kv, start=n) if ids else self._last_logits(kv)

    def _last_logits(self, kv: DenseKV) -> torch.Tensor:
        # prompt entirely in the prefix: recompute its last token on top of the rest
        return self.engine.prefill_dense(self.ids[-1:], kv, start=len(self.ids) - 1)


def _pick(logits: torch.Tensor, allowed: list[int]) -> int:
    idx = torch.tensor(allowed, device=logits.device)
    return allowed[int(torch.argmax(logits[idx]))]


@torch.inference_mode()
def choose(prefix: Prefix, text: str, options: list[str]) -> int:
    """Index of the option the model picks after prefix + `text` (each option is decoded as
    if it followed the text directly; give options their leading space)."""
    if not options:
        raise ValueError("choose needs at least one option")
    e = prefix.engine
    end = e.encode("\n")
    seqs = [e.encode(o) + end for o in options]
    if len({tuple(s) for s in seqs}) != len(seqs):
        raise ValueError(f"options must be distinct: {options}")
    alive = list(range(len(options)))
    kv, logits = prefix.start(text, max(len(s) for s in seqs))
    depth = 0
    while len(alive) > 1:
        tok = _pick(logits, sorted({seqs[i][depth] for i in alive}))
        alive = [i for i in alive if seqs[i][depth] == tok]
        depth += 1
        if len(alive) > 1:
            logits = e.prefill_dense([tok], kv, start=kv.length)
    return alive[0]


@torch.inference_mode()
def copy_span(prefix: Prefix, text: str, source: str, max_tokens: int = 16) -> str:
    """A contiguous span of `source` chosen greedily by the model after prefix + `text`,
    ending at a newline or after `max_tokens` tokens. Empty when the model ends at once."""
    e = prefix.engine
    src = e.encode(" " + source.strip())
    if not src:
        return ""
    newline = e.encode("\n")[-1]
    kv, logits = prefix.start(text, max_tokens + 1)
    positions = list(range(len(src)))  # where in src the next copied token may come from
    out: list[int] = []
    for _ in range(max_tokens):
        allowed = sorted({src[p] for p in positions if p < len(src)} | ({newline} if out else set()))
        if not allowed:
            break
        tok = _pick(logits, allowed)
        if tok == newline:
            break
        out.append(tok)
        positions = [p + 1 for p in positions if p < len(src) and src[p] == tok]
        logits = e.prefill_dense([tok], kv, start=kv.length)
    return e.decode(out).strip()

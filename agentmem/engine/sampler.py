"""Sampling parameters and the sampler.

The order is the one vLLM and HF transformers use, so a setting means here what it means
there: logit bias, then the repetition penalty (CTRL's: over prompt and reply tokens), the
frequency and presence penalties (OpenAI's: over reply tokens only), then temperature, and
the truncations top-k, top-p and min-p on the tempered distribution. Temperature 0 is
greedy (argmax of the penalized logits). Every row of a batch is processed with its own
settings and its own generator, so a sequence samples the same tokens batched or alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import InvalidSampling

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False  # generate max_tokens even past end-of-sequence (benchmarks)
    top_k: int = 0  # 0 -> off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0 -> off
    repetition_penalty: float = 1.0  # > 1 discourages every token already in the prompt or reply
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the reply
    presence_penalty: float = 0.0  # subtracted once if the token occurs in the reply
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: bool = False  # report the chosen token's log-probability
    top_logprobs: int = 0  # and that many most likely alternatives
    stop_loops: bool = True  # end a reply caught in a repeated cycle (finish_reason "repetition")
    copy_ngram: int = 0  # > 1: never let the reply repeat a copy_ngram-token run of any of copy_sources
    copy_sources: list[list[int]] = field(default_factory=list)  # e.g. the session's earlier replies
    grammar: Any = None  # an engine.grammar.Grammar: decode under it (JSON schema, tool calls)

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidSampling(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _in_range("temperature", self.temperature, 0.0, 5.0)
        _in_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _in_range("min_p", self.min_p, 0.0, 1.0)
        _in_range("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        _in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _in_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InvalidSampling(f"top_k must be a non-negative integer (0: off), got {self.top_k!r}")
        if not isinstance(self.copy_ngram, int) or self.copy_ngram == 1 or self.copy_ngram < 0:
            raise InvalidSampling(f"copy_ngram must be 0 (off) or an integer >= 2, got {self.copy_ngram!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidSampling(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidSampling("top_logprobs needs logprobs=true")
        if not isinstance(self.logit_bias, dict):
            raise InvalidSampling("logit_bias must map token ids to biases")
        bias = {}
        for tok, b in self.logit_bias.items():
            try:
                t = int(tok)
            except (TypeError, ValueError):
                raise InvalidSampling(f"logit_bias keys must be token ids, got {tok!r}") from None
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise InvalidSampling(f"logit_bias token id {t} is outside the vocabulary (0..{(vocab_size or 1) - 1})")
            _in_range(f"logit_bias[{t}]", b, -100.0, 100.0)
            bias[t] = float(b)
        self.logit_bias = bias
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidSampling("stop strings must be non-empty strings")
        return self

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits: the batched fast path."""
        return (self.temperature == 0.0 and not self.logit_bias and self.repetition_penalty == 1.0
                and self.frequency_penalty == 0.0 and self.presence_penalty == 0.0 and self.grammar is None
                and not (self.copy_ngram and self.copy_sources))


PROSE_PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")


def with_defaults(defaults: dict, **given) -> SamplingParams:
    """SamplingParams from a model's defaults (engine.sampling_defaults), the caller's
    non-None values on top: None means "what the model recommends". Under a grammar the
    default repetition penalties are left out (ones the caller sets still apply): they are
    there to keep prose from looping, and a JSON value must repeat its quotes, keys and
    braces; penalised, a string's closing quote grows less likely with every quote before
    it, and a tool call's argument runs on until max_tokens cuts it."""
    if given.get("grammar") is not None:
        defaults = {k: v for k, v in defaults.items() if k not in PROSE_PENALTIES}
    return SamplingParams(**{**defaults, **{k: v for k, v in given.items() if v is not None}})


def _in_range(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        raise InvalidSampling(f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}")


def penalize(logits: torch.Tensor, params: SamplingParams, prompt_ids: torch.Tensor | None,
             reply_ids: list[int]) -> torch.Tensor:
    """Logit bias and the three penalties on one row of logits [V] (fp32), a new tensor.
    `prompt_ids`: the distinct prompt tokens (only the repetition penalty reads them)."""
    out = logits.clone()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        out[ids] += torch.tensor(list(params.logit_bias.values()), dtype=out.dtype)
    reply = torch.tensor(reply_ids, dtype=torch.long)
    if params.repetition_penalty != 1.0:
        seen = reply if prompt_ids is None else torch.cat([prompt_ids, reply])
        seen = seen.unique()
        if len(seen):
            x = out[seen]
            out[seen] = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and len(reply):
        ids, counts = reply.unique(return_counts=True)
        out[ids] -= params.frequency_penalty * counts.to(out.dtype) + params.presence_penalty
    return out


def truncate(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Tempered, truncated log-space scores [V] (-inf for dropped tokens) to sample from.
    Every cut is a threshold on the scores (masked_fill): on a CPU, sorting or index-filling
    the 49k-token vocabulary costs tens of ms, a threshold a fraction of one. The top-p
    threshold is found among the CANDIDATES most likely tokens when they hold the mass, which
    at the default temperature they nearly always do; else over the sorted vocabulary."""
    x = logits / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(params.top_k).values[-1], -math.inf)
    if params.top_p < 1.0:
        x = x.masked_fill(x < _nucleus_cut(x, params.top_p), -math.inf)
    if params.min_p > 0.0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < params.min_p * probs.max(), -math.inf)
    return x


CANDIDATES = 512


def _nucleus_cut(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """The score of the least likely token of the smallest set whose mass reaches top_p."""
    log_z = torch.logsumexp(x, -1)
    vals = x.topk(min(CANDIDATES, x.shape[-1])).values
    mass = (vals - log_z).exp()
    if float(mass.sum()) < top_p:
        vals = x.sort(descending=True).values
        mass = (vals - log_z).exp()
    keep = int(((mass.cumsum(-1) - mass) < top_p).sum())  # always keeps the most likely token
    return vals[keep - 1]


def argmax(x: torch.Tensor) -> torch.Tensor | np.ndarray:
    """The index of the largest value along the last dimension (the first of equal ones), as
    torch's argmax. An fp32 CPU tensor goes through numpy's, which is ~10x faster: over 8 rows
    of 49,152 logits 0.06 ms against torch's 0.6, one row 0.016 against 0.12 (2-core Skylake VM),
    a tenth of a decode step's Python work for 8 streams."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad:
        return x.numpy().argmax(-1)
    return x.argmax(-1)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from processed logits [V] (penalties and grammar mask already applied).
    Drawn as argmax(p / E) with E ~ Exp(1) per token (the exponential race, as vLLM samples):
    the same distribution as multinomial, which takes ~60 ms over 49k tokens on this CPU."""
    if params.temperature == 0.0:
        return int(argmax(logits))
    probs = torch.softmax(truncate(logits, params), -1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int(argmax(probs / race))


def copy_index(sources: list[list[int]], n: int) -> dict[tuple[int, ...], set[int]]:
    """(n-1)-token run -> the tokens that follow it somewhere in `sources`: the next tokens
    that would make a reply repeat an n-token run of one of them."""
    out: dict[tuple[int, ...], set[int]] = {}
    for ids in sources:
        for i in range(len(ids) - n + 1):
            out.setdefault(tuple(ids[i : i + n - 1]), set()).add(ids[i + n - 1])
    return out


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability and the k most likely tokens', under the model's
    own distribution (before penalties, temperature and truncation, as vLLM reports them)."""
    logp = torch.log_softmax(logits.float(), -1)
    top = logp.topk(k) if k else None
    alts = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else []
    return float(logp[token]), alts

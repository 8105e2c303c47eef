"""Constrained decoding: every token is drawn from those a grammar allows next, so a JSON
reply parses and matches its schema and a tool call names a real tool with valid arguments.

The grammar engine is llguidance (Microsoft's Rust library behind Guidance, also used by
vLLM and SGLang). Measured here against xgrammar and outlines-core, all three from PyPI,
offline, on SmolLM2's 49k-token tokenizer, 2 CPU cores (docs/replies.md has the table):
mask per token 0.02-0.3 ms (xgrammar 0.01-0.1 ms, outlines-core 0.3 ms), against a decode
step of ~40 ms, so the choice is not speed. llguidance was picked because it is one wheel
with no Python dependencies (xgrammar pulls apache-tvm-ffi and triton; outlines-core needs
its own vocabulary conversion of byte-level tokens), compiles a schema lazily in ~2 ms
(no per-schema index build), and reads Lark grammars with inline JSON schemas, which is what
"either prose or a tool call" needs. Its one cost: the first mask of a tokenizer builds
its token trie (~2.5 s here, once per process).
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass

import torch

from .errors import InvalidSampling


class InvalidGrammar(InvalidSampling):
    """A schema or grammar that cannot be compiled; the message says why."""


@dataclass(frozen=True)
class Grammar:
    """What a reply must match: a Lark grammar (JSON schemas are inlined with %json)."""

    lark: str

    @classmethod
    def json_schema(cls, schema: dict) -> Grammar:
        return cls(f"start: %json {json.dumps(_compact(schema))}")

    @classmethod
    def json_object(cls) -> Grammar:
        return cls.json_schema({"type": "object"})

    @classmethod
    def choice(cls, schemas: list[dict], prefix: str = "", suffix: str = "", or_text: bool = False,
               most: int = 1) -> Grammar:
        """One JSON value matching any of `schemas`, between literal `prefix` and `suffix`,
        or up to `most` of them one per line (parallel tool calls); `or_text`: or else free
        text that does not start with the prefix's first character (a tool call or an
        ordinary answer, the model decides)."""
        body = json.dumps(_compact({"anyOf": schemas} if len(schemas) > 1 else schemas[0]))
        call = " ".join(x for x in (json.dumps(prefix) if prefix else "", "value", json.dumps(suffix) if suffix else "") if x)
        # several calls: a line each, and the line after the last may end the reply (the model
        # ends a line before it ends its turn; the grammar must not read that as "one more")
        calls = "call" if most == 1 else f'call ("\\n" call){{0,{most - 1}}} "\\n"?'
        lines = [f"start: {'calls | TEXT' if or_text else 'calls'}", f"calls: {calls}", f"call: {call}",
                 f"value: %json {body}"]
        if or_text:
            first = prefix[:1] or "{"
            lines.append(f"TEXT: /[^{_regex_char(first)}](.|\\n)*/")
        return cls("\n".join(lines))


def _compact(schema: dict) -> dict:
    """No free whitespace inside JSON: a small model given the choice can emit it forever."""
    return {**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}}


def _regex_char(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c


class GrammarCompiler:
    """Compiles grammars for one tokenizer; the llguidance tokenizer is built on first use."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        self._hf = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self._eos = eos_ids
        self._tok = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tok is None:
                import llguidance.hf

                self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                         eos_token=self._eos or None)
            return self._tok

    def check(self, grammar: Grammar) -> None:
        """Raise InvalidGrammar saying why, for a grammar or schema llguidance refuses."""
        import llguidance

        err = llguidance.LLMatcher.validate_grammar(grammar.lark, self.tokenizer)
        if err:
            raise InvalidGrammar(f"invalid grammar or schema: {err.strip()}")

    def matcher(self, grammar: Grammar) -> Matcher:
        import llguidance

        self.check(grammar)
        m = llguidance.LLMatcher(self.tokenizer, grammar.lark, log_level=0)
        if m.is_error():
            raise InvalidGrammar(f"invalid grammar or schema: {m.get_error()}")
        return Matcher(m, self.vocab_size, self._eos)


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher, vocab_size: int, eos_ids: list[int] | None = None):
        import llguidance.torch as lt

        self._m = matcher
        self._lt = lt
        self._mask = lt.allocate_token_bitmask(1, vocab_size)
        self._eos = list(eos_ids or [])

    def mask(self, logits: torch.Tensor, bias: dict[int, float] | None = None) -> torch.Tensor:
        """logits [V] with every token the grammar forbids next set to -inf (in place).

        Where the reply may end here but need not (a closed tool call in a list that allows
        more), what the model gives to tokens the grammar forbids goes to end-of-sequence:
        a model that would rather write anything but another call ends the reply, instead of
        being pushed into one more by the renormalisation over the tokens that may follow.
        `bias`: the request's logit_bias; a bias on end-of-sequence applies to that share too
        (a caller who pushes the end down gets more items)."""
        end = bool(self._eos) and self._m.is_accepting() and not self._m.is_stopped()
        before = torch.logsumexp(logits, -1) if end else None
        self._lt.fill_next_token_bitmask(self._m, self._mask, 0)
        self._lt.apply_token_bitmask_inplace(logits[None], self._mask)
        if end:
            eos = max(self._eos, key=lambda t: float(logits[t]))
            if math.isfinite(float(logits[eos])):  # the grammar lets the reply end here
                allowed = torch.logsumexp(logits, -1)
                if allowed < before:
                    forbidden = before + torch.log1p(-torch.exp(allowed - before))
                    logits[eos] = torch.logaddexp(logits[eos], forbidden + (bias or {}).get(eos, 0.0))
        return logits

    def consume(self, token: int) -> None:
        if not self._m.consume_token(token):
            raise InvalidGrammar(f"token {token} breaks the grammar: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar allows nothing more (a complete JSON value, a closed tool call)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

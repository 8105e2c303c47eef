"""Reflection with the configured model (`AGENTMEM_REFLECT_ENGINE=remote`): the remote
engine's server extracts facts and supersessions, instead of the embedded 135M model.

The templates still go first (exact, free); the sentences about the user they miss go to
the server in batches of BATCH, one chat request per batch with JSON-schema output
(`response_format` json_schema: vLLM, SGLang, llama.cpp's servers, OpenAI, Gemini's and
Groq's compatible endpoints decode under it). Per sentence the model picks a kind, one of
the templates' single-valued slots (so a new home supersedes the old one as a template's
fact would) or a topic, copies the value from the sentence, and says whether the sentence
states a change ("replaces"). A value that is not a piece of its sentence is dropped, as
the embedded extractor only ever copies a span: the model may classify, never invent.

The cost is what mem0 users complain of: an LLM call per message, or several. Here a pass
makes ceil(candidate sentences / BATCH) calls; `stats` counts calls and tokens, which
`bench memory` reports per 100 turns.
"""

from __future__ import annotations

import json
from datetime import datetime

import httpx

from ..engine.errors import EngineUnavailable
from .facts import TEMPLATES, TOPICS, Fact

BATCH = 24  # sentences per call: a call's prompt stays ~1k tokens, its JSON reply within MAX_TOKENS
MAX_TOKENS = 1024
SLOTS = {t.slot: t for t in TEMPLATES if t.single and "{attr}" not in t.text}  # name, residence, job, ...
KINDS = [*SLOTS, *[t for t in TOPICS if t != "none"], "none"]

SYSTEM = ("You extract facts about the user from what the user said. For each numbered sentence, give its kind: "
          f"one of {', '.join(SLOTS)} when it states that, else a topic ({', '.join(t for t in TOPICS if t != 'none')}), "
          "or none when it says nothing lasting about the user. value: the detail, copied word for word from the "
          "sentence. replaces: true when the sentence says something changed (moved, new job, gave up, no longer).")


def schema(n: int) -> dict:
    item = {"type": "object", "properties": {"i": {"type": "integer", "minimum": 0, "maximum": max(0, n - 1)},
                                             "kind": {"type": "string", "enum": KINDS},
                                             "value": {"type": "string", "maxLength": 120},
                                             "replaces": {"type": "boolean"}},
            "required": ["i", "kind", "value", "replaces"], "additionalProperties": False}
    return {"type": "object", "properties": {"facts": {"type": "array", "items": item, "maxItems": n}},
            "required": ["facts"], "additionalProperties": False}


def response_format(sch: dict, engine) -> dict:
    """JSON-schema output as the server spells it: OpenAI's `json_schema`, or llama-cpp-python's
    `json_object` with a `schema` (its chat route takes no other)."""
    if engine.dialect == "llama":
        return {"type": "json_object", "schema": sch}
    return {"type": "json_schema", "json_schema": {"name": "facts", "strict": True, "schema": sch}}


class RemoteExtractor:
    """Facts from the remote engine's server; `prefetch` a pass's sentences, then `extract`
    reads the answers one sentence at a time, as `reflect` asks the embedded extractor."""

    def __init__(self, engine, batch: int = BATCH):
        """`engine`: a RemoteEngine, or a function returning one (a service loads it on first use)."""
        self._engine = engine
        self.batch = batch
        self.stats = {"llm_calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "sentences": 0,
                      "failed_calls": 0, "dropped_values": 0}
        self._found: dict[tuple[int, str], Fact | None] = {}

    @property
    def engine(self):
        if callable(self._engine):
            self._engine = self._engine()
        return self._engine

    def prefetch(self, items: list[tuple[str, int, datetime | None]]) -> None:
        """Ask the server about every (sentence, source message id, time), BATCH per call."""
        todo = [it for it in items if (it[1], it[0]) not in self._found]
        for at in range(0, len(todo), self.batch):
            self._ask(todo[at: at + self.batch])

    def extract(self, sentence: str, source_id: int, event_time: datetime | None = None) -> Fact | None:
        key = (source_id, sentence)
        if key not in self._found:
            self._ask([(sentence, source_id, event_time)])
        return self._found.pop(key, None)

    def _ask(self, items: list[tuple[str, int, datetime | None]]) -> None:
        for it in items:
            self._found[(it[1], it[0])] = None
        numbered = "\n".join(f"{i}. {s}" for i, (s, _, _) in enumerate(items))
        body = {"model": self.engine.model_id, "temperature": 0.0, "max_tokens": MAX_TOKENS,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": numbered}],
                "response_format": response_format(schema(len(items)), self.engine)}
        self.stats["llm_calls"] += 1
        self.stats["sentences"] += len(items)
        try:
            r = self.engine._request("POST", "/v1/chat/completions", json=body)
            out = r.json()
        except (EngineUnavailable, httpx.HTTPError, ValueError):
            self.stats["failed_calls"] += 1  # the templates' facts stand; these sentences are asked next pass
            raise
        usage = out.get("usage") or {}
        self.stats["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
        self.stats["completion_tokens"] += int(usage.get("completion_tokens") or 0)
        try:
            facts = json.loads(out["choices"][0]["message"]["content"] or "{}").get("facts") or []
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            self.stats["failed_calls"] += 1
            return
        for f in facts:
            if not isinstance(f, dict) or not isinstance(f.get("i"), int) or not 0 <= f["i"] < len(items):
                continue
            sentence, source_id, when = items[f["i"]]
            fact = _fact(f, sentence, source_id, when)
            if fact is None and f.get("kind") not in (None, "none"):
                self.stats["dropped_values"] += 1
            if fact is not None:
                self._found[(source_id, sentence)] = fact


def _fact(f: dict, sentence: str, source_id: int, when: datetime | None) -> Fact | None:
    kind, value = f.get("kind"), " ".join(str(f.get("value") or "").split()).strip(" .")
    if kind not in KINDS or kind == "none" or not value or value.lower() not in sentence.lower():
        return None
    replaces = bool(f.get("replaces"))
    if kind in SLOTS:
        t = SLOTS[kind]
        return Fact(t.text.format(value=value), t.slot, value, True, t.importance, source_id, when, "remote",
                    replaces)
    from .facts import _third_person

    detail = _third_person(value)
    return Fact(f"The user's {kind}: {detail}.", f"topic:{kind}", detail, False, 0.5, source_id, when, "remote",
                replaces)


def remote_extractor(config, engine=None) -> RemoteExtractor:
    """The extractor for `reflect_engine="remote"`: on `engine` (a RemoteEngine or a function
    returning the service's), else a remote engine built from `config`."""
    if not config.engine_url:
        raise ValueError("AGENTMEM_REFLECT_ENGINE=remote needs AGENTMEM_ENGINE_URL (the server that extracts)")
    if engine is None:
        from ..engine.remote import RemoteEngine

        engine = RemoteEngine.from_config(config)
    return RemoteExtractor(engine)

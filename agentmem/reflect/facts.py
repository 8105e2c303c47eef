"""Facts: subject-level statements about the user, extracted from what the user said.

Extraction is deterministic first: first-person patterns ("my X is Y", "I live in Z",
"I work as W") cover the statements that matter most and are exact. Sentences about the
user that no pattern recognises go to the model, which may only answer through constrained
decoding (a topic from a closed list, then a verbatim span of the sentence).

Every fact is written from a template, so its *slot* (what it is about: "residence",
"dog's name") can be read back from the stored text with `slot_of`. A new fact in a
single-valued slot supersedes the older one; in a multi-valued slot (likes, has) it only
adds. Nothing but the text is needed to decide, so reflection over an archive written by an
older run behaves the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

from .constrained import Prefix, choose, copy_span

_VALUE = r"(?P<value>[^,.;!?\n]+?)"
_END = r"(?=\s*(?:[,.;!?\n]|\band\b|\bbut\b|\bbecause\b|\bsince\b|$))"


@dataclass(frozen=True)
class Template:
    slot: str  # "{attr}" is replaced by the captured attribute for possessive slots
    pattern: str  # over one sentence, case-insensitive; named groups attr / value
    text: str  # canonical statement, with {attr} and {value}
    single: bool = True  # one value at a time: a new one supersedes the old
    importance: float = 0.7


TEMPLATES: list[Template] = [
    Template(
        "name",
        r"\b(?:my name is|call me|i am called|i'm called)\s+(?P<value>(?-i:[A-Z])[\w'-]*(?:\s+(?-i:[A-Z])[\w'-]*)?)",
        "The user's name is {value}.",
        importance=0.9,
    ),
    Template(
        "residence",
        r"\bi\s+(?:now\s+|still\s+|currently\s+)?(?:live|am living|'m living)\s+in\s+" + _VALUE + _END,
        "The user lives in {value}.",
        importance=0.8,
    ),
    Template(
        "residence",
        r"\bi\s+(?:just\s+|recently\s+|have\s+|'ve\s+)?(?:moved|relocated)\s+to\s+" + _VALUE + _END,
        "The user lives in {value}.",
        importance=0.8,
    ),
    Template(
        "job",
        r"\bi\s+(?:now\s+|currently\s+)?(?:work|am working|'m working)\s+as\s+" + _VALUE + _END,
        "The user works as {value}.",
        importance=0.8,
    ),
    Template(
        "job",
        r"\b(?:got|started|have|took)\s+a\s+new\s+job\s+as\s+" + _VALUE + _END,
        "The user works as {value}.",
        importance=0.8,
    ),
    Template(
        "job",
        r"\bmy\s+(?:job|profession|occupation)\s+is\s+" + _VALUE + _END,
        "The user works as {value}.",
        importance=0.8,
    ),
    Template(
        "employer",
        r"\bi\s+(?:now\s+|currently\s+)?(?:work|am working|'m working)\s+(?:at|for)\s+" + _VALUE + _END,
        "The user works at {value}.",
        importance=0.7,
    ),
    Template(
        "age",
        r"\bi\s*(?:am|'m)\s+(?P<value>\d{1,3})\s+years?\s+old",
        "The user is {value} years old.",
        importance=0.7,
    ),
    Template(
        "age",
        r"\bi\s+(?:just\s+)?turned\s+(?P<value>\d{1,3})\b",
        "The user is {value} years old.",
        importance=0.7,
    ),
    Template(
        "allergy",
        r"\bi\s*(?:am|'m)\s+allergic\s+to\s+" + _VALUE + _END,
        "The user is allergic to {value}.",
        single=False,
        importance=0.9,
    ),
    Template(
        "likes",
        r"\bi\s+(?:really\s+|absolutely\s+)?(?:love|like|enjoy|adore)\s+" + _VALUE + _END,
        "The user likes {value}.",
        single=False,
        importance=0.5,
    ),
    Template(
        "dislikes",
        r"\bi\s+(?:really\s+)?(?:hate|dislike|can't stand|cannot stand)\s+" + _VALUE + _END,
        "The user dislikes {value}.",
        single=False,
        importance=0.5,
    ),
    Template(
        "has",
        r"\bi\s+(?:have|own|got)\s+" + _VALUE + _END,
        "The user has {value}.",
        single=False,
        importance=0.5,
    ),
    Template(
        "learning",
        r"\bi\s*(?:am|'m)\s+(?:studying|learning)\s+" + _VALUE + _END,
        "The user is learning {value}.",
        single=False,
        importance=0.5,
    ),
    Template(
        "drives", r"\b(?:i|and)\s+(?:now\s+|still\s+)?drive\s+" + _VALUE + _END, "The user drives {value}."
    ),
    Template(
        "plays",
        r"\bi\s+(?:now\s+|still\s+)?play\s+" + _VALUE + _END,
        "The user plays {value}.",
        single=False,
        importance=0.5,
    ),
    Template(
        "{attr}",
        r"\b(?:we|i)\s+renamed\s+(?:my|our)\s+(?P<attr>[a-z]+)\b[^.]*?\b(?:called|named|to)\s+"
        + _VALUE
        + _END,
        "The user's {attr} is {value}.",
    ),
    Template(
        "{attr}",
        r"\bmy\s+(?P<attr>[a-z][a-z' -]{1,40}?)\s+(?:has\s+)?changed\b[^.]*?\b(?:it|he|she|they)\s+"
        r"(?:is|are)\s+(?:now\s+)?" + _VALUE + _END,
        "The user's {attr} is {value}.",
    ),
    Template(
        "{attr}",
        r"\bmy\s+(?P<attr>[a-z][a-z' -]{1,40}?)\s+(?:is|are)\s+(?:now\s+|called\s+|named\s+)*"
        + _VALUE
        + _END,
        "The user's {attr} is {value}.",
        importance=0.7,
    ),
]

# possessive attributes that say nothing lasting about the user ("my day is long")
_TRANSIENT = {
    "day",
    "week",
    "morning",
    "evening",
    "night",
    "weekend",
    "question",
    "point",
    "guess",
    "bad",
    "mistake",
    "turn",
    "pleasure",
    "problem",
    "issue",
    "answer",
    "plan",
    "idea",
}
# time words and hedges that end a value but are not part of it ("Berlin last week")
_TRAILING = re.compile(
    r"(?:\s+(?:now|anymore|any more|these days|currently|too|as well|again|recently|already|yesterday|today"
    r"|last (?:week|month|year|night)|this (?:week|month|year)|a (?:while|few \w+) ago|\w+ (?:days|weeks|months|years) ago))+$",
    re.IGNORECASE,
)
_CHANGE = re.compile(r"\b(?:gave up|quit|stopped|no longer|instead|switched|changed|replaced)\b", re.IGNORECASE)
_FILLER_VALUES = {"it", "that", "this", "them", "so", "too", "a lot", "good", "fine", "great", "ok", "okay"}

# topics the model may pick for a sentence no pattern matched ("none": nothing lasting)
TOPICS = ["home", "work", "family", "pet", "health", "hobby", "food", "travel", "study", "plan", "none"]

_FEW_SHOT = """Say what each sentence tells about the speaker, then copy the detail.
Sentence: I adopted a kitten called Miso last week.
Topic: pet
Detail: a kitten called Miso
Sentence: Thanks, that was really helpful!
Topic: none
Sentence: Our flight to Tokyo leaves on Friday morning.
Topic: travel
Detail: flight to Tokyo on Friday morning
Sentence: My sister Ana just had a baby boy.
Topic: family
Detail: sister Ana just had a baby boy
Sentence: I've been running every morning to train for a marathon.
Topic: hobby
Detail: running every morning to train for a marathon
"""


@dataclass(frozen=True)
class Fact:
    text: str
    slot: str
    value: str
    single: bool
    importance: float
    source_id: int
    event_time: datetime | None = None
    how: str = "pattern"  # pattern | model
    replaces: bool = False  # said as a change ("I gave up X, now I play Y"): supersedes even a multi-valued slot


@dataclass
class _Compiled:
    template: Template
    regex: re.Pattern = field(init=False)

    def __post_init__(self) -> None:
        self.regex = re.compile(self.template.pattern, re.IGNORECASE)


_COMPILED = [_Compiled(t) for t in TEMPLATES]


def sentences(text: str) -> list[str]:
    """Split on sentence ends and line breaks (no NLTK data: everything is offline)."""
    parts = re.split(r"(?<=[.!?])\s+|\n+", text)
    return [p.strip() for p in parts if p and p.strip()]


def _norm_value(value: str) -> str:
    value = re.sub(r"\s+", " ", value).strip(" '\"")
    return _TRAILING.sub("", value)


def same_value(a: str, b: str) -> bool:
    """Equal up to case, articles and spacing: "a nurse" and "Nurse" are one value."""

    def key(v: str) -> str:
        return re.sub(r"\b(?:a|an|the)\b|\s+", "", v.lower())

    return key(a) == key(b)


def pattern_facts(sentence: str, source_id: int, event_time: datetime | None = None) -> list[Fact]:
    """Facts the templates find in one sentence; the first template per slot wins."""
    found: dict[str, Fact] = {}
    change = _CHANGE.search(sentence) is not None
    negated = re.search(r"\b(?:don't|do not|no longer|never|not)\b", sentence, re.IGNORECASE)
    for c in _COMPILED:
        t = c.template
        for m in c.regex.finditer(sentence):
            value = _norm_value(m.group("value"))
            attr = _norm_value(m.group("attr")).lower() if "attr" in c.regex.groupindex else ""
            if not value or value.lower() in _FILLER_VALUES or attr in _TRANSIENT:
                continue
            if t.slot == "has" and re.match(r"(?:a\s+)?(?:new\s+job|to\b|been\b|no\b)", value, re.IGNORECASE):
                continue
            if negated and not t.single:
                continue  # "I don't like X" is not "likes X"
            slot = t.slot.format(attr=attr)
            if slot in found or (t.slot == "{attr}" and attr in ("name", "job", "age", "home")):
                continue
            text = t.text.format(attr=attr, value=value)
            found[slot] = Fact(text, slot, value, t.single, t.importance, source_id, event_time, replaces=change)
    return list(found.values())


def slot_of(text: str) -> tuple[str, str, bool] | None:
    """(slot, value, single) of a fact text written from a template; None for other text."""
    for t in TEMPLATES:
        pat = re.escape(t.text).replace(r"\{value\}", "(?P<value>.+)").replace(r"\{attr\}", "(?P<attr>.+?)")
        m = re.fullmatch(pat, text)
        if m:
            attr = m.groupdict().get("attr") or ""
            return t.slot.format(attr=attr), m.group("value"), t.single
    m = re.fullmatch(r"The user's (?P<topic>\w+): (?P<value>.+)\.", text)
    if m:
        return f"topic:{m.group('topic')}", m.group("value"), False
    return None


def about_user(sentence: str) -> bool:
    """Worth asking the model: a first-person statement, not a question or a pleasantry."""
    s = sentence.strip()
    if s.endswith("?") or len(s.split()) < 4:
        return False
    return re.search(r"\b(?:i|i'm|i've|i'll|my|we|our)\b", s, re.IGNORECASE) is not None


class ModelExtractor:
    """The constrained-decoding path for sentences no template matched."""

    def __init__(self, engine):
        self.prefix = Prefix(engine, _FEW_SHOT)

    def extract(self, sentence: str, source_id: int, event_time: datetime | None = None) -> Fact | None:
        text = f"Sentence: {sentence}\nTopic:"
        topic = TOPICS[choose(self.prefix, text, [" " + t for t in TOPICS])]
        if topic == "none":
            return None
        detail = copy_span(self.prefix, f"{text} {topic}\nDetail:", sentence)
        if len(detail.split()) < 2:
            return None
        detail = _third_person(detail)
        return Fact(
            f"The user's {topic}: {detail}.",
            f"topic:{topic}",
            detail,
            False,
            0.5,
            source_id,
            event_time,
            "model",
        )


def _third_person(text: str) -> str:
    """'my sister' -> "the user's sister": facts are about the user, whoever reads them."""
    swaps = [
        (r"\bI am\b|\bI'm\b", "the user is"),
        (r"\bI've\b", "the user has"),
        (r"\bI\b", "the user"),
        (r"\bmy\b", "the user's"),
        (r"\bme\b", "the user"),
        (r"\bmyself\b", "themselves"),
    ]
    for pat, rep in swaps:
        text = re.sub(pat, rep, text, flags=re.IGNORECASE)
    return text.rstrip(" .")

"""The seeded generator: multi-session conversations between two people, and questions
annotated with the turns that answer them.

A conversation is two friends chatting over 10-25 dated sessions days or weeks apart (some
in the same week), 20-60 turns each, mostly small talk (`chatter`). Facts (`facts`) are
planted in passing, in the speaker's own words, often after the other's lead-in ("How's
the new place??" / "We got the keys last Tuesday"), with relative times resolved against
the session's date. Questions are asked after the last session, as a person would ask
them, in five categories:

- `paraphrase`: one evidence turn sharing no content word (stop words out, Porter stems)
  with the question; checked here, a pair that fails is never emitted;
- `multi_hop`: two turns in two different sessions (moved twice; quit, then what next);
- `temporal`: "When did Tom move house?" (answer computable from the session date and the
  turn's "last Tuesday"), "What did Priya cook in March 2023?" with the same kind of turn in
  other months, "the week after her trip to Lisbon";
- `which_person`: both speakers, or two people they mention, have the same kind of fact;
  the question names one;
- `distractor`: other turns share at least two content words with the question (and more
  than the evidence does) but do not answer it.

Everything draws from one `random.Random(seed)`, so a seed gives the same data set.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from . import chatter as C
from .facts import (
    AFTER_ASKS,
    AFTER_SAYS,
    AFTER_VALUES,
    CHAINS,
    FACTS,
    RECURRING,
    RELATIONS,
    THIRD_ASKS,
    THIRD_JOBS,
    THIRD_SAYS,
    TRIP_CITIES,
    TRIP_SAYS,
    FactType,
)
from .words import content_stems, shared_stems

CATEGORIES = ("paraphrase", "multi_hop", "temporal", "which_person", "distractor")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
# a fact kind and the chain of the same kind are never both planted for one person
GROUP = {"pets": "pet", "moves": "city", "hobbies": "hobby", "quit_next": "job"}
FEMALE_OTHERS = frozenset({"Ana", "Hannah", "Leila", "Bea", "Julia", "Rosa", "Nkechi", "Lina", "Mariam", "Carmen"})


@dataclass(frozen=True)
class Turn:
    index: int  # position in the conversation; evidence refers to it
    session: int
    speaker: str
    text: str  # as a chat export carries it, image captions inline
    created_at: datetime
    caption: str | None = None  # a shared picture's caption apart from the text (data sets read from files)

    @property
    def seen(self) -> str:
        """The text with its caption, as a reader (and the plain-cosine peer) sees the turn."""
        return f"{self.text} [image: {self.caption}]" if self.caption else self.text


@dataclass(frozen=True)
class Question:
    conversation: str
    category: str
    text: str
    answer: str
    evidence: tuple[int, ...]  # turn indices


@dataclass
class Conversation:
    id: str
    speakers: tuple[str, str]
    session_dates: list[datetime]
    turns: list[Turn]

    def sessions(self) -> list[list[dict]]:
        """Messages per session for `add_messages`: first speaker as "user", with `name`. A
        speaker called "assistant" (a data set of a person talking to their assistant) is the
        assistant's own replies: that role with no name, as `AgentSession.chat` stores them."""
        out: list[list[dict]] = [[] for _ in self.session_dates]
        for t in self.turns:
            role = "user" if t.speaker == self.speakers[0] else "assistant"
            msg = {"role": role, "content": t.text, "created_at": t.created_at, "name": t.speaker}
            if t.speaker.lower() == "assistant":
                msg["role"] = "assistant"
                del msg["name"]
            if t.caption:
                msg["caption"] = t.caption
            out[t.session].append(msg)
        return out


@dataclass
class Dataset:
    conversations: list[Conversation]
    questions: list[Question]


@dataclass
class _Person:
    name: str
    female: bool

    def fill(self) -> dict[str, str]:
        return {"name": self.name, "sub": "she" if self.female else "he", "obj": "her" if self.female else "him",
                "pos": "her" if self.female else "his"}


@dataclass
class _Planted:
    speaker: int
    text: str
    tag: int | None = None


@dataclass
class _Builder:
    """One conversation: plants facts into sessions, then lays the sessions out."""

    rng: random.Random
    cid: str
    speakers: tuple[_Person, _Person]
    others: tuple[tuple[_Person, str, int], ...]  # (person, relation, whose)
    dates: list[datetime]
    blocks: dict[int, list[list[_Planted]]] = field(default_factory=dict)
    asks: list[tuple[str, str, str, tuple[int, ...]]] = field(default_factory=list)
    used: set[tuple[int, str]] = field(default_factory=set)
    _tag: int = 0

    def tag(self) -> int:
        self._tag += 1
        return self._tag

    def plant(self, session: int, block: list[_Planted]) -> None:
        self.blocks.setdefault(session, []).append(block)

    def ask(self, category: str, text: str, answer: str, tags: tuple[int, ...]) -> None:
        self.asks.append((category, text, answer, tags))

    @property
    def names(self) -> tuple[str, str]:
        return self.speakers[0].name, self.speakers[1].name

    def fact_block(self, who: int, text: str, cues: tuple[str, ...], avoid: str = "") -> tuple[list[_Planted], int]:
        """The other's lead-in (sometimes), the fact (often inside a longer turn that also says
        something else, sharing no word with `avoid`), the other's reaction."""
        t = self.tag()
        block = []
        if cues and self.rng.random() < 0.6:
            block.append(_Planted(1 - who, self.rng.choice(cues)))
        people = tuple(o[0].name for o in self.others)
        block.append(_Planted(who, _wrap(self.rng, text, people, self.speakers[1 - who].name, avoid), t))
        react = C.fill(self.rng, self.rng.choice(C.REACT), people, self.speakers[who].name)
        block.append(_Planted(1 - who, C.noisy(self.rng, react)))
        return block, t


WRAP_SHARE = 0.4  # fact turns that also say something else, as real turns do


def _sentence(text: str) -> str:
    return text if text.rstrip()[-1:] in ".!?" or text.rstrip()[-1:] > "\u2000" else f"{text}."


def _wrap(rng: random.Random, text: str, people: tuple[str, ...], other: str, avoid: str) -> str:
    """Sometimes the fact is one sentence of a longer turn: a greeting or other news before
    it, a question back after it ("Hey! busy week. Oh and I bought a cello. How are you?")."""
    if rng.random() >= WRAP_SHARE:
        return text
    before = rng.random() < 0.6
    pool = (C.GREET_BACK if before else C.ASK_BACK) + tuple(t for ts in C.TOPICS.values() for t in ts)
    for _ in range(4):
        extra = C.fill(rng, rng.choice(pool), people, other)
        if not avoid or not shared_stems(avoid, extra):
            return f"{_sentence(extra)} {text}" if before else f"{_sentence(text)} {extra}"
    return text


def _relative(rng: random.Random, day: datetime) -> tuple[str, str]:
    """A relative time phrase said on `day`, and the date (or week) it refers to."""
    kind = rng.choice(("yesterday", "weekday", "weeks", "days", "weekend", "today"))
    if kind == "yesterday":
        return "yesterday", f"{day - timedelta(days=1):%Y-%m-%d}"
    if kind == "weekday":
        wd = rng.randrange(7)
        back = (day.weekday() - wd) % 7
        back += 7 if back < 2 else 0
        return f"last {WEEKDAYS[wd]}", f"{day - timedelta(days=back):%Y-%m-%d}"
    if kind == "weeks":
        n = rng.choice((2, 3))
        return f"{('two', 'three')[n - 2]} weeks ago", f"the week of {day - timedelta(weeks=n):%Y-%m-%d}"
    if kind == "days":
        n = rng.randint(3, 5)
        return f"{('three', 'four', 'five')[n - 3]} days ago", f"{day - timedelta(days=n):%Y-%m-%d}"
    if kind == "weekend":
        back = (day.weekday() - 5) % 7 or 7
        return "last weekend", f"the weekend of {day - timedelta(days=back):%Y-%m-%d}"
    return rng.choice(("today", "this morning")), f"{day:%Y-%m-%d}"


def _fill(template: str, **slots: str) -> str:
    text = template.format_map(_Slots(slots))
    return text[:1].upper() + text[1:] if template.startswith("{") else text


class _Slots(dict):
    def __missing__(self, key: str) -> str:
        raise KeyError(f"template slot {{{key}}} has no value")


def _dates(rng: random.Random, n: int) -> list[datetime]:
    day = datetime(2022, 1, 3, tzinfo=UTC) + timedelta(days=rng.randrange(800))
    out = []
    for _ in range(n):
        out.append(day.replace(hour=rng.randint(7, 21), minute=rng.randrange(60)))
        r = rng.random()
        day += timedelta(days=rng.randint(1, 4) if r < 0.3 else rng.randint(5, 16) if r < 0.8 else rng.randint(17, 45))
    return out


def _say(rng: random.Random, f: FactType, value: str, day: datetime, temporal: bool = False) -> tuple[str, str]:
    """A saying of fact `f` on `day`, and what its {when} resolves to ('' if none)."""
    says = [s for s in f.says if "{when}" in s] if temporal else list(f.says)
    s = rng.choice(says)
    when, answer = _relative(rng, day) if "{when}" in s else ("", "")
    x = rng.choice(f.extra) if f.extra else ""
    return _fill(s, v=value, when=when, x=x), answer


# --- the five categories ----------------------------------------------------------------------
def _paraphrase(b: _Builder, f: FactType, who: int) -> bool:
    rng, person = b.rng, b.speakers[who]
    session = rng.randrange(len(b.dates))
    for value in rng.sample(f.values, len(f.values)):
        text = C.noisy(rng, _say(rng, f, value, b.dates[session])[0])
        asks = [a for a in f.asks if not shared_stems(_fill(a, **person.fill()), text)]
        if asks:
            q = _fill(rng.choice(asks), **person.fill())
            block, t = b.fact_block(who, text, f.cues, avoid=q)
            b.plant(session, block)
            b.ask("paraphrase", q, value, (t,))
            return True
    return False


def _which_person(b: _Builder, f: FactType) -> bool:
    rng = b.rng
    values = rng.sample(f.values, 2)
    tags = []
    for who in (0, 1):
        session = rng.randrange(len(b.dates))
        text, _ = _say(rng, f, values[who], b.dates[session])
        block, t = b.fact_block(who, text, f.cues)
        b.plant(session, block)
        tags.append(t)
    who = rng.randrange(2)
    b.ask("which_person", _fill(rng.choice(f.asks), **b.speakers[who].fill()), values[who], (tags[who],))
    return True


def _which_third(b: _Builder) -> bool:
    """Two people the speakers mention, each with a job; the question names one."""
    rng = b.rng
    firsts = [o for o in b.others if o[2] == 0]
    seconds = [o for o in b.others if o[2] == 1]
    if not firsts or not seconds or (-1, "job") in b.used:
        return False
    b.used.add((-1, "job"))
    pair = (rng.choice(firsts), rng.choice(seconds))
    jobs = rng.sample(THIRD_JOBS, 2)
    tags = []
    for (person, rel, whose), job in zip(pair, jobs, strict=True):
        session = rng.randrange(len(b.dates))
        f = person.fill()
        text = _fill(rng.choice(THIRD_SAYS), rel=rel, p=person.name, v=job, obj=f["obj"], sub=f["sub"])
        block, t = b.fact_block(whose, text, ())
        b.plant(session, block)
        tags.append(t)
    i = rng.randrange(2)
    b.ask("which_person", _fill(rng.choice(THIRD_ASKS), p=pair[i][0].name), jobs[i], (tags[i],))
    return True


def _distractor(b: _Builder, f: FactType, who: int) -> bool:
    rng, person = b.rng, b.speakers[who]
    session = rng.randrange(len(b.dates))
    value = rng.choice(f.values)
    text, _ = _say(rng, f, value, b.dates[session])
    lines = []
    for d in f.distract:
        if d.startswith("{name},"):
            lines.append((1 - who, _fill(d, **person.fill())))
        else:
            other = rng.choice(b.others)[0]
            lines.append((rng.randrange(2), _fill(d, **other.fill())))
    best: tuple[str, list[tuple[int, str]]] = ("", [])
    for a in rng.sample(f.asks, len(f.asks)):
        q = _fill(a, **person.fill())
        ev = len(shared_stems(q, text))
        near = [(w, line) for w, line in lines if len(shared_stems(q, line)) >= max(2, ev + 1)]
        if len(near) > len(best[1]):
            best = (q, near)
    q, near = best
    if not near:
        return False
    block, t = b.fact_block(who, text, (), avoid=q)
    b.plant(session, block)
    people = tuple(o[0].name for o in b.others)
    for speaker, line in near:
        reply = C.fill(rng, rng.choice(C.ANSWER_BACK + C.REACT), people, "")
        b.plant(rng.randrange(len(b.dates)), [_Planted(speaker, line), _Planted(1 - speaker, C.noisy(rng, reply))])
    b.ask("distractor", q, value, (t,))
    return True


def _temporal_event(b: _Builder, f: FactType, who: int) -> bool:
    rng, person = b.rng, b.speakers[who]
    session = rng.randrange(len(b.dates))
    value = rng.choice(f.values)
    text, when = _say(rng, f, value, b.dates[session], temporal=True)
    block, t = b.fact_block(who, text, f.cues)
    b.plant(session, block)
    b.ask("temporal", _fill(rng.choice(f.when_asks), **person.fill()), when, (t,))
    return True


def _temporal_month(b: _Builder, key: str, who: int) -> bool:
    """The same kind of turn in up to three months; the question names one month."""
    rng, person = b.rng, b.speakers[who]
    values, says, asks = RECURRING[key]
    months: dict[tuple[int, int], list[int]] = {}
    for i, d in enumerate(b.dates):
        months.setdefault((d.year, d.month), []).append(i)
    if len(months) < 2:
        return False
    chosen = rng.sample(sorted(months), min(3, len(months)))
    tags = []
    picked = rng.sample(values, len(chosen))
    for month, value in zip(chosen, picked, strict=True):
        session = rng.choice(months[month])
        block, t = b.fact_block(who, _fill(rng.choice(says), v=value), ())
        b.plant(session, block)
        tags.append(t)
    i = rng.randrange(len(chosen))
    label = datetime(chosen[i][0], chosen[i][1], 1).strftime("%B %Y")
    b.ask("temporal", _fill(rng.choice(asks), month=label, **person.fill()), picked[i], (tags[i],))
    return True


def _temporal_after_trip(b: _Builder, who: int) -> bool:
    rng, person = b.rng, b.speakers[who]
    pairs = [(i, j) for i in range(len(b.dates)) for j in range(i + 1, len(b.dates))
             if 3 <= (b.dates[j] - b.dates[i]).days <= 9]
    if not pairs:
        return False
    i, j = rng.choice(pairs)
    city, value = rng.choice(TRIP_CITIES), rng.choice(AFTER_VALUES)
    trip, t1 = b.fact_block(who, _fill(rng.choice(TRIP_SAYS), c=city), ())
    after, t2 = b.fact_block(who, _fill(rng.choice(AFTER_SAYS), v=value), ())
    b.plant(i, trip)
    b.plant(j, after)
    b.ask("temporal", _fill(rng.choice(AFTER_ASKS), c=city, **person.fill()), value, (t1, t2))
    return True


def _multi_hop(b: _Builder, chain, who: int) -> bool:
    rng, person = b.rng, b.speakers[who]
    n = len(b.dates)
    if n < 2:
        return False
    i = rng.randrange(n - 1)
    j = rng.randrange(i + 1, n)
    u, v = rng.sample(chain.values, 2)
    x = rng.choice(chain.extra) if chain.extra else ""
    when, _ = _relative(rng, b.dates[i])
    first, t1 = b.fact_block(who, _fill(rng.choice(chain.first), v=u, x=x, when=when), ())
    second, t2 = b.fact_block(who, _fill(rng.choice(chain.second), u=u, v=v, x=x), ())
    b.plant(i, first)
    b.plant(j, second)
    b.ask("multi_hop", _fill(rng.choice(chain.asks), **person.fill()), _fill(chain.answer, u=u, v=v), (t1, t2))
    return True


# --- layout -----------------------------------------------------------------------------------
def _layout(b: _Builder, lengths: tuple[int, int]) -> tuple[list[Turn], dict[int, int]]:
    """Each session: greeting, small talk with the planted blocks at random places, goodbye."""
    rng = b.rng
    people = tuple(o[0].name for o in b.others)
    turns: list[Turn] = []
    where: dict[int, int] = {}
    seen: set[str] = set()
    for s, start in enumerate(b.dates):
        target = rng.randint(*lengths)
        planted = list(b.blocks.get(s, []))
        rng.shuffle(planted)
        body: list[list[tuple[int, str, int | None]]] = []
        size = sum(len(p) for p in planted) + 4
        while size < target:
            ex = C.exchange(rng, people, b.names, seen)
            body.append([(w, t, None) for w, t in ex])
            size += len(ex)
        for p in planted:
            body.insert(rng.randint(0, len(body)), [(x.speaker, x.text, x.tag) for x in p])
        seq = [(w, t, None) for w, t in C.greeting(rng, people, b.names)]
        seq += [x for chunk in body for x in chunk]
        seq += [(w, t, None) for w, t in C.farewell(rng, people, b.names)]
        when = start
        for w, text, tag in seq:
            if tag is not None:
                where[tag] = len(turns)
            turns.append(Turn(len(turns), s, b.names[w], text, when))
            when += timedelta(seconds=rng.randint(20, 240))
    return turns, where


def conversation(rng: random.Random, cid: str, sessions: int | None = None,
                 lengths: tuple[int, int] = (20, 60)) -> tuple[Conversation, list[Question]]:
    """One conversation and its questions (see the module docstring)."""
    n = sessions or rng.randint(10, 25)
    a, c = rng.sample(C.NAMES, 2)
    speakers = (_Person(a, a in C.FEMALE), _Person(c, c in C.FEMALE))
    names = rng.sample(C.OTHERS, 6)
    others = tuple((_Person(p, p in FEMALE_OTHERS), rng.choice(RELATIONS), i % 2) for i, p in enumerate(names))
    b = _Builder(rng, cid, speakers, others, _dates(rng, n))
    pool = list(FACTS)
    rng.shuffle(pool)

    def take(who: int | None, need_when: bool = False) -> FactType | None:
        for f in pool:
            if need_when and not f.when_asks:
                continue
            whos = (0, 1) if who is None else (who,)
            if any((w, GROUP.get(f.key, f.key)) in b.used for w in whos):
                continue
            pool.remove(f)
            b.used.update((w, f.key) for w in whos)
            return f
        return None

    def chain_for(who: int):
        for ch in rng.sample(CHAINS, len(CHAINS)):
            g = GROUP.get(ch.key, ch.key)
            if (who, g) not in b.used:
                b.used.add((who, g))
                return ch
        return None

    for ch_who in [rng.randrange(2) for _ in range(max(2, n // 5))]:
        ch = chain_for(ch_who)
        if ch is not None:
            _multi_hop(b, ch, ch_who)
    for _ in range(max(2, n // 5)):
        who = rng.randrange(2)
        f = take(who, need_when=True)
        if f is not None:
            _temporal_event(b, f, who)
    for key in rng.sample(sorted(RECURRING), min(len(RECURRING), max(1, n // 10))):
        _temporal_month(b, key, rng.randrange(2))
    _temporal_after_trip(b, rng.randrange(2))
    for _ in range(max(1, n // 8)):
        f = take(None)
        if f is not None:
            _which_person(b, f)
    _which_third(b)
    for _ in range(max(2, n // 4)):
        who = rng.randrange(2)
        f = take(who)
        if f is not None and not _distractor(b, f, who):
            pool.append(f)
    for _ in range(max(3, n // 2)):
        who = rng.randrange(2)
        f = take(who)
        if f is not None:
            _paraphrase(b, f, who)
    turns, where = _layout(b, lengths)
    conv = Conversation(cid, b.names, b.dates, turns)
    qs = [Question(cid, cat, text, ans, tuple(where[t] for t in tags)) for cat, text, ans, tags in b.asks]
    _check(conv, qs)
    return conv, qs


def _check(conv: Conversation, questions: list[Question]) -> None:
    """The generator's promises, asserted on every data set it emits."""
    for q in questions:
        ev = [conv.turns[i] for i in q.evidence]
        if q.category == "paraphrase" and content_stems(q.text) & content_stems(ev[0].text):
            raise AssertionError(f"paraphrase question shares words with its evidence: {q.text!r} / {ev[0].text!r}")
        if q.category == "multi_hop" and len({t.session for t in ev}) < 2:
            raise AssertionError(f"multi-hop evidence in one session: {q.text!r}")


def generate(seed: int = 0, conversations: int = 8, sessions: int | None = None,
             lengths: tuple[int, int] = (20, 60)) -> Dataset:
    """`conversations` conversations (one agentmem user each) and their questions.
    `sessions`: per conversation (default: 10-25 at random); `lengths`: turns per session."""
    if conversations < 1:
        raise ValueError("conversations must be at least 1")
    if sessions is not None and sessions < 2:
        raise ValueError("sessions must be at least 2 (multi-hop questions span two)")
    if not 4 <= lengths[0] <= lengths[1]:
        raise ValueError(f"turns per session must be a range from at least 4, got {lengths}")
    rng = random.Random(seed)
    convs, qs = [], []
    for c in range(conversations):
        conv, q = conversation(rng, f"conv{c:03d}", sessions, lengths)
        convs.append(conv)
        qs += q
    return Dataset(convs, qs)


def scale_history(seed: int, messages: int, lengths: tuple[int, int] = (20, 60)) -> tuple[list[dict], list[str]]:
    """`messages` turns of history for one user (the scale test): generated sessions one
    after the other, 2 hours to 3 days apart, and the questions asked about them."""
    rng = random.Random(seed)
    when = datetime(2012, 1, 2, 9, tzinfo=UTC)
    out: list[dict] = []
    questions: list[str] = []
    while len(out) < messages:
        conv, qs = conversation(rng, f"scale{len(questions)}", None, lengths)
        questions += [q.text for q in qs]
        for msgs in conv.sessions():
            offset = when - msgs[0]["created_at"]
            out += [{**m, "created_at": m["created_at"] + offset} for m in msgs]
            when = out[-1]["created_at"] + timedelta(hours=rng.randint(2, 72))
    return out[:messages], questions

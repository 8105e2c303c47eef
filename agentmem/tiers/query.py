"""What a recall query is made of, read by rules: its content words (for the full-text index),
the people it names, and the time it speaks of.

No model reads the question: every step is a rule that can be tested on a table of phrasings,
so the same question always retrieves the same evidence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

from .timeparse import Anchor, TimeWindow, parse_anchor, parse_time

MAX_TERMS = 48  # a 100 kB query still becomes one bounded full-text query
INFO_WORDS = 3  # content words from which a turn counts as saying something
_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)?", re.UNICODE)

# English function words and question scaffolding: they match almost every turn, so a
# full-text query made of them ranks noise. Kept short and explicit on purpose.
STOP_WORDS = frozenset("""
a about above after again against ago all also am an and any are aren as at be because been before being
below between both but by can cannot could couldn did didn do does doesn doing don down during each either
else ever every few for from further get gets got had hadn has hasn have haven having he her here hers
herself him himself his how i if in into is isn it its itself just let lets like ll me might mine more most
much must my myself no nor not now of off often on once one only or other ought our ours ourselves out over
own per please quite rather re really s said same say says shall shan she should shouldn since so some
something such t than that thats the their theirs them themselves then there these they this those though
through to too toward towards under until up upon us ve very was wasn way we well were weren what whatever
when whenever where whether which while who whom whose why will with within without won would wouldn yes
yet you your yours yourself yourselves
tell remember recall know think mention mentioned talk talked kind sort thing things anything everything
hi hello hey thanks thank haha lol ok okay yeah yep oh wow cool sure bye
""".split())


def words(text: str) -> list[str]:
    """Lower-cased word tokens, apostrophes kept inside words (don't, Tom's)."""
    return [w.lower().replace("’", "'") for w in _WORD.findall(text)]


def content_terms(text: str, drop: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The query's content words, in order, unique, at most `MAX_TERMS`: no stop words, no
    possessive 's, nothing in `drop` (the people the query names are weighed apart)."""
    out: list[str] = []
    seen: set[str] = set()
    for w in words(text):
        if w.endswith("'s"):
            w = w[:-2]
        w = w.replace("'", "")
        if len(w) < 2 and not w.isdigit():
            continue
        if w in STOP_WORDS or w in drop or w in seen:
            continue
        seen.add(w)
        out.append(w)
        if len(out) == MAX_TERMS:
            break
    return out


def information(text: str, names: set[str] | frozenset[str] = frozenset()) -> float:
    """How much a turn can say, from its content words (names aside): 1 from INFO_WORDS on,
    less below. "Hi Yasmin! so good to hear from you" and "How's Lina doing?" answer nothing,
    yet short texts that name a person sit close to any question naming them."""
    n = len(content_terms(text, names))
    return (min(max(n, 0.5), INFO_WORDS) / INFO_WORDS) ** 0.5


@dataclass(frozen=True)
class ParsedQuery:
    text: str
    terms: list[str]  # for the full-text index
    people: list[str] = field(default_factory=list)  # speakers the query names (as stored)
    window: TimeWindow | None = None
    asks_when: bool = False  # "when did ...": the evidence is a turn that dates an event
    dense_text: str = ""  # what the embedder reads: the speakers' names masked
    anchor: Anchor | None = None  # "the week after her trip": dated by another event (no window named)



_WHEN = re.compile(r"^\s*(?:and\s+)?(?:when|what\s+(?:date|day|year|month|time)|how\s+long\s+ago)\b", re.I)


def parse_query(text: str, speakers: list[str] | None = None, now: datetime | None = None) -> ParsedQuery:
    """Read `text` against this user's known speakers and the conversation's own 'now'
    (the newest message time), so that "last week" means the week before that."""
    lowered = {w for w in words(text)} | {w[:-2] for w in words(text) if w.endswith("'s")}
    # a name that is also a function word ("Will", "May") names someone only as written so
    lowered -= {w for w in lowered & STOP_WORDS if not re.search(rf"\b{w.capitalize()}\b", text)}
    people, said = named_speakers(lowered, speakers or [])
    drop = {p for s in said for p in words(s)}
    known = {w for s in speakers or [] for w in words(s)}
    window = parse_time(text, now, known) if now is not None else None
    dense = mask_names(text, said) if speakers else mask_capitalised(text)
    return ParsedQuery(text, content_terms(text, drop), people, window, bool(_WHEN.search(text)),
                       dense, parse_anchor(text) if window is None else None)


def named_speakers(lowered: set[str], speakers: list[str]) -> tuple[list[str], list[str]]:
    """(the speakers a question names, the names as it says them): a speaker all of whose
    name's words it holds, or whose first name it holds when no other speaker has that first
    name ("Caroline" for the speaker "Caroline Smith", not when "Caroline Jones" speaks too)."""
    first: dict[str, int] = {}
    for s in speakers:
        if ws := words(s):
            first[ws[0]] = first.get(ws[0], 0) + 1
    people, said = [], []
    for s in speakers:
        ws = words(s)
        if ws and all(p in lowered for p in ws):
            people.append(s)
            said.append(s)
        elif len(ws) > 1 and ws[0] in lowered and first[ws[0]] == 1:
            people.append(s)
            said.append(s.split()[0])
    return people, said


# Capitalised words that name a time, not a person: `mask_capitalised` leaves them (parse_time reads them).
_TIME_WORDS = frozenset("""
january february march april may june july august september october november december
monday tuesday wednesday thursday friday saturday sunday christmas easter halloween thanksgiving
""".split())
_LETTERS = re.compile(r"[^\W\d_]+")  # a run of letters, any script


def mask_capitalised(text: str) -> str:
    """The query with each capitalised word inside a sentence (not a sentence's first word, not a
    month, weekday or holiday) replaced by "someone", for a user whose history names no speaker:
    a conversation imported as bare user/assistant turns, or an agent's own chat. There a name
    in the question is as likely one of the two parties as anyone else, and a party's own turns
    never say their name, so the name would pull the embedded question toward the turns that
    greet them ("Hi Priya!"), as an unmasked speaker's name did before `mask_names`. The
    full-text terms keep every word, so a third person still finds the turns that name them.
    Measured on the Zen 4 VM (2026-11-28) on the hand-written conversations and generator seed 2 imported with
    roles only (no `name`, no "Name:" prefix): recall@10 0.682 -> 0.800 and 0.541 -> 0.691
    (imported with names: 0.877 and 0.768, unchanged by this); which-person questions there
    0.929 -> 0.881 on the hand-written set, where third persons lose their name's pull."""
    out, last, end, prev = [], 0, 0, ""  # prev: the last non-space character before the word
    for m in _LETTERS.finditer(text):
        w = m.group(0)
        prev = (text[end:m.start()].rstrip() or prev)[-1:]
        end = m.end()
        # capitalised ("Zoë", "José"; not "TV", "OK", "I"), inside a sentence, not a time
        if (w[0].isupper() and not w.isupper() and prev and prev not in ".!?"
                and w.lower() not in _TIME_WORDS):
            out += [text[last:m.start()], "someone"]
            last = end
        prev = w[-1]
    return "".join(out) + text[last:]


def mask_names(text: str, names: list[str]) -> str:
    """The query with the named speakers replaced by "someone": in a sentence embedding a
    name outweighs the rest of a short question, so "What scares Yasmin?" would rank
    "Hi Yasmin!" first. Who is asked about is weighed apart (a speaker boost)."""
    for name in sorted(names, key=len, reverse=True):
        pat = r"\b" + r"\s+".join(re.escape(p) for p in name.split()) + r"\b"
        flags = 0 if name.lower() in STOP_WORDS else re.I  # "Will", not "will"
        text = re.sub(pat + r"['’]s\b", "someone's", text, flags=flags)
        text = re.sub(pat, "someone", text, flags=flags)
    return text

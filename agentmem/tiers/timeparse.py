"""Time in a question, read by rules into a window of the conversation's own time.

"What did Tom cook last week?" asked after a conversation whose newest message is dated
2023-08-01 means 2023-07-24..2023-07-31, whatever today's date is: the reference is the
conversation's 'now' (its newest message), which imports set through `created_at`.

Relative phrases (yesterday, last week, N days ago, last Monday, this month...) are patterns
here; explicit dates ("7 May 2023", "May 7th", "2023-05-07") are cut out by patterns and read
by `dateparser`; a month ("in May", "May 2023") or a year ("in 2022") becomes that whole
span. No model guesses a date. The window is used as a boost, not a filter: people date
things loosely ("last month" said on the 2nd), so turns inside it are favoured, the others
still found.
"""

from __future__ import annotations

import calendar
import re
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

_MONTHS = {m.lower(): i for i, m in enumerate(calendar.month_name) if m}
_MONTHS.update({m.lower(): i for i, m in enumerate(calendar.month_abbr) if m})
_MONTHS["sept"] = 9
_DAYS = {d.lower(): i for i, d in enumerate(calendar.day_name)}
_NUM = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
        "nine": 9, "ten": 10, "couple": 2, "a couple": 2, "a couple of": 2, "few": 3, "a few": 3}
_UNIT_DAYS = {"day": 1, "week": 7, "month": 30, "year": 365}
_MONTH_RE = "|".join(sorted(_MONTHS, key=len, reverse=True))
_DAY_RE = "|".join(_DAYS)

_EXPLICIT = re.compile(
    rf"\b(?:\d{{4}}-\d{{1,2}}-\d{{1,2}}"
    rf"|\d{{1,2}}(?:st|nd|rd|th)?\s+(?:of\s+)?(?:{_MONTH_RE})\.?,?\s*(?:\d{{4}})?"
    rf"|(?:{_MONTH_RE})\.?\s+\d{{1,2}}(?:st|nd|rd|th)?\b,?\s*(?:\d{{4}})?)", re.I)
_MONTH_YEAR = re.compile(rf"\b(early|mid|late|end\s+of|beginning\s+of)?\s*(?:-\s*)?({_MONTH_RE})\.?(?:,?\s+(\d{{4}}))?\b",
                         re.I)
_YEAR = re.compile(r"\b(?:in|during|of|since)\s+((?:19|20)\d{2})\b", re.I)
_AGO = re.compile(r"\b(\d+|a couple of|a couple|a few|couple|few|an?|one|two|three|four|five|six|seven|eight|"
                  r"nine|ten)\s+(day|week|month|year)s?\s+ago\b", re.I)
_LAST_UNIT = re.compile(r"\b(last|past|previous|this|current)\s+(week(?:end)?|month|year)\b", re.I)
_LAST_DAY = re.compile(rf"\b(last|this|on)\s+({_DAY_RE})\b", re.I)
_SIMPLE = {"yesterday": (-1, 1), "today": (0, 1), "tonight": (0, 1), "the day before yesterday": (-2, 1),
           "recently": (-21, 22), "lately": (-21, 22)}
# 'may' is a month and a verb: as a month it needs a preposition, a day or a year next to it
_MAY_VERB = re.compile(r"\bmay\b(?!\s*(?:\d|,?\s*(?:19|20)\d{2}))", re.I)
_AFTER_PREP = re.compile(r"\b(?:in|of|during|since|by|until|from|through)\s+$", re.I)
_MAY_MONTH = re.compile(r"\b(?:in|of|during|since|early|mid|late|by|until|end\s+of|beginning\s+of)\s+may\b", re.I)


@dataclass(frozen=True)
class TimeWindow:
    since: datetime
    until: datetime
    phrase: str  # the words it was read from

    def contains(self, t: datetime) -> bool:
        return self.since <= t < self.until


@dataclass(frozen=True)
class Anchor:
    """Time told by another event: "the week after her trip to Lisbon". `relation` is after
    or before, `days` how far the window reaches from the event, `phrase` the event's words
    (found by a search of its own, whose best hit dates it)."""

    relation: str
    days: int
    phrase: str

    def window(self, event: datetime) -> TimeWindow:
        day = _day(event)
        if self.relation == "after":
            return TimeWindow(day, day + timedelta(days=self.days + 1), f"{self.relation} {self.phrase}")
        return TimeWindow(day - timedelta(days=self.days), day + timedelta(days=1), f"{self.relation} {self.phrase}")


_ANCHOR = re.compile(r"\b(?:(?:in|during|over)\s+)?(?:the\s+)?(?:(?:first|next|few|couple\s+of)\s+)?"
                     r"(day|days|week|weeks|weekend|month|months)?\s*"
                     r"(after|before|following|prior\s+to|ahead\s+of|in\s+the\s+run-up\s+to)\s+"
                     r"([^?.!;,]+)", re.I)
_ANCHOR_SPAN = {"day": 2, "days": 7, "week": 8, "weeks": 21, "weekend": 4, "month": 31, "months": 92, None: 14}
# words that do not name an event ("before the current one", "after that", "after all")
_NOT_EVENT = frozenset("the a an her his their my your our its this that these those then now current one ones "
                       "all last next previous first time times it them him me us you".split())


def parse_anchor(text: str) -> Anchor | None:
    """An event the question dates things by ("after getting back from Lisbon", "the week
    before her wedding"), or None. Dates and relative phrases are `parse_time`'s."""
    m = _ANCHOR.search(text)
    if m is None:
        return None
    phrase = " ".join(m.group(3).split())
    if not [w for w in re.findall(r"[^\W\d_]+", phrase.lower()) if w not in _NOT_EVENT]:
        return None
    unit = m.group(1).lower() if m.group(1) else None
    relation = "after" if m.group(2).lower() in ("after", "following") else "before"
    return Anchor(relation, _ANCHOR_SPAN[unit], phrase)


def _day(t: datetime) -> datetime:
    return t.replace(hour=0, minute=0, second=0, microsecond=0)


def _month_span(year: int, month: int, part: str | None) -> tuple[datetime, datetime]:
    start = datetime(year, month, 1, tzinfo=UTC)
    end = datetime(year + (month == 12), month % 12 + 1, 1, tzinfo=UTC)
    part = (part or "").lower().replace("  ", " ")
    if part == "early" or part.startswith("beginning"):
        end = start + timedelta(days=11)
    elif part == "mid":
        start, end = start + timedelta(days=9), start + timedelta(days=21)
    elif part == "late" or part.startswith("end"):
        start = start + timedelta(days=19)
    return start, end


_DATEPARSER = threading.Lock()  # its first parse builds shared tables
_warming: threading.Thread | None = None


def _explicit(phrase: str, now: datetime) -> datetime | None:
    with _DATEPARSER:
        import dateparser

        got = dateparser.parse(phrase, languages=["en"], settings={
            "RELATIVE_BASE": now.replace(tzinfo=None), "PREFER_DATES_FROM": "past", "RETURN_AS_TIMEZONE_AWARE": False})
    return None if got is None else got.replace(tzinfo=UTC)


_NAMED_MONTH = re.compile(rf"\b(?:{_MONTH_RE})\.?\b", re.I)
_ANY_YEAR = re.compile(r"\b\d{4}\b")


def parse_timestamp(text: str) -> datetime | None:
    """A message time as imports write it when it is not ISO-8601: a date with its month in
    words and its year ("1:56 pm on 8 May, 2023", "May 8th 2023, 10:00"), in UTC when it names
    no zone. None for anything else: "03/04/2023" could be March or April, and a date without
    its year would be guessed."""
    if not (_NAMED_MONTH.search(text) and _ANY_YEAR.search(text)):
        return None
    with _DATEPARSER:
        import dateparser

        got = dateparser.parse(text, languages=["en"], settings={
            "REQUIRE_PARTS": ["day", "month", "year"], "RETURN_AS_TIMEZONE_AWARE": True, "TIMEZONE": "UTC"})
    return got


def warm_up() -> None:
    """Import dateparser and parse one date in a background thread, once per process: its
    first parse costs ~0.2 s (seconds on a loaded machine), which would otherwise land on the
    first question that names a date."""
    global _warming
    with _DATEPARSER:
        if _warming is not None:
            return
        _warming = threading.Thread(target=_explicit, args=("7 May 2023", datetime(2023, 6, 1, tzinfo=UTC)),
                                    name="dateparser-warm-up", daemon=True)
    _warming.start()


def parse_time(text: str, now: datetime, names: frozenset[str] | set[str] = frozenset()) -> TimeWindow | None:
    """The first time expression in `text`, as a window relative to `now`; None if there is none.
    `names`: lower-case words of people's names ("jun", "april", "june"): such a month word is a
    month only with a date around it ("in June", "June 2023", "early April"), as "may" the verb is;
    "What can Jun not eat?" names no time."""
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    today = _day(now)
    low = " ".join(text.lower().split())
    for phrase in sorted(_SIMPLE, key=len, reverse=True):
        if re.search(rf"\b{phrase}\b", low):
            start, days = _SIMPLE[phrase]
            since = today + timedelta(days=start)
            return TimeWindow(since, since + timedelta(days=days), phrase)
    m = _EXPLICIT.search(text)
    if m and not (m.group(0).lower().startswith("may") and _MAY_VERB.match(m.group(0))):
        day = _explicit(m.group(0), now)
        if day is not None:
            day = _day(day)
            return TimeWindow(day, day + timedelta(days=1), m.group(0).strip())
    m = _AGO.search(low)
    if m:
        g = m.group(1)
        n = int(g) if g.isdigit() else _NUM.get(g, 1)
        unit = _UNIT_DAYS[m.group(2)]
        center = today - timedelta(days=n * unit)
        slack = timedelta(days=max(1, unit // 2 if n == 1 else unit * n // 4))
        return TimeWindow(center - slack, center + slack + timedelta(days=1), m.group(0))
    m = _LAST_UNIT.search(low)
    if m:
        which, unit = m.group(1), m.group(2)
        last = which in ("last", "past", "previous")
        if unit == "week":
            start = today - timedelta(days=today.weekday()) - (timedelta(days=7) if last else timedelta())
            return TimeWindow(start, start + timedelta(days=7), m.group(0))
        if unit == "weekend":
            sat = today - timedelta(days=(today.weekday() - 5) % 7)  # the latest Saturday, today included
            if last and today - sat < timedelta(days=2):
                sat -= timedelta(days=7)  # said during a weekend, "last weekend" is the one before
            return TimeWindow(sat, sat + timedelta(days=2), m.group(0))
        if unit == "month":
            year, month = (today.year, today.month)
            if last:
                year, month = (year - 1, 12) if month == 1 else (year, month - 1)
            return TimeWindow(*_month_span(year, month, None), m.group(0))
        year = today.year - last
        return TimeWindow(datetime(year, 1, 1, tzinfo=UTC), datetime(year + 1, 1, 1, tzinfo=UTC), m.group(0))
    m = _LAST_DAY.search(low)
    if m:
        back = (today.weekday() - _DAYS[m.group(2)]) % 7 or 7
        day = today - timedelta(days=back)
        return TimeWindow(day, day + timedelta(days=1), m.group(0))
    for m in _MONTH_YEAR.finditer(text):
        name = m.group(2).lower()
        if name == "may" and not (m.group(3) or m.group(1) or _MAY_MONTH.search(low)):
            continue  # "may" the verb
        dated = m.group(3) or m.group(1) or _AFTER_PREP.search(text[:m.start(2)])
        if not dated and (m.group(2).islower() or name.rstrip(".") in names):
            continue  # "march on", "the mar" in lower case; a person, "What can Jun not eat?": no date around it
        month = _MONTHS[name.rstrip(".")]
        year = int(m.group(3)) if m.group(3) else today.year - (month > today.month)
        return TimeWindow(*_month_span(year, month, m.group(1)), m.group(0).strip())
    m = _YEAR.search(text)
    if m:
        year = int(m.group(1))
        return TimeWindow(datetime(year, 1, 1, tzinfo=UTC), datetime(year + 1, 1, 1, tzinfo=UTC), m.group(0))
    return None

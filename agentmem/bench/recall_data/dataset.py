"""Conversations and evidence-annotated questions from a JSON file, for `agentmem bench recall
--dataset FILE`: the same measurement as on the generator, on text people wrote.

Two layouts are read (`load_dataset` tells them apart):

- **agentmem's own** (what `agentmem/bench/recall_data/data/*.json` holds)::

    {"conversations": [{"id": "A", "speakers": ["Ines", "Kwame"],
                        "sessions": [{"date": "2023-01-14T19:05:00",
                                      "turns": [{"speaker": "Ines", "text": "...",
                                                 "caption": "a photo of ..."}]}]}],
     "questions": [{"conversation": "A", "question": "...", "answer": "...",
                    "category": "single_hop", "evidence": [[3, 7]]}]}

  Evidence is [session, turn], both counted from 0; `caption` is optional.
- **the LoCoMo-style layout** of published multi-session conversation sets: a list of
  samples, each with `conversation` (`speaker_a`, `speaker_b`, `session_<n>` lists of turns
  with `speaker`, `dia_id` "D<n>:<m>", `text` and an optional `blip_caption`, and
  `session_<n>_date_time` such as "1:56 pm on 8 May, 2023") and `qa` (`question`, `answer`,
  `evidence` as dia ids, `category`, kept as "category_<n>").

Every turn is stored through `AgentSession.add_messages` as the benchmark does with its own
conversations: the speaker as `name`, the caption as the message's `caption` (indexed beside
the text, never part of it), `created_at` the session's date plus half a minute per turn. A
question whose evidence names no turn of its conversation is left out and counted
(`skipped_questions`), never guessed.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

from .generator import Conversation, Dataset, Question, Turn

TURN_GAP = timedelta(seconds=30)  # between a session's turns: their order, on the session's day
_SESSION_KEY = re.compile(r"^session_(\d+)$")


class DatasetError(ValueError):
    """The file is not a conversation data set this loader reads; the message says where."""


def load_dataset(path: str | Path) -> tuple[Dataset, int]:
    """The conversations and questions of the file, and how many questions were skipped
    because their evidence names no turn."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DatasetError(f"{p}: {e}") from e
    if isinstance(raw, dict) and "conversations" in raw:
        return _own(raw, p)
    if isinstance(raw, list) and raw and all(isinstance(s, dict) and "conversation" in s for s in raw):
        return _locomo(raw, p)
    raise DatasetError(f"{p}: neither agentmem's layout ({{'conversations': ..., 'questions': ...}}) "
                       "nor a list of LoCoMo-style samples (each with 'conversation' and 'qa')")


def _date(value, where: str) -> datetime:
    if not isinstance(value, str):
        raise DatasetError(f"{where}: a date must be a string, got {value!r}")
    for parse in (datetime.fromisoformat, lambda s: datetime.strptime(s, "%I:%M %p on %d %B, %Y"),
                  lambda s: datetime.strptime(s, "%I:%M %p on %d %b, %Y")):
        try:
            d = parse(value.strip())
        except ValueError:
            continue
        return d if d.tzinfo else d.replace(tzinfo=UTC)
    raise DatasetError(f"{where}: unreadable date {value!r} (ISO 8601 or '1:56 pm on 8 May, 2023')")


def _text(value, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{where}: text must be a non-empty string")
    return value


def _conversation(cid: str, speakers: list[str], sessions: list[tuple[datetime, list[tuple[str, str, str | None]]]]
                  ) -> tuple[Conversation, dict[tuple[int, int], int]]:
    """A Conversation from (date, [(speaker, text, caption)]) sessions, and the turn index of
    each (session, turn) pair."""
    turns: list[Turn] = []
    where: dict[tuple[int, int], int] = {}
    for s, (date, rows) in enumerate(sessions):
        for t, (speaker, text, caption) in enumerate(rows):
            where[(s, t)] = len(turns)
            turns.append(Turn(len(turns), s, speaker, text, date + t * TURN_GAP, caption))
    first = speakers[0] if speakers else (turns[0].speaker if turns else "")
    second = speakers[1] if len(speakers) > 1 else next((t.speaker for t in turns if t.speaker != first), first)
    return Conversation(cid, (first, second), [d for d, _ in sessions], turns), where


def _own(raw: dict, p: Path) -> tuple[Dataset, int]:
    convs, index = [], {}
    for i, c in enumerate(raw.get("conversations") or []):
        at = f"{p}: conversations[{i}]"
        if not isinstance(c, dict) or not isinstance(c.get("sessions"), list):
            raise DatasetError(f"{at}: needs 'id' and a list of 'sessions'")
        sessions = []
        for s, sess in enumerate(c["sessions"]):
            rows = []
            for t, turn in enumerate(sess.get("turns") or []):
                tw = f"{at}.sessions[{s}].turns[{t}]"
                rows.append((_text(turn.get("speaker"), tw + ".speaker"), _text(turn.get("text"), tw + ".text"),
                             turn.get("caption") or None))
            sessions.append((_date(sess.get("date"), f"{at}.sessions[{s}].date"), rows))
        cid = str(c.get("id", i))
        conv, where = _conversation(cid, list(c.get("speakers") or []), sessions)
        convs.append(conv)
        index[cid] = where
    questions, skipped = [], 0
    for i, q in enumerate(raw.get("questions") or []):
        if not isinstance(q, dict):
            raise DatasetError(f"{p}: questions[{i}] must be an object")
        pairs = _pairs(q.get("evidence"), f"{p}: questions[{i}].evidence")
        where = index.get(str(q.get("conversation")))
        ev = [where.get(pair) for pair in pairs] if where is not None else []
        if not ev or None in ev:
            skipped += 1
            continue
        questions.append(Question(str(q["conversation"]), str(q.get("category", "all")),
                                  _text(q.get("question"), f"{p}: questions[{i}].question"), str(q.get("answer", "")),
                                  tuple(sorted(set(ev)))))
    return Dataset(convs, questions), skipped


def _pairs(evidence, where: str) -> list[tuple[int, int]]:
    """[session, turn] pairs as integers (none given: none, and the question is skipped);
    anything else is a DatasetError."""
    if evidence is None:
        return []
    if not isinstance(evidence, list):
        raise DatasetError(f"{where}: a list of [session, turn] pairs, got {evidence!r}")
    out = []
    for e in evidence:
        if not (isinstance(e, list | tuple) and len(e) == 2 and all(isinstance(x, int) for x in e)):
            raise DatasetError(f"{where}: {e!r} is not a [session, turn] pair of integers")
        out.append((e[0], e[1]))
    return out


def _locomo(raw: list, p: Path) -> tuple[Dataset, int]:
    convs, questions, skipped = [], [], 0
    for i, sample in enumerate(raw):
        c = sample["conversation"]
        at = f"{p}: [{i}].conversation"
        numbers = sorted(int(m.group(1)) for k in c if (m := _SESSION_KEY.match(k)) and isinstance(c[k], list))
        sessions, dia = [], {}
        for s, n in enumerate(numbers):
            rows = []
            for t, turn in enumerate(c[f"session_{n}"]):
                tw = f"{at}.session_{n}[{t}]"
                rows.append((_text(turn.get("speaker"), tw + ".speaker"), _text(turn.get("text"), tw + ".text"),
                             turn.get("blip_caption") or None))
                if isinstance(turn.get("dia_id"), str):
                    dia[turn["dia_id"].strip()] = (s, t)
            sessions.append((_date(c.get(f"session_{n}_date_time"), f"{at}.session_{n}_date_time"), rows))
        cid = str(sample.get("sample_id", i))
        speakers = [x for x in (c.get("speaker_a"), c.get("speaker_b")) if isinstance(x, str)]
        conv, where = _conversation(cid, speakers, sessions)
        convs.append(conv)
        for q in sample.get("qa") or []:
            ids = []
            for e in q.get("evidence") or []:
                # some annotations hold several ids in one string ("D8:6; D9:17")
                ids += [x for x in re.split(r"[;,\s]+", str(e)) if x]
            ev = [where.get(dia.get(x, (-1, -1))) for x in ids]
            if not ev or None in ev or not isinstance(q.get("question"), str):
                skipped += 1
                continue
            questions.append(Question(cid, f"category_{q.get('category', 0)}", q["question"], str(q.get("answer", "")),
                                      tuple(sorted(set(ev)))))
    return Dataset(convs, questions), skipped

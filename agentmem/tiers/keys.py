"""Richer keys, verbatim values: what the indexes read for a message besides its text.

People answer in context ("The cello!" answers "What did you end up buying?") and share
photos whose caption says what the words do not. So the full-text index reads, besides the
text, the captions and attachment texts a message carries (the `keys` column), and the dense
index embeds each message a second time read after the turn it answers. The turn before is
not put in the full-text keys: there it made every neighbour of a matching turn match too.
What recall returns and the prompt shows is always the message text itself.
"""

from __future__ import annotations

import re

from .records import InvalidInput

PREVIOUS_CHARS = 300  # of the turn a message answers, in its keys
ATTACHMENT_FIELDS = ("caption", "image_caption", "blip_caption", "attachment_text", "attachments", "images")


def message_text(content) -> str | bytes:
    """A message's text: a string, or OpenAI's content parts (the text parts joined; an
    image part contributes its caption or alt text when it has one)."""
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, str):
                pieces.append(part)
            elif isinstance(part, dict):
                text = part.get("text") or part.get("caption") or part.get("alt")
                if isinstance(text, str):
                    pieces.append(text)
        return "\n".join(pieces)
    return content


def attachment_text(message: dict, what: str = "message") -> str:
    """Caption and attachment text a message dict carries (strings, or lists of strings or of
    dicts with a 'caption'/'text'), joined."""
    out: list[str] = []

    def take(value) -> None:
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, dict):
            take(value.get("caption") or value.get("text") or value.get("alt"))
        elif isinstance(value, list | tuple):
            for v in value:
                take(v)
        elif value is not None:
            raise InvalidInput(f"{what}: an attachment must be text, a list, or a dict with a caption")

    for f in ATTACHMENT_FIELDS:
        take(message.get(f))
    return " ".join(" ".join(out).split())


def with_keys(text: str, keys: str | None) -> str:
    """What a message says, its captions and attachment text included: "look what followed me
    home" says nothing without "a photo of a cello leaning against a wall". The dense text view
    embeds it and the priors (information, specificity) read it."""
    return f"{text}\n{keys}" if keys else text


def context_view(text: str, previous: str | None, keys: str | None) -> str:
    """The second dense view of a message: the start of the turn it answers, then the message
    (with its captions). A session's first message has one too (its own text), so that every
    message gets the same number of votes in the fusion."""
    own = with_keys(text, keys)
    if not previous:
        return own
    return f"{' '.join(previous.split())[:PREVIOUS_CHARS]}\n{own}"


# --- speakers named inside the text --------------------------------------------------------
# Transcripts are often imported flattened to role/content pairs with the speaker in the text
# ("Caroline: I went to the support group yesterday"). Recall weighs a turn by who said it
# (the speaker boost, the person vote, the name masked in the embedded question), so a batch
# that reads as such a transcript gets its speakers from the prefixes. The text is stored as
# given; only the dense views leave the prefix out (`unprefixed`).
_PREFIX = re.compile(r"\s*([A-Z][\w'’.-]{0,30}(?: [A-Z][\w'’.-]{0,30})?)\s*:\s+\S")
# labels and roles, not people ("Note: ...", "User: ...")
NOT_NAMES = frozenset({
    "a", "ai", "answer", "assistant", "bot", "caption", "edit", "error", "example", "human", "image", "input", "me",
    "note", "output", "photo", "ps", "q", "question", "re", "reply", "step", "subject", "summary", "system", "tip",
    "todo", "update", "user", "warning", "you",
})
TRANSCRIPT_SHARE = 0.8  # of a batch's messages that must open with a name and a colon
TRANSCRIPT_MIN = 2  # messages a batch needs before its prefixes are read as speakers
TRANSCRIPT_MAX_NAMES = 8  # more distinct "names" than this is a list of labels, not a talk


def prefix_name(text: str) -> str | None:
    """'Caroline' for "Caroline: I went ...", else None (a label such as 'Note' is no name)."""
    m = _PREFIX.match(text)
    if m is None or m.group(1).lower().rstrip(".") in NOT_NAMES:
        return None
    return m.group(1)


def transcript_speakers(texts: list[str]) -> list[str | None]:
    """The speaker each message of a batch names at its start, when the batch reads as a
    transcript: at least TRANSCRIPT_MIN messages, TRANSCRIPT_SHARE of them opening with
    "Name: " and at most TRANSCRIPT_MAX_NAMES names. Otherwise all None: one message's
    "Paris: day 3" is a heading, not a speaker."""
    names = [prefix_name(t) for t in texts]
    found = [n for n in names if n]
    if len(texts) < TRANSCRIPT_MIN or len(found) < TRANSCRIPT_SHARE * len(texts):
        return [None] * len(texts)
    if len(set(found)) > TRANSCRIPT_MAX_NAMES:
        return [None] * len(texts)
    return names


def unprefixed(text: str, name: str | None) -> str:
    """The text without its speaker's own "Name: " opening (what the dense views embed: the
    name would otherwise pull every question about that person toward all their turns)."""
    if name and text.startswith(name):
        rest = text[len(name):].lstrip()
        if rest.startswith(":"):
            return rest[1:].lstrip() or text
    return text

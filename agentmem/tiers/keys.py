"""Richer keys, verbatim values: what the indexes read for a message besides its text.

People answer in context ("The cello!" answers "What did you end up buying?") and share
photos whose caption says what the words do not. So the full-text index reads, besides the
text, the captions and attachment texts a message carries (the `keys` column), and the dense
index embeds each message a second time read after the turn it answers. The turn before is
not put in the full-text keys: there it made every neighbour of a matching turn match too.
What recall returns and the prompt shows is always the message text itself.
"""

from __future__ import annotations

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


def context_view(text: str, previous: str | None, keys: str | None) -> str:
    """The second dense view of a message: the start of the turn it answers, then the message
    (with its captions). A session's first message has one too (its own text), so that every
    message gets the same number of votes in the fusion."""
    own = f"{text}\n{keys}" if keys else text
    if not previous:
        return own
    return f"{' '.join(previous.split())[:PREVIOUS_CHARS]}\n{own}"

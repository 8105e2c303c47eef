"""The hits a search returns, built from stored messages and memories."""

from __future__ import annotations

from ..records import Hit, Memory, Message


def message_hit(msg: Message, pieces: list[str], chunk: int = 0, *, score: float = 0.0, similarity: float = 0.0,
                retrievers: list[str] | None = None, context: str | None = None) -> Hit:
    """The hit a stored message's piece `chunk` comes back as (`pieces`: `chunk_text(msg.text)`):
    its compressed form only where it is one piece, its captions (`keys`) with its first piece.
    Recall and reflection's replays build message hits with this one function."""
    return Hit(id=msg.id, kind="message", text=pieces[chunk], score=score, similarity=similarity, time=msg.time,
               source_ids=[msg.id], role=msg.role, session_id=msg.session_id, importance=0.5, chunk=chunk,
               compressed_text=msg.compressed_text if len(pieces) == 1 else None, retrievers=list(retrievers or []),
               name=msg.name, context=context, keys=msg.keys if chunk == 0 else None)


def memory_hit(m: Memory, *, score: float = 0.0, similarity: float = 0.0, retrievers: list[str] | None = None) -> Hit:
    """The hit a stored memory (fact, insight) comes back as."""
    return Hit(id=m.id, kind=m.kind, text=m.text, score=score, similarity=similarity, time=m.time,
               source_ids=list(m.source_ids), importance=m.importance, compressed_text=m.compressed_text,
               retrievers=list(retrievers or []))


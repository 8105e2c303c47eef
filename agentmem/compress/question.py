"""Question-aware compression of one prompt's recalled memories (LongLLMLingua), on request.

The recalled memories are ranked and compressed against the question into one segment.
That text changes with every question, so the segment is marked not cacheable: none of the
recalled memories' chunk KV is reused for this request and their tokens are prefilled anew.
Use it when the prompt budget matters more than time to first token; by default, memories
carry the compressed text computed once when they were written or reflected.
"""

from __future__ import annotations

from ..assemble import Context, ContextSegment
from .compressor import Compressor

REF = "recall:question-aware"


def question_aware(ctx: Context, compressor: Compressor, question: str, target_tokens: int) -> Context:
    """`ctx` with its recalled-memory segments replaced by one LongLLMLingua-compressed
    segment of about `target_tokens` tokens (the header line is kept as is)."""
    recall = [s for s in ctx.segments if s.tier == "recall" and s.ref != "recall:header"]
    if not recall:
        return ctx
    text, stats = compressor.compress_for_question([s.text for s in recall], question, target_tokens)
    merged = ContextSegment("recall", text.rstrip("\n") + "\n", 0, REF,
                            [m for s in recall for m in s.memory_ids], cacheable=False)
    merged.tokens = compressor.engine.count_tokens(merged.text)
    first = ctx.segments.index(recall[0])
    rest = [s for s in ctx.segments if s not in recall]
    return Context(rest[:first] + [merged] + rest[first:], ctx.memories, ctx.namespace)

"""Prompt compression: LLMLingua on the engine's own model, offline, once per memory.

Names load on first use, so the budget policy (which the assembler reads every turn) does not
import llmlingua."""

from importlib import import_module

_WHERE = {
    "BudgetPlan": ".policy",
    "BudgetPolicy": ".policy",
    "CompressionStats": ".compressor",
    "Compressor": ".compressor",
    "compress_memory": ".compressor",
    "EngineCompressor": ".lingua",
    "EngineLM": ".lingua",
    "question_aware": ".question",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name], __name__), name)

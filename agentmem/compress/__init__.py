"""Prompt compression: LLMLingua on the engine's own model, offline, once per memory."""

from .compressor import CompressionStats, Compressor, compress_memory
from .lingua import EngineCompressor, EngineLM
from .policy import BudgetPlan, BudgetPolicy
from .question import question_aware

__all__ = [
    "BudgetPlan",
    "BudgetPolicy",
    "CompressionStats",
    "Compressor",
    "EngineCompressor",
    "EngineLM",
    "compress_memory",
    "question_aware",
]

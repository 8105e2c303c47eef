"""The model engine: weights, tokenizer and chat format, forward pass, KV, generation."""

from .block_manager import BlockManager, NoFreeBlocks
from .engine import (
    DenseKV,
    Engine,
    Generation,
    GenerationStats,
    GenerationStream,
    PrefillPlanner,
    PrefillResult,
    Segment,
    attend,
)
from .errors import (
    EmptyPrompt,
    EngineError,
    EngineRefused,
    EngineUnavailable,
    InvalidSampling,
    PromptTooLong,
    UnsupportedModel,
)
from .kv_pool import KVPool
from .loop import EngineLoop
from .model import ModelArgs, Transformer, load_transformer
from .protocol import TextEngine, load_engine, local_engine
from .sampler import SamplingParams
from .weights import WeightsMissing, resolve_model_dir

__all__ = [
    "BlockManager",
    "EngineLoop",
    "KVPool",
    "NoFreeBlocks",
    "DenseKV",
    "EmptyPrompt",
    "Engine",
    "EngineError",
    "EngineRefused",
    "EngineUnavailable",
    "Generation",
    "GenerationStats",
    "GenerationStream",
    "InvalidSampling",
    "ModelArgs",
    "PrefillPlanner",
    "PrefillResult",
    "PromptTooLong",
    "SamplingParams",
    "TextEngine",
    "Segment",
    "Transformer",
    "UnsupportedModel",
    "WeightsMissing",
    "attend",
    "load_engine",
    "load_transformer",
    "local_engine",
    "resolve_model_dir",
]

"""Offline reflection: turn a user's conversations into fewer, better memories.

`reflect(store, engine, tenant_id, user_id)` runs one pass (checkpointed, idempotent);
`ReflectionScheduler` runs passes in the background after N new turns or idle time;
`agentmem reflect` runs them from the command line (`--watch`: in the background).
"""

from .checkpoint import Checkpoints
from .constrained import Prefix, choose, copy_span
from .facts import Fact, ModelExtractor, pattern_facts, slot_of
from .job import HUMAN_BLOCK, ReflectReport, compress_messages, hot_segments, reflect
from .trigger import ReflectionScheduler

__all__ = [
    "HUMAN_BLOCK",
    "Checkpoints",
    "Fact",
    "ModelExtractor",
    "Prefix",
    "ReflectReport",
    "ReflectionScheduler",
    "choose",
    "compress_messages",
    "copy_span",
    "hot_segments",
    "pattern_facts",
    "reflect",
    "slot_of",
]

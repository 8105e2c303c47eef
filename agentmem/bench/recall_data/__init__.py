"""The data `agentmem bench recall` (agentmem/bench/recall.py) runs on: seeded multi-session
chats between two people with questions annotated with their evidence turns (`generator`), and
datasets read from JSON (`dataset`; the hand-written sets are in `data/`)."""

from .generator import CATEGORIES, Conversation, Dataset, Question, Turn, generate, scale_history

__all__ = ["CATEGORIES", "Conversation", "Dataset", "Question", "Turn", "generate", "scale_history"]

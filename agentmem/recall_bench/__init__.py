"""A recall benchmark that real conversations would pass: seeded multi-session chats between
two people (`generator`), questions annotated with their evidence turns, and the harness
behind `agentmem bench recall` (`bench`)."""

from .generator import CATEGORIES, Conversation, Dataset, Question, Turn, generate, scale_history

__all__ = ["CATEGORIES", "Conversation", "Dataset", "Question", "Turn", "generate", "scale_history"]

"""OpenAI chat roles -> the roles the chat template knows. Current OpenAI SDKs send
`developer` where older ones sent `system`; `function` is the legacy name of a `tool`
result. Every role the request schema accepts maps to a template role here, so no role can
reach the engine unknown (it used to answer 500)."""

from __future__ import annotations

from typing import Literal

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]

_PROMPT_ROLE = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                "tool": "tool", "function": "tool"}


def prompt_role(role: str) -> str:
    """The chat-template role of an OpenAI message role."""
    return _PROMPT_ROLE[role]

"""agentmem: long, accurate memory for chatbots on a small model, with chunk-KV reuse."""

from __future__ import annotations

__all__ = ["AgentSession", "AsyncAgentSession"]


def __getattr__(name: str):
    # imported lazily so that `import agentmem` (and the CLI) stays instant
    if name == "AgentSession":
        from .session import AgentSession

        return AgentSession
    if name == "AsyncAgentSession":
        from .async_session import AsyncAgentSession

        return AsyncAgentSession
    raise AttributeError(f"module 'agentmem' has no attribute {name!r}")

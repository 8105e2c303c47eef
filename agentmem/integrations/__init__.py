"""Adapters for the places agents live, each a small module behind its own optional extra:

| module | what | extra |
|---|---|---|
| `mcp_server` | an MCP server (stdio, and streamable HTTP inside `agentmem serve`) | `agentmem[mcp]` |
| `openai_agents` | the OpenAI Agents SDK's `Session`, and a `recall_memory` tool | `agentmem[agents]` |
| `langgraph` | LangGraph's `BaseStore` | `agentmem[langgraph]` |

They call the same `AgentSession` / `MemoryStore` methods as the Python API and the REST
service; none of them holds memory logic of its own.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """Import a framework's package, or fail saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"this integration needs the {module!r} package: pip install 'agentmem[{extra}]'") from exc

"""The multi-tenant REST service: OpenAI-compatible chat completions with memory, memory and
session endpoints, metrics. `create_app(config, engine=None, store=None)` builds it;
`agentmem serve` runs it; `agentmem tenant create NAME` makes a tenant and prints its key.

Names are imported on first use, so `agentmem tenant` does not pay for FastAPI and torch."""

from __future__ import annotations

import importlib

_WHERE = {"Services": ".app", "create_app": ".app", "create_tenant_with_key": ".auth", "hash_key": ".auth",
          "new_key": ".auth", "Limits": ".limits"}

__all__ = ["Limits", "Services", "create_app", "create_tenant_with_key", "hash_key", "new_key"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name], __name__), name)

"""The multi-tenant REST service: OpenAI-compatible chat completions with memory, memory and
session endpoints, metrics. `create_app(config, engine=None, store=None)` builds it;
`agentmem serve` runs it; `agentmem tenant create NAME` makes a tenant and prints its key."""

from .app import Services, create_app
from .auth import create_tenant_with_key, hash_key, new_key
from .limits import Limits

__all__ = ["Limits", "Services", "create_app", "create_tenant_with_key", "hash_key", "new_key"]

"""An OpenAI Agents SDK agent whose model is `agentmem serve` and whose memory is agentmem's.

The user tells the agent a few things in one session (`AgentmemSession` keeps the SDK's
items and makes what they say the user's memory), then asks about them in a new, empty
session: the agent answers through `recall_memory`, agentmem's hybrid recall over every
session. The SDK's tracing export is off (it would post traces to the internet).

    pip install 'agentmem[agents]'
    agentmem tenant create demo          # prints an API key
    agentmem serve &                     # http://127.0.0.1:8000
    python examples/openai_agents_memory.py --base-url http://127.0.0.1:8000 --api-key am-... --user ana

The memory is written to agentmem's data directory (`--data-dir`, else AGENTMEM_DATA_DIR or
the default one); when it is the server's, the memory is that of the key's tenant, the same
one the server's own chat and memory endpoints use.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from pathlib import Path

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.exceptions import AgentsException
from openai import AsyncOpenAI

from agentmem.api.auth import hash_key
from agentmem.config import Config
from agentmem.integrations.openai_agents import AgentmemSession, recall_memory_tool
from agentmem.tiers import MemoryStore

TOLD = ["Hi! My dog is a greyhound called Pixel.", "My sister Marta moved to Montreal last month."]
ASKED = ["What is my dog called?", "Where does my sister live now?"]
INSTRUCTIONS = ("You are a friendly assistant with a long memory. Answer in one or two sentences. "
                "When a question is about the user, use what recall_memory returns.")


async def converse(agent: Agent, session: AgentmemSession, lines: list[str]) -> None:
    for line in lines:
        print(f"user: {line}")
        try:
            result = await Runner.run(agent, line, session=session, max_turns=3)
        except AgentsException as exc:  # a small model may loop on calls or run out of tokens in one
            print(f"agent: (no answer: {exc})\n")
            continue
        for item in result.new_items:
            if item.type == "tool_call_output_item":
                print("  recall_memory returned:\n    " + str(item.output).replace("\n", "\n    "))
        print(f"agent: {str(result.final_output).strip()}\n")


async def main(args: argparse.Namespace) -> None:
    set_tracing_disabled(True)
    store = MemoryStore(Config(data_dir=args.data_dir) if args.data_dir else Config())
    try:
        tenant = store.tenant_for_key_hash(hash_key(args.api_key)) or "default"
        model = OpenAIChatCompletionsModel(
            model="agentmem", openai_client=AsyncOpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key))
        settings = ModelSettings(max_tokens=args.max_tokens)
        chat = Agent(name="assistant", instructions=INSTRUCTIONS, model=model, model_settings=settings)
        # asked in a new session, the agent must look the answer up: its first model call has to
        # call recall_memory (the SDK lets it choose freely after that)
        recall = chat.clone(tools=[recall_memory_tool(args.user, tenant, store=store)],
                            model_settings=settings.resolve(ModelSettings(tool_choice="required")))
        run_id = uuid.uuid4().hex[:8]
        print(f"--- session 1 ({args.user}, tenant {tenant}): telling\n")
        await converse(chat, AgentmemSession(f"tell-{run_id}", args.user, tenant, store=store), TOLD)
        print("--- session 2, empty history: asking\n")
        await converse(recall, AgentmemSession(f"ask-{run_id}", args.user, tenant, store=store), ASKED)
    finally:
        store.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="where `agentmem serve` listens")
    p.add_argument("--api-key", required=True, help="a tenant's key (`agentmem tenant create NAME`)")
    p.add_argument("--user", default="ana", help="whose memory the agent keeps and recalls")
    p.add_argument("--data-dir", type=Path, help="agentmem's data directory (default: AGENTMEM_DATA_DIR or agentmem's own)")
    p.add_argument("--max-tokens", type=int, default=96, help="of each reply (a tool call takes up to ~70)")
    asyncio.run(main(p.parse_args()))

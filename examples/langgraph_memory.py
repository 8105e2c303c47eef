"""A LangGraph graph whose long-term memory is agentmem, with no LLM: one node stores what
the user says (`store.put`), the next answers a question with the best memory agentmem's
hybrid recall finds for it (`store.search`). Everything runs offline.

    pip install 'agentmem[langgraph]'
    python examples/langgraph_memory.py              # a fresh data directory each run
    python examples/langgraph_memory.py --data-dir ~/agentmem-demo   # memories kept between runs
"""

from __future__ import annotations

import argparse
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime

from agentmem.config import Config
from agentmem.integrations.langgraph import AgentmemStore

FACTS = ["I adopted a greyhound called Pixel last spring",
         "My sister Marta moved to Montreal for her new job",
         "On Sundays I play the cello with a small orchestra"]
QUESTIONS = ["What is my dog's name?", "Where does Marta live now?", "Which instrument do I play?"]


@dataclass
class Context:
    user_id: str


class State(TypedDict, total=False):
    said: str
    question: str
    answer: str


def remember(state: State, runtime: Runtime[Context]) -> State:
    if state.get("said"):
        runtime.store.put(("memories", runtime.context.user_id), uuid.uuid4().hex, {"text": state["said"]})
    return {}


def answer(state: State, runtime: Runtime[Context]) -> State:
    if not state.get("question"):
        return {}
    hits = runtime.store.search(("memories", runtime.context.user_id), query=state["question"], limit=1)
    return {"answer": hits[0].value["text"] if hits else "I don't know yet."}


def build(store: AgentmemStore):
    graph = StateGraph(State, context_schema=Context)
    graph.add_node(remember)
    graph.add_node(answer)
    graph.add_edge(START, "remember")
    graph.add_edge("remember", "answer")
    graph.add_edge("answer", END)
    return graph.compile(store=store)


def run(store: AgentmemStore, user_id: str = "ana") -> list[tuple[str, str]]:
    """Tell the graph the facts, then ask it the questions: (question, answer) pairs."""
    graph = build(store)
    for fact in FACTS:
        graph.invoke({"said": fact}, context=Context(user_id))
    return [(q, graph.invoke({"question": q}, context=Context(user_id))["answer"]) for q in QUESTIONS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=None, help="agentmem's data directory (default: a new one)")
    args = parser.parse_args()
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="agentmem-langgraph-"))
    store = AgentmemStore("default", config=Config(data_dir=data_dir))
    try:
        for question, reply in run(store):
            print(f"{question}\n  -> {reply}")
    finally:
        store.close()


if __name__ == "__main__":
    main()

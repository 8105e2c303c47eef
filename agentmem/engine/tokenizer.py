"""Tokenizer and chat format, both taken from the checkpoint.

The chat template is rendered once per role around a sentinel to learn the text that wraps a
message. Every message can then be formatted on its own, which is what lets the memory
assembler tokenize each segment separately and still produce exactly the ids the template
would (the chunk-KV convention of the design).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_SENTINEL = "\x00AGENTMEM\x00"


@dataclass(frozen=True)
class ChatFormat:
    wraps: dict[str, tuple[str, str]]  # role -> (prefix, suffix)
    generation_prefix: str

    def message(self, role: str, content: str) -> str:
        if role not in self.wraps:
            raise ValueError(f"unknown chat role {role!r}; expected one of {sorted(self.wraps)}")
        pre, post = self.wraps[role]
        return pre + content + post


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def chat_format(tokenizer) -> ChatFormat:
    if not getattr(tokenizer, "chat_template", None):
        wraps = {r: (f"{r}: ", "\n") for r in ("system", "user", "assistant", "tool")}
        return ChatFormat(wraps, "assistant: ")

    def render(msgs, gen=False) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    base = [{"role": "system", "content": "S"}]
    head = render(base)
    wraps = {}
    for role in ("system", "user", "assistant"):
        full = render(base + [{"role": role, "content": _SENTINEL}])
        pre, post = full[len(head):].split(_SENTINEL)
        wraps[role] = (pre, post)
    wraps["tool"] = wraps["user"]
    with_user = base + [{"role": "user", "content": "u"}]
    gen = render(with_user, gen=True)[len(render(with_user)):]
    return ChatFormat(wraps, gen)

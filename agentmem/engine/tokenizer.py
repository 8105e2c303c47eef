"""Tokenizer and chat format, both taken from the checkpoint.

The chat template is rendered once per role around a sentinel to learn the text that wraps a
message. Every message can then be formatted on its own, which is what lets the memory
assembler tokenize each segment separately and still produce exactly the ids the template
would (the chunk-KV convention of the design). The system wrap is learned from a system
message that comes first, so whatever the template puts before the first message (a BOS
token, Llama 3.1's date lines) is part of it. A sample conversation then checks that the
wrapped messages, concatenated, are what the template renders (`round_trips`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_SENTINEL = "\x00AGENTMEM\x00"
# what the round-trip check renders: the shape assemble.py gives every prompt
_SAMPLE = [("system", "You are brief."), ("user", "Hi there"), ("assistant", "Hello!"), ("user", "And now?")]


@dataclass(frozen=True)
class ChatFormat:
    wraps: dict[str, tuple[str, str]]  # role -> (prefix, suffix)
    generation_prefix: str
    round_trips: bool = True  # a system-first conversation, message by message, equals the template's text

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
    wraps = {"system": tuple(render([{"role": "system", "content": _SENTINEL}]).split(_SENTINEL))}
    for role in ("user", "assistant"):
        full = render(base + [{"role": role, "content": _SENTINEL}])
        pre, post = full[len(head):].split(_SENTINEL)
        wraps[role] = (pre, post)
    wraps["tool"] = wraps["user"]
    with_user = base + [{"role": "user", "content": "u"}]
    gen = render(with_user, gen=True)[len(render(with_user)):]
    fmt = ChatFormat(wraps, gen)
    sample = [{"role": r, "content": c} for r, c in _SAMPLE]
    ours = "".join(fmt.message(r, c) for r, c in _SAMPLE) + gen
    return ChatFormat(wraps, gen, round_trips=ours == render(sample, gen=True))


def stop_ids(tokenizer, chat: ChatFormat, config_eos: int | list[int] | None, path: Path | None = None) -> set[int]:
    """Every id that ends a reply: the config's EOS (one or a list), the generation config's
    (Llama 3 lists <|eot_id|> there), the tokenizer's EOS, and the special token that closes
    an assistant turn in the chat template (<|im_end|>, <|eot_id|>, </s>)."""
    ids: set[int] = set()

    def add(eos) -> None:
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    add(config_eos)
    gen_config = Path(path) / "generation_config.json" if path is not None else None
    if gen_config is not None and gen_config.is_file():
        add(json.loads(gen_config.read_text()).get("eos_token_id"))
    add(tokenizer.eos_token_id)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    end_of_turn = tokenizer.encode(chat.wraps["assistant"][1], add_special_tokens=False)
    if end_of_turn and end_of_turn[0] in special:
        ids.add(end_of_turn[0])
    return ids

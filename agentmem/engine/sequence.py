"""One request as the scheduler sees it: its tokens, its KV blocks, and where its output goes."""

from __future__ import annotations

import itertools
import queue
import time
from dataclasses import dataclass, field

import torch

from .detokenize import ReplyText
from .repetition import LoopDetector
from .sampler import SamplingParams, copy_index

_ids = itertools.count()


@dataclass
class Sequence:
    token_ids: list[int]  # prompt, then each generated token as it is sampled
    params: SamplingParams
    max_new: int  # tokens it may generate (max_tokens capped by the context window)
    salt: str = ""  # prefix blocks are shared only between sequences with the same salt (namespace)
    parts: list | None = None  # tokenized segments, for a prefill planner
    id: int = field(default_factory=lambda: next(_ids))
    prompt_len: int = 0
    num_computed: int = 0  # leading tokens whose K/V is in the pool
    num_cached: int = 0  # of those, how many came from shared prefix blocks
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hash of each full, registered block
    key_slots: object | None = None  # block_manager.KeySlots: the slots of its keys, kept between steps
    shareable: bool = True  # False when a planner filled the KV (approximate, so never shared)
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # str pieces, then a Generation or an exception
    generator: torch.Generator | None = None
    cancelled: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    ttft_s: float = 0.0
    reused: int = 0
    recomputed: int = 0
    prefilled: int = 0
    segments: list[dict] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of `text` already sent
    # the reply's text and its loop-settled head, decoded a tail at a time (detokenize.py)
    reply_text: ReplyText | None = None
    head_text: ReplyText | None = None
    matcher: object | None = None  # grammar.Matcher when params.grammar is set
    loops: LoopDetector = field(default_factory=LoopDetector)
    loop_ban: set[int] = field(default_factory=set)  # tokens of a cycle a grammar-bound reply fell into
    # under a grammar: where the reply last could have ended (tokens, characters; 0 before any
    # such point) and the longest stretch between two such points (one item: a tool call)
    complete_at: tuple[int, int] = (0, 0)
    longest_item: int = 0
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    _prompt_set: torch.Tensor | None = None
    copies: dict[tuple[int, ...], set[int]] = field(default_factory=dict)  # sampler.copy_index of the params

    def __post_init__(self) -> None:
        self.prompt_len = len(self.token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.params.copy_ngram:
            self.copies = copy_index(self.params.copy_sources, self.params.copy_ngram)

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def prompt_set(self) -> torch.Tensor:
        """The distinct prompt token ids (the repetition penalty reads them every step)."""
        if self._prompt_set is None:
            self._prompt_set = torch.tensor(self.token_ids[: self.prompt_len], dtype=torch.long).unique()
        return self._prompt_set

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed

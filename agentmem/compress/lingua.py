"""LLMLingua running on the engine's own model and tokenizer, fully offline.

`llmlingua.PromptCompressor.__init__` loads a model from a hub and fetches tiktoken's
vocabulary over the network. We bypass it: the compressor is built around the already
loaded engine, with a token counter on our own tokenizer in place of tiktoken. The only
thing LLMLingua asks of the model is `model(ids, attention_mask=, past_key_values=,
use_cache=True)` returning `.logits` and `.past_key_values` in the legacy layout (a list of
per-layer `[k, v]`, each `[1, heads, T, head_dim]`), which it slices and concatenates
itself. transformers 5 models return `Cache` objects that do not support that, so
`EngineLM` answers the call with our own forward and keeps the legacy layout.

K is cached after RoPE at the positions the tokens had when they were computed, and new
tokens are placed right after the cache, exactly as an HF causal LM does: LLMLingua drops
tokens from the cache between iterations and relies on that behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from llmlingua import PromptCompressor

from ..engine import Engine, attend
from ..engine.threads import TRACE_LOCK


@dataclass
class LMOutput:
    logits: torch.Tensor  # [1, n, V] fp32
    past_key_values: list[list[torch.Tensor]]


class EngineLM:
    """The slice of the HF causal-LM call signature that LLMLingua uses, on `engine.model`."""

    def __init__(self, engine: Engine):
        self.engine = engine

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, attention_mask=None, past_key_values=None, use_cache=True
    ) -> LMOutput:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(
                f"EngineLM runs one sequence at a time, got input_ids of shape {tuple(input_ids.shape)}"
            )
        e = self.engine
        ids = input_ids[0].to(e.device)
        past = past_key_values or []
        p = past[0][0].shape[2] if past else 0
        n = ids.shape[0]
        q_pos = torch.arange(p, p + n, device=e.device)
        k_pos = torch.arange(p + n, device=e.device)
        new: list[list[torch.Tensor]] = []

        def attn(i, q, k_raw, k_rot, v):
            k_all, v_all = k_rot, v
            if past:
                k_all = torch.cat([past[i][0][0].transpose(0, 1).to(k_rot.dtype), k_rot])
                v_all = torch.cat([past[i][1][0].transpose(0, 1).to(v.dtype), v])
            new.append([k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None]])
            return attend(q, k_all, v_all, q_pos, k_pos)

        with TRACE_LOCK.shared():  # engine/threads.py
            logits = e.model(ids, q_pos, attn)
        return LMOutput(logits[None], new)


class TokenCounter:
    """Stands in for the tiktoken encoder LLMLingua uses for its reported token counts."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)


class EngineCompressor(PromptCompressor):
    """`PromptCompressor` (LLMLingua / LongLLMLingua) bound to a loaded engine."""

    def __init__(self, engine: Engine):
        # not super().__init__(): it would download a model and the tiktoken vocabulary
        self.model_name = engine.model_id
        self.use_llmlingua2 = False
        self.retrieval_model = None
        self.retrieval_model_name = None
        self.open_api_config = {}
        self.cache_bos_num = 10
        self.prefix_bos_num = 100
        self.oai_tokenizer = TokenCounter(engine)
        self.tokenizer = engine.tokenizer
        self.model = EngineLM(engine)
        self.device = engine.device
        self.context_idxs = []
        self.max_position_embeddings = engine.context_window
        vocab = engine.tokenizer.convert_ids_to_tokens(list(range(len(engine.tokenizer))))
        self.digit_tokens = torch.tensor(
            [any(ch.isdigit() for ch in t or "") for t in vocab], device=engine.device
        )
        # a token continues the word before it when it starts with a letter or digit and no
        # space marker (byte-level BPE writes a leading space as "Ġ", a newline as "Ċ")
        self.continues_word = torch.tensor(
            [bool(t) and t[0].isalnum() and t[0] not in "ĠĊ" for t in vocab], device=engine.device
        )

    def whole_words(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Keep every token of a word of which any token is kept: half a word ("Sub" of
        "Subaru") is a new, wrong word, and its first token usually carries the surprise."""
        starts = ~self.continues_word[ids]
        starts[0] = True
        word = torch.cumsum(starts.long(), 0) - 1
        kept = torch.zeros(int(word[-1]) + 1, dtype=torch.long, device=ids.device)
        kept.scatter_reduce_(0, word, keep.long(), reduce="amax")
        return kept[word].bool()

    def protected(self, ids: torch.Tensor) -> torch.Tensor:
        """Tokens that are never dropped: numbers (each digit is its own token here, so
        dropping one rewrites the number) and the token that introduces one."""
        d = self.digit_tokens[ids]
        before = torch.zeros_like(d)
        before[:-1] = d[1:]
        return d | before

    def get_compressed_input(
        self,
        loss,
        input_ids,
        attention_mask,
        end=200,
        iterative_size=200,
        threshold=0.5,
        keep_flag=None,
        split_token_id: int = 13,
        start: int = 0,
        self_loss=None,
        self_input_ids=None,
        self_attention_mask=None,
    ):
        """Keep a token when *it* is surprising, and keep words whole.

        `loss[j]` is the surprise of token j+1; the stock method judges token j by it, which on
        short memories drops exactly the names and numbers that carry the fact ("My dog's name
        is Rex" -> "My's is"). Numbers are always kept, and a word is kept or dropped as a
        whole. The question-conditioned path keeps the stock rule.
        """
        if self_loss is not None:
            return super().get_compressed_input(
                loss,
                input_ids,
                attention_mask,
                end,
                iterative_size,
                threshold,
                keep_flag,
                split_token_id,
                start,
                self_loss,
                self_input_ids,
                self_attention_mask,
            )
        ids = input_ids[attention_mask == 1]
        n, m = ids.shape[0], loss.shape[0]
        keep = torch.ones(n, dtype=torch.bool, device=ids.device)
        lo, hi = max(end - iterative_size, 1), min(end, m + 1)
        if hi > lo:
            keep[lo:hi] = loss[lo - 1 : hi - 1] > threshold
        keep = self.whole_words(ids, keep | self.protected(ids))
        if keep_flag is not None:
            keep |= keep_flag[:n] == 1
            keep_flag = keep_flag[:n][keep]
        loss = loss[keep[1 : m + 1]]
        end -= int((~keep[:end]).sum())
        ones = torch.ones(1, int(keep.sum()), dtype=attention_mask.dtype, device=ids.device)
        return ids[keep][None], ones, keep_flag, end, loss, None, None, None

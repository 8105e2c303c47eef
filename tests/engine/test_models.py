"""Every supported model family against HF transformers in fp32, offline: each is a tiny model
built from its transformers config with seeded random weights and the family's options on
(llama3 RoPE scaling with a 64-token original context, so the scaling acts within 300
tokens; Qwen2's q/k/v biases; Qwen3's q/k norms and a head_dim that is not hidden/heads;
Mistral's sliding window of 48), saved to a temp dir with a small trained byte-level BPE
tokenizer and the family's chat template, and loaded by the engine like any user model."""

from __future__ import annotations

import json

import pytest
import torch

from agentmem.config import Config
from agentmem.engine import Engine, EngineLoop, SamplingParams, Segment, UnsupportedModel
from agentmem.engine.sequence import Sequence
from agentmem.kvreuse import ChunkReuse, place_k
from agentmem.kvreuse.fuser import Piece, fuse

CORPUS = [
    "The harbour master remembered the winter storms of that year.",
    "A young baker wrote down a recipe for rye bread on day 12.",
    "What is my cat called? Where does my sister live? Which instrument am I learning?",
    "My cat is called Miso and she is four years old. I moved to Lyon last spring.",
]
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
           "{% elif m['role'] == 'system' %}{{ m['content'] }}\n\n{% else %}{{ m['content'] }}{{ eos_token }}"
           "{% endif %}{% endfor %}")
TEMPLATES = {  # template, special tokens, bos, eos (the config's), end of turn (the template's)
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"], "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"),
    "chatml": (CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|endoftext|>", "<|im_end|>"),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "</s>"),
}
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, max_position_embeddings=512)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}
# name -> (config class, its options, template, the same weights without the option (class, changes))
FAMILIES = {
    "llama3": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                   tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE), "llama3",
               ("LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))),
    "llama-linear": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                         rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}),
                     "llama3", ("LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}))),
    "llama-dynamic": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                                          rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                           "rope_theta": 10000.0}),
                      "llama3", None),
    "llama-bias": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                       tie_word_embeddings=False), "llama3", ("LlamaConfig", dict(attention_bias=False))),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True), "chatml",
              ("LlamaConfig", {})),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  tie_word_embeddings=False), "chatml", ("LlamaConfig", {})),
    "mistral": ("MistralConfig", dict(num_attention_heads=8, num_key_value_heads=2, sliding_window=48,
                                      tie_word_embeddings=False), "mistral", ("MistralConfig", dict(sliding_window=None))),
}


def build_tokenizer(template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    chat_template, specials, bos, eos, _ = TEMPLATES[template]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, chat_template=chat_template)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits spread over several units (HF's init gives near-zero
    logits, where any error would pass an absolute tolerance), norms and biases not trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.15 * noise)


def hf_config(cls_name: str, vocab: int, tok, **kw):
    import transformers

    base = dict(SMALL, vocab_size=vocab, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id)
    return getattr(transformers, cls_name)(**(base | kw))


class Tiny:
    def __init__(self, name: str, path, hf, engine: Engine, tok):
        self.name, self.path, self.hf, self.engine, self.tok = name, path, hf, engine, tok

    def ids(self, n: int, seed: int = 0) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.hf.config.vocab_size, (n,), generator=g).tolist()

    def hf_logits(self, ids: list[int], model=None) -> torch.Tensor:
        with torch.no_grad():
            return (model or self.hf)(torch.tensor([ids])).logits[0]


def load(path, **kw) -> Engine:
    return Engine.load(Config(model_path=path, dtype="float32", device="cpu", kv_mode="full", **kw))


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory) -> Tiny:
    from transformers import AutoModelForCausalLM

    name = request.param
    cls_name, options, template, _ = FAMILIES[name]
    tok = build_tokenizer(template)
    path = tmp_path_factory.mktemp(name)
    cfg = hf_config(cls_name, len(tok), tok, **options)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(hf, seed=sorted(FAMILIES).index(name))
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    return Tiny(name, path, hf.eval(), load(path), tok)


def test_logits_match_hf_on_300_tokens(tiny):
    ids = tiny.ids(300)
    ref = tiny.hf_logits(ids)
    ours = tiny.engine.logits(ids)
    assert ref.std() > 1.0  # logits that spread: an absolute tolerance means something
    assert (ours - ref).abs().max().item() <= 1e-4


def test_the_family_option_changes_the_logits(tiny):
    """The option under test acts within the test's 300 tokens: the same weights without it
    (default RoPE, no biases, no q/k norms, no window) give other logits. Dynamic NTK acts
    only past max_position_embeddings, the end of the engine's window: there it is the
    default RoPE, so its oracle equals the plain model."""
    import transformers

    from agentmem.engine.models import model_args

    cls_name, options, _, plain = FAMILIES[tiny.name]
    ids = tiny.ids(300)
    ref = tiny.hf_logits(ids)
    changes = plain[1] if plain else {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    cfg = hf_config((plain or (cls_name,))[0], len(tiny.tok), tiny.tok,
                    **({k: v for k, v in options.items() if k != "rope_parameters"} | changes))
    other = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    other.load_state_dict(tiny.hf.state_dict(), strict=False)
    gap = (tiny.hf_logits(ids, other) - ref).abs().max().item()
    if plain is None:
        assert gap <= 1e-5
        assert model_args(tiny.path).rope_scaling["rope_type"] == "dynamic"
    else:
        assert gap > 1e-2


def test_greedy_32_tokens_equal_hf_generate(tiny):
    ids = tiny.ids(20, seed=1)
    ours = tiny.engine.generate(ids, max_tokens=32, ignore_eos=True).token_ids
    with torch.no_grad():
        ref = tiny.hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert ours == ref[0, len(ids):].tolist()


def drive(engine: Engine, loop: EngineLoop, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Every prompt admitted at once and stepped in this thread: decode steps are batched."""
    seqs = [Sequence(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True).validate(), max_tokens)
            for p in prompts]
    for s in seqs:
        loop.scheduler.add(s)
    while loop.scheduler.has_work():
        loop.step()
    return [s.generated for s in seqs]


def test_batched_decode_equals_one_by_one(tiny):
    e = tiny.engine
    prompts = [tiny.ids(n, seed=n) for n in (5, 30, 70)]  # 70 + 12 passes Mistral's window of 48
    alone = [e.generate(p, max_tokens=12, ignore_eos=True).token_ids for p in prompts]
    loop = EngineLoop(e, pool_tokens=1024)
    assert drive(e, loop, prompts, 12) == alone
    assert loop.steps == 12  # one prefill step, then every decode step shared


def chunks(tiny: Tiny) -> list[Segment]:
    return [Segment(text) for text in CORPUS]


def test_chunk_reuse_at_ratio_one_equals_full_prefill(tiny, tmp_path):
    e = Engine(tiny.engine.model, tiny.engine.tokenizer, tiny.engine.model_id, tiny.engine.device,
               Config(dtype="float32", device="cpu", kv_mode="blend", kv_disk_dir=tmp_path))
    reuse = ChunkReuse(e)
    assert reuse.precompute(chunks(tiny)) > 0
    prompt = [Segment(e.format_message("system", "Notes."))] + chunks(tiny)[::-1] + e.chat_segments(
        [{"role": "user", "content": "What is my cat called?"}])
    parts = e.tokenize_prompt(prompt)
    full = reuse.plan(parts, mode="full", store=False)
    one = reuse.plan(parts, mode="blend", ratio=1.0, store=False)
    assert one.recomputed > 0 and one.reused == 0
    assert torch.equal(one.last_logits, full.last_logits)
    ref = tiny.hf_logits([t for p in parts for t in p[0]])[-1]
    assert (full.last_logits - ref).abs().max().item() <= 1e-4
    blended = reuse.plan(parts, mode="blend", ratio=0.15, store=False)
    assert blended.reused > 0 and (blended.last_logits - full.last_logits).abs().max() > 0


def test_cached_keys_are_rerotated_with_the_models_own_rope(tiny):
    """Pre-RoPE keys computed at positions 0.. and moved to 200.. equal the keys a prefill
    computes there (layer 0, where K depends on the token alone): scaling included."""
    m = tiny.engine.model
    ids = tiny.ids(40, seed=3)
    at0 = fuse(m, ids, [Piece(0, 40)], "full", keep_raw=True)
    filler = tiny.ids(200, seed=4)
    later = fuse(m, filler + ids, [Piece(0, 240)], "full")
    moved = place_k(m, at0.new_k_raw[:1], torch.arange(200, 240))
    assert (moved[0] - later.k[0, 200:]).abs().max().item() <= 1e-5


def test_a_reused_prefix_equals_recomputing_it(tiny, tmp_path):
    e = Engine(tiny.engine.model, tiny.engine.tokenizer, tiny.engine.model_id, tiny.engine.device,
               Config(dtype="float32", device="cpu", kv_mode="blend", kv_disk_dir=tmp_path))
    reuse = ChunkReuse(e)
    segs = [Segment(e.format_message("system", CORPUS[0] + " " + CORPUS[2]))] + e.chat_segments(
        [{"role": "user", "content": CORPUS[1]}])
    parts = e.tokenize_prompt(segs)
    reuse.plan(parts)
    again = reuse.plan(parts)
    assert [s["how"] for s in again.segments][:2] == ["reused", "reused"]
    full = reuse.plan(parts, mode="full", store=False)
    assert (again.last_logits - full.last_logits).abs().max().item() <= 1e-4
    # the paged pool's shared prefix blocks: a second request on the same prefix decodes alike
    loop = EngineLoop(tiny.engine, pool_tokens=1024, block_size=4)
    ids = tiny.ids(60, seed=5)
    first = tiny.engine.generate(ids, max_tokens=8, ignore_eos=True, loop=loop).token_ids
    second = tiny.engine.generate(ids, max_tokens=8, ignore_eos=True, loop=loop).token_ids
    assert first == second == tiny.engine.generate(ids, max_tokens=8, ignore_eos=True).token_ids


def test_chat_format_round_trips_and_stops_on_the_end_of_turn(tiny):
    e = tiny.engine
    template = FAMILIES[tiny.name][2]
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "What is my cat called?"}]
    ours = [t for s in e.chat_segments(convo) for t in e.encode(s.text)]
    ref = tiny.tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    assert e.chat.round_trips
    assert ours == list(ref)
    _, _, _, eos, eot = TEMPLATES[template]
    assert {tiny.tok.convert_tokens_to_ids(eos), tiny.tok.convert_tokens_to_ids(eot)} <= e.eos_ids


# --- load-time errors ------------------------------------------------------------------------
def write_config(tmp_path, **cfg) -> None:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"")


def test_an_unknown_model_type_fails_at_load_naming_it_and_the_supported_ones(tmp_path):
    write_config(tmp_path, model_type="gpt_neox", hidden_size=64)
    with pytest.raises(UnsupportedModel) as err:
        load(tmp_path)
    assert "gpt_neox" in str(err.value)
    assert all(t in str(err.value) for t in ("llama", "mistral", "qwen2", "qwen3"))


@pytest.mark.parametrize("cls_name, option, named", [
    ("LlamaConfig", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "yarn"),
    ("LlamaConfig", dict(hidden_act="gelu"), "gelu"),
    ("LlamaConfig", dict(mlp_bias=True), "mlp_bias"),
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=32), "use_sliding_window"),
    ("Qwen3Config", dict(layer_types=["sliding_attention", "full_attention", "full_attention"], sliding_window=32), "layer_types"),
])
def test_an_unsupported_option_fails_at_load_naming_it(tmp_path, cls_name, option, named):
    import transformers

    cfg = getattr(transformers, cls_name)(**(SMALL | dict(vocab_size=64, num_attention_heads=4) | option))
    cfg.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the config fails first
    with pytest.raises(UnsupportedModel, match=named) as err:
        load(tmp_path)
    assert "supported" in str(err.value)


# --- GGUF ------------------------------------------------------------------------------------
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # as llama.cpp writes them


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The row order llama.cpp gives q/k of the llama architecture (interleaved RoPE halves);
    transformers' GGUF loader undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(tiny: Tiny, out) -> None:
    """Write the tiny model as llama.cpp's converter would (f32 tensors, its tensor names and
    metadata keys, llama3 scaling as a `rope_freqs` tensor, the BPE vocabulary and merges)."""
    import gguf

    from agentmem.engine.layers import rope_inv_freq

    c = tiny.hf.config
    model_type = c.model_type
    arch = GGUF_ARCH[model_type]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"{model_type.capitalize()} tiny test")  # as real files name themselves
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = dict(c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if getattr(c, "sliding_window", None) and model_type == "mistral":
        w.add_sliding_window(c.sliding_window)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for name, t in tiny.hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            t = llama_cpp_permute(t, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        w.add_tensor(tmap.get_name(name, try_suffixes=(".weight", ".bias")), t.float().contiguous().numpy())
    if rope["rope_type"] == "llama3":
        plain = rope_inv_freq(head_dim, rope["rope_theta"])
        w.add_tensor("rope_freqs.weight", (plain / rope_inv_freq(head_dim, rope["rope_theta"], rope)).float().numpy())
    tok = tiny.tok
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) for m in merges])
    if tok.bos_token_id is not None:
        w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_chat_template(tok.chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_same_model_as_gguf_loads_once_and_matches(tiny, tmp_path, monkeypatch):
    from agentmem.engine import weights

    path = tmp_path / f"{tiny.name}.gguf"
    write_gguf(tiny, path)
    e = load(path, cache_dir=tmp_path / "cache")
    ids = tiny.ids(300)
    assert (e.logits(ids) - tiny.hf_logits(ids)).abs().max().item() <= 1e-4
    ours, direct = e.model.args, tiny.engine.model.args
    for field in ("n_heads", "n_kv_heads", "head_dim", "tie_embeddings", "qkv_bias", "qk_norm", "sliding_window",
                  "rope_theta", "max_seq_len"):
        assert getattr(ours, field) == getattr(direct, field), field
    if direct.rope_scaling and direct.rope_scaling["rope_type"] != "dynamic":
        assert ours.rope_scaling == pytest.approx(direct.rope_scaling)
    assert e.chat == tiny.engine.chat and e.eos_ids >= tiny.engine.eos_ids
    prompt = tiny.ids(20, seed=1)
    assert (e.generate(prompt, max_tokens=8, ignore_eos=True).token_ids
            == tiny.engine.generate(prompt, max_tokens=8, ignore_eos=True).token_ids)
    # converted once, into the cache, under the file's hash: the next load only reads it
    (cached,) = [d for d in (tmp_path / "cache" / "models").iterdir() if d.is_dir() and d.name[0] != "."]
    assert cached.name == f"{tiny.name}-{weights.file_sha256(path)[:16]}"  # its SHA-256, recomputed here
    monkeypatch.setattr(weights, "dequantize_gguf", lambda *a: pytest.fail("converted twice"))
    assert load(path, cache_dir=tmp_path / "cache").model.args == ours


def test_a_gguf_of_another_architecture_fails_at_load_naming_it(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "gemma2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModel, match="gemma2") as err:
        load(tmp_path / "other.gguf", cache_dir=tmp_path / "cache")
    assert "llama" in str(err.value) and "qwen3" in str(err.value)


# --- the commands ----------------------------------------------------------------------------
def test_agentmem_models_lists_arch_params_context_dtype_and_format(tiny, tmp_path, monkeypatch, capsys):
    from agentmem.engine import models_cli

    gguf_path = tmp_path / f"{tiny.name}.gguf"
    write_gguf(tiny, gguf_path)
    monkeypatch.setenv("AGENTMEM_MODEL_PATH", str(tiny.path))
    monkeypatch.setenv("AGENTMEM_CACHE_DIR", str(tmp_path / "cache"))
    assert models_cli.main(["--json", "--no-load", str(gguf_path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["format"]: r for r in out["models"]}
    n_params = sum(p.numel() for p in tiny.hf.parameters())  # a tied head counted once
    checkpoint, gguf_row = rows["safetensors"], rows["gguf"]
    assert checkpoint["configured"] and out["configured"] == str(tiny.path)
    assert (checkpoint["arch"], checkpoint["params"], checkpoint["context"], checkpoint["dtype"]) == (
        tiny.hf.config.model_type, n_params, 512, "F32")
    assert checkpoint["supported"] == "yes"
    assert (gguf_row["arch"], gguf_row["params"], gguf_row["context"], gguf_row["dtype"]) == (
        GGUF_ARCH[tiny.hf.config.model_type], n_params, 512, "F32")


def test_bench_engine_runs_on_the_model_it_is_given(tiny, monkeypatch, capsys):
    from agentmem.bench import engine as bench

    monkeypatch.setattr(bench, "machine_figures", lambda dtype, device, fmt, rows_math="bf16": (1.0, 1.0, 1.0, 1.0))
    assert bench.main(["--model", str(tiny.path), "--json", "--dtype", "float32", "--prompt-tokens", "64",
                       "--new-tokens", "4", "--streams", "2", "--repeats", "1", "--batch-prompt-tokens", "40"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model"] == tiny.path.name and out["max_logit_err"] <= 1e-4
    assert type(tiny.hf).__name__ in out["peer"] and out["prefill_tok_s"] > 0
    assert out["decode_long_tok_s"] > 0 and out["hf_decode_long_tok_s"] > 0
    # the streams after a memory turn's worth of prompt each, and one stream after such a prompt
    assert out["batch_long_prompt_tokens"] == 40
    assert out["batch_long_decode_tok_s"] > 0 and out["batch_long_single_decode_tok_s"] > 0
    # the ratio is of the unrounded rates, the rates are printed to 0.1 tok/s: on a slow host (a
    # tiny model at a few tok/s) that rounding alone moves their quotient by more than 0.01
    batch, single = out["batch_long_decode_tok_s"], out["batch_long_single_decode_tok_s"]
    assert out["batch_long_speedup_vs_single"] == pytest.approx(
        batch / single, abs=0.006 + batch / single * (0.05 / single + 0.05 / batch))
    # int8's decode: the same figure when int8 is the format chosen, else its own engine's runs
    assert out["decode_tok_s_int8"] > 0
    assert (out["decode_tok_s_int8"] == out["decode_tok_s"]) == (out["weights"] == "int8")
    # one token a forward over the KV before it reads the text as one forward over all of it
    assert out["decode_perplexity"]["fp32"] == pytest.approx(out["perplexity"]["fp32"], rel=1e-3)
    assert out["decode_perplexity"]["int8"] == pytest.approx(out["perplexity"]["int8"], rel=0.05)


def test_rope_scaling_in_the_older_config_layout_is_read_too(tiny, tmp_path):
    """transformers 5 writes `rope_parameters`; checkpoints saved before it have
    `rope_scaling` and a top-level `rope_theta`. Both load to the same model."""
    if tiny.name not in ("llama3", "llama-linear"):
        pytest.skip("a scaled-RoPE family")
    conf = json.loads((tiny.path / "config.json").read_text())
    params = conf.pop("rope_parameters")
    conf["rope_theta"] = params.pop("rope_theta")
    conf["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(conf))
    for f in tiny.path.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    old = load(tmp_path)
    assert old.model.args == tiny.engine.model.args
    ids = tiny.ids(300)
    assert torch.equal(old.logits(ids), tiny.engine.logits(ids))

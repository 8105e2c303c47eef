"""The engine on a CUDA GPU: what the CPU's tests check, with the Triton kernels compiled and
running natively (RoPE, paged decode attention, the blend's selected-query attention) and the
decode step under CUDA graphs. Skipped, saying so, where no GPU is present (CI); run on the
lent GPU machine (README, "GPU")."""

from __future__ import annotations

import pytest
import torch

from agentmem.bench.blend import kl
from agentmem.config import Config
from agentmem.engine import Engine, Segment
from agentmem.engine.cuda_graph import GraphDecode
from agentmem.kvreuse import enable_chunk_reuse

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
FACTS = [
    "- 2024-03-02 the user said: \"My cat is called Miso and she is four years old.\"\n",
    "- 2024-04-11 the user said: \"I moved to Lyon last spring for a job at a bakery.\"\n",
    "- 2024-05-19 the user said: \"My sister Clara works as a pilot and lives in Porto.\"\n",
    "- 2024-06-23 the user said: \"I am learning the cello and practise every Tuesday.\"\n",
]


@pytest.fixture(scope="module")
def gpu32():
    return Engine.load(Config(dtype="float32", device="cuda", kv_mode="full", compile="off"))


def test_fp32_logits_on_the_gpu_match_the_cpu(engine, gpu32):
    assert gpu32.device.type == "cuda" and gpu32.dtype == torch.float32
    ids = engine.encode("The history of the lighthouse begins with fire on the shore. " * 30)[:300]
    cpu, gpu = engine.logits(ids), gpu32.logits(ids).cpu()
    assert cpu.shape == gpu.shape
    assert (cpu - gpu).abs().max().item() <= 1e-3


def test_paged_decode_on_the_gpu_gives_the_cpu_greedy_tokens(engine, gpu32):
    """64 greedy tokens through the paged pool and the Triton decode-attention kernel."""
    prompt = engine.chat_segments(STORY)
    assert gpu32.generate(prompt, max_tokens=64).token_ids == engine.generate(prompt, max_tokens=64).token_ids


def test_batched_gpu_decode_equals_one_by_one(gpu32):
    texts = ["Name three rivers in Europe.", "What is a haiku? Write one about rain.",
             "Explain photosynthesis to a child in a long, patient answer."]
    prompts = [gpu32.chat_segments([{"role": "user", "content": t}]) for t in texts]
    alone = [gpu32.generate(p, max_tokens=24).token_ids for p in prompts]
    streams = [gpu32.stream(p, max_tokens=24) for p in prompts]
    for s in streams:
        for _ in s:
            pass
    assert [s.result.token_ids for s in streams] == alone


def test_cuda_graph_decode_gives_the_eager_greedy_tokens(gpu32):
    """compile=on (and auto) on CUDA: the whole decode step replayed from a captured graph."""
    e = Engine(gpu32.model, gpu32.tokenizer, gpu32.model_id, gpu32.device,
               Config(dtype="float32", device="cuda", kv_mode="full", compile="on"))
    graphs = e.loop.runner.compiled
    assert isinstance(graphs, GraphDecode)
    prompt = e.chat_segments(STORY)
    got = e.generate(prompt, max_tokens=64).token_ids
    assert graphs.failed is None, graphs.failed
    assert (1, 16) in graphs.ready and graphs.compile_s > 0
    assert got == gpu32.generate(prompt, max_tokens=64).token_ids
    # three streams at once: a padded bucket of 4 rows
    texts = ["Name three rivers in Europe.", "What is a haiku? Write one about rain.",
             "Explain photosynthesis to a child in a long, patient answer."]
    prompts = [e.chat_segments([{"role": "user", "content": t}]) for t in texts]
    streams = [e.stream(p, max_tokens=24) for p in prompts]
    for s in streams:
        for _ in s:
            pass
    assert (4, 16) in graphs.ready
    assert [s.result.token_ids for s in streams] == [gpu32.generate(p, max_tokens=24).token_ids for p in prompts]


def test_blend_on_the_gpu_is_closer_to_full_than_reuse(tmp_path):
    """The blend's selected-query attention is the Triton kernel here."""
    base = Engine.load(Config(dtype="bfloat16", device="cuda", kv_mode="full", compile="off"))
    e = Engine(base.model, base.tokenizer, base.model_id, base.device,
               Config(dtype="bfloat16", device="cuda", kv_mode="blend", kv_disk_dir=tmp_path))
    reuse = enable_chunk_reuse(e)
    reuse.precompute([Segment(f, tier="recall") for f in FACTS])
    sys_open, sys_close = e.chat.wraps["system"]
    kls = {"reuse": [], "blend": []}
    for order, q in [([1, 0, 2], "What is my cat called?"), ([3, 2, 1, 0], "Where does my sister live?")]:
        segs = [Segment(f"{sys_open}You are a helpful assistant with notes about the user.\n", tier="system")]
        segs += [Segment(FACTS[i], tier="recall") for i in order]
        segs += [Segment(sys_close, tier="system"), Segment(e.format_message("user", q), tier="user"),
                 Segment(e.chat.generation_prefix, cacheable=False, tier="generation")]
        parts = e.tokenize_prompt(segs)
        full = reuse.plan(parts, mode="full", store=False)
        for mode in kls:
            r = reuse.plan(parts, mode=mode, store=False)
            assert r.reused > 0 and r.last_logits.is_cuda
            kls[mode].append(kl(full.last_logits, r.last_logits))
    assert sum(kls["blend"]) < sum(kls["reuse"])

"""The blend's quality on every attention route this machine offers (AGENTMEM_ATTN_KERNEL):
the same prompts, chunks precomputed and blended on that route, against full prefill on it.
The routes are the bf16 engine's (fp32 has one C route and SDPA, both fp32 throughout); a
route the CPU lacks is skipped, saying so. Loads the bf16 model once for the module (the
shared fixture is fp32)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from agentmem.bench.blend import build_prompts, kl
from agentmem.config import Config
from agentmem.engine import Engine
from agentmem.engine.kernels import cpu_bf16
from agentmem.kvreuse import ChunkReuse, ChunkStore

# AGENTMEM_ATTN_KERNEL -> what runs the causal attention of the prefill's and the blend's rows
ROUTES = {"on": "the vdpbf16ps rows kernel", "off": "torch SDPA in bf16", "fp32": "torch SDPA on rows widened to fp32",
          "amx": "the AMX tiles kernel"}
KL_SHARE = 0.3  # the blend's mean KL against full prefill at most this share of plain reuse's
TOP1 = 0.9  # the blend's next token is full prefill's on at least this share of the prompts


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "this CPU"


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    e = Engine.load(Config(dtype="bfloat16", device="cpu", kv_mode="blend",
                           kv_disk_dir=tmp_path_factory.mktemp("chunks")))
    # ~550-token prompts of 4 cached 128-token chunks (the default metric's query + drift regime);
    # measured on an AMD EPYC Zen 5 (bf16): KL 0.11-0.12x plain reuse's on each route, top-1 1.0
    prompts, memory = build_prompts(e, 5, 6, 4, 128, seed=3)
    return e, prompts, memory


def test_every_route_keeps_the_blend_close_to_full_prefill(bf16, monkeypatch, route):
    e, prompts, memory = bf16
    monkeypatch.setenv("AGENTMEM_ATTN_KERNEL", route)
    calls = {"kernel": 0, "amx": 0}
    for name, fn in (("kernel", "rows_attention"), ("amx", "rows_attention_amx")):
        real = getattr(cpu_bf16, fn)
        monkeypatch.setattr(cpu_bf16, fn, lambda *a, _r=real, _n=name, **kw: calls.__setitem__(_n, calls[_n] + 1)
                            or _r(*a, **kw))
    reuse = ChunkReuse(e, e.config, store=ChunkStore([("cpu", 1 << 30)]))
    reuse.precompute(memory)  # on this route too
    blend_kl, reuse_kl, top1 = [], [], []
    for prompt in prompts:
        parts = e.tokenize_prompt(prompt)
        full = reuse.plan(parts, mode="full", store=False).last_logits
        blended = reuse.plan(parts, mode="blend", store=False)
        assert blended.reused > 0 and blended.recomputed > 0
        blend_kl.append(kl(full, blended.last_logits))
        reuse_kl.append(kl(full, reuse.plan(parts, mode="reuse", store=False).last_logits))
        top1.append(float(int(blended.last_logits.argmax()) == int(full.argmax())))
    # the route asked for is the one that ran
    assert (calls["kernel"] > 0) == (route == "on") and (calls["amx"] > 0) == (route == "amx"), calls
    assert statistics.fmean(blend_kl) <= KL_SHARE * statistics.fmean(reuse_kl), (route, blend_kl, reuse_kl)
    assert statistics.fmean(top1) >= TOP1, (route, top1, blend_kl)


@pytest.fixture(params=list(ROUTES))
def route(request, bf16):
    name = request.param
    if bf16[0].dtype != torch.bfloat16:
        pytest.skip(f"the engine did not load in bf16 here ({bf16[0].dtype})")
    if name == "on" and cpu_bf16._lib is None:
        pytest.skip(f"{ROUTES[name]}: no bf16 C kernels on {cpu_name()} ({cpu_bf16.why_not})")
    if name == "amx" and not cpu_bf16.amx_usable(cpu_bf16._lib):
        pytest.skip(f"{ROUTES[name]}: {cpu_name()} has no AMX (amx_bf16/amx_tile), or Linux refused the tile state")
    return name

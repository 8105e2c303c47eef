"""Kernel micro-benchmark: each dispatcher against the torch path it replaces, same run,
same device, SmolLM2-135M head layout (9 query heads, 3 KV heads, head_dim 64).

`agentmem bench kernels --json`. On CUDA it times the Triton kernel and its
torch peer and reports the largest difference between them; without CUDA only the torch
side runs (the kernels exist for the GPU) and the kernel fields are null.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from ..engine.engine import attend
from ..engine.kernels import paged_decode_attention, paged_decode_attention_ref, rope, selected_attention
from ..engine.model import Rotary

HEADS, KV_HEADS, HD, BLOCK = 9, 3, 64, 16


def _time_ms(fn: Callable[[], torch.Tensor], device: torch.device, iters: int) -> float:
    fn()  # compile / warm up
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _cases(device: torch.device, dtype: torch.dtype, small: bool):
    """(name, kernel call, torch peer call) triples; the peer is what the engine runs without
    the kernel."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    n = 256 if small else 2048
    rotary = Rotary(HD, 100000.0).to(device)
    inv_freq = rotary.inv_freq.to(device)
    x, pos = rand(n, HEADS + KV_HEADS, HD), torch.arange(n, device=device)
    yield f"rope_{n}", lambda: rope(x, pos, inv_freq), lambda: rotary.apply(x, pos)

    for batch, ctx in ((8, 256), (32, 256)) if small else ((8, 1024), (64, 1024), (8, 4096)):
        blocks = ctx // BLOCK
        k_pool, v_pool = rand(batch * blocks, BLOCK, KV_HEADS, HD), rand(batch * blocks, BLOCK, KV_HEADS, HD)
        perm = torch.randperm(batch * blocks, generator=g).to(device)
        tables = perm.view(batch, blocks).int()
        lens = torch.randint(ctx // 2, ctx + 1, (batch,), generator=g).int().to(device)
        q = rand(batch, HEADS, HD)
        args = (q, k_pool, v_pool, tables, lens)
        yield (
            f"paged_decode_b{batch}_ctx{ctx}",
            lambda a=args: paged_decode_attention(*a),
            lambda a=args: paged_decode_attention_ref(*a),
        )

    ctx = 512 if small else 4096
    k, v = rand(ctx, KV_HEADS, HD), rand(ctx, KV_HEADS, HD)
    k_pos = torch.arange(ctx, device=device)
    for name, q_pos in (
        (f"prefill_{ctx}", k_pos),
        (f"blend15pct_{ctx}", torch.randperm(ctx, generator=g)[: ctx * 15 // 100].sort().values.to(device)),
    ):
        q = rand(len(q_pos), HEADS, HD)
        yield (
            name,
            lambda q=q, qp=q_pos: selected_attention(q, k, v, qp, k_pos),
            lambda q=q, qp=q_pos: attend(q, k, v, qp, k_pos),
        )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="agentmem bench kernels", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="tiny sizes, for a quick check")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    on_gpu = device.type == "cuda"
    result: dict = {"device": torch.cuda.get_device_name(device) if on_gpu else "cpu", "dtype": args.dtype}
    for name, kernel, peer in _cases(device, dtype, args.small):
        print(f"{name} ...", file=sys.stderr)
        torch_ms = _time_ms(peer, device, args.iters)
        result[f"{name}_torch_ms"] = round(torch_ms, 4)
        if on_gpu:
            triton_ms = _time_ms(kernel, device, args.iters)
            result[f"{name}_triton_ms"] = round(triton_ms, 4)
            result[f"{name}_speedup"] = round(torch_ms / triton_ms, 2)
            result[f"{name}_max_err"] = float((kernel().float() - peer().float()).abs().max())
        else:
            result[f"{name}_triton_ms"] = None
    if not args.json:
        for key, value in result.items():
            print(f"{key:>36}: {value}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

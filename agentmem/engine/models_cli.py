"""`agentmem models`: provision the configured model (the default GGUF is dequantized once,
with a progress bar) and describe it, with the time a load of its weights and tokenizer takes."""

from __future__ import annotations

import argparse
import json
import time

from ..config import Config
from .weights import resolve_model_dir


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="agentmem models", description=__doc__)
    ap.add_argument("--no-load", action="store_true", help="only provision; do not time a load")
    args = ap.parse_args(argv)
    cfg = Config()
    path = resolve_model_dir(cfg.model_path, cfg.cache_dir)
    conf = json.loads((path / "config.json").read_text())
    info = {"path": str(path), "model_type": conf.get("model_type"), "layers": conf.get("num_hidden_layers"),
            "hidden": conf.get("hidden_size"), "context": conf.get("max_position_embeddings")}
    if not args.no_load:
        from .engine import pick_device, pick_dtype
        from .model import load_transformer
        from .tokenizer import load_tokenizer

        device = pick_device(cfg.device)
        dtype = pick_dtype(cfg.dtype, device)
        t0 = time.perf_counter()
        load_transformer(path, dtype, device)
        t1 = time.perf_counter()
        load_tokenizer(path)  # most of it is importing transformers
        t2 = time.perf_counter()
        info |= {"dtype": str(dtype).removeprefix("torch."), "weights_load_s": round(t1 - t0, 2),
                 "tokenizer_load_s": round(t2 - t1, 2), "load_s": round(t2 - t0, 2)}
    print(json.dumps(info, indent=2))
    return 0

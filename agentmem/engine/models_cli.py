"""`agentmem models`: provision and describe the configured model."""

from __future__ import annotations

import argparse
import json

from ..config import Config
from .weights import resolve_model_dir


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="agentmem models", description=__doc__)
    ap.parse_args(argv)
    cfg = Config()
    path = resolve_model_dir(cfg.model_path, cfg.cache_dir)
    conf = json.loads((path / "config.json").read_text())
    print(json.dumps({"path": str(path), "model_type": conf.get("model_type"),
                      "layers": conf.get("num_hidden_layers"), "hidden": conf.get("hidden_size"),
                      "context": conf.get("max_position_embeddings")}, indent=2))
    return 0

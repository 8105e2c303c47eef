"""`agentmem models`: the models this machine has, and the configured one provisioned.

Lists the configured model (AGENTMEM_MODEL_PATH, else the default GGUF, dequantized once
with a progress bar), every checkpoint in the cache (dequantized GGUFs included) and any
PATH given, each with its architecture, parameters, context window, stored dtype and weight
format, read from the files' headers without loading a tensor, and whether the engine runs
it (an unsupported model_type or option is named). The configured model's load is timed
unless --no-load.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from collections import Counter
from pathlib import Path

from ..config import Config
from .errors import UnsupportedModel
from .weights import DEFAULT_MODEL_ID, WeightsMissing, default_gguf, resolve_model_dir

COLUMNS = ("name", "arch", "params", "context", "dtype", "format", "supported", "path")


def _safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file: tensor name -> dtype, shape, offsets."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _supported(path: Path) -> str:
    from .models import model_args

    try:
        model_args(path)
    except UnsupportedModel as e:
        return f"no: {e}"
    return "yes"


def describe_dir(path: Path) -> dict:
    """An HF checkpoint directory, from config.json and the safetensors headers."""
    conf = json.loads((path / "config.json").read_text())
    tensors = [t for f in sorted(path.glob("*.safetensors")) for t in _safetensors_header(f).values()]
    params = sum(_numel(t["shape"]) for t in tensors)
    dtypes = Counter(t["dtype"] for t in tensors)
    source = path / "source.json"  # written by dequantize_gguf
    fmt = "safetensors"
    if source.is_file() or path.name == DEFAULT_MODEL_ID:
        fmt = "safetensors, dequantized from GGUF"
    return {"name": path.name, "arch": conf.get("model_type"), "params": params,
            "context": conf.get("max_position_embeddings"), "dtype": "/".join(d for d, _ in dtypes.most_common()),
            "format": fmt, "supported": _supported(path), "path": str(path)}


def describe_gguf(path: Path) -> dict:
    """A GGUF file, from its metadata and tensor table (the weights are not read)."""
    from gguf import GGUFReader

    from .weights import GGUF_ARCHS

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    ctx = reader.fields.get(f"{arch}.context_length")
    kinds = Counter(t.tensor_type.name for t in reader.tensors)
    params = sum(int(t.n_elements) for t in reader.tensors if not t.name.startswith("rope_freqs"))  # a RoPE table
    return {"name": path.stem, "arch": arch, "params": params,
            "context": ctx.contents() if ctx is not None else None,
            "dtype": "/".join(k for k, _ in kinds.most_common()), "format": "gguf",
            "supported": "yes (converted on first use)" if arch in GGUF_ARCHS
            else f"no: GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHS)})", "path": str(path)}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def describe(path: Path) -> dict:
    path = Path(path).expanduser()
    return describe_gguf(path) if path.suffix == ".gguf" else describe_dir(path)


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="agentmem models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", type=Path, help="more checkpoint directories or .gguf files to describe")
    ap.add_argument("--json", action="store_true", help="print a JSON object (models, configured) instead of a table")
    ap.add_argument("--no-load", action="store_true", help="do not time a load of the configured model")
    args = ap.parse_args(argv)
    cfg = Config()
    rows: list[dict] = []
    try:
        configured = resolve_model_dir(cfg.model_path, cfg.cache_dir)
    except (WeightsMissing, UnsupportedModel) as e:
        print(f"agentmem models: the configured model is not usable: {e}", file=sys.stderr)
        configured = None
    seen: set[Path] = set()
    cache = Path(cfg.cache_dir).expanduser() / "models"
    candidates = ([configured] if configured else []) + sorted(p for p in cache.glob("*") if p.is_dir()) + args.paths
    if cfg.model_path is None:
        try:
            candidates.append(default_gguf())  # the installed package's file itself
        except WeightsMissing:
            pass
    for p in candidates:
        p = Path(p).expanduser().resolve()
        if p in seen or not (p.suffix == ".gguf" or (p / "config.json").is_file()):
            continue
        seen.add(p)
        row = describe(p)
        row["configured"] = configured is not None and p == Path(configured).resolve()
        rows.append(row)
    timing: dict = {}
    if configured is not None and not args.no_load:
        from .engine import pick_device, pick_dtype
        from .model import load_transformer
        from .tokenizer import load_tokenizer

        device = pick_device(cfg.device)
        dtype = pick_dtype(cfg.dtype, device)
        t0 = time.perf_counter()
        load_transformer(configured, dtype, device)
        t1 = time.perf_counter()
        load_tokenizer(configured)  # most of it is importing transformers
        t2 = time.perf_counter()
        timing = {"dtype": str(dtype).removeprefix("torch."), "weights_load_s": round(t1 - t0, 2),
                  "tokenizer_load_s": round(t2 - t1, 2), "load_s": round(t2 - t0, 2)}
    if args.json:
        print(json.dumps({"models": rows, "configured": str(configured) if configured else None, "load": timing}))
        return 0
    table = [[("* " if r["configured"] else "  ") + r["name"], str(r["arch"]), _human(r["params"]), str(r["context"]),
              r["dtype"], r["format"], r["supported"], r["path"]] for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(COLUMNS)]
    print("  ".join(h.upper().ljust(w) for h, w in zip(COLUMNS, widths, strict=True)))
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)))
    if timing:
        print(f"\n* configured; loaded in {timing['load_s']} s as {timing['dtype']} "
              f"(weights {timing['weights_load_s']} s, tokenizer {timing['tokenizer_load_s']} s)")
    return 0

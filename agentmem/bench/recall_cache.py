"""`agentmem bench recall-cache`: resident memory of one process after serving 10,000 users.

Each user gets a message (committed, embedded, indexed) and a search, once, as a service sees
a long tail of users. With the recall cache bounded (`AGENTMEM_RECALL_CACHE_MB`) the
process's resident size stays flat; the peer, in the same run, is the same loop with the
bound lifted (every index kept, as before the bound existed). Each arm runs in a fresh
process so that neither inherits the other's heap. Prints JSON last.

`--embedder hash` (the default) embeds with `HashEmbedder`: 384-d vectors from the words,
the size MiniLM's are, so each user's index weighs what it would, without a model's
seconds per user (10,000 users through MiniLM take hours on a shared 2-core machine; the
model's own weights are a constant part of the resident size, not a growing one).
`--embedder model` uses the real embedder.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


class HashEmbedder:
    """Deterministic 384-d unit vectors from the text's words (no model)."""

    dim = 384

    def __init__(self):
        self.texts = 0  # how many texts it embedded

    def embed(self, texts: list[str], owner: str = "") -> np.ndarray:
        import hashlib

        self.texts += len(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            for w in t.lower().split():
                out[i, int(hashlib.blake2b(w.encode(), digest_size=4).hexdigest(), 16) % self.dim] += 1.0
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-6)


def rss_mb() -> float:
    """Resident set size of this process, from /proc (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(data_dir: Path, users: int, cache_mb: int, embedder=None, every: int = 1000, search: bool = True) -> dict:
    """Serve `users` users once each (a message, then a search, which indexes it; without
    `search` only the indexing); RSS sampled every `every` users."""
    from ..config import Config
    from ..tiers.store import MemoryStore

    store = MemoryStore(Config(data_dir=data_dir, recall_cache_mb=cache_mb), embedder=embedder)
    store.embedder_instance().embed(["warm up"])
    samples = []
    t0 = time.perf_counter()
    for i in range(users):
        user = f"user-{i}"
        sid = store.open_session("soak", user).id
        store.add_messages("soak", user, sid, [{"role": "user", "content": f"My locker code is {i * 7919 % 10007}."}])
        if search:
            store.search("soak", user, "What is my locker code?", k=1)
        else:
            store.recall.sync("soak", user)
        if (i + 1) % every == 0:
            samples.append({"users": i + 1, "rss_mb": round(rss_mb(), 1)})
    out = {"cache_mb": cache_mb, "users": users, "seconds": round(time.perf_counter() - t0, 1),
           "rss_mb": samples[-1]["rss_mb"] if samples else round(rss_mb(), 1), "samples": samples,
           "cached_indexes": store.recall.cached_users()}
    store.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="agentmem bench recall-cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print only the JSON result line")
    p.add_argument("--users", type=int, default=10_000)
    p.add_argument("--cache-mb", type=int, default=64, help="the bounded arm's AGENTMEM_RECALL_CACHE_MB")
    p.add_argument("--embedder", choices=("hash", "model"), default="hash",
                   help="hash: HashEmbedder (384-d, no model); model: the real embedder")
    p.add_argument("--arm", type=int, default=None, help=argparse.SUPPRESS)  # one arm, in this process
    args = p.parse_args(argv)
    if args.arm is not None:
        with tempfile.TemporaryDirectory(prefix="agentmem-soak-") as tmp:
            emb = HashEmbedder() if args.embedder == "hash" else None
            print(json.dumps(soak(Path(tmp), args.users, args.arm, embedder=emb)))
        return 0
    arms = {}
    for name, mb in (("bounded", args.cache_mb), ("unbounded", 1 << 20)):
        run = subprocess.run([sys.executable, "-m", "agentmem.bench.recall_cache", "--users", str(args.users), "--arm", str(mb),
                              "--embedder", args.embedder], capture_output=True, text=True, check=True)
        arms[name] = json.loads(run.stdout.strip().splitlines()[-1])
        if not args.json:
            print(f"  {name}: {arms[name]['rss_mb']} MB after {args.users} users", file=sys.stderr)
    b, u = arms["bounded"], arms["unbounded"]
    first = b["samples"][0]["rss_mb"] if b["samples"] else b["rss_mb"]
    print(json.dumps({
        "bench": "recall-cache", "users": args.users, "cache_mb": args.cache_mb,
        "embedder": "HashEmbedder (384-d, no model)" if args.embedder == "hash" else "the real embedder",
        "rss_mb_10k_users": b["rss_mb"], "rss_mb_first_1k_users": first,
        "rss_growth_mb": round(b["rss_mb"] - first, 1),
        "peer": "the same loop with the cache unbounded, in its own process",
        "unbounded_rss_mb_10k_users": u["rss_mb"],
        "unbounded_rss_growth_mb": round(u["rss_mb"] - (u["samples"][0]["rss_mb"] if u["samples"] else u["rss_mb"]), 1),
        "bounded": b, "unbounded": u}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`agentmem bench recall`: does `AgentSession.search` find the turns that answer a question?

The generated conversations (`generator`) are imported through `AgentSession.add_messages`
(one agentmem user per conversation, one agentmem session per conversation session, with
`created_at` and the speaker's `name`); every question is then asked with
`search(question, k=10)`. A hit counts for the message it is, or, for a reflected fact, for
the messages it rests on (`source_ids`), in rank order, each message once. Peers measured in
the same run on the same turns: plain all-MiniLM-L6-v2 cosine over the raw turn texts, and
the database's full-text ranking alone (`MemoryStore.search(..., retrievers=("lexical",))`).

Scale: one user filled to each size in `--scale` with generated turns (batches of 500 through
`AgentSession.add_messages`), then `search` and `context` timed on ~30 questions per size.
The JSON (last line with --json) names the CPU flags and dtype beside the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .recall_data.dataset import DatasetError, load_dataset
from .recall_data.generator import CATEGORIES, Dataset, generate, scale_history

BATCH = 500
K = 10
OTHER_MESSAGES = 500  # the second user's history in the scale test
DEFAULT_SCALE = "1000,10000,100000"


def embedder_dtype(embedder) -> str:
    return str(next(embedder.model.parameters()).dtype).removeprefix("torch.")


def ranked_messages(hits) -> list[int]:
    """Message ids in rank order: a message hit for itself, a memory for its sources; each once."""
    out: list[int] = []
    for h in hits:
        for mid in ([h.id] if h.kind == "message" else list(h.source_ids)):
            if mid not in out:
                out.append(mid)
    return out


def scores(ranked: list[int], evidence: list[int]) -> tuple[float, float, float]:
    """Recall at 5 and 10 (share of the evidence found) and binary nDCG at 10."""
    ev = set(evidence)
    r5 = len(ev & set(ranked[:5])) / len(ev)
    r10 = len(ev & set(ranked[:K])) / len(ev)
    dcg = sum(1 / math.log2(i + 2) for i, m in enumerate(ranked[:K]) if m in ev)
    ideal = sum(1 / math.log2(i + 2) for i in range(min(len(ev), K)))
    return r5, r10, dcg / ideal


def _add(session, messages: list[dict]) -> list[int]:
    ids = []
    for i in range(0, len(messages), BATCH):
        ids += [m.id for m in session.add_messages(messages[i:i + BATCH])]
    return ids


IMPORTS = ("named", "prefixed", "roles")  # --import-as: how each turn names its speaker


def as_imported(messages: list[dict], how: str) -> list[dict]:
    """A session's messages as an importer may write them: `named` (each turn's speaker in
    OpenAI's `name`, as the data sets give it), `prefixed` (no `name`, the text opening with
    "Name: ", a flattened transcript) or `roles` (no `name` and no prefix: bare user/assistant
    turns, all an importer that maps two people onto the two roles keeps)."""
    if how not in IMPORTS:
        raise ValueError(f"import_as must be one of {', '.join(IMPORTS)}, got {how!r}")
    if how == "named":
        return messages
    out = []
    for m in messages:
        m = dict(m)
        name = m.pop("name", None)
        if how == "prefixed" and name:
            m["content"] = f"{name}: {m['content']}"
        out.append(m)
    return out


def import_conversations(data: Dataset, store, engine, config, tenant: str,
                         how: str = "named") -> tuple[dict[str, list[int]], float]:
    """Each conversation into its own user (its turns as `as_imported(.., how)` writes them);
    returns turn index -> message id per conversation, and the seconds `add_messages` took."""
    from ..session import AgentSession

    ids: dict[str, list[int]] = {}
    spent = 0.0
    for conv in tqdm(data.conversations, desc="import conversations", file=sys.stderr):
        ids[conv.id] = []
        for msgs in conv.sessions():
            s = AgentSession(conv.id, tenant_id=tenant, config=config, engine=engine, store=store)
            t0 = time.perf_counter()
            ids[conv.id] += _add(s, as_imported(msgs, how))
            spent += time.perf_counter() - t0
    return ids, spent


def _dense(data: Dataset, ids: dict[str, list[int]], embedder) -> list[list[int]]:
    """Plain cosine of the question against every raw turn of its conversation."""
    by_conv = {c.id: c for c in data.conversations}
    vecs = {cid: embedder.embed([t.seen for t in c.turns]) for cid, c in by_conv.items()}
    qv = embedder.embed([q.text for q in data.questions])
    out = []
    for q, v in zip(data.questions, qv, strict=True):
        sims = vecs[q.conversation] @ v
        top = np.argsort(-sims, kind="stable")[:K]
        out.append([ids[q.conversation][i] for i in top])
    return out


def _lexical(store, tenant: str, data: Dataset) -> list[list[int]] | None:
    """The database's full-text ranking alone; None while the store has no `retrievers`."""
    out = []
    for q in tqdm(data.questions, desc="lexical baseline", file=sys.stderr):
        try:
            hits = store.search(tenant, q.conversation, q.text, k=K, retrievers=("lexical",))
        except TypeError:
            return None
        out.append(ranked_messages(hits))
    return out


def evaluate(data: Dataset, store, engine, config, embedder, tenant: str = "bench", how: str = "named") -> dict:
    """Import (`as_imported(.., how)`), ask every question, score the system and both peers per category."""
    from ..session import AgentSession

    ids, spent = import_conversations(data, store, engine, config, tenant, how)
    system = []
    sessions = {c.id: AgentSession(c.id, tenant_id=tenant, config=config, engine=engine, store=store)
                for c in data.conversations}
    for q in tqdm(data.questions, desc="search", file=sys.stderr):
        system.append(ranked_messages(sessions[q.conversation].search(q.text, k=K))[:K])
    dense = _dense(data, ids, embedder)
    lexical = _lexical(store, tenant, data)
    rows: dict[str, list[list[float]]] = defaultdict(list)
    for i, q in enumerate(data.questions):
        evidence = [ids[q.conversation][t] for t in q.evidence]
        r5, r10, nd = scores(system[i], evidence)
        row = [r5, r10, nd, scores(dense[i], evidence)[1]]
        row.append(scores(lexical[i], evidence)[1] if lexical is not None else math.nan)
        rows[q.category].append(row)
        rows["all"].append(row)

    def summary(r: list[list[float]]) -> dict:
        m = np.asarray(r).mean(axis=0)
        return {"evidence_recall_at_5": float(m[0]), "evidence_recall_at_10": float(m[1]), "ndcg_at_10": float(m[2]),
                "dense_recall_at_10": float(m[3]), "lexical_recall_at_10": None if lexical is None else float(m[4]),
                "questions": len(r)}

    result = summary(rows["all"])
    del result["questions"]
    cats = [c for c in CATEGORIES if rows[c]] + sorted(set(rows) - set(CATEGORIES) - {"all"})
    result["by_category"] = {c: summary(rows[c]) for c in cats}
    n_msgs = sum(len(v) for v in ids.values())
    result |= {"questions": len(data.questions), "conversations": len(data.conversations), "messages": n_msgs,
               "import_msgs_per_s": n_msgs / spent if spent else None}
    return result


def _pct(xs: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(xs), p))


def measure_scale(sizes: list[int], store, engine, config, seed: int, queries: int,
                  tenant: str = "bench-scale") -> tuple[list[dict], float, float]:
    """One fresh user filled to each size in turn; search and context latency at each.
    Returns the per-size rows, the import rate over the whole fill (`add_messages` alone) and
    the rate until every message is searchable (the fill and each first search, which embeds
    the messages added since the last)."""
    from ..session import AgentSession

    history, questions = scale_history(seed, max(sizes))
    qs = random.Random(seed).sample(questions, min(queries, len(questions)))
    user = f"scale-{seed}"
    # a second, small user searched between this user's searches (`alternating_search_p95_s`):
    # a service serves many, and an index the cache cannot keep beside another's is read back
    other = AgentSession(f"{user}-other", tenant_id=tenant, config=config, engine=engine, store=store)
    other.add_messages(history[-OTHER_MESSAGES:])
    done, spent, indexing, rows = 0, 0.0, 0.0, []
    for size in sorted(sizes):
        s = AgentSession(user, tenant_id=tenant, config=config, engine=engine, store=store)
        with tqdm(total=size, initial=done, desc=f"fill to {size}", file=sys.stderr) as bar:
            while done < size:
                batch = history[done:min(size, done + BATCH)]
                t0 = time.perf_counter()
                s.add_messages(batch)
                spent += time.perf_counter() - t0
                done += len(batch)
                bar.update(len(batch))
        # the first search embeds what the fill added (writes never wait for embeddings): timed
        # apart, so that `searchable_msgs_per_s` says how soon imported messages are all searchable
        t0 = time.perf_counter()
        s.search(qs[0], k=K)
        first = time.perf_counter() - t0
        indexing += first
        s.context(qs[0])  # warm: the first call may build and load this user's index
        search_t, context_t = [], []
        for q in tqdm(qs, desc=f"latency at {size}", file=sys.stderr):
            t0 = time.perf_counter()
            s.search(q, k=K)
            search_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            s.context(q)
            context_t.append(time.perf_counter() - t0)
        alternating = []
        for q in qs:
            other.search(q, k=K)
            t0 = time.perf_counter()
            s.search(q, k=K)
            alternating.append(time.perf_counter() - t0)
        rows.append({"messages": size, "search_p50_s": _pct(search_t, 50), "search_p95_s": _pct(search_t, 95),
                     "context_p50_s": _pct(context_t, 50), "context_p95_s": _pct(context_t, 95),
                     "first_search_s": first, "alternating_search_p95_s": _pct(alternating, 95)})
    return rows, done / spent, done / (spent + indexing)


def cpu_flags() -> list[str]:
    """The SIMD features that matter for the figures (Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "neon"})


def run(args: argparse.Namespace, engine, embedder, data_dir: Path,
        loaded: tuple[Dataset, int] | None = None) -> dict:
    """The benchmark on `args.dataset` (`loaded`: that file as `load_dataset` read it) or the
    generator, and the scale test; the JSON's fields."""
    from ..config import Config
    from ..tiers import MemoryStore
    from ..tiers.records import NotFound

    config = Config(data_dir=data_dir, db_url=args.db_url, dtype=args.dtype, device="cpu")
    store = MemoryStore(config, embedder=embedder)
    t0 = time.perf_counter()
    skipped = 0
    dataset = getattr(args, "dataset", None)
    if dataset:
        data, skipped = loaded or load_dataset(dataset)
        if not data.questions:
            raise DatasetError(f"{dataset}: no question with evidence in its conversations")
    else:
        lo, hi = (int(x) for x in args.turns.split(","))
        data = generate(args.seed, args.conversations, args.sessions, (lo, hi))
    print(f"{len(data.conversations)} conversations, {sum(len(c.turns) for c in data.conversations)} turns, "
          f"{len(data.questions)} questions" + (f" ({skipped} skipped: evidence names no turn)" if skipped else ""),
          file=sys.stderr)
    how = getattr(args, "import_as", "named")
    # tenants of this run alone, deleted at its end: with --db-url the database outlives the run,
    # and a second run into the same tenant and users found each turn twice (the second
    # hand-written set measured 0.66 against 0.78 on PostgreSQL, the copies competing)
    run_id = uuid.uuid4().hex[:8]
    tenant, scale_tenant = f"bench-{run_id}", f"bench-scale-{run_id}"
    try:
        result = evaluate(data, store, engine, config, embedder, tenant=tenant, how=how)
        result["import_as"] = how
        scale = args.scale if args.scale is not None else ("" if dataset else DEFAULT_SCALE)
        sizes = [] if args.no_scale else [int(x) for x in scale.split(",") if x]
        result["scale"], result["ingest_msgs_per_s"] = [], result["import_msgs_per_s"]
        result["searchable_msgs_per_s"] = None
        if sizes:
            result["scale"], result["ingest_msgs_per_s"], result["searchable_msgs_per_s"] = measure_scale(
                sizes, store, engine, config, args.seed + 1, args.scale_queries, tenant=scale_tenant)
    finally:
        if args.db_url:
            for t in (tenant, scale_tenant):
                try:
                    store.delete_tenant(t)
                except NotFound:  # no scale test, or the run stopped before it
                    pass
    result |= {"dataset": str(dataset) if dataset else "generated", "skipped_questions": skipped,
               "seconds": time.perf_counter() - t0, "seed": args.seed, "k": K, "batch": BATCH,
               "cpu_flags": cpu_flags(), "threads": _threads(), "dtype": str(engine.dtype).removeprefix("torch."),
               "embedder": f"all-MiniLM-L6-v2 ({embedder_dtype(embedder)})", "db": store.archive.url.split(":", 1)[0]}
    store.close()
    return result


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="agentmem bench recall", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conversations", type=int, default=8, help="conversations (one user each)")
    ap.add_argument("--sessions", type=int, default=None, help="sessions per conversation (default 10-25)")
    ap.add_argument("--turns", default="20,60", help="turns per session, min,max")
    ap.add_argument("--dataset", default=None,
                    help="a JSON file of conversations and evidence-annotated questions instead of the generator "
                         "(agentmem's layout or LoCoMo-style; bench/recall_data/dataset.py)")
    ap.add_argument("--scale", default=None,
                    help=f"message counts for the one-user latency test (default {DEFAULT_SCALE}; none with --dataset)")
    ap.add_argument("--scale-queries", type=int, default=30)
    ap.add_argument("--no-scale", action="store_true", help="skip the latency test")
    ap.add_argument("--db-url", default=None, help="archive database (default: SQLite in a temporary folder)")
    ap.add_argument("--dtype", default="float32", help="the engine's dtype (context() counts tokens with it)")
    ap.add_argument("--import-as", choices=IMPORTS, default="named",
                    help="how each imported turn names its speaker: `name` (named), a \"Name: \" prefix "
                         "(prefixed) or not at all (roles)")
    args = ap.parse_args(argv)
    loaded = None
    if args.dataset:  # a bad file fails here, before the model loads
        try:
            loaded = load_dataset(args.dataset)
        except DatasetError as e:
            print(f"agentmem bench recall: {e}", file=sys.stderr)
            return 2

    import torch

    from ..config import Config
    from ..engine import Engine
    from ..tiers.embed import load_embedder

    torch.set_num_threads(min(2, torch.get_num_threads()))
    print("loading engine and embedder", file=sys.stderr)
    engine = Engine.load(Config(dtype=args.dtype, device="cpu"))
    embedder = load_embedder()
    with tempfile.TemporaryDirectory(prefix="agentmem-recall-", ignore_cleanup_errors=True) as tmp:
        result = run(args, engine, embedder, Path(tmp), loaded)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0

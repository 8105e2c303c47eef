"""`agentmem bench report`: the README's benchmark table, made from the results in docs/bench/.

One row per figure a user compares (engine decode and prefill against HF and llama.cpp, the
blend's speed and top-1, recall@10 on the three question sets, memory answers, the service,
the MCP server's overhead) and per CPU: the latest run of that bench there
(agentmem/bench/results.py), named by its CPU model and date. A result is left out when a newer
one of the same bench ran on the same CPU or on one its name covers ("AMD EPYC" is covered by
"AMD EPYC (family 25 model 1)"): older files named before CPUs were recorded precisely stay
in docs/bench/ but are not current figures. The README keeps the table between the lines `<!-- bench-table:start -->` and
`<!-- bench-table:end -->`; `--write` replaces what is between them, else the table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .results import RESULTS

START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"
_SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def _dtype(r: dict) -> str:
    dtype = _SHORT.get(r["dtype"], r["dtype"])
    return f"{dtype}, {r['weights']} weights" if r.get("weights") else dtype


def _against_llamacpp(ours: float, peer: float | None) -> str:
    return f", {ours / peer:.2f}x llama.cpp" if peer else ""


def _engine(r: dict) -> str:
    return (f"decode {r['decode_tok_s']:,.1f} tok/s ({r['decode_speedup_vs_hf']:.1f}x HF"
            f"{_against_llamacpp(r['decode_tok_s'], r.get('llamacpp_decode_tok_s'))}); "
            f"prefill of {r['prompt_tokens']:,} tokens {r['prefill_tok_s']:,.0f} tok/s ({r['prefill_speedup_vs_hf']:.2f}x HF"
            f"{_against_llamacpp(r['prefill_tok_s'], r.get('llamacpp_prefill_tok_s'))})")


def _blend(r: dict) -> str:
    return (f"{r['speedup']:.2f}x at r = {r['ratio']:g} on ~{r['prompt_tokens']:,.0f}-token prompts; "
            f"top-1 {r['blend_top1']:.2f} (plain reuse {r['reuse_top1']:.2f})")


def _recall(r: dict) -> str:
    peers = [f"{name} {r[key]:.3f}" for name, key in (("MiniLM alone", "dense_recall_at_10"),
                                                      ("full text alone", "lexical_recall_at_10")) if key in r]
    return f"{r['evidence_recall_at_10']:.3f}" + (f" ({', '.join(peers)})" if peers else "")


def _recall_sets(found: dict[str | None, dict]) -> str:
    names = {None: "generated", "handwritten": "hand-written 1", "handwritten2": "hand-written 2"}
    return "; ".join(f"{names.get(v, v)} {_recall(r)}" for v, r in found.items())


def _mcp(r: dict) -> str:
    o, py = r["overhead_p50_ms"], r["python"]
    return (f"p50 over Python: stdio +{o['stdio']['search_memory']:.1f} ms search, +{o['stdio']['add_messages']:.1f} ms "
            f"add; HTTP +{o['http']['search_memory']:.1f} / +{o['http']['add_messages']:.1f} ms "
            f"(Python {py['search_memory']['p50_ms']:.1f} / {py['add_messages']['p50_ms']:.1f} ms, "
            f"{r['messages']:,} messages)")


def _memory(r: dict) -> str:
    n = r["questions"]
    text = f"evidence in the prompt {r['evidence_in_prompt']:.2f}; answers {round(r['answer_accuracy'] * n)} of {n}"
    if r.get("full_context_accuracy") is not None:
        text += f" (the raw history in the window: {round(r['full_context_accuracy'] * n)} of {n})"
    return text


def _serve(r: dict) -> str:
    top = r["levels"][-1]
    return (f"{top['speedup']:.2f}x the serial server's throughput at {top['clients']} clients "
            f"({top['throughput_req_s']:.2f} req/s), {r['errors']} errors")


def _replicas(r: dict) -> str:
    return f"{r['replicas_speedup']:.2f}x one replica's throughput, {r['replicas']} replicas on PostgreSQL"


def _seconds(x: float) -> str:
    """Three significant digits: 0.153 s and 14.0 s alike."""
    return f"{x:.3g}"


def _fair(r: dict) -> str:
    return (f"a tenant's short requests p95 {_seconds(r['fair_short_with_long_p95_s'])} s beside another's 8 long "
            f"streams, {_seconds(r['fair_short_alone_p95_s'])} s alone ({r['fair_ratio']:.2f}x; target <= 2x)")


def _kvstore(r: dict) -> str:
    return (f"token hit rate {r['policy_hit_rate']:.2f} against LRU's {r['lru_hit_rate']:.2f} at equal memory; "
            f"TTFT p95 {r['policy_ttft_p95_s']:.2f} s against {r['lru_ttft_p95_s']:.2f} s; {r['codec']} KV "
            f"{r['codec_bytes_ratio']:.3f}x raw bytes, blend KL {r['codec_kl_ratio']:.2f}x raw's, top-1 "
            f"{r['codec_top1']:.2f} ({r['users']} users, {r['turns']} turns)")


def _listing(r: dict) -> str:
    pages = r["listings"]
    return ("a page of 100 in " + ", ".join(f"{pages[k]['page_default']['p50_ms']:.0f} ms ({k})" for k in pages)
            + f"; {r['users']:,} users x {r['sessions_per_user']:,} sessions, {r['db']}")


@dataclass(frozen=True)
class Row:
    bench: str
    variant: str | None
    what: str
    figure: Callable[[dict], str]
    more: tuple[str, ...] = ()  # variants shown in the same row, per CPU (`figure` then takes {variant: result})


ROWS = (
    Row("engine", None, "`bench engine`: one stream against HF and llama.cpp", _engine),
    Row("blend", None, "`bench blend`: CacheBlend against full prefill", _blend),
    Row("recall", None, "`bench recall`: recall@10", _recall_sets, ("handwritten", "handwritten2")),
    Row("memory", None, "`bench memory`: multi-session QA", _memory),
    Row("serve", None, "`bench serve`: batched against serial", _serve),
    Row("serve", "replicas", "`bench serve --replicas 2`", _replicas),
    Row("serve", "fair", "`bench serve --fair only`: fair share between tenants", _fair),
    Row("mcp", None, "`bench mcp`: the MCP server's overhead", _mcp),
    Row("kvstore", None, "`bench kvstore`: value-per-byte policy and int4 KV against LRU and raw KV", _kvstore),
    Row("listing", None, "`bench listing`: REST pages at scale", _listing),
)


def _machine(r: dict, link: str) -> str:
    where = f"{r['gpu']} (host: {r['cpu']})" if r.get("gpu") else r["cpu"]
    return f"{where} ([{r['machine']}]({link}))"


def results(bench: str, variant: str | None, root: Path) -> list[tuple[Path, dict]]:
    """The result files of one bench (or one variant of it), newest first."""
    folder = root / bench / variant if variant else root / bench
    found = [(path, json.loads(path.read_text())) for path in sorted(folder.glob("*.json"))]
    return sorted(found, key=lambda item: item[1]["date"], reverse=True)


def current(found: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """The newest result per CPU (and GPU), without those a newer one on a CPU of the same or
    a more precise name supersedes."""
    kept: list[tuple[Path, dict]] = []
    for path, r in found:  # newest first
        if not any(k.get("gpu") == r.get("gpu") and k["cpu"].startswith(r["cpu"]) for _, k in kept):
            kept.append((path, r))
    return kept


def table(root: Path = RESULTS, readme_dir: Path = Path(".")) -> str:
    """The markdown table; links are relative to the README's folder."""
    lines = ["| benchmark | figure | dtype | machine | date |", "|---|---|---|---|---|"]
    for row in ROWS:
        found = current(results(row.bench, row.variant, root))
        if row.more:  # the other variants' latest on each of these CPUs, in the same row
            extra = {v: {(r.get("gpu"), r["cpu"]): r for _, r in current(results(row.bench, v, root))}
                     for v in row.more}
        for path, r in found:
            link = Path(os.path.relpath(path, readme_dir)).as_posix()
            if row.more:
                same = {v: extra[v].get((r.get("gpu"), r["cpu"])) for v in row.more}
                figure = row.figure({row.variant: r, **{v: x for v, x in same.items() if x is not None}})
            else:
                figure = row.figure(r)
            lines.append(f"| {row.what} | {figure} | {_dtype(r)} | {_machine(r, link)} | {r['date']} |")
    return "\n".join(lines)


def replace_table(text: str, new_table: str) -> str:
    """`text` with everything between the marker lines replaced by `new_table`."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(f"the README needs the lines {START} and {END}, in that order")
    head = text[: start + len(START)]
    return f"{head}\n{new_table}\n{text[end:]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="agentmem bench report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="replace the table between the README's markers")
    ap.add_argument("--readme", type=Path, default=Path("README.md"))
    ap.add_argument("--results", type=Path, default=RESULTS, help="the results folder (default docs/bench)")
    args = ap.parse_args(argv)
    new_table = table(args.results, args.readme.parent)
    if not args.write:
        print(new_table)
        return 0
    try:
        text = replace_table(args.readme.read_text(), new_table)
    except (OSError, ValueError) as exc:
        print(f"agentmem bench report: {args.readme}: {exc}", file=sys.stderr)
        return 1
    args.readme.write_text(text)
    rows = len(new_table.splitlines()) - 2
    print(f"{args.readme}: the table's {rows} rows written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

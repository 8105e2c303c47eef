"""`agentmem` command line. Each command lives in its own module and is imported only when
used, so `agentmem --help` stays instant and packages stay independent."""

from __future__ import annotations

import importlib
import sys

# command -> (module with main(argv) -> int | None, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("agentmem.demo", "scripted multi-session chat that shows memory at work"),
    "chat": ("agentmem.repl", "interactive chat REPL with memory (--show-memories)"),
    "serve": ("agentmem.api.cli", "run the multi-tenant REST service (OpenAI-compatible)"),
    "tenant": ("agentmem.api.admin", "create / list / delete tenants and API keys"),
    "reflect": ("agentmem.reflect.cli", "run offline reflection for one user or all"),
    "models": ("agentmem.engine.models_cli", "show / provision the model weights"),
    "mcp": ("agentmem.integrations.mcp_server", "MCP server over stdio for one user (Claude Desktop, Cursor, agents)"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "engine": ("agentmem.bench.engine", "engine prefill/decode/batching vs HF transformers"),
    "kernels": ("agentmem.bench.kernels", "attention/RoPE kernels vs their torch peers"),
    "blend": ("agentmem.bench.blend", "chunk-KV reuse: full vs reuse vs CacheBlend"),
    "kvstore": ("agentmem.bench.kvstore", "chunk KV store on a multi-user trace: LRU+raw vs value per byte+codec"),
    "memory": ("agentmem.bench.memory", "multi-session memory QA workload"),
    "recall": ("agentmem.bench.recall", "evidence recall on generated multi-session conversations"),
    "recall-cache": ("agentmem.bench.recall_cache", "resident memory over 10,000 users, recall cache bounded vs not"),
    "serve": ("agentmem.bench.serve", "REST service under N concurrent clients"),
    "listing": ("agentmem.bench.listing", "REST listings at 2,000 users x 2,000 sessions: a page and every page"),
    "replies": ("agentmem.bench.replies", "reply quality (loops, copies, answers) and tool/JSON validity"),
    "mcp": ("agentmem.bench.mcp", "MCP tool latency over stdio and HTTP vs the Python API"),
    "report": ("agentmem.bench.report", "the README's benchmark table from docs/bench/ (--write: into README.md)"),
}


def _usage() -> str:
    lines = ["usage: agentmem COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [f"  bench {name:<4} {help_}" for name, (_, help_) in BENCHES.items()]
    lines += ["", "  bench NAME ... --json --save[=VARIANT]: also keep the result in docs/bench/NAME/[VARIANT/]<machine>.json"]
    return "\n".join(lines)


def _dispatch(module: str, argv: list[str]) -> int:
    rc = importlib.import_module(module).main(argv)
    return int(rc or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCHES:
            print(_usage(), file=sys.stderr)
            return 2
        from .bench.results import run_saved, split_save

        module = BENCHES[rest[0]][0]
        argv, saving, variant = split_save(rest[1:])
        if not saving:
            return _dispatch(module, argv)
        return run_saved(rest[0], importlib.import_module(module).main, argv, variant)
    if cmd not in COMMANDS:
        print(f"agentmem: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return _dispatch(COMMANDS[cmd][0], rest)


if __name__ == "__main__":
    sys.exit(main())

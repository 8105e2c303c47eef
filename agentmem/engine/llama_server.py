"""llama-cpp-python's OpenAI-compatible server on the default GGUF, on a loopback port: the
remote engine's peer in tests and in `bench memory --llama-server`.

That server reports no cached prompt tokens (no `prompt_tokens_details`, no `timings`, no
usage at all in a stream). What it does say is in its log: before each completion that
reuses its slot's KV, `Llama.generate: N prefix-match hit, remaining M prompt tokens to
eval` (or `full prompt already cached`). `log_cache_hits` reads those lines; that is the
server's own figure, not an estimate, for a run that owns the server's log.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .weights import default_gguf

HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
FULL = "Llama.generate: full prompt already cached"


class LlamaServer:
    """`python -m llama_cpp.server` on `model` (default: the default GGUF), one thread, its
    log in `log`; `kill()` stops it at once (SIGKILL), `close()` politely."""

    def __init__(self, log: Path, n_ctx: int = 4096, threads: int = 1, model: Path | None = None,
                 alias: str = "smollm2", cpu: int | None = None, start_timeout_s: float = 180.0):
        from ..api.local import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model or default_gguf()),
               "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(n_ctx),
               "--n_threads", str(threads), "--n_threads_batch", str(threads), "--model_alias", alias,
               "--logits_all", "false"]  # its default keeps n_ctx x vocab floats of logits nobody reads
        if cpu is not None:
            cmd = ["taskset", "-c", str(cpu)] + cmd
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-cpp-python's server exited: {self.log_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"llama-cpp-python's server did not start in {start_timeout_s:.0f} s")
            time.sleep(0.2)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def log_cache_hits(log: str) -> dict:
    """What llama-cpp-python's log says its prefix cache reused: `cached_tokens` (prefix
    hits), `evaluated_tokens` (the rest of those prompts), `completions_with_hit`.
    Completions that reused nothing log no line, so the share of a run is cached_tokens
    over the prompt tokens the run sent."""
    cached = evaluated = hits = 0
    for line in log.splitlines():
        m = HIT.search(line)
        if m:
            cached, evaluated, hits = cached + int(m[1]), evaluated + int(m[2]), hits + 1
    full = log.count(FULL)
    return {"cached_tokens": cached, "evaluated_tokens": evaluated, "completions_with_hit": hits,
            "full_prompt_cached": full}

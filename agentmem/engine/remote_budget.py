"""Token budgets for a chat server whose model's tokenizer agentmem does not have.

A chat API applies its model's template and tokenizer to the messages; agentmem counts with
the tokenizer files it has (`engine_tokenizer`, else the default model's byte-level BPE) over
the prompt as it assembled it, its own chat wraps included, which stand in for the server's
template. `TokenBudget` turns that count into an upper bound of what the server will count:
the count times a factor, calibrated per server from the `usage.prompt_tokens` it reports
(the largest ratio of the last CALIBRATION_KEEP turns), plus a margin. Before the server
has reported anything the factor is a prior: 1.0 for the model's own files, PRIOR_FACTOR
for the default model's stand-in (byte-level BPEs of 32k-256k vocabularies count English
within about a fifth of each other). bench/estimator.py measures the estimator's error on
the bench conversations (`bench memory --engine-api chat`: the `estimator_*` keys).

The assembly fits prompts to `context_budget` in counted tokens; the engine reports its
context window in the same units (the server's window divided by the factor's bound), so
`context_budget + reply_tokens` is checked against what the server will allow, and before
each request the bound of the prompt must leave room for at least one reply token. The
context window comes from `engine_context`, else the server's model metadata
(`server_window`), else the configured or tokenizer-file window.
"""

from __future__ import annotations

import math
import threading
from collections import deque

import httpx

PRIOR_FACTOR = 1.25  # the default model's files counting for an unknown model, before calibration
MARGIN = 0.05  # above the calibrated factor: a turn's text is not the turns it was calibrated on
CALIBRATION_KEEP = 32  # ratios kept; the largest of them is the factor
MIN_CALIBRATION_TOKENS = 16  # shorter prompts say more about the template than the tokenizer


class TokenBudget:
    """The bound on a server's count of a prompt agentmem counted `n` tokens."""

    def __init__(self, exact: bool):
        self.exact = exact
        self.prior = 1.0 if exact else PRIOR_FACTOR
        self._ratios: deque[float] = deque(maxlen=CALIBRATION_KEEP)
        self._lock = threading.Lock()

    @property
    def calibrated(self) -> bool:
        return bool(self._ratios)

    @property
    def factor(self) -> float:
        """Server tokens per counted token: the largest recent ratio, else the prior."""
        with self._lock:
            return max(self._ratios) if self._ratios else self.prior

    @property
    def bound_factor(self) -> float:
        return self.factor * (1 + MARGIN)

    def upper(self, counted: int) -> int:
        """At least what the server will count for a prompt counted `counted` tokens here."""
        return math.ceil(counted * self.bound_factor) + 1

    def estimate(self, counted: int) -> int:
        """The best guess (no margin): what the estimator's error is measured on."""
        return round(counted * self.factor)

    def observe(self, counted: int, reported: int | None) -> None:
        """A prompt counted `counted` here that the server said was `reported` tokens."""
        if not reported or counted < MIN_CALIBRATION_TOKENS:
            return
        with self._lock:
            self._ratios.append(reported / counted)

    def window(self, server_window: int) -> int:
        """The server's window in counted tokens: what a prompt plus its reply may use."""
        return int((server_window - 1) / self.bound_factor)

    def to_dict(self) -> dict:
        return {"exact_tokenizer": self.exact, "factor": round(self.factor, 4), "calibrated": self.calibrated,
                "observations": len(self._ratios), "margin": MARGIN}


def server_window(http: httpx.Client, model: str | None) -> int | None:
    """The context window a server's metadata states for `model` (or its only model), None
    where it states none: vLLM's and SGLang's `/v1/models` (`max_model_len`), OpenRouter's
    and Together's (`context_length`), LM Studio's `/api/v0/models` (`max_context_length`),
    llama.cpp's server's `/props` (`default_generation_settings.n_ctx`). llama-cpp-python's
    server states none: give `engine_context` there. A server that cannot be reached raises
    httpx.TransportError."""
    keys = ("max_model_len", "context_length", "max_context_length", "context_window")
    for path in ("/v1/models", "/api/v0/models"):
        try:
            r = http.get(path)
            data = r.json().get("data") if r.status_code == 200 else None
        except httpx.TransportError:
            if path == "/v1/models":
                raise  # the server is away: ask again later
            continue
        except (httpx.HTTPError, ValueError, AttributeError):
            continue
        cards = [c for c in data or [] if isinstance(c, dict)]
        mine = [c for c in cards if model is None or c.get("id") == model] or cards[:1]
        for card in mine:
            for k in keys:
                if isinstance(card.get(k), int) and card[k] > 0:
                    return card[k]
    try:
        r = http.get("/props")
        n = (r.json().get("default_generation_settings") or {}).get("n_ctx") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        n = None
    return n if isinstance(n, int) and n > 0 else None

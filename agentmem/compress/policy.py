"""Which parts of a prompt are compressed, and how hard, given the context budget.

Compression is decided per tier, not per request: system prompt, core memory blocks,
recent turns and the user's message are never compressed (they are short, exact, and read
every turn); retrieved memories and the running summary are, at a fixed rate, once, when
they are written. At assembly time the plan only chooses, tier by tier, between the stored
original and the stored compressed text, so the choice never invalidates cached KV of a
memory that was already compressed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BudgetPolicy:
    # tier -> rate used when a memory of that tier is written; tiers not listed stay verbatim
    rates: dict[str, float] = field(
        default_factory=lambda: {"recall": 0.4, "fact": 0.5, "insight": 0.6, "summary": 0.6}
    )
    # compressed first when over budget (the cheapest loss first)
    order: tuple[str, ...] = ("recall", "fact", "insight", "summary")
    always_compress: bool = False  # use compressed text even when the originals fit

    def __post_init__(self) -> None:
        for tier, rate in self.rates.items():
            if not 0.0 < rate <= 1.0:
                raise ValueError(f"rate for tier {tier!r} must be in (0, 1], got {rate}")

    def rate_for(self, tier: str) -> float:
        """Rate to compress a new memory of `tier` at write time (1.0: keep verbatim)."""
        return self.rates.get(tier, 1.0)

    def plan(self, original: dict[str, int], compressed: dict[str, int], budget: int) -> BudgetPlan:
        """Pick, per tier, original or compressed text so the prompt fits `budget` tokens.

        `original` / `compressed`: tokens each tier takes with the original / the stored
        compressed texts (a tier absent from `compressed` cannot shrink). Tiers switch to
        compressed text in `order` until the total fits; if even that is over, `fits` is
        False and the caller drops its lowest-ranked memories.
        """
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget}")
        use = {t: False for t in original}
        total = sum(original.values())
        for tier in self.order:
            if tier not in original or tier not in compressed or self.rate_for(tier) >= 1.0:
                continue
            if total <= budget and not self.always_compress:
                break
            total -= original[tier] - min(compressed[tier], original[tier])
            use[tier] = True
        return BudgetPlan(use_compressed=use, tokens=total, fits=total <= budget)


@dataclass(frozen=True)
class BudgetPlan:
    use_compressed: dict[str, bool]
    tokens: int
    fits: bool

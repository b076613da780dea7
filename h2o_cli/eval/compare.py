"""Perplexity of one text under every (policy, budget): the budget-vs-quality table of `h2o compare`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.streaming import stream_perplexity


def budget_tokens(budget: float, tokens: int) -> int:
    """A fraction (<= 1) is of the tokens read (the whole text is the 'prompt'); above 1 it is a count."""
    return max(2, round(budget * tokens)) if budget <= 1 else int(budget)


def compare_perplexity(
    model,
    ids: Sequence[int],
    budgets: Sequence[float],
    policies: Sequence[str],
    chunk: int = 32,
    score_norm: str = "sum",
    kv_bits: int | None = None,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Rows {policy, budget, budget_tokens, tokens, ppl}; `full` once, at budget 1.0."""
    rows = []
    window = int(model.config.get_text_config().max_position_embeddings)
    cells = [("full", 1.0)] if "full" in policies else []
    cells += [(policy, budget) for policy in policies if policy != "full" for budget in budgets]
    for policy, budget in cells:
        if policy == "full":
            settings = CacheSettings(
                budget=min(window, len(ids)) or 2,
                policy="local",
                positions="original",
                chunk=chunk,
                kv_bits=kv_bits,
            )
        else:
            k = budget_tokens(budget, len(ids))
            settings = CacheSettings(
                budget=k,
                policy=policy,
                sinks=min(4, k - 1),
                score_norm=score_norm,
                chunk=chunk,
                kv_bits=kv_bits,
            )
        stats = stream_perplexity(model, H2OCache(model, settings), [list(ids)], chunk)
        row = {
            "policy": policy,
            "budget": budget,
            "budget_tokens": settings.budget,
            "score_norm": score_norm,
            "kv_bits": kv_bits,
            "quant": getattr(model, "h2o_quant", "none"),
            "tokens": stats.tokens,
            "ppl": stats.ppl,
        }
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows

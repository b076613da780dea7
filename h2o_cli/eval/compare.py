"""Perplexity of one text under every (policy, budget): the budget-vs-quality table of `h2o compare`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.policies import policy_class
from h2o_cli.streaming import stream_perplexity


def compare_perplexity(
    model,
    ids: Sequence[int],
    budgets: Sequence[float | str],
    policies: Sequence[str],
    settings: CacheSettings | None = None,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Rows {policy, budget, budget_tokens, tokens, ppl} for every policy at every budget.

    `settings` gives everything but the policy and budget (default: `CacheSettings` defaults, chunk 32). A
    fractional budget is of the tokens read (the whole text is the 'prompt'); a policy that never evicts is
    run once, at budget 1.0.
    """
    base = settings or CacheSettings(budget=1.0, chunk=32)
    cells = [
        (policy, budget)
        for policy in policies
        for budget in (budgets if policy_class(policy).evicts else [1.0])
    ]
    rows = []
    for policy, budget in cells:
        cell = replace(base, policy=policy, budget=budget).resolved(len(ids), floor=True)
        cache = H2OCache(model, cell, span=len(ids))
        stats = stream_perplexity(model, cache, [list(ids)], cell.chunk)
        report = cache.report()
        row = {
            "policy": policy,
            "budget": budget,
            "budget_tokens": report.budget_tokens,
            "score_norm": cell.score_norm,
            "heavy_ratio": cell.heavy_ratio,
            "score_decay": cell.score_decay,
            "h2o_sinks": cell.h2o_sinks,
            "kv_bits": cell.kv_bits,
            "quant": getattr(model, "h2o_quant", "none"),
            "tokens": stats.tokens,
            "ppl": stats.ppl,
            **report.archive_row,  # recall: the archive's bytes (RAM, disk), reach and recalls
        }
        cache.close()
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows

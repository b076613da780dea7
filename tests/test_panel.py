"""The chat panel's timeline strip, rendered: kept, evicted and empty cells are told apart."""

from __future__ import annotations

from dataclasses import replace

import torch
from rich.console import Console

from h2o_cli.chat.snapshot import CacheSnapshot
from h2o_cli.cli.panel import LABEL_WIDTH, PanelView, render_panel


def snapshot_of(token_index: list[int], tokens_seen: int, recent: int) -> CacheSnapshot:
    """One layer, one KV head, holding `token_index` (the last `recent` of them recent)."""
    index = torch.tensor(token_index).view(1, 1, -1)
    heavy = torch.zeros_like(index, dtype=torch.bool)
    heavy[..., : len(token_index) - recent] = True
    return CacheSnapshot(
        token_index=index, heavy=heavy, scores=torch.zeros(index.shape), tokens_seen=tokens_seen,
        length=len(token_index), budget=len(token_index), slots=len(token_index), recent=recent,
        policy="h2o", evictions=tokens_seen - len(token_index), bytes_per_head=1, cache_bytes=1, full_kv_bytes=1,
    )  # fmt: skip


def test_short_conversation_draws_empty_cells_blank_not_evicted():
    """Issue 9.13: 10 tokens, all kept, on a ~80-cell strip: no cell may read as evicted."""
    console = Console(width=120, record=True, color_system=None)
    console.print(render_panel(snapshot_of(list(range(10)), 10, recent=5), PanelView(), 120, 40))
    row = next(line for line in console.export_text().splitlines() if line.startswith("L0"))
    strip = row[LABEL_WIDTH:]
    assert "·" not in strip
    assert strip.count("▒") == 5  # one cell per recent token
    assert sum(strip.count(shade) for shade in "▁▃▅▇") == 5  # one per heavy hitter


def test_evicted_tokens_still_show_as_dots_in_a_short_conversation():
    console = Console(width=120, record=True, color_system=None)
    kept = [0, 1, 6, 7, 8, 9]  # tokens 2..5 evicted
    console.print(render_panel(snapshot_of(kept, 10, recent=4), PanelView(), 120, 40))
    row = next(line for line in console.export_text().splitlines() if line.startswith("L0"))
    assert row[LABEL_WIDTH:].count("·") == 4  # exactly the four evicted tokens' cells


def test_long_conversation_has_no_blank_cells():
    console = Console(width=120, record=True, color_system=None)
    kept = list(range(990, 1000))
    console.print(render_panel(snapshot_of(kept, 1000, recent=10), PanelView(), 120, 40))
    row = next(line for line in console.export_text().splitlines() if line.startswith("L0"))
    strip = row[LABEL_WIDTH:].split("  ")[0]
    assert " " not in strip.rstrip() and "·" in strip


def test_heavy_slots_line_reports_the_summary_and_is_absent_without_heavy_entries():
    summary = {
        "heavy_mean_age": 1234.4,
        "heavy_median_age": 900.0,
        "sinks_kept": 3.25,
        "heavy_attention_share": 0.42,
    }
    snapshot = snapshot_of([0, 1, 6, 7, 8, 9], 10, recent=4)
    console = Console(width=160, record=True, color_system=None)
    console.print(render_panel(replace(snapshot, heavy_summary=summary), PanelView(), 160, 40))
    text = console.export_text()
    assert (
        "heavy slots: age 1,234 tok (median 900) · sinks kept 3.2/4 · last query's attention on them 42%"
        in text
    )
    console = Console(width=160, record=True, color_system=None)
    console.print(
        render_panel(replace(snapshot, heavy_summary={"heavy_mean_age": None}), PanelView(), 160, 40)
    )
    assert "heavy slots:" not in console.export_text()

"""The chat panel's timeline strip, rendered: kept, evicted and empty cells are told apart."""

from __future__ import annotations

from dataclasses import replace

import torch
from conftest import run_stream
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
    """Regression: 10 tokens, all kept, on a ~80-cell strip: no cell may read as evicted."""
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


def row_of(text: str, label: str = "L0") -> str:
    return next(line for line in text.splitlines() if line.startswith(label))


def recall_cells(row: str, strip_width: int) -> set[int]:
    """Cells of a rendered strip that carry the recall mark."""
    return {cell for cell, mark in enumerate(row[LABEL_WIDTH : LABEL_WIDTH + strip_width]) if mark == "◆"}


RECALL_STRIP = 100  # console width 142 = label 8 + strip 100 + tail 26 + recall tail 6 + 2


def test_recall_mark_sits_exactly_in_the_cells_of_recalled_tokens():
    """200 tokens on 100 cells (two per cell): S = 0..3 (heavy) and 189..199 (recent); the last step recalled
    50, 51, 52, 120, 133 and 188 (which shares its cell with the recent token 189: the recall mark wins)."""
    kept = [0, 1, 2, 3] + list(range(189, 200))
    recalled = [50, 51, 52, 120, 133, 188, -1, -1]
    snapshot = replace(
        snapshot_of(kept, 200, recent=11),
        policy="recall",
        recalled=torch.tensor(recalled).view(1, 1, -1),
        archive_oldest=40,
    )
    console = Console(width=142, record=True, color_system=None)
    console.print(render_panel(snapshot, PanelView(), 142, 40, turn_starts=[("user", 0), ("assistant", 100)]))
    text = console.export_text()
    row = row_of(text)
    # By hand: token t lies in cell t * 100 // 200 = t // 2.
    assert recall_cells(row, RECALL_STRIP) == {25, 26, 60, 66, 94}
    assert row[LABEL_WIDTH + 94] == "◆" and row[LABEL_WIDTH + 95] == "▒"
    assert row.split()[-5:] == ["15/15", "4h", "6r", "1", "B"]  # kept/budget, heavy, recalled, bytes
    assert "budget 23 (4 heavy + 11 recent + 8 recalled)" in text
    assert "recall: ◆ 6.0/8 per KV head last step · [ reaches token 40 (160 archived)" in text
    # The reach on the ruler: cell 40 // 2 = 20; before it the tokens are gone for good; turn starts after it stay.
    ruler = next(line for line in text.splitlines() if "[" in line and line.startswith(" " * LABEL_WIDTH))
    axis = ruler[LABEL_WIDTH : LABEL_WIDTH + RECALL_STRIP]
    assert axis.index("[") == 20 and axis[0] == "u" and set(axis[1:20]) == {"╌"} and axis[50] == "a"
    assert "◆ recalled last step" in text and "[ recall reaches back to here" in text


def test_the_panel_of_a_live_recall_cache_marks_its_recall_slots(tiny_pair):
    """A tiny model streams 240 tokens with `recall` (archive of 160): the snapshot reads each layer's recall
    slots and the archive's reach, and each strip marks exactly the cells of its head's recalled tokens."""
    from h2o_cli.chat.snapshot import take_snapshot
    from h2o_cli.config import CacheSettings

    _, model = tiny_pair
    settings = CacheSettings(budget=32, policy="recall", chunk=8, page_size=8, archive_max=160)
    ids = torch.randint(0, 128, (1, 240), generator=torch.Generator().manual_seed(1))
    _, cache = run_stream(model, settings, ids, 8)
    snapshot = take_snapshot(cache)
    # The archive keeps whole pages of 8 in a ring of 160 tokens: after 240 tokens, pages 10..29 (80..239).
    assert snapshot.archive_oldest == 80
    console = Console(width=142, record=True, color_system=None)
    console.print(render_panel(snapshot, PanelView(), 142, 40))
    text = console.export_text()
    assert "[ reaches token 80 (160 archived)" in text
    marked = 0
    for number, layer in enumerate(cache.layers):
        assert torch.equal(snapshot.recalled[number], layer.recall_index)
        for head in range(2):
            recalled = [t for t in layer.recall_index[head].tolist() if t >= 0]
            resident = set(layer.store.token_index[head][layer.store.valid[head]].tolist())
            assert recalled and all(80 <= t < 232 and t not in resident for t in recalled)
            row = row_of(text, f"L{number}  h{head}")
            cells = {t * RECALL_STRIP // 240 for t in recalled}
            assert recall_cells(row, RECALL_STRIP) == cells
            assert row.split()[-3] == f"{len(recalled)}r"  # before the bytes ("3.7 KiB")
            marked += len(cells)
    assert marked > 0


def test_panels_of_other_policies_are_unchanged(tiny_pair):
    from h2o_cli.cache import H2OCache
    from h2o_cli.chat.snapshot import take_snapshot
    from h2o_cli.config import CacheSettings

    _, model = tiny_pair
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(2))
    for policy in ("h2o", "sink", "local", "full"):
        cache = H2OCache(model, CacheSettings(budget=16, policy=policy, chunk=4))
        with torch.no_grad():
            model(ids, cache=cache)
        snapshot = take_snapshot(cache)
        assert snapshot.recalled is None and snapshot.archive_oldest is None and snapshot.recall_slots == 0
        console = Console(width=120, record=True, color_system=None)
        console.print(render_panel(snapshot, PanelView(), 120, 40, turn_starts=[("user", 0)]))
        text = console.export_text()
        assert "◆" not in text and "recall" not in text and "[" not in text
        assert text.splitlines()[-1] == "▒ recent  ▅ heavy hitters  · evicted  u a turn starts"
        row = row_of(text)
        # Strip of 120 - 8 - 26 - 2 = 84 cells, then the usual tail (kept/budget, heavy, bytes).
        assert len(row.rstrip()) == LABEL_WIDTH + 84 + 26


def test_the_legend_fits_under_the_rows_at_any_height():
    """With more layers than fit, the rows leave room for every line under them: the layer count, the
    tokens most kept and the legend stay on screen."""
    one = snapshot_of(list(range(10)), 10, recent=5)
    index = one.token_index.expand(30, 3, -1).clone()
    many = replace(
        one, token_index=index, heavy=one.heavy.expand(30, 3, -1).clone(), scores=torch.zeros(index.shape)
    )
    for height in range(12, 40):
        console = Console(width=120, record=True, color_system=None)
        console.print(render_panel(many, PanelView(), 120, height, decode=lambda token: f"t{token}"))
        text = console.export_text().splitlines()
        assert len(text) <= height
        assert "turn starts" in text[-1], height
        assert any(line.startswith("most kept") for line in text), height
        assert any(line.startswith("showing") for line in text), height

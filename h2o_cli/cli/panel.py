"""The live cache panel of `h2o chat`: rich renderables built from a `CacheSnapshot`, not the live cache."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.segment import Segment
from rich.text import Text

from h2o_cli.analysis import SINK_TOKENS
from h2o_cli.chat.snapshot import CacheSnapshot, take_snapshot
from h2o_cli.cli.common import size

HEAVY_SHADES = "▁▃▅▇"
LABEL_WIDTH = 8  # "L12 h2  "
TAIL_WIDTH = 26  # " 64/96  32 heavy  48 KiB"
RECALL_TAIL_WIDTH = 6  # "   32r": tokens the head recalled in the last step (recalling policies only)
RECALL_MARK = "◆"
REACH_MARK = "["


def _shown(text: str, limit: int = 12) -> str:
    """A token's text, visible: escapes for whitespace, trimmed."""
    return repr(text)[1:-1][:limit] or "∅"


@dataclass
class PanelView:
    """What the panel shows: every layer (sampled to fit), or one layer's KV heads in detail."""

    layer: int | None = None


def strip_text(
    cells: list[tuple[int, int]],
    tokens_per_cell: float,
    holds_tokens: list[bool] | None = None,
    recalled: list[int] | None = None,
) -> Text:
    """One KV head's timeline: green ▒ = recent window, yellow/red blocks = heavy hitters (taller = more),
    magenta ◆ = tokens recalled from the archive in the last step (`recalled`: count per cell; it wins over
    the other marks of its cell), dim · = evicted, blank = a cell that covers no token (a conversation
    shorter than the strip)."""
    text = Text()
    for number, (heavy, recent) in enumerate(cells):
        if holds_tokens is not None and not holds_tokens[number]:
            text.append(" ")
        elif recalled is not None and recalled[number]:
            text.append(RECALL_MARK, style="bold magenta")
        elif recent:
            text.append("▒", style="green")
        elif heavy:
            share = min(heavy / max(tokens_per_cell, 1.0), 1.0)
            shade = HEAVY_SHADES[min(int(share * len(HEAVY_SHADES)), len(HEAVY_SHADES) - 1)]
            text.append(shade, style="bold red" if share >= 0.5 else "yellow")
        else:
            text.append("·", style="dim")
    return text


def turn_ruler(
    turn_starts: list[tuple[str, int]], tokens_seen: int, width: int, archive_oldest: int | None = None
) -> Text:
    """A line under the strips' axis: `u`/`a` where each user / assistant turn starts. With an archive
    (`archive_oldest`: its oldest token), `[` marks how far back recall reaches and the cells before it,
    gone for good, are dim `╌`; the reach mark wins over a turn start in the same cell."""
    cells = ["─"] * width
    for role, start in turn_starts:
        if tokens_seen:
            cells[min(start * width // tokens_seen, width - 1)] = role[0]
    if archive_oldest is None or not tokens_seen:
        return Text("".join(cells), style="cyan")
    reach = min(archive_oldest * width // tokens_seen, width - 1)
    gone = "".join("╌" if cell == "─" else cell for cell in cells[:reach])
    return Text.assemble((gone, "dim"), (REACH_MARK, "bold magenta"), ("".join(cells[reach + 1 :]), "cyan"))


def heavy_slots_line(summary: dict) -> Text | None:
    """What the heavy slots hold (`HeavySlotStats.summary()`), in one line; None with no heavy entries."""
    if summary.get("heavy_mean_age") is None:
        return None
    share = summary.get("heavy_attention_share")
    return Text.assemble(
        ("heavy slots: ", "bold"),
        f"age {summary['heavy_mean_age']:,.0f} tok (median {summary['heavy_median_age']:,.0f}) · ",
        f"sinks kept {summary['sinks_kept']:.1f}/{SINK_TOKENS} · ",
        f"last query's attention on them {share:.0%}" if share is not None else "",
    )


def token_runs(tokens) -> list[tuple[int, int]]:
    """Sorted token indices as runs of consecutive ones: [3, 4, 5, 9] -> [(3, 5), (9, 9)]."""
    runs: list[tuple[int, int]] = []
    for token in sorted(tokens):
        if runs and token == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], token)
        else:
            runs.append((token, token))
    return runs


def recalled_run(first: int, last: int, decode) -> str:
    """`first–last` (or `first`) and the run's first words, for `/panel layer N`."""
    text = "".join(decode(token) for token in range(first, min(last, first + 5) + 1))
    return f"{first}–{last} {_shown(text)}" if last > first else f"{first} {_shown(text)}"


def recall_line(snapshot: CacheSnapshot) -> Text | None:
    """Recalled tokens in the last step and the archive's reach, in one line; None without recall."""
    if snapshot.recalled is None:
        return None
    per_head = float(snapshot.recalled_per_head().double().mean())
    oldest = snapshot.archive_oldest or 0
    return Text.assemble(
        ("recall: ", "bold"),
        (RECALL_MARK, "bold magenta"),
        f" {per_head:,.1f}/{snapshot.recall_slots} per KV head last step · ",
        (REACH_MARK, "bold magenta"),
        f" reaches token {oldest:,} ({max(snapshot.tokens_seen - oldest, 0):,} archived)",
    )


def layer_list(layers: list[int]) -> str:
    """Layer numbers as runs: [0, 1, 2, 4] -> "L0–2, L4"."""
    return ", ".join(f"L{a}–{b}" if b > a else f"L{a}" for a, b in token_runs(layers))


def window_line(snapshot: CacheSnapshot) -> Text | None:
    """Which layers take the budget and which attend over their own sliding window, with the slots those
    hold beside the budget; None for a model whose layers all attend globally."""
    if not snapshot.windowed:
        return None
    windows = [layer for layer in range(snapshot.n_layers) if snapshot.is_window(layer)]
    budgeted = [layer for layer in range(snapshot.n_layers) if not snapshot.is_window(layer)]
    return Text.assemble(
        ("layers: ", "bold"),
        f"budget on {len(budgeted)} global ({layer_list(budgeted)}) · ",
        ("win", "green"),
        f"dow on {len(windows)} ({layer_list(windows)}): {snapshot.window_slots} slots/head each beside it",
    )


def render_panel(
    snapshot: CacheSnapshot,
    view: PanelView,
    width: int,
    height: int,
    decode=None,
    turn_starts: list[tuple[str, int]] = (),
    tokens_per_s: float = 0.0,
) -> Group:
    """The panel as lines of text, at most `height` lines and `width` columns."""
    recalls = snapshot.recalled is not None
    strip_width = max(10, width - LABEL_WIDTH - TAIL_WIDTH - (RECALL_TAIL_WIDTH if recalls else 0) - 2)
    tokens_per_cell = snapshot.tokens_seen / strip_width if snapshot.tokens_seen else 1.0
    lines: list[Text] = []
    heavy_slots = max(snapshot.budget - snapshot.recent, 0)
    share = snapshot.cache_bytes / snapshot.full_kv_bytes if snapshot.full_kv_bytes else 0.0
    recall_slots = snapshot.recall_slots
    split = f"{heavy_slots} heavy + {snapshot.recent} recent" + (
        f" + {recall_slots} recalled" if recalls else ""
    )
    if snapshot.pinned:  # pinned entries (the chat's template) sit inside the resident slots
        split += f"; {snapshot.pinned} pinned"
    header = Text.assemble(
        ("h2o cache ", "bold"),
        f"{snapshot.policy} · budget {snapshot.budget + recall_slots} ({split}) · ",
        f"tokens 0–{max(snapshot.tokens_seen - 1, 0):,} on positions 0–{max(snapshot.length - 1, 0)} · ",
        f"{snapshot.slots} slots/head",
    )
    totals = Text.assemble(
        f"cache {size(snapshot.cache_bytes)} vs full KV {size(snapshot.full_kv_bytes)} ",
        (f"({share:.0%})" if snapshot.full_kv_bytes else "", "bold"),
        f" · evictions {snapshot.evictions:,}/head · {tokens_per_s:,.1f} tok/s",
    )
    lines += [header, totals]
    windows_line = window_line(snapshot)
    if windows_line is not None:
        lines.append(windows_line)
    heavy_line = heavy_slots_line(snapshot.heavy_summary)
    if heavy_line is not None:
        lines.append(heavy_line)
    recalled_line = recall_line(snapshot)
    if recalled_line is not None:
        lines.append(recalled_line)
    ruler = turn_ruler(list(turn_starts), snapshot.tokens_seen, strip_width, snapshot.archive_oldest)
    lines.append(Text(" " * LABEL_WIDTH) + ruler)
    footer = footer_lines(snapshot, width, decode, recalls)
    if view.layer is not None:
        layers = [min(max(view.layer, 0), snapshot.n_layers - 1)]
    else:
        room = (height - len(lines) - len(footer)) // snapshot.n_kv_heads
        if room < snapshot.n_layers:  # one line more says how many layers are shown
            room = max(1, (height - len(lines) - len(footer) - 1) // snapshot.n_kv_heads)
        step = max(1, -(-snapshot.n_layers // room))
        layers = list(range(0, snapshot.n_layers, step))
    heavy_cells, recent_cells = snapshot.strips(strip_width)
    holds_tokens = snapshot.holds_tokens(strip_width)
    recall_cells = snapshot.recall_strips(strip_width) if recalls else None
    recalled_per_head = snapshot.recalled_per_head().tolist()
    heavy_kept = heavy_cells.sum(-1).tolist()
    all_kept = (heavy_cells + recent_cells).sum(-1).tolist()
    for layer in layers:
        for head in range(snapshot.n_kv_heads):
            cells = list(
                zip(heavy_cells[layer, head].tolist(), recent_cells[layer, head].tolist(), strict=True)
            )
            row = Text(f"L{layer:<2} h{head:<3}"[:LABEL_WIDTH].ljust(LABEL_WIDTH), style="bold")
            recalled = recall_cells[layer, head].tolist() if recalls else None
            row += strip_text(cells, tokens_per_cell, holds_tokens, recalled)
            kept, n_heavy = all_kept[layer][head], heavy_kept[layer][head]
            if snapshot.is_window(layer):  # its own window: no budget, no heavy hitters
                row += Text(f" {kept:>4}/{snapshot.window_slots:<4}") + Text("  win", style="green")
            else:
                row += Text(f" {kept:>4}/{snapshot.budget:<4} {n_heavy:>4}h")
            if recalls:
                row += Text(f" {recalled_per_head[layer][head]:>4}r")
            head_bytes = (
                snapshot.window_bytes_per_head if snapshot.is_window(layer) else snapshot.bytes_per_head
            )
            row += Text(f" {size(head_bytes):>9}")
            lines.append(row)
            heavy = snapshot.kept(layer, head)[0] if view.layer is not None else []
            if view.layer is not None and decode is not None and heavy:
                scores = snapshot.scores[layer, head]
                index = snapshot.token_index[layer, head]
                heavy_set = set(heavy)
                order = [int(i) for i in scores.argsort(descending=True) if int(index[i]) in heavy_set][:6]
                words = " ".join(f"{_shown(decode(int(index[i])))}@{int(index[i])}" for i in order)
                lines.append(Text(" " * LABEL_WIDTH + "top: " + words, style="dim"))
            if view.layer is not None and decode is not None and recalls:
                runs = token_runs(int(t) for t in snapshot.recalled[layer, head] if t >= 0)
                if runs:
                    words = "  ".join(recalled_run(first, last, decode) for first, last in runs[:6])
                    lines.append(Text(" " * LABEL_WIDTH + "recalled: " + words, style="dim"))
    if view.layer is None and len(layers) < snapshot.n_layers:
        lines.append(
            Text(
                f"showing {len(layers)} of {snapshot.n_layers} layers; /panel layer N shows one", style="dim"
            )
        )
    lines += footer
    return Group(*[line[:width] if len(line) > width else line for line in lines[:height]])


def footer_lines(snapshot: CacheSnapshot, width: int, decode, recalls: bool) -> list[Text]:
    """The lines under the rows: the tokens most kept (with `decode`) and the legend (on two lines when
    recall's does not fit beside it)."""
    footer: list[Text] = []
    if decode is not None:
        top = snapshot.top_heavy(8)
        if top:
            total = snapshot.n_layers * snapshot.n_kv_heads
            words = "  ".join(f"{_shown(decode(index))} {kept}/{total}" for index, kept in top)
            footer.append(Text.assemble(("most kept: ", "bold"), words))
    legend = Text.assemble(
        ("▒", "green"),
        " recent  ",
        ("▅", "yellow"),
        " heavy hitters  ",
        ("·", "dim"),
        " evicted  ",
        ("u a", "cyan"),
        " turn starts",
    )
    if recalls:  # on the same line when it fits, else on its own
        recall_legend = Text.assemble(
            (RECALL_MARK, "bold magenta"),
            " recalled last step  ",
            (REACH_MARK, "bold magenta"),
            " recall reaches back to here",
        )
        if len(legend) + 2 + len(recall_legend) <= width:
            legend += Text("  ") + recall_legend
        else:
            footer.append(recall_legend)
    footer.append(legend)
    return footer


class PreRendered:
    """Lines already rendered to segments: redrawing them costs ~5 ms instead of ~35 ms for the panel."""

    def __init__(self, lines: list[list[Segment]]) -> None:
        self.lines = lines

    def __rich_console__(self, console: Console, options) -> Iterator[Segment]:
        for line in self.lines:
            yield from line
            yield Segment.line()


class LivePanel:
    """rich Live on stderr, redrawn from the decode loop between tokens.

    A snapshot of the cache is taken and rendered to segments every `1 / snapshot_hz` seconds; in between,
    redraws (`refresh_hz`, for the streaming answer) only replay those segments. Drawing runs in the decode
    thread, so it never contends with decoding for the GIL, and costs nothing per token but a clock read."""

    def __init__(
        self, session, console: Console, view: PanelView, refresh_hz: float = 2.0, snapshot_hz: float = 1 / 3
    ) -> None:
        self.session = session
        self.console = console
        self.view = view
        self.period = 1.0 / snapshot_hz
        self.draw_period = 1.0 / refresh_hz
        self._panel: PreRendered | None = None
        self.answer = ""
        self.snapshot = take_snapshot(session.cache)
        self.taken = self.drawn = time.perf_counter()
        self.started = self.taken
        self.live = Live(
            get_renderable=self._render,
            console=console,
            auto_refresh=False,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )

    def __enter__(self) -> LivePanel:
        self.started = time.perf_counter()
        self.live.start(refresh=True)
        return self

    def __exit__(self, *exc) -> None:
        self.tick("", force=True)
        self.live.stop()

    def tick(self, piece: str, force: bool = False) -> None:
        self.answer += piece
        now = time.perf_counter()
        if force or now - self.taken >= self.period:
            self.snapshot = take_snapshot(self.session.cache)
            self.taken = now
            self._panel = None
        if force or now - self.drawn >= self.draw_period:
            self.drawn = now
            self.live.refresh()

    def _render(self):
        width, height = self.console.width, self.console.height
        if self._panel is None:
            group = self._build(width, height)
            self._panel = PreRendered(
                self.console.render_lines(group, self.console.options.update(width=width))
            )
        answer_lines = Text(self.answer).wrap(self.console, width)
        tail = answer_lines[-3:] if len(answer_lines) else []
        return Group(self._panel, Text("─" * min(width, 40), style="dim"), *tail)

    def _build(self, width: int, height: int) -> Group:
        """The panel for the latest snapshot: built once per snapshot, not per refresh."""
        elapsed = time.perf_counter() - self.started
        rate = self.session.last.generated_tokens / elapsed if elapsed > 0 else 0.0
        return render_panel(
            self.snapshot,
            self.view,
            width,
            max(height - 4, 6),
            self.session.decode_token,
            [(turn.role, turn.start) for turn in self.session.turns],
            rate,
        )

"""Capture the chat panel as an SVG: a real short chat with the embedded model, then the panel `/panel` prints.

Usage: python scripts/capture_panel.py [--out docs/figs/panel.svg] [--budget 128] [--policy h2o]
           [--width 110] [--height 24] [--new-tokens 96]

The panel is `h2o_cli.cli.panel.render_panel` over a snapshot of the session's cache, exactly what `h2o chat`
draws (live on stderr while an answer streams, once on `/panel`); rich records it and writes the SVG. Greedy
decoding, so the rows repeat from run to run on the same code and model; the tok/s figure does not.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TURNS = ("Write a short poem about the sea.", "Now give me three facts about whales.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "figs" / "panel.svg")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--width", type=int, default=110)
    parser.add_argument(
        "--height", type=int, default=26, help="lines of the panel (layers are sampled to fit)"
    )
    parser.add_argument("--new-tokens", type=int, default=96, help="the most tokens per answer")
    args = parser.parse_args()

    sys.path[:0] = [str(REPO), str(REPO / "kernels")]
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from rich.console import Console

    from h2o_cli.chat import ChatSession, take_snapshot
    from h2o_cli.cli.chat import default_chunk
    from h2o_cli.cli.common import quiet_transformers
    from h2o_cli.cli.panel import PanelView, render_panel
    from h2o_cli.config import CacheSettings
    from h2o_cli.generation import Sampling
    from h2o_cli.models import context_window, load_model

    quiet_transformers()
    model, tokenizer = load_model(args.model)
    settings = CacheSettings(budget=args.budget, policy=args.policy, chunk=default_chunk(args.policy))
    session = ChatSession(
        model, tokenizer, settings.resolved(context_window(model)), Sampling(max_new_tokens=args.new_tokens)
    )
    for text in TURNS:
        answer = session.ask(text)
        print(f">>> {text}\n{answer}\n", file=sys.stderr)
    panel = render_panel(
        take_snapshot(session.cache),
        PanelView(),
        args.width,
        args.height,
        session.decode_token,
        [(turn.role, turn.start) for turn in session.turns],
        session.last.tokens_per_s,
    )
    console = Console(
        record=True, width=args.width, file=io.StringIO(), force_terminal=True, color_system="truecolor"
    )
    console.print(panel)
    print(console.export_text(clear=False), end="")  # the same panel as text, on stdout
    args.out.parent.mkdir(parents=True, exist_ok=True)
    console.save_svg(str(args.out), title=f"h2o chat --budget {args.budget} --policy {args.policy} · /panel")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the heavy slots hold along a stream: per layer, the age of the heavy entries, the attention
sinks still kept and the share of the latest attention they get, sampled every N tokens; JSON and a plot.

Each run streams the same book's first --tokens tokens (as `h2o stream --ppl` does) with one setting of the
cache, given as `policy[:field=value,...]` (fields of `CacheSettings`):

    python -m research.heavy_age --tokens 20000 --budget 410 --runs h2o h2o:score_decay=0.995 sink \
        --json docs/results/heavy_age_war_and_peace.json --fig docs/figs/heavy_age_war_and_peace.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from h2o_cli.analysis import SINK_TOKENS, heavy_slot_stats
from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.models import load_model
from h2o_cli.streaming import stream_perplexity
from h2o_cli.textio import open_source, text_blocks, token_stream

BOOK = "gutenberg_books/war_and_peace_pg2600.txt"  # under the data folder ($H2O_DATA)


def label(spec: str) -> str:
    return spec.replace(":", " ").replace("score_decay=", "γ=").replace("h2o_sinks=", "sinks=")


def stream_run(model, tokenizer, book: Path, settings: CacheSettings, tokens: int, every: int) -> list[dict]:
    """Stream the book through a cache with `settings`; a sample every `every` tokens (and at the end)."""
    cache = H2OCache(model, settings)
    samples: list[dict] = []
    last = {"tokens": 0, "nll": 0.0, "predictions": 0}

    def sample(stats) -> None:
        if stats.tokens - last["tokens"] < every and stats.tokens < tokens:
            return
        heavy = heavy_slot_stats(cache)
        window = stats.predictions - last["predictions"]
        samples.append(
            {
                "tokens": stats.tokens,
                "ppl": stats.ppl,
                "window_ppl": math.exp((stats.nll - last["nll"]) / window) if window else None,
                **heavy.summary(),
                "layers": heavy.as_dict(),
            }
        )
        last.update(tokens=stats.tokens, nll=stats.nll, predictions=stats.predictions)
        print(
            f"  {stats.tokens:>7,} tok  ppl {stats.ppl:.3f}  heavy age {samples[-1]['heavy_mean_age']}  "
            f"sinks {samples[-1]['sinks_kept']}",
            file=sys.stderr,
            flush=True,
        )

    with open_source(str(book)) as source:
        pieces = token_stream(tokenizer, text_blocks(source, name=str(book)))
        stats = stream_perplexity(model, cache, pieces, settings.chunk, tokens, sample)
    stats.reraise()
    return samples


def plot(runs: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    first_spec, first = next(iter(runs.items()))
    ax = axes[0, 0]
    tokens = [sample["tokens"] for sample in first]
    n_layers = len(first[0]["layers"]["mean_age"])
    colours = plt.cm.viridis([layer / max(n_layers - 1, 1) for layer in range(n_layers)])
    for layer in range(n_layers):
        ax.plot(tokens, [s["layers"]["mean_age"][layer] for s in first], color=colours[layer], lw=0.8)
    ax.plot(tokens, [t - 1 for t in tokens], "k:", lw=1, label="age of token 0")
    ax.set(title=f"{label(first_spec)}: mean age of heavy entries, per layer (dark = layer 0)",
           xlabel="tokens read", ylabel="tokens since arrival")  # fmt: skip
    ax.legend(loc="upper left")
    panels = [
        (axes[0, 1], "heavy_mean_age", "mean age of heavy entries (mean over layers)"),
        (axes[1, 0], "sinks_kept", f"first {SINK_TOKENS} tokens still held (mean over layers and heads)"),
        (axes[1, 1], "heavy_attention_share", "share of the latest query's attention on heavy entries"),
    ]
    for ax, key, name in panels:
        for spec, samples in runs.items():
            ax.plot([s["tokens"] for s in samples], [s[key] for s in samples], marker=".", label=label(spec))
        ax.set(title=name, xlabel="tokens read")
        ax.legend()
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--book", type=Path, default=None, help=f"text file (default $H2O_DATA/{BOOK})")
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument(
        "--every", type=int, default=1024, help="sample every N tokens (rounded up to chunks)"
    )
    parser.add_argument("--budget", type=int, default=410, help="tokens per KV head (410 = 5%% of 8,192)")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--runs", nargs="+", default=["h2o"], help="policy[:field=value,...] per run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--json", type=Path, required=True, help="written after every run (a cut run keeps them)"
    )
    parser.add_argument("--fig", type=Path, default=None)
    args = parser.parse_args()
    book = args.book or Path(os.environ.get("H2O_DATA", "")) / BOOK
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    runs = {}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for spec in args.runs:
        print(f"{spec}:", file=sys.stderr, flush=True)
        settings = CacheSettings.from_spec(spec, budget=args.budget, chunk=args.chunk)
        started = time.perf_counter()
        runs[spec] = stream_run(model, tokenizer, book, settings, args.tokens, args.every)
        runs[spec][-1]["seconds"] = round(time.perf_counter() - started, 1)
        report = {
            "book": book.name,
            "model": args.model,
            "tokens": args.tokens,
            "budget": args.budget,
            "chunk": args.chunk,
            "threads": args.threads,
            "device": str(model.device),
            "dtype": str(model.dtype),
            "runs": runs,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.fig:
        plot(runs, args.fig, f"{book.name}, budget {args.budget}, chunk {args.chunk}, {args.model}")
    print(f"wrote {args.json}" + (f" and {args.fig}" if args.fig else ""), file=sys.stderr)


if __name__ == "__main__":
    main()

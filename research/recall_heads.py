"""Let only the best-ranked KV heads recall: the passkey grid with recall limited to the K best heads of an
`h2o calibrate` ranking (rows labelled `recall@headsK`).

    python -m research.recall_heads docs/results/recall/retrieval_heads_2048.json:9 --lengths 1536 \
        --depths 10 --seeds 3 --budgets 0.1 --policies recall --out docs/results/recall/passkey_window_heads9_1536.jsonl

`RecallHeads` wraps `PageArchive.choose` and `choose_one` (for the whole process) so every other head's
recalled slots stay empty: it attends over its resident set S alone. Runs the torch step (the C step chooses
in C).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from h2o_cli.cache.recall.archive import PageArchive
from research.recall_probe import steps_keep_valid_only


class RecallHeads:
    """Only the `top` KV heads of a ranking (`h2o calibrate --out`'s file) recall. `attach(cache)` says which
    layer each archive serves."""

    def __init__(self, ranking: Path, top: int) -> None:
        self.top = top
        self.heads: dict[int, list[int]] = defaultdict(list)
        for row in json.loads(Path(ranking).read_text())["ranked"][:top]:
            self.heads[row["layer"]].append(row["kv_head"])
        self.recalls: dict[int, torch.Tensor] = {}  # id(archive) -> [n_kv_heads] bool, set by `attach`
        choose, choose_one = PageArchive.choose, PageArchive.choose_one

        def chunk(archive, *args, **kwargs):
            return self.only(archive, *choose(archive, *args, **kwargs))

        def step(archive, *args, **kwargs):
            return self.only(archive, *choose_one(archive, *args, **kwargs))

        PageArchive.choose, PageArchive.choose_one = chunk, step
        steps_keep_valid_only()  # or the heads that do not recall would recall at every answer step

    def attach(self, cache) -> None:
        """Each recalling layer's mask of the KV heads that recall, made once per cache."""
        self.recalls = {}
        for number, layer in enumerate(cache.layers):
            if hasattr(layer, "archive"):
                recalls = torch.zeros(layer.archive.n_kv_heads, dtype=torch.bool)
                recalls[self.heads.get(number, [])] = True
                self.recalls[id(layer.archive)] = recalls

    def only(self, archive, chosen: torch.Tensor, valid: torch.Tensor):
        """chosen, valid [n_kv_heads, slots] -> the same, `valid` cleared in the heads that do not recall."""
        return chosen, valid & self.recalls[id(archive)].unsqueeze(1)


def main() -> None:
    from h2o_cli.config import split_run_specs
    from h2o_cli.eval.passkey import haystack_text
    from h2o_cli.eval.passkey_grid import Grid, even_depths, run_grid, summary
    from h2o_cli.models import load_model

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "heads", metavar="RANKING:K", help="a ranking file and how many of its best heads recall"
    )
    parser.add_argument("--lengths", default="1536")
    parser.add_argument("--depths", type=int, default=10)
    parser.add_argument("--depth-list", default=None)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seed-from", type=int, default=0)
    parser.add_argument("--budgets", default="0.1")
    parser.add_argument("--policies", default="recall")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--haystack", default=None, help="text file or folder (default: the data folder's essays)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    ranking, _, top = args.heads.rpartition(":")
    torch.set_num_threads(args.threads)
    depths = [int(d) for d in args.depth_list.split(",")] if args.depth_list else even_depths(args.depths)
    grid = Grid(
        lengths=tuple(int(n) for n in args.lengths.split(",")), depths=tuple(depths), seeds=args.seeds,
        seed_from=args.seed_from, budgets=tuple(float(b) for b in args.budgets.split(",")),
        policies=tuple(split_run_specs(args.policies)), chunk=args.chunk,
        threads=args.threads, heads=RecallHeads(Path(ranking), int(top)),
    )  # fmt: skip
    essays = haystack_text(args.haystack)
    model, tokenizer = load_model(args.model, device="cpu", dtype="float32")
    run_grid(model, tokenizer, essays, grid, args.out)
    print(summary([args.out]))


if __name__ == "__main__":
    main()

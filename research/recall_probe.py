"""Why `recall` misses a passkey in longer texts: at the question, where is the needle?

The passkey run of `h2o passkey` (same haystacks, same question after the text), with `PageArchive.choose`
watched while the question's chunk is read. For every layer and KV head it records where the needle's tokens
are (resident in S, recalled into R, or left in the archive) and how the needle's best page ranks among the
candidate pages twice: by the summary bound the policy uses, and by the exact best logit `max q.k` over the
page's keys (the same unrotated dot product the bound bounds). The pages the recall slots take are the first
`recall_slots / page_size` of that order. So a miss is either the summary's (the exact rank was inside, the
bound's was not) or the score's (neither was: the question's queries do not single the needle out).

    python -m research.recall_probe --lengths 1536,4096 --depths 5 --seeds 2 --budget 0.1 \
        --out docs/results/recall/probe.jsonl
    python -m research.recall_probe --summary docs/results/recall/probe.jsonl    # the table
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from h2o_cli.cache.positions import rotate
from h2o_cli.cache.recall import layer as recall_layer
from h2o_cli.cache.recall.archive import PageArchive, best_page_bound
from h2o_cli.config import CacheSettings
from h2o_cli.eval.passkey import MAX_NEW_TOKENS, QUESTION, haystacks, needle_tokens


def steps_keep_valid_only() -> None:
    """For a wrapper that clears some of the choice's `valid` slots: every answer step then reads only the slots
    `valid` keeps. (A step whose archive can fill every recall slot takes R as full and reads `chosen` whatever
    `valid` says, which the page choice itself never contradicts.)"""
    recall_layer.recall_is_full = lambda held, length, slots: False


class Probe:
    """Wraps `PageArchive.choose`; records one row per (layer, KV head) for calls at or after `question`."""

    def __init__(self) -> None:
        self.question = math.inf
        self.group = 1  # query heads per KV head: a chunk of c tokens brings group * c queries
        self.needle = self.key = torch.empty(0, dtype=torch.int64)  # stream indices: the sentence, the digits
        self.rows: list[dict] = []
        self.layer_of: dict[int, int] = {}
        self.rope = None  # the model's `Rope` (its tables), set per run
        inner = PageArchive.choose

        def choose(archive, query, resident, before, slots, chunk=1):
            chosen, valid = inner(archive, query, resident, before, slots, chunk)
            if before + query.shape[1] // self.group > self.question:  # the chunk holds question tokens
                self.record(archive, query, resident, before, slots, chosen, valid)
            return chosen, valid

        PageArchive.choose = choose

    def record(self, archive, query, resident, before, slots, chosen, valid) -> None:
        layer = self.layer_of.setdefault(id(archive), len(self.layer_of))
        used = min(archive.pages, -(-archive.tokens // archive.page_size))
        size = archive.page_size
        index = archive.token_index[: used * size]
        archived = (index >= 0) & (index < before)
        bound = best_page_bound(query.float(), archive.summary[:, :used])  # [n_kv, used]
        keys = archive.keys[:, : used * size].float()  # RAM archive in the compute dtype
        exact = torch.einsum("hmd,htd->hmt", query.float(), keys).amax(dim=1)  # [n_kv, tokens]
        # The same with RoPE at the original positions (query i of the chunk at `before + i % chunk`, each key at
        # its token index): what a position-aware page score would rank by.
        chunk = query.shape[1] // self.group
        cos, sin = self.rope.table(before + chunk, torch.float32, query.device)
        at = before + torch.arange(query.shape[1], device=query.device) % chunk
        where = index.clamp_min(0)
        rotated = torch.einsum(
            "hmd,htd->hmt", rotate(query.float(), cos[at], sin[at]), rotate(keys, cos[where], sin[where])
        ).amax(dim=1)
        recalled = torch.where(valid, archive.token_index[chosen], -1)
        take = max(1, slots // size)  # pages the recall slots hold
        for head in range(archive.n_kv_heads):
            in_s = torch.isin(self.needle, resident[head])
            in_r = torch.isin(self.needle, recalled[head])
            key_in = torch.isin(self.key, resident[head]) | torch.isin(self.key, recalled[head])
            candidate = archived & ~torch.isin(index, resident[head])
            page_ok = candidate.view(used, size).any(dim=1)
            needle_page = torch.isin(index, self.needle).view(used, size).any(dim=1) & page_ok
            row = {"layer": layer, "head": head, "needle": len(self.needle), "in_s": int(in_s.sum()),
                   "in_r": int(in_r.sum()), "key": len(self.key), "key_in": int(key_in.sum()), "candidate_pages": int(page_ok.sum()), "take": take}  # fmt: skip
            if needle_page.any():
                exact_page = exact[head].masked_fill(~candidate, -math.inf).view(used, size).amax(dim=1)
                rotated_page = rotated[head].masked_fill(~candidate, -math.inf).view(used, size).amax(dim=1)
                for name, score in (("bound", bound[head]), ("exact", exact_page), ("rotated", rotated_page)):
                    score = score.masked_fill(~page_ok, -math.inf)
                    best = score[needle_page].max()
                    row[f"rank_{name}"] = int((score > best).sum())  # pages ranked above the needle's best
            self.rows.append(row)


def summarise(rows: list[dict], take: int) -> dict:
    """Shares over (layer, KV head) of the question's chunk."""
    covered = [(r["in_s"] + r["in_r"]) / r["needle"] for r in rows]
    ranked = [r for r in rows if "rank_bound" in r]
    return {
        "needle_attendable": statistics.mean(covered),
        "needle_in_s": statistics.mean(r["in_s"] / r["needle"] for r in rows),
        "needle_recalled": statistics.mean(r["in_r"] / r["needle"] for r in rows),
        "key_attendable": statistics.mean(r["key_in"] / r["key"] for r in rows),
        "heads_with_a_key_token": statistics.mean(r["key_in"] > 0 for r in rows),
        "heads_with_needle_candidates": len(ranked) / len(rows),
        "bound_inside": statistics.mean(r["rank_bound"] < take for r in ranked) if ranked else None,
        "exact_inside": statistics.mean(r["rank_exact"] < take for r in ranked) if ranked else None,
        "median_rank_bound": statistics.median(r["rank_bound"] for r in ranked) if ranked else None,
        "median_rank_exact": statistics.median(r["rank_exact"] for r in ranked) if ranked else None,
        "rotated_inside": statistics.mean(r["rank_rotated"] < take for r in ranked) if ranked else None,
        "median_rank_rotated": statistics.median(r["rank_rotated"] for r in ranked) if ranked else None,
        "candidate_pages": statistics.median(r["candidate_pages"] for r in rows),
    }


def table(paths: list[Path]) -> str:
    """The markdown table of probe lines: per text length, means over runs of the per-run shares (rank
    columns: over runs where the needle's pages were candidates, i.e. not all resident)."""
    lines = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    out = [
        "| text tokens | runs | answered | heads holding a passkey token | needle page in the recall cut: "
        "exact / bound / exact with RoPE | needle page rank: exact / bound / exact with RoPE (median) | "
        "candidate pages | pages recalled |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for length in sorted({line["length"] for line in lines}):
        runs = [line for line in lines if line["length"] == length]
        ranked = [line for line in runs if line["bound_inside"] is not None]

        def mean(key: str, group: list[dict]) -> float | None:
            values = [line[key] for line in group if line.get(key) is not None]
            return statistics.mean(values) if values else None

        def median(key: str, group: list[dict]) -> float | None:
            values = [line[key] for line in group if line.get(key) is not None]
            return statistics.median(values) if values else None

        def rotated(value, spec: str) -> str:  # lines from before the RoPE column have none
            return "–" if value is None else format(value, spec)

        pages = statistics.median(line["candidate_pages"] for line in runs)
        out.append(
            f"| {length:,} | {len(runs)} | {sum(line['correct'] for line in runs)}/{len(runs)} | "
            f"{mean('heads_with_a_key_token', runs):.0%} | {mean('exact_inside', ranked):.0%} / "
            f"{mean('bound_inside', ranked):.0%} / {rotated(mean('rotated_inside', ranked), '.0%')} | "
            f"{statistics.median(line['median_rank_exact'] for line in ranked):.0f} / "
            f"{statistics.median(line['median_rank_bound'] for line in ranked):.0f} / "
            f"{rotated(median('median_rank_rotated', ranked), '.0f')} | "
            f"{pages:,.0f} | "
            f"{runs[0].get('take', round(runs[0]['budget'] * 0.5) // 4):,} |"  # older lines: the defaults
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1536, 4096])
    parser.add_argument("--depths", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--budget", type=float, default=0.1, help="fraction of the text's tokens")
    parser.add_argument(
        "--policy", default="recall", help="a recall run spec, as h2o passkey --policies takes"
    )
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--summary", type=Path, nargs="+", help="print the table of these JSON-lines files")
    args = parser.parse_args()
    if args.summary:
        print(table(args.summary))
        return
    if args.out is None:
        parser.error("--out is required for a run")
    torch.set_num_threads(args.threads)

    from h2o_cli.cache import H2OCache
    from h2o_cli.eval.data import load_essays
    from h2o_cli.generation import Sampling, TextStreamer, generate_ids
    from h2o_cli.models import load_model
    from h2o_cli.prompting import read_then_answer
    from h2o_cli.streaming import prefill

    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32")
    essays = load_essays(None)
    probe = Probe()
    probe.group = model.config.num_attention_heads // model.config.num_key_value_heads
    depths = [round(5 + 90 * i / max(1, args.depths - 1)) for i in range(args.depths)]
    for length in args.lengths:
        for seed in range(args.seeds):
            for depth, key, text in haystacks(tokenizer, essays, length, depths, seed):
                started = time.perf_counter()
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                pieces = list(read_then_answer(tokenizer, [ids], QUESTION))
                budget = max(2, round(len(ids) * args.budget))
                settings = CacheSettings.from_spec(args.policy, budget=budget, chunk=args.chunk)
                cache = H2OCache(model, settings, span=sum(map(len, pieces)) + MAX_NEW_TOKENS)
                probe.rows, probe.layer_of, probe.rope = [], {}, cache.layers[0].rope
                needle, digits = needle_tokens(tokenizer, text, key, len(pieces[0]))
                probe.needle, probe.key = torch.tensor(needle), torch.tensor(digits)
                probe.question = sum(map(len, pieces[:-1]))  # the question's chunk(s) start here
                logits, stats = prefill(model, cache, pieces, settings.chunk)
                stats.reraise()
                rows = list(probe.rows)
                probe.question = math.inf
                streamer = TextStreamer(tokenizer)
                stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
                for token in generate_ids(
                    model, cache, logits, Sampling(max_new_tokens=MAX_NEW_TOKENS), stop
                ):
                    streamer.push(token)
                take = rows[0]["take"]
                line = {"length": length, "seed": seed, "depth": depth, "budget": budget, "policy": args.policy,
                        "take": take,
                        "correct": key in streamer.printed, "answer": streamer.printed.strip(),
                        "seconds": round(time.perf_counter() - started, 1), **summarise(rows, take)}  # fmt: skip
                print(json.dumps(line), flush=True)
                with args.out.open("a") as out:
                    out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()

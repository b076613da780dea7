"""The passkey grid with the needle made attendable by force: what `recall` would answer if its page choice
never missed the needle (is the miss the choice's, or the positions' and the rest of the context's?).

Each run is `h2o passkey`'s (same haystacks, the question after the text, greedy answer), with
`PageArchive.choose` (the question's chunk) and `PageArchive.choose_one` (every decode step, on the torch
step: `--kernels torch`, since the C step chooses inside C) wrapped: every archived token of the needle sentence that a KV head does not hold in S is put first into
its recall slots (the rest of R keeps the policy's order). `--mode natural` only records; `oracle` forces.
Per run it prints the share of (layer, KV head) holding a passkey digit token while the question is read and
at each answer step.

    python -m research.recall_oracle --length 1536 --mode oracle --out docs/results/recall/oracle_1536.jsonl
    python -m research.recall_oracle --length 1536 --mode oracle --policy recall:positions=original \
        --out docs/results/recall/oracle_1536.jsonl
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from h2o_cli.cache.recall.archive import PageArchive
from h2o_cli.config import CacheSettings
from h2o_cli.eval.passkey import MAX_NEW_TOKENS, QUESTION, haystacks, needle_tokens
from research.recall_probe import steps_keep_valid_only


class Oracle:
    """Wraps the page choice of every `PageArchive`; `needle`/`key`: stream indices of the needle sentence and
    of the passkey's digits; `question`: the first token of the question's chunk(s); `rest`: how many of the
    policy's chosen slots follow the forced needle (None: as many as R holds); without `force`, how many of
    the choice's slots stay (its first, the best pages; None: all); `share`: without `force`, only pages
    holding at least this share of the head's carried page scores stay (0: all)."""

    def __init__(
        self, force: bool, group: int, rest: int | None = None, share: float = 0.0, vote_pages: int = 0
    ) -> None:
        self.force, self.group, self.rest, self.share = force, group, rest, share
        self.vote_pages, self.votes, self.vote_max = vote_pages, {}, False
        self.voters: dict[int, list[int]] | None = None  # layer -> KV heads that vote (None: every head)
        self.layer_of: dict[int, int] = {}  # id(archive) -> layer number, for `voters`
        self.archives = None  # ids of the archives (layers) the needle is forced into; None: every one
        self.needle = self.key = torch.empty(0, dtype=torch.int64)
        self.question, self.phase, self.log = 0, "text", []
        choose, choose_one = PageArchive.choose, PageArchive.choose_one

        def chunk(archive, query, resident, before, slots, chunk=1, question=False):
            chosen, valid = choose(archive, query, resident, before, slots, chunk, question=question)
            # The question's chunk: asked as one (`question`), or a chunk of `chunk` tokens reaching it.
            if self.phase == "text" and (question or before + chunk > self.question):
                self.phase = "question"
            if self.phase == "question":
                chosen, valid = self.visit(archive, chosen, valid, resident)
            return chosen, valid

        def step(archive, query, resident, slots):
            chosen, valid = choose_one(archive, query, resident, slots)
            return self.visit(archive, chosen, valid, resident)

        PageArchive.choose, PageArchive.choose_one = chunk, step
        steps_keep_valid_only()  # or `oracleN` would read the choice's slots past its N at every answer step

    def start(self, needle: list[int], key: list[int], question: int) -> None:
        self.needle, self.key = torch.tensor(needle), torch.tensor(key)
        self.question, self.phase, self.log, self.votes = question, "text", [], {}

    def only_in(self, archives: set[int]) -> None:
        """Force the needle only into these archives (`id`s: their layers); the others keep the choice."""
        self.archives = archives

    def visit(self, archive, chosen, valid, resident):
        if self.force and (self.archives is None or id(archive) in self.archives):
            chosen, valid = self.forced(archive, chosen, valid, resident)
        elif (
            not self.force and self.rest is not None and not self.vote_pages
        ):  # the choice's first `rest` slots
            valid = valid & (torch.arange(valid.shape[1], device=valid.device) < self.rest)
        if not self.force and self.share:  # pages holding at least `share` of the head's carried score only
            scores = archive.carried.clamp_min(0)
            page_share = scores / scores.sum(dim=1, keepdim=True).clamp_min(1e-30)
            valid = valid & (page_share.gather(1, chosen // archive.page_size) >= self.share)
        if not self.force and self.vote_pages:
            chosen, valid = self.voted(archive, chosen, valid, resident)
        recalled = torch.where(valid, archive.token_index[chosen], -1)
        present = [torch.isin(self.key, torch.cat([resident[h], recalled[h]])) for h in range(len(chosen))]
        held = [bool(p.any()) for p in present]
        whole = [bool(p.all()) for p in present]
        ranks = self.key_page_ranks(archive) if self.phase == "question" else None
        self.log.append(
            (self.phase, sum(held), len(held), sum(whole), held, valid.sum(dim=1).tolist(), ranks)
        )
        return chosen, valid

    def key_page_ranks(self, archive) -> list[int] | None:
        """Per KV head, the rank (0 = best) of the best archived page holding a pass-key digit by the head's
        carried page score: how many pages score above it. None without carried scores or an archived digit."""
        carried = getattr(archive, "carried", None)
        if carried is None or not len(self.key):
            return None
        slots = self.key % archive.capacity
        pages = (slots[archive.token_index[slots] == self.key] // archive.page_size).unique()
        pages = pages[pages < carried.shape[1]]
        if not len(pages):
            return None
        best = carried[:, pages].amax(dim=1, keepdim=True)
        return (carried > best).sum(dim=1).tolist()

    def voted(self, archive, chosen, valid, resident):
        """Every head's R starts with the candidates of the `vote_pages` pages the whole model votes for: each
        (layer, KV head) gives each page its share of the head's carried score, summed over the heads of every
        layer's latest call (the layers before this one in this call, the others from the call before); then
        the head's own choice (its first `rest` slots)."""
        scores = archive.carried.clamp_min(0)
        share = scores / scores.sum(dim=1, keepdim=True).clamp_min(1e-30)
        if self.voters is not None:  # only the listed (layer, KV head) vote
            share = share[self.voters.get(self.layer_of[id(archive)], [])]
        if self.vote_max:  # a page's vote: its best share in any head (of any layer)
            self.votes[id(archive)] = share.amax(dim=0) if len(share) else torch.zeros(share.shape[1])
            total = torch.stack(list(self.votes.values())).amax(dim=0)
        else:
            self.votes[id(archive)] = share.sum(dim=0)
            total = sum(self.votes.values())
        size = archive.page_size
        # Only pages with a candidate in some head (archived before the question, not in that head's S).
        ring = archive.token_index.view(-1, size)
        outside = (ring >= 0) & (ring < self.question)
        outside = outside.unsqueeze(0) & ~torch.isin(ring, resident).unsqueeze(0)
        total = total.masked_fill(~outside.any(dim=2).any(dim=0)[: total.shape[0]], 0.0)
        top = torch.topk(total, self.vote_pages)
        pages = top.indices[top.values > 0]  # no vote yet (no voting layer read so far): none
        slots = (pages.unsqueeze(1) * size + torch.arange(size)).flatten()
        tokens = archive.token_index[slots]
        given = valid.tolist()
        chosen, valid = chosen.clone(), torch.zeros_like(valid)
        for head in range(chosen.shape[0]):
            usable = (tokens >= 0) & ~torch.isin(tokens, resident[head])
            need = slots[usable].tolist()
            own = [c for c, v in zip(chosen[head].tolist(), given[head], strict=True) if v and c not in need]
            take = (need + own[: self.rest])[: chosen.shape[1]]
            chosen[head, : len(take)] = torch.tensor(take, dtype=chosen.dtype)
            valid[head, : len(take)] = True
        return chosen, valid

    def forced(self, archive, chosen, valid, resident):
        """The needle's archived tokens first in every head's R (those not in S), then the policy's choice (its
        first `rest`)."""
        slots = self.needle % archive.capacity
        archived = archive.token_index[slots] == self.needle
        given = valid.tolist()  # the choice's own validity: the rest of R comes from its valid slots
        chosen, valid = chosen.clone(), torch.zeros_like(valid)
        for head in range(chosen.shape[0]):
            missing = archived & ~torch.isin(self.needle, resident[head])
            need = slots[missing].tolist()
            rest = [c for c, v in zip(chosen[head].tolist(), given[head], strict=True) if v and c not in need]
            take = (need + rest[: self.rest])[: chosen.shape[1]]
            chosen[head, : len(take)] = torch.tensor(take, dtype=chosen.dtype)
            valid[head, : len(take)] = True
        return chosen, valid

    def question_detail(self, layers: int) -> tuple[list[str], float]:
        """The question's last call: the (layer.KV head) holding a passkey digit, and the mean tokens recalled
        per (layer, KV head)."""
        rows = [row for row in self.log if row[0] == "question"][-layers:]
        heads = [
            f"{layer}.{head}" for layer, row in enumerate(rows) for head, held in enumerate(row[4]) if held
        ]
        counts = [count for row in rows for count in row[5]]
        return heads, round(sum(counts) / max(1, len(counts)), 1)

    def question_key_ranks(self, layers: int) -> dict[str, int]:
        """The question's last call: `key_page_ranks` of every (layer.KV head) that has them."""
        rows = [row for row in self.log if row[0] == "question"][-layers:]
        return {
            f"{layer}.{head}": rank
            for layer, row in enumerate(rows)
            if row[6] is not None
            for head, rank in enumerate(row[6])
        }

    def shares(self, layers: int, column: int = 1) -> tuple[float, list[float]]:
        """Share of (layer, KV head) holding a digit token (`column` 3: every digit token): over the question's
        chunk(s), and per answer step."""

        def share(rows):
            return round(sum(r[column] for r in rows) / max(1, sum(r[2] for r in rows)), 3)

        question = [row for row in self.log if row[0] == "question"]
        steps = [row for row in self.log if row[0] == "decode"]
        return share(question), [share(steps[i : i + layers]) for i in range(0, len(steps), layers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1536)
    parser.add_argument("--depths", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.1, help="fraction of the text's tokens")
    parser.add_argument("--policy", default="recall", help="a recall run spec, as h2o passkey")
    parser.add_argument("--mode", choices=("natural", "oracle"), default="oracle")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="JSON lines, appended")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from h2o_cli.cache import H2OCache
    from h2o_cli.eval.data import load_essays
    from h2o_cli.generation import Sampling, TextStreamer, generate_ids
    from h2o_cli.models import load_model
    from h2o_cli.prompting import read_then_answer
    from h2o_cli.streaming import prefill

    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32")
    essays = load_essays(None)
    oracle = Oracle(
        args.mode == "oracle", model.config.num_attention_heads // model.config.num_key_value_heads
    )
    depths = [round(100 * (i + 0.5) / args.depths) for i in range(args.depths)]
    for seed in range(args.seeds):
        for depth, key, text in haystacks(tokenizer, essays, args.length, depths, seed):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            pieces = list(read_then_answer(tokenizer, [ids], QUESTION))
            settings = CacheSettings.from_spec(
                args.policy, budget=max(2, round(len(ids) * args.budget)), chunk=args.chunk
            )
            settings = replace(settings, kernels="torch")  # decode steps through `choose_one`
            cache = H2OCache(model, settings, span=sum(map(len, pieces)) + MAX_NEW_TOKENS)
            oracle.start(*needle_tokens(tokenizer, text, key, len(pieces[0])), sum(map(len, pieces[:-1])))
            logits, stats = prefill(model, cache, pieces, settings.chunk)
            stats.reraise()
            oracle.phase = "decode"
            streamer = TextStreamer(tokenizer)
            stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
            for token in generate_ids(model, cache, logits, Sampling(max_new_tokens=MAX_NEW_TOKENS), stop):
                streamer.push(token)
            question, steps = oracle.shares(len(cache.layers))
            line = {"length": args.length, "seed": seed, "depth": depth, "budget": args.budget,
                    "policy": args.policy, "mode": args.mode, "correct": key in streamer.printed,
                    "answer": streamer.printed.strip(), "question_heads_with_key": question,
                    "answer_heads_with_key": steps}  # fmt: skip
            print(json.dumps(line), flush=True)
            if args.out:
                with args.out.open("a") as out:
                    out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()

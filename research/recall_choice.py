"""Which page choice finds a passkey past the window? Read each haystack once, then ask under every variant.

The passkey haystacks of `h2o passkey` (the needle at a depth of a text longer than the model's window,
the question after it). Each haystack's text is read once through a `recall` cache; its state is kept
(`H2OCache.state`), and for every variant the cache is put back to it and the question is read and answered
(greedy) with the variant's page choice. So every variant sees the same resident set and the same archive,
and a haystack costs one read however many variants are tried. The text is read with blocks of `--block`
tokens; a variant with pages of P tokens groups them P / block at a time (the summaries are the same), so
pages and blocks can be compared without reading again. Variants (`--variants`, comma-separated):

- `pN`: pages of N tokens, each ranked by its best block (N = block: today's pages);
- `pN-votes`: the same, every KV head of a layer taking the pages in one shared order: a page's place is its
  best rank in any head of the layer (the heads that single the needle out lend it to the others);
- `pN-exact`: pages ranked by the best exact `q.k` of their keys (no summary), `pN-mass`: by the attention mass
  the queries put on them, each query's softmax over every archived key; either may add `-votes`;
- `-wideN` (with any score): a page scores as the best page within N pages of it, so a hit is read back with
  the pages around it (a span, as ReAttention widens each hit);
- `-fwdN` (with any score): a page scores as the best of itself and the N pages before it, so a hit is read
  back with the text that follows it (what an answer copies next);
- `-keepN` (with `mass`): a page's score carried from step to step, each step's mass added to the last
  score times N/10, so a page the question found stays while the answer is written;
- `pN-shortK`: the attention mass inside a shortlist, the K pages with the best summary bound per KV head
  (a two-level choice: summaries first, then the keys of the best pages only);
- `-tailN`: a chunk (the question) scores with its last N tokens' queries only;
- `-qall`: the question scores every page's mass (no shortlist), answer steps as the archive is set;
  `-qlistN`: the same, and each answer step scores the N pages its carried scores rank best (the question's
  choice is the answer's shortlist) instead of the summaries' shortlist;
- `-firstN` (with any score): only the choice's first N slots (its best pages) are recalled, the rest of R
  left empty; `-shareN`: only pages holding at least N/1000 of the KV head's carried page scores (a head
  whose mass no page stands out in recalls nothing);
- `-gvoteN`: every head's R starts with the N pages the whole model votes for (each (layer, KV head) gives
  each page its share of the head's carried score; the latest call of every layer counts), then the head's
  own choice (`-firstM`: its first M slots only); `-rvoteN`: the same, only the six best retrieval heads of
  `retrieval_heads_2048.json` voting; `-lvoteN`: the best of them alone (the pages it ranks first lead every
  head); `-mvoteN`: the N pages with the best share in any one head; `-twice` (with a vote): the question is
  read twice, the second time with every layer's votes from the first (as a layer's own come too late);
- `@field=value` (after any of the above, repeatable): a `PageArchive` setting for the question and answer,
  e.g. `p16@chunk_weight=8@carry=0.95`, or `@recall_place=contiguous` (the reading keeps `--policy`'s);
- `oracle`: the needle sentence's archived tokens forced into every head's recall slots (what a perfect
  choice would answer; `recall_oracle.py`); `oracleN`: the same, the rest of R only the choice's first N
  slots (`oracle0`: the needle alone); `@layers=A:B` forces it in layers A to B-1 only (the choice's R in
  the others).

The question is read as its own chunk (as chat reads a new turn), then up to 12 tokens are generated.
Each row lists the (layer.KV head) holding a pass-key digit at the question and, per head, the rank of the best
page holding one by that head's carried score (`question_key_page_ranks`: 0 = the head's first page).

    python -m research.recall_choice --length 32768 --depth-list 10,30,50,70,90 --seeds 1 --budget-tokens 819 \
        --variants p4,p16,p32,p16-votes,oracle --out docs/results/recall/choice_32768.jsonl
    python -m research.recall_choice --summary docs/results/recall/choice_32768.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from h2o_cli.cache.recall.archive import PageArchive
from h2o_cli.config import CacheSettings
from h2o_cli.eval.passkey import MAX_NEW_TOKENS, QUESTION, haystacks, needle_tokens
from research.recall_oracle import Oracle

CHOOSE, CHOOSE_ONE = PageArchive.choose, PageArchive.choose_one
RETRIEVAL_HEADS = Path(__file__).resolve().parents[1] / "docs/results/recall/retrieval_heads_2048.json"
VOTES = ("gvote", "rvote", "mvote", "lvote")  # `-gvoteN`, `-rvoteN`, `-mvoteN`, `-lvoteN`
VOTERS = 6  # `-rvoteN`: the best KV heads of that ranking vote (those copying at least a fifth of the digits)


def regroup(archive: PageArchive, page_size: int) -> None:
    """View `archive` (read with pages of one block) as pages of `page_size` tokens: the same tokens and block
    summaries, grouped `page_size / block_size` blocks to a page."""
    assert page_size % archive.block_size == 0 and archive.capacity % page_size == 0
    archive.page_size = page_size
    archive.pages = archive.capacity // page_size
    archive.blocks_per_page = page_size // archive.block_size
    device = archive.token_index.device
    archive._page_offsets = torch.arange(page_size, device=device)
    archive._block_offsets = torch.arange(archive.blocks_per_page, device=device)


def shared_order(bound: torch.Tensor) -> torch.Tensor:
    """Votes: every head's pages in one order, a page's best rank in any head of the layer (ties: the older
    page, as `order_key` breaks them), as a float32 per (head, page) that sorts as that order.
    bound: [n_kv_heads, pages]."""
    ranks = bound.argsort(dim=1, descending=True).argsort(dim=1)  # 0 = the head's best page
    return (-ranks.min(dim=0).values.float()).expand_as(bound).contiguous()


def exact_bounds(archive: PageArchive, query: torch.Tensor, pages: int, mass: bool) -> torch.Tensor:
    """Page scores from the archived keys themselves instead of block summaries: `exact`, the best `q.k` of the
    page's keys under the best query (pages of one token: Quest's bound made exact); `mass`, the attention
    mass the queries put on the page, each query's softmax taken over every archived key (what the question
    attends to, InfiniRetri's signal). query: [n_kv_heads, m, head_dim] (the scoring queries); returns
    [n_kv_heads, pages]."""
    size = pages * archive.page_size
    logits = torch.bmm(query.float(), archive.keys[:, :size].float().transpose(1, 2))  # [n_kv, m, size]
    logits.masked_fill_(archive.token_index[:size] == -1, float("-inf"))
    if mass:
        per_token = torch.softmax(logits * archive.head_dim**-0.5, dim=-1).sum(dim=1)
        return per_token.view(archive.n_kv_heads, pages, archive.page_size).sum(dim=2)
    return logits.amax(dim=1).view(archive.n_kv_heads, pages, archive.page_size).amax(dim=2)


def shortlisted_mass(archive: PageArchive, query: torch.Tensor, pages: int, bounds: torch.Tensor, short: int):
    """`exact_bounds(..., mass=True)` inside a shortlist: the `short` pages with the best summary bound per KV
    head, each query's softmax over their keys only; the other pages score -1. bounds: [n_kv_heads, pages]."""
    size, n_kv = archive.page_size, archive.n_kv_heads
    top = bounds.topk(min(short, pages), dim=1).indices  # [n_kv, K]
    slots = (top.unsqueeze(-1) * size + torch.arange(size)).flatten(1)  # [n_kv, K * size]
    keys = archive.keys.float().gather(1, slots.unsqueeze(-1).expand(-1, -1, archive.head_dim))
    logits = torch.bmm(query.float(), keys.transpose(1, 2)) * archive.head_dim**-0.5
    logits.masked_fill_((archive.token_index[slots] == -1).unsqueeze(1), float("-inf"))
    mass = torch.softmax(logits, dim=-1).sum(dim=1).view(n_kv, -1, size).sum(dim=2)
    return torch.full((n_kv, pages), -1.0).scatter_(1, top, mass)


def choice(extras: set[str]) -> None:
    """Make `PageArchive.bounds` (which every choice ranks by) score as the variant says (`exact`, `mass`,
    then `votes` over the result), or put the summaries' bounds back (no extras)."""
    if not hasattr(PageArchive, "_own_bounds"):
        PageArchive._own_bounds = PageArchive.bounds
    own = PageArchive._own_bounds

    def bounds(self, query, pages, chunk=1, fixed=False, question=False):
        tail = [int(extra[4:]) for extra in extras if extra.startswith("tail")]
        # A chunk's last `tail` tokens' queries alone (layout [n_kv, group, chunk]).
        if tail and chunk > tail[0]:
            query = query.reshape(query.shape[0], -1, chunk, query.shape[-1])[:, :, -tail[0] :]
            query = query.reshape(query.shape[0], -1, query.shape[-1])
            if not extras - {f"tail{tail[0]}"}:
                return own(self, query, pages, chunk, fixed, question)
        short = [int(extra[5:]) for extra in extras if extra.startswith("short")]
        listed = [int(extra[5:]) for extra in extras if extra.startswith("qlist")]
        if chunk > 1 and ("qall" in extras or listed):  # the question scores every page
            shortlist, self.shortlist = self.shortlist, 0
            scores = own(self, query, pages, chunk)
            self.shortlist = shortlist
        elif listed:  # an answer step scores the pages the carried scores rank best (the question's)
            page_start = self.token_index.view(self.pages, self.page_size)[:pages, 0]
            same = (self.carried_start[:pages] == page_start) & (page_start != -1)
            last = torch.where(same, self.carried[:, :pages], 0.0)
            picked = last.topk(min(listed[0], pages), dim=1).indices
            scores = torch.zeros_like(last).scatter_(1, picked, self.attention_mass(query, pages, picked))
            scores += self.carry * last
            self.carried[:, :pages], self.carried_start[:pages] = scores, page_start
        elif short:
            scores = shortlisted_mass(self, query, pages, own(self, query, pages, chunk, fixed), short[0])
        elif extras & {"exact", "mass"}:
            scores = exact_bounds(self, query, pages, "mass" in extras)
        else:
            scores = own(self, query, pages, chunk, fixed, question)
        if "hold" in extras:  # answer steps keep the question's scores: what it found stays till the end
            if chunk > 1 or getattr(self, "_held", None) is None:
                self._held = scores
            else:
                held = self._held
                scores = torch.nn.functional.pad(held, (0, pages - held.shape[1]), value=-1.0)[:, :pages]
        keep = [int(extra[4:]) / 10 for extra in extras if extra.startswith("keep")]
        if keep:  # scores carried over steps: each step's added to the last's times the decay
            last = getattr(self, "_carried", None)
            if last is not None:
                last = torch.nn.functional.pad(last, (0, pages - last.shape[1]))[:, :pages]
                scores = scores + keep[0] * last.clamp_min(0)
            self._carried = scores.clamp_min(0)
        wide = [int(extra[4:]) for extra in extras if extra.startswith("wide")]
        if (
            wide
        ):  # a page scores as well as the best page within `wide` of it: hits come with their neighbours
            n = wide[0]
            scores = torch.nn.functional.max_pool1d(scores.unsqueeze(1), 2 * n + 1, stride=1, padding=n)[:, 0]
        ahead = [int(extra[3:]) for extra in extras if extra.startswith("fwd")]
        if (
            ahead
        ):  # a page scores as well as the best of the `ahead` pages before it: a hit brings what follows
            n = ahead[0]
            padded = torch.nn.functional.pad(scores.unsqueeze(1), (n, 0), value=float("-inf"))
            scores = torch.nn.functional.max_pool1d(padded, n + 1, stride=1)[:, 0]
        return shared_order(scores) if "votes" in extras else scores

    PageArchive.bounds = bounds if extras else own


ARCHIVED = ("keys", "values", "token_index", "summary")


def save_state(cache, path: Path, tokens: int, seconds: float) -> None:
    """The cache after the read (every store's state and every archive's tensors) in one file."""
    archives = [{name: getattr(layer.archive, name) for name in ARCHIVED} for layer in cache.layers]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": cache.state(), "archives": archives, "tokens": tokens, "seconds": seconds}, path)


def load_state(cache, path: Path) -> tuple[int, float]:
    """Put a `save_state` file into a fresh cache of the same settings; returns (tokens read, read seconds)."""
    saved = torch.load(path, mmap=True)  # copied into the cache: no second copy of a 128K archive in RAM
    for layer, archive in zip(cache.layers, saved["archives"], strict=True):
        for name in ARCHIVED:
            getattr(layer.archive, name).copy_(archive[name])
        layer.archive.tokens = saved["tokens"]
    cache.restore(saved["state"])
    return saved["tokens"], saved["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--depth-list", type=lambda s: [int(x) for x in s.split(",")], default=[10, 50, 90])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--seed-from", type=int, default=0)
    parser.add_argument(
        "--budget-tokens", type=int, default=819, help="resident + recalled tokens per KV head"
    )
    parser.add_argument("--policy", default="recall", help="the reading's recall spec, as h2o passkey")
    parser.add_argument(
        "--block",
        type=int,
        help="pages and key summaries of this many tokens while reading (default: the policy's)",
    )
    parser.add_argument(
        "--question-alone",
        action="store_true",
        help="read the question as a chunk of its own (default: it ends the text's last chunk, as `stream --prompt`)",
    )
    parser.add_argument("--variants", default="p4,p16,p32,p16-votes,oracle")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--states", type=Path, help="keep each haystack's state after the read here, and reuse it if there"
    )
    parser.add_argument("--summary", type=Path, nargs="+")
    args = parser.parse_args()
    if args.summary:
        print(summary(args.summary))
        return
    torch.set_num_threads(args.threads)

    from h2o_cli.cache import H2OCache
    from h2o_cli.eval.data import load_essays
    from h2o_cli.generation import Sampling, TextStreamer, generate_ids
    from h2o_cli.models import load_model
    from h2o_cli.prompting import NewChunk, read_then_answer
    from h2o_cli.streaming import chunks_of, prefill

    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32")
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    essays = load_essays(None)
    variants = args.variants.split(",")
    for seed in range(args.seed_from, args.seed_from + args.seeds):
        for depth, key, text in haystacks(tokenizer, essays, args.length, args.depth_list, seed):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            pieces = list(read_then_answer(tokenizer, [ids], QUESTION))
            settings = CacheSettings.from_spec(args.policy, budget=args.budget_tokens, chunk=args.chunk)
            if args.block:
                settings = replace(settings, page_size=args.block, block_size=args.block)
            settings = replace(settings, kernels="torch")
            if args.question_alone:
                reading, asking = pieces[:-1], pieces[-1:]
            else:  # the question ends the text's last chunk (`chunks_of`): read up to it, then ask with it
                *reading, last = chunks_of(pieces, settings.chunk)
                asks = getattr(last, "asks", 0)
                asking = (
                    [list(last[: len(last) - asks]), NewChunk(last[len(last) - asks :])]
                    if asks
                    else [NewChunk(last)]
                )
            span = -(-(sum(map(len, pieces)) + MAX_NEW_TOKENS) // 64) * 64  # whole pages of up to 64
            settings = replace(settings, archive_max=span, archive="ram")
            cache = H2OCache(model, settings, span=span)
            tag = ("" if args.question_alone else "_asked") + (f"_p{args.block}" if args.block else "")
            saved = (
                args.states / f"{args.length}_s{seed}_d{depth}_b{args.budget_tokens}{tag}.pt"
                if args.states
                else None
            )
            started = time.perf_counter()
            if saved is not None and saved.exists():
                read_tokens, read_seconds = load_state(cache, saved)
            else:
                _, stats = prefill(model, cache, reading, settings.chunk)
                stats.reraise()
                read_tokens, read_seconds = stats.tokens, time.perf_counter() - started
                if saved is not None:
                    save_state(cache, saved, read_tokens, read_seconds)
            state = cache.state()
            tunable = ("attention", "shortlist", "carry", "chunk_weight")
            base = [{field: getattr(layer.archive, field) for field in tunable} for layer in cache.layers]
            policies = [layer.policy for layer in cache.layers]
            needle, digits = needle_tokens(tokenizer, text, key, len(pieces[0]))
            for variant in variants:
                choice_part, *settings_part = variant.split("@")
                name, *extras = choice_part.split("-")
                overrides = dict(item.split("=") for item in settings_part)
                forced = name.startswith("oracle")  # oracleN: the needle, then only N of the choice's slots
                page = settings.page_size if forced else int(name[1:])
                cache.restore(state)
                for layer, settings_of_layer, policy in zip(cache.layers, base, policies, strict=True):
                    layer.archive.__dict__.update(settings_of_layer)
                    regroup(layer.archive, page)
                    layer.archive._carried = layer.archive._held = None
                    # @recall_place=...: the question and answer place R so (else as the read did)
                    layer.policy = replace(
                        policy, recall_place=overrides.get("recall_place", policy.recall_place)
                    )
                    for field, value in overrides.items():  # an archive setting: @chunk_weight=8, @carry=0.95
                        if field not in ("recall_place", "layers"):
                            setattr(layer.archive, field, type(getattr(layer.archive, field))(float(value)))
                first = [int(extra[5:]) for extra in extras if extra.startswith("first")]
                share = [int(extra[5:]) / 1000 for extra in extras if extra.startswith("share")]
                vote = [int(extra[5:]) for extra in extras if extra.startswith(VOTES)]
                choice(
                    {extra for extra in extras if not extra.startswith(("first", "share", "twice", *VOTES))}
                )
                rest = int(name[6:]) if forced and name[6:] else (first or [None])[0]
                oracle = Oracle(forced, group, rest, (share or [0.0])[0], (vote or [0])[0])
                oracle.vote_max = any(extra.startswith("mvote") for extra in extras)
                leads = any(extra.startswith("lvote") for extra in extras)  # the best one alone
                if leads or any(extra.startswith("rvote") for extra in extras):  # the retrieval heads vote
                    oracle.voters = defaultdict(list)
                    for row in json.loads(RETRIEVAL_HEADS.read_text())["ranked"][: 1 if leads else VOTERS]:
                        oracle.voters[row["layer"]].append(row["kv_head"])
                    oracle.layer_of = {id(layer.archive): n for n, layer in enumerate(cache.layers)}
                # oracle@layers=A:B: forced in layers A..B-1 only, the choice elsewhere
                if "layers" in overrides:
                    first, last = map(int, overrides["layers"].split(":"))
                    oracle.only_in({id(layer.archive) for layer in cache.layers[first:last]})
                oracle.start(needle, digits, read_tokens)
                oracle.phase = "question"
                try:
                    started = time.perf_counter()
                    if (
                        "twice" in extras
                    ):  # read the question, keep the votes, put the cache back, read it again
                        prefill(model, cache, asking, settings.chunk)
                        cache.restore(state)
                        for layer in cache.layers:
                            layer.archive._carried = layer.archive._held = None
                        oracle.log.clear()
                    logits, _ = prefill(model, cache, asking, settings.chunk)
                    oracle.phase = "decode"
                    streamer = TextStreamer(tokenizer)
                    stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
                    sampling = Sampling(max_new_tokens=MAX_NEW_TOKENS)
                    for token in generate_ids(model, cache, logits, sampling, stop):
                        streamer.push(token)
                finally:
                    PageArchive.choose, PageArchive.choose_one = CHOOSE, CHOOSE_ONE
                    choice(set())
                question, steps = oracle.shares(len(cache.layers))
                _, whole = oracle.shares(len(cache.layers), column=3)
                key_heads, recalled = oracle.question_detail(len(cache.layers))
                row = {"length": args.length, "seed": seed, "depth": depth, "budget_tokens": args.budget_tokens,
                       "policy": args.policy, "variant": variant, "key": key, "answer": streamer.printed.strip(),
                       "correct": key in streamer.printed, "text_tokens": len(ids),
                       "question_heads_with_key": question, "answer_heads_with_key": steps,
                       "answer_heads_with_every_digit": whole,
                       "question_key_heads": key_heads, "question_recalled": recalled,
                       "question_key_page_ranks": oracle.question_key_ranks(len(cache.layers)),
                       "read_seconds": round(read_seconds, 1),
                       "answer_seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
                print(json.dumps(row), flush=True)
                if args.out:
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    with args.out.open("a") as out:
                        out.write(json.dumps(row) + "\n")
            cache.close()
            print(f"s{seed} d{depth}: read {read_seconds:.0f} s", file=sys.stderr, flush=True)


def summary(paths: list[Path]) -> str:
    """One markdown row per (length, budget, variant): answered / runs, and the mean share of heads holding a
    passkey token while the question is read."""
    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    unique = {(r["length"], r["seed"], r["depth"], r["budget_tokens"], r["variant"]): r for r in rows}
    cells = defaultdict(list)
    for row in unique.values():  # a run repeated (the same state, the same variant) counts once
        cells[(row["length"], row["budget_tokens"], row["variant"])].append(row)
    lines = ["| text tokens | budget (tokens) | variant | answered | heads holding a digit at the question |",
             "|---|---|---|---|---|"]  # fmt: skip
    for (length, budget, variant), runs in cells.items():
        heads = sum(run["question_heads_with_key"] for run in runs) / len(runs)
        answered = sum(run["correct"] for run in runs)
        lines.append(f"| {length:,} | {budget:,} | {variant} | {answered}/{len(runs)} | {heads:.0%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

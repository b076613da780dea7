"""Where does the lead head rank the asked needle of a RULER document? The page choice of `recall` on lm-eval's
own documents, read as `h2o lm-eval` reads them past the window.

Each document of an lm-eval samples file (`--log_samples` output of `h2o lm-eval ... --tasks niah_multikey_2`)
is read through a fresh cache as `H2OLM.generate_until` reads it (the text, then its last line as a question,
`NewChunk`), and after the question's read the lead head's page ranking (`LeadRanking.ranked`) is looked at:
for each needle the answer needs (the sentence holding a target value), the rank of its best page and of the
pages holding the value's first and last token (a page boundary may split a value); what the lead's first
`--show` pages hold; the lead's carried scores of its best pages. A miss whose needle ranks past the lead's
`pages` is the ranking's; one inside it is the answer's. Prints one JSON line per document and variant.

`--variants` asks each document under several lead choices from one read of its text (the cache's state kept
after the text, put back before each question, so an answer may differ from lm-eval's run's): `pN` the lead's
N best pages alone (`--lead-pages N --lead-next 0`); `nextN` the N best with the page after each
(`--lead-pages N --lead-next 1`; next8 is the default); `beforeN` N pages, each ranked just below the page
after it too (a hit brings the page before it: the start of its line); `aroundN` a page ranked just below
either neighbour; `oracleN` the pages holding the asked line first (whatever their score), then the lead's
order: what the answer would be if the ranking never missed; `fill` as many as fill the recall slots
(`--lead-pages fill`); `outK` next8 and every page scoring K times the median page (`--lead-outliers K`);
`introN` out100 (the defaults) with the text's first N pages ranked first, taken on top of the others (a
task's instruction opens its text). A variant may end in `+hold` (the question's ranking holds through the
answer: the lead layer's answer steps carry no page scores) and `+contiguous` (`--recall-place contiguous`
from the question on; the text was read under the run's own placement).
Each row also gives the lead's own scores of its 48 best pages and of each needle's page as multiples of the
median page's (`over_median`, `needle_over_median`), and the pages it took after the question and after the
answer (`lead_pages`, `answer_pages`). The answer is greedy, at most the task's `max_gen_toks` (256 where it
names none, as `generate_until`; the cache has room for all of it), cut at its stop strings; `score` is RULER's
(the share of the target values in the answer).
`research/ruler_samples.py` writes documents to probe without a model run.

    python -m research.ruler_probe /work/runs/ruler/recall_32k_a/out/*/samples_niah_multikey_2_*.jsonl \
        --limit 6 --model_args policy=recall,budget=819,threads=1 --variants p8,next8,before16,around24
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import time

import torch


def targets_of(sample: dict) -> list[str]:
    """The values lm-eval scores a sample on (its `target`, a list written as a string by `--log_samples`)."""
    target = sample["target"]
    values = ast.literal_eval(target) if isinstance(target, str) and target.startswith("[") else target
    return [str(value) for value in (values if isinstance(values, list) else [values])]


def line_spans(text: str, value: str) -> list[tuple[int, int]]:
    """Character spans of every sentence of `text` that holds `value`: from the line or sentence start before
    it (a newline, or ". ") to the end of its line or the first ". " after it (RULER's needles are one sentence
    each, in a line of their own or inside an essay's paragraph)."""
    spans = []
    for found in re.finditer(re.escape(value), text):
        start = max(text.rfind("\n", 0, found.start()) + 1, text.rfind(". ", 0, found.start()) + 2)
        line_end, stop = text.find("\n", found.end()), text.find(". ", found.end())
        ends = [at for at in (line_end, stop + 1 if stop >= 0 else -1) if at >= 0]
        spans.append((start, min(ends) if ends else len(text)))
    return spans


def widened(variant: str, needle: tuple[int, int] = (0, 0), size: int = 16):
    """`order_key` for the lead's page ranking under `variant` (see the module's docs); `needle`: the token
    span [first, last) of the asked line, which `oracleN` ranks first; `size`: tokens per page."""
    from h2o_cli.cache.recall.archive import NOTHING
    from h2o_cli.cache.recall.scores import order_key

    if variant.startswith(("p", "next", "fill", "out")):
        return order_key
    if variant.startswith("intro"):  # the oracle's ranking, of the text's first N pages instead of the line
        needle = (0, int(variant[5:]) * size)
    if variant.startswith(("oracle", "intro")):

        def forced(score, page_start, candidate):
            holds = (page_start != NOTHING) & (page_start + size > needle[0]) & (page_start < needle[1])
            return order_key(torch.where(holds, score + 1e6, score), page_start, candidate | holds)

        return forced

    def key(score, page_start, candidate):
        shifted = torch.zeros_like(score)
        shifted[:-1] = score[1:] * 0.999  # the page after's score, just below it
        if variant.startswith("around"):
            shifted[1:] = torch.maximum(shifted[1:], score[:-1] * 0.999)  # the page before's
        score = torch.maximum(score, shifted)
        return order_key(score, page_start, (page_start != NOTHING) & (score > 0))

    return key


def needles_of(lm, text: str, text_ids: list[int], sample: dict) -> list[dict]:
    """Each needle the answer needs (every sentence of `text` holding a target value): its value, its token span
    [first, last), its depth in the text and the indices of the value's first and last token."""

    def tokens_before(char: int) -> int:
        return len(lm.tok_encode(text[:char]))

    needles = []
    for value in targets_of(sample):
        for start, end in line_spans(text, value):
            first, last = tokens_before(start), tokens_before(end)
            at = text.index(value, start)
            needles.append(
                {
                    "value": value,
                    "tokens": [first, last],
                    "depth": round(first / len(text_ids), 3),
                    "value_tokens": [tokens_before(at), tokens_before(at + len(value)) - 1],
                }
            )
    return needles


class OpeningLead:
    """`introN`'s lead (a `LeadRanking` subclass made by `under`): `extra` pages more than it would take."""

    extra = 0

    @property
    def count(self):
        count = super().count
        return None if count is None else count + self.extra


def held_scores(self, query, call, scores=None) -> None:
    """`+hold`: a `RecallLayer._lead_scores` that carries nothing: the lead's ranking stays the question's."""
    if self.lead.archive is self.archive:
        self.lead.ready = True


def under(cache, state, variant: str, needle: tuple[int, int]) -> None:
    """Put the cache back to `state` (kept after the text) and make its lead rank as `variant` says (the module's
    docs; `needle`: the token span `oracleN` ranks first). The caller puts `lead.order_key`, the lead's class,
    the layers' `_lead_scores` and their placement back after (`restored`)."""
    import types

    from h2o_cli.cache.recall import lead as lead_module

    variant, *modifiers = variant.split("+")
    lead_module.order_key = widened(variant, needle, cache.lead.archive.page_size)
    cache.restore(state)
    for layer in recalling(cache):
        if "hold" in modifiers:
            layer._lead_scores = types.MethodType(held_scores, layer)
        if "contiguous" in modifiers:
            object.__setattr__(layer.policy, "recall_place", "contiguous")
    cache.lead.outliers = 0.0
    if variant.startswith("intro"):
        lead_class = type(cache.lead)
        cache.lead.__class__ = type("Opening" + lead_class.__name__, (OpeningLead, lead_class), {})
        cache.lead.extra = int(variant[5:])
        variant = "out100"
    if variant == "fill":  # `--lead-pages fill`: the best pages, each with the page after it, until R is full
        cache.lead.pages, cache.lead.follow = None, 1
        return
    if variant.startswith("out"):  # outK: next8, and every page scoring K times the median page
        cache.lead.pages, cache.lead.follow, cache.lead.outliers = 8, 1, float(variant[3:])
        return
    cache.lead.pages, cache.lead.follow = int(re.sub(r"\D", "", variant)), int(variant.startswith("next"))


def probe(lm, sample: dict, show: int, variants: list[str]) -> list[dict]:
    from h2o_cli.cache.recall import lead as lead_module
    from h2o_cli.eval.scoring import greedy_continuation
    from h2o_cli.prompting import NewChunk
    from h2o_cli.streaming import prefill

    context, gen_kwargs = (
        sample["arguments"]["gen_args_0"]["arg_0"],
        sample["arguments"]["gen_args_0"]["arg_1"],
    )
    text_ids, question = lm._split_question(context)
    if not question:
        raise SystemExit(
            f"document {sample['doc_id']} fits the model's window ({lm.max_length:,} tokens) or has no question "
            "line: the probe reads contexts past the window under a recalling policy; take a longer --length"
        )
    text = context[: context.rfind("\n") + 1]
    until, most = gen_kwargs.get("until") or [], gen_kwargs.get("max_gen_toks", 256)
    until = [until] if isinstance(until, str) else until
    cache = lm._cache(len(text_ids) + len(question), most)  # as generate_until: room for the whole answer
    started = time.perf_counter()
    _, stats = prefill(lm.model, cache, [text_ids], lm.settings.chunk)
    stats.reraise()
    read = time.perf_counter() - started
    state = cache.state()
    needles, values = needles_of(lm, text, text_ids, sample), targets_of(sample)
    needle = tuple(needles[0]["tokens"])  # the first target's first sentence: what `oracleN` ranks first
    rows, kept = [], lead_module.order_key
    places = {id(layer.policy): (layer.policy, layer.policy.recall_place) for layer in recalling(cache)}
    for variant in variants:
        under(cache, state, variant, needle)
        logits, stats = prefill(lm.model, cache, [NewChunk(question)], lm.settings.chunk)
        stats.reraise()
        row = {"doc_id": sample["doc_id"], **ranking(lm, cache, text_ids, needles, show)}
        row["lm_eval_answered"] = sample["resps"][0][0][:40]
        answer = greedy_continuation(lm.model, lm.tokenizer, cache, logits, most, until)
        score = sum(value.lower() in answer.lower() for value in values) / len(values)
        row.update(answer_pages=cache.lead.count, answer=answer[:200], score=score, read_s=round(read, 1))
        rows.append({"variant": variant, **row})
        restored(cache, places)
    lead_module.order_key = kept
    cache.close()
    return rows


def recalling(cache) -> list:
    from h2o_cli.cache.recall.layer import RecallLayer

    return [layer for layer in cache.layers if isinstance(layer, RecallLayer)]


def restored(cache, places: dict) -> None:
    """Undo `under`'s modifiers: the lead's own class, each layer's `_lead_scores` and `policy.recall_place`."""
    if isinstance(cache.lead, OpeningLead):
        cache.lead.__class__ = cache.lead.__class__.__mro__[2]
    for layer in recalling(cache):
        layer.__dict__.pop("_lead_scores", None)
    for policy, place in places.values():
        object.__setattr__(policy, "recall_place", place)


def ranking(lm, cache, text_ids: list[int], needles: list[dict], show: int) -> dict:
    """Where the lead ranks each of `needles` (`needles_of`: value, token span, depth, the value's first and last
    token) after the question's read, and what its first `show` pages hold (`text_ids`: the ids read, by stream
    index)."""
    lead = cache.lead
    ranked = lead.ranked().tolist()
    top = lead.archive.carried[lead.head, ranked[0]].clamp_min(1e-30) if ranked else 1.0
    size = lead.archive.page_size
    index = lead.archive.token_index.view(lead.archive.pages, size)
    rank_of_token = {}
    for rank, page in enumerate(ranked):
        for token in index[page].tolist():
            rank_of_token.setdefault(token, rank)
    ranked_needles = []
    for needle in needles:
        first, last = needle["tokens"]
        ranks = [rank_of_token[t] for t in range(first, last) if t in rank_of_token]
        ranked_needles.append(
            {
                **{key: needle[key] for key in ("value", "tokens", "depth")},
                "rank": min(ranks) if ranks else None,  # None: no page of the sentence ranked (not archived)
                # the ranks of the pages holding the value's first and last token (a page boundary may split
                # the value: the answer then needs both pages)
                "value_ranks": [rank_of_token.get(t) for t in needle["value_tokens"]],
            }
        )
    shown = []
    for page in ranked[:show]:
        ids = [t for t in index[page].tolist() if 0 <= t < len(text_ids)]
        if ids:
            shown.append({"first": ids[0], "text": lm.tok_decode([text_ids[t] for t in ids])})
    return {
        "lead": [lead.layer, lead.head],
        "lead_pages": lead.count,
        # the lead's carried scores of its 12 best pages, as shares of the best one's
        "scores": [round(v, 3) for v in (lead.archive.carried[lead.head, ranked[:12]] / top).tolist()],
        "needles": ranked_needles,
        **spread(lead, ranked, ranked_needles),
        "first_pages": shown,
    }


def spread(lead, ranked: list[int], needles: list[dict]) -> dict:
    """How far the lead's best pages stand out from the bulk: its own carried score of each of its 48 best pages
    (`ranked`, best first) and of each needle's best page, as multiples of the median over every ranked page."""
    own = lead.archive.carried[lead.head, ranked].double() if ranked else torch.zeros(1, dtype=torch.float64)
    median = own.median().clamp_min(1e-30)
    return {
        "ranked_pages": len(ranked),
        "over_median": [round(v, 1) for v in (own[:48] / median).tolist()],
        "needle_over_median": [
            None if n["rank"] is None else round(float(own[n["rank"]] / median), 1) for n in needles
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("samples", help="an lm-eval --log_samples file of a generate_until task")
    parser.add_argument("--limit", type=int, default=0, help="the first N documents (0: all)")
    parser.add_argument("--skip", type=int, default=0, help="start after the first N documents")
    parser.add_argument("--show", type=int, default=8, help="print what the lead's first N pages hold")
    parser.add_argument("--model_args", default="policy=recall,budget=819,threads=1")
    parser.add_argument("--variants", default="next8", help="comma-separated lead choices (see above)")
    args = parser.parse_args()
    from h2o_cli.eval.lm_eval_model import H2OLM

    model_args = dict(item.split("=", 1) for item in args.model_args.split(","))
    lm = H2OLM(**model_args)
    with open(args.samples) as file:
        samples = [json.loads(line) for line in file]
    for sample in samples[args.skip :][: args.limit or None]:
        with torch.inference_mode():
            for row in probe(lm, sample, args.show, args.variants.split(",")):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

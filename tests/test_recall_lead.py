"""`recall --recall-lead` (docs/spec.md, recall: lead head): after a question every recalling head recalls the
candidates of the lead head's best pages. Checked call by call against a plain-Python ranking of the same
inputs (the lead's carried scores, the archive's ring, each head's resident set), with the ranking a layer
below the lead reads taken from the lead layer's call before; the question read twice; the C step against
the torch step; and the usage errors."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import typer
from conftest import tiny_config
from h2o_kernels import native

from h2o_cli.cache import H2OCache
from h2o_cli.cache.recall.c_step import RecallCStep
from h2o_cli.cache.recall.layer import LeadMode
from h2o_cli.cache.recall.lead import LeadRanking
from h2o_cli.cli.app import app
from h2o_cli.config import CacheSettings
from h2o_cli.errors import UsageError
from h2o_cli.generation import Sampling, generate_ids
from h2o_cli.models.presets import PRESETS
from h2o_cli.prompting import NewChunk
from h2o_cli.streaming import prefill

LEAD = "1.1"  # the tiny model's second layer, KV head 1: layer 0 reads its ranking of the call before
TEXT, QUESTION, ANSWER = 230, 6, 8
CHOOSE = LeadRanking.choose
C_CHOOSE = RecallCStep.lead_choose


def lead_settings(kernels: str = "torch", lead_text: bool = False, **extra) -> CacheSettings:
    """The lead after a question only, unless `lead_text` (the default of `CacheSettings`, off in chat)."""
    return CacheSettings(
        budget=40, policy="recall", chunk=16, page_size=4, archive_max=512, recall_lead=LEAD,
        kernels=kernels, lead_text=lead_text, **{"lead_pages": 3, **extra},
    )  # fmt: skip


def expected_tokens(
    ring: list[int], scores: list[float], resident, before: int, slots: int, pages: int | None, size: int,
    follow: int = 0, lead_ring: list[int] | None = None,
):  # fmt: skip
    """Each head's recalled token indices by the contract, in plain Python: ring pages holding a page (its first
    slot written) with a positive score and, for some head, a candidate (an archived token older than `before`
    not in that head's S), by score (ties: the older page), the best `pages` (None, `--lead-text`'s fill: as
    many as fill every head's slots, so all of them); each head's candidates of them in that order, oldest
    first in a page, the first `slots`. A page's score: the larger of its lead score and 0.999^k times the lead
    score of the page whose first token is k · `size` tokens before its own, k = 1 .. `follow` (float32). Pages
    are ranked as the lead's ring `lead_ring` holds them (a layer before the lead has archived this step's
    tokens, the lead not yet), their candidates are the calling layer's `ring`'s."""
    heads = [set(row) - {-1} for row in resident]
    start, widened = page_scores(ring, scores, size, follow, lead_ring)

    def candidate(slot: int, head: int) -> bool:
        return 0 <= ring[slot] < before and ring[slot] not in heads[head]

    ranked = [
        page
        for page in range(len(ring) // size)
        if start[page] != -1
        and widened[page] > 0
        and any(
            candidate(slot, head)
            for slot in range(page * size, page * size + size)
            for head in range(len(heads))
        )
    ]
    ranked.sort(key=lambda page: (-widened[page], start[page]))
    top = ranked if pages is None else ranked[:pages]
    return [
        [
            ring[slot]
            for page in top
            for slot in range(page * size, page * size + size)
            if candidate(slot, head)
        ][:slots]
        for head in range(len(heads))
    ]


def page_scores(ring, scores, size: int, follow: int, lead_ring=None) -> tuple[list[int], list[np.float32]]:
    """Each ring page's first token index (-1: not written) and score, the larger of its lead score and 0.999^k
    times the lead score of the page whose first token is k · `size` tokens before its own, k = 1 .. `follow`
    (float32), as the lead's ring `lead_ring` (else `ring`) holds them."""
    start = [(lead_ring or ring)[page * size] for page in range(len(ring) // size)]
    first = {token: page for page, token in enumerate(start) if token != -1}
    widened = [
        max(
            [np.float32(scores[page])]
            + [
                np.float32(scores[first[start[page] - back * size]]) * np.float32(0.999**back)
                for back in range(1, follow + 1)
                if start[page] - back * size in first
            ]
        )
        for page in range(len(ring) // size)
    ]
    return start, widened


def outlier_pages(call: dict, size: int, follow: int, outliers: float) -> int:
    """The pages of a lead call's ranking (`page_scores`) scoring at least `outliers` times the median (the
    lower middle one) of those holding a page with a positive score."""
    start, widened = page_scores(call["ring"], call["scores"], size, follow, call["lead_ring"])
    scored = sorted(score for page, score in enumerate(widened) if start[page] != -1 and score > 0)
    bar = np.float32(outliers) * scored[(len(scored) - 1) // 2]
    return sum(score >= bar for score in scored)


def answer_with_lead(
    model, settings: CacheSettings, monkeypatch, question: bool = True
) -> tuple[list[dict], H2OCache, list[int]]:
    """Text, a question (unless not `question`), a greedy answer through a lead cache; every
    `LeadRanking.choose` call (and the C step's `RecallCStep.lead_choose`) recorded with its inputs and what it
    chose (token indices per head)."""
    calls: list[dict] = []

    def recorded(self, archive, resident, before, slots, fill=False):
        chosen, valid = CHOOSE(self, archive, resident, before, slots, fill)
        tokens = torch.where(valid, archive.token_index[chosen], -1)
        calls.append(
            dict(
                lead=archive is self.archive, ready=self.ready, before=before, slots=slots,
                ring=archive.token_index.tolist(), scores=self.archive.carried[self.head].tolist(),
                lead_ring=self.archive.token_index.tolist(),
                resident=resident.tolist(), chosen=[[t for t in row if t >= 0] for row in tokens.tolist()],
                c_step=False, fill=fill,
            )
        )  # fmt: skip
        return chosen, valid

    def recorded_c(self, ranked, pages):  # the C step's: the same record, its choice read from the slots
        store = self.store
        layer = next(layer for layer in cache.layers if layer.__dict__.get("_c_buffers") is self)
        resident = store.token_index.masked_fill(~store.valid, -1)
        lead = layer.lead
        record = dict(
            lead=layer.archive is lead.archive, ready=lead.ready, before=store.tokens_seen,
            slots=self.recall, ring=layer.archive.token_index.tolist(), lead_ring=lead.archive.token_index.tolist(),
            scores=lead.archive.carried[lead.head].tolist(), resident=resident.tolist(), c_step=True,
            fill=layer.lead_mode is LeadMode.FILL,
        )  # fmt: skip
        result = C_CHOOSE(self, ranked, pages)
        record["chosen"] = [[t for t in row if t >= 0] for row in layer.recall_index.tolist()]
        calls.append(record)
        return result

    monkeypatch.setattr(LeadRanking, "choose", recorded)
    monkeypatch.setattr(RecallCStep, "lead_choose", recorded_c)
    generator = torch.Generator().manual_seed(3)
    text = torch.randint(0, 128, (TEXT,), generator=generator).tolist()
    asked = NewChunk(torch.randint(0, 128, (QUESTION,), generator=generator).tolist())
    cache = H2OCache(model, settings)
    logits, stats = prefill(model, cache, [text, asked] if question else [text], settings.chunk)
    stats.reraise()
    answer = list(generate_ids(model, cache, logits, Sampling(max_new_tokens=ANSWER)))
    return calls, cache, answer


@pytest.mark.parametrize(
    ("follow", "archive_max", "pages", "outliers"),
    [
        (0, 512, 3, 0.0), (1, 512, 3, 0.0), (2, 512, 3, 0.0), (2, 96, 3, 0.0), (1, 512, "fill", 0.0),
        (2, 96, "fill", 0.0), (0, 512, 1, 1.002), (1, 96, 1, 1.0),
    ],
)  # fmt: skip
@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_every_head_recalls_the_lead_heads_best_pages(
    tiny_pair, monkeypatch, kernels, follow, archive_max, pages, outliers
):
    """`--lead-pages 3` and `--lead-next` 0 to 2: the best 3 · (1 + N) pages, each page ranked by the larger of
    its score and its N predecessors' (just below each); `--lead-pages fill`: as many as fill each head's
    slots; `--lead-outliers K`: as many as scored K times the median page at the question's read where they
    are more, through the answer (the tiny
    model's page scores lie within 1 % of their median: 1.002 takes a few, 1 half of them). 20 recall
    slots, pages of 4; an archive of 96 tokens has wrapped its ring (a page's predecessor may be the ring's
    last page)."""
    if kernels == "native" and native.compiler() is None:
        pytest.skip("no C compiler")
    _, model = tiny_pair
    settings = replace(
        lead_settings(kernels, lead_next=follow, lead_pages=pages, lead_outliers=outliers),
        archive_max=archive_max,
    )
    calls, cache, answer = answer_with_lead(model, settings, monkeypatch)
    slots = cache.policy.recall_slots
    # The text chooses as ever; the question (read twice) and each answer step ask the lead, in both layers.
    assert len(calls) == 2 * (2 + ANSWER) and len(answer) == ANSWER
    assert [call["lead"] for call in calls] == [False, True] * (len(calls) // 2)
    assert not calls[0]["ready"] and calls[0]["chosen"] == [[], []]  # the first read: layer 0 has no ranking
    recalled, widened, outlying = 0, 0, 0
    for number, call in enumerate(calls):
        if call["lead"] and number < 4 and outliers:  # a read of the question counts its outlier pages,
            outlying = outlier_pages(call, 4, follow, outliers)  # which its answer's steps keep
        if not call["ready"]:
            continue
        count = None if pages == "fill" else pages * (1 + follow)
        wanted = expected_tokens(
            call["ring"], call["scores"], call["resident"], call["before"], slots,
            count and max(count, outlying), 4, follow, call["lead_ring"],
        )  # fmt: skip
        assert call["chosen"] == wanted, number
        if outliers:  # the outliers took more pages than the count alone would have
            alone = expected_tokens(
                call["ring"], call["scores"], call["resident"], call["before"], slots, count, 4, follow,
                call["lead_ring"],
            )  # fmt: skip
            widened += wanted != alone
        recalled += sum(map(len, wanted))
        if not call["lead"]:  # layer 0 reads the lead layer's ranking of the call before
            assert call["scores"] == calls[number - 1]["scores"], number
        # The question ends the chunk of the text's last tokens (`chunks_of`); then a step per answer token.
        first = TEXT // settings.chunk * settings.chunk if number < 4 else TEXT + QUESTION + number // 2 - 2
        if call["c_step"] and number < 4:  # C's candidates: older than the chunk's end and not in S, which
            first = TEXT + QUESTION  # holds the whole chunk: the same tokens
        assert call["before"] == first, number
    assert recalled > 0
    assert (widened > 0) == bool(outliers)
    if pages == "fill":  # every head's slots are full once the archive holds enough candidates
        assert all(len(row) == slots for row in calls[-1]["chosen"])
    # The C step's answer steps choose in C (S is full), the torch step's in torch.
    assert any(call["c_step"] for call in calls) == (kernels == "native")
    # Read twice, archived once.
    assert cache.tokens_seen == TEXT + QUESTION + ANSWER
    assert all(layer.archive.tokens == cache.tokens_seen for layer in cache.layers)


@pytest.mark.parametrize("pages", [{}, {"lead_pages": 1, "lead_next": 0}])  # the fill, not the page count
@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_with_lead_text_every_chunk_of_text_recalls_the_lead_heads_best_pages(
    tiny_pair, monkeypatch, kernels, pages
):
    """`--lead-text`: a chunk of text in every layer but the lead's recalls the candidates of the lead's best
    pages, as many pages as fill every head's recall slots, by the ranking of the lead layer's latest call
    (layer 0: the chunk before's; before the lead has read one, nothing); the lead layer chooses its own (that
    is its ranking); a question is answered as ever. With the C step, each such chunk chooses in C (whose
    candidates are the tokens older than the chunk's end that S lacks: S holds the whole chunk)."""
    from h2o_cli.cache.recall.layer import RecallLayer

    if kernels == "native" and native.compiler() is None:
        pytest.skip("no C compiler")
    _, model = tiny_pair
    ranked, attend = (
        [],
        RecallLayer.recall_chunk,
    )  # the lead's carried scores after each of its layer's calls

    def noted(self, query, chunk):
        output = attend(self, query, chunk)
        if self.archive is self.lead.archive:
            ranked.append(self.archive.carried[self.lead.head].tolist())
        return output

    monkeypatch.setattr(RecallLayer, "recall_chunk", noted)
    settings = lead_settings(kernels, lead_text=True, **pages)  # 20 recall slots, pages of 4
    calls, cache, answer = answer_with_lead(model, settings, monkeypatch)
    slots, chunks = (
        cache.policy.recall_slots,
        TEXT // settings.chunk,
    )  # then the text's last tokens and the question
    text = [call for call in calls if call["fill"]]
    assert len(text) == chunks and not any(call["lead"] for call in text)  # layer 0 only
    assert not text[0]["ready"] and text[0]["chosen"] == [[], []]
    recalled = most = 0
    assert all(call["c_step"] == (kernels == "native") for call in text)
    for number, call in enumerate(text[1:], start=1):
        assert call["ready"] and call["before"] == (number + call["c_step"]) * settings.chunk
        assert call["scores"] == ranked[number - 1], number  # the lead layer's ranking of the chunk before
        wanted = expected_tokens(
            call["ring"], call["scores"], call["resident"], call["before"], slots, None, 4, settings.lead_next
        )
        assert call["chosen"] == wanted, number
        recalled += sum(map(len, wanted))
        most = max(most, *map(len, wanted))
    assert recalled > 0 and most == slots  # a head's slots filled from the lead's pages
    # The question and the answer: the lead's `--lead-pages` in both layers, as without `--lead-text`.
    assert len(calls) - len(text) == 2 * (2 + ANSWER) and len(answer) == ANSWER
    assert not any(call["fill"] for call in calls[len(text) :])


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_with_lead_text_the_steps_that_continue_a_text_fill_from_the_lead_heads_pages(
    tiny_pair, monkeypatch, kernels
):
    """Text with no question, then tokens generated after it: every step, in both layers (the layers but the
    lead's kept no scores of their own while the text was read), takes the lead's pages until every head's
    recall slots are full, as a chunk of text does; in C (S full) as in torch."""
    if kernels == "native" and native.compiler() is None:
        pytest.skip("no C compiler")
    _, model = tiny_pair
    settings = lead_settings(kernels, lead_text=True)
    calls, cache, answer = answer_with_lead(model, settings, monkeypatch, question=False)
    slots = cache.policy.recall_slots
    read = -(-TEXT // settings.chunk)  # layer 0, every chunk of text
    assert len(answer) == ANSWER and len(calls) == read + 2 * ANSWER
    assert all(call["fill"] and not call["lead"] for call in calls[:read])
    steps = calls[read:]
    assert [call["lead"] for call in steps] == [False, True] * ANSWER and all(c["fill"] for c in steps)
    for number, call in enumerate(steps):
        wanted = expected_tokens(
            call["ring"], call["scores"], call["resident"], call["before"], slots, None, 4, 1
        )
        assert call["chosen"] == wanted, number
    assert all(len(row) == slots for call in steps for row in call["chosen"])  # every slot filled
    assert any(call["c_step"] for call in steps) == (kernels == "native")


def test_a_chunk_of_text_ends_the_answer(tiny_pair, monkeypatch):
    _, model = tiny_pair
    calls, cache, _ = answer_with_lead(model, lead_settings(), monkeypatch)
    count = len(calls)
    more = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():  # a new turn of text: each layer's own choice again
        model(input_ids=more, cache=cache, use_cache=True)
    assert len(calls) == count and all(layer.lead_mode is LeadMode.OWN for layer in cache.layers)


def test_the_c_step_recalls_as_the_torch_step(tiny_pair, monkeypatch):
    if native.compiler() is None:
        pytest.skip("no C compiler")
    _, model = tiny_pair
    runs = [answer_with_lead(model, lead_settings(kernels), monkeypatch) for kernels in ("torch", "native")]
    (torch_calls, _, torch_answer), (c_calls, c_cache, c_answer) = runs
    assert c_answer == torch_answer
    assert [call["chosen"] for call in c_calls] == [call["chosen"] for call in torch_calls]
    assert any(layer._c_buffers is not None for layer in c_cache.layers)


@pytest.mark.parametrize(
    ("values", "words"),
    [
        (
            dict(recall_lead="18"),
            "--recall-lead '18': give none, auto, or a layer and KV head from 0 as LAYER.HEAD",
        ),
        (
            dict(recall_lead="1.1", page_score="positional"),
            "it needs --page-score attention and --page-carry",
        ),
        (dict(recall_lead="1.1", page_carry=0.0), "it needs --page-score attention and --page-carry"),
        (dict(recall_lead="1.1", lead_pages=0), "--lead-pages 0 must be at least 1"),
        (dict(recall_lead="1.1", lead_pages="all"), "--lead-pages all must be at least 1 .* or fill"),
        (dict(recall_lead="1.1", lead_next=-1), "--lead-next -1 must be at least 0"),
        (dict(recall_lead="1.1", lead_outliers=0.5), "--lead-outliers 0.5 must be 0 .* or at least 1"),
        (dict(recall_lead="1.1", lead_outliers=float("nan")), "--lead-outliers nan must be 0"),
    ],
)
def test_bad_lead_settings_are_usage_errors(values, words):
    with pytest.raises(UsageError, match=words):
        CacheSettings(**{"budget": 64, "policy": "recall", **values})


@pytest.mark.parametrize(
    ("values", "words"),
    [
        (dict(recall_lead="2.0"), r"--recall-lead 2.0: the model has 2 layers \(0-1\)"),
        (dict(recall_lead="1.2"), r"--recall-lead 1.2: the model has 2 KV heads a layer \(0-1\)"),
        (dict(recall_lead="1.0", recall_layers="0"), "--recall-lead 1.0: layer 1 does not recall"),
    ],
)
def test_a_lead_the_model_lacks_is_a_usage_error(values, words):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_config()).eval()
    with pytest.raises(UsageError, match=words):
        H2OCache(model, CacheSettings(budget=16, chunk=8, policy="recall", **values))


def test_auto_is_the_models_calibrated_lead_where_pages_carry_attention(tiny_pair, monkeypatch):
    _, model = tiny_pair
    settings = CacheSettings(budget=40, policy="recall", chunk=16, page_size=4)  # recall_lead auto
    assert H2OCache(model, settings).lead is None  # a model without a calibrated head: each head's own choice
    monkeypatch.setattr(model, "h2o_lead_head", (1, 0), raising=False)  # a head planted on the model wins
    cache = H2OCache(model, settings)
    assert (cache.lead.layer, cache.lead.head) == (1, 0) and cache.lead.archive is cache.layers[1].archive
    assert all(layer.lead is cache.lead for layer in cache.layers)
    summary = cache.archive_summary()
    assert (summary.recall_lead, summary.lead_pages, summary.lead_next, summary.lead_text) == (
        "1.0",
        8,
        1,
        True,
    )
    pages = H2OCache(model, replace(settings, lead_pages=3, lead_next=2)).archive_summary()
    assert (pages.lead_pages, pages.lead_next) == (3, 2)
    assert H2OCache(model, replace(settings, lead_pages="fill")).archive_summary().lead_pages == "fill"
    assert H2OCache(model, replace(settings, lead_text=False)).archive_summary().lead_text is False
    with_none = replace(settings, lead_text=True, recall_lead="none")  # no lead: nothing leads the text
    assert H2OCache(model, with_none).archive_summary().lead_text is False
    assert H2OCache(model, with_none).archive_summary().lead_next == 0  # nothing follows what no lead ranks
    for other in (
        dict(page_score="unrotated"),
        dict(page_carry=0.0),
        dict(recall_layers="0"),
        dict(recall_lead="none"),
    ):
        assert H2OCache(model, replace(settings, **other)).lead is None, other


def test_the_fixed_step_refuses_a_lead(tiny_pair):
    _, model = tiny_pair
    cache = H2OCache(model, lead_settings())
    with pytest.raises(UsageError, match="--compile.*--recall-lead 1.1 needs none"):
        cache.fix_steps()
    with pytest.MonkeyPatch.context() as patch:  # `auto` leaves its lead out for the fixed step
        patch.setattr(model, "h2o_lead_head", (1, 1), raising=False)
        cache = H2OCache(model, replace(lead_settings(), recall_lead="auto"))
        assert cache.lead is not None
        cache.fix_steps()
        assert cache.lead is None and all(layer.lead is None for layer in cache.layers)


def test_no_preset_types_a_head():
    """Heads are found per weights (`h2o_cli.models.calibration`), never typed in a preset."""
    assert not any(hasattr(preset, "lead_head") for preset in PRESETS.values())


def read_calls(
    model, settings: CacheSettings, reads: list[tuple[list[int], int]]
) -> tuple[list, torch.Tensor]:
    """Forward calls through a fresh cache, each (ids, question tokens ending them) read by `prefill` (an asking
    chunk twice with a lead). Returns layer 0's chunk attends as (size, asks), and the last logits [vocab]."""
    from h2o_cli.cache.recall.layer import RecallLayer

    seen, attend = [], RecallLayer.recall_chunk
    cache = H2OCache(model, settings)

    def recorded(self, query, chunk):
        if self is cache.layers[0]:
            seen.append((chunk, self.asks))
        return attend(self, query, chunk)

    logits = None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RecallLayer, "recall_chunk", recorded)
        for ids, asks in reads:
            pieces = [ids[: len(ids) - asks], NewChunk(ids[len(ids) - asks :])] if asks else [ids]
            logits, stats = prefill(model, cache, [piece for piece in pieces if piece], 256)
            stats.reraise()
    return seen, logits


@pytest.mark.parametrize("lead", [LEAD, "none"])
def test_a_question_cut_by_the_free_slots_is_read_whole(tiny_pair, lead):
    """A call longer than the free slots is read in sub-chunks; one ending in a question ends its text where the
    question starts, so the question is a sub-chunk of its own (its queries choose, the lead ranks): the same
    reads as the text and the question sent as two calls."""
    _, model = tiny_pair
    settings = replace(lead_settings(), recall_lead=lead)  # budget 40: 16 slots free once full
    ids = torch.randint(0, 128, (118,), generator=torch.Generator().manual_seed(5)).tolist()
    text, more, question = ids[:100], ids[100:112], ids[112:]  # then 12 + 6 tokens: more than 16
    reads = 2 if lead != "none" else 1  # with a lead the question's call is read twice
    one, one_logits = read_calls(model, settings, [(text, 0), (more + question, len(question))])
    two, two_logits = read_calls(model, settings, [(text, 0), (more, 0), (question, len(question))])
    assert one[-2 * reads :] == [(12, 0), (6, 6)] * reads
    assert two[-1 - reads :] == [(12, 0)] + [(6, 6)] * reads
    # The model's own layers run on 18 rows instead of 12 and 6: float32 rounding, nothing else.
    torch.testing.assert_close(one_logits, two_logits, rtol=1e-5, atol=1e-5)


def test_text_is_read_under_the_lead_by_default_except_in_chat():
    """Every command with cache options defaults to `--lead-text` (`CacheSettings`' default) but `h2o chat`,
    where each head's own choice remembered a first turn's fact more often."""
    commands = typer.main.get_command(app).commands
    defaults = {
        name: param.default
        for name, command in commands.items()
        for param in command.params
        if param.name == "lead_text"
    }
    assert CacheSettings(budget=0.1).lead_text is True
    assert defaults.pop("chat") is False
    assert {"stream", "eval"} <= set(defaults) and all(default is True for default in defaults.values())


def test_a_save_loaded_twice_is_ranked_afresh(tiny_pair, monkeypatch):
    """The lead's ranking is sorted once per state of its archive (epoch, tokens, scores carried): a save loaded
    again into the same cache is a new state, so a ranking asked under other settings is not the first load's."""
    _, model = tiny_pair
    _, cache, _ = answer_with_lead(model, lead_settings(lead_next=0), monkeypatch)
    arrays = {name: tensor.clone() for name, tensor in cache.saved_arrays().items()}
    counters = cache.saved_counters()
    lead, rankings = cache.lead, []
    for follow in (0, 3):
        cache.load_saved(arrays, counters)
        lead.follow = follow
        rankings.append(lead.ranked().tolist())
        lead._ranked = lead._key = None  # the same state, sorted from scratch
        assert lead.ranked().tolist() == rankings[-1], follow
    assert rankings[0] != rankings[1]

"""Task loaders on the real shared files (counts from each SOURCE.txt) and the scorers on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from h2o_cli.config import CacheSettings
from h2o_cli.eval import data
from h2o_cli.eval.scoring import contains_answer, exact_match, wilson_interval


@pytest.mark.data
def test_loader_counts_match_source_txt():
    copa = data.load_copa()
    assert (len(copa["train"]), len(copa["validation"])) == (400, 100)
    assert copa["validation"][0]["premise"] == "The man turned on the faucet."  # SuperGLUE val idx 0
    assert len(data.load_piqa()) == 1838
    assert len(data.load_openbookqa()) == 500
    assert len(data.load_winogrande()) == 1267
    rte = data.load_rte()
    assert len(rte) == 277 and sum(row["label"] == 0 for row in rte) == 146
    mathqa = data.load_mathqa()
    assert len(mathqa) == 1000 and all(len(doc["choices"]) == 5 for doc in mathqa)
    assert mathqa[0]["choices"] == ["12", "16", "18", "24", "26"]
    assert len(data.load_xsum()) == 1000
    hotpot = data.load_hotpotqa()
    assert len(hotpot) == 103 and sum(item["type"] == "bridge" for item in hotpot) == 82
    assert len(data.load_kv_retrieval()) == 500


def test_mathqa_list_quirk_parses_like_the_plain_form():
    plain = data.mathqa_options("a ) 1 , b ) 2 , c ) 3 , d ) 4 , e ) 5")
    quirk = data.mathqa_options("['a ) 1', 'b ) 2', 'c ) 3', 'd ) 4', 'e ) 5']")
    assert plain == quirk == ["1", "2", "3", "4", "5"]


def test_wilson_interval_hand_computed():
    # p = 0.5, n = 4, z = 1.96: centre 0.5, half = 1.96*sqrt(0.0625 + 0.2401)/1.9604 = 0.34998...
    low, high = wilson_interval(0.5, 4)
    half = 1.959964 * math.sqrt(0.25 / 4 + 1.959964**2 / 64) / (1 + 1.959964**2 / 4)
    assert (low, high) == pytest.approx((0.5 - half, 0.5 + half))
    assert half == pytest.approx(0.34996, abs=1e-4)
    # 0 of 10: Wilson gives [0, z^2 / (n + z^2)] = [0, 3.8415 / 13.8415] = [0, 0.27753]
    assert wilson_interval(0.0, 10) == pytest.approx((0.0, 1.959964**2 / (10 + 1.959964**2)))
    assert all(math.isnan(bound) for bound in wilson_interval(0.5, 0))


def test_answer_matching():
    assert exact_match("The Eiffel Tower.", ["eiffel tower"])
    assert not exact_match("It is the Eiffel Tower", ["eiffel tower"])
    assert contains_answer("It is the Eiffel Tower", ["eiffel tower"])


def test_budget_is_a_fraction_of_each_prompt():
    settings = CacheSettings(budget=0.2, policy="h2o")
    assert settings.resolved(100, floor=True).budget == 20
    assert settings.resolved(4, floor=True).budget == 2  # never below 2 tokens
    assert CacheSettings(policy="sink", budget=0.2).resolved(10, floor=True).sinks == 1


def test_multiple_choice_score_hand_computed(tiny_pair):
    """continuation_scores on a tiny model equals a log-likelihood computed by hand from one plain forward."""
    from h2o_cli.eval.scoring import CachePool, continuation_scores

    reference, model = tiny_pair
    context, choices = [5, 9, 17, 3, 40, 41], [[7, 8], [60]]
    cache = CachePool(model, CacheSettings(budget=0.2, policy="full")).cache_for(len(context), 2)
    assert cache.stores[0].budget == len(context) + 2  # the whole example, not the whole window
    ours = continuation_scores(model, cache, context, choices, chunk=4)
    for (score, _), choice in zip(ours, choices, strict=False):
        whole = torch.tensor([context + choice])
        logprobs = torch.log_softmax(reference(whole).logits[0].float(), -1)
        expected = sum(float(logprobs[len(context) - 1 + i, token]) for i, token in enumerate(choice))
        assert score == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("policy", ["h2o", "tova"])
def test_reusing_the_prefilled_cache_across_choices_equals_a_fresh_prefill(tiny_pair, policy):
    """Choices scored from one snapshot of the prefilled (and evicting) cache match a fresh prefill per choice."""
    from h2o_cli.eval.scoring import CachePool, continuation_scores

    _, model = tiny_pair
    generator = torch.Generator().manual_seed(3)
    context = torch.randint(0, 128, (23,), generator=generator).tolist()
    choices = [[7, 8, 9, 10, 11], [60], [5, 6, 61, 62, 63, 64, 65, 99, 100]]
    pool = CachePool(model, CacheSettings(budget=0.3, policy=policy, sinks=1))
    cache = pool.cache_for(len(context), 9)
    assert (
        cache.stores[0].budget == 7
    )  # far below the context: eviction during prefill and every continuation
    shared = continuation_scores(model, cache, context, choices, chunk=4)
    for choice, (score, greedy) in zip(choices, shared, strict=True):
        ((fresh, fresh_greedy),) = continuation_scores(
            model, pool.cache_for(len(context), 9), context, [choice], chunk=4
        )
        assert score == pytest.approx(fresh, abs=1e-5)
        assert greedy == fresh_greedy
    assert len({round(score, 3) for score, _ in shared}) == len(choices)  # the choices really differ


@pytest.mark.data
def test_needle_prompt_uses_the_chat_template_and_hits_the_length(smollm):
    from h2o_cli.eval.long_tasks import NEEDLE, NEEDLE_QUESTION, needle_examples
    from h2o_cli.prompting import user_frame

    _, tokenizer = smollm
    before, after = user_frame(tokenizer)
    assert before.startswith("<|im_start|>") and after.endswith("assistant\n")
    grid = list(needle_examples(tokenizer, lengths=(500,), depths=(0, 50, 100)))
    assert [example.cell for example in grid] == ["500x0%", "500x50%", "500x100%"]
    for example in grid:
        assert example.prompt.startswith(before) and example.prompt.endswith(after)
        assert NEEDLE_QUESTION in example.prompt[-len(after) - 100 :]  # the question, in the user message
        assert abs(len(tokenizer(example.prompt)["input_ids"]) - 500) <= 8
    positions = [example.prompt.index(NEEDLE) / len(example.prompt) for example in grid]
    assert positions[0] < 0.2 < positions[1] < 0.8 < positions[2]


@pytest.mark.data
def test_full_cache_finds_the_needle_with_the_chat_prompt(smollm):
    """The measured premise of docs/results.md's needle table: with nothing evicted, the model retrieves it."""
    from h2o_cli.eval.long_tasks import NEEDLE_ANSWERS, examples
    from h2o_cli.eval.scoring import CachePool, contains_answer, greedy_answer

    model, tokenizer = smollm
    example = next(iter(examples("needle", tokenizer)))  # 1,000 tokens, needle at depth 0%
    ids = tokenizer(example.prompt)["input_ids"]
    cache = CachePool(model, CacheSettings(budget=0.2, policy="full")).cache_for(len(ids), 32)
    answer = greedy_answer(model, tokenizer, cache, ids, 32, 256, ("\n\n",))
    assert contains_answer(answer, NEEDLE_ANSWERS), answer


def test_a_long_task_asks_its_question_after_the_document(smollm, monkeypatch):
    """A long task reads the document, then its question as a question (as `h2o stream --prompt` asks one): a
    `recall` cache chooses with the question's queries and its lead ranks the answer's pages."""
    from h2o_cli.cache import H2OCache
    from h2o_cli.eval import runner
    from h2o_cli.eval.long_tasks import LongExample
    from h2o_cli.prompting import document_frame

    model, tokenizer = smollm
    before, after = document_frame(tokenizer, "Question: What is the pass key?\nAnswer:")
    prompt = before + "The pass key is 71432. " + "The grass is green. " * 30 + after
    monkeypatch.setattr(
        runner, "examples", lambda *a: iter([LongExample(prompt, ("71432",), question=after)])
    )
    asked, asking = [], H2OCache.asking
    monkeypatch.setattr(H2OCache, "asking", lambda self, tokens, again=False: (
        asked.append((tokens, again)), asking(self, tokens, again))[1])  # fmt: skip
    settings = CacheSettings(budget=64, policy="recall", chunk=64)
    (row,) = runner.run_long(model, tokenizer, "hotpotqa", settings, 1, None)
    question = len(tokenizer(after, add_special_tokens=False)["input_ids"])
    assert asked == [(question, False), (question, True)]  # read twice: the lead ranks, then the kept read
    assert row["n"] == 1

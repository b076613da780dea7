"""research/passkey_probe.py on a tiny random Llama: the needle's token span it hands the ranking must be the
needle's stream indices (the frame's head counted), so the oracle variant, which forces that span's pages
first, ranks the needle first; every variant answers from the same kept read, `outK` with the page count its
question's read gave."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, tiny_config, word_tokenizer


@pytest.fixture
def passkey_probe(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # `research` is a folder of the repository, not of the package
    import research.passkey_probe as probe

    return probe


def test_the_oracle_ranks_the_needle_first_and_each_variant_answers(passkey_probe):
    from h2o_cli.eval.lm_eval_model import H2OLM
    from h2o_cli.eval.passkey import haystacks

    torch.manual_seed(0)
    config = tiny_config()
    model = __import__("transformers").LlamaForCausalLM(config).eval()
    tokenizer = word_tokenizer(config.vocab_size)
    lm = H2OLM(model=(model, tokenizer), policy="recall", budget=48, chunk=16, recall_lead="1.1")
    essays = " ".join(f"w{3 + (i * 7) % (config.vocab_size - 3)}" for i in range(4000))
    depth, key, text = next(haystacks(tokenizer, essays, 600, [50], seed=0, wording="page"))
    with torch.inference_mode():
        variants = ["next8", "oracle8", "fill", "out1"]
        rows = passkey_probe.probe(lm, text, key, depth, "page", show=4, variants=variants)
    assert [row["variant"] for row in rows] == variants
    needle = rows[1]["needles"][0]
    assert needle["value"] == key and needle["rank"] == 0  # the forced span holds the needle
    first, last = needle["tokens"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert 0 < first < last and last - first <= len(ids)
    assert 0.4 < needle["depth"] < 0.6  # the needle at 50 % of the text read
    assert all(isinstance(row["answer"], str) and isinstance(row["correct"], bool) for row in rows)
    assert [row["lead_pages"] for row in rows[:3]] == [16, 8, None]  # next8: 8 pages and the page after each
    # out1: every page at or above the median page's score, counted at the question and kept through the answer
    ranked = rows[3]["ranked_pages"]
    assert rows[3]["lead_pages"] == rows[3]["answer_pages"] >= max(16, ranked // 2)
    assert len(rows[3]["needle_over_median"]) == 1 and len(rows[3]["over_median"]) == min(48, ranked)

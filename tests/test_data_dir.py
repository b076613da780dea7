"""Where the data comes from: `--data-dir` or $H2O_DATA, never a path guessed from the checkout."""

from __future__ import annotations

import pytest
from test_cli_stream import h2o_in_process, one_error_line

from h2o_cli.errors import H2OError
from h2o_cli.eval import data

COPA_XML = """<?xml version="1.0" encoding="UTF-8"?>
<copa-corpus version="1.0">
<item id="401" asks-for="effect" most-plausible-alternative="2">
<p>The sun rose.</p><a1>It rained.</a1><a2>It got light.</a2>
</item>
</copa-corpus>
"""


@pytest.fixture
def no_data_env(monkeypatch):
    monkeypatch.setenv(data.DATA_ENV, "")  # recorded first, so whatever a command sets is undone afterwards
    monkeypatch.delenv(data.DATA_ENV)


def write_copa(folder):
    (folder / "copa").mkdir()
    (folder / "copa" / "copa-dev.xml").write_text(COPA_XML, encoding="utf-8")


def test_no_folder_is_an_error_naming_the_option_and_the_variable(no_data_env):
    with pytest.raises(H2OError) as error:
        data.load_copa()
    assert "--data-dir" in str(error.value) and "$H2O_DATA" in str(error.value)


def test_a_missing_folder_names_it_and_both_ways_to_fix_it(monkeypatch, tmp_path):
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(H2OError, match="nowhere.*--data-dir.*H2O_DATA"):
        data.load_copa()


def test_the_environment_variable_chooses_the_folder(monkeypatch, tmp_path):
    write_copa(tmp_path)
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    copa = data.load_copa()
    assert copa["validation"] == [
        {"idx": 401, "premise": "The sun rose.", "choice1": "It rained.", "choice2": "It got light.",
         "question": "effect", "label": 1}
    ]  # fmt: skip


def test_an_explicit_folder_beats_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path / "nowhere"))
    assert data.data_dir(tmp_path) == tmp_path


def test_a_file_missing_from_the_folder_names_the_file(monkeypatch, tmp_path):
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    with pytest.raises(H2OError, match="piqa/valid.jsonl not found"):
        data.load_piqa()


@pytest.mark.parametrize("command", [["eval", "copa"], ["eval", "needle"], ["bench", "--quick"]])
def test_commands_without_data_fail_in_one_line_before_loading_a_model(
    monkeypatch, capsys, no_data_env, command
):
    import h2o_cli.cli.bench
    import h2o_cli.cli.eval

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the data folder was checked")

    monkeypatch.setattr(h2o_cli.cli.eval, "load", no_model)
    monkeypatch.setattr(h2o_cli.cli.bench, "load", no_model)
    code, out, err = h2o_in_process(monkeypatch, capsys, *command)
    assert code == 1 and out == ""
    line = one_error_line(err)
    assert "--data-dir" in line and "$H2O_DATA" in line


def test_data_dir_option_reaches_the_library(monkeypatch, capsys, no_data_env, tmp_path):
    """`bench --data-dir` on a folder without the book: the error names the book inside that folder."""
    code, _, err = h2o_in_process(monkeypatch, capsys, "bench", "--quick", "--data-dir", str(tmp_path))
    assert code == 1
    assert f"{tmp_path}/gutenberg_books/war_and_peace_pg2600.txt not found" in one_error_line(err)


@pytest.mark.data
def test_quiet_eval_shows_no_bars_and_leaves_tqdm_alone(monkeypatch, capsys, smollm):
    """`h2o eval` without --verbose: no progress bar on stderr, and tqdm itself is not patched afterwards."""
    import tqdm

    import h2o_cli.cli.eval

    monkeypatch.setattr(h2o_cli.cli.eval, "load", lambda *args, **kwargs: smollm)
    monkeypatch.setenv("TQDM_DISABLE", "")  # as a user's shell: bars would show if nothing switched them off
    init = vars(tqdm.tqdm)["__init__"]
    code, out, err = h2o_in_process(monkeypatch, capsys, "eval", "copa", "--limit", "1", "--policies", "full")
    assert code == 0, err
    assert "it/s" not in err and "%|" not in err and "copa" in err
    assert vars(tqdm.tqdm)["__init__"] is init

"""`h2o_cli.models.calibration`: the lead head kept per weights under $H2O_HOME. The key follows the weights and
not the path or name; a renamed copy finds its calibration; a calibration of a tiny random model runs end to
end and writes a valid private file; `--recall-lead auto` with none kept calibrates once where the tokenizer
is beside the weights, and leads with no head where it is not; `h2o calibrate` keeps, reuses and redoes it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import tiny_config

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.models import calibration


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("H2O_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("H2O_DATA", raising=False)
    return tmp_path / "home"


def random_llama(seed: int = 0, vocab: int = 256):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(vocab_size=vocab, max_position_embeddings=512)).eval()


@pytest.fixture
def saved(smollm, tmp_path):
    """A tiny random Llama speaking the embedded model's tokenizer, saved with it to a folder: (folder, load)
    where `load(folder)` loads a model from a folder as `load_model` does."""
    from transformers import AutoModelForCausalLM

    _, tokenizer = smollm
    folder = tmp_path / "tiny-model"
    random_llama(vocab=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, lambda where: AutoModelForCausalLM.from_pretrained(where).eval()


def test_the_key_changes_with_the_weights_and_not_with_the_path_name_or_dtype(tmp_path):
    model = random_llama()
    key = calibration.fingerprint(model)
    same = random_llama()  # the same weights, another object
    same.h2o_name = "/elsewhere/renamed-model"
    assert calibration.fingerprint(same) == key
    assert calibration.fingerprint(random_llama().to(torch.bfloat16)) == key  # the same weights, halved
    other = random_llama()
    with torch.no_grad():
        other.model.layers[1].self_attn.k_proj.weight.mul_(1.01)  # one tensor of one layer, slightly
    assert calibration.fingerprint(other) != key
    assert calibration.fingerprint(random_llama(seed=1)) != key
    assert calibration.cache_file(key).name == f"{key}.json"


def test_a_calibration_of_a_tiny_random_model_runs_end_to_end_and_writes_a_valid_private_file(saved, home):
    folder, load = saved
    model = load(folder)
    seen = []
    kept = calibration.run(
        model, calibration.own_tokenizer(model), None, lambda *row: seen.append(row), count=3, tokens=200
    )
    path = calibration.cache_file(calibration.fingerprint(model))
    assert path.parent == home / "calibration" and oct(path.stat().st_mode & 0o777) == "0o600"
    written = json.loads(path.read_text())
    assert written == kept and written["version"] == calibration.VERSION and written["probes"] == 3
    assert [done for done, _, _ in seen] == [1, 2, 3] and len(written["runs"]) == 3
    assert len(written["score"]) == 2 and all(len(row) == 2 for row in written["score"])
    assert written["lead"] is None or written["lead"] == [
        written["ranked"][0]["layer"],
        written["ranked"][0]["kv_head"],
    ]
    assert written["answered"] == sum(run["correct"] for run in written["runs"])
    assert calibration.load(model) == written


def test_a_renamed_copy_finds_its_calibration_and_leads_with_it(saved, tmp_path, monkeypatch):
    """A calibration kept for the weights in one folder (its lead planted as 1.0) is the one a copy of the
    folder under another name finds: `auto` leads with it, and nothing is calibrated again."""
    folder, load = saved
    model = load(folder)
    kept = calibration.run(model, calibration.own_tokenizer(model), None, count=1, tokens=120)
    planted = {**kept, "lead": [1, 0]}
    calibration.cache_file(kept["fingerprint"]).write_text(json.dumps(planted))
    copy = shutil.copytree(folder, tmp_path / "my-renamed-copy")
    renamed = load(copy)
    renamed.h2o_name = str(copy)
    monkeypatch.setattr(calibration, "run", lambda *args, **kwargs: pytest.fail("calibrated again"))
    assert calibration.load(renamed) == planted
    cache = H2OCache(renamed, CacheSettings(budget=40, policy="recall", chunk=16, page_size=4))
    assert (cache.lead.layer, cache.lead.head) == (1, 0)


def test_auto_with_no_calibration_calibrates_once_where_the_tokenizer_is_beside_the_weights(
    saved, monkeypatch
):
    folder, load = saved
    model = load(folder)
    settings = CacheSettings(budget=40, policy="recall", chunk=16, page_size=4)  # recall_lead auto
    real, calls = calibration.run, []

    def counted(*args, **kwargs):
        calls.append(args)
        return {**real(*args, **{**kwargs, "count": 1, "tokens": 120}), "lead": None} | _plant(args[0])

    monkeypatch.setattr(calibration, "run", counted)
    first = H2OCache(model, settings)
    assert len(calls) == 1 and (first.lead.layer, first.lead.head) == (1, 1)
    monkeypatch.setattr(calibration, "run", lambda *args, **kwargs: pytest.fail("calibrated again"))
    again = H2OCache(load(folder), settings)  # the same weights, loaded again: the kept file
    assert (again.lead.layer, again.lead.head) == (1, 1)
    assert (
        H2OCache(model, CacheSettings(budget=40, policy="recall", chunk=16, page_size=4, page_carry=0.0)).lead
        is None
    )


def _plant(model) -> dict:
    """Plant lead 1.1 in the file just written for `model` (a random model answers nothing, so finds none)."""
    path = calibration.cache_file(calibration.fingerprint(model))
    planted = {**json.loads(path.read_text()), "lead": [1, 1]}
    path.write_text(json.dumps(planted))
    return {"lead": [1, 1]}


def test_auto_with_no_calibration_and_no_tokenizer_leads_with_no_head(home, monkeypatch):
    """A model built in code (no folder, no tokenizer): nothing to calibrate with, so each head's own choice,
    and no file written."""
    monkeypatch.setattr(calibration, "run", lambda *args, **kwargs: pytest.fail("calibrated"))
    cache = H2OCache(random_llama(), CacheSettings(budget=40, policy="recall", chunk=16, page_size=4))
    assert cache.lead is None and not (home / "calibration").exists()


def test_h2o_calibrate_keeps_reuses_and_redoes_the_calibration(saved, monkeypatch, home):
    from typer.testing import CliRunner

    import h2o_cli.models
    from h2o_cli.cli.app import app

    folder, load = saved
    model = load(folder)
    tokenizer = calibration.own_tokenizer(model)
    monkeypatch.setattr(h2o_cli.models, "load_model", lambda *args, **kwargs: (model, tokenizer))
    args = ["calibrate", "--probes", "2", "--length", "150", "--threads", "0", "--json"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    report = json.loads(first.stdout)
    path = calibration.cache_file(report["fingerprint"])
    assert json.loads(path.read_text()) == report and report["model"] == "smollm2-135m"
    before = path.stat().st_mtime_ns
    again = CliRunner().invoke(app, args)
    assert json.loads(again.stdout) == report and path.stat().st_mtime_ns == before  # kept: not redone
    os.utime(path, ns=(0, 0))
    forced = CliRunner().invoke(app, [*args, "--force"])
    assert forced.exit_code == 0 and path.stat().st_mtime_ns != 0  # written again
    shown = CliRunner().invoke(app, ["models", "--json"])
    rows = {row["alias"]: row for row in json.loads(shown.stdout)}
    assert rows["smollm2-135m"]["calibrated"] and not rows["gemma3-270m"]["calibrated"]

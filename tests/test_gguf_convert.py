"""Converting a GGUF file once into $H2O_HOME: several processes may start at once (torchrun ranks, parallel
test workers) on a fresh home; none may see a partial folder or delete the one another process is reading."""

from __future__ import annotations

import json

import pytest
import transformers
from conftest import tiny_config

from h2o_cli.models.gguf import convert_gguf


class _Tokenizer:
    def save_pretrained(self, folder):
        (folder / "tokenizer.json").write_text("{}")


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path):
    """A .gguf path whose 'loading' gives a tiny random Llama (the conversion's save path is what is tested)."""
    model = transformers.LlamaForCausalLM(tiny_config()).eval()
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _Tokenizer())
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    return gguf


def test_conversion_writes_a_loadable_folder(fake_gguf, tmp_path):
    target = tmp_path / "home" / "model"
    convert_gguf(fake_gguf, target)
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == 2
    assert list(target.glob("*.safetensors")) and (target / "tokenizer.json").is_file()
    assert [p.name for p in target.parent.iterdir()] == ["model"]  # no staging folder left behind


def test_a_folder_another_process_finished_first_is_kept(fake_gguf, tmp_path):
    target = tmp_path / "home" / "model"
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"written_by": "the other process"}')
    convert_gguf(fake_gguf, target)  # its own rename fails: the finished folder wins, no error
    assert json.loads((target / "config.json").read_text()) == {"written_by": "the other process"}
    assert [p.name for p in target.parent.iterdir()] == ["model"]


def test_a_torn_folder_is_replaced(fake_gguf, tmp_path):
    target = tmp_path / "home" / "model"
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"partial")  # no config.json: an interrupted old conversion
    convert_gguf(fake_gguf, target)
    assert (target / "config.json").is_file()
    assert (target / "model.safetensors").stat().st_size > len(b"partial")

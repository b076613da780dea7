"""A saved read (h2o_cli.saved): what a resumed cache generates equals what the process that read the text
generates without stopping, for every policy, on the torch step and the C step, with sliding-window layers and
recall's archive; and a question asked from a save leaves the save as it was."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace

import pytest
import torch
from conftest import tiny_config
from test_chat_cli import home, loaded  # noqa: F401  (fixtures)
from test_gemma import gemma_pair  # noqa: F401  (a fixture)

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.errors import H2OError
from h2o_cli.generation import Sampling, generate_ids
from h2o_cli.policy_registry import policy_names
from h2o_cli.prompting import NewChunk
from h2o_cli.saved import model_identity, open_saved, write_saved
from h2o_cli.saved_checks import resume_settings
from h2o_cli.streaming import prefill

TEXT, QUESTION, ANSWER, CHUNK = 150, 6, 16, 8


@pytest.fixture(scope="module")
def tiny():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_config()).eval()


@pytest.fixture(scope="module")
def tiny_gemma(gemma_pair):  # noqa: F811  (the fixture imported above)
    return gemma_pair[1]


def ids(count: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def ask(model, cache, question: list[int]) -> list[int]:
    """The greedy answer to `question` (read as a question, as `h2o stream --prompt` reads one)."""
    logits, stats = prefill(model, cache, [NewChunk(question)], CHUNK)
    stats.reraise()
    return list(generate_ids(model, cache, logits, Sampling(max_new_tokens=ANSWER)))


def read(model, settings: CacheSettings, text: list[int]) -> H2OCache:
    cache = H2OCache(model, settings)
    _, stats = prefill(model, cache, [text], CHUNK)
    stats.reraise()
    return cache


def settings_of(policy: str, kernels: str) -> CacheSettings:
    return CacheSettings(
        budget=32, policy=policy, chunk=CHUNK, kernels=kernels, page_size=4, recall_lead="none"
    )


def saved_and_resumed(model, settings, tmp_path, text, question):
    """(answer of the process that read `text` and saved it, answer of a cache resumed from that save)."""
    tmp_path.mkdir(exist_ok=True)
    reader = read(model, settings, text)
    identity = model_identity(model, "tiny")
    write_saved(tmp_path / "read", reader, identity, {})
    want = ask(model, reader, question)
    saved = open_saved(tmp_path / "read")
    resumed = H2OCache(model, resume_settings(saved, {}))
    saved.load_into(resumed)
    return want, ask(model, resumed, question)


@pytest.mark.parametrize("kernels", ["torch", "auto"])
@pytest.mark.parametrize("policy", policy_names())
def test_a_resumed_read_answers_as_the_reading_process(tiny, tmp_path, policy, kernels):
    """`auto` takes the C step where the policy has one (`kernel_victim`; checked by counting its calls),
    `torch` never does."""
    from unittest import mock

    from h2o_kernels import native
    from h2o_kernels.dispatch import use_native

    from h2o_cli.policies import make_policy

    settings = settings_of(policy, kernels)
    with mock.patch.object(native, "step", wraps=native.step) as c_calls:
        want, got = saved_and_resumed(tiny, settings, tmp_path, ids(TEXT, 1), ids(QUESTION, 2))
    assert got == want and len(got) == ANSWER
    c_step = kernels == "auto" and make_policy(settings).kernel_victim and use_native(torch.device("cpu"))
    assert (c_calls.call_count > 0) == bool(c_step), c_calls.call_count


@pytest.mark.parametrize("policy", ["h2o", "sink"])
def test_pinned_tokens_come_back_pinned(tiny, tmp_path, policy):
    """A save of a cache with pinned tokens (some read, some still to come) resumes with the same pins and
    pinned entries, so eviction after the resume keeps them as the reading process does: same answer, and the
    pinned tokens still resident in both after it."""
    settings = settings_of(policy, "torch")
    text, question = ids(TEXT, 5), ids(QUESTION, 6)
    reader = H2OCache(tiny, settings)
    reader.pin({3, 40, TEXT + 2})  # two read soon, one in the question
    _, stats = prefill(tiny, reader, [text], CHUNK)
    stats.reraise()
    write_saved(tmp_path / "read", reader, model_identity(tiny, "tiny"), {})
    want = ask(tiny, reader, question)
    saved = open_saved(tmp_path / "read")
    resumed = H2OCache(tiny, resume_settings(saved, {}))
    saved.load_into(resumed)
    assert [layer.store.pins for layer in resumed.layers] == [{3, 40, TEXT + 2}] * len(resumed.layers)
    assert ask(tiny, resumed, question) == want
    for cache in (reader, resumed):
        for layer in cache.layers:
            resident = set(layer.store.token_index[layer.store.valid].tolist())
            assert {3, 40, TEXT + 2} <= resident


@pytest.mark.parametrize("policy", ["h2o", "recall"])
def test_sliding_window_layers_resume_too(tiny_gemma, tmp_path, policy):
    want, got = saved_and_resumed(
        tiny_gemma, settings_of(policy, "auto"), tmp_path, ids(TEXT, 3), ids(QUESTION, 4)
    )
    assert got == want


@pytest.mark.parametrize("archive, bits", [("ram", None), ("disk", None), ("disk", 8)])
def test_a_question_from_a_save_leaves_the_save_as_it_was(tiny, tmp_path, archive, bits):
    """Two questions asked from one save in turn: the second is answered as if asked first, and every file
    of the save keeps its bytes (recall's new pages land in the resumed cache's own archive, in RAM or in its
    own mapped file, int8 or not); the first answer is the reading process's."""
    settings = replace(settings_of("recall", "auto"), archive=archive, archive_bits=bits)
    want, got = saved_and_resumed(tiny, settings, tmp_path / "first", ids(TEXT, 5), ids(QUESTION, 6))
    assert got == want
    write_saved(tmp_path / "read", read(tiny, settings, ids(TEXT, 5)), model_identity(tiny, "tiny"), {})
    before = {path: path.read_bytes() for path in (tmp_path / "read").rglob("*") if path.is_file()}
    answers = []
    for question in (ids(QUESTION, 6), ids(QUESTION, 7), ids(QUESTION, 6)):
        saved = open_saved(tmp_path / "read")
        cache = H2OCache(tiny, resume_settings(saved, {}))
        saved.load_into(cache)
        answers.append(ask(tiny, cache, question))
    assert answers[0] == answers[2] and answers[0] != answers[1]
    assert {path: path.read_bytes() for path in (tmp_path / "read").rglob("*") if path.is_file()} == before


def test_the_save_is_private_and_sized_as_its_arrays(tiny, tmp_path):
    cache = read(tiny, settings_of("recall", "auto"), ids(TEXT, 8))
    written = write_saved(tmp_path / "sub" / "read", cache, model_identity(tiny, "tiny"), {})
    folder = tmp_path / "sub" / "read"
    for path in [folder, *folder.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), path
    assert written == sum(
        entry["bytes"] for entry in json.loads((folder / "manifest.json").read_text())["arrays"].values()
    )
    assert written == sum(path.stat().st_size for path in (folder / "arrays").iterdir())


def test_another_model_or_other_settings_are_refused_naming_the_difference(tiny, tmp_path):
    settings = settings_of("h2o", "auto")
    write_saved(tmp_path / "read", read(tiny, settings, ids(40, 9)), model_identity(tiny, "tiny"), {})
    saved = open_saved(tmp_path / "read")
    with pytest.raises(H2OError, match="--budget 32, not 64"):
        resume_settings(saved, {"budget": 64})
    with pytest.raises(H2OError, match="--policy h2o, not sink"):
        resume_settings(saved, {"policy": "sink"})
    assert (
        resume_settings(saved, {"budget": 32, "kernels": "torch"}).kernels == "torch"
    )  # what changes nothing
    import transformers

    from h2o_cli.saved_checks import check_model

    torch.manual_seed(1)
    other = transformers.LlamaForCausalLM(tiny_config()).eval()
    check_model(saved, model_identity(tiny, "tiny"))
    with pytest.raises(H2OError, match="made with model tiny"):
        check_model(saved, model_identity(other, "other"))


def test_a_damaged_save_is_refused_in_one_line(tiny, tmp_path):
    write_saved(
        tmp_path / "read", read(tiny, settings_of("h2o", "auto"), ids(40, 10)), model_identity(tiny, "t"), {}
    )
    manifest = json.loads((tmp_path / "read" / "manifest.json").read_text())
    keys = tmp_path / "read" / manifest["arrays"]["layers.0.store.keys"]["file"]
    data = bytearray(keys.read_bytes())
    data[100] ^= 1
    keys.write_bytes(bytes(data))
    saved = open_saved(tmp_path / "read")
    with pytest.raises(H2OError, match="damaged .*differs"):
        saved.load_into(H2OCache(tiny, resume_settings(saved, {})))
    keys.write_bytes(bytes(data[:-5]))
    with pytest.raises(H2OError, match="damaged .*holds"):
        open_saved(tmp_path / "read")
    (tmp_path / "read" / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(H2OError, match="format version 99"):
        open_saved(tmp_path / "read")
    (tmp_path / "read" / "manifest.json").write_text("{")
    with pytest.raises(H2OError, match="damaged"):
        open_saved(tmp_path / "read")
    assert os.path.isdir(tmp_path / "read")


@pytest.mark.parametrize("kernels", ["torch", "auto"])
@pytest.mark.parametrize("policy", policy_names())
def test_the_embedded_model_answers_from_a_save_as_the_reading_process(
    smollm, excerpt, tmp_path, policy, kernels
):
    """`h2o stream --save --prompt` reads the text (`text_pieces`), saves, then reads the question as a chunk of
    its own (`question_pieces`); `--resume --prompt` reads the question alone into a cache resumed from the
    save. The answers are equal."""
    from h2o_cli.saved_read import open_text_save, question_pieces, resumed_cache, save_text_read, text_pieces

    model, tokenizer = smollm
    text, question, chunk = tokenizer(excerpt)["input_ids"][:300], "Who is writing these letters?", 32
    settings = CacheSettings(budget=64, policy=policy, chunk=chunk, kernels=kernels)
    sampling = Sampling(max_new_tokens=8)
    reader = H2OCache(model, settings)
    prefill(model, reader, text_pieces(tokenizer, [text], None), chunk)[1].reraise()
    save_text_read(tmp_path / "read", reader, model, "smollm2-135m", {}, {})
    logits, _ = prefill(model, reader, question_pieces(tokenizer, question), chunk)
    want = list(generate_ids(model, reader, logits, sampling))
    saved = open_text_save(tmp_path / "read")
    resumed = resumed_cache(saved, model, "smollm2-135m", resume_settings(saved, {}))
    logits, _ = prefill(model, resumed, question_pieces(tokenizer, question), chunk)
    assert list(generate_ids(model, resumed, logits, sampling)) == want


def test_the_embedded_model_answers_from_a_mapped_archive_as_the_reading_process(smollm, excerpt, tmp_path):
    """recall with its archive in a file: the resumed cache maps the save's `archive.kv` (no copy) and gives
    the reading process's answer to two questions in turn, on the C step."""
    from h2o_cli.saved_read import open_text_save, question_pieces, resumed_cache, save_text_read, text_pieces

    model, tokenizer = smollm
    text, chunk = tokenizer(excerpt)["input_ids"][:600], 32
    settings = CacheSettings(budget=64, policy="recall", chunk=chunk, archive=f"{tmp_path}/archives/")
    sampling = Sampling(max_new_tokens=8)
    for question in ("Who is writing these letters?", "Where is the ship?"):
        reader = H2OCache(model, settings, archive_span=len(text) + 4096)  # a reading process per question
        prefill(model, reader, text_pieces(tokenizer, [text], None), chunk)[1].reraise()
        if not (tmp_path / "read").exists():
            spans = {"archive_span": len(text) + 4096}
            save_text_read(tmp_path / "read", reader, model, "smollm2-135m", {}, spans)
        logits, _ = prefill(model, reader, question_pieces(tokenizer, question), chunk)
        want = list(generate_ids(model, reader, logits, sampling))
        saved = open_text_save(tmp_path / "read")
        resumed = resumed_cache(saved, model, "smollm2-135m", resume_settings(saved, {}))
        assert resumed.archive_file.adopted
        logits, _ = prefill(model, resumed, question_pieces(tokenizer, question), chunk)
        assert list(generate_ids(model, resumed, logits, sampling)) == want
        resumed.close()
        reader.close()


@pytest.mark.parametrize("policy", ["h2o", "recall"])
def test_a_resumed_chat_answers_as_the_chat_that_went_on(smollm, tmp_path, policy):
    from h2o_cli.chat import ChatSession
    from h2o_cli.cli.chat import default_chunk

    model, tokenizer = smollm
    settings = CacheSettings(budget=48, policy=policy, chunk=default_chunk(policy))
    talk = ChatSession(model, tokenizer, settings, Sampling(max_new_tokens=10), system="Be brief.")
    talk.ask("Name three colours.")
    talk.save_read(tmp_path / "chat", "smollm2-135m")
    want = talk.ask("And three animals?")
    saved = open_saved(tmp_path / "chat")
    resumed = ChatSession(
        model, tokenizer, resume_settings(saved, {}), Sampling(max_new_tokens=10), "Be brief."
    )
    resumed.load_read(saved, "smollm2-135m")
    assert resumed.ask("And three animals?") == want
    assert resumed.transcript() == talk.transcript() and list(resumed.ids) == list(talk.ids)


def test_chat_saves_on_exit_and_at_slash_save_and_resumes_without_reading(
    loaded,  # noqa: F811
    home,  # noqa: F811
    tmp_path,
):
    """`h2o chat --save S` (piped: after its answer), `--resume S` (saved there again), `/save NAME` in the loop,
    and a bare `/save` to the resumed save; the transcript's `/save FILE.json` stays a transcript."""
    from typer.testing import CliRunner

    from h2o_cli.cli.app import app

    save = tmp_path / "talk"
    args = ["chat", "--budget", "32", "--chunk", "16", "-n", "4"]
    result = CliRunner().invoke(app, [*args, "--save", str(save)], input="My name is Ana.\n")
    assert result.exit_code == 0, result.output
    first = open_saved(save)
    assert [turn["role"] for turn in first.extra["turns"]] == ["user", "assistant"]
    result = CliRunner().invoke(app, ["chat", "--json", "-n", "4", "--resume", str(save)], input="My name?\n")
    assert result.exit_code == 0, result.output
    assert "resumed 2 messages" in result.stderr and "without reading them again" in result.stderr
    assert json.loads(result.stdout)["turns"] == 4 and len(open_saved(save).extra["turns"]) == 4
    script = f"Thanks!\n/save {tmp_path / 'other'}\n/save {tmp_path / 'talk.json'}\n/save\n/exit\n"
    result = CliRunner().invoke(app, ["chat", "-i", "-n", "4", "--resume", str(save)], input=script)
    assert result.exit_code == 0, result.output
    assert len(open_saved(tmp_path / "other").extra["turns"]) == 6 == len(open_saved(save).extra["turns"])
    assert json.loads((tmp_path / "talk.json").read_text())["turns"][0]["content"] == "My name is Ana."

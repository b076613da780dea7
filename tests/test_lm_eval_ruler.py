"""lm-eval past the model's window: a policy that streams reads each context whole (RULER's long documents
reach the cache), `full` keeps the end of a longer context as lm-eval's `hf` does; RULER runs offline."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import REPO, tiny_config, word_tokenizer
from naive import naive_model_nll

pytest.importorskip("lm_eval")

WINDOW = 64


@pytest.fixture
def tiny_window():
    """(reference with sdpa, the same weights for the cache, a word tokenizer): a tiny Llama of a 64-token window."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_config(max_position_embeddings=WINDOW)
    reference = LlamaForCausalLM(config).eval()
    model = LlamaForCausalLM(copy.deepcopy(config)).eval()
    model.load_state_dict(reference.state_dict())
    return reference, model, word_tokenizer(config.vocab_size)


def words(count: int, seed: int = 0) -> str:
    """`count` random words of the word tokenizer, one token each (w30-w99: "w1"/"w2", its end and start tokens,
    would match inside "w117")."""
    generator = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(30, 100, (count,), generator=generator))


def generate(lm, context: str, max_new: int) -> tuple[str, list]:
    """lm.generate_until on one request, and every cache built for it."""
    from lm_eval.api.instance import Instance

    caches = []
    for pool in {id(lm.pool): lm.pool, id(lm.long_pool): lm.long_pool}.values():
        build = pool.cache_for
        pool.cache_for = lambda *args, build=build, **kwargs: (
            caches.append(build(*args, **kwargs)) or caches[-1]
        )
    request = Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": max_new}), 0)
    (text,) = lm.generate_until([request], disable_tqdm=True)
    return text, caches


@pytest.mark.parametrize("budget", ["16", "0.25"])
def test_a_streaming_policy_reads_a_context_past_the_window_whole(tiny_window, budget):
    """200 prompt tokens through a 64-token window: the cache sees every one of them (not the last 60), its
    budget the window's (16 = a count, or 0.25 of the window; not 0.25 of the prompt, 50)."""
    from h2o_cli.eval.lm_eval_model import H2OLM

    _, model, tokenizer = tiny_window
    lm = H2OLM(model=(model, tokenizer), budget=budget, policy="h2o", chunk=8)
    context = words(200)
    prompt = tokenizer(context, add_special_tokens=False)["input_ids"]
    assert len(prompt) == 200 > WINDOW
    text, (cache,) = generate(lm, context, 4)
    answer = text.split()  # one word a token
    assert len(answer) <= 4
    assert cache.tokens_seen in (len(prompt) + len(answer) - 1, len(prompt) + len(answer))
    assert lm.budget_tokens == [16] and lm.contexts_cut == 0


def test_a_streaming_policy_scores_a_long_context_as_the_naive_reference(tiny_window):
    """loglikelihood after a 200-token context under h2o (16 tokens, chunks of 8, rolling positions): the whole
    context read, equal to the naive simulation of SPEC.md over the same chunks."""
    from lm_eval.api.instance import Instance

    from h2o_cli.config import CacheSettings
    from h2o_cli.eval.lm_eval_model import H2OLM

    _, model, tokenizer = tiny_window
    lm = H2OLM(model=(model, tokenizer), budget=16, policy="h2o", chunk=8)
    context, continuation = words(200), " w35 w49 w81"
    request = Instance("loglikelihood", {}, (context, continuation), 0)
    ((score, _),) = lm.loglikelihood([request], disable_tqdm=True)
    ids = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    settings = CacheSettings(budget=16, policy="h2o", chunk=8, positions="rolling")
    nlls = naive_model_nll(
        model, ids, settings, sizes=[8] * 25 + [3]
    )  # the last token is predicted, not read
    assert score == pytest.approx(-sum(nlls[-3:]), rel=1e-4)
    assert lm.budget_tokens == [16]


def test_a_streaming_policy_scores_a_long_document_whole_with_the_windows_budget(tiny_window):
    """loglikelihood_rolling of a 200-token document under h2o at 0.25: one pass over all of it, with 16 tokens
    (a quarter of the window, not of the document), equal to the naive simulation of SPEC.md."""
    from lm_eval.api.instance import Instance

    from h2o_cli.config import CacheSettings
    from h2o_cli.eval.lm_eval_model import H2OLM

    _, model, tokenizer = tiny_window
    lm = H2OLM(model=(model, tokenizer), budget=0.25, policy="h2o", chunk=8)
    text = words(200, seed=2)
    request = Instance("loglikelihood_rolling", {}, (text,), 0)
    (score,) = lm.loglikelihood_rolling([request], disable_tqdm=True)
    ids = [lm.prefix_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
    settings = CacheSettings(budget=16, policy="h2o", chunk=8, positions="rolling")
    nlls = naive_model_nll(model, ids, settings, sizes=[1] + [8] * 24 + [7, 1])
    assert lm.budget_tokens == [16]
    assert score == pytest.approx(-sum(nlls), rel=1e-4)


@pytest.mark.parametrize(("policy", "count"), [("recall", 100), ("recall", 40), ("h2o", 100)])
def test_a_recalling_policy_reads_the_last_line_past_the_window_as_its_question(
    tiny_window, monkeypatch, policy, count
):
    """Under a policy that recalls, the last line of a context past the window is read as a question after
    the text (as `h2o stream --prompt` reads one); a context inside it, or under another policy, is one text."""
    import h2o_cli.eval.lm_eval_model as module

    _, model, tokenizer = tiny_window
    read = {}
    monkeypatch.setattr(
        module, "greedy_answer", lambda *args: read.update(text=args[3], question=args[7]) or ""
    )
    lm = module.H2OLM(model=(model, tokenizer), budget=16, policy=policy, chunk=8)
    text, question = words(count), words(5, seed=3)
    generate(lm, f"{text}\n{question}", 4)
    ids = lambda string: tokenizer(string, add_special_tokens=False)["input_ids"]  # noqa: E731
    split = policy == "recall" and count + 5 > WINDOW
    want = (ids(text), ids(question)) if split else (ids(f"{text} {question}"), [])
    assert (list(read["text"]), list(read["question"])) == want


def test_full_keeps_the_end_of_a_context_past_the_window_and_says_so(tiny_window, caplog):
    """`full` cannot pass the window: it reads the last `window - max_gen_toks` tokens of a longer context, as
    lm-eval's `hf` model does, answers what plain transformers greedy-generates from them, and warns once."""
    from h2o_cli.eval.lm_eval_model import H2OLM

    reference, model, tokenizer = tiny_window
    lm = H2OLM(model=(model, tokenizer), budget=1.0, policy="full", chunk=16)
    context = words(200, seed=1)
    prompt = tokenizer(context, add_special_tokens=False)["input_ids"]
    with caplog.at_level("WARNING"):
        text, (cache,) = generate(lm, context, 4)
    kept = prompt[-(WINDOW - 4) :]
    with torch.no_grad():
        want = reference.generate(
            torch.tensor([kept]), max_new_tokens=4, do_sample=False, eos_token_id=tokenizer.eos_token_id
        )[0, len(kept) :].tolist()
    assert want and text.split() == tokenizer.decode(want, skip_special_tokens=True).split()
    assert len(kept) <= cache.tokens_seen <= WINDOW
    assert "1 context(s)" in caplog.text


def test_an_interrupted_run_resumes_from_lm_evals_answer_cache(tiny_window, tmp_path):
    """`--use_cache DB`: each answer is stored as it comes (not at the end), so a long RULER run stopped after
    one document answers it again from the store and reads only the others."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import CachingLM

    from h2o_cli.eval.lm_eval_model import H2OLM

    _, model, tokenizer = tiny_window
    contexts = [words(120, seed=seed) for seed in (3, 4)]
    requests = [
        Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": 3}), index)
        for index, context in enumerate(contexts)
    ]
    first = H2OLM(model=(model, tokenizer), budget="16", policy="h2o", chunk=8)
    read: list[str] = []
    answer = first.generate_until

    def interrupted(batch, disable_tqdm=False):
        read.extend(request.args[0] for request in batch)
        texts = answer(batch[:1], disable_tqdm=True)
        raise KeyboardInterrupt(texts)  # stopped after the first document's answer

    first.generate_until = interrupted
    with pytest.raises(KeyboardInterrupt):
        CachingLM(first, str(tmp_path / "answers")).generate_until(requests)
    again = H2OLM(model=(model, tokenizer), budget="16", policy="h2o", chunk=8)
    read_again: list[str] = []
    answer_again = again.generate_until

    def counted(batch, disable_tqdm=False):
        read_again.extend(request.args[0] for request in batch)
        return answer_again(batch, disable_tqdm=True)

    again.generate_until = counted
    texts = CachingLM(again, str(tmp_path / "answers")).generate_until(requests)
    assert read == contexts and read_again == contexts[1:]  # the first document's answer was kept
    fresh = H2OLM(model=(model, tokenizer), budget="16", policy="h2o", chunk=8)
    assert texts == fresh.generate_until(requests, disable_tqdm=True)


def test_ruler_tasks_are_known_by_the_names_lm_eval_gives_them():
    """`h2o lm-eval --tasks ruler_vt` must be seen as a RULER task (it then gets the tokenizer and the offline
    haystacks): the names are the ones the YAML files declare, not the files' own names (`vt.yaml`)."""
    from h2o_cli.eval.ruler import asked_tasks, ruler_names

    names = ruler_names()
    assert {"ruler_vt", "ruler_cwe", "niah_single_1", "niah_multivalue", "ruler", "longcxt"} <= names
    assert "vt" not in names and "cwe" not in names  # lm-eval answers "Tasks not found" to these
    assert names & set(asked_tasks(["--tasks", "ruler_vt,piqa"])) == {"ruler_vt"}


@pytest.mark.model  # the embedded model, end to end through lm-eval's RULER generator
@pytest.mark.slow  # ~100 s: importing lm-eval's RULER words, generating 500 documents, 2 answers of 128 tokens
def test_h2o_lm_eval_runs_ruler_offline(smollm, plain_smollm, tmp_path):
    """`h2o lm-eval --tasks niah_single_1` offline at 512 tokens (inside the window, `full`): a score in
    [0, 1], and each logged answer what plain transformers greedy-generates for the logged prompt."""
    env = {**__import__("os").environ, "PYTHONPATH": f"{REPO}:{REPO / 'kernels'}", "HF_HUB_OFFLINE": "1"}
    env |= {"HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [sys.executable, "-m", "h2o_cli", "lm-eval", "--model", "h2o", "--model_args",
         "policy=full,budget=1.0,dtype=float32", "--tasks", "niah_single_1", "--metadata",
         '{"max_seq_lengths":[512]}', "--limit", "2", "--log_samples", "--output_path", str(tmp_path / "out")],
        capture_output=True, env=env, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    (saved,) = (tmp_path / "out").rglob("results_*.json")
    score = json.loads(saved.read_text())["results"]["niah_single_1"]["512,none"]
    assert isinstance(score, float) and 0 <= score <= 1 and not math.isnan(score)
    (samples,) = (tmp_path / "out").rglob("samples_niah_single_1_*.jsonl")
    tokenizer = smollm[1]
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        prompt, kwargs = (
            sample["arguments"]["gen_args_0"]["arg_0"],
            sample["arguments"]["gen_args_0"]["arg_1"],
        )
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = plain_smollm.generate(ids, max_new_tokens=kwargs["max_gen_toks"], do_sample=False)[
                0, ids.shape[1] :
            ]
        assert sample["resps"][0][0] == tokenizer.decode(out, skip_special_tokens=True)


@pytest.mark.heavy  # imports lm-eval's RULER generator (its word lists: ~20 s)
@pytest.mark.data
def test_ruler_essay_tasks_read_the_data_folders_essays_offline(monkeypatch):
    """Offline, the essay haystack is the data folder's Paul Graham essays as whitespace-split words (what
    lm-eval makes of the Hub's), and one line says so."""
    import os
    import re
    from pathlib import Path

    pytest.importorskip("wonderwords")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks.ruler import prepare_niah

    from h2o_cli.eval.ruler import prepare_offline

    said = []
    monkeypatch.setattr(prepare_niah, "get_haystack", prepare_niah.get_haystack)  # undone after the test
    monkeypatch.setattr(prepare_niah, "cached_sent_tokenize", prepare_niah.cached_sent_tokenize)
    prepare_offline(say=said.append)
    folder = Path(os.environ["H2O_DATA"]) / "paul_graham_essays" / "PaulGrahamEssays"
    text = " ".join(path.read_text(encoding="utf-8") for path in sorted(folder.glob("*.txt")))
    assert prepare_niah.get_haystack("essay") == re.sub(r"\s+", " ", text).split(" ")
    assert prepare_niah.get_haystack("repeat").startswith("The grass is green.")
    assert any("data folder's are read instead" in line for line in said)

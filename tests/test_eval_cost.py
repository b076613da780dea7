"""Evaluating through the cache beside lm-eval's own models: the same scores as `hf`, lm-eval's models still
reachable through `h2o lm-eval`, and the one-call scoring of a short context equal to a separate prefill."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import FIXTURES, REPO, tiny_config, word_tokenizer

from h2o_cli.config import CacheSettings

pytest.importorskip("lm_eval")


def random_requests(count: int, seed: int) -> list[tuple[tuple[str, str], list[int], list[int]]]:
    """lm-eval loglikelihood requests (strings unused) of random ids: contexts of 1-40 tokens, some shared
    by several continuations of 1-12 tokens."""
    generator = torch.Generator().manual_seed(seed)
    requests = []
    while len(requests) < count:
        context = torch.randint(
            3, 128, (int(torch.randint(1, 41, (1,), generator=generator)),), generator=generator
        )
        for _ in range(int(torch.randint(1, 4, (1,), generator=generator))):
            length = int(torch.randint(1, 13, (1,), generator=generator))
            continuation = torch.randint(3, 128, (length,), generator=generator).tolist()
            requests.append((("", ""), context.tolist(), continuation))
    return requests


@pytest.mark.parametrize(
    "settings",
    [
        CacheSettings(budget=0.2, policy="full"),
        CacheSettings(budget=0.2, policy="h2o"),
        CacheSettings(budget=0.3, policy="h2o", positions="original"),
        CacheSettings(budget=0.4, policy="h2o", kv_bits=8),
        CacheSettings(budget=0.3, policy="tova"),
        CacheSettings(budget=0.3, policy="sink", sinks=1),
        CacheSettings(budget=0.3, policy="local"),
    ],
    ids=lambda settings: f"{settings.policy}-{settings.positions}-kv{settings.kv_bits}",
)
def test_one_call_per_choice_equals_a_separate_prefill(tiny_pair, settings):
    """`joint_scores` (context and continuation in one forward call, the cache's chunk from `joint_chunk`)
    gives every continuation the score and greediness of a prefill of the context, then the continuation,
    on a fresh cache; whether the context evicts before the continuation or not."""
    from h2o_cli.eval.scoring import CachePool, continuation_scores, joint_scores

    _, model = tiny_pair
    pool = CachePool(model, settings)
    generator = torch.Generator().manual_seed(5)
    joint_cases = 0
    for length in (1, 2, 5, 17, 30):
        context = torch.randint(0, 128, (length,), generator=generator).tolist()
        choices = [[7, 8, 9, 10], [60], [5, 6, 61, 62, 63, 64]]
        longest = max(len(choice) for choice in choices)
        chunk = pool.joint_chunk(len(context), longest - 1)
        if chunk is None:
            continue
        joint_cases += 1
        joint = joint_scores(model, pool.cache_for(len(context), longest, chunk=chunk), context, choices)
        for choice, (score, greedy) in zip(choices, joint, strict=True):
            ((alone, alone_greedy),) = continuation_scores(
                model, pool.cache_for(len(context), longest), context, [choice], chunk=settings.chunk
            )
            assert score == pytest.approx(alone, abs=1e-4), (length, choice)
            assert greedy == alone_greedy
    assert joint_cases >= 3
    budget = pool.budget_for(30, longest)
    assert budget == pool.cache_for(30, longest).report().resident_slots
    if settings.policy != "full":
        assert budget < 30 - longest  # the long contexts did evict before their continuations


def test_joint_chunk_refuses_what_one_call_cannot_split():
    from transformers import LlamaForCausalLM

    from h2o_cli.eval.scoring import CachePool

    model = LlamaForCausalLM(tiny_config()).eval()
    pool = CachePool(model, CacheSettings(budget=0.2, policy="h2o", chunk=16))
    assert pool.joint_chunk(10, 5) == 10 - pool.budget_for(10, 6)
    assert pool.joint_chunk(10, 9) is None  # the continuation would not fit in the slots eviction frees
    assert pool.joint_chunk(20, 2) is None  # the context alone takes two chunks
    recall = CachePool(model, CacheSettings(budget=0.5, policy="recall"))
    assert recall.joint_chunk(10, 2) is None


def test_full_gives_lm_eval_hf_loglikelihoods_per_request(tiny_pair):
    """`policy=full` through the cache: every request's log-likelihood and greediness equal lm-eval's own
    `hf` model's on the same weights (its batched, padded forward over context + continuation)."""
    from lm_eval.models.huggingface import HFLM

    from h2o_cli.eval.lm_eval_model import H2OLM

    reference, model = tiny_pair
    tokenizer = word_tokenizer(128)
    requests = random_requests(40, seed=11)
    theirs = HFLM(pretrained=reference, tokenizer=tokenizer, batch_size=4)._loglikelihood_tokens(
        requests, disable_tqdm=True
    )
    ours = H2OLM(model=(model, tokenizer), policy="full")._loglikelihood_tokens(requests, disable_tqdm=True)
    for (score, greedy), (hf_score, hf_greedy) in zip(ours, theirs, strict=True):
        assert score == pytest.approx(hf_score, abs=1e-4)
        assert greedy == hf_greedy
    assert len({round(score, 2) for score, _ in ours}) > 30  # the requests really differ


@pytest.mark.parametrize("policy", ["h2o", "sink"])
def test_scoring_in_one_call_or_after_a_prefill_gives_the_same_requests(tiny_pair, policy):
    """`CachePool.scores` picks one call per choice where it can: every request's score, greediness and the
    budget recorded per context equal those of the context prefilled alone for every request."""
    from h2o_cli.eval.lm_eval_model import H2OLM

    _, model = tiny_pair
    tokenizer = word_tokenizer(128)
    requests = random_requests(40, seed=12)
    chosen = H2OLM(model=(model, tokenizer), policy=policy, budget=0.3)
    prefilled = H2OLM(model=(model, tokenizer), policy=policy, budget=0.3)
    prefilled.pool.joint_tokens = -1
    ours = chosen._loglikelihood_tokens(requests, disable_tqdm=True)
    theirs = prefilled._loglikelihood_tokens(requests, disable_tqdm=True)
    for (score, greedy), (other, other_greedy) in zip(ours, theirs, strict=True):
        assert score == pytest.approx(other, abs=1e-4)
        assert greedy == other_greedy
    assert chosen.budget_tokens == prefilled.budget_tokens


@pytest.mark.heavy  # a fresh interpreter importing torch and lm-eval
def test_h2o_lm_eval_model_keeps_lm_evals_own_models():
    """Registering `h2o` must not hide `hf` and the rest (lm-eval lists its own models only into an empty
    registry); in a fresh interpreter, as `h2o lm-eval` imports it."""
    code = (
        "import h2o_cli.eval.lm_eval_model\n"
        "from lm_eval.api.registry import get_model\n"
        "print(get_model('h2o').__name__, get_model('hf').__name__, get_model('dummy').__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert result.stdout.decode().split() == ["H2OLM", "HFLM", "DummyLM"]


@pytest.mark.model  # the embedded model's tokenizer
def test_h2o_lm_eval_runs_lm_evals_hf_model(smollm, tmp_path):
    """`h2o lm-eval --model hf --model_args pretrained=FOLDER` runs lm-eval's own model end to end, on a tiny
    random Llama saved with the embedded model's tokenizer, on the h2o_copa task's fixture file."""
    folder, metadata = tiny_copa_model(smollm[1], tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "h2o_cli", "lm-eval", "--model", "hf", "--model_args",
         f"pretrained={folder},dtype=float32", "--tasks", "h2o_copa", "--limit", "3", "--metadata", metadata,
         "--output_path", str(tmp_path / "out")],
        capture_output=True, env=_env(), timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    (saved,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(saved.read_text())
    assert results["config"]["model"] == "hf" and results["n-samples"]["h2o_copa"]["effective"] == 3


def tiny_copa_model(tokenizer, tmp_path) -> tuple:
    """(a folder holding a tiny random Llama with the embedded model's tokenizer, lm-eval `--metadata` that
    points h2o_copa at the fixture file)."""
    from transformers import LlamaForCausalLM

    folder = tmp_path / "tiny"
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config(vocab_size=len(tokenizer))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, json.dumps({"data_path": str(FIXTURES / "tasks" / "copa.xml")})


def _env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "kernels"), os.environ.get("PYTHONPATH", "")]),
        "OMP_WAIT_POLICY": "PASSIVE",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TQDM_DISABLE": "1",
    }


@pytest.mark.model  # the embedded model's tokenizer
def test_two_processes_give_the_metrics_of_one(smollm, tmp_path):
    """Data-parallel lm-eval (`torchrun --nproc_per_node 2 -m h2o_cli lm-eval ...`, gloo on the CPU; on GPUs
    `accelerate launch --multi_gpu`): each process scores every other document with its own cache, rank 0
    gathers; the metrics and every document's scores equal a one-process run."""
    folder, metadata = tiny_copa_model(smollm[1], tmp_path)
    command = ["-m", "h2o_cli", "lm-eval", "--model", "h2o", "--model_args",
               f"model={folder},policy=h2o,budget=0.5,threads=1", "--tasks", "h2o_copa", "--metadata", metadata,
               "--log_samples"]  # fmt: skip
    launched = {}
    for processes in (1, 2):  # both at once: each spends most of its time importing and indexing tasks
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        out = tmp_path / f"out{processes}"
        launched[processes] = out, subprocess.Popen(
            [sys.executable, *(launcher if processes > 1 else []), *command, "--output_path", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env(), cwd=tmp_path,
        )  # fmt: skip
    runs = {}
    for processes, (out, run) in launched.items():
        _, err = run.communicate(timeout=600)
        assert run.returncode == 0, err.decode()[-2000:]
        (results,) = out.rglob("results_*.json")
        (samples,) = out.rglob("samples_*.jsonl")
        rows = [json.loads(line) for line in samples.read_text().splitlines()]
        scores = {row["doc_id"]: [float(resp[0][0]) for resp in row["resps"]] for row in rows}
        runs[processes] = (
            json.loads(results.read_text())["results"]["h2o_copa"],
            scores,
            [r["doc_id"] for r in rows],
        )
    (one, one_scores, _), (two, two_scores, order) = runs[1], runs[2]
    assert len(one_scores) == 4 and order != sorted(order)  # the documents were split (gathered by rank)
    for metric in ("acc,none", "acc_norm,none", "sample_len"):
        assert one[metric] == two[metric]
    assert one_scores.keys() == two_scores.keys()
    for doc, scores in one_scores.items():
        assert two_scores[doc] == pytest.approx(scores, abs=1e-5)

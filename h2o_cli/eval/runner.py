"""Run tasks x policies and return plain rows (one per task, policy, and grid cell for the needle)."""

from __future__ import annotations

import itertools
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import mean

from h2o_cli.config import CacheSettings
from h2o_cli.eval.data import check_data, copa_task
from h2o_cli.eval.long_tasks import MAX_NEW_TOKENS, examples
from h2o_cli.eval.scoring import (
    CachePool,
    budget_used,
    contains_answer,
    exact_match,
    greedy_answer,
    wilson_interval,
)

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
HARNESS_TASKS = {
    name: f"h2o_{name}"
    for name in ("copa", "copa_all", "piqa", "openbookqa", "winogrande", "rte", "mathqa", "xsum")
}


def _row(task: str, spec: CacheSettings, budget_tokens: Sequence[int], n: int, **metrics) -> dict:
    row = {
        "task": task,
        "policy": spec.policy,
        "budget": spec.budget,
        "score_norm": spec.score_norm,
        "kv_bits": spec.kv_bits,
        "budget_tokens_mean": round(mean(budget_tokens), 1) if budget_tokens else None,
        "n": n,
    }
    if "acc" in metrics and metrics["acc"] is not None:
        row["acc"] = metrics.pop("acc")
        row["ci_low"], row["ci_high"] = wilson_interval(row["acc"], n)
    row.update(metrics)
    return row


def run_harness(
    lm, task: str, spec: CacheSettings, limit: int | None, shots: int, seed: int, data: str | None
) -> dict | None:
    """One lm-eval task (friendly name, registered name or YAML path) scored through `lm` with `spec`.

    In a data-parallel run (`lm` one of several processes) rank 0 returns the row of every document; the
    others None."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    lm.configure(spec)
    name = HARNESS_TASKS.get(task, task)
    include = [str(TASKS_DIR)]
    if os.path.isfile(name) and name.endswith((".yaml", ".yml")):
        include.append(str(Path(name).resolve().parent))
        name = Path(name).stem
    # --data reaches the task's `custom_dataset` loader through lm-eval's metadata (passed to it as keyword
    # arguments); a `dataset_kwargs` override in a task dict would make an inline task without the loader.
    metadata = None
    if data:
        check_data(task, data)
        metadata = {"data_path": str(data)}
        if task == "copa":  # a file without SuperGLUE's split is scored whole, shots from its other items
            name = HARNESS_TASKS[copa_task(data)]
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=[name],
        limit=limit,
        num_fewshot=shots,
        # Indexing lm-eval's own task folder takes ~10 s per TaskManager; the project's tasks need none of it.
        task_manager=TaskManager(
            include_path=include, include_defaults=task not in HARNESS_TASKS, metadata=metadata
        ),
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
        verbosity="ERROR",
        bootstrap_iters=0,
    )
    budget_tokens = lm.gathered_budget_tokens()  # every process takes part
    if out is None:
        return None
    results = out["results"][name]
    n = int(out.get("n-samples", {}).get(name, {}).get("effective", 0))
    metrics = {
        key.split(",")[0]: value
        for key, value in results.items()
        if "," in key and "stderr" not in key and isinstance(value, (int, float))
    }
    samples = sorted(out.get("samples", {}).get(name, []), key=lambda sample: sample["doc_id"])
    if samples and all("acc" in sample for sample in samples):
        metrics["correct"] = [int(sample["acc"]) for sample in samples]  # per example, by document
    return _row(task, spec, budget_tokens, n, **metrics)


def pair_with_full(rows: list[dict]) -> list[dict]:
    """Each row of a policy other than `full` with per-example outcomes (`correct`) gains the paired
    difference from the `full` row of the same task (and needle cell): `delta_vs_full` with its 95%
    paired-bootstrap interval (`delta_low`, `delta_high`), `discordant` = [right under full only, right under
    the policy only] and McNemar's exact `mcnemar_p` (h2o_cli/eval/paired.py)."""
    from h2o_cli.eval.paired import paired_delta
    from h2o_cli.policies import policy_class

    def key(row: dict) -> tuple:
        return row["task"], row.get("length"), row.get("depth")

    def reference(row: dict) -> bool:  # `full`: the policy that keeps every token
        return not policy_class(row["policy"]).evicts

    full = {key(row): row["correct"] for row in rows if reference(row) and "correct" in row}
    for row in rows:
        base = full.get(key(row))
        if reference(row) or base is None or len(row.get("correct", ())) != len(base):
            continue
        paired = paired_delta(base, row["correct"])
        row.update(
            delta_vs_full=paired.delta,
            delta_low=paired.low,
            delta_high=paired.high,
            discordant=[paired.lost, paired.gained],
            mcnemar_p=paired.p_value,
        )
    return rows


def run_long(
    model,
    tokenizer,
    task: str,
    spec: CacheSettings,
    limit: int | None,
    data: str | None,
    on_example: Callable[[int], None] | None = None,
) -> list[dict]:
    """Greedy answers for a long-context task; rows per needle cell, one row otherwise."""
    if data:
        check_data(task, data)
    pool = CachePool(model, spec)
    cells: dict[str, dict[str, list]] = defaultdict(lambda: {"hit": [], "em": [], "budget": []})
    for number, example in enumerate(itertools.islice(examples(task, tokenizer, data), limit)):
        # The document, then its question (read as one, as `h2o stream --prompt` asks); a prompt longer than the
        # window loses the document's first tokens.
        document = example.prompt[: len(example.prompt) - len(example.question)]
        question = tokenizer(example.question, add_special_tokens=False)["input_ids"]
        ids = tokenizer(document)["input_ids"][-(pool.window - MAX_NEW_TOKENS[task] - len(question)) :]
        cache = pool.cache_for(len(ids) + len(question), MAX_NEW_TOKENS[task])
        answer = greedy_answer(
            model, tokenizer, cache, ids, MAX_NEW_TOKENS[task], spec.chunk, ("\n\n",), question
        )
        cell = cells[example.cell]
        cell["hit"].append(contains_answer(answer, example.answers))
        cell["em"].append(exact_match(answer.strip().split("\n")[0], example.answers))
        cell["budget"].append(budget_used(cache, len(ids) + len(question)))
        if on_example is not None:
            on_example(number + 1)
    rows = []
    for name, cell in cells.items():
        n = len(cell["hit"])
        row = _row(task, spec, cell["budget"], n, acc=sum(cell["hit"]) / n, em=sum(cell["em"]) / n)
        row["correct"] = [int(hit) for hit in cell["hit"]]
        if name:
            length, depth = name.split("x")
            row.update(length=int(length), depth=depth)
        rows.append(row)
    return rows

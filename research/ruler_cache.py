"""What has a stopped `h2o lm-eval --use_cache DB` run of a RULER task answered, and how does it score?

lm-eval writes `--log_samples` only when a run ends, but `--use_cache` keeps each answer as it comes (keyed by
the request: the context and its generation arguments). This rebuilds the task's requests as lm-eval does
(the same documents: its generator, `--metadata`, the model's tokenizer), looks each up in the cache, and
scores the answered ones with the task's own `process_results`. One JSON line per answered document, then
the mean with its interval (as research/ruler_table.py computes them).

    python -m research.ruler_cache niah_single_1 /work/runs/r128/recall_128k/cache_rank0.db \\
        --metadata '{"max_seq_lengths":[131072]}' --limit 10
"""

from __future__ import annotations

import argparse
import json
import random


def built_task(task_name: str, metadata: dict, limit: int | None = None, samples: list[int] | None = None):
    """lm-eval's task `task_name` with its requests built (`task.instances`) as an `h2o lm-eval` run builds them:
    offline, and under the seeds lm-eval sets first, so RULER draws the same documents (its first `limit`, or
    the ids `samples`, which lm-eval numbers 0, 1, ... in its instances)."""
    import numpy
    import torch
    from lm_eval.evaluator import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.tasks import TaskManager

    from h2o_cli.eval.ruler import prepare_offline

    prepare_offline(say=lambda line: None)
    # lm-eval seeds python's, numpy's and torch's generators before it builds a task (`simple_evaluate`'s
    # defaults); RULER draws its documents' keys and values from them
    random.seed(DEFAULT_RANDOM_SEED)
    numpy.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)
    task = TaskManager(metadata=metadata).load([task_name])["tasks"][task_name]
    task.build_all_requests(limit=limit, samples=samples, rank=0, world_size=1)
    return task


def answered(task_name: str, db: str, metadata: dict, limit: int | None) -> list[dict]:
    """The cached answers of `task_name`'s first `limit` documents, each with the task's score."""
    from lm_eval.api.model import hash_args
    from sqlitedict import SqliteDict

    task = built_task(task_name, metadata, limit)
    rows = []
    with SqliteDict(db, autocommit=False) as cache:
        for instance in task.instances:
            key = hash_args("generate_until", instance.args)
            if key not in cache:
                continue
            answer = cache[key]
            scores = task.process_results(instance.doc, [answer])
            rows.append(
                {
                    "doc_id": instance.doc_id,
                    "target": instance.doc.get("outputs"),
                    "answer": answer[:80],
                    **scores,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", help="a RULER task, e.g. niah_single_1")
    parser.add_argument("db", help="the run's cache file (--use_cache PREFIX writes PREFIX_rank0.db)")
    parser.add_argument("--metadata", default="{}", help="the run's --metadata (JSON)")
    parser.add_argument("--limit", type=int, default=None, help="the run's --limit")
    parser.add_argument(
        "--model", default="smollm2-135m", help="the model whose tokenizer sized the documents"
    )
    args = parser.parse_args()
    from h2o_cli.models.sources import local_folder, resolve
    from research.ruler_table import interval

    metadata = {"tokenizer": str(local_folder(resolve(args.model))), **json.loads(args.metadata)}
    rows = answered(args.task, args.db, metadata, args.limit)
    for row in rows:
        print(json.dumps(row))
    # RULER scores a document under each of its default lengths, -1 at those it was not generated at
    scores = [max(v for k, v in row.items() if k not in ("doc_id", "target", "answer")) for row in rows]
    low, high = interval(scores)
    print(f"{args.task}: {sum(scores) / max(1, len(scores)):.2f} ({low:.2f}-{high:.2f}), n = {len(scores)}")


if __name__ == "__main__":
    main()

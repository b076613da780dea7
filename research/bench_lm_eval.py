"""Does evaluating through the cache cost more than lm-eval's own model? lm-eval's `hf` model and `--model h2o`
(one `CachePool` per policy) on the same weights and task, run interleaved in one process (hf, h2o full,
h2o 20 %, hf, ...) so that load from other processes falls on all of them alike; the median of each.
`--prefill-too` adds each policy scored the way it was before (every context prefilled in a call of its own).

Times `lm_eval.simple_evaluate` only (the weights are loaded once, before), with the accuracy of every run.

    python research/bench_lm_eval.py --model ~/.cache/h2o/models/<converted SmolLM2>/ --task h2o_copa \\
        --limit 100 --rounds 3

`--whole` times the whole commands instead, each in a fresh process as a user types them (start-up,
imports, loading, task building and scoring): `lm_eval --model hf --model_args pretrained=FOLDER` against
`h2o lm-eval --model h2o --model_args model=FOLDER,policy=P`, the commands alternating within each round.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import torch


def evaluate(lm, task: str, limit: int) -> tuple[float, float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from h2o_cli.eval.runner import TASKS_DIR

    start = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=[task],
        limit=limit,
        task_manager=TaskManager(include_path=[str(TASKS_DIR)]),
        verbosity="ERROR",
        bootstrap_iters=0,
    )
    return time.perf_counter() - start, out["results"][task]["acc,none"]


def task_requests(task: str, limit: int) -> list:
    """The task's loglikelihood requests (lm-eval `Instance`s), built once, for `--requests-only`."""
    from lm_eval.tasks import TaskManager, get_task_dict

    from h2o_cli.eval.runner import TASKS_DIR

    built = get_task_dict([task], TaskManager(include_path=[str(TASKS_DIR)]))[task]
    built.build_all_requests(limit=limit, rank=0, world_size=1)
    return built.instances


def score_requests(lm, requests: list) -> tuple[float, list[float]]:
    start = time.perf_counter()
    scores = [score for score, _ in lm.loglikelihood(requests, disable_tqdm=True)]
    return time.perf_counter() - start, scores


def whole_commands(args) -> dict[str, list[str]]:
    """The commands `--whole` alternates: lm-eval's own CLI with `hf`, and `h2o lm-eval` per policy."""
    from h2o_cli.eval.runner import TASKS_DIR

    common = ["--tasks", args.task, "--limit", str(args.limit), "--device", "cpu"]
    commands = {"hf": [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                       f"pretrained={args.model},dtype=float32", "--include_path", str(TASKS_DIR), *common]}  # fmt: skip
    for policy in args.policies.split(","):
        model_args = f"model={args.model},policy={policy},budget={args.budget}"
        commands[policy] = [sys.executable, "-m", "h2o_cli", "lm-eval", "--model", "h2o", "--model_args",
                            model_args, *common]  # fmt: skip
    return commands


def run_whole(command: list[str]) -> tuple[float, str]:
    """(seconds, accuracy as lm-eval's table prints it) of one command in a fresh process."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    found = re.search(r"\|acc\s*\|[^|]*\|\s*([0-9.]+)\|", done.stdout)
    return seconds, found.group(1) if found else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a safetensors folder (both models load it)")
    parser.add_argument("--task", default="h2o_copa")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--policies", default="full,h2o", help="h2o policies to time beside hf")
    parser.add_argument("--budget", default="0.2")
    parser.add_argument(
        "--requests-only",
        action="store_true",
        help="time only the models' loglikelihood calls on the task's requests (built once), not lm-eval's "
        "task building; prints each model's largest score difference from hf (a -prefill variant's: from its "
        "policy scored in one call) instead of the accuracy",
    )
    parser.add_argument(
        "--prefill-too", action="store_true", help="also time each policy with every context prefilled alone"
    )
    parser.add_argument(
        "--whole",
        action="store_true",
        help="time the whole commands, each in a fresh process (lm_eval --model hf; h2o lm-eval --model h2o)",
    )
    args = parser.parse_args()
    if args.whole:
        commands = whole_commands(args)
        times: dict[str, list[float]] = {name: [] for name in commands}
        print(
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}, load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        for number in range(args.rounds):
            for name, command in commands.items():
                seconds, acc = run_whole(command)
                times[name].append(seconds)
                print(f"round {number} {name:6} {seconds:6.1f} s  acc {acc}  load {os.getloadavg()[0]:.1f}",
                      flush=True)  # fmt: skip
        base = statistics.median(times["hf"])
        for name, values in times.items():
            print(
                f"{name:6} median {statistics.median(values):6.1f} s  {statistics.median(values) / base:.2f}x hf"
            )
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    from lm_eval.models.huggingface import HFLM

    from h2o_cli.eval.lm_eval_model import H2OLM
    from h2o_cli.models import load_model

    hf = HFLM(pretrained=args.model, dtype="float32", device="cpu", batch_size=1)
    lms = {"hf": hf}
    pair = load_model(args.model, device="cpu", dtype="float32")  # h2o attention: a model of its own
    for policy in args.policies.split(","):
        lms[policy] = H2OLM(model=pair, policy=policy, budget=args.budget)
        if args.prefill_too:  # the same policy, every context prefilled alone (the scoring before)
            lms[f"{policy}-prefill"] = H2OLM(model=pair, policy=policy, budget=args.budget)
            lms[f"{policy}-prefill"].pool.joint_tokens = -1
    times: dict[str, list[float]] = {name: [] for name in lms}
    print(f"threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    requests = task_requests(args.task, args.limit) if args.requests_only else None
    scored: dict[str, list[float]] = {}
    for number in range(args.rounds):
        for name, lm in lms.items():
            if requests is None:
                seconds, acc = evaluate(lm, args.task, args.limit)
                figure = f"acc {acc:.4f}"
            else:
                seconds, scored[name] = score_requests(lm, requests)
                other = name.removesuffix("-prefill") if name.endswith("-prefill") else "hf"
                gap = max(abs(a - b) for a, b in zip(scored[name], scored[other], strict=True))
                figure = f"{len(requests)} requests, max |score - {other}| {gap:.1e}"
            times[name].append(seconds)
            print(f"round {number} {name:12} {seconds:6.1f} s  {figure}  load {os.getloadavg()[0]:.1f}",
                  flush=True)  # fmt: skip
    base = statistics.median(times["hf"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:12} median {median:6.1f} s  {median / base:.2f}x hf")


if __name__ == "__main__":
    main()

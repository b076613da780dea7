"""The passkey grid: length x depth x seed x budget x policy, one JSON line per run, and its summary tables.

Budgets are fractions of the text's tokens; `full` runs once per haystack and only while the prompt fits the
model's window (past it, original positions would exceed it). Lines are appended: a grid run again skips the
runs its file already holds, so an interrupted grid resumes (a run that failed is run again).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from h2o_cli.config import CacheSettings, parse_run_spec
from h2o_cli.errors import UsageError
from h2o_cli.eval import passkey


@dataclass(frozen=True)
class Grid:
    """What a grid runs. `depths`: the needle's depths in % (`even_depths(n)` spreads n evenly); `policies`:
    run specs `POLICY[:FIELD=VALUE,...]`; `via`: ask as `h2o stream --prompt` does (in process) or through
    `h2o chat` (a subprocess); `fork`: read each haystack's text before its needles once and fork a process
    per depth (`passkey_fork`: same answers; one thread, one needle, via stream). `heads`: an object with
    `top` (int) and `attach(cache)` that lets only some KV heads recall (rows say `recall@headsK`; the torch
    step), as research/recall_heads.py builds. `wording`: how the needle is said and asked (`passkey.WORDINGS`);
    `haystack`: the name rows record for the text the haystacks are cut from (rows of another wording or
    haystack in the same file are other runs). `answer_tokens`: the most tokens an answer may take (None:
    `passkey.most_new`'s, 12 for one needle and 16 each for two; rows of another limit are other runs)."""

    lengths: tuple[int, ...] = (1536,)
    depths: tuple[int, ...] = (5, 15, 25, 35, 45, 55, 65, 75, 85, 95)
    seeds: int = 3
    seed_from: int = 0
    budgets: tuple[float, ...] = (0.05, 0.1, 0.2)
    policies: tuple[str, ...] = ("full", "h2o", "sink", "local", "recall")
    chunk: int = 256
    needles: int = 1
    via: str = "stream"
    fork: bool = False
    threads: int = 1
    heads: object | None = None
    wording: str = "passkey"
    haystack: str = "essays"
    answer_tokens: int | None = None

    def __post_init__(self) -> None:
        passkey.wording_of(self.wording)
        if any(not 0 < budget <= 1 for budget in self.budgets):
            raise UsageError(
                f"--budgets {','.join(map(str, self.budgets))}: give fractions of the text's tokens "
                "(0.025 keeps 819 of 32,768), not token counts"
            )
        if self.needles != 1 and self.wording != "passkey":
            raise UsageError("--needles 2 hides a pass key and a vault code; it has no --wording")
        if self.answer_tokens is not None and self.answer_tokens < 1:
            raise UsageError(f"--answer-tokens {self.answer_tokens}: give 1 or more")
        if self.needles not in (1, 2):
            raise UsageError(f"--needles {self.needles}: 1 or 2")
        if self.via not in ("stream", "chat"):
            raise UsageError(f"--via {self.via}: stream or chat")
        if self.via == "chat" and self.needles != 1:
            raise UsageError("--via chat asks one passkey; use --via stream with --needles 2")
        if self.fork and (
            self.via != "stream" or self.needles != 1 or self.heads is not None or self.threads != 1
        ):
            raise UsageError("--fork: one needle, --via stream, no recall heads, --threads 1")
        if self.heads is not None and self.via == "chat":
            raise UsageError("recall heads need --via stream (the choice is wrapped in this process)")
        for spec in self.policies:
            try:
                name, extra = parse_run_spec(spec)
            except ValueError as error:
                raise UsageError(f"--policies: {error}") from error
            self._check_fork_reach(name, extra)

    def _check_fork_reach(self, name: str, extra: dict[str, str]) -> None:
        """`--fork` keeps recall's archive in RAM (a fork copies it), whose default reach is `RAM_ARCHIVE_MAX`
        tokens: a longer prompt would lose its needle silently, so it is refused before any reading."""
        from h2o_cli.cache.recall.limits import RAM_ARCHIVE_MAX
        from h2o_cli.policies import policy_class

        longest = max(self.lengths, default=0)
        if (
            self.fork
            and policy_class(name).recalls
            and "archive_max" not in extra
            and longest > RAM_ARCHIVE_MAX
        ):
            raise UsageError(
                f"--fork keeps recall's archive in RAM, which reaches back {RAM_ARCHIVE_MAX:,} tokens: a "
                f"{longest:,}-token prompt needs the archive on disk; run it without --fork"
            )


def even_depths(count: int) -> tuple[int, ...]:
    """`count` depths (%) evenly spread: the middle of each of `count` equal parts (5 %..95 % for 10)."""
    return tuple(round(100 * (i + 0.5) / count) for i in range(count))


class Run(NamedTuple):
    """One cell of the grid: a haystack (length, seed, depth: its key and text) under a policy spec and budget."""

    length: int
    seed: int
    depth: int
    key: str
    text: str
    text_tokens: int
    given: str  # the policy spec as given
    spec: str  # as recorded (`@headsK` with recall heads)
    budget: float
    tokens: int  # the budget in tokens


def written(
    out: Path, wording: str = "passkey", haystack: str = "essays", answer_tokens: int | None = None
) -> set[tuple]:
    """(length, seed, depth, policy_spec, budget) of each run `out` already holds with this wording, haystack
    and answer limit (rows written before any was recorded are the `passkey` wording on the essays, with the
    default limit of their needles); a run that failed (`failed`) is not held: the grid runs it again."""
    if not out.exists():
        return set()
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {
        (row["length"], row["seed"], row["depth"], row["policy_spec"], row["budget"])
        for row in rows
        if (row.get("wording", "passkey"), row.get("haystack", "essays")) == (wording, haystack)
        and limit_of(row) == limit(row.get("needles", 1), answer_tokens)
        and not failed(row)
    }


def failed(row: dict) -> bool:
    """Whether a row records a run that could not run (its answer `ERROR: ...`), not an answer."""
    return str(row.get("answer", "")).startswith(passkey.FAILED)


def limit(needles: int, answer_tokens: int | None) -> int:
    """The most tokens an answer of a grid with `needles` needles may take (`passkey.most_new`)."""
    asked = (passkey.QUESTION,) if needles == 1 else passkey.TWO_QUESTIONS
    return passkey.most_new(asked, answer_tokens)


def limit_of(row: dict) -> int:
    """A row's answer limit (rows written before it was recorded had their needles' default)."""
    return row.get("answer_tokens", limit(row.get("needles", 1), None))


def plan(grid: Grid, tokenizer, essays: str, window: int, done: set[tuple] = frozenset()) -> list[Run]:
    """The runs not in `done`, in grid order (length, seed, depth, policy, budget)."""
    from h2o_cli.policies import policy_class

    asked = 1 if grid.needles == 1 else len(passkey.TWO_QUESTIONS)
    top = getattr(grid.heads, "top", None)
    # `full` is given the prompt, then per question an answer (at least two needles' limit) and a turn's frame
    answer_room = max(limit(grid.needles, grid.answer_tokens), passkey.TWO_MAX_NEW_TOKENS) + 64
    todo = []
    for length in grid.lengths:
        for seed in range(grid.seed_from, grid.seed_from + grid.seeds):
            for depth, key, text in passkey.haystacks(
                tokenizer, essays, length, grid.depths, seed, grid.needles, grid.wording
            ):
                text_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
                for given in grid.policies:
                    name, _ = parse_run_spec(given)
                    spec = (
                        f"{given}@heads{top}"
                        if grid.heads is not None and policy_class(name).recalls
                        else given
                    )
                    evicts = policy_class(name).evicts
                    if not evicts and length > window:
                        continue  # full attention past the window: positions the model never saw
                    for budget in grid.budgets if evicts else [1.0]:
                        if (length, seed, depth, spec, budget) in done:
                            continue
                        tokens = (
                            max(2, round(budget * text_tokens)) if evicts else length + asked * answer_room
                        )
                        todo.append(
                            Run(length, seed, depth, key, text, text_tokens, given, spec, budget, tokens)
                        )
    return todo


def row_of(grid: Grid, run: Run, said: str, read: int, seconds: float, device: str) -> dict:
    """The JSON line of one run."""
    return {
        "length": run.length, "seed": run.seed, "depth": run.depth, "policy_spec": run.spec,
        "policy": parse_run_spec(run.given)[0], "budget": run.budget, "budget_tokens": run.tokens,
        "text_tokens": run.text_tokens, "prompt_tokens": read, "key": run.key,
        "answer": said, "correct": passkey.correct(run.key, said),
        "needles": grid.needles, "seconds": round(seconds, 3),
        "device": device, "chunk": grid.chunk, "via": grid.via, "wording": grid.wording,
        "haystack": grid.haystack, "answer_tokens": limit(grid.needles, grid.answer_tokens),
    }  # fmt: skip


def run_grid(
    model, tokenizer, essays: str, grid: Grid, out: Path, progress: Callable[[dict], None] | None = None
):
    """Run `grid` over haystacks cut from `essays`, appending a JSON line per run to `out` (the runs it already
    holds are skipped). A run that fails is recorded with an `ERROR: ...` answer, not raised. `progress` is
    called with each row as it is written. Returns the rows written."""
    from h2o_cli.cache.families import context_window
    from h2o_cli.eval.passkey_fork import answers_forked

    question = passkey.wording_of(grid.wording).question
    asked = (question,) if grid.needles == 1 else passkey.TWO_QUESTIONS
    done = written(out, grid.wording, grid.haystack, grid.answer_tokens)
    todo = plan(grid, tokenizer, essays, context_window(model), done)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with out.open("a") as lines:

        def record(run: Run, said: str, read: int, seconds: float) -> None:
            row = row_of(grid, run, said, read, seconds, str(model.device))
            lines.write(json.dumps(row) + "\n")
            lines.flush()
            rows.append(row)
            if progress is not None:
                progress(row)

        if grid.fork:  # the runs of one haystack, policy and budget share one reading of the text
            groups = defaultdict(list)
            for run in todo:
                groups[(run.length, run.seed, run.spec, run.budget, run.tokens)].append(run)
            for group in groups.values():
                left = {run.depth: run for run in group}
                settings = CacheSettings.from_spec(group[0].given, budget=group[0].tokens, chunk=grid.chunk)
                try:
                    for depth, said, read, seconds in answers_forked(
                        model,
                        tokenizer,
                        settings,
                        [(run.depth, run.text) for run in group],
                        question,
                        grid.answer_tokens,
                    ):
                        record(left.pop(depth), said, read, seconds)
                except Exception as error:  # the shared reading failed: every run left is recorded so
                    for run in left.values():
                        record(run, f"{passkey.FAILED}{error}", 0, 0.0)
            return rows
        for run in todo:
            settings = CacheSettings.from_spec(run.given, budget=run.tokens, chunk=grid.chunk)
            if run.spec != run.given:  # only some heads recall: the torch step (the C step chooses in C)
                settings = replace(settings, kernels="torch")
            try:
                if grid.via == "chat":
                    said, read, seconds = passkey.answer_in_chat(
                        run.spec,
                        run.tokens,
                        grid.chunk,
                        run.text,
                        grid.threads,
                        question,
                        limit(1, grid.answer_tokens),
                    )
                else:
                    chosen = grid.heads if run.spec != run.given else None
                    said, read, seconds = passkey.answer(
                        model, tokenizer, settings, run.text, asked, chosen, grid.answer_tokens
                    )
            except Exception as error:  # a cell that cannot run is recorded, not fatal
                said, read, seconds = f"{passkey.FAILED}{error}", 0, 0.0
            record(run, said, read, seconds)
    return rows


def share(hits: list[bool] | None) -> str:
    return f"{sum(hits)}/{len(hits)}" if hits else "–"


def labelled(row: dict) -> str:
    """A row's policy spec, with its wording, haystack and answer limit when they are not the grid's own
    (`passkey`, essays, its needles' default)."""
    wording, haystack = row.get("wording", "passkey"), row.get("haystack", "essays")
    extra = [part for part, own in ((wording, "passkey"), (haystack, "essays")) if part != own]
    if limit_of(row) != limit(row.get("needles", 1), None):
        extra.append(f"answers of {limit_of(row)} tokens")
    return f"{row['policy_spec']} [{', '.join(extra)}]" if extra else row["policy_spec"]


def summary(paths: list[Path]) -> str:
    """Markdown tables: per length, the share correct per (policy, budget), with the number of runs. A run
    that failed is not counted (a line says how many; running the grid again runs them)."""
    rows = [
        json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line.strip()
    ]
    for row in rows:
        row["policy_spec"] = labelled(row)

    def run_of(row: dict) -> tuple:
        return row["length"], row.get("seed"), row.get("depth"), row["policy_spec"], row["budget"]

    answered = {run_of(row) for row in rows if not failed(row)}
    errors = sum(failed(row) and run_of(row) not in answered for row in rows)  # not run again since
    rows = [row for row in rows if not failed(row)]
    cells: dict = defaultdict(list)
    for row in rows:
        cells[(row["length"], row["policy_spec"], row["budget"])].append(row["correct"])
    lines = []
    for length in sorted({row["length"] for row in rows}):
        specs = list(dict.fromkeys(row["policy_spec"] for row in rows if row["length"] == length))
        budgets = sorted({row["budget"] for row in rows if row["length"] == length and row["budget"] < 1})
        runs = {len(v) for (n, _, _), v in cells.items() if n == length}
        head = ["policy", *(f"{b:.0%} of text" for b in budgets), "full cache"]
        lines += [f"\n**{length:,}-token prompts** (runs per cell: {', '.join(map(str, sorted(runs)))})\n",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
        for spec in specs:
            shares = {b: share(cells.get((length, spec, b))) for b in [*budgets, 1.0]}
            if (length, spec, 1.0) in cells:
                row = [spec, *("–" for _ in budgets), shares[1.0]]
            else:
                row = [spec, *(shares[b] for b in budgets), "–"]
            lines.append("| " + " | ".join(row) + " |")
    if errors:
        lines.append(
            f"\n{errors} run(s) failed (an `ERROR:` answer) and are not counted; the grid runs them again."
        )
    return "\n".join(lines)

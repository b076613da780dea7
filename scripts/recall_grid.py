"""Passkey retrieval after a long text: length x depth x seed x budget x policy, one JSON line per run.

Each haystack is Paul Graham essays (the needle task's haystack) read from an offset chosen by the seed, cut so
the whole prompt is `--lengths` tokens, with the passkey sentence inserted at `depth` % (at a sentence end).
The question is asked **after** the text, exactly as `h2o stream FILE --prompt Q` asks it
(`prompting.read_then_answer` -> `streaming.prefill` -> greedy `generation.generate_ids`). A run is correct
when the answer contains the passkey's digits. Budgets are fractions of the text's tokens; `full` runs once per
haystack and only while the prompt fits the model's window (past it, original positions would exceed it).

    python scripts/recall_grid.py --lengths 1536,4096 --depths 10 --seeds 3 --budgets 0.05,0.1,0.2 \
        --policies full,h2o,sink,local,recall --out docs/results/recall_grid.jsonl
    python scripts/recall_grid.py --summary docs/results/recall_grid.jsonl     # the tables, from the lines

`--needles 2` hides a pass key at the depth and a vault code half the text further on (wrapping) and asks
for each in turn, the second as `h2o chat` asks a new turn on the same cache; a run counts when each answer
holds its key. `--recall-heads RANKING:K` lets only the K best KV heads of a `retrieval_heads.py` ranking
recall (rows labelled `recall@headsK`).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

from h2o_cli.config import parse_run_spec

NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? Answer with the number only."
MAX_NEW_TOKENS = 12
# `--needles 2`: a pass key and a vault code, at `depth` and half the text further on (wrapping), asked
# one after the other as two chat turns on the same cache; a run is correct when each answer holds its key.
TWO_NEEDLES = (
    "\nThe pass key is {key}. Remember it. {key} is the pass key.\n",
    "\nThe vault code is {key}. Remember it. {key} is the vault code.\n",
)
TWO_QUESTIONS = (
    "What is the pass key? Answer with the number only.",
    "What is the vault code? Answer with the number only.",
)
TWO_MAX_NEW_TOKENS = 16  # per answer: "The vault code is 12345." and a little more


class Run(NamedTuple):
    """One cell of the grid: a haystack (length, seed, depth: its key and text) under a policy spec and budget."""

    length: int
    seed: int
    depth: int
    key: str
    text: str
    text_tokens: int
    given: str  # the policy spec as given
    spec: str  # as recorded (`@headsK` with --recall-heads)
    budget: float
    tokens: int  # the budget in tokens


def settings_of(spec: str, budget: int, chunk: int):
    """`CacheSettings` of a run spec (`parse_run_spec`) at `budget` tokens and `chunk`."""
    from h2o_cli.config import CacheSettings

    return CacheSettings.from_spec(spec, budget=budget, chunk=chunk)


def haystacks(tokenizer, essays: str, length: int, depths: list[int], seed: int, needles: int = 1):
    """(depth, passkey, text) for one seed: `length` prompt tokens in all, the passkey at each depth. With
    `needles=2` the passkey is the two keys joined by a space, the pass key at `depth`, the vault code at
    `depth + 50` % (wrapping), each at a sentence end."""
    from h2o_cli.prompting import document_frame

    rng = random.Random(seed)
    keys = [str(rng.randint(10000, 99999)) for _ in range(needles)]
    texts = (NEEDLE,) if needles == 1 else TWO_NEEDLES
    inserted = [text.format(key=key) for text, key in zip(texts, keys, strict=True)]
    before, after = document_frame(tokenizer, QUESTION if needles == 1 else TWO_QUESTIONS[0])
    overhead = len(tokenizer(before + "".join(inserted) + after)["input_ids"])
    ids = tokenizer(essays, add_special_tokens=False)["input_ids"]
    room = length - overhead
    start = rng.randrange(0, max(1, len(ids) - room))
    context = tokenizer.decode(ids[start : start + room])

    def cut_at(depth: int) -> int:  # the sentence end before `depth` % of the context
        cut = int(len(context) * depth / 100)
        period = context.rfind(".", 0, cut)
        return period + 1 if period >= 0 else cut

    for depth in depths:
        cuts = [cut_at(depth), cut_at((depth + 50) % 100)][: len(inserted)]
        places = sorted(zip(cuts, inserted, strict=True))
        text, last = "", 0
        for cut, needle in places:
            text, last = text + context[last:cut] + needle, cut
        yield depth, " ".join(keys), text + context[last:]


def answer(
    model, tokenizer, settings, text: str, questions: tuple[str, ...] = (QUESTION,), heads=None
) -> tuple[str, int, float]:
    """What `h2o stream --prompt QUESTION` answers after `text`: (answer, prompt tokens, seconds). With more
    than one question, each next one is asked as `h2o chat` asks a new turn, on the same cache (the answers
    joined by " | "). `heads`: a `retrieval_heads.RecallHeads`, attached to the cache."""
    from h2o_cli.cache import H2OCache
    from h2o_cli.streaming import prefill

    started = time.perf_counter()
    pieces = prompt_pieces(tokenizer, text, questions[0])
    cache = H2OCache(model, settings, span=cache_span(sum(map(len, pieces)), questions))
    if heads is not None:
        heads.attach(cache)
    logits, stats = prefill(model, cache, pieces, settings.chunk)
    stats.reraise()
    said, tokens = ask(model, tokenizer, cache, logits, text, questions, settings.chunk)
    return said, stats.tokens + tokens, time.perf_counter() - started


def prompt_pieces(tokenizer, text: str, question: str) -> list[list[int]]:
    """The ids `h2o stream --prompt QUESTION` reads for `text`: `read_then_answer`'s pieces (the frame's head,
    the text, and the question as a `NewChunk`)."""
    from h2o_cli.prompting import read_then_answer

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(read_then_answer(tokenizer, [ids], question))


def cache_span(prompt_tokens: int, questions: tuple[str, ...]) -> int:
    """The most tokens a run's cache is given: its prompt, then per question an answer and a turn's frame."""
    return prompt_tokens + len(questions) * (most_new(questions) + 64)


def most_new(questions: tuple[str, ...]) -> int:
    """The most tokens an answer may take: `MAX_NEW_TOKENS` for one question, `TWO_MAX_NEW_TOKENS` each for two."""
    return MAX_NEW_TOKENS if len(questions) == 1 else TWO_MAX_NEW_TOKENS


def ask(model, tokenizer, cache, logits, text: str, questions: tuple[str, ...], chunk: int):
    """Answer `questions[0]` from `logits` (the cache has read `text` and it), then each next question as a new
    chat turn. Returns (the answers joined by " | ", the tokens of the later turns read)."""
    from h2o_cli.chat.framing import answer_suffix, turn_text
    from h2o_cli.generation import Sampling, TextStreamer, generate_ids
    from h2o_cli.prompting import NewChunk
    from h2o_cli.streaming import prefill

    most = most_new(questions)
    stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    history, answers, tokens = [{"role": "user", "content": text + "\n\n" + questions[0]}], [], 0
    for number, question in enumerate(questions):
        if number:  # the next question, as chat frames a new turn after the answer
            history.append({"role": "assistant", "content": answers[-1]})
            turn = answer_suffix(tokenizer, None) + turn_text(tokenizer, None, history, question)
            history.append({"role": "user", "content": question})
            ids = NewChunk(tokenizer(turn, add_special_tokens=False)["input_ids"])
            logits, stats = prefill(model, cache, [ids], chunk)
            stats.reraise()
            tokens += stats.tokens
        streamer = TextStreamer(tokenizer)
        for token in generate_ids(model, cache, logits, Sampling(max_new_tokens=most), stop):
            streamer.push(token)
        answers.append(streamer.printed.strip() if len(questions) > 1 else streamer.printed)
    return " | ".join(answers), tokens


def answers_forked(model, tokenizer, settings, texts: list[tuple[int, str]]):
    """For each (depth, text) of one haystack (the same essays, the needle at each depth), in depth order:
    (depth, answer, prompt tokens, seconds) as `answer` gives them, but the text before the needles is read once.

    One cache reads the deepest depth's prompt. At the last chunk boundary that a shallower prompt shares with
    it, the process forks (`os.fork`: the child holds an exact copy of the cache, model and all); the child reads
    that prompt's own rest and answers while the parent waits, then the parent reads on. The archive is kept in
    RAM, which a fork copies (a file archive would be one file for both; it recalls bit for bit what a RAM
    archive does). `seconds` is a run's own: the reading up to its fork plus its rest, not the other runs'.
    The cache's `span` is the longest prompt's (`answer` sizes it by its own prompt: this bounds the archive's
    capacity, alike for every depth once the prompts pass `archive_max`). Needs one thread: a forked child
    has no OpenMP pool."""
    from h2o_cli.cache import H2OCache
    from h2o_cli.streaming import prefill

    def prompt(text: str) -> tuple[list[int], list[int]]:  # (frame head + text, the question's NewChunk)
        *read, question = prompt_pieces(tokenizer, text, QUESTION)
        return [token for piece in read for token in piece], question

    def rest(read: list[int], question: list[int], text: str) -> str:
        """A run's own reading (the rest of its text, then the question) and its answer."""
        logits, stats = prefill(model, cache, [read, question], settings.chunk)
        stats.reraise()
        return ask(model, tokenizer, cache, logits, text, (QUESTION,), settings.chunk)[0]

    threads = torch.get_num_threads()
    if threads != 1:  # a forked child's first parallel region would wait forever on the parent's thread pool
        raise ValueError(f"forked runs need one thread (torch.set_num_threads(1)), not {threads}")
    prompts = {depth: prompt(text) for depth, text in texts}
    trunk = prompts[max(prompts)][0]
    span = cache_span(max(len(read) + len(question) for read, question in prompts.values()), (QUESTION,))
    started = time.perf_counter()
    cache = H2OCache(model, replace(settings, archive="ram"), span=span)
    done, reading = 0, time.perf_counter() - started  # trunk tokens read, and the seconds that took
    for depth, text in sorted(texts):
        read, question = prompts[depth]
        same = next((i for i, (a, b) in enumerate(zip(read, trunk, strict=False)) if a != b), len(read))
        shared = same // settings.chunk * settings.chunk  # whole chunks that both read alike
        if shared < done:  # (the same depth twice) nothing shared left: read it alone
            yield depth, *answer(model, tokenizer, settings, text)
            continue
        if shared > done:
            began = time.perf_counter()
            _, stats = prefill(model, cache, [trunk[done:shared]], settings.chunk)
            stats.reraise()
            done, reading = shared, reading + time.perf_counter() - began
        began = time.perf_counter()
        if read is trunk:  # the deepest: the parent reads its rest itself, last
            said = rest(read[shared:], question, text)
        else:
            try:
                said = in_fork(functools.partial(rest, read[shared:], question, text))
            except RuntimeError as error:  # the child failed; the parent's cache is as it was
                said = f"ERROR: {error}"
        yield depth, said, len(read) + len(question), reading + time.perf_counter() - began


def in_fork(work):
    """`work()` run in a forked child process; its (JSON) result comes back through a pipe. A child that fails
    raises here with its error; the parent's state is never touched by it."""
    import os

    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, send, and leave without the parent's exit handlers (archive files, atexit)
        os.close(reader)
        try:
            result = {"value": work()}
        except BaseException as error:
            result = {"error": f"{type(error).__name__}: {error}"}
        with os.fdopen(writer, "w") as out:
            json.dump(result, out)
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as source:
        sent = source.read()
    _, status = os.waitpid(pid, 0)
    if not sent:
        raise RuntimeError(f"the forked run ended without an answer (wait status {status})")
    result = json.loads(sent)
    if "error" in result:
        raise RuntimeError(result["error"])
    return result["value"]


def correct(key: str, said: str) -> bool:
    """Each key (space-separated) in its answer (answers joined by " | ", in the keys' order)."""
    keys, answers = key.split(), said.split(" | ")
    return len(answers) == len(keys) and all(k in part for k, part in zip(keys, answers, strict=True))


def answer_in_chat(
    spec: str, budget_tokens: int, chunk: int, text: str, threads: int
) -> tuple[str, int, float]:
    """The same question through `h2o chat` (one-shot: the text and the question as one piped message)."""
    import subprocess

    name, extra = parse_run_spec(spec)
    flags = [f"--{field.replace('_', '-')}={value}" for field, value in extra.items()]
    command = [sys.executable, "-c", "from h2o_cli.cli.app import main; main()", "chat", "--no-panel", "--json",
               "--policy", name, "--budget", str(budget_tokens), "--chunk", str(chunk), "--threads", str(threads),
               "--max-new-tokens", str(MAX_NEW_TOKENS), *flags]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, input=text + "\n\n" + QUESTION, capture_output=True, text=True)
    if done.returncode != 0:
        return f"ERROR: {done.stderr.strip()[-200:]}", 0, 0.0
    report = json.loads(done.stdout)
    return report["answer"], report.get("last_prompt_tokens", 0), time.perf_counter() - started


def run(args) -> None:
    from h2o_cli.cache.families import context_window
    from h2o_cli.eval.data import load_essays
    from h2o_cli.models import load_model
    from h2o_cli.policies import policy_class

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    window = context_window(model)
    essays = load_essays(args.essays)
    asked = (QUESTION,) if args.needles == 1 else TWO_QUESTIONS
    if args.via == "chat" and args.needles != 1:
        raise SystemExit("--via chat asks one passkey; use --via stream with --needles 2")
    if args.fork and (args.via != "stream" or args.needles != 1 or args.recall_heads or args.threads != 1):
        raise SystemExit("--fork: one needle, --via stream, no --recall-heads, --threads 1")
    heads, top = None, None
    if args.recall_heads:
        if args.via == "chat":
            raise SystemExit("--recall-heads needs --via stream (the choice is wrapped in this process)")
        from retrieval_heads import RecallHeads

        ranking, _, top = args.recall_heads.rpartition(":")
        heads = RecallHeads(Path(ranking), int(top))
    depths = args.depth_list or [round(100 * (i + 0.5) / args.depths) for i in range(args.depths)]
    done = set()
    if args.out.exists():  # resume: skip the runs already written
        for line in args.out.read_text().splitlines():
            row = json.loads(line)
            done.add((row["length"], row["seed"], row["depth"], row["policy_spec"], row["budget"]))
    todo = []  # the runs not yet written, in grid order
    for length in args.lengths:
        for seed in range(args.seed_from, args.seed_from + args.seeds):
            for depth, key, text in haystacks(tokenizer, essays, length, depths, seed, args.needles):
                text_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
                for given in args.policies:
                    name, _ = parse_run_spec(given)
                    spec = f"{given}@heads{top}" if heads is not None and name == "recall" else given
                    evicts = policy_class(name).evicts
                    if not evicts and length > window:
                        continue  # full attention past the window: positions the model never saw
                    for budget in args.budgets if evicts else [1.0]:
                        if (length, seed, depth, spec, budget) in done:
                            continue
                        tokens = (
                            max(2, round(budget * text_tokens))
                            if evicts
                            else length + len(asked) * (TWO_MAX_NEW_TOKENS + 64)
                        )
                        cell = (length, seed, depth, key, text, text_tokens, given, spec, budget, tokens)
                        todo.append(Run(*cell))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:

        def record(run: Run, said: str, read: int, seconds: float) -> None:
            row = {
                "length": run.length, "seed": run.seed, "depth": run.depth, "policy_spec": run.spec,
                "policy": parse_run_spec(run.given)[0], "budget": run.budget, "budget_tokens": run.tokens,
                "text_tokens": run.text_tokens, "prompt_tokens": read, "key": run.key,
                "answer": said, "correct": correct(run.key, said),
                "needles": args.needles, "seconds": round(seconds, 3),
                "device": str(model.device), "chunk": args.chunk, "via": args.via,
            }  # fmt: skip
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"{run.length} s{run.seed} d{run.depth:>2} {run.spec:<10} {run.budget:<5} {row['correct']!s:<5} "
                  f"{seconds:6.2f}s {said!r}", file=sys.stderr, flush=True)  # fmt: skip

        if args.fork:  # the runs of one haystack, policy and budget share one reading of the text
            groups = defaultdict(list)
            for run in todo:
                groups[(run.length, run.seed, run.spec, run.budget, run.tokens)].append(run)
            for group in groups.values():
                left = {run.depth: run for run in group}
                settings = settings_of(group[0].given, group[0].tokens, args.chunk)
                try:
                    for depth, said, read, seconds in answers_forked(
                        model, tokenizer, settings, [(run.depth, run.text) for run in group]
                    ):
                        record(left.pop(depth), said, read, seconds)
                except Exception as error:  # the shared reading failed: every run left is recorded so
                    for run in left.values():
                        record(run, f"ERROR: {error}", 0, 0.0)
            return
        for run in todo:
            settings = settings_of(run.given, run.tokens, args.chunk)
            if run.spec != run.given:  # only some heads recall: the torch step (the C step chooses in C)
                settings = replace(settings, kernels="torch")
            try:
                if args.via == "chat":
                    asking = (run.spec, run.tokens, args.chunk, run.text, args.threads)
                    said, read, seconds = answer_in_chat(*asking)
                else:
                    chosen = heads if run.spec != run.given else None
                    said, read, seconds = answer(model, tokenizer, settings, run.text, asked, chosen)
            except Exception as error:  # a cell that cannot run is recorded, not fatal
                said, read, seconds = f"ERROR: {error}", 0, 0.0
            record(run, said, read, seconds)


def share(hits: list[bool] | None) -> str:
    return f"{sum(hits)}/{len(hits)}" if hits else "–"


def summary(paths: list[Path]) -> str:
    """Markdown tables: per length, the share correct per (policy, budget), with the number of runs."""
    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    cells: dict = defaultdict(list)
    for row in rows:
        cells[(row["length"], row["policy_spec"], row["budget"])].append(row["correct"])
    lines = []
    for length in sorted({row["length"] for row in rows}):
        specs = list(dict.fromkeys(row["policy_spec"] for row in rows if row["length"] == length))
        budgets = sorted({row["budget"] for row in rows if row["length"] == length and row["budget"] < 1})
        runs = {len(v) for (n, _, _), v in cells.items() if n == length}
        lines += [f"\n**{length:,}-token prompts** (runs per cell: {', '.join(map(str, sorted(runs)))})\n",
                  "| policy | " + " | ".join(f"{b:.0%} of text" for b in budgets) + " | full cache |",
                  "|---|" + "---|" * (len(budgets) + 1)]  # fmt: skip
        for spec in specs:
            shares = {b: share(cells.get((length, spec, b))) for b in [*budgets, 1.0]}
            if (length, spec, 1.0) in cells:
                lines.append(f"| {spec} | " + " | ".join("–" for _ in budgets) + f" | {shares[1.0]} |")
            else:
                lines.append(f"| {spec} | " + " | ".join(shares[b] for b in budgets) + " | – |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1536])
    parser.add_argument("--depths", type=int, default=10, help="depths (evenly spread, 5%%..95%% for 10)")
    parser.add_argument("--seeds", type=int, default=3, help="haystacks (offset and passkey) per depth")
    parser.add_argument(
        "--seed-from", type=int, default=0, help="first seed (to split a grid over processes)"
    )
    parser.add_argument(
        "--budgets", type=lambda s: [float(x) for x in s.split(",")], default=[0.05, 0.1, 0.2]
    )
    parser.add_argument("--policies", type=lambda s: [spec for spec in s.split(";" if ";" in s else ",") if spec],
                        default=["full", "h2o", "sink", "local", "recall"],
                        help="policy[:field=value,...], comma-separated (';' if a spec has commas)")  # fmt: skip
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--essays", default=None, help="PaulGrahamEssays folder (default: under $H2O_DATA)")
    parser.add_argument(
        "--via",
        choices=("stream", "chat"),
        default="stream",
        help="ask as `h2o stream --prompt` does (in process), or through `h2o chat` (a subprocess)",
    )
    parser.add_argument(
        "--depth-list",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="these depths (%%) instead of --depths evenly spread",
    )
    parser.add_argument("--needles", type=int, choices=(1, 2), default=1,
                        help="passkeys per text: 2 hides a second at depth + 50 %% and asks for both")  # fmt: skip
    parser.add_argument("--recall-heads", metavar="RANKING:K", default=None,
                        help="recall only in the K best KV heads of a retrieval_heads.py ranking (the others'"
                             " recall slots stay empty; rows say recall@headsK)")  # fmt: skip
    parser.add_argument("--fork", action="store_true",
                        help="read each haystack's text before its needles once and fork a process per depth "
                             "(same answers, ~40 %% less reading over 10 depths; one thread, one needle)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="JSON lines, appended (an interrupted grid resumes)")
    parser.add_argument("--summary", type=Path, nargs="+", help="print the tables of these JSON-lines files")
    args = parser.parse_args(argv)
    if args.summary:
        print(summary(args.summary))
    else:
        run(args)


if __name__ == "__main__":
    main()

"""Passkey retrieval after a long text: the haystacks, the needles, and asking after the text.

A haystack is Paul Graham essays (the needle task's haystack) read from an offset chosen by the seed, cut so
the whole prompt is `length` tokens, with the passkey sentence inserted at `depth` % (at a sentence end).
The question is asked **after** the text, exactly as `h2o stream FILE --prompt Q` asks it
(`prompting.read_then_answer` -> `streaming.prefill` -> greedy `generation.generate_ids`). A run is correct
when the answer contains the passkey's digits. `h2o passkey` runs the grid of them (`eval/passkey_grid.py`).

With two needles a pass key sits at the depth and a vault code half the text further on (wrapping); each is
asked in turn, the second as `h2o chat` asks a new turn on the same cache, and a run counts when each answer
holds its key.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from h2o_cli.config import parse_run_spec
from h2o_cli.errors import InputError

NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? Answer with the number only."
MAX_NEW_TOKENS = 12
FAILED = "ERROR: "  # how a run that could not run is recorded, in place of an answer
TWO_NEEDLES = (
    "\nThe pass key is {key}. Remember it. {key} is the pass key.\n",
    "\nThe vault code is {key}. Remember it. {key} is the vault code.\n",
)
TWO_QUESTIONS = (
    "What is the pass key? Answer with the number only.",
    "What is the vault code? Answer with the number only.",
)
TWO_MAX_NEW_TOKENS = 16  # per answer: "The vault code is 12345." and a little more


class Wording(NamedTuple):
    """How one needle is said (`needle`, with `{key}`) and asked for (`question`)."""

    needle: str
    question: str


# `passkey` is the wording every recall default was chosen on; the others were never used to choose anything,
# so a grid run with them reports on text the defaults did not see (docs/results.md names both sets).
WORDINGS = {
    "passkey": Wording(NEEDLE, QUESTION),
    "page": Wording(
        "\nAt the bottom of the page someone had written the number {key}.\n",
        "Which number was written at the bottom of the page? Answer with the number only.",
    ),
    "door": Wording(
        "\nThe door of the old archive opens with the code {key}.\n",
        "Which code opens the door of the old archive? Answer with the number only.",
    ),
    "phone": Wording(
        "\nHer telephone number, she told me, was {key}.\n",
        "What was her telephone number? Answer with the number only.",
    ),
    "locker": Wording(
        "\nThe key to the station locker was marked with the number {key}.\n",
        "Which number was marked on the key to the station locker? Answer with the number only.",
    ),
    "secret": Wording(
        "\nImportant: the secret number is {key}. Write down {key}.\n",
        "What is the secret number? Answer with the number only.",
    ),
    "ticket": Wording(
        "\nThe winning lottery ticket number is {key}.\n",
        "What is the winning lottery ticket number? Answer with the number only.",
    ),
}


def wording_of(name: str) -> Wording:
    """The wording called `name`; a usage error naming the choices otherwise."""
    from h2o_cli.errors import UsageError

    if name not in WORDINGS:
        raise UsageError(f"--wording {name!r} is unknown; choose {', '.join(WORDINGS)}")
    return WORDINGS[name]


def haystack_text(path: str | Path | None = None) -> str:
    """The text haystacks are cut from: `path` if a file, the essays of `path` if a folder of *.txt, else the
    Paul Graham essays of the data folder (`--data-dir` / $H2O_DATA)."""
    from h2o_cli.eval.data import load_essays

    if path is not None and Path(path).is_file():
        try:
            return Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise InputError(f"{path} is not UTF-8 text: {error}") from error
    if path is not None and not Path(path).is_dir():
        raise InputError(f"haystack {path} not found (a text file, or a folder of *.txt)")
    return load_essays(path)


def haystacks(
    tokenizer,
    essays: str,
    length: int,
    depths: list[int],
    seed: int,
    needles: int = 1,
    wording: str = "passkey",
):
    """(depth, passkey, text) for one seed: `length` prompt tokens in all, the passkey at each depth, said and
    asked as `WORDINGS[wording]` says. With `needles=2` (the `passkey` wording only) the passkey is the two keys
    joined by a space, the pass key at `depth`, the vault code at `depth + 50` % (wrapping), each at a sentence
    end."""
    from h2o_cli.prompting import document_frame

    rng = random.Random(seed)
    keys = [str(rng.randint(10000, 99999)) for _ in range(needles)]
    said = wording_of(wording)
    texts = (said.needle,) if needles == 1 else TWO_NEEDLES
    inserted = [text.format(key=key) for text, key in zip(texts, keys, strict=True)]
    before, after = document_frame(tokenizer, said.question if needles == 1 else TWO_QUESTIONS[0])
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


def needle_tokens(
    tokenizer, text: str, key: str, head: int, wording: str = "passkey"
) -> tuple[list[int], list[int]]:
    """Stream indices of the (one) needle sentence's tokens in `text`, and of the passkey's first mention in
    it (`head`: tokens read before the text)."""
    needle = wording_of(wording).needle.format(key=key)
    start = text.index(needle)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]

    def inside(begin: int, end: int) -> list[int]:
        return [head + i for i, (a, b) in enumerate(offsets) if a < end and b > begin and text[a:b].strip()]

    digits = start + needle.index(key)
    return inside(start, start + len(needle)), inside(digits, digits + len(key))


def answer(
    model,
    tokenizer,
    settings,
    text: str,
    questions: tuple[str, ...] = (QUESTION,),
    heads=None,
    most: int | None = None,
) -> tuple[str, int, float]:
    """What `h2o stream --prompt QUESTION` answers after `text`: (answer, prompt tokens, seconds). With more
    than one question, each next one is asked as `h2o chat` asks a new turn, on the same cache (the answers
    joined by " | "). `heads`: an object whose `attach(cache)` is called on the fresh cache before it reads
    (research/recall_heads.py limits recall to some KV heads so)."""
    from h2o_cli.cache import H2OCache
    from h2o_cli.streaming import prefill

    started = time.perf_counter()
    pieces = prompt_pieces(tokenizer, text, questions[0])
    cache = H2OCache(model, settings, span=cache_span(sum(map(len, pieces)), questions, most))
    if heads is not None:
        heads.attach(cache)
    logits, stats = prefill(model, cache, pieces, settings.chunk)
    stats.reraise()
    said, tokens = ask(model, tokenizer, cache, logits, text, questions, settings.chunk, most)
    return said, stats.tokens + tokens, time.perf_counter() - started


def prompt_pieces(tokenizer, text: str, question: str) -> list[list[int]]:
    """The ids `h2o stream --prompt QUESTION` reads for `text`: `read_then_answer`'s pieces (the frame's head,
    the text with the special tokens the tokenizer adds around a text, e.g. a base Gemma's BOS, as `token_stream`
    gives a file's, and the question as a `NewChunk`)."""
    from h2o_cli.prompting import read_then_answer
    from h2o_cli.textio import token_stream

    return list(read_then_answer(tokenizer, token_stream(tokenizer, iter([text])), question))


def cache_span(prompt_tokens: int, questions: tuple[str, ...], most: int | None = None) -> int:
    """The most tokens a run's cache is given: its prompt, then per question an answer (`most_new`) and a
    turn's frame."""
    return prompt_tokens + len(questions) * (most_new(questions, most) + 64)


def most_new(questions: tuple[str, ...], most: int | None = None) -> int:
    """The most tokens an answer may take: `most` if given, else `MAX_NEW_TOKENS` for one question and
    `TWO_MAX_NEW_TOKENS` each for two."""
    if most is not None:
        return most
    return MAX_NEW_TOKENS if len(questions) == 1 else TWO_MAX_NEW_TOKENS


def ask(
    model,
    tokenizer,
    cache,
    logits,
    text: str,
    questions: tuple[str, ...],
    chunk: int,
    most: int | None = None,
):
    """Answer `questions[0]` from `logits` (the cache has read `text` and it), then each next question as a new
    chat turn, each answer at most `most_new(questions, most)` tokens. Returns (the answers joined by " | ",
    the tokens of the later turns read)."""
    from h2o_cli.chat.framing import answer_suffix, turn_text
    from h2o_cli.generation import Sampling, TextStreamer, generate_ids
    from h2o_cli.prompting import NewChunk
    from h2o_cli.streaming import prefill

    most = most_new(questions, most)
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


def correct(key: str, said: str) -> bool:
    """Each key (space-separated) in its answer (answers joined by " | ", in the keys' order)."""
    keys, answers = key.split(), said.split(" | ")
    return len(answers) == len(keys) and all(k in part for k, part in zip(keys, answers, strict=True))


def answer_in_chat(
    spec: str,
    budget_tokens: int,
    chunk: int,
    text: str,
    threads: int,
    question: str = QUESTION,
    most: int = MAX_NEW_TOKENS,
) -> tuple[str, int, float]:
    """The same question through `h2o chat` (one-shot: the text and the question as one piped message)."""
    name, extra = parse_run_spec(spec)
    flags = [f"--{field.replace('_', '-')}={value}" for field, value in extra.items()]
    command = [sys.executable, "-c", "from h2o_cli.cli.app import main; main()", "chat", "--no-panel", "--json",
               "--policy", name, "--budget", str(budget_tokens), "--chunk", str(chunk), "--threads", str(threads),
               "--max-new-tokens", str(most), *flags]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, input=text + "\n\n" + question, capture_output=True, text=True)
    if done.returncode != 0:
        return f"{FAILED}{done.stderr.strip()[-200:]}", 0, 0.0
    report = json.loads(done.stdout)
    return report["answer"], report.get("last_prompt_tokens", 0), time.perf_counter() - started

"""Does `h2o chat` answer a fact from its first turn after tens of thousands of tokens of later conversation?

A conversation on the embedded model: the first turn gives a fact ("the code of my locker is NNNNN"), then
turns of a book's text (each about `--turn-tokens` tokens, "Reply with OK.", a short answer) until
`--tokens` tokens have been read, then the question. One JSON line per policy: the answer, whether it holds
the code, the tokens read, seconds. `recall` is what should remember; `h2o` and `sink` show what a cache
without an archive answers.

    python scripts/chat_remembers.py --tokens 20000 --budget 819 --policies recall,h2o
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

FACT = "Remember this for later: the code of my locker is {code}."
QUESTION = "What is the code of my locker? Answer with the number only."
BOOK = Path("gutenberg_books/moby_dick_pg2701.txt")


def converse(session, book_ids: list[int], tokenizer, tokens: int, turn_tokens: int, code: str,
             fact: str = FACT, question: str = QUESTION):  # fmt: skip
    """Feed the fact, the book's turns up to `tokens` tokens read, then the question: (answer, turns)."""
    from h2o_cli.generation import Sampling

    session.sampling = Sampling(max_new_tokens=8)
    session.ask(fact.format(code=code))
    session.sampling = Sampling(max_new_tokens=3)
    start, turns = 0, 0
    while session.cache.tokens_seen < tokens:
        part = tokenizer.decode(book_ids[start : start + turn_tokens])
        session.ask(f"Here is the next part of a book I am reading:\n\n{part}\n\nReply with OK.")
        start, turns = start + turn_tokens, turns + 1
    session.sampling = Sampling(max_new_tokens=12)
    return session.ask(question), turns


def main() -> None:
    from h2o_cli.chat import ChatSession
    from h2o_cli.config import CacheSettings
    from h2o_cli.eval.data import data_dir
    from h2o_cli.models import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000, help="tokens read before the question")
    parser.add_argument("--turn-tokens", type=int, default=1500)
    parser.add_argument("--budget", type=int, default=819)
    parser.add_argument("--policies", default="recall,h2o")
    parser.add_argument("--seed", type=int, default=0, help="picks the code and where in the book to start")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fact", default=FACT, help="the first turn, {code} standing for the number")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32")
    rng = random.Random(args.seed)
    code = str(rng.randint(10000, 99999))
    ids = tokenizer((data_dir() / BOOK).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    offset = rng.randrange(0, len(ids) - 2 * args.tokens)
    for policy in args.policies.split(","):
        session = ChatSession(model, tokenizer, CacheSettings(budget=args.budget, policy=policy))
        started = time.perf_counter()
        said, turns = converse(
            session, ids[offset:], tokenizer, args.tokens, args.turn_tokens, code, args.fact, args.question
        )
        row = {"policy": policy, "budget": args.budget, "seed": args.seed, "fact": args.fact, "code": code, "answer": said,
               "correct": code in said, "tokens_read": session.cache.tokens_seen, "book_turns": turns,
               "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
        session.cache.close()
        print(json.dumps(row), flush=True)
        if args.out:
            with args.out.open("a") as out:
                out.write(json.dumps(row) + "\n")
        print(f"{policy}: {said!r} ({row['seconds']} s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()

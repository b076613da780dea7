"""Does `h2o chat` answer a fact from its first turn after tens of thousands of tokens of later conversation?

A conversation on the embedded model: the first turn gives a fact ("the code of my locker is NNNNN"), then
turns of a book's text (each about `--turn-tokens` tokens, "Reply with OK.", a short answer) until
`--tokens` tokens have been read, then the question. One JSON line per policy: the answer, whether it holds
the code, the tokens read, seconds. `recall` is what should remember; `h2o` and `sink` show what a cache
without an archive answers.

    python -m research.chat_remembers --tokens 20000 --budget 819 --policies recall,h2o

`--probe` also records, for every layer call while the question is read and answered, how many of the
code's digit tokens each KV head holds in S (resident) and in R (recalled): a miss where R never holds them is
the page choice's; one where every head holds them is the placement's or the model's.
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
             fact: str = FACT, question: str = QUESTION, before_question=None, reply_tokens: int = 32,
             given_reply: str | None = None):  # fmt: skip
    """Feed the fact, the book's turns up to `tokens` tokens read, then the question: (answer, turns, the
    replies to the book's turns). `before_question(session)` is called just before the question is sent. Each
    reply may take `reply_tokens`: cut shorter, the cut replies become a pattern the model repeats. With
    `given_reply`, every turn before the question is answered with that text instead of a generated reply
    (read as `h2o chat --resume` reads a saved conversation)."""
    from h2o_cli.generation import Sampling

    def exchange(message: str) -> str:
        if given_reply is None:
            return session.ask(message)
        session.read_exchange(message, given_reply)
        return given_reply

    # The fact's reply may take `reply_tokens` too: cut at 8 tokens, "The code of your locker is" (without the
    # number) became the pattern the later replies and the answer copied.
    session.sampling = Sampling(max_new_tokens=reply_tokens)
    exchange(fact.format(code=code))
    start, turns, replies = 0, 0, []
    while session.cache.tokens_seen < tokens:
        part = tokenizer.decode(book_ids[start : start + turn_tokens])
        replies.append(exchange(f"Here is the next part of a book I am reading:\n\n{part}\n\nReply with OK."))
        start, turns = start + turn_tokens, turns + 1
    session.sampling = Sampling(max_new_tokens=24)  # "The code of my locker is 6049" took 12
    if before_question is not None:
        before_question(session)
    return session.ask(question), turns, replies


class Probe:
    """Where the code's tokens are after each `recall` layer call (S or R, per KV head) while `on`."""

    def __init__(self, cache, tokens: list[int]) -> None:
        self.tokens, self.on, self.calls = torch.tensor(tokens), False, []
        for number, layer in enumerate(cache.layers):
            for name in ("_chunk_attend", "_torch_step", "_c_step"):
                self._watch(layer, name, number)

    def _watch(self, layer, name: str, number: int) -> None:
        original = getattr(layer, name)

        def watched(*args, **kwargs):
            output = original(*args, **kwargs)
            if self.on:
                resident = torch.isin(layer.store.token_index, self.tokens).sum(dim=1)
                recalled = torch.isin(layer.recall_index, self.tokens).sum(dim=1)
                self.calls.append((number, name, resident.tolist(), recalled.tolist()))
            return output

        setattr(layer, name, watched)

    def summary(self, layers: int) -> dict:
        """Per call of the last layer's sequence: the share of (layer, KV head) holding every code token."""
        steps = [self.calls[i : i + layers] for i in range(0, len(self.calls), layers)]
        want = len(self.tokens)

        def share(step, where: str) -> float:
            pick = {"S": lambda s, r: s, "R": lambda s, r: r, "S+R": lambda s, r: s + r}[where]
            held = [pick(s, r) == want for _, _, resident, recalled in step
                    for s, r in zip(resident, recalled, strict=True)]  # fmt: skip
            return round(sum(held) / len(held), 3)

        return {where: [share(step, where) for step in steps] for where in ("S", "R", "S+R")}


def code_tokens(session, code: str) -> list[int]:
    """Token indices of the first turn's code digits (the tokens whose text lies inside the code)."""
    turn = session.turns[0]
    ids = list(session.ids[turn.start : turn.end])
    text, spans = "", []
    for offset, token in enumerate(ids):
        piece = session.tokenizer.decode([token])
        spans.append((len(text), len(text) + len(piece), turn.start + offset))
        text += piece
    at = text.index(code)
    return [
        index
        for begin, end, index in spans
        if begin < at + len(code) and end > at and text[begin:end].strip()
    ]


def pick(seed: int, book_tokens: int, tokens: int) -> tuple[str, int]:
    """(the code, the book token the turns start from) of conversation `seed`."""
    rng = random.Random(seed)
    code = str(rng.randint(10000, 99999))
    return code, rng.randrange(0, book_tokens - 2 * tokens)


def main() -> None:
    from h2o_cli.chat import ChatSession
    from h2o_cli.cli.chat import default_chunk
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
    parser.add_argument(
        "--chunk", type=int, default=None, help="the cache's chunk (default: `h2o chat`'s for the policy)"
    )
    parser.add_argument(
        "--reply-tokens", type=int, default=32, help="most tokens of each reply to a book turn"
    )
    parser.add_argument(
        "--given-reply", default=None,
        help="answer every turn before the question with this text (e.g. OK.) instead of generating",
    )  # fmt: skip
    parser.add_argument("--lead-text", action="store_true", help="recall with --lead-text")
    parser.add_argument(
        "--recall-ratio", type=float, default=None, help="recall's --recall-ratio (default: chat's)"
    )
    parser.add_argument(
        "--lead-pages", default=None, help="recall's --lead-pages: a count or fill (default: chat's)"
    )
    parser.add_argument("--probe", action="store_true", help="record where the code's tokens are (recall)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32")
    ids = tokenizer((data_dir() / BOOK).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    code, offset = pick(args.seed, len(ids), args.tokens)
    for policy in args.policies.split(","):
        chunk = args.chunk or default_chunk(policy)
        ratio = {} if args.recall_ratio is None else {"recall_ratio": args.recall_ratio}
        pages = {} if args.lead_pages is None else {"lead_pages": args.lead_pages}
        settings = CacheSettings(
            budget=args.budget, policy=policy, chunk=chunk, lead_text=args.lead_text, **ratio, **pages
        )
        session = ChatSession(model, tokenizer, settings)
        started, probes = time.perf_counter(), []

        def watch(session, probes=probes):
            probes.append(Probe(session.cache, code_tokens(session, code)))
            probes[-1].on = True

        said, turns, replies = converse(
            session, ids[offset:], tokenizer, args.tokens, args.turn_tokens, code, args.fact, args.question,
            watch if args.probe and policy == "recall" else None, args.reply_tokens, args.given_reply,
        )  # fmt: skip
        row = {"policy": policy, "budget": args.budget, "chunk": chunk, "seed": args.seed, "fact": args.fact, "code": code, "answer": said,
               "correct": code in said, "tokens_read": session.cache.tokens_seen, "book_turns": turns,
               "reply_tokens": args.reply_tokens, "given_reply": args.given_reply, "lead_text": args.lead_text, "recall_ratio": settings.recall_ratio, "lead_pages": settings.lead_pages, "replies": replies[:3],
               "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
        if probes:
            row["code_tokens"] = probes[0].tokens.tolist()
            row["held_by_call"] = probes[0].summary(len(session.cache.layers))
        session.cache.close()
        print(json.dumps(row), flush=True)
        if args.out:
            with args.out.open("a") as out:
                out.write(json.dumps(row) + "\n")
        print(f"{policy}: {said!r} ({row['seconds']} s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()

"""Does the chat template survive eviction? What share of a long chat's template tokens each policy keeps.

A conversation through `h2o_cli.chat.ChatSession` on the embedded model at `h2o chat`'s default settings
(budget 0.1 of the context window, its chunk per policy): user turns alternate an MT-Bench question and a
passage pasted from a book or an essay with a request about it; every reply is generated (greedy, at most
`--reply-tokens`). Once `--tokens` tokens are read, the template's tokens the session recorded
(`ChatSession.frame`: role markers, the role word and newline after them, turn ends, the system message) are
looked up in every layer's slots (`H2OCache.layer_slots`, resident entries S): per (layer, KV head) the share
still resident, reported as min and mean, for the system message, the older turns' markers and all of them.
Then `--probes` short-answer questions are asked with `--probe-tokens` each: how many answers end at the
end-of-turn token, and how many start by writing a role marker or a role word.

    python -m research.frame_survival --policies h2o,sink,tova,recall --tokens 20000 [--keep-frame]

One JSON line per policy on stdout (and appended to `--out`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

BOOKS = ("gutenberg_books/pride_and_prejudice_pg1342.txt", "gutenberg_books/sherlock_holmes_pg1661.txt")
ESSAYS = "paul_graham_essays/PaulGrahamEssays"
ASKS = ("Summarise this passage in one sentence.", "Who or what is this passage about?")
ROLE_WORDS = ("user", "assistant", "system")
# Questions a chat answers in a few words: an answer that runs to the cap instead of ending its turn is the
# template's structure lost (long MT-Bench answers run to any cap either way).
SHORT = (
    "What is the capital of France? Answer in one word.",
    "Reply with just yes or no: is water wet?",
    "Name one colour of the rainbow, in one word.",
)


def passages(root: Path, tokenizer, size: int):
    """Endless pasted passages of about `size` tokens: essays and book text in turn."""
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted((root / ESSAYS).glob("*.txt"))]
    texts += [(root / book).read_text(encoding="utf-8", errors="replace")[20000:] for book in BOOKS]
    number = 0
    while True:
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            for start in range(0, max(len(ids) - size // 2, 1), size):
                yield tokenizer.decode(ids[start : start + size]).strip(), ASKS[number % len(ASKS)]
                number += 1
                break  # one passage per text per round: the chat wanders like a user's


def questions(root: Path):
    lines = (root / "mt_bench/question.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["turns"][0] for line in lines if line.strip()]


def survival(session) -> dict:
    """Per (layer, KV head), the share of the template's tokens resident: min and mean over the heads of every
    layer, for the system message (the first turn's header), the markers of turns before the last four
    messages (the recent window's turns are resident anyway), and all of them."""
    frame = torch.tensor(list(session.frame), dtype=torch.int64)
    first_user = session.turns[0]
    head = frame[frame < first_user.start + _header_tokens(session)]
    older = frame[(frame >= head.numel()) & (frame < session.turns[-4].start)]
    groups = {"system": head, "older_turns": older, "all": frame}
    shares = {name: [] for name in groups}
    for slots in session.cache.layer_slots():
        for head_index in range(slots.token_index.shape[0]):
            held = slots.token_index[head_index][slots.valid[head_index]]
            for name, tokens in groups.items():
                if tokens.numel():
                    shares[name].append(torch.isin(tokens, held).float().mean().item())
    row = {}
    for name, values in shares.items():
        row[f"{name}_tokens"] = int(groups[name].numel())
        if values:
            row[f"{name}_min"] = round(min(values), 4)
            row[f"{name}_mean"] = round(sum(values) / len(values), 4)
    return row


def _header_tokens(session) -> int:
    """Template tokens fed before the first user message's text (the system message and the user header)."""
    first = session.turns[0]
    frame = set(session.frame)
    count = 0
    while first.start + count in frame:
        count += 1
    return count


def probe(session, asked: list[str], tokens: int) -> dict:
    """Ask each question with `tokens` at most: answers ending at the end-of-turn token, and answers whose
    text starts with a role word or holds a template marker."""
    from h2o_cli.generation import Sampling

    session.sampling = Sampling(max_new_tokens=tokens)
    stopped, confused, starts = 0, 0, []
    for question in asked:
        answer = session.ask(question)
        stopped += session.last.stopped == "stop"
        head = answer.strip().lower()
        confused += head.startswith(ROLE_WORDS) or "<|im_" in answer or "\nuser\n" in answer
        starts.append(answer.strip()[:60])
    return {"probes": len(asked), "stopped_at_turn_end": stopped, "role_confused": confused, "starts": starts}


def main() -> None:
    from h2o_cli.chat import ChatSession
    from h2o_cli.cli.chat import default_chunk
    from h2o_cli.config import CacheSettings
    from h2o_cli.eval.data import data_dir
    from h2o_cli.generation import Sampling
    from h2o_cli.models import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="h2o,sink,tova,recall")
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--passage-tokens", type=int, default=900)
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--probes", type=int, default=4)
    parser.add_argument("--probe-tokens", type=int, default=96)
    parser.add_argument("--budget", default="0.1", help="as `h2o chat --budget` (default: its default)")
    parser.add_argument("--keep-frame", action="store_true", help="pin the template's tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2-135m", device="cpu", dtype="float32")
    root = data_dir()
    asked = questions(root)
    for policy in args.policies.split(","):
        settings = CacheSettings(
            budget=args.budget, policy=policy, chunk=default_chunk(policy), lead_text=False
        )
        session = ChatSession(model, tokenizer, settings, Sampling(max_new_tokens=args.reply_tokens))
        if args.keep_frame:
            session.keep_frame = True
        started, number = time.perf_counter(), 0
        pasted = passages(root, tokenizer, args.passage_tokens)
        while session.cache.tokens_seen < args.tokens:
            if number % 2:
                text, ask = next(pasted)
                message = f"{text}\n\n{ask}"
            else:
                message = asked[(number // 2) % len(asked)]
            session.ask(message)
            number += 1
        row = {"policy": policy, "keep_frame": args.keep_frame, "budget": session.cache.report().resident_slots,
               "chunk": settings.chunk, "tokens_seen": session.cache.tokens_seen, "turns": len(session.turns)}  # fmt: skip
        row.update(survival(session))
        row.update(probe(session, list(SHORT[: args.probes]), args.probe_tokens))
        row["seconds"] = round(time.perf_counter() - started, 1)
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with args.out.open("a", encoding="utf-8") as out:
                out.write(line + "\n")
        session.cache.close()


if __name__ == "__main__":
    main()

"""Where does the lead head rank a pass key's needle, and what do other lead choices answer? The twin of
research/ruler_probe.py for `h2o passkey`'s haystacks (any book, any `--wording`).

Each haystack (`passkey.haystacks`: the text of `--haystack` with the needle at each depth, as the grid cuts
it for `--length`, `--seed` and `--wording`) is read through a fresh cache as `h2o passkey` reads it (the
frame's head, the text, then the question as a `NewChunk`); the cache's state after the text is kept and each
of `--variants` (ruler_probe's: `pN`, `nextN`, `beforeN`, `aroundN`, `oracleN`) asks the question from it:
the rank of the needle's best page and of the pages holding the key's first and last token, what the lead's
first `--show` pages hold, and the answer (`passkey.ask`, greedy, as the grid answers). Prints one JSON line
per depth and variant. A miss whose needle ranks past the lead's pages is the ranking's; one inside them (or
one `oracleN` answers no better) is the answer's.

    python -m research.passkey_probe --haystack $H2O_DATA/gutenberg_books/sherlock_holmes_pg1661.txt \\
        --wording page --length 32768 --depths 10,30,50,70,90 --seed 0 --variants next8,oracle8
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from research.ruler_probe import ranking, under


def probe(lm, text: str, key: str, depth: int, wording: str, show: int, variants: list[str]) -> list[dict]:
    """The rows of one haystack (`text`, its needle holding `key` at `depth` %), one per variant."""
    from h2o_cli.cache.recall import lead as lead_module
    from h2o_cli.eval.passkey import ask, cache_span, correct, needle_tokens, prompt_pieces, wording_of
    from h2o_cli.streaming import prefill

    question = wording_of(wording).question
    pieces = prompt_pieces(lm.tokenizer, text, question)
    read_ids = [token for piece in pieces[:-1] for token in piece]
    prompt = len(read_ids) + len(pieces[-1])
    cache = lm._cache(prompt, cache_span(prompt, (question,)) - prompt)
    started = time.perf_counter()
    _, stats = prefill(lm.model, cache, pieces[:-1], lm.settings.chunk)
    stats.reraise()
    read = time.perf_counter() - started
    state = cache.state()
    # the text's ids are one piece (`token_stream` of one block); what comes before it (the frame's head, a BOS)
    # shifts the needle's stream indices
    text_ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    head = sum(map(len, pieces[: next(i for i, piece in enumerate(pieces) if list(piece) == text_ids)]))
    sentence, digits = needle_tokens(lm.tokenizer, text, key, head, wording)
    needles = [
        {
            "value": key,
            "tokens": [sentence[0], sentence[-1] + 1],
            "depth": round((sentence[0] - head) / len(text_ids), 3),
            "value_tokens": [digits[0], digits[-1]],
        }
    ]
    rows, kept = [], lead_module.order_key
    for variant in variants:
        under(cache, state, variant, (sentence[0], sentence[-1] + 1))
        logits, stats = prefill(lm.model, cache, [pieces[-1]], lm.settings.chunk)
        stats.reraise()
        row = ranking(lm, cache, read_ids, needles, show)
        said, _ = ask(lm.model, lm.tokenizer, cache, logits, text, (question,), lm.settings.chunk)
        rows.append(
            {
                "depth": depth,
                "key": key,
                "variant": variant,
                **row,
                "answer_pages": cache.lead.count,  # as the answer's last step counted them
                "answer": said[:60],
                "correct": correct(key, said),
                "read_s": round(read, 1),
            }  # fmt: skip
        )
    lead_module.order_key = kept
    cache.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--haystack", required=True, help="a text file, or a folder of *.txt")
    parser.add_argument(
        "--wording", default="page", help="how the needle is said and asked (`h2o passkey`'s)"
    )
    parser.add_argument("--length", type=int, default=32768, help="prompt tokens in all")
    parser.add_argument("--depths", default="10,30,50,70,90", help="comma-separated needle depths, in %%")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=8, help="print what the lead's first N pages hold")
    parser.add_argument("--model_args", default="policy=recall,budget=819,threads=1")
    parser.add_argument("--variants", default="next8", help="comma-separated lead choices (ruler_probe's)")
    args = parser.parse_args()
    from h2o_cli.eval.lm_eval_model import H2OLM
    from h2o_cli.eval.passkey import haystack_text, haystacks

    lm = H2OLM(**dict(item.split("=", 1) for item in args.model_args.split(",")))
    depths = [int(depth) for depth in args.depths.split(",")]
    essays = haystack_text(args.haystack)
    for depth, key, text in haystacks(
        lm.tokenizer, essays, args.length, depths, args.seed, wording=args.wording
    ):
        with torch.inference_mode():
            for row in probe(lm, text, key, depth, args.wording, args.show, args.variants.split(",")):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""Which attention heads copy a passkey? The retrieval score of every (layer, KV head), full cache, in the window.

For each passkey haystack of `recall_grid.py` short enough for the model's window, the prompt is read with a
plain full cache and the answer generated greedily. At every answer step that writes the next digit of the
passkey, each query head's strongest key is looked up: a head *copies* that step when its top key is a token
of the needle sentence holding the digit being written (Wu et al. 2024, "Retrieval Head Mechanistically
Explains Long-Context Factuality": the copy-paste score). A head's score is the share of copied digits over
the runs the full cache answers; a KV head's is the best of its query heads (GQA: a KV head recalls for its
whole group). One JSON object: the runs, the per-(layer, KV head) scores, and the KV heads ranked.

    python scripts/retrieval_heads.py --length 2048 --seeds 2 --depths 4 \
        --out docs/results/recall/retrieval_heads_2048.json

`RecallHeads` lets only the best-ranked KV heads recall (`recall_grid.py --recall-heads FILE:K`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from recall_grid import MAX_NEW_TOKENS, QUESTION, haystacks  # scripts/ on sys.path
from recall_probe import needle_tokens, steps_keep_valid_only
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import repeat_kv

from h2o_cli.cache.recall.archive import PageArchive

TOP: list[torch.Tensor] = []  # per layer call of a one-token step: [n_heads] index of the strongest key


def probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain causal attention over one unpadded sequence (`attention_mask` is not needed); when one token
    queries, each head's strongest key goes to `TOP`."""
    group = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, group), repeat_kv(value, group)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    logits = torch.matmul(query, key.transpose(2, 3)) * scaling
    q, k = query.shape[2], key.shape[2]  # causal: the queries are the last q of the k positions
    later = torch.ones(q, k, dtype=torch.bool).triu(k - q + 1)
    logits = logits.masked_fill(later, float("-inf"))
    weights = torch.softmax(logits.float(), dim=-1).to(query.dtype)
    if query.shape[2] == 1:
        TOP.append(weights[0, :, 0].argmax(-1))
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


def copy_hits(model, tokenizer, ids: list[int], key: str, needle: list[int]):
    """Greedy answer of `ids` with a full cache; per (layer, query head) how many of the passkey's digits the
    head copied (its top key is a needle token equal to the digit written), the digits scored (each written
    in order by an answer step), and the answer."""
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    hits = torch.zeros(layers, heads)
    digits = [tokenizer.convert_tokens_to_ids(d) for d in key]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(torch.tensor([ids]), cache=cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        answer, scored = [], 0
        written = int(token == digits[0])  # a first digit written by the prompt's pass: not scored
        for _ in range(MAX_NEW_TOKENS):
            answer.append(token)
            TOP.clear()
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            following = int(out.logits[0, -1].argmax())
            # this step's queries chose `following`: a copy when it is the next digit of the key
            if written < len(digits) and following == digits[written]:
                sources = torch.tensor([p for p in needle if ids[p] == following])
                top = torch.stack(TOP)  # [layers, heads]
                hits += torch.isin(top, sources).float()
                written, scored = written + 1, scored + 1
            token = following
    return hits, scored, tokenizer.decode(answer + [token])


class RecallHeads:
    """Only the `top` KV heads of a ranking (this script's output) recall: wraps `PageArchive.choose` and
    `choose_one` so every other head's recalled slots stay empty (it attends over its resident set S alone).
    `attach(cache)` says which layer each archive serves. Needs the torch step (`kernels=torch`): the C step
    chooses in C."""

    def __init__(self, ranking: Path, top: int) -> None:
        self.heads: dict[int, list[int]] = defaultdict(list)
        for row in json.loads(Path(ranking).read_text())["ranked"][:top]:
            self.heads[row["layer"]].append(row["kv_head"])
        self.recalls: dict[int, torch.Tensor] = {}  # id(archive) -> [n_kv_heads] bool, set by `attach`
        choose, choose_one = PageArchive.choose, PageArchive.choose_one

        def chunk(archive, *args, **kwargs):
            return self.only(archive, *choose(archive, *args, **kwargs))

        def step(archive, *args, **kwargs):
            return self.only(archive, *choose_one(archive, *args, **kwargs))

        PageArchive.choose, PageArchive.choose_one = chunk, step
        steps_keep_valid_only()  # or the heads that do not recall would recall at every answer step

    def attach(self, cache) -> None:
        """Each recalling layer's mask of the KV heads that recall, made once per cache."""
        self.recalls = {}
        for number, layer in enumerate(cache.layers):
            if hasattr(layer, "archive"):
                recalls = torch.zeros(layer.archive.n_kv_heads, dtype=torch.bool)
                recalls[self.heads.get(number, [])] = True
                self.recalls[id(layer.archive)] = recalls

    def only(self, archive, chosen: torch.Tensor, valid: torch.Tensor):
        """chosen, valid [n_kv_heads, slots] -> the same, `valid` cleared in the heads that do not recall."""
        return chosen, valid & self.recalls[id(archive)].unsqueeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens (inside the model's window)")
    parser.add_argument("--depths", type=int, default=5, help="depths, evenly spread")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seed-from", type=int, default=100, help="first seed (apart from the grids' 0-2)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from h2o_cli.eval.data import load_essays
    from h2o_cli.models import load_model
    from h2o_cli.prompting import read_then_answer

    model, tokenizer = load_model(args.model, device="cpu", dtype="float32")
    AttentionInterface.register("copy_probe", probe_attention)
    model.set_attn_implementation("copy_probe")
    config = model.config
    group = config.num_attention_heads // config.num_key_value_heads
    essays = load_essays(None)
    depths = [round(5 + 90 * i / max(1, args.depths - 1)) for i in range(args.depths)]
    total, copied, runs = torch.zeros(config.num_hidden_layers, config.num_attention_heads), 0, []
    for seed in range(args.seed_from, args.seed_from + args.seeds):
        for depth, key, text in haystacks(tokenizer, essays, args.length, depths, seed):
            text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            pieces = list(read_then_answer(tokenizer, [text_ids], QUESTION))
            ids = [token for piece in pieces for token in piece]
            needle, _ = needle_tokens(tokenizer, text, key, len(pieces[0]))
            hits, scored, answer = copy_hits(model, tokenizer, ids, key, needle)
            correct = key in answer
            runs.append({"seed": seed, "depth": depth, "key": key, "answer": answer, "correct": correct})
            print(f"s{seed} d{depth:>2} {correct!s:<5} {answer!r}", file=sys.stderr, flush=True)
            if correct:  # a wrong answer's digits are not a copy of the needle
                total, copied = total + hits, copied + scored
    score = (total / max(1, copied)).view(config.num_hidden_layers, config.num_key_value_heads, group)
    kv_score = score.max(-1).values  # [layers, kv heads]
    ranked = sorted(
        ((float(kv_score[layer, head]), layer, head) for layer in range(kv_score.shape[0])
         for head in range(kv_score.shape[1])), reverse=True,
    )  # fmt: skip
    report = {
        "model": args.model, "length": args.length, "copied_digits": copied, "runs": runs,
        "score": [[round(float(s), 4) for s in row] for row in kv_score],
        "ranked": [{"layer": layer, "kv_head": head, "score": round(s, 4)} for s, layer, head in ranked],
    }  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for s, layer, head in ranked[:15]:
        print(f"L{layer:<2} kv{head}  {s:.2f}")


if __name__ == "__main__":
    main()

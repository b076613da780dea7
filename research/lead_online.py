"""Would an online rule pick the lead head as well as the calibration? On report probes inside the window.

The rule measured: at the question, each KV head's page scores are the attention its group's question queries
put on each 16-token page of the text (the mean over queries and the group's heads); the head whose best
`--lead-pages` pages hold the largest share of its text attention leads. A probe counts for a rule when the
page holding the value's first mention is among the chosen head's best pages. Beside it: the calibrated head
(`--lead HEAD`), and the best any single head does over all probes (its ceiling).

    python -m research.lead_online --lead 18.2 --probes 12 --tokens 2048 --data /work/shared/data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

PAGE = 16


class QuestionAttention:
    """sdpa, and for a call of more than one query the page attention of the last `question` queries."""

    def __init__(self) -> None:
        self.question, self.text, self.pages = 0, (0, 0), []  # pages: per layer [n_kv, n_pages]

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from transformers.integrations.sdpa_attention import repeat_kv

        group = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, group), repeat_kv(value, group)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling)
        if query.shape[2] > 1 and self.question:
            q = query[0, :, -self.question :]  # [H, Q, d]
            weights = torch.softmax(
                (q @ key[0].transpose(1, 2)).float() * scaling, dim=-1
            )  # causal: keys before
            first, end = self.text
            used = (end - first) // PAGE * PAGE
            mass = weights[:, :, first : first + used].reshape(weights.shape[0], weights.shape[1], -1, PAGE)
            per_head = mass.sum(-1).mean(1)  # [H, pages]
            self.pages.append(per_head.view(-1, group, per_head.shape[-1]).mean(1))  # [n_kv, pages]
        return out.transpose(1, 2).contiguous(), None


def main() -> None:
    from transformers import AttentionInterface

    from h2o_cli.eval.probes import REPORT, probes
    from h2o_cli.models import load_model
    from h2o_cli.prompting import read_then_answer

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lead", default="18.2")
    parser.add_argument("--probes", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--pages", type=int, default=8)
    parser.add_argument("--data", type=Path, default=None)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, "cpu", "float32")
    probe = QuestionAttention()
    AttentionInterface.register("question_pages", probe)
    model.set_attn_implementation("question_pages")
    lead = tuple(int(part) for part in args.lead.split("."))
    rows, hits_by_head = [], None
    for item in probes(tokenizer, REPORT, args.data, args.tokens, args.probes, seed=9000):
        text_ids = tokenizer(item.text, add_special_tokens=False)["input_ids"]
        pieces = list(read_then_answer(tokenizer, [text_ids], item.question))
        head = len(pieces[0])
        probe.question, probe.text, probe.pages = len(pieces[-1]), (head, head + len(text_ids)), []
        with torch.no_grad():
            model(torch.tensor([[token for piece in pieces for token in piece]]), logits_to_keep=1)
        pages = torch.stack(probe.pages)  # [layers, n_kv, pages]
        at = item.text.index(item.needle) + item.needle.index(item.value)
        offsets = tokenizer(item.text, add_special_tokens=False, return_offsets_mapping=True)[
            "offset_mapping"
        ]
        needle_page = next(i for i, (a, b) in enumerate(offsets) if b > at) // PAGE
        best = pages.topk(args.pages, dim=-1)
        found = (best.indices == needle_page).any(-1)  # [layers, n_kv]
        share = best.values.sum(-1) / pages.sum(-1).clamp_min(1e-12)
        online = divmod(int(share.flatten().argmax()), share.shape[1])
        hits_by_head = found.float() if hits_by_head is None else hits_by_head + found.float()
        rows.append({"filler": item.filler, "depth": item.depth, "online": online,
                     "online_found": bool(found[online]), "lead_found": bool(found[lead])})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    ceiling = divmod(int(hits_by_head.flatten().argmax()), hits_by_head.shape[1])
    print(json.dumps({
        "probes": len(rows), "online": sum(r["online_found"] for r in rows),
        "calibrated": sum(r["lead_found"] for r in rows), "best_single_head": ceiling,
        "best_single_head_found": int(hits_by_head[ceiling]),
    }))  # fmt: skip


if __name__ == "__main__":
    main()

"""Would an online rule pick the lead head as well as the calibration? On report probes inside the window.

The rule measured: at the question, each KV head's page scores are the attention its group's question queries
put on each 16-token page of the text (the mean over queries and the group's heads); the head whose best
`--lead-pages` pages hold the largest share of its text attention leads. A probe counts for a rule when the
page holding the value's first mention is among the chosen head's best pages. Beside it: the calibrated head
(`--lead HEAD`), and the best any single head does over all probes (its ceiling). `page_hits` is the proxy
`research/lead_scores.py` measures the calibration's scores with.

    python -m research.lead_online --lead 18.2 --probes 12 --tokens 2048 --data /work/shared/data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

PAGE = 16
NAME = "question_pages"


class QuestionAttention:
    """sdpa under the model's own mask (a sliding window's too), and for a call of more than one query the
    page attention of the last `question` queries."""

    def __init__(self) -> None:
        self.question, self.text, self.pages = 0, (0, 0), []  # pages: per layer [n_kv, n_pages]

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from transformers.integrations.sdpa_attention import repeat_kv

        group = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, group), repeat_kv(value, group)
        q, k = query.shape[2], key.shape[2]
        allowed = torch.ones(q, k, dtype=torch.bool).tril(k - q)
        if attention_mask is not None and attention_mask.dim() == 4:
            mask = attention_mask[..., -q:, :k]
            allowed = allowed & (mask if mask.dtype == torch.bool else mask == 0)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling)
        if q > 1 and self.question:
            logits = (query[0, :, -self.question :] @ key[0].transpose(1, 2)).float() * scaling  # [H, Q, k]
            weights = torch.softmax(
                logits.masked_fill(~allowed.reshape(q, k)[-self.question :], float("-inf")), -1
            )
            first, end = self.text
            used = (end - first) // PAGE * PAGE
            mass = weights[:, :, first : first + used].reshape(weights.shape[0], weights.shape[1], -1, PAGE)
            per_head = mass.sum(-1).mean(1)  # [H, pages]
            self.pages.append(per_head.view(-1, group, per_head.shape[-1]).mean(1))  # [n_kv, pages]
        return out.transpose(1, 2).contiguous(), None


def report_pages(model, tokenizer, data: Path | None, tokens: int, count: int, seed: int = 9000):
    """For each of `count` report probes of `tokens` tokens: (probe, [layers, n_kv, pages] page attention of
    the question, the page of the value's first mention)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from h2o_cli.eval.probes import REPORT, probes
    from h2o_cli.eval.retrieval_heads import framed

    probe = QuestionAttention()
    AttentionInterface.register(NAME, probe)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    before = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        for item in probes(tokenizer, REPORT, data, tokens, count, seed=seed):
            ids, head, question = framed(tokenizer, item)
            probe.question, probe.text, probe.pages = question, (head, len(ids) - question), []
            with torch.no_grad():
                model(torch.tensor([ids]), logits_to_keep=1)
            at = item.text.index(item.needle) + item.needle.index(item.value)
            offsets = tokenizer(item.text, add_special_tokens=False, return_offsets_mapping=True)
            needle_page = next(i for i, (a, b) in enumerate(offsets["offset_mapping"]) if b > at) // PAGE
            yield item, torch.stack(probe.pages), needle_page
    finally:
        model.set_attn_implementation(before)


def page_hits(pages: torch.Tensor, needle_page: int, best: int) -> torch.Tensor:
    """[layers, n_kv] bool: whether the needle's page is among each KV head's `best` pages."""
    return (pages.topk(best, dim=-1).indices == needle_page).any(-1)


def main() -> None:
    from h2o_cli.models import load_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lead", default="18.2")
    parser.add_argument("--probes", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--pages", type=int, default=8)
    parser.add_argument("--data", type=Path, default=None)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, "cpu", "float32")
    lead = tuple(int(part) for part in args.lead.split("."))
    rows, hits_by_head = [], None
    for item, pages, needle_page in report_pages(model, tokenizer, args.data, args.tokens, args.probes):
        best = pages.topk(args.pages, dim=-1)
        found = page_hits(pages, needle_page, args.pages)  # [layers, n_kv]
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

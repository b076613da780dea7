"""Which calibration score names the best lead head? Each score's head, found on the tuning probes, measured by
the page proxy of `research/lead_online.py` on the report probes.

Scores (per KV head of a global layer, `h2o_cli.eval.retrieval_heads.calibrate`): `copy_mass` (what
`--recall-lead auto` takes: the group's attention mass on the needle at the answer steps that copy a piece
of the value, answered probes), `argmax` (the share of those pieces whose strongest key is the needle) and
`question` (the group's mass on the needle from the prompt's last token, every probe). The proxy: a report
probe counts for a head when the value's page is among its `--pages` best pages by its question's attention.
Each head is printed as `layer.head:score/report probes found`. (At 2a6d759 this script also
measured the masses on the value's tokens alone and over all the question's queries.)

    python -m research.lead_scores --model smollm2-135m --report-probes 24 --data /work/shared/data
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from research.lead_online import page_hits, report_pages


def main() -> None:
    from h2o_cli.eval.probes import TUNING, probes
    from h2o_cli.eval.retrieval_heads import calibrate
    from h2o_cli.models import load_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--probes", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--report-probes", type=int, default=12)
    parser.add_argument("--report-tokens", type=int, default=2048)
    parser.add_argument("--pages", type=int, default=8)
    parser.add_argument("--data", type=Path, default=None)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, "cpu", "float32")
    started = time.perf_counter()
    report = calibrate(model, tokenizer, probes(tokenizer, TUNING, args.data, args.tokens, args.probes))
    seconds = time.perf_counter() - started
    answered = sum(run["correct"] for run in report["runs"])
    print(json.dumps({"tuning_seconds": round(seconds, 1), "answered": answered, "copied": report["copied"]}))
    found = [
        page_hits(pages, needle_page, args.pages).float()
        for _, pages, needle_page in report_pages(
            model, tokenizer, args.data, args.report_tokens, args.report_probes
        )
    ]
    hits = torch.stack(found).sum(0)  # [layers, n_kv]: report probes whose value page the head finds
    print(json.dumps({"report_probes": len(found), "best_single_head": _best(hits)}))
    for name, ranked in {"copy_mass": report["ranked"], **report["others"]}.items():
        heads = [(row["layer"], row["kv_head"]) for row in ranked[:5]]
        top = [f"{layer}.{head}:{row['score']:.3f}/{int(hits[layer, head])}" for (layer, head), row in
               zip(heads, ranked, strict=False)]  # fmt: skip
        print(f"{name:>18}  " + "  ".join(top))


def _best(hits: torch.Tensor) -> list:
    order = hits.flatten().argsort(descending=True)[:5]
    return [f"{int(i) // hits.shape[1]}.{int(i) % hits.shape[1]}/{int(hits.flatten()[i])}" for i in order]


if __name__ == "__main__":
    main()

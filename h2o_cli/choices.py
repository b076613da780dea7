"""Multiple-choice scoring with the H2O cache: log-likelihood of each choice given its context.

Protocol (SPEC.md, eval): the context is prefilled in one chunk into a fresh cache whose budget is a fraction
of the context length, the cache evicts down to it, then the choice's tokens are scored in one chunk.
The prediction is the choice with the highest summed log-likelihood.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    label: int


def copa_examples(folder: Path) -> list[Example]:
    """COPA dev (`copa-dev.xml`), phrased as lm-eval does: "premise because/therefore" + " alternative"."""
    text = (folder / "copa-dev.xml").read_text(encoding="utf-8")
    examples = []
    pattern = (
        r'asks-for="(\w+)" most-plausible-alternative="(\d)">\s*'
        r"<p>(.*?)</p>\s*<a1>(.*?)</a1>\s*<a2>(.*?)</a2>"
    )
    for asks, label, premise, first, second in re.findall(pattern, text, flags=re.S):
        joiner = " because" if asks == "cause" else " therefore"
        choices = tuple(" " + alt[0].lower() + alt[1:] for alt in (first, second))
        examples.append(Example(premise.rstrip(".") + joiner, choices, int(label) - 1))
    return examples


def piqa_examples(folder: Path) -> list[Example]:
    """PIQA validation: "Question: goal\\nAnswer:" + " solution"."""
    labels = (folder / "valid-labels.lst").read_text().split()
    examples = []
    for line, label in zip((folder / "valid.jsonl").read_text().splitlines(), labels, strict=False):
        row = json.loads(line)
        examples.append(
            Example(f"Question: {row['goal']}\nAnswer:", (" " + row["sol1"], " " + row["sol2"]), int(label))
        )
    return examples


def choice_loglik(
    model, tokenizer, context: str, choice: str, budget_ratio: float | None, **settings
) -> float:
    """Summed log-probability of `choice` after `context`; `budget_ratio` None = full cache."""
    context_ids = tokenizer(context)["input_ids"]
    choice_ids = tokenizer(choice, add_special_tokens=False)["input_ids"]
    chunk = max(len(context_ids), len(choice_ids))
    # A budget covering everything never evicts: full attention, without preallocating the context window.
    budget = (
        len(context_ids) + len(choice_ids) if budget_ratio is None else round(budget_ratio * len(context_ids))
    )
    cache_settings = CacheSettings(budget=max(2, budget), chunk=chunk, **settings)
    cache = H2OCache(model, cache_settings)
    with torch.no_grad():
        last = model(input_ids=torch.tensor([context_ids]), cache=cache, use_cache=True).logits[0, -1:]
        rest = model(input_ids=torch.tensor([choice_ids]), cache=cache, use_cache=True).logits[0, :-1]
    logprobs = torch.log_softmax(torch.cat([last, rest]).float(), dim=-1)
    return logprobs.gather(1, torch.tensor(choice_ids).unsqueeze(1)).sum().item()


def accuracy(model, tokenizer, examples: list[Example], budget_ratio: float | None, **settings) -> float:
    """Share of examples whose highest-likelihood choice is the label."""
    correct = 0
    for example in examples:
        scores = [
            choice_loglik(model, tokenizer, example.context, c, budget_ratio, **settings)
            for c in example.choices
        ]
        correct += int(max(range(len(scores)), key=scores.__getitem__) == example.label)
    return correct / len(examples)

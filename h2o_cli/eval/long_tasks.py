"""Long-context tasks the harness does not fit: answers in the middle of a long prompt, scored by greedy answers.

- `hotpotqa`: 10-document HotpotQA distractor questions in the lost-in-the-middle QA prompt.
- `kv-retrieval`: lost-in-the-middle JSON key-value retrieval (75 keys), gold pair moved to the middle.
- `needle`: the Paul Graham needle-in-a-haystack over a length x depth grid.
Each example is `LongExample(prompt, answers, cell, question)`; `cell` names its grid point (needle) or "", and
`question` is the prompt's tail from the question on, which the runner reads as a question (as `h2o stream
--prompt` does: a `recall` cache chooses with its queries).
Each prompt is a document and a question about it, framed by `h2o_cli.prompting.document_frame` (the read-then-
answer framing `h2o stream --prompt` uses too): with a chat template (an instruct model) they are one user message
in that template, as lost-in-the-middle did for its chat models.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from h2o_cli.eval import data
from h2o_cli.prompting import document_frame

# Each prompt is a document, then "\n\n" and a question (`document_frame`): lost-in-the-middle's prompts.
QA_DOCUMENT = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant).\n\n{search_results}"
)
QA_QUESTION = "Question: {question}\nAnswer:"
KV_DOCUMENT = (
    "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n{records}"
)
KV_QUESTION = 'Key: "{key}"\nCorresponding value:'
NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
NEEDLE_QUESTION = "What is the best thing to do in San Francisco?"
NEEDLE_ANSWERS = ("eat a sandwich", "dolores park")
LONG_TASKS = ("hotpotqa", "kv-retrieval", "needle")
MAX_NEW_TOKENS = {"hotpotqa": 24, "kv-retrieval": 40, "needle": 32}


@dataclass(frozen=True)
class LongExample:
    prompt: str
    answers: tuple[str, ...]
    cell: str = ""
    question: str = ""  # the prompt's tail that is its question (the frame's `after`); "" for none


def hotpotqa_examples(tokenizer, path=None) -> Iterator[LongExample]:
    for item in data.load_hotpotqa(path):
        documents = "\n".join(
            f"Document [{number}](Title: {title}) {''.join(sentences).strip()}"
            for number, (title, sentences) in enumerate(item["context"], start=1)
        )
        before, after = document_frame(tokenizer, QA_QUESTION.format(question=item["question"]))
        prompt = before + QA_DOCUMENT.format(search_results=documents) + after
        yield LongExample(prompt, (item["answer"],), question=after)


def kv_examples(tokenizer, path=None) -> Iterator[LongExample]:
    for item in data.load_kv_retrieval(path):
        records = [pair for pair in item["ordered_kv_records"] if pair[0] != item["key"]]
        records.insert(len(records) // 2, [item["key"], item["value"]])
        body = "{" + ",\n ".join(f"{json.dumps(key)}: {json.dumps(value)}" for key, value in records) + "}"
        before, after = document_frame(tokenizer, KV_QUESTION.format(key=item["key"]))
        yield LongExample(before + KV_DOCUMENT.format(records=body) + after, (item["value"],), question=after)


def needle_examples(
    tokenizer, lengths=(1000, 2000, 4000), depths=(0, 25, 50, 75, 100), path=None
) -> Iterator[LongExample]:
    """Haystack cut so the prompt is `length` tokens, needle inserted at `depth` % (at a sentence end, as
    Kamradt's tester), then the question (`document_frame`)."""
    haystack_ids = tokenizer(data.load_essays(path), add_special_tokens=False)["input_ids"]
    before, after = document_frame(tokenizer, NEEDLE_QUESTION + " Answer from the text above:")
    overhead = len(tokenizer(before + NEEDLE + after)["input_ids"])
    for length in lengths:
        context = tokenizer.decode(haystack_ids[: max(0, length - overhead)])
        for depth in depths:
            cut = int(len(context) * depth / 100)
            if 0 < cut < len(context):
                period = context.rfind(".", 0, cut)
                cut = period + 1 if period >= 0 else cut
            prompt = before + context[:cut] + NEEDLE + context[cut:] + after
            yield LongExample(prompt, NEEDLE_ANSWERS, f"{length}x{depth}%", after)


def examples(task: str, tokenizer, path=None) -> Iterator[LongExample]:
    if task == "needle":
        return needle_examples(tokenizer, path=path)
    return hotpotqa_examples(tokenizer, path) if task == "hotpotqa" else kv_examples(tokenizer, path)

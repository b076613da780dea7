"""lm-eval hooks for the h2o task YAMLs: datasets from local files, lm-eval's own prompt functions, ROUGE."""

from __future__ import annotations

import datasets

from h2o_cli.eval import data


def _dataset(**splits: list[dict]) -> datasets.DatasetDict:
    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


def copa(data_path=None, **_):
    return _dataset(**data.load_copa(data_path))


def copa_all(data_path=None, **_):
    """All 500 labelled COPA items as one split, `all` (ids 1-500), for the h2o_copa_all task."""
    splits = data.load_copa(data_path)
    return _dataset(all=splits["train"] + splits["validation"])


def piqa(data_path=None, **_):
    return _dataset(validation=data.load_piqa(data_path))


def openbookqa(data_path=None, **_):
    return _dataset(test=data.load_openbookqa(data_path))


def winogrande(data_path=None, **_):
    return _dataset(validation=data.load_winogrande(data_path))


def rte(data_path=None, **_):
    return _dataset(validation=data.load_rte(data_path))


def mathqa(data_path=None, **_):
    return _dataset(test=data.load_mathqa(data_path))


def xsum(data_path=None, **_):
    return _dataset(test=data.load_xsum(data_path))


# COPA, as lm-eval's super_glue/copa/utils.py words it.
def copa_convert_choice(choice: str) -> str:
    return choice[0].lower() + choice[1:]


def copa_doc_to_text(doc) -> str:
    connector = {"cause": "because", "effect": "therefore"}[doc["question"]]
    return doc["premise"].strip()[:-1] + f" {connector}"


def copa_doc_to_target(doc) -> str:
    correct = doc["choice1"] if doc["label"] == 0 else doc["choice2"]
    return " " + copa_convert_choice(correct)


def copa_doc_to_choice(doc) -> list[str]:
    return [" " + copa_convert_choice(doc["choice1"]), " " + copa_convert_choice(doc["choice2"])]


# WinoGrande partial scoring (lm-eval winogrande): the text is the gold index, the choices are the contexts.
def winogrande_doc_to_text(doc) -> int:
    return int(doc["gold"])


def winogrande_doc_to_target(doc) -> str:
    return doc["continuation"].strip()


def winogrande_doc_to_choice(doc) -> list[str]:
    return list(doc["context_options"])


def xsum_rouge(doc, results) -> dict:
    """ROUGE-1/2/L F1 (x100) of the generated summary against `summary_gt`, as the H2O authors report."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    prediction = results[0].split("###")[0].strip()
    scores = scorer.score(doc["summary_gt"], prediction)
    return {name: 100 * score.fmeasure for name, score in scores.items()}

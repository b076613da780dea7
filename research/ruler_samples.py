"""Write lm-eval's RULER documents as a `--log_samples`-shaped file without running a model, for
`research/ruler_probe.py` to read.

lm-eval builds each document for the model's own tokenizer (`--model`: an alias or folder; the embedded model by
default) at `--length` tokens, as `h2o lm-eval --tasks TASK --metadata '{"max_seq_lengths":[LENGTH]}'` does
(offline, under lm-eval's seeds: `research.ruler_cache.built_task`), and its requests give each
document's context and generation arguments. One JSON line a document: `doc_id`, `arguments`
(`gen_args_0`: `arg_0` the context, `arg_1` the generation arguments), `target`, and an empty `resps` (no model
answered it), written to `--out` (lm-eval prints its own notes on standard output).

    python -m research.ruler_samples niah_multivalue --length 32768 --docs 0-9 --out mv_32k_docs0_9.jsonl
"""

from __future__ import annotations

import argparse
import json


def doc_ids(spec: str) -> list[int]:
    """`0-9,20,22` as [0, 1, ..., 9, 20, 22]: each id once, in order (lm-eval reads the chosen documents so)."""
    ids: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        ids.update(range(int(first), int(last or first) + 1))
    return sorted(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", help="an lm-eval RULER task (niah_multivalue, ruler_vt, ...)")
    parser.add_argument("--length", type=int, default=32768, help="max_seq_lengths: the documents' tokens")
    parser.add_argument("--docs", default="0-9", help="document ids: ranges and single ids, comma-separated")
    parser.add_argument("--model", default=None, help="whose tokenizer sizes them (default: embedded)")
    parser.add_argument("--out", required=True, help="the samples file to write")
    args = parser.parse_args()

    from h2o_cli.models.presets import DEFAULT_MODEL
    from h2o_cli.models.sources import local_folder, resolve
    from research.ruler_cache import built_task

    tokenizer = str(local_folder(resolve(args.model or DEFAULT_MODEL)))
    ids = doc_ids(args.docs)
    task = built_task(args.task, {"max_seq_lengths": [args.length], "tokenizer": tokenizer}, samples=ids)
    # lm-eval numbers the chosen documents 0, 1, ... and logs each by its own id (`ids[number]`)
    with open(args.out, "w") as out:
        for instance in task.instances:
            context, gen_kwargs = instance.arguments
            row = {
                "doc_id": ids[instance.doc_id],
                "arguments": {"gen_args_0": {"arg_0": context, "arg_1": gen_kwargs}},
                "target": str(task.doc_to_target(instance.doc)),
                "resps": [[""]],
            }
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

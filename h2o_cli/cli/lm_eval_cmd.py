"""`h2o lm-eval ...`: lm-eval's own command line with the h2o model and tasks registered.

lm-eval 0.4.13 loads models only from modules it imports itself (not from an entry-point group), so
`lm_eval --model h2o` cannot find the model; this command imports it first, then hands over. lm-eval's own
models stay available (`h2o_cli.eval.lm_eval_model` lists them in lm-eval's registry before its own).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator

import typer

from h2o_cli.errors import UsageError

EXAMPLES = """
Examples:

  h2o lm-eval --model h2o --model_args model=smollm2-135m,budget=0.2,policy=h2o --tasks h2o_copa
  h2o lm-eval --model h2o --model_args budget=0.1,policy=sink --tasks h2o_piqa --limit 50
  h2o lm-eval --model hf --model_args pretrained=FOLDER --tasks h2o_copa   (lm-eval's own model)
  h2o lm-eval --model h2o --model_args policy=recall,budget=819 --tasks niah_single_1
      --metadata '{"max_seq_lengths":[16384]}' --limit 20   (RULER at 16K tokens, past the window)
  ... --use_cache runs/recall_16k   (each answer kept as it comes: the same command again resumes)
  torchrun --nproc_per_node 2 -m h2o_cli lm-eval --model h2o --tasks h2o_copa   (2 processes)
  accelerate launch --multi_gpu -m h2o_cli lm-eval --model h2o --tasks h2o_copa   (one per GPU)
  h2o lm-eval ls tasks
  h2o lm-eval run -h                  (lm-eval's own options)
"""


def lm_eval(ctx: typer.Context) -> None:
    """Run lm-eval's own command line with `--model h2o` and the h2o_* task YAMLs available.

    Every argument goes to lm-eval unchanged; `h2o lm-eval run -h` lists its options. lm-eval's own
    models (hf, vllm, ...) stay available beside h2o, for comparisons on the same tasks.

    Under torchrun or accelerate launch the documents are split over the processes.

    Added unless you give them: --include_path (the h2o task folder), --device auto; for lm-eval's RULER
    tasks with --model h2o, --metadata tokenizer=(the model's folder), which they generate documents with.
    When every task asked is an h2o_* task, lm-eval's own task folder is not indexed (~10 s saved).

    A policy that evicts on rolling positions (h2o, sink, tova, recall, ...) reads each context whole, past
    the model's window, its budget then a token count or a fraction of the window; `full` keeps the end of
    a longer context, as lm-eval's `hf` does, and says how many it cut. `recall` reads the last line of a
    context past the window as its question, as `h2o stream --prompt` reads one. RULER runs offline: its essay tasks
    read the data folder's Paul Graham essays ($H2O_DATA) when the Hub's are out of reach.

    Model args: model, device_map, budget, policy, heavy_ratio, sinks, positions, score_norm, chunk, kv_bits, quant.
    """
    try:
        from lm_eval.__main__ import cli_evaluate

        import h2o_cli.eval.lm_eval_model  # noqa: F401 - registers `--model h2o` with lm-eval
        from h2o_cli.eval.ruler import asked_tasks, prepare_offline, ruler_names
        from h2o_cli.eval.runner import TASKS_DIR
    except ImportError as error:
        raise UsageError(
            f"h2o lm-eval needs the eval extra (pip install 'h2o-cli[eval]'): {error}"
        ) from error
    args = list(ctx.args)
    own_only = False
    if not args or args[0] not in ("ls", "validate"):
        given = {arg.split("=")[0] for arg in args}
        if "--include_path" not in given:
            args += ["--include_path", str(TASKS_DIR)]
        if "--device" not in given:  # lm-eval's default is cuda:0; h2o picks CUDA when there is one
            args += ["--device", "auto"]
        if ruler_names() & set(asked_tasks(args)):
            args += ruler_tokenizer(args)
            prepare_offline(say=lambda line: typer.echo(line, err=True))
        asked = set(asked_tasks(args))
        own_only = bool(asked) and asked <= {path.stem for path in TASKS_DIR.glob("*.yaml")}
    sys.argv = ["lm_eval", *args]
    with own_tasks_only(own_only):
        cli_evaluate()


@contextlib.contextmanager
def own_tasks_only(active: bool) -> Iterator[None]:
    """While active, lm-eval's `TaskManager` indexes only the folders it is given (`--include_path`), not
    lm-eval's own task folder: ~14,000 YAML files, ~10 s at every start, none of which an h2o_* task needs
    (`h2o eval` builds its TaskManager the same way)."""
    import lm_eval.tasks

    own = lm_eval.tasks.TaskManager
    if not active:
        yield
        return

    class IncludedOnly(own):
        def __init__(self, *args, include_defaults: bool = False, **kwargs) -> None:
            super().__init__(*args, include_defaults=include_defaults, **kwargs)

    lm_eval.tasks.TaskManager = IncludedOnly
    try:
        yield
    finally:
        lm_eval.tasks.TaskManager = own


# The name lm-eval knows h2o's model by (`register_model` in h2o_cli/eval/lm_eval_model.py): not a policy's.
LM_EVAL_MODEL = "h2o"


def ruler_tokenizer(args: list[str]) -> list[str]:
    """`--metadata tokenizer=FOLDER` for `--model h2o` (its `model=` arg, or the embedded model) when neither
    the metadata nor the model args name a tokenizer: RULER sizes its documents with it, and looks for it
    under `tokenizer`, `pretrained` or `model` (which for h2o is an alias, not a folder)."""
    if value_of(args, "--model") != LM_EVAL_MODEL or any(
        ("tokenizer" in a or "pretrained=" in a) for a in args
    ):
        return []
    from h2o_cli.models.presets import DEFAULT_MODEL
    from h2o_cli.models.sources import local_folder, resolve

    model_args = dict(part.split("=", 1) for part in value_of(args, "--model_args").split(",") if "=" in part)
    return ["--metadata", f"tokenizer={local_folder(resolve(model_args.get('model', DEFAULT_MODEL)))}"]


def value_of(args: list[str], option: str) -> str:
    """The value of `option` in lm-eval arguments (`--option value` or `--option=value`), else ""."""
    for number, arg in enumerate(args):
        if arg == option and number + 1 < len(args):
            return args[number + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return ""


lm_eval.__doc__ = inspect.cleandoc(lm_eval.__doc__ or "") + "\n" + EXAMPLES

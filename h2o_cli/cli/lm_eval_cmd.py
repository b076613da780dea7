"""`h2o lm-eval ...`: lm-eval's own command line with the h2o model and tasks registered.

lm-eval 0.4.13 loads models only from modules it imports itself (not from an entry-point group), so
`lm_eval --model h2o` cannot find the model; this command imports it first, then hands over. lm-eval's own
models stay available (`h2o_cli.eval.lm_eval_model` lists them in lm-eval's registry before its own).
"""

from __future__ import annotations

import inspect
import sys

import typer

from h2o_cli.errors import UsageError

EXAMPLES = """
Examples:

  h2o lm-eval --model h2o --model_args model=smollm2-135m,budget=0.2,policy=h2o --tasks h2o_copa
  h2o lm-eval --model h2o --model_args budget=0.1,policy=sink --tasks h2o_piqa --limit 50
  h2o lm-eval --model hf --model_args pretrained=FOLDER --tasks h2o_copa   (lm-eval's own model)
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

    Added unless you give them: --include_path (the h2o task folder), --device auto.

    Model args: model, device_map, budget, policy, heavy_ratio, sinks, positions, score_norm, chunk, kv_bits, quant.
    """
    try:
        from lm_eval.__main__ import cli_evaluate

        import h2o_cli.eval.lm_eval_model  # noqa: F401 - registers `--model h2o` with lm-eval
        from h2o_cli.eval.runner import TASKS_DIR
    except ImportError as error:
        raise UsageError(
            f"h2o lm-eval needs the eval extra (pip install 'h2o-cli[eval]'): {error}"
        ) from error
    args = list(ctx.args)
    if not args or args[0] not in ("ls", "validate"):
        given = {arg.split("=")[0] for arg in args}
        if "--include_path" not in given:
            args += ["--include_path", str(TASKS_DIR)]
        if "--device" not in given:  # lm-eval's default is cuda:0; h2o picks CUDA when there is one
            args += ["--device", "auto"]
    sys.argv = ["lm_eval", *args]
    cli_evaluate()


lm_eval.__doc__ = inspect.cleandoc(lm_eval.__doc__ or "") + "\n" + EXAMPLES

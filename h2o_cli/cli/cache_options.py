"""The options of the cache's own settings (budget, policy, positions, chunk, the h2o variants, K/V bits,
kernels), and the help panels every option of every command sits in.

`--help` shows a command's own options first, then one panel per concern in `PANELS` order: recall's
tuning knobs (h2o_cli.cli.recall_options) last; docs/recall.md gives the measurement behind each default.
"""

from __future__ import annotations

from typing import Annotated

import typer

from h2o_cli.config import KERNELS, POSITIONS
from h2o_cli.policies import policy_names
from h2o_cli.policies.h2o import SCORE_NORMS

POLICIES = policy_names()

CACHE = "Cache"
MODEL = "Model"
OUTPUT = "Output"
POLICY_TUNING = "h2o, sink and tova"
MEMORY = "Memory"
SPEED = "Speed / kernels"
ADVANCED_RECALL = "Advanced recall"
# --help's panels after the command's own options, in this order.
PANELS = (CACHE, MODEL, OUTPUT, POLICY_TUNING, MEMORY, SPEED, ADVANCED_RECALL)


def choice(name: str, choices):
    """A callback accepting one of `choices` (a tuple, or a function giving it when the option is used)."""

    def check(value: str) -> str:
        allowed = choices() if callable(choices) else choices
        if value not in allowed:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(allowed)}")
        return value

    check.__name__ = f"check_{name}"
    return check


Budget = Annotated[
    str,
    typer.Option(
        "--budget",
        "-b",
        help="Tokens kept per KV head: a fraction (0,1] of the context window, or a count > 1.",
        rich_help_panel=CACHE,
    ),
]
PromptBudget = Annotated[
    str,
    typer.Option(
        "--budget",
        "-b",
        help="Tokens kept per KV head: a fraction (0,1] of each prompt, or a count > 1.",
        rich_help_panel=CACHE,
    ),
]
Policy = Annotated[
    str,
    typer.Option(
        "--policy",
        "-p",
        help=f"Eviction policy: {', '.join(POLICIES)}.",
        callback=choice("policy", policy_names),
        rich_help_panel=CACHE,
    ),
]
HeavyRatio = Annotated[
    float,
    typer.Option(
        "--heavy-ratio",
        min=0.0,
        max=1.0,
        help="Share of the budget for heavy hitters (h2o, tova).",
        rich_help_panel=POLICY_TUNING,
    ),
]
Sinks = Annotated[
    int,
    typer.Option(
        "--sinks", min=0, help="Attention-sink tokens kept by --policy sink.", rich_help_panel=POLICY_TUNING
    ),
]
Positions = Annotated[
    str,
    typer.Option(
        "--positions",
        help="rolling (any length) or original (exact, within the context window).",
        callback=choice("positions", POSITIONS),
        rich_help_panel=CACHE,
    ),
]
ScoreNorm = Annotated[
    str,
    typer.Option(
        "--score-norm",
        help="h2o scores: sum (the paper) or mean (per query that saw the token).",
        callback=choice("score-norm", SCORE_NORMS),
        rich_help_panel=POLICY_TUNING,
    ),
]
ScoreDecay = Annotated[
    float,
    typer.Option(
        "--score-decay",
        min=0.0,
        max=1.0,
        help="h2o scores forget: each query token multiplies them by this before adding (1 = the paper).",
        rich_help_panel=POLICY_TUNING,
    ),
]
H2OSinks = Annotated[
    int,
    typer.Option(
        "--h2o-sinks",
        min=0,
        help="h2o: keep the first N tokens in heavy slots (0 = the paper).",
        rich_help_panel=POLICY_TUNING,
    ),
]
Chunk = Annotated[
    int,
    typer.Option(
        "--chunk",
        min=1,
        help="Tokens per forward pass (1 = token by token). With rolling positions, budget + chunk must fit in "
        "the context window: otherwise the command stops with a usage error naming the largest chunk that fits.",
        rich_help_panel=CACHE,
    ),
]


def check_kv_bits(value: int | None) -> int | None:
    if value is not None and value not in (16, 8):
        raise typer.BadParameter(f"{value} is not 16 or 8")
    return value


KvBits = Annotated[
    int | None,
    typer.Option(
        "--kv-bits",
        help="K/V cache storage: 16 (fp16/bf16) or 8 (int8, per-token scales); default: the model dtype.",
        callback=check_kv_bits,
        rich_help_panel=MEMORY,
    ),
]
Kernels = Annotated[
    str,
    typer.Option(
        "--kernels",
        help="Attention code: torch, triton (CUDA kernels, opt-in), native (the CPU decode step, and a bf16 read's rotations and "
        "softmax, as C functions built on first use) or auto (native on a CPU with a C compiler, else torch; $H2O_KERNELS). "
        "A failing kernel falls back to torch with one warning.",
        callback=choice("kernels", KERNELS),
        rich_help_panel=SPEED,
    ),
]
DecodeThreads = Annotated[
    str,
    typer.Option(
        "--decode-threads",
        help="torch threads of a decode step: a count, or auto (time one thread against torch's count on the "
        "first steps and keep the faster; re-timed every 64 steps). Prefill chunks use --threads.",
        rich_help_panel=SPEED,
    ),
]

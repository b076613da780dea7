"""Options shared by several commands, declared once, each in its help panel (`PANELS`).

Cache options map one-to-one onto `CacheSettings` fields (`CACHE_OPTIONS`; declared in
h2o_cli.cli.cache_options and h2o_cli.cli.recall_options); a command decorated with `cache_options` gets all
of them and receives one `settings: CacheSettings`. A new cache flag is one field in `CacheSettings` and one
line in `CACHE_OPTIONS`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path
from typing import Annotated

import typer

from h2o_cli.cli import cache_options as cache
from h2o_cli.cli import recall_options as recall
from h2o_cli.cli.cache_options import MODEL, OUTPUT, PANELS, SPEED
from h2o_cli.cli.cache_options import choice as _choice
from h2o_cli.config import CacheSettings
from h2o_cli.eval.data import DATA_ENV
from h2o_cli.models import DEFAULT_MODEL, QUANTS
from h2o_cli.policies import policy_names


def __getattr__(name: str):
    """Every cache and recall option is named here too (`opt.Budget`, `opt.RecallLead`), so a command
    imports one module."""
    for module in (cache, recall):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


Model = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="Alias (see `h2o models`), hub id, local folder or .gguf file.",
        rich_help_panel=MODEL,
    ),
]
Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.", rich_help_panel=MODEL)]
DeviceMap = Annotated[
    str | None,
    typer.Option(
        "--device-map",
        help="Split the model over devices with accelerate: auto, balanced, or a JSON file of module -> device "
        '("cuda:0", "cpu", "disk"). Each layer\'s cache lives on its layer\'s device. Overrides --device.',
        rich_help_panel=MODEL,
    ),
]
Dtype = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="auto: bf16 on GPU; on a CPU fp32 weights, and where it multiplies bf16 natively (AVX512_BF16/AMX) "
        "reads (calls of 16+ tokens) in bf16 against a bf16 copy of the weights (+50 % weight memory); "
        "float32 (everything fp32), bfloat16, float16.",
        rich_help_panel=MODEL,
    ),
]
Threads = Annotated[
    int,
    typer.Option(
        "--threads", min=0, help="CPU threads for torch (0 = torch's default).", rich_help_panel=SPEED
    ),
]
TrustRemoteCode = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        help="Allow a hub model's own Python code (off by default).",
        rich_help_panel=MODEL,
    ),
]
Quant = Annotated[
    str,
    typer.Option(
        "--quant",
        help="Weights: none, 8bit (LLM.int8) or 4bit (nf4), via bitsandbytes (CPU and CUDA).",
        callback=_choice("quant", QUANTS),
        rich_help_panel=MODEL,
    ),
]


Compile = Annotated[
    bool,
    typer.Option(
        "--compile",
        help="Capture the one-token forward with the cache once (torch.compile: inductor, on CUDA as a CUDA "
        "graph) and replay it. The first token waits for the compilation (minutes on a CPU); on a CPU it "
        "decodes about as fast as the default C step (docs/benchmarks.md).",
        rich_help_panel=SPEED,
    ),
]
Json = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on stdout.", rich_help_panel=OUTPUT)
]
DataDir = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        envvar=DATA_ENV,
        file_okay=False,
        help="Folder of the shared task files and books (default: $H2O_DATA).",
    ),
]
MaxNewTokens = Annotated[
    int,
    typer.Option("--max-new-tokens", "-n", min=0, help="Most tokens to generate.", rich_help_panel=OUTPUT),
]
Temperature = Annotated[
    float,
    typer.Option(
        "--temperature", "-t", min=0.0, help="Sampling temperature; 0 = greedy.", rich_help_panel=OUTPUT
    ),
]
TopP = Annotated[
    float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.", rich_help_panel=OUTPUT)
]
Seed = Annotated[int | None, typer.Option("--seed", help="Random seed for sampling.", rich_help_panel=OUTPUT)]


# One option per CacheSettings field, in CacheSettings' order (--help orders them by panel).
CACHE_OPTIONS = {
    "budget": cache.Budget,
    "policy": cache.Policy,
    "heavy_ratio": cache.HeavyRatio,
    "sinks": cache.Sinks,
    "positions": cache.Positions,
    "score_norm": cache.ScoreNorm,
    "score_decay": cache.ScoreDecay,
    "h2o_sinks": cache.H2OSinks,
    "chunk": cache.Chunk,
    "kv_bits": cache.KvBits,
    "recall_ratio": recall.RecallRatio,
    "page_size": recall.PageSize,
    "block_size": recall.BlockSize,
    "shortlist": recall.Shortlist,
    "step_shortlist": recall.StepShortlist,
    "page_carry": recall.PageCarry,
    "chunk_weight": recall.ChunkWeight,
    "choice_tokens": recall.ChoiceTokens,
    "recall_place": recall.RecallPlace,
    "recall_layers": recall.RecallLayers,
    "recall_lead": recall.RecallLead,
    "lead_pages": recall.LeadPages,
    "lead_next": recall.LeadNext,
    "lead_outliers": recall.LeadOutliers,
    "lead_text": recall.LeadText,
    "page_score": recall.PageScore,
    "archive_max": recall.ArchiveMax,
    "archive": recall.Archive,
    "archive_bits": recall.ArchiveBits,
    "keep_archive": recall.KeepArchive,
    "kernels": cache.Kernels,
    "decode_threads": cache.DecodeThreads,
}


def panel_of(annotation) -> str | None:
    """The help panel of a parameter's `Annotated[..., typer.Option(...)]`; None: the command's own panel."""
    for info in getattr(annotation, "__metadata__", ()):
        return getattr(info, "rich_help_panel", None)
    return None


def by_panel(parameters: list[inspect.Parameter]) -> list[inspect.Parameter]:
    """`parameters` as keyword-only, ordered by panel (typer prints panels in the order it first meets
    them): the command's own first, then `PANELS`' order; the order inside a panel is kept."""
    rank = {name: place for place, name in enumerate(PANELS, start=1)}
    ordered = sorted(parameters, key=lambda param: rank.get(panel_of(param.annotation), 0))
    return [param.replace(kind=inspect.Parameter.KEYWORD_ONLY) for param in ordered]


def cache_options(skip: tuple[str, ...] = (), options: dict | None = None, **defaults):
    """Decorate a command with one option per `CacheSettings` field; it receives `settings: CacheSettings`
    (budget not yet resolved) instead of them.

    skip: fields the command does not offer (set from `defaults`, else their `CacheSettings` defaults);
    options: a different option for a field (e.g. `PromptBudget`); defaults: a different default for a field.
    """
    fields = {field.name: field for field in dataclasses.fields(CacheSettings)}
    assert set(CACHE_OPTIONS) == set(fields), "every CacheSettings field needs exactly one option"
    chosen = {name: {**CACHE_OPTIONS, **(options or {})}[name] for name in CACHE_OPTIONS if name not in skip}

    missing = [
        name for name in fields if name not in defaults and fields[name].default is dataclasses.MISSING
    ]
    assert not missing, f"give a default for {missing}"
    fixed = {name: defaults[name] for name in skip if name in defaults}  # skipped fields set by the command

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        own = [param for param in signature.parameters.values() if param.name != "settings"]
        added = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=annotation,
                default=defaults[name] if name in defaults else fields[name].default,
            )
            for name, annotation in chosen.items()
        ]

        @functools.wraps(command)
        def run(**values):
            settings = CacheSettings(**fixed, **{name: values.pop(name) for name in chosen})
            return command(settings=settings, **values)

        parameters = by_panel(own + added)
        run.__signature__ = signature.replace(parameters=parameters)
        run.__annotations__ = {param.name: param.annotation for param in parameters}
        del run.__wrapped__  # typer must read the new signature, not the command's
        return run

    return decorate


DEFAULTS = {"model": DEFAULT_MODEL, "budget": "0.1", "chunk": 256}


def parse_policies(value: str) -> list[str]:
    """The policies of a comma-separated `--policies` value; a usage error names an unknown one."""
    from h2o_cli.errors import UsageError

    chosen = [name.strip() for name in value.split(",") if name.strip()]
    for name in chosen:
        if name not in policy_names():
            raise UsageError(f"--policies: {name!r} is not one of {', '.join(policy_names())}")
    return chosen

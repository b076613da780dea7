"""Options shared by several commands, declared once.

Cache options map one-to-one onto `CacheSettings` fields (`CACHE_OPTIONS`); a command decorated with
`cache_options` gets all of them and receives one `settings: CacheSettings`. A new cache flag is one field
in `CacheSettings` and one line in `CACHE_OPTIONS`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path
from typing import Annotated

import typer

from h2o_cli.config import KERNELS, POSITIONS, CacheSettings
from h2o_cli.eval.data import DATA_ENV
from h2o_cli.models import DEFAULT_MODEL, QUANTS
from h2o_cli.policies import policy_names
from h2o_cli.policies.h2o import SCORE_NORMS

POLICIES = policy_names()


def _choice(name: str, choices):
    """A callback accepting one of `choices` (a tuple, or a function giving it when the option is used)."""

    def check(value: str) -> str:
        allowed = choices() if callable(choices) else choices
        if value not in allowed:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(allowed)}")
        return value

    check.__name__ = f"check_{name}"
    return check


Model = Annotated[
    str,
    typer.Option("--model", "-m", help="Alias (see `h2o models`), hub id, local folder or .gguf file."),
]
Budget = Annotated[
    str,
    typer.Option(
        "--budget",
        "-b",
        help="Tokens kept per KV head: a fraction (0,1] of the context window, or a count > 1.",
    ),
]
PromptBudget = Annotated[
    str,
    typer.Option(
        "--budget", "-b", help="Tokens kept per KV head: a fraction (0,1] of each prompt, or a count > 1."
    ),
]
Policy = Annotated[
    str,
    typer.Option(
        "--policy",
        "-p",
        help=f"Eviction policy: {', '.join(POLICIES)}.",
        callback=_choice("policy", policy_names),
    ),
]
HeavyRatio = Annotated[
    float,
    typer.Option(
        "--heavy-ratio", min=0.0, max=1.0, help="Share of the budget for heavy hitters (h2o, tova)."
    ),
]
Sinks = Annotated[int, typer.Option("--sinks", min=0, help="Attention-sink tokens kept by --policy sink.")]
Positions = Annotated[
    str,
    typer.Option(
        "--positions",
        help="rolling (any length) or original (exact, within the context window).",
        callback=_choice("positions", POSITIONS),
    ),
]
ScoreNorm = Annotated[
    str,
    typer.Option(
        "--score-norm",
        help="h2o scores: sum (the paper) or mean (per query that saw the token).",
        callback=_choice("score-norm", SCORE_NORMS),
    ),
]
ScoreDecay = Annotated[
    float,
    typer.Option(
        "--score-decay",
        min=0.0,
        max=1.0,
        help="h2o scores forget: each query token multiplies them by this before adding (1 = the paper).",
    ),
]
H2OSinks = Annotated[
    int,
    typer.Option("--h2o-sinks", min=0, help="h2o: keep the first N tokens in heavy slots (0 = the paper)."),
]
Chunk = Annotated[
    int,
    typer.Option(
        "--chunk",
        min=1,
        help="Tokens per forward pass (1 = token by token). With rolling positions, budget + chunk must fit in "
        "the context window: otherwise the command stops with a usage error naming the largest chunk that fits.",
    ),
]
Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
DeviceMap = Annotated[
    str | None,
    typer.Option(
        "--device-map",
        help="Split the model over devices with accelerate: auto, balanced, or a JSON file of module -> device "
        '("cuda:0", "cpu", "disk"). Each layer\'s cache lives on its layer\'s device. Overrides --device.',
    ),
]
Dtype = Annotated[
    str, typer.Option("--dtype", help="auto (fp32 on CPU, bf16 on GPU), float32, bfloat16, float16.")
]
Threads = Annotated[
    int, typer.Option("--threads", min=0, help="CPU threads for torch (0 = torch's default).")
]
TrustRemoteCode = Annotated[
    bool, typer.Option("--trust-remote-code", help="Allow a hub model's own Python code (off by default).")
]
Quant = Annotated[
    str,
    typer.Option(
        "--quant",
        help="Weights: none, 8bit (LLM.int8) or 4bit (nf4), via bitsandbytes (CPU and CUDA).",
        callback=_choice("quant", QUANTS),
    ),
]


def _kv_bits(value: int | None) -> int | None:
    if value is not None and value not in (16, 8):
        raise typer.BadParameter(f"{value} is not 16 or 8")
    return value


KvBits = Annotated[
    int | None,
    typer.Option(
        "--kv-bits",
        help="K/V cache storage: 16 (fp16/bf16) or 8 (int8, per-token scales); default: the model dtype.",
        callback=_kv_bits,
    ),
]
RecallRatio = Annotated[
    float,
    typer.Option("--recall-ratio", help="recall: share of the budget refilled from the archive every step."),
]
PageSize = Annotated[
    int,
    typer.Option("--page-size", help="recall: tokens per archive page, the span a recall reads back whole."),
]
BlockSize = Annotated[
    int | None,
    typer.Option(
        "--block-size",
        help="recall: tokens per key summary inside a page (divides --page-size; default: 4, or the page when 4 "
        "does not divide it). A page's bound is its best block's.",
    ),
]
Shortlist = Annotated[
    int,
    typer.Option(
        "--shortlist",
        help="recall, --page-score attention: a chunk scores only the K pages whose key summaries bound "
        "highest, an answer step (with --page-carry) the K its carried scores rank highest; a question scores "
        "every page; 0 scores every page always.",
    ),
]
StepShortlist = Annotated[
    int,
    typer.Option(
        "--step-shortlist",
        help="recall, --page-carry: an answer step scores only the K pages its carried scores rank highest "
        "(0: --shortlist's K). A step's cost grows with K.",
    ),
]
PageCarry = Annotated[
    float,
    typer.Option(
        "--page-carry",
        help="recall, --page-score attention: share of a page's last score added to its next, so a page the "
        "question found stays while the answer is written (0: every step scores afresh).",
    ),
]
ChunkWeight = Annotated[
    float,
    typer.Option(
        "--chunk-weight",
        help="recall, --page-carry: a chunk of c > 1 tokens (a question, a chat turn) starts the carried page "
        "scores weighing min(c, N) answer steps, so what the question found outlasts the answer's first words "
        "(1: one step).",
    ),
]
RecallPlace = Annotated[
    str,
    typer.Option(
        "--recall-place",
        help="recall, rolling positions: where recalled tokens sit among the resident ones: ranked by token "
        "index (index), or as one block in token order between the older resident tokens and the recent "
        "window (contiguous, as ReAttention places its spans).",
    ),
]
RecallLayers = Annotated[
    str,
    typer.Option(
        "--recall-layers",
        help="recall: the layers that recall, numbered from 0 (e.g. 6,17,18,20-23; default all). The others "
        "keep only their resident tokens, with no archive: less RAM and a faster step, but on the embedded "
        "model fewer pass keys found (docs/results.md).",
    ),
]
RecallLead = Annotated[
    str,
    typer.Option(
        "--recall-lead",
        help="recall: after a question (stream --prompt), every head recalls only the pages one retrieval head "
        "ranks best, and the question is read twice so the layers before it have its ranking: LAYER.HEAD "
        "(from 0), auto (the model's calibrated head, 18.2 for the embedded model; none for a model without "
        "one), or none (each head's own choice). Past the window it finds pass keys each head's own choice "
        "misses (docs/results.md).",
    ),
]
LeadPages = Annotated[
    int,
    typer.Option(
        "--lead-pages",
        help="recall, --recall-lead: how many of the lead head's best pages every head recalls (at most "
        "--recall-ratio of the budget in tokens).",
    ),
]
LeadText = Annotated[
    bool,
    typer.Option(
        "--lead-text/--no-lead-text",
        help="recall, --recall-lead: chunks of text too recall the lead head's best pages (until every head's "
        "recall slots are full) in every layer but the lead's, instead of each head's own choice: only one layer scores "
        "pages while text is read (on by default; off in chat, where each head's own choice remembered more).",
    ),
]
ChoiceTokens = Annotated[
    int,
    typer.Option(
        "--choice-tokens",
        help="recall: a chunk of text chooses what it recalls with at most N of its tokens' queries, evenly "
        "spaced (0: every token; a question's tokens always all choose). Fewer read faster; perplexity "
        "measured in docs/results.md.",
    ),
]
PageScore = Annotated[
    str,
    typer.Option(
        "--page-score",
        help="recall: rank pages by the attention the queries put on them over every archived key (attention), "
        "by the bound of their key summaries with the query rotated over the distances recalled keys take "
        "(positional), or with the query unrotated (Quest's).",
    ),
]
ArchiveMax = Annotated[
    str,
    typer.Option(
        "--archive-max",
        help="recall: what the archive keeps, in tokens (131072) or bytes (64MiB, 1GiB); older pages are dropped.",
    ),
]
Archive = Annotated[
    str,
    typer.Option(
        "--archive",
        help="recall: where archived K/V live: auto (RAM when the whole archive fits in 1 GiB, else disk; on a GPU "
        "its memory), ram, disk (a file in $H2O_HOME/archive/, memory-mapped and not kept resident; CPU only), "
        "or a file or folder PATH. The file is removed at exit.",
    ),
]
ArchiveBits = Annotated[
    int | None,
    typer.Option(
        "--archive-bits",
        help="recall: archived K/V as 16-bit or 8 (int8, per-token scales); default: the model dtype.",
        callback=_kv_bits,
    ),
]
KeepArchive = Annotated[
    bool, typer.Option("--keep-archive", help="recall: leave the archive's file in place at exit.")
]
Kernels = Annotated[
    str,
    typer.Option(
        "--kernels",
        help="Attention code: torch, triton (CUDA kernels, opt-in), native (the CPU decode step as one C function, "
        "built on first use) or auto (native on a CPU with a C compiler, else torch; $H2O_KERNELS). "
        "A failing kernel falls back to torch with one warning.",
        callback=_choice("kernels", KERNELS),
    ),
]
DecodeThreads = Annotated[
    str,
    typer.Option(
        "--decode-threads",
        help="torch threads of a decode step: a count, or auto (time one thread against torch's count on the "
        "first steps and keep the faster; re-timed every 64 steps). Prefill chunks use --threads.",
    ),
]
Compile = Annotated[
    bool,
    typer.Option(
        "--compile",
        help="Capture the one-token forward with the cache once (torch.compile: inductor, on CUDA as a CUDA "
        "graph) and replay it. The first token waits for the compilation (minutes on a CPU); on a CPU it "
        "decodes about as fast as the default C step (docs/benchmarks.md).",
    ),
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
DataDir = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        envvar=DATA_ENV,
        file_okay=False,
        help="Folder of the shared task files and books (default: $H2O_DATA).",
    ),
]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", "-n", min=0, help="Most tokens to generate.")]
Temperature = Annotated[
    float, typer.Option("--temperature", "-t", min=0.0, help="Sampling temperature; 0 = greedy.")
]
TopP = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.")]
Seed = Annotated[int | None, typer.Option("--seed", help="Random seed for sampling.")]

DEFAULTS = {"model": DEFAULT_MODEL, "budget": "0.1", "chunk": 256}

# One option per CacheSettings field, in --help order.
CACHE_OPTIONS = {
    "budget": Budget,
    "policy": Policy,
    "heavy_ratio": HeavyRatio,
    "sinks": Sinks,
    "positions": Positions,
    "score_norm": ScoreNorm,
    "score_decay": ScoreDecay,
    "h2o_sinks": H2OSinks,
    "chunk": Chunk,
    "kv_bits": KvBits,
    "recall_ratio": RecallRatio,
    "page_size": PageSize,
    "block_size": BlockSize,
    "shortlist": Shortlist,
    "step_shortlist": StepShortlist,
    "page_carry": PageCarry,
    "chunk_weight": ChunkWeight,
    "choice_tokens": ChoiceTokens,
    "recall_place": RecallPlace,
    "recall_layers": RecallLayers,
    "recall_lead": RecallLead,
    "lead_pages": LeadPages,
    "lead_text": LeadText,
    "page_score": PageScore,
    "archive_max": ArchiveMax,
    "archive": Archive,
    "archive_bits": ArchiveBits,
    "keep_archive": KeepArchive,
    "kernels": Kernels,
    "decode_threads": DecodeThreads,
}


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

        run.__signature__ = signature.replace(parameters=own + added)
        run.__annotations__ = {param.name: param.annotation for param in own + added}
        del run.__wrapped__  # typer must read the new signature, not the command's
        return run

    return decorate


def parse_policies(value: str) -> list[str]:
    """The policies of a comma-separated `--policies` value; a usage error names an unknown one."""
    from h2o_cli.errors import UsageError

    chosen = [name.strip() for name in value.split(",") if name.strip()]
    for name in chosen:
        if name not in policy_names():
            raise UsageError(f"--policies: {name!r} is not one of {', '.join(policy_names())}")
    return chosen

"""Cache settings as plain data, and the one budget rule of SPEC.md.

`CacheSettings` is the only list of cache settings: the CLI declares one option per field
(`h2o_cli.cli.options.CACHE_OPTIONS`), the lm-eval model takes the same names as model args, and every
command, the eval harness and the library build a cache from it. What a policy name means (its slot split,
positions, parameter checks) is decided in `h2o_cli/policies/`, never here: the settings reach a policy by
its name through `h2o_cli.policy_registry`, and import no policy module.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, fields, replace

from h2o_cli.cache.recall.limits import (
    DEFAULT_ARCHIVE_MAX,
    archive_cap,
    check_recall_options,
    lead_page_count,
)
from h2o_cli.errors import UsageError
from h2o_cli.policy_registry import make_policy, policy_class, policy_names

POSITIONS = ("rolling", "original")
KV_BITS = (None, 16, 8)
KERNELS = ("auto", "torch", "triton", "native")  # h2o_kernels.dispatch.KERNELS (a test checks they agree)


def budget_value(value: str | float) -> int | float:
    """`--budget` checked but not yet resolved: a fraction in (0, 1] (a float) or a token count > 1 (an int)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value  # a count; CacheSettings checks it is at least 2
    try:
        budget = float(value)
    except (TypeError, ValueError):
        raise UsageError(
            f"--budget {value!r} is not a number; give a fraction like 0.1 or a token count like 512"
        ) from None
    if math.isnan(budget) or math.isinf(budget) or budget <= 0:
        raise UsageError(f"--budget {value} must be > 0: a fraction in (0, 1] or a token count > 1")
    if budget <= 1:
        return budget
    if budget != int(budget):
        raise UsageError(f"--budget {value} above 1 must be a whole token count, e.g. {int(budget)}")
    return int(budget)


def parse_budget(value: str | float, window: int, floor: bool = False) -> int:
    """The budget rule (SPEC.md): `--budget` as a token count `k`, a fraction being of `window` tokens.

    `window` is the model's context window for `chat`/`stream`, each prompt for `eval`, the tokens read for
    `compare`. A fraction that rounds below 2 tokens is an error, or 2 with `floor` (eval and compare, where
    one short example is not the user's mistake).
    """
    budget = budget_value(value)
    if isinstance(budget, int):
        return budget
    tokens = round(budget * window)
    if tokens < 2:
        if floor:
            return 2
        raise UsageError(
            f"--budget {value} is {tokens} token(s) of a {window}-token context; "
            "give a larger fraction or a token count of at least 2"
        )
    return tokens


def check_decode_threads(setting: str) -> None:
    """`--decode-threads`: `auto` or a thread count >= 1 (h2o_cli.cache.threads)."""
    if setting != "auto" and not (setting.isdigit() and int(setting) >= 1):
        raise UsageError(f"--decode-threads {setting!r}: give auto or a thread count of at least 1")


@dataclass(frozen=True)
class CacheSettings:
    """What a cache keeps. `budget`: the tokens `k` each KV head keeps after every step — a count (an int),
    or a fraction (a float <= 1, or any `--budget` string) still to be resolved against a window by `resolved`.

    `chunk` is the most tokens one forward call adds; the slot buffers hold `budget + chunk` entries so a
    chunk never reallocates.
    """

    budget: int | float | str
    policy: str = "h2o"
    heavy_ratio: float = 0.5
    sinks: int = 4
    positions: str = "rolling"
    score_norm: str = "sum"
    score_decay: float = 1.0  # h2o: γ per query token (1 = the paper's sum)
    h2o_sinks: int = 0  # h2o: the first tokens of the stream, kept in heavy slots whatever their score
    chunk: int = 256
    kv_bits: int | None = None  # None: K/V in the model's dtype; 16: fp16/bf16; 8: int8 + per-token scales
    recall_ratio: float = 0.75  # recall: share of the budget refilled from the archive at every step
    page_size: int = 16  # recall: tokens per archive page (what a recall reads back whole)
    block_size: int | None = None  # recall: tokens per key summary inside a page (None: 4, or the page)
    shortlist: int = 512  # recall, --page-score attention: pages a chunk (by summaries) or a step (by carried score) scores
    step_shortlist: int = 0  # recall, --page-carry: pages an answer step scores (0: --shortlist)
    page_carry: float = 0.9  # recall, --page-score attention: share of a page's last score added to the next
    chunk_weight: float = (
        8.0  # recall, --page-carry: one-token steps a chunk of c > 1 tokens weighs (at most c)
    )
    choice_tokens: int = 32  # recall: a chunk of text chooses with at most this many of its tokens (0: all)
    recall_place: str = (
        "index"  # recall, rolling: R ranked among S by token index, or in one block (contiguous)
    )
    recall_layers: str = "all"  # recall: the layers that recall (e.g. 6,17,18,20-23); the others keep S alone
    recall_lead: str = "auto"  # recall: after a question, every head recalls one head's best pages
    lead_pages: int | str = 8  # recall, --recall-lead: the lead head's best pages each head recalls, or fill
    lead_next: int = 1  # recall, --recall-lead: pages after each of them that come too (a cut line's rest)
    lead_outliers: float = 100.0  # recall, --recall-lead: pages scoring this x the median come too (0: off)
    lead_text: bool = True  # recall, --recall-lead: text recalls the lead's best pages too (chat: off)
    page_score: str = "attention"  # recall: pages ranked by the attention they get, or by summary bounds (positional, unrotated)
    archive_max: int | str = (
        DEFAULT_ARCHIVE_MAX  # recall: tokens (1048576 on disk) or bytes ("64MiB") the archive reaches back
    )
    archive: str = (
        "auto"  # recall: where archived K/V live: auto (ram up to 2 GiB, else disk), ram, disk, or a path
    )
    archive_bits: int | None = (
        None  # recall: archived K/V as --kv-bits: None (model dtype), 16, 8 (int8 + scales)
    )
    keep_archive: bool = False  # recall: leave the archive's file in place at exit
    kernels: str = (
        "auto"  # torch, triton (CUDA, opt-in), native (the CPU's C decode step), auto ($H2O_KERNELS)
    )
    decode_threads: str = (
        "auto"  # torch threads of a decode step: a count, or auto (h2o_cli.cache.threads measures)
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", budget_value(self.budget))
        if self.kv_bits not in KV_BITS:
            raise UsageError(
                f"--kv-bits {self.kv_bits} is not supported; choose 16 or 8 (or omit for the model dtype)"
            )
        policy_class(self.policy)
        if self.kernels not in KERNELS:
            raise UsageError(f"--kernels {self.kernels!r} is unknown; choose {', '.join(KERNELS)}")
        if self.positions not in POSITIONS:
            raise UsageError(f"--positions {self.positions!r} is unknown; choose rolling or original")
        check_decode_threads(self.decode_threads)
        if self.chunk < 1:
            raise UsageError(f"--chunk {self.chunk} must be at least 1")
        count, unit = archive_cap(self.archive_max)
        if unit == "tokens":  # "16384" from the command line is the token count 16384
            object.__setattr__(self, "archive_max", count)
        pages = lead_page_count(self.lead_pages)  # "8" from the command line is 8 pages, "fill" stays
        object.__setattr__(self, "lead_pages", "fill" if pages is None else pages)
        check_recall_options(
            self.recall_ratio,
            self.page_size,
            self.archive_max,
            self.archive,
            self.archive_bits,
            self.page_score,
            self.block_size,
            self.shortlist,
            self.page_carry,
            self.chunk_weight,
            self.choice_tokens,
            self.step_shortlist,
            self.recall_place,
            self.recall_layers,
            self.recall_lead,
            self.lead_pages,
            self.lead_next,
            self.lead_outliers,
        )
        if self.is_resolved:
            make_policy(self)  # the policy checks its own parameters (budget, split, sinks, ...)

    @classmethod
    def from_args(cls, **args) -> CacheSettings:
        """From string values (lm-eval's `--model_args budget=0.2,policy=h2o`); names that are not fields are
        left out."""
        types = typing.get_type_hints(cls)
        values = {}
        for field in fields(cls):
            value = args.get(field.name)
            if value is None or str(value).lower() in ("", "none"):
                continue
            kind = types[field.name]
            if kind in (int, float, int | None):  # a union with str (budget, archive_max, ...) stays as given
                value = float(value) if kind is float else int(value)
            elif kind is bool and isinstance(value, str):
                value = value.strip().lower() in ("1", "true", "yes", "on")
            values[field.name] = value
        return cls(**values)

    @classmethod
    def from_spec(cls, spec: str, **fields_given) -> CacheSettings:
        """From a run spec `POLICY[:FIELD=VALUE,...]` (`parse_run_spec`), with `fields_given` (e.g. `budget`,
        `chunk`) added: `CacheSettings.from_spec("recall:lead_text=0", budget=819, chunk=256)`."""
        name, values = parse_run_spec(spec)
        return cls.from_args(**values, **fields_given, policy=name)

    @property
    def is_resolved(self) -> bool:
        """Whether `budget` is a token count (not a fraction still to be resolved)."""
        return isinstance(self.budget, int)

    def resolved(self, window: int, floor: bool = False) -> CacheSettings:
        """These settings with `budget` in tokens: `parse_budget` against `window` (a count stays a count).

        `floor` (eval, compare): a tiny window still gets 2 tokens, and sinks stay below the budget.
        """
        budget = parse_budget(self.budget, window, floor)
        sinks = min(self.sinks, budget - 1) if floor else self.sinks
        return replace(self, budget=budget, sinks=sinks)

    @property
    def heavy(self) -> int:
        """Slots the policy keeps for heavy hitters (or sinks); the policy decides."""
        return make_policy(self).heavy_slots

    @property
    def recent(self) -> int:
        """Slots for the newest tokens; the policy decides."""
        return make_policy(self).recent_slots


def split_run_specs(value: str) -> list[str]:
    """Run specs written one after another: split at ';' where the value has one, else at commas, where a
    piece that does not start with a policy's name (`FIELD=VALUE`, or a value going on) belongs to the spec
    before it: `"full,recall:recall_ratio=0.5,lead_pages=4"` -> `["full", "recall:recall_ratio=0.5,lead_pages=4"]`."""
    if ";" in value:
        return [spec.strip() for spec in value.split(";") if spec.strip()]
    specs: list[str] = []
    for piece in filter(None, (piece.strip() for piece in value.split(","))):
        if specs and piece.partition(":")[0] not in policy_names():
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def parse_run_spec(spec: str) -> tuple[str, dict[str, str]]:
    """`recall:recall_ratio=0.25,page_size=16` -> ("recall", {"recall_ratio": "0.25", ...}): values as written,
    typed by `CacheSettings.from_args`; a name that is not a field is a `ValueError`, not dropped. A piece
    without `=` continues the value before it (`recall_layers=6,17,20-23`)."""
    name, _, rest = spec.partition(":")
    values: dict[str, str] = {}
    last = None
    for pair in filter(None, rest.split(",")):
        if "=" not in pair and last is not None:
            values[last] += "," + pair
            continue
        last, _, value = pair.partition("=")
        values[last] = value
    unknown = set(values) - {field.name for field in fields(CacheSettings)}
    if unknown:
        raise ValueError(f"{spec}: {', '.join(sorted(unknown))} is not a CacheSettings field")
    return name, values

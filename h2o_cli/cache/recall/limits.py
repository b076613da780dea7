"""What the recall archive may hold, and the one-line checks of recall's options (docs/spec.md, recall)."""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from h2o_cli.errors import UsageError

# `--archive-max` sizes: binary units as every figure of h2o, decimal ones as disks are sold.
SIZE_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SIZE_UNITS |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
ARCHIVE_BITS = (None, 16, 8)
DEFAULT_ARCHIVE_MAX = 1_048_576  # tokens: recall reaches back this far by default (on disk, where it fits)
RAM_ARCHIVE_MAX = 131072  # tokens: the default reach of an archive kept in RAM (or an accelerator's memory)
GROW_TOKENS = 16384  # a file archive reserves its disk space this many ring slots ahead of its writes
DISK_SPARE = 2**30  # bytes of the disk a file archive leaves free when it sizes its reach to the disk
DEFAULT_BLOCK = 4  # tokens per key summary when --block-size is not given (and 4 divides the page)
# `--archive auto`: a CPU archive whose K/V pass this (or an eighth of the machine's memory) goes to a file
AUTO_RAM_BYTES = 2 * 2**30
PAGE_SCORES = ("positional", "unrotated", "attention")
RECALL_PLACES = ("index", "contiguous")  # where rolling positions rank R among S (docs/spec.md, recall)


def archive_cap(value: int | str) -> tuple[int, str]:
    """`--archive-max` as `(count, "tokens")` for a whole number (`16384`) or `(count, "bytes")` for a size
    (`64MiB`, `1.5GiB`, `500MB`, `4096B`); anything else is a one-line usage error."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, "tokens"
    match = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([A-Za-z]*)", str(value).strip())
    if match and not match[2] and match[1].isdigit():
        return int(match[1]), "tokens"
    if match and match[2].lower() in SIZE_UNITS:
        return int(float(match[1]) * SIZE_UNITS[match[2].lower()]), "bytes"
    raise UsageError(
        f"--archive-max {value!r} is neither a token count (e.g. 16384) nor a size (e.g. 64MiB or 1GiB)"
    )


def lead_page_count(value: int | str) -> int | None:
    """`--lead-pages` as a page count (`8`, at least 1), or None for `fill` (as many of the lead's pages as
    fill the recall slots); anything else is a one-line usage error."""
    if isinstance(value, str) and value.strip().lower() == "fill":
        return None
    try:
        count = int(str(value).strip()) if not isinstance(value, bool) else -1
    except ValueError:
        count = -1
    if count < 1:
        raise UsageError(
            f"--lead-pages {value} must be at least 1 (pages of the lead head's ranking) or fill (as many as "
            "fill the recall slots)"
        )
    return count


def recall_layer_list(setting: str, n_layers: int | None = None) -> tuple[int, ...] | None:
    """`--recall-layers`: the layers named, ascending, as numbers from 0 (`6,17,18,20-23`: single layers and
    inclusive ranges), or for `all` every one of `n_layers` (None when the model is not known yet). With
    `n_layers`, each must be below it. A one-line usage error for anything else, and for no layer at all
    (that is `--policy h2o`)."""
    text = str(setting).strip().lower()
    if text == "all":
        return None if n_layers is None else tuple(range(n_layers))
    layers: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match or (match[2] is not None and int(match[2]) < int(match[1])):
            raise UsageError(
                f"--recall-layers {setting!r}: give all, or layer numbers and ranges from 0, e.g. 6,17,18,20-23"
            )
        layers.update(range(int(match[1]), int(match[2] or match[1]) + 1))
    if n_layers is not None and max(layers) >= n_layers:
        raise UsageError(
            f"--recall-layers {setting!r} names layer {max(layers)}, but the model has {n_layers} "
            f"(0-{n_layers - 1})"
        )
    return tuple(sorted(layers))


def recall_lead_head(
    setting: str,
    n_layers: int | None = None,
    n_kv_heads: int | None = None,
    calibrated: tuple[int, int] | None = None,
    model: str = "this model",
) -> tuple[int, int] | None:
    """`--recall-lead`: the (layer, KV head) whose page ranking every head recalls from after a question, or
    None for `none`. `auto` is the model's `calibrated` head, or None for a model without one; `LAYER.HEAD`
    names one, numbered from 0 (checked against the model once known)."""
    text = str(setting).strip().lower()
    if text == "none":
        return None
    if text == "auto":
        return calibrated
    match = re.fullmatch(r"(\d+)\.(\d+)", text)
    if not match:
        raise UsageError(
            f"--recall-lead {setting!r}: give none, auto, or a layer and KV head from 0 as LAYER.HEAD, e.g. 18.2"
        )
    layer, head = int(match[1]), int(match[2])
    if n_layers is not None and layer >= n_layers:
        raise UsageError(f"--recall-lead {setting}: the model has {n_layers} layers (0-{n_layers - 1})")
    if n_kv_heads is not None and head >= n_kv_heads:
        raise UsageError(
            f"--recall-lead {setting}: the model has {n_kv_heads} KV heads a layer (0-{n_kv_heads - 1})"
        )
    return layer, head


def step_pages(shortlist: int, step_shortlist: int) -> int:
    """The pages an answer step scores (its carried best): `--step-shortlist`, or `--shortlist` for 0; 0
    (every page) when `--shortlist` is 0."""
    return (step_shortlist or shortlist) if shortlist else 0


def check_recall_options(
    recall_ratio: float,
    page_size: int,
    archive_max: int | str,
    archive: str = "ram",
    archive_bits=None,
    page_score: str = "positional",
    block_size: int | None = None,
    shortlist: int = 0,
    page_carry: float = 0.0,
    chunk_weight: float = 1.0,
    choice_tokens: int = 0,
    step_shortlist: int = 0,
    recall_place: str = "index",
    recall_layers: str = "all",
    recall_lead: str = "none",
    lead_pages: int | str = 8,
    lead_next: int = 0,
    lead_outliers: float = 0.0,
) -> None:
    """One-line usage errors for `--recall-ratio`, `--page-size`, `--archive-max`, `--archive`,
    `--archive-bits`, `--page-score`, `--block-size`, `--shortlist`, `--page-carry`, `--chunk-weight`,
    `--choice-tokens`, `--step-shortlist`, `--recall-place`, `--recall-layers`, `--recall-lead`, `--lead-pages`,
    `--lead-next`, `--lead-outliers`
    (whatever the policy; the layers and the lead head against the model when the cache is built). A cap in bytes is checked
    against a page when the cache is built."""
    if not 0 <= recall_ratio <= 1:  # also NaN
        raise UsageError(f"--recall-ratio {recall_ratio} must lie in [0, 1]")
    if page_size < 1:
        raise UsageError(f"--page-size {page_size} must be at least 1")
    if block_size is not None and (block_size < 1 or page_size % block_size):
        raise UsageError(
            f"--block-size {block_size} must divide --page-size {page_size} (e.g. --block-size 4 with pages of 16)"
        )
    if not 0 <= page_carry < 1:  # also NaN
        raise UsageError(f"--page-carry {page_carry} must lie in [0, 1)")
    if not chunk_weight >= 1:  # also NaN
        raise UsageError(
            f"--chunk-weight {chunk_weight} must be at least 1 (1: a chunk weighs one answer step)"
        )
    if choice_tokens < 0:
        raise UsageError(f"--choice-tokens {choice_tokens} must be 0 (every token) or a number of tokens")
    if shortlist < 0:
        raise UsageError(f"--shortlist {shortlist} must be 0 (every page) or a number of pages")
    if step_shortlist < 0:
        raise UsageError(f"--step-shortlist {step_shortlist} must be 0 (as --shortlist) or a number of pages")
    count, unit = archive_cap(archive_max)
    if unit == "tokens" and count < 2 * page_size:
        raise UsageError(f"--archive-max {archive_max} must hold at least two pages ({2 * page_size} tokens)")
    if unit == "bytes" and count < 1:
        raise UsageError(f"--archive-max {archive_max} must be at least two pages' bytes, e.g. 64MiB")
    if not str(archive).strip():
        raise UsageError("--archive '' names nothing; give ram, disk or a file or folder path")
    if archive_bits not in ARCHIVE_BITS:
        raise UsageError(f"--archive-bits {archive_bits} is not supported; choose 16 or 8 (or omit it)")
    if page_score not in PAGE_SCORES:
        raise UsageError(f"--page-score {page_score!r} is unknown; choose {', '.join(PAGE_SCORES)}")
    if recall_place not in RECALL_PLACES:
        raise UsageError(f"--recall-place {recall_place!r} is unknown; choose {', '.join(RECALL_PLACES)}")
    recall_layer_list(recall_layers)
    if recall_lead_head(recall_lead) is not None:  # `auto` leaves a lead out where the scores do not carry
        if page_score != "attention" or not page_carry:
            raise UsageError(
                f"--recall-lead {recall_lead} ranks pages by the lead head's carried attention: it needs "
                "--page-score attention and --page-carry above 0 (the defaults)"
            )
    lead_page_count(lead_pages)
    if lead_next < 0:
        raise UsageError(f"--lead-next {lead_next} must be at least 0 (pages after each of the lead's pages)")
    if not (lead_outliers == 0 or lead_outliers >= 1):  # also NaN
        raise UsageError(
            f"--lead-outliers {lead_outliers} must be 0 (off) or at least 1 (a multiple of the median page's score)"
        )


def summary_block(page_size: int, block_size: int | None) -> int:
    """Tokens per key summary: `--block-size`, else 4 where 4 divides the page, else the page."""
    if block_size:
        return block_size
    return DEFAULT_BLOCK if page_size % DEFAULT_BLOCK == 0 else page_size


def archive_storage(setting: str, stored_bytes: int, device_type: str) -> str:
    """Where the archive's K/V live for `--archive setting`: `auto` is `ram` on an accelerator (its memory) and
    on the CPU when all of it (`stored_bytes`, every layer's K/V at its capacity) fits in `auto_ram_bytes()`,
    else `disk`; any other setting is itself (ram, disk or a path)."""
    if setting != "auto":
        return setting
    return "ram" if device_type != "cpu" or stored_bytes <= auto_ram_bytes() else "disk"


def auto_ram_bytes() -> int:
    """The most archived K/V `--archive auto` keeps in RAM on the CPU: `AUTO_RAM_BYTES`, or an eighth of the
    machine's physical memory where that is less (the page summaries add a quarter of it). Why 2 GiB:
    docs/recall.md, where the archive lives."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # a platform without these names: the limit alone
        return AUTO_RAM_BYTES
    return min(AUTO_RAM_BYTES, memory // 8) if memory > 0 else AUTO_RAM_BYTES


def archive_capacity(archive_max: int | str, page_size: int, span: int | None, page_bytes: int | None) -> int:
    """Archive capacity in tokens: `archive_max` (at most `span` when known), whole pages, at least two.

    A cap in bytes holds as many whole pages as fit (`page_bytes`: one page's archive bytes, every layer, as
    `h2o_cli.memory.archive_bytes` counts them); fewer than two is a usage error."""
    count, unit = archive_cap(archive_max)
    if unit == "bytes":
        assert page_bytes, "a cap in bytes needs the bytes of a page"
        if count < 2 * page_bytes:
            raise UsageError(
                f"--archive-max {archive_max} holds fewer than two pages of {page_size} tokens "
                f"({2 * page_bytes:,} bytes with this model); give at least that, or a token count"
            )
        pages = count // page_bytes
        return (min(pages, max(2, -(-span // page_size))) if span else pages) * page_size
    tokens = min(count, span) if span else count
    return max(2, -(-tokens // page_size)) * page_size


def ram_reach(capacity: int, archive_max: int | str, page_size: int) -> int:
    """The capacity of an archive kept in RAM: `capacity`, but at most `RAM_ARCHIVE_MAX` tokens (whole pages)
    when `--archive-max` is the default (a reach of a million tokens is the disk's; given, it is the user's)."""
    if archive_max != DEFAULT_ARCHIVE_MAX:
        return capacity
    return min(capacity, max(2, -(-RAM_ARCHIVE_MAX // page_size)) * page_size)


def free_bytes(place: Path) -> int:
    """Bytes free to this user on the file system of `place` (its nearest existing folder)."""
    place = Path(place)
    while not place.exists() and place != place.parent:
        place = place.parent
    status = os.statvfs(place)
    return status.f_bavail * status.f_frsize


def disk_reach(capacity: int, page_size: int, token_bytes: int, free: int, where: Path | str) -> int:
    """The capacity of a file archive: `capacity` tokens when the disk's `free` bytes hold them at
    `token_bytes` each (every layer's K/V and summaries) with `DISK_SPARE` left over, else the whole pages that
    do (at least two), said in one line on stderr (the `h2o_cli.recall` logger)."""
    room = max(0, free - DISK_SPARE) // max(1, token_bytes) // page_size * page_size
    if capacity <= room:
        return capacity
    fitted = max(2 * page_size, room)
    REACH_LOG.warning(
        f"note: the disk of {where} has room for {fitted:,} archived tokens ({free / 2**30:.1f} GiB free), not "
        f"the {capacity:,} of recall's reach; older pages are dropped past that (free space, or --archive PATH)"
    )
    return fitted


class _StderrLine(logging.Handler):
    """Each record as one line on the `sys.stderr` of the moment (stderr is everything but data)."""

    def emit(self, record: logging.LogRecord) -> None:
        sys.stderr.write(self.format(record) + "\n")


# The reach's notes: one line on stderr each, whatever logging the host set up (silence: raise its level).
REACH_LOG = logging.getLogger("h2o_cli.recall")
REACH_LOG.addHandler(_StderrLine())
REACH_LOG.propagate = False
_told: list[tuple[int, int]] = []  # the (capacity, token) last told outgrown: the layers of a cache tell once


def forget_told() -> None:
    """A new archive is being built: its first outgrown page is told again."""
    _told.clear()


def tell_outgrown(capacity: int, token: int) -> None:
    """Say in one line on stderr (the `h2o_cli.recall` logger) that a text outgrew the archive's reach of
    `capacity` tokens at token `token` (its first dropped page); every layer of a cache calls it, it says it
    once (`archive_oldest` in `--json` is how far back recall then reaches)."""
    if _told == [(capacity, token)]:
        return
    _told[:] = [(capacity, token)]
    REACH_LOG.warning(
        f"note: the text outgrew recall's archive at token {token:,}: it reaches back {capacity:,} tokens, "
        "older pages are dropped from here (raise --archive-max to keep them)"
    )

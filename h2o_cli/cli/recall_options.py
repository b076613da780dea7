"""The options of `recall`'s settings: its archive (where it lives, at what precision: the Memory panel) and
its tuning knobs (the Advanced recall panel; docs/recall.md gives the measurement behind each default)."""

from __future__ import annotations

from typing import Annotated

import typer

from h2o_cli.cli.cache_options import ADVANCED_RECALL, MEMORY, check_kv_bits

RecallRatio = Annotated[
    float,
    typer.Option(
        "--recall-ratio",
        help="recall: share of the budget refilled from the archive every step (2 tokens stay resident).",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
PageSize = Annotated[
    int,
    typer.Option(
        "--page-size",
        help="recall: tokens per archive page, the span a recall reads back whole.",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
BlockSize = Annotated[
    int | None,
    typer.Option(
        "--block-size",
        help="recall: tokens per key summary inside a page (divides --page-size; default: 4, or the page when 4 "
        "does not divide it). A page's bound is its best block's.",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
Shortlist = Annotated[
    int,
    typer.Option(
        "--shortlist",
        help="recall, --page-score attention: a chunk scores only the K pages whose key summaries bound "
        "highest, an answer step (with --page-carry) the K its carried scores rank highest; a question scores "
        "every page; 0 scores every page always.",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
StepShortlist = Annotated[
    int,
    typer.Option(
        "--step-shortlist",
        help="recall, --page-carry: an answer step scores only the K pages its carried scores rank highest "
        "(0: --shortlist's K). A step's cost grows with K.",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
PageCarry = Annotated[
    float,
    typer.Option(
        "--page-carry",
        help="recall, --page-score attention: share of a page's last score added to its next, so a page the "
        "question found stays while the answer is written (0: every step scores afresh).",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
ChunkWeight = Annotated[
    float,
    typer.Option(
        "--chunk-weight",
        help="recall, --page-carry: a chunk of c > 1 tokens (a question, a chat turn) starts the carried page "
        "scores weighing min(c, N) answer steps, so what the question found outlasts the answer's first words "
        "(1: one step).",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
RecallPlace = Annotated[
    str,
    typer.Option(
        "--recall-place",
        help="recall, rolling positions: where recalled tokens sit among the resident ones: ranked by token "
        "index (index), or as one block in token order between the older resident tokens and the recent "
        "window (contiguous, as ReAttention places its spans).",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
RecallLayers = Annotated[
    str,
    typer.Option(
        "--recall-layers",
        help="recall: the layers that recall, numbered from 0 (e.g. 6,17,18,20-23; default all). The others "
        "keep only their resident tokens, with no archive: less RAM and a faster step, but on the embedded "
        "model fewer pass keys found (docs/results.md).",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
RecallLead = Annotated[
    str,
    typer.Option(
        "--recall-lead",
        help="recall: after a question (stream --prompt), every head recalls only the pages one retrieval head "
        "ranks best, and the question is read twice so the layers before it have its ranking: LAYER.HEAD "
        "(from 0), auto (the head `h2o calibrate` found for these weights, kept under $H2O_HOME; found once, "
        "about 12 short probes, the first time a model without one recalls), or none (each head's own "
        "choice). Past the window it finds pass keys each head's own choice misses (docs/results.md).",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
LeadPages = Annotated[
    str,
    typer.Option(
        "--lead-pages",
        help="recall, --recall-lead: how many of the lead head's best pages every head recalls after a "
        "question (at most --recall-ratio of the budget in tokens), or fill: as many as fill its recall slots.",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
LeadNext = Annotated[
    int,
    typer.Option(
        "--lead-next",
        help="recall, --recall-lead: each of the lead head's best pages brings the N pages after it too (the "
        "rest of a line or a number a page boundary cut), so every head recalls --lead-pages × (1 + N) pages; "
        "0: the best pages only.",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
LeadOutliers = Annotated[
    float,
    typer.Option(
        "--lead-outliers",
        help="recall, --recall-lead: after a question every head also recalls each of the lead head's pages "
        "whose score is at least K times the median page's (with the page after it, as --lead-next says), up "
        "to its recall slots: a text whose facts stand out of their filler (a chain of assignments) brings "
        "them all back, running prose stays at --lead-pages (docs/results.md). 0: off.",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
LeadText = Annotated[
    bool,
    typer.Option(
        "--lead-text/--no-lead-text",
        help="recall, --recall-lead: chunks of text too recall the lead head's best pages (until every head's "
        "recall slots are full) in every layer but the lead's, instead of each head's own choice: only one layer scores "
        "pages while text is read (on by default; off in chat, where each head's own choice remembered more).",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
ChoiceTokens = Annotated[
    int,
    typer.Option(
        "--choice-tokens",
        help="recall: a chunk of text chooses what it recalls with at most N of its tokens' queries, evenly "
        "spaced (0: every token; a question's tokens always all choose). Fewer read faster; perplexity "
        "measured in docs/results.md.",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
PageScore = Annotated[
    str,
    typer.Option(
        "--page-score",
        help="recall: rank pages by the attention the queries put on them over every archived key (attention), "
        "by the bound of their key summaries with the query rotated over the distances recalled keys take "
        "(positional), or with the query unrotated (Quest's).",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
ArchiveMax = Annotated[
    str,
    typer.Option(
        "--archive-max",
        help="recall: how far back the archive reaches, in tokens (1048576 on disk, 131072 in RAM) or bytes "
        "(64MiB, 1GiB); older pages are dropped, said in one line.",
        rich_help_panel=ADVANCED_RECALL,
    ),
]
Archive = Annotated[
    str,
    typer.Option(
        "--archive",
        help="recall: where archived K/V live: auto (RAM when its K/V fit in 2 GiB, or an eighth of RAM, else "
        "disk; on a GPU its memory), ram, disk (a file in $H2O_HOME/archive/, memory-mapped and not kept "
        "resident; CPU only), or a file or folder PATH. The file is removed at exit.",
        rich_help_panel=MEMORY,
    ),
]
ArchiveBits = Annotated[
    int | None,
    typer.Option(
        "--archive-bits",
        help="recall: archived K/V as 16-bit or 8 (int8, per-token scales); default: the model dtype.",
        callback=check_kv_bits,
        rich_help_panel=MEMORY,
    ),
]
KeepArchive = Annotated[
    bool,
    typer.Option(
        "--keep-archive", help="recall: leave the archive's file in place at exit.", rich_help_panel=MEMORY
    ),
]

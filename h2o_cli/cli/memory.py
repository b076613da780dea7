"""`h2o memory`: what fits — weights, KV cache (full vs H2O) and activations, from the config alone."""

from __future__ import annotations

import json
from dataclasses import replace

from h2o_cli.cli import options as opt
from h2o_cli.cli.common import size, stderr, stdout_console
from h2o_cli.config import CacheSettings

EXAMPLES = """
Examples:

  h2o memory --model llama-7b --budget 0.2
  h2o memory --model smollm2-135m --budget 512 --quant 4bit --kv-bits 8 --json
  h2o memory --model llama-7b --archive disk --archive-bits 8 --archive-max 64MiB
"""


@opt.cache_options(
    skip=(
        "policy",
        "heavy_ratio",
        "sinks",
        "positions",
        "score_norm",
        "recall_ratio",
        "score_decay",
        "h2o_sinks",
        "kernels",
        "keep_archive",
    ),
    budget=opt.DEFAULTS["budget"],
    chunk=opt.DEFAULTS["chunk"],
)
def memory(
    settings: CacheSettings,
    model: opt.Model = opt.DEFAULTS["model"],
    quant: opt.Quant = "none",
    dtype: opt.Dtype = "auto",
    device: opt.Device = "cpu",
    device_map: opt.DeviceMap = None,
    as_json: opt.Json = False,
) -> None:
    """Memory for context lengths 4K … 1M: weights, KV cache full vs H2O (per head and total), activations.

    Computed from the model config without loading weights (a built-in public config for offline aliases).
    With --device-map, also the H2O cache (and a RAM recall archive) on each device, as the layers are placed.
    """
    from h2o_cli.cache.families import windowed_layers
    from h2o_cli.cache.recall.limits import (
        archive_capacity,
        archive_storage,
        auto_ram_bytes,
        recall_layer_list,
        step_pages,
        summary_block,
    )
    from h2o_cli.memory import ModelShape, archive_bytes, memory_table, token_kv_bytes
    from h2o_cli.models import config_for, pick_device, pick_dtype
    from h2o_cli.models.device import pick_read_dtype

    config, origin = config_for(model)
    shape = ModelShape.from_config(config)
    windowed = windowed_layers(config.get_text_config() if hasattr(config, "get_text_config") else config)
    tokens, chunk, kv_bits = settings.resolved(shape.context).budget, settings.chunk, settings.kv_bits
    dtype_bytes = pick_dtype(dtype, pick_device(device)).itemsize
    page, bits = settings.page_size, settings.archive_bits
    block = summary_block(page, settings.block_size)
    named = recall_layer_list(settings.recall_layers, shape.n_layers)
    recalling = [number for number in named if not windowed[number]]  # a window layer keeps no archive
    archived = replace(shape, n_layers=len(recalling))  # the archive: the recalling layers' only
    page_bytes = archive_bytes(archived, page, block, dtype_bytes, bits)
    archive = archive_capacity(settings.archive_max, page, None, page_bytes)  # whole pages, as the cache
    token_kv = archived.n_layers * archived.n_kv_heads * token_kv_bytes(archived, bits, dtype_bytes)
    kv_bytes = archive * token_kv  # the K/V (and scales) of every recalling layer, as the cache weighs them
    reads_bf16 = (
        pick_read_dtype(dtype, pick_device(device)) is not None and quant == "none" and not device_map
    )
    storage = (
        "ram" if archive_storage(settings.archive, kv_bytes, pick_device(device).type) == "ram" else "disk"
    )
    table = memory_table(
        shape,
        tokens,
        chunk,
        quant,
        kv_bits,
        dtype_bytes,
        page_size=page,
        block_size=block,
        archive_max=archive,
        archive_bits=bits,
        archive_storage=storage,
        shortlist=step_pages(settings.shortlist, settings.step_shortlist),
        recall_layers=len(recalling),
        read_copy_bytes=shape.read_copy_bytes() if reads_bf16 else 0,
    )
    table.update(model=model, config_source=origin)
    if settings.archive == "auto" and pick_device(device).type == "cpu":  # a text known to be short: RAM
        table["recall_archive_ram_up_to_tokens"] = auto_ram_bytes() // max(token_kv, 1) // page * page
    if device_map:
        table["cache_by_device"] = cache_by_device(
            config, device_map, pick_dtype(dtype, pick_device(device)), table, windowed, set(recalling)
        )
    if as_json:
        print(json.dumps(table))
        return
    from rich.table import Table

    kv = {None: f"{8 * dtype_bytes}-bit (model dtype)", 16: "16-bit", 8: "int8 + per-token scales"}[kv_bits]
    title = (
        f"{model} · {table['params'] / 1e9:.2f} B params · "
        f"weights {quant}: {size(table['weights_bytes'])}"
        + (
            f" (with a bf16 copy for reads, {size(table['read_copy_bytes'])})"
            if table["read_copy_bytes"]
            else ""
        )
        + " · "
        f"KV {kv} · H2O budget {tokens} tokens (+{chunk} chunk) · context window {shape.context:,}"
    )
    grid = Table(title=title + window_title(table), title_justify="left")
    for name in ("context", "full KV", "full KV/head", "H2O KV", "H2O KV/head", "act. full", "act. H2O"):
        grid.add_column(name, justify="right")
    grid.add_column("total full", justify="right")
    grid.add_column("total H2O", justify="right")
    for row in table["rows"]:
        context = (
            f"{row['context'] // 2**20}M" if row["context"] >= 2**20 else f"{row['context'] // 1024}K"
        ) + ("" if row["within_window"] else "*")
        grid.add_row(
            context,
            size(row["full_kv_bytes"]),
            size(row["full_kv_bytes_per_head"]),
            size(row["h2o_kv_bytes"]),
            size(row["h2o_kv_bytes_per_head"]),
            size(row["full_activation_bytes"]),
            size(row["h2o_activation_bytes"]),
            size(row["full_total_bytes"]),
            size(row["h2o_total_bytes"]),
        )
    stdout_console().print(grid)
    for name, placed in table.get("cache_by_device", {}).items():
        stderr.print(
            f"--device-map {device_map}: {name}: {placed['layers']} layers, H2O cache "
            f"{size(placed['h2o_kv_bytes'])}, recall archive in RAM {size(placed['recall_archive_ram_bytes'])}"
        )
    stderr.print(
        f"per head = one KV head of one {'global ' if table['windowed_layers'] else ''}layer "
        f"({table['kv_heads_total']} in all); {window_note(table)}"
        "* = beyond the context window (full attention cannot go there; H2O with rolling positions can); "
        f"config: {origin}"
    )
    by_bits = table["recall_archive_bytes_per_token_by_bits"]
    stored = {None: f"{8 * dtype_bytes}-bit", 16: "16-bit", 8: "int8"}[bits]
    in_ram = table.get("recall_archive_ram_up_to_tokens")
    ram_note = (
        f" (a text known to hold at most {in_ram:,} tokens, a file `stream` counts or an eval's document, "
        f"keeps its archive in RAM: K/V up to {size(auto_ram_bytes())})"
        if in_ram is not None
        else ""
    )
    stderr.print(
        f"--policy recall also keeps an archive ({stored}, --archive {settings.archive}"
        f"{'' if len(recalling) == shape.n_layers else f', in {len(recalling)} of {shape.n_layers} layers'}): "
        f"{size(table['recall_archive_bytes_per_token'])} per token "
        f"({size(table['recall_archive_ram_bytes_per_token'])} in RAM, "
        f"{size(table['recall_archive_disk_bytes_per_token'])} on disk); at --archive-max {archive:,} tokens "
        f"{size(table['recall_archive_ram_bytes'])} in RAM + {size(table['recall_archive_disk_bytes'])} on disk"
        f"{ram_note}. Per token: {size(by_bits['model'])} in the model dtype, {size(by_bits['16'])} 16-bit, "
        f"{size(by_bits['8'])} int8 (the summaries and index, in RAM, are part of each). Its page choice keeps "
        f"{size(table['recall_choice_bytes'])} more in RAM (the keys of the pages an answer step scores, "
        "per KV head: --step-shortlist; carried scores, section summaries, scratch)"
    )


def window_title(table: dict) -> str:
    """The title's tail for a model with sliding-window layers: which layers take the budget."""
    if not table["windowed_layers"]:
        return ""
    budgeted = table["kv_heads_total"] // max(table["kv_heads_per_layer"], 1)
    return f" · budget on {budgeted} global layers, {table['windowed_layers']} windowed layers beside it"


def window_note(table: dict) -> str:
    """The footnote on the sliding-window layers (empty without any): what they hold whatever the budget."""
    if not table["windowed_layers"]:
        return ""
    heads = table["windowed_layers"] * table["kv_heads_per_layer"]
    return (
        f"{table['windowed_layers']} layers attend over a sliding window of {table['window_tokens']:,} tokens "
        f"and keep it beside the budget: {table['window_slots_per_head']:,} slots per KV head "
        f"({heads} in all, {size(table['window_kv_bytes_per_head'] * heads)}), counted in H2O KV; "
        f"full KV holds at most the window in them; "
    )


def cache_by_device(
    config, device_map: str, dtype, table: dict, windowed: list[bool], recalling: set[int]
) -> dict[str, dict]:
    """{device: layers, their H2O cache bytes and RAM archive bytes} as `--device-map` places the layers
    (`planned_layer_devices`); each global layer holds its KV heads' budget, each sliding-window layer (of
    `windowed`) its window, and every recalling layer (of `recalling`) an equal share of the archive."""
    from h2o_cli.models.loading import planned_layer_devices

    per_layer = {
        False: table["rows"][0]["h2o_kv_bytes_per_head"] * table["kv_heads_per_layer"],
        True: table["window_kv_bytes_per_head"] * table["kv_heads_per_layer"],
    }
    placed: dict[str, dict] = {}
    for number, device in enumerate(planned_layer_devices(config, device_map, dtype)):
        entry = placed.setdefault(device, {"layers": 0, "h2o_kv_bytes": 0, "recall_archive_ram_bytes": 0})
        entry["layers"] += 1
        entry["h2o_kv_bytes"] += per_layer[windowed[number]]
        if number in recalling:
            entry["recall_archive_ram_bytes"] += table["recall_archive_ram_bytes"] // len(recalling)
    return placed


memory.__doc__ = (memory.__doc__ or "") + EXAMPLES

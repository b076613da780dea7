"""How `H2OCache` builds its layers: one `H2OLayer` per decoder layer, a `RecallLayer` for a layer that
recalls (`--recall-layers`), or a `WindowLayer` for a sliding-window layer (its own window, no budget), each with its store on its layer's device; recall's archives (in RAM or one mapped
file) and the lead head's ranking. The layer classes are chosen here, once; afterwards the cache only hands
calls on to its layers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from h2o_cli.cache.devices import compute_dtype
from h2o_cli.cache.families import SLIDING, text_config, windowed_layers
from h2o_cli.cache.kvquant import storage_dtype
from h2o_cli.cache.layer import H2OLayer
from h2o_cli.cache.positions import Rope
from h2o_cli.cache.recall.archive import PageArchive
from h2o_cli.cache.recall.layer import RecallLayer
from h2o_cli.cache.recall.lead import LeadRanking
from h2o_cli.cache.recall.limits import lead_page_count
from h2o_cli.cache.step import DecodeMaps
from h2o_cli.cache.store import LayerStore
from h2o_cli.cache.window import WindowLayer
from h2o_cli.config import CacheSettings
from h2o_cli.errors import UsageError
from h2o_cli.memory import ModelShape


@dataclass
class BuiltLayers:
    """What `build_layers` gives the cache: its layers, recall's archive file (None: in RAM, or no recall)
    and the lead head's ranking (None: no lead)."""

    layers: list[H2OLayer]
    archive_file: object | None
    lead: LeadRanking | None


def build_layers(
    model,
    settings: CacheSettings,
    shape: ModelShape,
    policy,
    budget: int,
    devices: list[torch.device],
    span: int | None,
    archive_span: int | None,
    archive_reach: int | None = None,
) -> BuiltLayers:
    """One layer per decoder layer of `model` (`settings` resolved, `budget` the resident tokens per head,
    `shape` its decoder's, `devices` each layer's): `--recall-layers` gives a layer that does not recall S alone, as `h2o` on the
    resident budget. `span`, `archive_span` bound a recall archive, `archive_reach` fixes a file's (`H2OCache`)."""
    dtype = compute_dtype(model)
    windowed = windowed_layers(text_config(model))
    ropes = layer_ropes(model.model.rotary_emb, shape.head_dim)
    maps = DecodeMaps()
    recalling = set(policy.recalling_layers(shape.n_layers)) if policy.recalls else set()
    recalling -= {number for number, window in enumerate(windowed) if window}
    resident = replace(settings, policy="h2o", budget=budget)
    positions = policy.positions_for(settings.positions)

    def store(number: int, kept: int) -> LayerStore:
        kv_dtype = storage_dtype(settings.kv_bits, dtype)
        return LayerStore(
            shape.n_kv_heads,
            shape.head_dim,
            kept,
            settings.chunk,
            kv_dtype,
            devices[number],
            compute_dtype=dtype,
        )

    layers = []
    for number, sliding in enumerate(windowed):
        rope = ropes[sliding]
        first = windowed.index(sliding) == number  # the first layer of its kind computes its RoPE afresh
        if sliding:  # bounded already: its own window, exact, no budget (`h2o_cli.cache.window`)
            window = replace(settings, policy="local", budget=shape.window - 1)
            layer = WindowLayer(
                store(number, window.budget),
                window,
                rope,
                shape.context,
                shape.window,
                positions,
                first_layer=first,
            )
        else:
            layer = (RecallLayer if number in recalling else H2OLayer)(
                store(number, budget),
                settings if number in recalling or not policy.recalls else resident,
                rope,
                shape.context,
                first_layer=first,
                maps=maps,
            )
        layer.read_matmul = getattr(model, "h2o_read_dtype", None)
        layer.read_rows = getattr(model, "h2o_read_rows", 0)
        layers.append(layer)
    if not policy.recalls:
        return BuiltLayers(layers, None, None)
    known = [bound for bound in (span, archive_span) if bound is not None]
    recallers = [(layer, devices[number]) for number, layer in enumerate(layers) if number in recalling]
    archive_file = add_archives(
        recallers, settings, shape, policy, min(known) if known else None, dtype, archive_reach
    )
    return BuiltLayers(layers, archive_file, lead_ranking(model, layers, policy, shape))


def layer_ropes(rotary_emb, head_dim: int) -> dict[bool, Rope]:
    """The `Rope` of a global layer (key False) and of a sliding-window layer (True): one each where the
    model rotates the two kinds with their own bases (Gemma 3's `layer_types`), else one shared."""
    kinds = getattr(rotary_emb, "layer_types", None)
    if not kinds:
        rope = Rope(rotary_emb, head_dim)
        return {False: rope, True: rope}
    return {
        sliding: Rope(rotary_emb, head_dim, SLIDING if sliding else "full_attention")
        for sliding in (False, True)
    }


# Who names `--recall-lead auto`'s head for a model when none is set on it: `h2o_cli.models` registers its
# calibration here when imported (the cache imports no model loader; `register_lead_finder`).
LEAD_FINDERS: list[Callable[[object], tuple[int, int] | None]] = []


def register_lead_finder(finder: Callable[[object], tuple[int, int] | None]) -> None:
    """Let `finder(model)` name the lead head (layer, KV head) of a model with none set on it, or None."""
    if finder not in LEAD_FINDERS:
        LEAD_FINDERS.append(finder)


def lead_ranking(model, layers: list[H2OLayer], policy, shape: ModelShape) -> LeadRanking | None:
    """`--recall-lead`: the lead head's `LeadRanking`, given to every recalling layer; None without one. `auto`
    takes a head set on the model (`h2o_lead_head`), else the first head a registered finder gives (`h2o_cli.models`
    registers its calibration: the one kept for the weights, calibrated once where none is kept)."""
    calibrated = getattr(model, "h2o_lead_head", None)
    if calibrated is None and policy.lead_calibrated:
        calibrated = next((found for finder in LEAD_FINDERS if (found := finder(model)) is not None), None)
    name = getattr(model, "h2o_name", None) or "this model"
    lead = policy.lead_head(shape.n_layers, shape.n_kv_heads, calibrated, name)
    if lead is None:
        return None
    if layers[lead[0]].is_sliding:
        raise UsageError(
            f"--recall-lead {policy.recall_lead}: layer {lead[0]} attends over a sliding window and keeps no "
            "archive; name a head of a global layer"
        )
    pages = lead_page_count(policy.lead_pages)
    ranking = LeadRanking(
        layers[lead[0]].archive, lead[1], pages, lead[0], policy.lead_next, policy.lead_outliers
    )
    for layer in layers:
        layer.follow(ranking)
    return ranking


def add_archives(
    recallers: list[tuple[RecallLayer, torch.device]],
    settings: CacheSettings,
    shape: ModelShape,
    policy,
    span: int | None,
    dtype: torch.dtype,
    reach: int | None = None,
):
    """Give every recalling layer (with its device) its `PageArchive`, in RAM or in one mapped file
    (docs/spec.md, recall: storage): the default reach is `RAM_ARCHIVE_MAX` in RAM, and a file's as many
    tokens as its disk holds (`disk_reach`, one line when fewer), or `reach` exactly (a resumed cache takes
    its save's, whatever the disk holds now: the file's layout is the save's)."""
    from h2o_cli import memory
    from h2o_cli.cache.recall.archive_file import ArchiveFile, aligned
    from h2o_cli.cache.recall.archive_folder import archive_location
    from h2o_cli.cache.recall.limits import archive_storage, disk_reach, free_bytes, ram_reach, summary_block

    layers, devices = [layer for layer, _ in recallers], [device for _, device in recallers]
    bits, page = settings.archive_bits, policy.page_size
    block = summary_block(page, policy.block_size)
    archived = replace(shape, n_layers=len(layers))  # a byte cap counts the recalling layers only
    page_bytes = memory.archive_bytes(archived, page, block, dtype.itemsize, bits)
    capacity = policy.archive_tokens(span, page_bytes)
    regions, archive_file = [None] * len(layers), None
    device = next((device for device in devices if device.type != "cpu"), devices[0])
    kv = PageArchive.stored_bytes(shape.n_kv_heads, shape.head_dim, capacity, dtype, bits)
    storage = archive_storage(settings.archive, aligned(kv) * len(layers), device.type)
    if storage == "ram":
        capacity = ram_reach(capacity, policy.archive_max, page)
    else:
        if device.type != "cpu":
            raise UsageError(
                f"--archive {settings.archive} maps a file into CPU memory, but the model runs on {device}; "
                "use --archive ram (the archive then lives in device memory) or --device cpu"
            )
        where = archive_location(storage, settings.keep_archive)
        in_file = PageArchive.stored_bytes(shape.n_kv_heads, shape.head_dim, capacity, dtype, bits, block)
        token_bytes = -(-in_file * len(layers) // capacity)
        if reach is not None:
            capacity = reach
        else:
            capacity = disk_reach(capacity, page, token_bytes, free_bytes(where.parent), where.parent)
        region = aligned(
            PageArchive.stored_bytes(shape.n_kv_heads, shape.head_dim, capacity, dtype, bits, block)
        )
        archive_file = ArchiveFile(where, region * len(layers), settings.keep_archive)
        regions = [archive_file.region(region) for _ in layers]
    for layer, region, device in zip(layers, regions, devices, strict=True):
        layer.add_archive(capacity, dtype, device, bits, region)
    return archive_file

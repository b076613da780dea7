"""The model-level cache (`H2OCache`), speaking the transformers `Cache` protocol.

`H2OCache(model, settings)` holds one `H2OLayer` (or `RecallLayer`) per decoder layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache

from h2o_cli.cache.build import build_layers
from h2o_cli.cache.devices import check_kernels, compute_dtype, execution_device, layer_devices
from h2o_cli.cache.families import check_family
from h2o_cli.cache.fixed_step import FIXED_DTYPES
from h2o_cli.cache.layer import Prefixed
from h2o_cli.cache.report import ArchiveReport, CacheReport, LayerSlots
from h2o_cli.cache.store import LayerStore
from h2o_cli.cache.threads import DecodeThreads
from h2o_cli.config import CacheSettings
from h2o_cli.errors import ContextOverflowError, UsageError
from h2o_cli.memory import ModelShape
from h2o_cli.policies import make_policy


class H2OCache(Cache):
    """A fixed-memory KV cache for one sequence with H2O (or another) eviction policy.

    A fractional budget is resolved against the model's context window. `span` is the most tokens this cache
    will be given (default: the context window): a policy that never evicts preallocates that many.
    `archive_span` bounds only what a recall archive holds (the most tokens a text can bring when that is known,
    e.g. a file's size): the archive is then no larger than the text, and the settings are still checked as
    for any text. `archive_reach` is an archive file's capacity in tokens, exactly (a cache resumed from a
    saved read takes its save's: `SavedRead.archive_reach`).
    With rolling positions, `budget + chunk` (capped at `span`) must fit in the context window, else a
    `UsageError` names the fix (positions would pass the window the model was trained on).

    Example:
        cache = H2OCache(model, CacheSettings(budget=256))
        model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
    """

    def __init__(
        self,
        model,
        settings: CacheSettings,
        span: int | None = None,
        archive_span: int | None = None,
        archive_reach: int | None = None,
    ) -> None:
        from h2o_cli.cache.attention import enable

        check_family(model)
        enable(model)
        self.shape = shape = ModelShape.from_config(model.config)  # the decoder's, as memory counts it
        self.max_positions = shape.context
        self.settings = settings = settings.resolved(shape.context)
        self.quant = getattr(model, "h2o_quant", "none")
        policy = make_policy(settings)
        budget = policy.kept_tokens(min(span or shape.context, shape.context))
        # Attention reads the kept entries, the recall slots and the chunk: positions reach their sum.
        check_rolling_window(settings, budget + policy.recall_slots, span, shape.context)
        # Every layer's buffers live where its attention runs (a device map may split the model).
        self.devices = devices = layer_devices(model)
        for device in dict.fromkeys(devices):
            check_kernels(settings.kernels, device)
        # What `generate_ids` decodes on; on a GPU the step's time is not the CPU's threads' to choose.
        on_cpu = all(device.type == "cpu" for device in devices)
        self.decode_threads = DecodeThreads(settings.decode_threads, measure=on_cpu)
        self._policy = policy
        built = build_layers(
            model, settings, shape, policy, budget, devices, span, archive_span, archive_reach
        )
        self.archive_file = (
            built.archive_file
        )  # the recall archive's mapped file, with --archive disk or PATH
        self.lead = built.lead
        layers = built.layers
        super().__init__(layers=layers)

    def close(self) -> None:
        """Remove the recall archive's file now (unless kept); it is removed anyway when the cache is
        collected or the interpreter exits. The cache must not be used afterwards with a file archive."""
        if self.archive_file is not None:
            self.archive_file.close()

    def fix_steps(self) -> None:
        """Prepare the fixed decode step (h2o_cli.cache.fixed_step), which `fixed_step` then switches on: check
        that this cache can take it and size the RoPE tables once for the largest position it can reach (so a
        captured step never regrows them). Raises `UsageError` where it cannot run. The fixed step takes no lead
        head: `--recall-lead auto` leaves it out here, a named one is a `UsageError`."""
        if self.lead is not None and self._policy.lead_auto:
            self.lead = None
            for layer in self.layers:
                layer.follow(None)
        for layer in self.layers:
            store = layer.store
            if store.compute_dtype not in FIXED_DTYPES:
                raise UsageError(
                    "the fixed decode step (--compile) takes a float16, bfloat16, float32 or float64 model, "
                    f"not {store.compute_dtype}"
                )
            layer.prepare_fixed()
            cos_table, sin_table = layer.fixed_tables()[:2]
            if not layer.maps.usable(cos_table, sin_table):
                raise UsageError("the fixed decode step (--compile) needs the standard rotate_half RoPE")

    def fixed_buffers(self) -> list[torch.Tensor]:
        """Every tensor a fixed step reads or writes in place (stores, RoPE tables, recall slots, archives,
        statistics): what a CUDA graph may keep at fixed addresses (`h2o_cli.compiled.mark_static`)."""
        found: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            tensors = layer.fixed_buffers()
            found.update((id(tensor), tensor) for tensor in tensors if tensor is not None)
        return list(found.values())

    @contextmanager
    def asking(self, tokens: int, again: bool = False) -> Iterator[None]:
        """Within: a forward's chunk whose last `tokens` tokens are a question (`streaming.AskingChunk`; 0: no
        question). A `recall` layer then chooses what to bring back with their queries alone, weighed as a
        chunk of that many tokens (docs/spec.md, recall: choice); every other policy reads the chunk as ever.
        With a lead head (`lead`) a question starts unranked: the layers below the lead recall nothing until
        it is read `again` (after `restore`), with the ranking of the first read (`streaming.prefill`)."""
        if self.lead is not None and tokens > 1 and not again:
            self.lead.ready = False
        for layer in self.layers:
            layer.ask(tokens)
        try:
            yield
        finally:
            for layer in self.layers:
                layer.ask(0)

    @contextmanager
    def fixed_step(self) -> Iterator[None]:
        """Run the enclosed one-token forward on the fixed step (after `fix_steps`): every layer reads only
        tensors, its token index from the forward's `position_ids` (which must be `tokens_seen`); then
        advance the Python counters by what they imply. Raises `ContextOverflowError` before the forward where
        the token cannot be held (original positions past the window, a store that never evicts full)."""
        for layer in self.layers:
            layer.check_room(1)
            store = layer.store
            if store.tokens_seen in store.pins:
                raise UsageError(
                    f"token {store.tokens_seen} is pinned: the fixed step cannot pin it; feed it uncompiled"
                )
            if not layer.policy.evicts and store.length >= store.slots:
                raise ContextOverflowError(
                    f"the cache holds {store.slots} tokens and policy {layer.policy.name} evicts none"
                )
            layer.fixed = True
        try:
            yield
        finally:
            for layer in self.layers:
                layer.fixed = False
        for layer in self.layers:
            layer.stepped_fixed()

    @property
    def policy(self):
        """The eviction policy (`h2o_cli.policies`). Every layer holds an equal one, but under
        `--recall-layers` a layer that does not recall holds `h2o` on recall's resident budget."""
        return self._policy

    @property
    def positions(self) -> str:
        """The positions in use: `settings.positions` unless the policy allows only others."""
        return self.layers[0].positions

    @property
    def stores(self) -> list[LayerStore]:
        """Every layer's store: the cache's own (and its tests'); reports read `report()`/`layer_slots()`."""
        return [layer.store for layer in self.layers]

    def report(self) -> CacheReport:
        """The cache's figures now, as plain data (`CacheReport`): what every command and table reports."""
        policy, store = self.policy, self._budgeted.store
        windows = [layer.store for layer in self.layers if layer.is_sliding]
        return CacheReport(
            settings=self.settings,
            shape=self.shape,
            quant=self.quant,
            positions=self.positions,
            resident_slots=store.budget,
            recall_slots=policy.recall_slots,
            heavy_slots=policy.heavy_slots,
            recent_window=policy.recent_slots,
            sinks=getattr(policy, "sinks", 0),  # only the policies that take the option have the field
            h2o_sinks=getattr(policy, "h2o_sinks", 0),
            score_decay=policy.decay_per_query,
            slots=store.slots,
            length=store.length,
            tokens_seen=store.tokens_seen,
            evictions=store.evictions,
            nbytes=self.nbytes(),
            compute_bytes=store.compute_dtype.itemsize,
            kv_element_bytes=store.keys.element_size(),
            archive=self.archive_summary(),
            windowed_layers=len(windows),
            window_slots=windows[0].slots if windows else 0,
            pinned_slots=store.pinned_count,
            pinned_tokens=len(store.pins),
            window_bytes=sum(window.nbytes() for window in windows),
        )

    @property
    def _budgeted(self):
        """The first layer that takes the budget (not a sliding window): what the report's figures are."""
        return next(layer for layer in self.layers if not layer.is_sliding)

    def pin(self, tokens) -> None:
        """Pin token indices (an iterable of ints; docs/spec.md, pinned tokens): no policy evicts them while
        they are resident, and they count inside the budget. A token not yet read is pinned when written; one
        already evicted stays gone. Sliding-window layers keep their window as ever. Raises `UsageError` when
        the pinned entries would take more than half of the resident slots."""
        tokens = {int(token) for token in tokens}
        stores = [layer.store for layer in self.layers if not layer.is_sliding]
        room = stores[0].budget // 2
        if len(stores[0].pins | tokens) > room:
            raise UsageError(
                f"pinning {len(stores[0].pins | tokens)} tokens would take more than half of the "
                f"{stores[0].budget} resident slots ({room}); unpin some or raise the budget"
            )
        for store in stores:
            store.pin(tokens)

    def unpin(self, tokens) -> None:
        """Release pinned token indices (`pin`): their entries are the policy's to evict again."""
        tokens = {int(token) for token in tokens}
        for layer in self.layers:
            if not layer.is_sliding:
                layer.store.unpin(tokens)

    def layer_slots(self) -> list[LayerSlots]:
        """What each layer's slots hold now (`LayerSlots`: views of the live buffers, not copies)."""
        shown = self.policy.recall_slots if self.policy.recalls else None
        return [layer.report(shown) for layer in self.layers]

    def state(self) -> list[dict]:
        """A copy of every layer's entries and counters (`LayerStore.state`), to put back with `restore`."""
        return [store.state() for store in self.stores]

    def restore(self, state: list[dict]) -> None:
        """Put back a `state()`; a recall archive forgets what it archived since."""
        for store, layer_state in zip(self.stores, state, strict=False):
            store.restore(layer_state)
        self.rewind_archive(state[0]["tokens_seen"])

    def saved_arrays(self) -> dict[str, torch.Tensor]:
        """Every layer's arrays (`H2OLayer.saved_arrays`) named `layers.N.NAME`: what a saved read writes
        (h2o_cli.saved); live tensors, not copies."""
        return {
            f"layers.{number}.{name}": tensor
            for number, layer in enumerate(self.layers)
            for name, tensor in layer.saved_arrays().items()
        }

    def saved_counters(self) -> dict:
        """Every layer's counters (`H2OLayer.saved_counters`), whether a lead head's ranking is ready and its
        question's outlier pages."""
        lead_ready = self.lead is not None and self.lead.ready
        outlying = 0 if self.lead is None else self.lead.outlying
        layers = [layer.saved_counters() for layer in self.layers]
        return {"layers": layers, "lead_ready": lead_ready, "lead_outlying": outlying}

    def load_saved(self, arrays, counters: dict) -> None:
        """Put back `saved_arrays` (a mapping by name) and `saved_counters` of a cache built with the same model
        and settings: this cache then goes on exactly as that one would have (a fork: the mapping is read,
        never written)."""
        for number, (layer, layer_counters) in enumerate(zip(self.layers, counters["layers"], strict=True)):
            layer.load_saved(Prefixed(arrays, f"layers.{number}."), layer_counters)
        if self.lead is not None:
            self.lead.ready = counters["lead_ready"]
            self.lead.outlying = counters.get("lead_outlying", 0)  # a save from before --lead-outliers: none

    def nbytes(self) -> int:
        """Bytes of all preallocated cache buffers."""
        return sum(store.nbytes() for store in self.stores)

    @property
    def tokens_seen(self) -> int:
        return self.stores[0].tokens_seen

    def rewind_archive(self, tokens: int) -> None:
        """With a recalling policy, forget archived tokens from index `tokens` on (the stores were put back to
        that point, by `restore`); nothing otherwise."""
        for layer in self.layers:
            layer.rewind(tokens)

    def archive_summary(self) -> ArchiveReport | None:
        """The archive's figures with a recalling policy (`ArchiveReport`, whose docs say what each is), else
        None (docs/spec.md, recall: reporting)."""
        layers = [layer for layer in self.layers if layer.archive is not None]
        if not layers:
            return None
        archive = layers[0].archive
        steps = sum(layer.steps for layer in layers)
        recalled = sum(layer.recalled_total for layer in layers) / steps if steps else 0.0
        hits = sum(layer.hits_total for layer in layers) / steps if steps else 0.0
        kept = self.archive_file is not None and self.settings.keep_archive
        return ArchiveReport(
            archive_storage="ram" if self.archive_file is None else "disk",
            archive_path=None if self.archive_file is None else str(self.archive_file.path),
            archive_kept=kept,
            archive_bits=self.settings.archive_bits,
            archive_bytes=sum(layer.archive.nbytes() for layer in layers),
            archive_ram_bytes=sum(layer.archive.ram_bytes() for layer in layers),
            archive_disk_bytes=sum(layer.archive.disk_bytes() for layer in layers),
            archive_token_bytes=sum(layer.archive.token_bytes() for layer in layers),
            archive_capacity=archive.capacity,
            archive_tokens=archive.held(),
            archive_reach=archive.oldest,
            archive_oldest=archive.oldest,
            recall_slots=self.policy.recall_slots,
            recall_lead="none" if self.lead is None else f"{self.lead.layer}.{self.lead.head}",
            lead_pages=0 if self.lead is None else "fill" if self.lead.pages is None else self.lead.pages,
            lead_next=0 if self.lead is None else self.lead.follow,
            lead_outliers=0.0 if self.lead is None else self.lead.outliers,
            lead_text=self.lead is not None and self.policy.lead_text,
            recall_place=self.policy.recall_place,
            recall_slot_bytes=sum(
                tensor.nbytes
                for layer in layers
                for tensor in (layer.recall_keys, layer.recall_values, layer.recall_index)
            ),
            choice_bytes=sum(layer.choice_bytes() for layer in layers),
            recalled_per_step=recalled,
            recall_hits=hits,
            archive_reads_per_step=recalled - hits,
        )

    @property
    def length(self) -> int:
        """Entries each KV head of a global layer holds now."""
        return self._budgeted.store.length


def check_rolling_window(settings: CacheSettings, budget: int, span: int | None, context: int) -> None:
    """Rolling positions reach `budget + chunk - 1` (SPEC.md), or `span - 1` for a cache never given more than
    `span` tokens; refuse settings that would pass `context`."""
    rolling = make_policy(settings).positions_for(settings.positions) == "rolling"
    if rolling and min(budget + settings.chunk, span or budget + settings.chunk) > context:
        raise UsageError(
            f"--budget {budget} + --chunk {settings.chunk} = {budget + settings.chunk} positions pass the "
            f"model's context window ({context}); use --chunk {max(1, context - budget)} or less, "
            f"or --budget {max(2, context - settings.chunk)} or less"
        )


__all__ = [
    "H2OCache",
    "check_kernels",
    "check_rolling_window",
    "compute_dtype",
    "execution_device",
    "layer_devices",
]

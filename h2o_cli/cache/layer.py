"""One decoder layer's cache (`H2OLayer`): a `LayerStore` plus the step logic of SPEC.md.

The model's attention calls `layer.update(k, v, kwargs=...)` and then the registered "h2o" attention function
(`h2o_cli.cache.attention`), which receives the layer through those same kwargs and calls `layer.attend`.
`update` chooses the call's path once (`h2o_cli.cache.paths.choose_path`: chunk, Triton, torch step, C step or
fixed step) and leaves the call's K/V with it; `attend` hands the call to that path. The path bodies are the
same for every layer; a layer supplies its recalled set R through the hooks below (`recall_chunk`,
`chunk_positions`, `merged_order`, `step_entries`, `c_recall`, `fixed_entries`): here R = ∅, `RecallLayer`
overrides them.
"""

from __future__ import annotations

import functools

import torch
from h2o_kernels.dispatch import use_native
from transformers.cache_utils import CacheLayerMixin

from h2o_cli.cache.c_step import CStep, KeyPlacement
from h2o_cli.cache.paths import Call, choose_path
from h2o_cli.cache.paths.base import Recalled
from h2o_cli.cache.positions import Rope
from h2o_cli.cache.report import LayerSlots
from h2o_cli.cache.step import DecodeMaps
from h2o_cli.cache.store import LayerStore
from h2o_cli.config import CacheSettings
from h2o_cli.errors import ContextOverflowError, UnsupportedModelError
from h2o_cli.policies import make_policy

LAYER_KWARG = "h2o_layer"
RECALL_SLOTS = (
    "recall_keys",
    "recall_values",
    "recall_index",
)  # a recall layer's R, as a saved read keeps it


class H2OLayer(CacheLayerMixin):
    """One decoder layer's cache: a `LayerStore` (S) plus the step logic of SPEC.md, with R = ∅."""

    is_sliding = False
    is_compileable = False
    fused_kernels = True  # the chunk path may run on the Triton kernels
    asks = (
        0  # the call's last `asks` tokens are a question: only a layer that reads questions sets it (`ask`)
    )
    archive = None  # a recall layer's `PageArchive`
    recall_index = None  # a recall layer's R: token indices [n_kv_heads, recall_slots] (-1 = empty)
    # A read of `read_rows` tokens or more multiplies the chunk path's QK^T and PV in `read_matmul` where it
    # attends in token order (over R and S; set by `build_layers` from the model's `h2o_read_dtype`, `--dtype
    # auto`'s bf16); None: the store's dtype.
    read_matmul: torch.dtype | None = None
    read_rows = 0

    def __init__(
        self,
        store: LayerStore,
        settings: CacheSettings,
        rope: Rope,
        max_positions: int,
        first_layer: bool = True,
        maps: DecodeMaps | None = None,
    ) -> None:
        """`first_layer`: this layer starts each forward pass, so it computes the RoPE tables afresh; the
        other layers of a model reuse them (they share one `Rope`, and one `maps` for the decode step)."""
        super().__init__()
        self.first_layer = first_layer
        self.store = store
        self.settings = settings
        self.policy = policy = make_policy(settings)
        self.positions = policy.positions_for(settings.positions)
        self.rope = rope
        self.max_positions = max_positions
        self.is_initialized = True
        self._call: Call | None = None  # the call `update` took and `attend` has not run yet
        self.maps = maps or DecodeMaps()
        # One-token calls may take a step in these compute dtypes (the fixed step, which `H2OCache.fix_steps`
        # checks, takes 16-bit ones too: `fixed_step.FIXED_DTYPES`).
        self._step_path = store.compute_dtype in (torch.float32, torch.float64)
        # While set (`H2OCache.fixed_step`), a one-token call takes the fixed step, the RoPE tables being
        # `fixed_rows` long (set by `prepare_fixed`).
        self.fixed = False
        self.fixed_rows = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    @property
    def keys(self) -> torch.Tensor:  # [1, n_kv_heads, slots, head_dim], the protocol's view
        return self.store.keys.unsqueeze(0)

    @keys.setter
    def keys(self, value) -> None:  # CacheLayerMixin.__init__ assigns None
        pass

    @property
    def values(self) -> torch.Tensor:
        return self.store.values.unsqueeze(0)

    @values.setter
    def values(self, value) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs=None, **extra):
        """Take a call's keys/values `[1, n_kv_heads, chunk, head_dim]` (rotated by the model), kept unrotated
        for `attend`, which writes them into the store on the path chosen here."""
        if key_states.shape[0] != 1:
            raise UnsupportedModelError("the H2O cache holds one sequence; run with batch size 1")
        if self._call is not None:
            raise UnsupportedModelError(
                "the model attended without the h2o attention function; "
                "load it with h2o_cli.load_model or call h2o_cli.enable(model) first"
            )
        path = self.choose_path(key_states)
        self._call = path.take(self, key_states, value_states, kwargs or {})
        self.archive_call(self._call)
        if kwargs is not None:
            kwargs[LAYER_KWARG] = self  # read by h2o_cli.attention.h2o_attention right after this call
        return self.keys, self.values

    def choose_path(self, states: torch.Tensor):
        """The path of a call of `states` [1, n_kv_heads, chunk, head_dim] (`h2o_cli.cache.paths.choose_path`;
        a layer kind with a path of its own returns it)."""
        return choose_path(self, states)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of the call given to `update`, with score accumulation and eviction (SPEC steps 1-4), on
        the path `update` chose. query: [1, n_heads, chunk, head_dim] rotated by the model. Returns
        [1, chunk, n_heads, head_dim]."""
        call, self._call = self._call, None
        return call.path.attend(self, call, query, scaling)

    def check_room(self, chunk: int) -> None:
        """Refuse a call of `chunk` tokens that original positions would rotate past the context window."""
        if self.positions == "original":
            last = self.store.tokens_seen + chunk
            if last > self.max_positions:
                raise ContextOverflowError(
                    f"{last} tokens exceed the model's context window ({self.max_positions}) with "
                    f"{'original positions' if self.policy.evicts else f'policy {self.policy.name}'}; "
                    "use --positions rolling with an evicting policy to go further (--policy local slides a "
                    "window of the latest tokens)"
                )

    def steps_possible(self, states: torch.Tensor) -> bool:
        """Whether a one-token call in `states`' dtype and device may take a step: the store computes in
        float32/64, the call in its dtype, and `DecodeMaps.usable` says the rotation allows it."""
        store = self.store
        return (
            self._step_path
            and states.dtype == store.compute_dtype
            and self.maps.usable(*self._step_tables(self._new_position(), states.device))
        )

    @functools.cached_property
    def _c_buffers(self) -> CStep | None:
        """The C step's fixed arguments when it can run this layer (h2o_cli.cache.c_step): a `kernel_victim`
        policy, a float32 store on the CPU, `--kernels auto` or `native` with a C compiler; else None."""
        if self._c_possible():
            return CStep(self.store)
        return None

    def _c_possible(self) -> bool:
        store = self.store
        return (
            self.policy.kernel_victim
            and store.keys.dtype == store.compute_dtype == torch.float32
            and use_native(store.keys.device, self.settings.kernels)
        )

    # What the cache hands on to its layers (a layer without recall slots has nothing to do for most).

    def ask(self, tokens: int) -> None:
        """The next calls end with a question of `tokens` tokens (`H2OCache.asking`; 0: none). Only a layer that
        chooses what to recall reads it."""

    def follow(self, lead) -> None:
        """Recall the pages of `lead` (a `LeadRanking`, or None) after a question: only a recall layer does."""

    def rewind(self, tokens: int) -> None:
        """Forget what was archived from token index `tokens` on (after `LayerStore.restore`)."""

    def archive_call(self, call: Call) -> None:
        """Archive the call's unrotated K/V before any eviction: only a recall layer keeps an archive."""

    def prepare_fixed(self) -> None:
        """Size `fixed_rows` for the largest position a fixed step reads: a rank below the slots of S and R,
        or a token index below the context window."""
        rolling = self.positions == "rolling"
        self.fixed_rows = self.store.slots + self.policy.recall_slots if rolling else self.max_positions

    def stepped_fixed(self) -> None:
        """The Python counters after a fixed step (`LayerStore.stepped_fixed`)."""
        self.store.stepped_fixed(self.policy.evicts)

    def fixed_buffers(self) -> list[torch.Tensor]:
        """Every tensor a fixed step reads or writes in place (`H2OCache.fixed_buffers`)."""
        store = self.store
        return [getattr(store, name) for name in store._state_names()] + [*self.fixed_tables()]

    def report(self, recall_slots: int | None = None) -> LayerSlots:
        """What this layer's slots hold now (`LayerSlots`: views of the live buffers). `recall_slots`: the
        cache's recall slots per KV head when its policy recalls (a layer that does not, under
        `--recall-layers`, shows them empty), None otherwise."""
        recalled = None
        if recall_slots is not None:
            store = self.store
            shape = (store.n_kv_heads, recall_slots)
            recalled = torch.full(shape, -1, dtype=torch.int64, device=store.token_index.device)
        return self._slots(recalled)

    def _slots(self, recalled: torch.Tensor | None) -> LayerSlots:
        store = self.store
        return LayerSlots(
            token_index=store.token_index,
            rank=store.rank,
            valid=store.valid,
            scores=store.scores,
            last_probs=store.last_probs,
            length=store.length,
            tokens_seen=store.tokens_seen,
            recalled=recalled,
            pinned=store.pinned,
        )

    # A saved read (h2o_cli.saved). The store's pins go with its buffers; a layer kind with more state adds
    # its arrays and counters here and puts them back in `load_saved`.

    def saved_arrays(self) -> dict[str, torch.Tensor]:
        """What a saved read keeps of this layer, by name (live tensors, not copies): the store's buffers
        (`store.NAME`, `LayerStore.saved_arrays`), and with recall R's slots (`recall_keys`, `recall_values`,
        `recall_index`) and the archive's (`archive.NAME`, `ArchiveStore.saved_arrays`)."""
        arrays = {f"store.{name}": tensor for name, tensor in self.store.saved_arrays().items()}
        if self.recall_index is not None:
            arrays |= {name: getattr(self, name) for name in RECALL_SLOTS}
        if self.archive is not None:
            arrays |= {f"archive.{name}": tensor for name, tensor in self.archive.saved_arrays().items()}
        return arrays

    def saved_counters(self) -> dict:
        """The counters beside `saved_arrays` (the store's, the archive's, whose pages a recall layer takes)."""
        counters = {"store": self.store.saved_counters()}
        if self.archive is not None:
            counters |= {"archive": self.archive.saved_counters(), "lead_mode": self.lead_mode.value}
        return counters

    def load_saved(self, arrays, counters: dict) -> None:
        """Put back `saved_arrays` (a mapping by name) and `saved_counters` into a layer built with the same
        settings: it then goes on exactly as the layer they were taken from."""
        self.store.load_saved(Prefixed(arrays, "store."), counters["store"])
        if self.recall_index is not None:
            for name in RECALL_SLOTS:
                getattr(self, name).copy_(arrays[name])
        if self.archive is not None:
            self.archive.load_saved(Prefixed(arrays, "archive."), counters["archive"])
            self.lead_mode = type(self.lead_mode)(counters["lead_mode"])

    # The hooks through which a layer supplies its R and the positions of E_q to the path bodies.

    def recall_chunk(self, query: torch.Tensor, chunk: int) -> Recalled | None:
        """Pass 1 of a chunk just written (query [n_heads, chunk, head_dim], unrotated): R, or None (R = ∅)."""
        return None

    def slot_positions(self, chunk: int) -> tuple[torch.Tensor, int]:
        """The store's key positions [n_kv_heads, slots] (ranks, or token indices) and the first query's of
        the chunk just written."""
        store = self.store
        if self.positions == "rolling":
            return store.rank, store.length - chunk
        return store.token_index, store.tokens_seen - chunk

    def chunk_allowed(self, chunk: int) -> torch.Tensor:
        """Which of S's first `active` slots each query of the chunk just written sees: [n_kv_heads, chunk or 1,
        active] bool (`LayerStore.allowed`: every entry up to the query's own token)."""
        return self.store.allowed(chunk)

    def chunk_positions(self, chunk: int, recalled: Recalled | None) -> tuple[torch.Tensor, int]:
        """The positions [n_kv_heads, active + r] of S's first `active` slots and R's, and the chunk's first
        query's position."""
        positions, first = self.slot_positions(chunk)
        return positions[:, : self.store.active].clamp_min(0), first

    def merged_order(self, chunk: int) -> torch.Tensor | None:
        """Where R fills every head and positions roll: the columns of [S's first `active` slots, R's slots] in
        E's rank order, [n_kv_heads, length + r] (S's holes cut), so that read in that order the entries sit
        at positions 0 .. n-1 in every head; None where they would not (here: R = ∅)."""
        return None

    def step_entries(self, query: torch.Tensor, call: Call) -> tuple[torch.Tensor, int, Recalled | None]:
        """For a torch step after its write (S packed in `active` slots): the key positions [n_kv_heads,
        active + r], the query's position, and R (None)."""
        store = self.store
        views = store.first_slots(store.active)
        if self.positions == "rolling":
            return views["rank"], store.length - 1, None
        return views["token_index"], store.tokens_seen - 1, None

    def c_recall(self, query: torch.Tensor, call: Call) -> int:
        """Pass 1 of a C step, before it: the recall slots of the fullest head (0: R = ∅)."""
        return 0

    def fixed_entries(
        self, query: torch.Tensor, call: Call, length: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Recalled | None]:
        """For a fixed step after its write (`length` [n_kv_heads, 1] before it): the key positions over every
        slot of S and R, the query's position [1], and R (None)."""
        store = self.store
        if self.positions == "rolling":
            return store.rank, length[0], None
        return store.token_index.clamp_min(0), call.token, None

    @property
    def placement(self) -> KeyPlacement:
        """Where the C step places E_q's keys."""
        return KeyPlacement.ROLLING if self.positions == "rolling" else KeyPlacement.TOKEN_INDEX

    def step_key(self, key_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A step's new key [n_kv_heads, 1, head_dim], unrotated by one matmul with the pass's unrotation map."""
        return (key_states[0, :, 0] @ self.maps.unrotation(cos, sin)).unsqueeze(1)

    def step_query(
        self, call: Call, query: torch.Tensor, scaling: float, position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's query [n_kv, group, 2 * head_dim] in `expand` form at cache position `position` (its rank
        or token index), scaled, grouped by KV head, and the key table `step_attention` reads; built once per
        forward pass for every layer at that position."""
        rows = max(position + 1, self.store.slots) + self.policy.recall_slots
        query_map, step_table = self.maps.per_pass(
            call.cos,
            (position, scaling, rows),
            lambda: self._step_maps(call.cos, call.sin, position, scaling, query.device),
        )
        store = self.store
        return (query[0, :, 0] @ query_map).view(store.n_kv_heads, -1, 2 * store.head_dim), step_table

    def fixed_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin and `Rope.step_table` of the fixed step: `fixed_rows` long, sized once by `prepare_fixed`
        for the largest position this cache can reach (so reading them changes nothing)."""
        store, rows = self.store, self.fixed_rows
        cos_table, sin_table = self.rope.table(rows, store.compute_dtype, store.keys.device)
        return cos_table, sin_table, self.rope.step_table(rows, store.compute_dtype, store.keys.device)

    def _new_position(self) -> int:
        """The position of the next token written (its rank, or its token index)."""
        return self.store.length if self.positions == "rolling" else self.store.tokens_seen

    def _step_tables(self, position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables a one-token call at `position` reads: the query's and every key's position (ranks
        stay below the slots of S and R, token indices below the query's)."""
        rows = max(position + 1, self.store.slots) + self.policy.recall_slots
        return self.rope.table(rows, self.store.compute_dtype, device)

    def _step_maps(
        self, cos: torch.Tensor, sin: torch.Tensor, position: int, scaling: float, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query map and key table of a one-token step at `position` (`DecodeMaps.query`,
        `Rope.step_table`)."""
        cos_table, sin_table = self._step_tables(position, device)
        query_map = self.maps.query(cos, sin, position, scaling, cos_table, sin_table)
        return query_map, self.rope.step_table(cos_table.shape[0], cos_table.dtype, device)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.store.length + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens processed so far (not entries kept): generate slices new input ids with it."""
        return self.store.tokens_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store.reset()
        self._call = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedModelError("beam search is not supported with the H2O cache; use greedy or sampling")


class Prefixed:
    """The entries of a mapping whose names start with `prefix`, by the rest of the name (read on demand)."""

    def __init__(self, arrays, prefix: str) -> None:
        self.arrays, self.prefix = arrays, prefix

    def __getitem__(self, name: str):
        return self.arrays[self.prefix + name]

    def get(self, name: str, default=None):
        return self.arrays.get(self.prefix + name, default)


__all__ = ["LAYER_KWARG", "H2OLayer", "Recalled"]

"""The H2O cache, speaking the transformers `Cache` protocol.

`H2OCache(model, settings)` holds one `H2OLayer` per decoder layer. The model's attention calls
`cache.update(k, v, layer_idx, kwargs=...)` and then the registered "h2o" attention function
(`h2o_cli.attention`), which receives the layer through those same kwargs and attends over its slots.
"""

from __future__ import annotations

import torch
from h2o_kernels import decode_attention, native, prefill_attention, slot_attention, use_triton
from h2o_kernels.dispatch import kernels_choice, triton_possible, use_native
from h2o_kernels.reference import rows
from transformers.cache_utils import Cache, CacheLayerMixin

from h2o_cli.archive import PageArchive
from h2o_cli.config import CacheSettings
from h2o_cli.decode_step import DecodeMaps, one_thread, step_attention
from h2o_cli.errors import ContextOverflowError, UnsupportedModelError, UsageError
from h2o_cli.kvquant import storage_dtype
from h2o_cli.memory import ModelShape
from h2o_cli.models.families import check_family, text_config
from h2o_cli.policies import make_policy
from h2o_cli.policies.base import lowest_outside_recent
from h2o_cli.positions import Rope, rotate, unrotate
from h2o_cli.recall_step import RecallCounts, recall_is_full, recall_step_attention, rolling_step_positions
from h2o_cli.store import LayerStore
from h2o_cli.threads import DecodeThreads

LAYER_KWARG = "h2o_layer"


class H2OLayer(CacheLayerMixin):
    """One decoder layer's cache: a `LayerStore` plus the step logic of SPEC.md."""

    is_sliding = False
    is_compileable = False
    step_keys_by_map = True  # the decode step unrotates the new keys by a matmul (False: as the chunk path)

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
        self._model_rotation: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of the chunk
        self._chunk = 0
        self._new_states: tuple[torch.Tensor, torch.Tensor] | None = None  # the call's K/V, unrotated
        # One-token calls on the torch path take `_attend_step` (h2o_cli.decode_step; recall's: recall_step).
        self.maps = maps or DecodeMaps()
        self._step_path = store.compute_dtype in (torch.float32, torch.float64)
        self._step = False  # this call takes it
        # The C step's fixed arguments (`_native_buffers`); None: not looked at yet, False: not for this layer.
        self._native: native.StepBuffers | bool | None = None

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
        for `attend`, which writes them into the store."""
        if key_states.shape[0] != 1:
            raise UnsupportedModelError("the H2O cache holds one sequence; run with batch size 1")
        if self._chunk:
            raise UnsupportedModelError(
                "the model attended without the h2o attention function; "
                "load it with h2o_cli.load_model or call h2o_cli.enable(model) first"
            )
        chunk = key_states.shape[2]
        store = self.store
        if self.positions == "original":
            last = store.tokens_seen + chunk
            if last > self.max_positions:
                raise ContextOverflowError(
                    f"{last} tokens exceed the model's context window ({self.max_positions}) with "
                    f"{'original positions' if self.policy.evicts else f'policy {self.policy.name}'}; "
                    "use --positions rolling with an evicting policy to go further"
                )
        positions = (kwargs or {}).get("position_ids")
        if positions is None:
            positions = torch.arange(store.tokens_seen, store.tokens_seen + chunk, device=key_states.device)
        elif positions.numel() != chunk:
            positions = positions.reshape(-1)[-chunk:]
        # The same tensor object for every layer of a forward pass, so Rope computes its cos/sin once per pass.
        cos, sin = self.rope.cos_sin(positions, key_states.dtype, reuse=not self.first_layer)
        self._step = (
            chunk == 1
            and self._step_path
            and key_states.dtype == store.compute_dtype
            and not use_triton(key_states.device, self.settings.kernels)
            and self.maps.usable(*self._step_tables(self._new_position(), key_states.device))
        )
        if self._step and self.step_keys_by_map:  # [n_kv_heads, 1, head_dim] by one matmul with U
            keys = (key_states[0, :, 0] @ self.maps.unrotation(cos, sin)).unsqueeze(1)
        else:
            keys = unrotate(key_states[0], cos, sin)
        # Written to the store by `attend`, in sub-chunks that fit the spare slots (a call may bring more).
        self._new_states = (keys, value_states[0])
        self._model_rotation = (cos, sin)
        self._chunk = chunk
        if kwargs is not None:
            kwargs[LAYER_KWARG] = self  # read by h2o_cli.attention.h2o_attention right after this call
        return self.keys, self.values

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of the call given to `update`, with score accumulation and eviction (SPEC steps 1-4).

        query: [1, n_heads, chunk, head_dim] rotated by the model. Returns [1, chunk, n_heads, head_dim].
        A call longer than the free slots is processed in sub-chunks that fit (write, attend, accumulate,
        evict, next), exactly as if the caller had sent those smaller chunks: the buffers never grow.
        """
        store = self.store
        if self._chunk == 1 and self._step_path and store.active > store.length + 1:
            store.compact()  # a chunk's evictions left holes: decode steps read `budget + 1` slots from now on
        if self._step:
            return self._attend_step(query, scaling)
        chunk = self._chunk
        keys, values = self._new_states
        self._chunk, self._new_states = 0, None
        cos, sin = (tensor.to(query.dtype) for tensor in self._model_rotation)
        query = unrotate(query[0], cos, sin)  # [n_heads, chunk, head_dim]
        outputs, start = [], 0
        while start < chunk:
            size = min(chunk - start, store.slots - store.length)
            assert size > 0, "eviction leaves at least the spare slots free"
            part = slice(start, start + size)
            store.write(keys[:, part], values[:, part])
            outputs.append(self._attend_written(query[:, part].contiguous(), scaling))
            start += size
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def _new_position(self) -> int:
        """The position of the next token written (its rank, or its token index)."""
        return self.store.length if self.positions == "rolling" else self.store.tokens_seen

    def _step_tables(self, position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables a one-token call at `position` reads: the query's and every key's position
        (ranks stay below `slots`, token indices below the query's)."""
        return self.rope.table(max(position + 1, self.store.slots), self.store.compute_dtype, device)

    def _attend_step(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """`attend` for one token on the torch path (`update` chose it): the same steps in far fewer ops
        (h2o_cli.decode_step), on one thread, or as one C call once the cache is full (`_native_step`).
        query: [1, n_heads, 1, head_dim] rotated by the model. Returns [1, 1, n_heads, head_dim]."""
        if self.store.length == self.store.budget and self._native_buffers(query.shape[1]) is not None:
            return self._native_step(query, scaling)
        with one_thread():
            return self._step_on_one_thread(query, scaling)

    def _native_buffers(self, n_heads: int) -> native.StepBuffers | None:
        """The C step's fixed arguments when it can run this layer (h2o_kernels.native), else None."""
        if self._native is None:
            store = self.store
            self._native = False
            if (
                self.policy.kernel_victim
                and not self.policy.recalls
                and store.keys.dtype == store.compute_dtype == torch.float32
                and use_native(store.keys.device, self.settings.kernels)
            ):
                self._native = native.StepBuffers(store, n_heads // store.n_kv_heads)
        return self._native or None

    def _take_step(
        self, query: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The one-token call `update` left: (new keys, values, the query in `expand` form at the token's
        cache position, scaled, grouped by KV head, and the key table `step_attention` reads). Clears the
        call; read before the token is written (its position is the store's length or token count)."""
        keys, values, cos, sin = self._call_left()
        position = self._new_position()
        query_map, step_table = self.maps.per_pass(
            cos, (position, scaling), lambda: self._step_maps(cos, sin, position, scaling, query.device)
        )
        return keys, values, self._grouped(query, query_map), step_table

    def _call_left(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(new keys, values, the model's cos, sin) of the one-token call `update` left; clears the call."""
        keys, values = self._new_states
        cos, sin = self._model_rotation
        self._chunk, self._new_states, self._step = 0, None, False
        return keys, values, cos, sin

    def _grouped(self, query: torch.Tensor, query_map: torch.Tensor) -> torch.Tensor:
        """The model's query [1, n_heads, 1, head_dim] through a step's query map: [n_kv, group, 2 * head_dim]."""
        store = self.store
        return (query[0, :, 0] @ query_map).view(store.n_kv_heads, -1, 2 * store.head_dim)

    def _evict_after_step(self) -> None:
        """Eviction after a one-token step: with one entry over budget under the `kernel_victim` rule, one
        min over the packed slots (no priority array); otherwise the policy's own `evict`."""
        store, policy = self.store, self.policy
        if policy.kernel_victim and store.length - store.budget == 1:
            views = store.first_slots(store.active)
            limit = store.length - policy.recent_slots
            store.drop(lowest_outside_recent(views["scores"], views["rank"], limit))
        else:
            store.evict(policy)

    def _native_step(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """`_step_on_one_thread` as one C call: the store is full, so the write takes the one hole (or the
        slot above the packed entries) and exactly one entry is evicted, by the `kernel_victim` rule."""
        store, policy = self.store, self.policy
        keys, values, grouped, step_table = self._take_step(query, scaling)
        output = native.decode_step(
            self._native,
            grouped,
            keys,
            values,
            step_table,
            rolling=self.positions == "rolling",
            limit=store.length + 1 - policy.recent_slots,
            decay=policy.decay_per_query,
        )
        return output.to(query.dtype).view(1, 1, -1, store.head_dim)

    def _step_on_one_thread(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        store = self.store
        keys, values, grouped, step_table = self._take_step(query, scaling)
        store.write(keys, values)
        # Every slot below `active` holds an entry now: `attend` packed a chunk's holes, at most one was left
        # (by the last eviction), and the write filled the lowest free slot. So no mask, clamp or validity test.
        active = store.active
        views = store.first_slots(active)
        key_positions = views["rank"] if self.positions == "rolling" else views["token_index"]
        output, probs = step_attention(
            grouped, store.key_states(active), store.value_states(active), key_positions, step_table
        )
        increments = views["last_probs"]  # one query: its probabilities are also the last ones
        torch.sum(probs, dim=1, out=increments)
        store.accumulate(increments, increments, 1, decay=self.policy.decay_per_query)
        self._evict_after_step()
        return output.to(query.dtype).view(1, 1, -1, store.head_dim)

    def _step_maps(
        self, cos: torch.Tensor, sin: torch.Tensor, position: int, scaling: float, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query map and key table of a one-token step at `position` (`DecodeMaps.query`,
        `Rope.step_table`); the same for every layer of a pass."""
        cos_table, sin_table = self._step_tables(position, device)
        query_map = self.maps.query(cos, sin, position, scaling, cos_table, sin_table)
        return query_map, self.rope.step_table(cos_table.shape[0], cos_table.dtype, device)

    def _attend_written(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attend the chunk just written (query [n_heads, chunk, head_dim], unrotated), accumulate, evict.
        Returns [1, chunk, n_heads, head_dim]."""
        chunk, store = query.shape[1], self.store
        dtype = query.dtype
        if self.positions == "rolling":
            key_positions = store.rank
            first_query_position = store.length - chunk
        else:
            key_positions = store.token_index
            first_query_position = store.tokens_seen - chunk
        cos_table, sin_table = self.rope.table(first_query_position + chunk, dtype, query.device)
        decay = self.policy.decay_per_query
        # The prefill kernel sums a chunk's probabilities unweighted: decayed chunks take the torch path.
        if use_triton(query.device, self.settings.kernels) and (chunk == 1 or decay == 1.0):
            return self._attend_fused(
                query, key_positions, first_query_position, cos_table, sin_table, scaling
            )
        key_positions = key_positions[:, : store.active].clamp_min(0)
        query_positions = slice(first_query_position, first_query_position + chunk)
        query_weights = None
        if decay != 1.0 and chunk > 1:  # query i's probabilities are decayed by the chunk's later queries
            query_weights = decay ** torch.arange(chunk - 1, -1, -1, dtype=torch.float32, device=query.device)
        output, increments, last_probs = slot_attention(
            query,
            store.key_states(store.active),
            store.value_states(store.active),
            store.allowed(chunk),
            cos_table[query_positions],
            sin_table[query_positions],
            rows(cos_table, key_positions),
            rows(sin_table, key_positions),
            scaling,
            query_weights,
        )
        store.accumulate(increments, last_probs, chunk, decay=decay)
        store.evict(self.policy)
        return output.transpose(0, 1).unsqueeze(0)

    def _attend_fused(self, query, key_positions, first_query_position, cos_table, sin_table, scaling):
        """The CUDA path: one Triton launch per layer for decode (scores accumulated in place, eviction
        candidate found in the same pass), the two-pass prefill kernel for a chunk."""
        chunk, store = query.shape[1], self.store
        if chunk > 1:
            output, increments, last_probs = prefill_attention(
                query, store.key_states(), store.value_states(), store.valid, store.token_index, key_positions,
                store.tokens_seen - chunk, first_query_position, cos_table, sin_table, scaling,
                kernels=self.settings.kernels,
            )  # fmt: skip
            store.accumulate(increments, last_probs, chunk)
            store.evict(self.policy)
            return output.transpose(0, 1).unsqueeze(0)
        policy = self.policy
        if policy.decay_per_query != 1.0:  # the kernel adds this step's probabilities to γ·õ
            store.scores.mul_(policy.decay_per_query)
        heavy_hitter = policy.kernel_victim and store.length - store.budget == 1
        recent_rank = store.length - policy.recent_slots if heavy_hitter else 0
        output, increments, candidate = decode_attention(
            query[:, 0], store.key_states(), store.value_states(), store.valid, key_positions, store.rank,
            store.token_index,
            first_query_position, cos_table, sin_table, scaling, store.scores, recent_rank,
            kernels=self.settings.kernels,
        )  # fmt: skip
        store.accumulate(increments, increments, chunk, scores_added=True)
        if heavy_hitter:
            store.drop(candidate.unsqueeze(1))
        else:
            store.evict(policy)
        return output.unsqueeze(0).unsqueeze(0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.store.length + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens processed so far (not entries kept): generate slices new input ids with it."""
        return self.store.tokens_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store.reset()
        self._chunk = 0
        self._new_states = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedModelError("beam search is not supported with the H2O cache; use greedy or sampling")


class RecallLayer(H2OLayer):
    """A layer of the `recall` policy (docs/spec.md): `H2OLayer`'s store holds S, managed as `h2o`; every
    token is also written to a `PageArchive`, and each step refills `recall_slots` slots per KV head from it.

    The step runs on the torch reference (also on CUDA): pass 1 chooses the recalled tokens with the chunk's
    queries, pass 2 attends over S, them and the chunk with the exact softmax, scores S only, evicts. A
    one-token call takes the same steps in far fewer ops (`_step_on_one_thread`, h2o_cli.recall_step), or as
    C calls on the CPU once S is full (`_native_recall_step`, h2o_kernels/recall_step.c).
    """

    # The new keys are unrotated elementwise, as the chunk path does, so the archive, its page summaries and
    # hence the page choice are bit for bit the chunk path's.
    step_keys_by_map = False

    def add_archive(
        self,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        bits: int | None = None,
        region=None,
    ) -> None:
        """Allocate the archive (`capacity` tokens; `bits` and `region` as `PageArchive`) and the recall slots
        `[n_kv_heads, recall_slots, head_dim]` (in `dtype`, the compute dtype)."""
        store, policy = self.store, self.policy
        self.archive = PageArchive(
            store.n_kv_heads, store.head_dim, capacity, policy.page_size, dtype, device, bits, region
        )
        shape = (store.n_kv_heads, policy.recall_slots)
        self.recall_keys = torch.zeros(*shape, store.head_dim, dtype=dtype, device=device)
        self.recall_values = torch.zeros(*shape, store.head_dim, dtype=dtype, device=device)
        self.recall_index = torch.full(shape, -1, dtype=torch.int64, device=device)  # token index, -1 = empty
        self.counts = RecallCounts(store.n_kv_heads)
        # The C step's fixed arguments (`_recall_buffers`); None: not looked at yet, False: not for this layer.
        self._native_recall: native.RecallBuffers | bool | None = None

    @property
    def recalled(self) -> float:
        """Tokens recalled per KV head in the last step (the mean over heads)."""
        return self.counts.recalled

    @property
    def hits(self) -> float:
        """Of them, already in the recall slots the step before (not read again)."""
        return self.counts.hits

    @property
    def recalled_total(self) -> float:
        """`recalled` summed over every step since the start."""
        return self.counts.recalled_total

    @property
    def hits_total(self) -> float:
        return self.counts.hits_total

    @property
    def steps(self) -> int:
        return self.counts.steps

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs=None, **extra):
        """As `H2OLayer.update`, and archive the call's unrotated K/V (write-through, before any eviction)."""
        result = super().update(key_states, value_states, *args, kwargs=kwargs, **extra)
        keys, values = self._new_states
        if keys.shape[1] == 1 and self._step and self._recall_buffers() is not None:
            native.archive_token(self._native_recall, keys, values)  # one C call for the same writes
        else:
            self.archive.write(keys, values)
        return result

    def _attend_written(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The recall step for the chunk just written (query [n_heads, chunk, head_dim], unrotated).
        Returns [1, chunk, n_heads, head_dim]."""
        chunk, store = query.shape[1], self.store
        n_kv, active, first = store.n_kv_heads, store.active, store.tokens_seen - chunk
        slots, hits = self.recall_index.shape[1], 0
        if slots:  # pass 1: the chunk's queries choose archived tokens, read back into the recall slots
            grouped = self._page_query(query, chunk).reshape(
                n_kv, -1, store.head_dim
            )  # [n_kv, group * chunk, d]
            chosen, valid = self.archive.choose(grouped, store.token_index[:, :active], first, slots)
            hits = self._read_back(chosen, valid)
        self.counts.add((self.recall_index >= 0).sum(), hits)
        # Pass 2: E_q = S ∪ R ∪ {chunk tokens <= q}; R is older than the chunk, so every query sees all of it.
        token_index = torch.cat([store.token_index[:, :active], self.recall_index], dim=1)
        present = token_index >= 0
        allowed = torch.cat(
            [
                store.allowed(chunk).expand(-1, chunk, -1),
                present[:, active:].unsqueeze(1).expand(-1, chunk, -1),
            ],
            dim=2,
        )
        if self.positions == "rolling":
            # Rank by token index among the entries present; heads with fewer entries are shifted up so every
            # head's queries share positions (RoPE logits depend only on the distance, which stays the rank's).
            order = torch.argsort(token_index.masked_fill(~present, torch.iinfo(torch.int64).max), dim=1)
            steps = torch.arange(order.shape[1], device=order.device).expand_as(order)
            rank = torch.empty_like(order).scatter_(1, order, steps)
            entries = present.sum(dim=1, keepdim=True)
            key_positions = torch.where(present, rank + entries.max() - entries, 0)
            first_query_position = int(entries.max()) - chunk
        else:
            key_positions = token_index.clamp_min(0)
            first_query_position = first
        cos_table, sin_table = self.rope.table(first_query_position + chunk, query.dtype, query.device)
        query_positions = slice(first_query_position, first_query_position + chunk)
        output, increments, last_probs = slot_attention(
            query,
            torch.cat([store.key_states(active), self.recall_keys.to(store.compute_dtype)], dim=1),
            torch.cat([store.value_states(active), self.recall_values.to(store.compute_dtype)], dim=1),
            allowed,
            cos_table[query_positions],
            sin_table[query_positions],
            cos_table[key_positions],
            sin_table[key_positions],
            scaling,
        )
        store.accumulate(increments[:, :active], last_probs[:, :active], chunk)  # S only: r = 0 is h2o
        store.evict(self.policy)
        return output.transpose(0, 1).unsqueeze(0)

    def _step_on_one_thread(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The recall step of one token (decode) on the torch path (`update` chose it; `attend` packed S into
        its lowest slots): pass 1 by `PageArchive.choose_one`, pass 2 by one softmax over S and R at the
        positions of `rolling_step_positions` or token indices, S's scores, eviction. The chunk path's result
        (docs/spec.md; h2o_cli.recall_step says why each part is the same). query: [1, n_heads, 1, head_dim]
        rotated by the model. Returns [1, 1, n_heads, head_dim]."""
        if self.store.length == self.store.budget and self._recall_buffers() is not None:
            return self._native_recall_step(query, scaling)
        store, archive = self.store, self.archive
        keys, values, cos, sin = self._call_left()
        store.write(keys, values)
        active, n_kv, head_dim = store.active, store.n_kv_heads, store.head_dim  # active == length: packed
        resident = store.token_index[:, :active]
        slots = self.recall_index.shape[1]
        full = recall_is_full(archive.held(), store.length, slots)
        if slots:
            chosen, valid = archive.choose_one(self._step_page_query(query, cos, sin), resident, slots)
            if archive.region is None:
                hits = self._read_all(chosen, valid, full)
            else:  # a file archive reads only the tokens new to the recall slots
                hits = self._read_back(chosen, valid)
            self.counts.add(slots * n_kv if full else valid.sum(), hits)
        else:
            self.counts.add(0, 0)
        present = None if full else self.recall_index >= 0
        if self.positions == "rolling":
            key_positions, position = rolling_step_positions(resident, self.recall_index, full)
        else:
            key_positions = torch.cat([resident, self.recall_index.clamp_min(0)], dim=1)
            position = store.tokens_seen - 1
        query_map, step_table = self._step_maps(cos, sin, position, scaling, query.device)
        output, probs = recall_step_attention(
            self._grouped(query, query_map),
            store.key_states(active),
            store.value_states(active),
            self.recall_keys,
            self.recall_values,
            key_positions,
            step_table,
            present,
        )
        increments = probs[:, :, :active].sum(dim=1)  # [n_kv, active]: S only (r = 0 is h2o)
        store.accumulate(increments, increments, 1)
        self._evict_after_step()
        return output.to(query.dtype).view(1, 1, -1, head_dim)

    def _recall_buffers(self) -> native.RecallBuffers | None:
        """The C step's fixed arguments when it can run this layer (h2o_kernels.native, recall_step.c): a
        `kernel_victim` policy, float32 store and a float32 archive in RAM on the CPU, `--kernels auto` or
        `native` with a C compiler; else None (the torch step)."""
        if self._native_recall is None:
            store, archive = self.store, self.archive
            self._native_recall = False
            if (
                self.policy.kernel_victim
                and store.keys.dtype == store.compute_dtype == torch.float32
                and archive.region is None
                and archive.keys.dtype == archive.dtype == torch.float32
                and use_native(store.keys.device, self.settings.kernels)
            ):
                self._native_recall = native.RecallBuffers(self)
        return self._native_recall or None

    def _native_recall_step(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """`_step_on_one_thread` as two C calls (recall_step.c) for a full S: the page bounds by torch
        (`PageArchive.step_bounds`), then `recall_choose` (the rest of `choose_one` and the read into the
        recall slots), the query map for the position that leaves, and `recall_decode_step` (write, attention
        over S ∪ R, S's scores, eviction). The same recalled tokens as the torch step, the rest to float
        rounding."""
        store, archive, policy = self.store, self.archive, self.policy
        keys, values, cos, sin = self._call_left()
        buffers = self._native_recall
        most = 0  # recall slots of the fullest head
        if self.recall_index.shape[1]:
            bounds = archive.step_bounds(self._step_page_query(query, cos, sin))
            recalled, hits = native.recall_choose(buffers, bounds)
            most = buffers.totals[1]
            self.counts.add(recalled, hits)
        else:
            self.counts.add(0, 0)
        rolling = self.positions == "rolling"
        # The query's position: its rank in E_q (S after the write, and the fullest head's R), or its index.
        position = store.length + most if rolling else store.tokens_seen
        query_map, step_table = self._step_maps(cos, sin, position, scaling, query.device)
        output = native.recall_step(
            buffers,
            self._grouped(query, query_map),
            keys,
            values,
            step_table,
            rolling=rolling,
            limit=store.length + 1 - policy.recent_slots,
            decay=policy.decay_per_query,
            entries=position + 1,
        )
        return output.to(query.dtype).view(1, 1, -1, store.head_dim)

    def _step_page_query(self, query: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A one-token step's page-scoring queries [n_kv, group, head_dim]: the model's rotated query unrotated
        elementwise, as the chunk path has it, so the page bounds are bit for bit the chunk path's."""
        unrotated = unrotate(query[0, :, 0], cos.to(query.dtype), sin.to(query.dtype))
        return self._page_query(unrotated, 1).view(self.store.n_kv_heads, -1, self.store.head_dim)

    def _page_query(self, query: torch.Tensor, chunk: int) -> torch.Tensor:
        """The queries (unrotated, any shape [..., head_dim]) that score archive pages, in float32: as they are
        (`--page-score unrotated`) or rotated by the mean rotation over the distances the policy gives for a
        chunk of `chunk` tokens (`positional`; docs/spec.md, recall), the chunk already archived. Elementwise,
        so a one-token step scores bit for bit as a chunk of one."""
        query = query.float()
        distances = self.policy.score_distances(self.positions == "rolling", chunk, self.archive.tokens)
        if distances is None:
            return query
        return rotate(query, *self.rope.mean_rotation(*distances, query.device))

    def _step_tables(self, position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """As `H2OLayer._step_tables`, with room for the recall slots' positions."""
        slots = self.recall_index.shape[1]
        return self.rope.table(max(position + 1, self.store.slots) + slots, self.store.compute_dtype, device)

    def _read_all(self, chosen: torch.Tensor, valid: torch.Tensor, full: bool) -> torch.Tensor:
        """`_read_back` for a RAM archive: every chosen token read from the archive in one row gather (a
        hit's K/V are the archive's own, so the slots end up the same). Returns the hits (a 0-d tensor)."""
        archive = self.archive
        wanted = archive.token_index.take(chosen)  # [n_kv, r] token indices
        if not full:
            wanted.masked_fill_(~valid, -1)
        # Hits: the slots' tokens so far, placed at their ring slots (they were archived at the last step, so
        # no two share one, all below `span`; empty slots go to a spare column), read at the chosen slots.
        held, span = self.recall_index, archive.span
        before = torch.full((held.shape[0], span + 1), -1, dtype=held.dtype, device=held.device)
        before.scatter_(1, torch.where(held >= 0, held % archive.capacity, span), held)
        hit = before.gather(1, chosen) == wanted
        hits = (hit if full else hit & valid).sum()
        archive.read_into(chosen, self.recall_keys, self.recall_values)
        if not full:
            empty = ~valid.unsqueeze(-1)
            self.recall_keys.masked_fill_(empty, 0)
            self.recall_values.masked_fill_(empty, 0)
        self.recall_index.copy_(wanted)
        return hits

    def _read_back(self, chosen: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Fill the recall slots with archive slots `chosen` [n_kv, r] where `valid`, in that order (empty: 0).

        A token already in a recall slot (a hit: chosen again) is moved from there; only the others are read
        from the archive, so a disk archive reads just the pages that are new to the slots.
        Returns the hits summed over KV heads (a 0-d tensor)."""
        wanted = torch.where(valid, self.archive.token_index[chosen], -1)  # [n_kv, r] token indices
        held, order = self.recall_index.sort(dim=1)
        place = torch.searchsorted(held, wanted).clamp_max(held.shape[1] - 1)
        hit = (held.gather(1, place) == wanted) & valid
        source = order.gather(1, place).unsqueeze(-1).expand(-1, -1, self.recall_keys.shape[-1])
        keys, values = self.recall_keys.gather(1, source), self.recall_values.gather(1, source)
        heads, columns = (valid & ~hit).nonzero(as_tuple=True)
        keys[heads, columns], values[heads, columns] = self.archive.read(heads, chosen[heads, columns])
        empty = ~valid.unsqueeze(-1)
        self.recall_keys.copy_(keys.masked_fill_(empty, 0))
        self.recall_values.copy_(values.masked_fill_(empty, 0))
        self.recall_index.copy_(wanted)
        return hit.sum()

    def reset(self) -> None:
        super().reset()
        self.archive.reset()
        self.recall_index.fill_(-1)
        self.counts.reset()


def compute_dtype(model) -> torch.dtype:
    """The dtype attention runs in: the first float parameter's (bitsandbytes weights are int8/uint8)."""
    for param in model.parameters():
        if param.dtype.is_floating_point:
            return param.dtype
    return model.dtype


class H2OCache(Cache):
    """A fixed-memory KV cache for one sequence with H2O (or another) eviction policy.

    A fractional budget is resolved against the model's context window. `span` is the most tokens this cache
    will be given (default: the context window): a policy that never evicts preallocates that many.
    With rolling positions, `budget + chunk` (capped at `span`) must fit in the context window, else a
    `UsageError` names the fix (positions would pass the window the model was trained on).

    Example:
        cache = H2OCache(model, CacheSettings(budget=256))
        model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
    """

    def __init__(self, model, settings: CacheSettings, span: int | None = None) -> None:
        from h2o_cli.attention import enable

        check_family(model)
        enable(model)
        self.shape = shape = ModelShape.from_config(text_config(model))  # also the memory accounting's
        self.max_positions = shape.context
        self.settings = settings = settings.resolved(shape.context)
        self.quant = getattr(model, "h2o_quant", "none")
        policy = make_policy(settings)
        budget = policy.kept_tokens(min(span or shape.context, shape.context))
        # Attention reads the kept entries, the recall slots and the chunk: positions reach their sum.
        check_rolling_window(settings, budget + policy.recall_slots, span, shape.context)
        param = next(model.parameters())
        check_kernels(settings.kernels, param.device)
        # What `generate_ids` decodes on; on a GPU the step's time is not the CPU's threads' to choose.
        self.decode_threads = DecodeThreads(settings.decode_threads, measure=param.device.type == "cpu")
        dtype = compute_dtype(model)
        rope = Rope(model.model.rotary_emb, shape.head_dim)
        maps = DecodeMaps()
        layer_class = RecallLayer if policy.recalls else H2OLayer
        layers = [
            layer_class(
                LayerStore(
                    shape.n_kv_heads,
                    shape.head_dim,
                    budget,
                    settings.chunk,
                    storage_dtype(settings.kv_bits, dtype),
                    param.device,
                    compute_dtype=dtype,
                ),
                settings,
                rope,
                self.max_positions,
                first_layer=number == 0,
                maps=maps,
            )
            for number in range(shape.n_layers)
        ]
        self.archive_file = None  # the recall archive's mapped file, with --archive disk or PATH
        if policy.recalls:
            self._add_archives(layers, policy, span, dtype, param.device)
        super().__init__(layers=layers)

    def _add_archives(self, layers: list[RecallLayer], policy, span: int | None, dtype, device) -> None:
        """Give every layer its `PageArchive`, in RAM or in one mapped file (docs/spec.md, recall: storage)."""
        from h2o_cli import memory
        from h2o_cli.archive_file import ArchiveFile, aligned, archive_location

        settings, shape = self.settings, self.shape
        bits, page = settings.archive_bits, policy.page_size
        page_bytes = memory.archive_bytes(shape, page, page, dtype.itemsize, bits)
        capacity = policy.archive_tokens(span, page_bytes)
        regions = [None] * len(layers)
        if settings.archive != "ram":
            if device.type != "cpu":
                raise UsageError(
                    f"--archive {settings.archive} maps a file into CPU memory, but the model runs on {device}; "
                    "use --archive ram (the archive then lives in device memory) or --device cpu"
                )
            region = aligned(
                PageArchive.stored_bytes(shape.n_kv_heads, shape.head_dim, capacity, dtype, bits)
            )
            where = archive_location(settings.archive, settings.keep_archive)
            self.archive_file = ArchiveFile(where, region * len(layers), settings.keep_archive)
            regions = [self.archive_file.region(region) for _ in layers]
        for layer, region in zip(layers, regions, strict=True):
            layer.add_archive(capacity, dtype, device, bits, region)

    def close(self) -> None:
        """Remove the recall archive's file now (unless kept); it is removed anyway when the cache is
        collected or the interpreter exits. The cache must not be used afterwards with a file archive."""
        if self.archive_file is not None:
            self.archive_file.close()

    @property
    def policy(self):
        """The eviction policy (`h2o_cli.policies`); every layer holds an equal one."""
        return self.layers[0].policy

    @property
    def positions(self) -> str:
        """The positions in use: `settings.positions` unless the policy allows only others."""
        return self.layers[0].positions

    @property
    def stores(self) -> list[LayerStore]:
        return [layer.store for layer in self.layers]

    def nbytes(self) -> int:
        """Bytes of all preallocated cache buffers."""
        return sum(store.nbytes() for store in self.stores)

    @property
    def tokens_seen(self) -> int:
        return self.stores[0].tokens_seen

    def rewind_archive(self, tokens: int) -> None:
        """With a recalling policy, forget archived tokens from index `tokens` on (the stores were put back to
        that point, e.g. by the eval scorer's snapshot); nothing otherwise."""
        for layer in self.layers:
            if isinstance(layer, RecallLayer):
                layer.archive.rewind(tokens)
                layer.recall_index.fill_(-1)

    def archive_summary(self) -> dict:
        """The archive's figures with a recalling policy, else {} (docs/spec.md, recall: reporting).

        `archive_bytes` (all layers, preallocated) = `archive_ram_bytes` (token index, summaries, and the K/V of
        a RAM archive) + `archive_disk_bytes` (the K/V of a file archive); `archive_token_bytes` per token;
        `archive_tokens` (tokens held), `archive_reach` = `archive_oldest` (the oldest token still recallable);
        `recall_slots` and their bytes; `recalled_per_step` (tokens per KV head, mean over layers and steps),
        of which `recall_hits` were already in the recall slots and `archive_reads_per_step` were read."""
        layers = [layer for layer in self.layers if isinstance(layer, RecallLayer)]
        if not layers:
            return {}
        archive = layers[0].archive
        steps = sum(layer.steps for layer in layers)
        recalled = sum(layer.recalled_total for layer in layers) / steps if steps else 0.0
        hits = sum(layer.hits_total for layer in layers) / steps if steps else 0.0
        kept = self.archive_file is not None and self.settings.keep_archive
        return {
            "archive_storage": "ram" if self.archive_file is None else "disk",
            "archive_path": None if self.archive_file is None else str(self.archive_file.path),
            "archive_kept": kept,
            "archive_bits": self.settings.archive_bits,
            "archive_bytes": sum(layer.archive.nbytes() for layer in layers),
            "archive_ram_bytes": sum(layer.archive.ram_bytes() for layer in layers),
            "archive_disk_bytes": sum(layer.archive.disk_bytes() for layer in layers),
            "archive_token_bytes": sum(layer.archive.token_bytes() for layer in layers),
            "archive_capacity": archive.capacity,
            "archive_tokens": archive.held(),
            "archive_reach": archive.oldest,
            "archive_oldest": archive.oldest,
            "recall_slots": self.policy.recall_slots,
            "recall_slot_bytes": sum(
                tensor.nbytes
                for layer in layers
                for tensor in (layer.recall_keys, layer.recall_values, layer.recall_index)
            ),
            "recalled_per_step": recalled,
            "recall_hits": hits,
            "archive_reads_per_step": recalled - hits,
        }

    @property
    def length(self) -> int:
        """Entries each KV head holds now."""
        return self.stores[0].length


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


def check_kernels(kernels: str, device: torch.device) -> None:
    """Refuse `--kernels triton` (or `$H2O_KERNELS`) where Triton cannot run, and an unknown `$H2O_KERNELS`."""
    try:
        choice = kernels_choice(kernels)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if choice == "triton" and not triton_possible(device):
        raise UsageError(
            f"--kernels triton needs a CUDA device and the triton package (device: {device}); "
            "use --kernels torch or auto"
        )
    if choice == "native" and torch.device(device).type != "cpu":
        raise UsageError(
            f"--kernels native is the CPU's decode step (device: {device}); use --kernels torch or auto"
        )


__all__ = ["H2OCache", "H2OLayer", "RecallLayer"]

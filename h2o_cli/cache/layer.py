"""One decoder layer's cache (`H2OLayer`): a `LayerStore` plus the step logic of SPEC.md.

The model's attention calls `layer.update(k, v, kwargs=...)` and then the registered "h2o" attention function
(`h2o_cli.cache.attention`), which receives the layer through those same kwargs and calls `layer.attend`.
"""

from __future__ import annotations

import torch
from h2o_kernels import decode_attention, native, prefill_attention, slot_attention, use_triton
from h2o_kernels.dispatch import use_native
from h2o_kernels.reference import lowest_outside_recent, rows
from transformers.cache_utils import CacheLayerMixin

from h2o_cli.cache.positions import Rope, unrotate
from h2o_cli.cache.step import DecodeMaps, one_thread, step_attention
from h2o_cli.cache.store import LayerStore
from h2o_cli.config import CacheSettings
from h2o_cli.errors import ContextOverflowError, UnsupportedModelError
from h2o_cli.policies import make_policy

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

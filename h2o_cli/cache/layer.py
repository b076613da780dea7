"""One decoder layer's cache (`H2OLayer`): a `LayerStore` plus the step logic of SPEC.md.

The model's attention calls `layer.update(k, v, kwargs=...)` and then the registered "h2o" attention function
(`h2o_cli.cache.attention`), which receives the layer through those same kwargs and calls `layer.attend`.
`update` chooses the call's path once (`_path`: the chunk path, its Triton form, the torch step or the C step)
and leaves it with the call's K/V in a `Call`; `attend` runs that path.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch
from h2o_kernels import decode_attention, prefill_attention, slot_attention, use_triton
from h2o_kernels.dispatch import use_native
from h2o_kernels.reference import lowest_outside_recent, rows
from transformers.cache_utils import CacheLayerMixin

from h2o_cli.cache.c_step import CStep
from h2o_cli.cache.fixed_step import accumulate_fixed, evict_fixed, fixed_query
from h2o_cli.cache.positions import Rope, unrotate
from h2o_cli.cache.step import DecodeMaps, one_thread, step_attention
from h2o_cli.cache.store import LayerStore
from h2o_cli.config import CacheSettings
from h2o_cli.errors import ContextOverflowError, UnsupportedModelError
from h2o_cli.policies import make_policy

LAYER_KWARG = "h2o_layer"


class CallPath(enum.Enum):
    """How a call is attended (`H2OLayer._path` chooses, once per call)."""

    CHUNK = "chunk"  # the reference: write, `slot_attention`, accumulate, evict (in sub-chunks that fit)
    TRITON = "triton"  # the chunk path on the fused Triton kernels (CUDA, `--kernels triton`)
    TORCH_STEP = "torch step"  # one token in far fewer ops (h2o_cli.cache.step), on one thread
    C_STEP = "C step"  # one token as one C call, once the cache is full (h2o_cli.cache.c_step)
    FIXED_STEP = (
        "fixed step"  # one token in fixed shapes, from tensors only: capturable (cache/fixed_step.py)
    )


STEPS = (CallPath.TORCH_STEP, CallPath.C_STEP)


@dataclass(slots=True)
class Call:
    """What `update` leaves for `attend`: the call's K/V, unrotated, the model's rotation of it, its path."""

    keys: torch.Tensor  # [n_kv_heads, chunk, head_dim]
    values: torch.Tensor
    cos: torch.Tensor  # [chunk, head_dim]
    sin: torch.Tensor
    path: CallPath
    token: torch.Tensor | None = None  # [1] int64, the token's index (the fixed step's, from position_ids)

    @property
    def chunk(self) -> int:
        return self.keys.shape[1]


class H2OLayer(CacheLayerMixin):
    """One decoder layer's cache: a `LayerStore` plus the step logic of SPEC.md."""

    is_sliding = False
    is_compileable = False
    step_keys_by_map = True  # the decode step unrotates the new keys by a matmul (False: as the chunk path)
    fused_kernels = True  # the chunk path may run on the Triton kernels
    asks = 0  # the call's last `asks` tokens are a question (H2OCache.asking): only `recall` reads it

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
        # One-token calls may take a step (h2o_cli.cache.step) in these compute dtypes (the fixed step, which
        # `H2OCache.fix_steps` checks, takes 16-bit ones too: `fixed_step.FIXED_DTYPES`).
        self._step_path = store.compute_dtype in (torch.float32, torch.float64)
        # While set (`H2OCache.fixed_step`), a one-token call takes the fixed step, the RoPE tables being
        # `fixed_rows` long (set by `H2OCache.fix_steps`).
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
        for `attend`, which writes them into the store."""
        if key_states.shape[0] != 1:
            raise UnsupportedModelError("the H2O cache holds one sequence; run with batch size 1")
        if self._call is not None:
            raise UnsupportedModelError(
                "the model attended without the h2o attention function; "
                "load it with h2o_cli.load_model or call h2o_cli.enable(model) first"
            )
        if self.fixed:
            return self._fixed_update(key_states, value_states, kwargs)
        chunk = key_states.shape[2]
        store = self.store
        if self.positions == "original":
            self.check_room(chunk)
        positions = (kwargs or {}).get("position_ids")
        if positions is None:
            positions = torch.arange(store.tokens_seen, store.tokens_seen + chunk, device=key_states.device)
        elif positions.numel() != chunk:
            positions = positions.reshape(-1)[-chunk:]
        # The same tensor object for every layer of a forward pass, so Rope computes its cos/sin once per pass.
        cos, sin = self.rope.cos_sin(positions, key_states.dtype, reuse=not self.first_layer)
        path = self._path(chunk, key_states)
        if path in STEPS and self.step_keys_by_map:  # [n_kv_heads, 1, head_dim] by one matmul with U
            keys = (key_states[0, :, 0] @ self.maps.unrotation(cos, sin)).unsqueeze(1)
        else:
            keys = unrotate(key_states[0], cos, sin)
        # Written to the store by `attend`, in sub-chunks that fit the spare slots (a call may bring more).
        self._call = Call(keys, value_states[0], cos, sin, path)
        if kwargs is not None:
            kwargs[LAYER_KWARG] = self  # read by h2o_cli.attention.h2o_attention right after this call
        return self.keys, self.values

    def check_room(self, chunk: int) -> None:
        """Refuse a call of `chunk` tokens that original positions would rotate past the context window."""
        if self.positions == "original":
            last = self.store.tokens_seen + chunk
            if last > self.max_positions:
                raise ContextOverflowError(
                    f"{last} tokens exceed the model's context window ({self.max_positions}) with "
                    f"{'original positions' if self.policy.evicts else f'policy {self.policy.name}'}; "
                    "use --positions rolling with an evicting policy to go further"
                )

    def prepare_fixed(self) -> None:
        """Size `fixed_rows` for the largest position a fixed step reads: a rank below `slots`, or a token
        index below the context window."""
        self.fixed_rows = self.store.slots if self.positions == "rolling" else self.max_positions

    def stepped_fixed(self) -> None:
        """The Python counters after a fixed step (`LayerStore.stepped_fixed`)."""
        self.store.stepped_fixed(self.policy.evicts)

    def _fixed_update(self, key_states: torch.Tensor, value_states: torch.Tensor, kwargs: dict | None):
        """`update` of a one-token call for the fixed step (h2o_cli.cache.fixed_step): its token index is the
        model's `position_ids` (the caller's tensor; no counter is read), its key unrotated elementwise."""
        positions = (kwargs or {}).get("position_ids")
        if key_states.shape[2] != 1 or positions is None:
            raise UnsupportedModelError("the fixed step takes one token per call, with its position_ids")
        token = positions.reshape(-1)[-1:]
        cos, sin = self.rope.rotation(token, key_states.dtype)
        keys = unrotate(key_states[0], cos, sin)
        self._call = Call(keys, value_states[0], cos, sin, CallPath.FIXED_STEP, token)
        kwargs[LAYER_KWARG] = self
        return self.keys, self.values

    def _path(self, chunk: int, states: torch.Tensor) -> CallPath:
        """The path of a call of `chunk` tokens in `states`' dtype and device. A one-token call takes a step when
        the store computes in float32/64 (the call in its dtype) and `DecodeMaps.usable` says the rotation
        allows it: in C once the cache is full and the C step can run this layer (`_c_buffers`), else the torch
        step. Otherwise the chunk path, on the Triton kernels where they run and the layer has them."""
        store, triton = self.store, use_triton(states.device, self.settings.kernels)
        if (
            chunk == 1
            and self._step_path
            and states.dtype == store.compute_dtype
            and not triton
            and self.maps.usable(*self._step_tables(self._new_position(), states.device))
        ):
            full = store.length == store.budget
            return CallPath.C_STEP if full and self._c_buffers is not None else CallPath.TORCH_STEP
        return CallPath.TRITON if triton and self.fused_kernels else CallPath.CHUNK

    @functools.cached_property
    def _c_buffers(self) -> CStep | None:
        """The C step's fixed arguments when it can run this layer (h2o_cli.cache.c_step): a `kernel_victim`
        policy, a float32 store on the CPU, `--kernels auto` or `native` with a C compiler; else None."""
        store = self.store
        if (
            self.policy.kernel_victim
            and store.keys.dtype == store.compute_dtype == torch.float32
            and use_native(store.keys.device, self.settings.kernels)
        ):
            return CStep(store)
        return None

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of the call given to `update`, with score accumulation and eviction (SPEC steps 1-4), on
        the path `update` chose.

        query: [1, n_heads, chunk, head_dim] rotated by the model. Returns [1, chunk, n_heads, head_dim].
        A call longer than the free slots is processed in sub-chunks that fit (write, attend, accumulate,
        evict, next), exactly as if the caller had sent those smaller chunks: the buffers never grow. A
        question ending the call (`asks`, read by `recall` layers only) is not cut there: the text before it
        ends a sub-chunk where the question starts, and the question is a sub-chunk of its own when it fits
        the free slots (else it is read as text); the sub-chunks before it are text (`asks` 0).
        """
        call, self._call = self._call, None
        if call.path is CallPath.FIXED_STEP:
            return self._fixed_step(call, query, scaling)
        store = self.store
        if call.chunk == 1 and self._step_path and store.active > store.length + 1:
            store.compact()  # a chunk's evictions left holes: decode steps read `budget + 1` slots from now on
        if call.path is CallPath.C_STEP:
            return self._c_step(call, query, scaling)
        if call.path is CallPath.TORCH_STEP:
            with one_thread():
                return self._torch_step(call, query, scaling)
        attend_written = self._triton_attend if call.path is CallPath.TRITON else self._chunk_attend
        cos, sin = call.cos.to(query.dtype), call.sin.to(query.dtype)
        query = unrotate(query[0], cos, sin)  # [n_heads, chunk, head_dim]
        outputs, start, asks = [], 0, self.asks
        question = call.chunk - asks if self.policy.recalls else 0  # the offset where the question starts
        try:
            while start < call.chunk:
                size = min(call.chunk - start, store.slots - store.length)
                assert size > 0, "eviction leaves at least the spare slots free"
                if start < question < start + size < call.chunk:
                    size = question - start  # end the text where the question starts
                self.asks = asks if start + size == call.chunk and size >= asks else 0
                part = slice(start, start + size)
                store.write(call.keys[:, part], call.values[:, part])
                outputs.append(attend_written(query[:, part].contiguous(), scaling))
                start += size
        finally:
            self.asks = asks
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def _new_position(self) -> int:
        """The position of the next token written (its rank, or its token index)."""
        return self.store.length if self.positions == "rolling" else self.store.tokens_seen

    def _step_tables(self, position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables a one-token call at `position` reads: the query's and every key's position
        (ranks stay below `slots`, token indices below the query's)."""
        return self.rope.table(max(position + 1, self.store.slots), self.store.compute_dtype, device)

    def _step_query(
        self, call: Call, query: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-token step's query [n_kv, group, 2 * head_dim] in `expand` form at the token's cache position
        (its rank or token index: read before the token is written), scaled, grouped by KV head, and the key
        table `step_attention` reads; the maps are built once per forward pass for every layer."""
        position = self._new_position()
        query_map, step_table = self.maps.per_pass(
            call.cos,
            (position, scaling),
            lambda: self._step_maps(call.cos, call.sin, position, scaling, query.device),
        )
        return self._grouped(query, query_map), step_table

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

    def _c_step(self, call: Call, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """`_torch_step` as one C call (h2o_kernels/step.c): the store is full, so the write takes the one
        hole (or the slot above the packed entries) and exactly one entry is evicted, by the `kernel_victim`
        rule. query: [1, n_heads, 1, head_dim] rotated by the model. Returns [1, 1, n_heads, head_dim]."""
        store, policy = self.store, self.policy
        grouped, step_table = self._step_query(call, query, scaling)
        output = self._c_buffers.run(
            grouped,
            call.keys,
            call.values,
            step_table,
            rolling=self.positions == "rolling",
            limit=store.length + 1 - policy.recent_slots,
            decay=policy.decay_per_query,
        )
        return output.to(query.dtype).view(1, 1, -1, store.head_dim)

    def _torch_step(self, call: Call, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The chunk path's steps for one token in far fewer ops (h2o_cli.cache.step), on one thread (`attend`
        packed the store's entries into its lowest slots). query: [1, n_heads, 1, head_dim] rotated by the
        model. Returns [1, 1, n_heads, head_dim]."""
        store = self.store
        grouped, step_table = self._step_query(call, query, scaling)
        store.write(call.keys, call.values)
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

    def _fixed_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin and `Rope.step_table` of the fixed step: `fixed_rows` long, sized once by `H2OCache.fix_steps`
        for the largest position this cache can reach (so reading them changes nothing)."""
        store, rows = self.store, self.fixed_rows
        cos_table, sin_table = self.rope.table(rows, store.compute_dtype, store.keys.device)
        return cos_table, sin_table, self.rope.step_table(rows, store.compute_dtype, store.keys.device)

    def _fixed_step(self, call: Call, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The torch step's work in fixed shapes and without a read-back (h2o_cli.cache.fixed_step): write
        into the lowest free slot, attend over every slot with the empty ones masked, scores, evict where a
        head passes the budget. query: [1, n_heads, 1, head_dim] rotated by the model. Returns
        [1, 1, n_heads, head_dim]."""
        store = self.store
        length = store.write_fixed(call.keys, call.values, call.token)  # [n_kv, 1], before the write
        rolling = self.positions == "rolling"
        cos_table, sin_table, step_table = self._fixed_tables()
        position = length[0] if rolling else call.token  # [1]: the query's rank, or its token index
        grouped = fixed_query(
            query, call.cos, call.sin, cos_table, sin_table, position, scaling, store.n_kv_heads
        )
        key_positions = store.rank if rolling else store.token_index.clamp_min(0)
        dtype = grouped.dtype  # float32 for a 16-bit store: its slots upcast as they are read
        output, probs = step_attention(
            grouped,
            store.key_states(dtype=dtype),
            store.value_states(dtype=dtype),
            key_positions,
            step_table,
            present=store.valid,
        )
        accumulate_fixed(store, probs.sum(dim=1), self.policy.decay_per_query)
        evict_fixed(store, self.policy, length + 1)
        return output.to(query.dtype).view(1, 1, -1, store.head_dim)

    def _step_maps(
        self, cos: torch.Tensor, sin: torch.Tensor, position: int, scaling: float, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query map and key table of a one-token step at `position` (`DecodeMaps.query`,
        `Rope.step_table`); the same for every layer of a pass."""
        cos_table, sin_table = self._step_tables(position, device)
        query_map = self.maps.query(cos, sin, position, scaling, cos_table, sin_table)
        return query_map, self.rope.step_table(cos_table.shape[0], cos_table.dtype, device)

    def _chunk_attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attend the chunk just written (query [n_heads, chunk, head_dim], unrotated), accumulate, evict: the
        reference path (`slot_attention`). Returns [1, chunk, n_heads, head_dim]."""
        chunk, store = query.shape[1], self.store
        key_positions, first_query_position = self._chunk_positions(chunk)
        cos_table, sin_table = self.rope.table(first_query_position + chunk, query.dtype, query.device)
        key_positions = key_positions[:, : store.active].clamp_min(0)
        query_positions = slice(first_query_position, first_query_position + chunk)
        decay = self.policy.decay_per_query
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
            query_weights(decay, chunk, query.device),
        )
        store.accumulate(increments, last_probs, chunk, decay=decay)
        store.evict(self.policy)
        return output.transpose(0, 1).unsqueeze(0)

    def _chunk_positions(self, chunk: int) -> tuple[torch.Tensor, int]:
        """The store's key positions [n_kv_heads, slots] (ranks, or token indices) and the first query's of
        the chunk just written."""
        store = self.store
        if self.positions == "rolling":
            return store.rank, store.length - chunk
        return store.token_index, store.tokens_seen - chunk

    def _triton_attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The CUDA path: one Triton launch per layer for decode (scores accumulated in place, eviction
        candidate found in the same pass), the two-pass prefill kernel for a chunk. The prefill kernel sums a
        chunk's probabilities unweighted: a decayed chunk takes `_chunk_attend`."""
        chunk, store, policy = query.shape[1], self.store, self.policy
        if chunk > 1 and policy.decay_per_query != 1.0:
            return self._chunk_attend(query, scaling)
        key_positions, first_query_position = self._chunk_positions(chunk)
        cos_table, sin_table = self.rope.table(first_query_position + chunk, query.dtype, query.device)
        if chunk > 1:
            output, increments, last_probs = prefill_attention(
                query, store.key_states(), store.value_states(), store.valid, store.token_index, key_positions,
                store.tokens_seen - chunk, first_query_position, cos_table, sin_table, scaling,
                kernels=self.settings.kernels,
            )  # fmt: skip
            store.accumulate(increments, last_probs, chunk)
            store.evict(policy)
            return output.transpose(0, 1).unsqueeze(0)
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
        self._call = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedModelError("beam search is not supported with the H2O cache; use greedy or sampling")


def query_weights(decay: float, chunk: int, device: torch.device) -> torch.Tensor | None:
    """`slot_attention`'s weights [chunk] of a chunk's queries in the score increments under decay γ: query i's
    probabilities are decayed by the chunk's later queries, γ**(chunk-1-i) (docs/spec.md); None for γ = 1 or
    one query."""
    if decay == 1.0 or chunk == 1:
        return None
    return decay ** torch.arange(chunk - 1, -1, -1, dtype=torch.float32, device=device)

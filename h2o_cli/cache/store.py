"""One layer's slot store: fixed K/V buffers written in place, per-KV-head scores, eviction."""

from __future__ import annotations

import torch
from h2o_kernels.reference import OLDEST_LAST

from h2o_cli.cache.kvquant import dequantize, quantize
from h2o_cli.cache.saved_store import SavedLayerStore
from h2o_cli.policies import select_evictions
from h2o_cli.policies.base import keep_pinned


class LayerStore(SavedLayerStore):
    """Preallocated state of one layer. Every tensor is `[n_kv_heads, slots]` (+ `[head_dim]` for K/V).

    `slots = budget + chunk`: a chunk of up to `chunk` new tokens is written into free slots, attended, and
    then `length - budget` entries are evicted, freeing their slots for the next chunk. An eviction moves
    nothing and nothing grows: `H2OLayer.attend` splits a longer call into sub-chunks that fit the free
    slots. `compact` (once after a chunk, by the decode step) packs the entries into the lowest slots.
    """

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        budget: int,
        chunk: int,
        dtype: torch.dtype,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.budget = budget
        # K/V are stored in `dtype` (int8 = quantised with per-token scales) and attended in `compute_dtype`.
        self.compute_dtype = compute_dtype or dtype
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.length = 0  # valid entries per head (the same for every head)
        # Free slots are filled lowest first, so every entry lies in slots [0, active): attention reads only
        # those (a full cache attends over its length, not its whole preallocation).
        self.active = 0
        self.tokens_seen = 0
        self.evictions = 0  # entries evicted per head so far
        # The lowest free slot of each head [n_kv_heads, 1] when `drop` knows it (it freed the only hole below
        # `active`), so a one-token `write` needs no search; None when unknown. Any write or move clears it.
        self._free_hint: torch.Tensor | None = None
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        # Pinned tokens (docs/spec.md, pinned tokens): token indices never evicted (`H2OCache.pin` gives every
        # store the same); a token is marked in `pinned` when it is written (or when pinned, if it is
        # resident then). `pinned_count`: pinned entries per head (the same for every head).
        self.pins: set[int] = set()
        self.pinned_count = 0
        self.pinning = False  # whether pins were ever given: a flag the fixed step may branch on once
        self._allocate(budget + chunk, dtype, device)

    def _allocate(self, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (self.n_kv_heads, slots)
        self.keys = torch.zeros(*shape, self.head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(*shape, self.head_dim, dtype=dtype, device=device)
        self.scores = torch.zeros(shape, dtype=torch.float32, device=device)
        self.seen = torch.zeros(shape, dtype=torch.float32, device=device)
        self.last_probs = torch.zeros(shape, dtype=torch.float32, device=device)
        self.token_index = torch.full(shape, -1, dtype=torch.int64, device=device)
        self.rank = torch.zeros(shape, dtype=torch.int64, device=device)
        self.valid = torch.zeros(shape, dtype=torch.bool, device=device)
        self.pinned = torch.zeros(shape, dtype=torch.bool, device=device)
        if self.quantized:
            self.key_scales = torch.zeros(shape, dtype=torch.float32, device=device)
            self.value_scales = torch.zeros(shape, dtype=torch.float32, device=device)

    @property
    def quantized(self) -> bool:
        """Whether K/V are int8 with per-token scales `key_scales`/`value_scales [n_kv_heads, slots]`."""
        return self.keys.dtype == torch.int8

    @property
    def slots(self) -> int:
        return self.keys.shape[1]

    def _state_names(self) -> tuple[str, ...]:
        names = ("keys", "values", "scores", "seen", "last_probs", "token_index", "rank", "valid")
        return names + (("key_scales", "value_scales") if self.quantized else ())

    def _write_states(
        self, index: torch.Tensor, free: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Scatter a chunk's K/V into their slots, quantising them for an int8 store."""
        if not self.quantized:
            self.keys.scatter_(1, index, keys.to(self.keys.dtype))
            self.values.scatter_(1, index, values.to(self.values.dtype))
            return
        for states, buffer, scales in (
            (keys, self.keys, self.key_scales),
            (values, self.values, self.value_scales),
        ):
            quantized, chunk_scales = quantize(states)
            buffer.scatter_(1, index, quantized)
            scales.scatter_(1, free, chunk_scales)

    def first_slots(self, width: int) -> dict[str, torch.Tensor]:
        """Views of every state buffer over slots [0, width), by name. Cached: the buffers are written in place
        and never reallocated, so a view stays true; a decode step at a fixed width slices nothing."""
        views = self._views.get(width)
        if views is None:
            if len(self._views) >= 4:  # widths change only while the store fills
                self._views.clear()
            views = self._views[width] = {
                name: getattr(self, name)[:, :width] for name in self._state_names()
            }
        return views

    def key_states(self, slots: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Keys `[n_kv_heads, slots, head_dim]` of the first `slots` slots (default all), in `dtype` (default
        the compute dtype; the fixed step of a 16-bit store reads them in float32), dequantised for an int8
        store."""
        dtype = dtype or self.compute_dtype
        if self.quantized:
            return dequantize(self.keys[:, :slots], self.key_scales[:, :slots], dtype)
        return self.keys[:, :slots].to(dtype)

    def value_states(self, slots: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Values `[n_kv_heads, slots, head_dim]`, like `key_states`."""
        dtype = dtype or self.compute_dtype
        if self.quantized:
            return dequantize(self.values[:, :slots], self.value_scales[:, :slots], dtype)
        return self.values[:, :slots].to(dtype)

    def nbytes(self) -> int:
        """Bytes held by this layer's buffers (K/V plus score, index and position arrays)."""
        return sum(getattr(self, name).nbytes for name in self._state_names())

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Write a chunk `[n_kv_heads, chunk, head_dim]` into free slots. Returns the slots `[n_kv_heads, chunk]`."""
        chunk = keys.shape[1]
        assert self.length + chunk <= self.slots, (
            "a chunk must fit the free slots (H2OLayer.attend splits calls)"
        )
        if chunk == 1 and self._free_hint is not None:
            free = self._free_hint
        elif chunk == 1:
            free = self.valid.to(torch.uint8).argmin(dim=1, keepdim=True)  # first free slot of each head
        else:
            free = torch.argsort(self.valid.to(torch.uint8), dim=1, stable=True)[:, :chunk]
        self._free_hint = None
        index = free.unsqueeze(-1).expand(-1, -1, self.head_dim)
        self._write_states(index, free, keys, values)
        if chunk == 1:  # decode: scalar scatters, no offsets tensor to build
            self.token_index.scatter_(1, free, self.tokens_seen)
            self.rank.scatter_(1, free, self.length)
        else:
            offsets = torch.arange(chunk, device=keys.device).expand(self.n_kv_heads, chunk)
            self.token_index.scatter_(1, free, offsets + self.tokens_seen)
            self.rank.scatter_(1, free, offsets + self.length)
        self.scores.scatter_(1, free, 0.0)
        self.seen.scatter_(1, free, 0.0)
        self.valid.scatter_(1, free, True)
        if self.pins:
            self._pin_written(free)
        self.length += chunk
        self.tokens_seen += chunk
        self.active = max(self.active, self.length)
        return free

    def _pin_written(self, free: torch.Tensor) -> None:
        """Mark the pinned tokens of a write of `free.shape[1]` tokens into `free` [n_kv_heads, chunk] slots
        (free slots are never marked: a pinned entry is never dropped, `unpin` and `compact` clear theirs)."""
        flags = [self.tokens_seen + offset in self.pins for offset in range(free.shape[1])]
        if any(flags):
            marks = torch.tensor(flags, device=free.device).expand(self.n_kv_heads, -1)
            self.pinned.scatter_(1, free, marks)
            self.pinned_count += sum(flags)

    def pin(self, tokens: set[int]) -> None:
        """Pin token indices (added to `pins`): the resident ones now, later ones when written."""
        self.pins |= tokens
        self.pinning = self.pinning or bool(tokens)
        self._mark()

    def unpin(self, tokens: set[int]) -> None:
        """Release pinned token indices: their entries become the policy's to evict again."""
        self.pins -= tokens
        self._mark()

    def _mark(self) -> None:
        """`pinned` and `pinned_count` from `pins` and the resident token indices."""
        if self.pins:
            wanted = torch.tensor(sorted(self.pins), dtype=torch.int64, device=self.token_index.device)
            self.pinned.copy_(self.valid & torch.isin(self.token_index, wanted))
        else:
            self.pinned.zero_()
        self.pinned_count = int(self.pinned[0].sum())

    def write_fixed(self, keys: torch.Tensor, values: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """`write` of one token `[n_kv_heads, 1, head_dim]` read from tensors only, for the fixed step
        (h2o_cli.cache.fixed_step): into each head's lowest free slot, at token index `token` ([1] int64).
        Returns the entries per head before the write [n_kv_heads, 1] (int64: the new entry's rank). Nothing
        is read back and no Python counter moves; `stepped_fixed` advances them after the step."""
        length = self.valid.sum(dim=1, keepdim=True)
        # The lowest free slot (one exists: length <= budget) as a min of slot numbers: inductor's CPU code for
        # `argmin` over uint8 (the `write` form) returned out-of-range indices (torch 2.13).
        numbers = torch.arange(self.slots, device=self.valid.device).expand_as(self.valid)
        free = torch.where(self.valid, self.slots, numbers).amin(dim=1, keepdim=True)
        self._write_states(free.unsqueeze(-1).expand(-1, -1, self.head_dim), free, keys, values)
        self.token_index.scatter_(1, free, token.view(1, 1).expand(self.n_kv_heads, 1))
        self.rank.scatter_(1, free, length)
        self.scores.scatter_(1, free, 0.0)
        self.seen.scatter_(1, free, 0.0)
        self.valid.scatter_(1, free, True)
        return length

    def drop_fixed(self, slots: torch.Tensor, evict: torch.Tensor) -> None:
        """`drop` of one entry per head where `evict` [n_kv_heads, 1] (bool, a tensor: whether the head holds
        more than `budget`) is set, read from tensors only; `slots` [n_kv_heads, 1] (any slot where not)."""
        slots = slots.clamp_min(0)
        evicted_rank = self.rank.gather(1, slots)
        self.rank.sub_(((self.rank > evicted_rank) & evict).long())
        self.valid.scatter_(1, slots, self.valid.gather(1, slots) & ~evict)
        self.token_index.scatter_(1, slots, torch.where(evict, -1, self.token_index.gather(1, slots)))

    def stepped_fixed(self, evicts: bool) -> None:
        """The Python counters after a fixed step (`write_fixed`, and `drop_fixed` when the policy `evicts`):
        what they are follows from themselves, so nothing is read back. The written slot lies below
        `length + 1`, so every entry still lies below `active`."""
        self.tokens_seen += 1
        self.length += 1
        self.active = max(self.active, self.length)
        if evicts and self.length > self.budget:
            self.length -= 1
            self.evictions += 1
        self._free_hint = None

    def compact(self) -> None:
        """Move every entry into slots [0, length), in their slot order, so that attention reads `length`
        slots again; the slots above are emptied (no entry, no score). A chunk's evictions leave up to
        `chunk` holes below `active`; a decode step fills one per token, so without this each step would
        read (and rotate) them all."""
        self._free_hint = None
        order = torch.argsort(self.valid.logical_not().to(torch.uint8), dim=1, stable=True)  # entries first
        for name in self._pinned_names():
            buffer = getattr(self, name)
            index = order if buffer.dim() == 2 else order.unsqueeze(-1).expand_as(buffer)
            buffer.copy_(buffer.gather(1, index))
        empties = (
            ("scores", 0.0),
            ("seen", 0.0),
            ("last_probs", 0.0),
            ("token_index", -1),
            ("pinned", False),
        )
        for name, empty in empties:
            getattr(self, name)[:, self.length :] = empty
        self.active = self.length

    def pack(self) -> None:
        """Before a one-token step: `compact` when a chunk's evictions left holes below `active`, so that a step
        reads `length + 1` slots, every one an entry after its write."""
        if self.active > self.length + 1:
            self.compact()

    def in_token_order(self) -> torch.Tensor:
        """The slots of the entries [n_kv_heads, length] (int64), each head's in token order."""
        token_index = self.token_index[:, : self.active]
        if self.active > self.length:  # holes below `active`: ranked last, then cut
            token_index = token_index.masked_fill(~self.valid[:, : self.active], OLDEST_LAST)
        return torch.sort(token_index, dim=1).indices[:, : self.length]

    def allowed(self, chunk: int) -> torch.Tensor:
        """E_q for each query of the last written chunk: `[n_kv_heads, chunk, active]` bool."""
        valid = self.valid[:, : self.active]
        if chunk == 1:  # decode: the one query sees every valid entry
            return valid.unsqueeze(1)
        first = self.tokens_seen - chunk
        query_index = torch.arange(first, first + chunk, device=self.keys.device)
        token_index = self.token_index[:, : self.active]
        return valid.unsqueeze(1) & (token_index.unsqueeze(1) <= query_index.view(1, -1, 1))

    def accumulate(
        self,
        score_increments: torch.Tensor,
        last_probs: torch.Tensor,
        chunk: int,
        scores_added: bool = False,
        decay: float = 1.0,
    ) -> None:
        """Add a chunk's attention to the scores (SPEC step 3); `scores_added`: a kernel already did that.

        score_increments, last_probs: `[n_kv_heads, n]` for the first n slots (n = `active` or all slots).
        decay γ < 1 (docs/spec.md): each query scaled the scores by γ before adding its own, so the old
        scores shrink by γ**chunk here (one multiply) and the increments must weigh query i by γ**(chunk-1-i).
        """
        views = self.first_slots(score_increments.shape[1])
        if not scores_added:
            if decay != 1.0:
                views["scores"].mul_(decay**chunk)
            views["scores"].add_(score_increments)
        views["last_probs"].copy_(last_probs)
        if chunk == 1:  # decode: the one query saw every valid entry
            views["seen"].add_(views["valid"])
            return
        # Queries of this chunk that saw each entry: all of them for old entries, fewer for the chunk's own.
        first = self.tokens_seen - chunk
        seen_by = (self.tokens_seen - torch.clamp(self.token_index, min=first)).clamp(0, chunk)
        self.seen += torch.where(self.valid, seen_by, 0).float()

    def _pinned_names(self) -> tuple[str, ...]:
        """The state buffers that move with their entries: `_state_names` and `pinned` (kept out of `nbytes`
        and the fixed step's buffers: a byte per slot, read only where pins are)."""
        return (*self._state_names(), "pinned")

    def evict(self, policy) -> torch.Tensor | None:
        """Evict down to `budget` entries per head (SPEC step 4), never a pinned entry (`keep_pinned`).
        Returns evicted slots `[n_kv_heads, n]`."""
        excess = self.length - self.budget
        if excess <= 0 or not policy.evicts:
            return None
        priority = policy.priority(self)
        if self.pinned_count:
            priority = keep_pinned(priority, self.valid, self.pinned)
        return self.drop(select_evictions(priority, self.token_index, excess))

    def drop(self, slots: torch.Tensor) -> torch.Tensor:
        """Evict the entries in `slots` [n_kv_heads, n] (one per head per column). Returns `slots`."""
        excess = slots.shape[1]
        # All entries packed below `active` (a decode step's state): the dropped slot becomes the only hole
        # there, so it is the lowest free slot the next one-token write takes.
        packed = excess == 1 and self.length == self.active
        evicted_rank = self.rank.gather(1, slots)
        # Ranks stay dense 0..length-1: each entry moves down by the evicted entries older than it.
        if excess == 1:
            self.rank.add_(self.rank > evicted_rank, alpha=-1)
        else:  # the evicted ranks below each rank, by a prefix count (every rank lies in [0, slots))
            evicted = torch.zeros_like(self.rank).scatter_(1, evicted_rank, 1)
            self.rank -= evicted.cumsum(1).sub_(evicted).gather(1, self.rank)
        self.valid.scatter_(1, slots, False)
        self.token_index.scatter_(1, slots, -1)
        self.length -= excess
        self.evictions += excess
        self._free_hint = slots if packed else None
        return slots

    def stepped(self, active: int) -> None:
        """Counters after a decode step done outside these methods (`h2o_kernels.native`): one token written,
        one entry evicted, entries now below `active`."""
        self.tokens_seen += 1
        self.evictions += 1
        self.active = active
        self._free_hint = None

    def state(self) -> dict:
        """A copy of the state up to the highest used slot (cheap for a mostly empty `full` store)."""
        used = int(self.valid.any(0).nonzero().max()) + 1 if self.valid.any() else 0
        return {
            "used": used,
            "tensors": {name: getattr(self, name)[:, :used].clone() for name in self._pinned_names()},
            "pins": set(self.pins),
            "length": self.length,
            "tokens_seen": self.tokens_seen,
            "evictions": self.evictions,
        }

    def restore(self, state: dict) -> None:
        """Put back a `state()`: slots past its used range are emptied."""
        used = state["used"]
        for name, tensor in state["tensors"].items():
            getattr(self, name)[:, :used] = tensor
        self.valid[:, used:] = False
        self.pinned[:, used:] = False
        self.token_index[:, used:] = -1
        self.pins = set(state.get("pins", ()))
        self.pinning = self.pinning or bool(self.pins)
        self.pinned_count = int(self.pinned[0].sum())
        self.active = max(self.active, used)  # every entry lies below `active` (a decode step compacts)
        self.length, self.tokens_seen, self.evictions = (
            state["length"],
            state["tokens_seen"],
            state["evictions"],
        )
        self._free_hint = None

    def reset(self) -> None:
        self._free_hint = None
        self.valid.zero_()
        self.pinned.zero_()
        self.pinned_count = 0
        self.pinning = False
        self.pins.clear()
        self.token_index.fill_(-1)
        self.scores.zero_()
        self.seen.zero_()
        self.length = self.tokens_seen = self.evictions = self.active = 0

"""The chunk path, the reference: write a sub-chunk into free slots, attend over E_q = S ∪ R ∪ {chunk tokens
<= q} with the exact renormalised softmax (`slot_attention`), add S's probabilities to its scores, evict."""

from __future__ import annotations

import torch
from h2o_kernels import native_read, slot_attention
from h2o_kernels.reference import rows

from h2o_cli.cache.paths.base import Call, Path
from h2o_cli.cache.positions import unrotate


class ChunkPath(Path):
    name = "chunk"
    in_order = True  # E_q is every entry up to the query (`LayerStore.allowed`): attend in token order
    kernel = staticmethod(slot_attention)  # `h2o_kernels.slot_attention` or a twin with its signature

    def attend(self, layer, call: Call, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of the call, with score accumulation and eviction (SPEC steps 1-4).

        query: [1, n_heads, chunk, head_dim] rotated by the model. Returns [1, chunk, n_heads, head_dim].
        A call longer than the free slots is processed in sub-chunks that fit (write, attend, accumulate,
        evict, next), exactly as if the caller had sent those smaller chunks: the buffers never grow. A
        question ending the call (`asks`: set only on layers that read questions) is not cut there: the text
        before it ends a sub-chunk where the question starts, and the question is a sub-chunk of its own when
        it fits the free slots (else it is read as text); the sub-chunks before it are text (`asks` 0).
        """
        store = layer.store
        if call.chunk == 1 and layer._step_path:
            store.pack()  # as a step does: one-token calls into a layer that takes steps keep S packed
        cos, sin = call.cos.to(query.dtype), call.sin.to(query.dtype)
        query = unrotate(query[0], cos, sin)  # [n_heads, chunk, head_dim]
        outputs, start, asks = [], 0, layer.asks
        question = call.chunk - asks  # the offset where the question starts
        try:
            while start < call.chunk:
                size = min(call.chunk - start, store.slots - store.length)
                assert size > 0, "eviction leaves at least the spare slots free"
                if start < question < start + size < call.chunk:
                    size = question - start  # end the text where the question starts
                layer.asks = asks if start + size == call.chunk and size >= asks else 0
                part = slice(start, start + size)
                store.write(call.keys[:, part], call.values[:, part])
                outputs.append(self.attend_written(layer, query[:, part].contiguous(), scaling))
                start += size
        finally:
            layer.asks = asks
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def attend_written(self, layer, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attend the chunk just written (query [n_heads, chunk, head_dim], unrotated) over S, the layer's R
        (`recall_chunk`, which chooses it with these queries; None: R = ∅) and the chunk, add S's probabilities
        to its scores, evict. Returns [1, chunk, n_heads, head_dim]. In token order (`in_order`), a read
        of `layer.read_rows` tokens or more multiplies QK^T and PV in `layer.read_matmul` (bf16 under `--dtype
        auto`; None: the store's dtype), over S ∪ R too; a window layer's own windows keep the store's dtype."""
        chunk, store, decay = query.shape[1], layer.store, layer.policy.decay_per_query
        recalled = layer.recall_chunk(query, chunk)
        matmul = layer.read_matmul if chunk >= layer.read_rows else None
        if self.in_order:
            output, increments, last_probs = self.attend_in_order(layer, query, scaling, matmul, recalled)
        else:
            output, increments, last_probs = self.attend_slots(layer, query, scaling, None, recalled)
        # S only (r = 0 is h2o), decayed as h2o's: R's entries are not S's, so nothing decays them.
        store.accumulate(increments, last_probs, chunk, decay=decay)
        store.evict(layer.policy)
        return output.transpose(0, 1).unsqueeze(0)

    def attend_slots(self, layer, query, scaling, matmul, recalled):
        """`slot_attention` over S's first `active` slots (then R's), each query's E_q a mask over them.
        Returns the output [n_heads, chunk, head_dim], S's score increments and last probabilities
        [n_kv_heads, active]."""
        chunk, store = query.shape[1], layer.store
        active = store.active
        key_positions, first_query_position = layer.chunk_positions(chunk, recalled)
        keys, values, allowed = (
            store.key_states(active),
            store.value_states(active),
            layer.chunk_allowed(chunk),
        )
        if recalled is not None:  # R is older than the chunk: every query sees all of it
            keys = torch.cat([keys, recalled.keys.to(store.compute_dtype)], dim=1)
            values = torch.cat([values, recalled.values.to(store.compute_dtype)], dim=1)
            present = recalled.present.unsqueeze(1).expand(-1, chunk, -1)
            allowed = torch.cat([allowed.expand(-1, chunk, -1), present], dim=2)
        output, increments, last_probs = self.slot_attention(
            layer, query, keys, values, allowed, key_positions, first_query_position, scaling, matmul
        )
        return output, increments[:, :active], last_probs[:, :active]

    def attend_in_order(self, layer, query, scaling, matmul, recalled=None):
        """`attend_slots` with E_q every entry up to the query (`LayerStore.allowed`): S's entries gathered in
        token order (`LayerStore.in_token_order`), the chunk's own last, so only their [chunk, chunk] corner
        is masked; S's increments go back to their slots. With R: where every head's R is full and positions
        roll, S ∪ R gathered in rank order (`merged_order`), every entry at its rank as without R; else R's
        entries first at their positions, its empty slots masked. R's own increments are not S's scores."""
        chunk, store = query.shape[1], layer.store
        active = store.active
        keys, values = store.key_states(active), store.value_states(active)
        leading, positions, ahead = None, None, 0  # `ahead`: R's columns before the gathered ones
        merged = None if recalled is None else layer.merged_order(chunk)
        if merged is not None:  # S ∪ R in rank order: positions 0 .. n-1, as S's alone
            keys = torch.cat([keys, recalled.keys.to(store.compute_dtype)], dim=1)
            values = torch.cat([values, recalled.values.to(store.compute_dtype)], dim=1)
        order = store.in_token_order() if merged is None else merged  # [n_kv, n]
        keys, values = in_rows(keys, order), in_rows(values, order)
        if recalled is None:
            slot_positions, first_query_position = layer.slot_positions(chunk)
            # Rolling ranks are dense in token order: 0 .. length-1 in every head (None: read as such).
            positions = None if layer.positions == "rolling" else slot_positions.gather(1, order)
        elif merged is not None:
            first_query_position = order.shape[1] - chunk
        else:  # R before S, at their positions
            key_positions, first_query_position = layer.chunk_positions(chunk, recalled)
            in_s = key_positions[:, :active].gather(1, order)
            positions = torch.cat([key_positions[:, active:], in_s], dim=1)
            keys = torch.cat([recalled.keys.to(store.compute_dtype), keys], dim=1)
            values = torch.cat([recalled.values.to(store.compute_dtype), values], dim=1)
            leading = None if bool(recalled.present.all()) else recalled.present
            ahead = recalled.present.shape[1]
        output, increments, last_probs = self.slot_attention(
            layer, query, keys, values, None, positions, first_query_position, scaling, matmul, leading
        )
        # Back to the columns they were gathered from (R's, from `active` on, dropped).
        width = active if merged is None else active + recalled.present.shape[1]
        back = torch.zeros(2, store.n_kv_heads, width, dtype=increments.dtype, device=increments.device)
        back[0].scatter_(1, order, increments[:, ahead:])
        back[1].scatter_(1, order, last_probs[:, ahead:])
        return output, back[0, :, :active], back[1, :, :active]

    def slot_attention(
        self,
        layer,
        query,
        keys,
        values,
        allowed,
        key_positions,
        first_query_position,
        scaling,
        matmul,
        leading=None,
    ):
        """`h2o_kernels.slot_attention` of the chunk (query [n_heads, chunk, head_dim]) over `keys`, `values`
        [n_kv_heads, n, head_dim] at `key_positions` [n_kv_heads, n] (None: 0 .. n-1 in every head), its
        queries from `first_query_position`; `leading` as the kernel's."""
        chunk, (n_kv, n) = query.shape[1], keys.shape[:2]
        rows_needed = max(first_query_position + chunk, n)
        cos_table, sin_table = layer.rope.table(rows_needed, query.dtype, query.device)
        query_positions = slice(first_query_position, first_query_position + chunk)
        if key_positions is None:
            key_cos, key_sin = cos_table[:n].expand(n_kv, -1, -1), sin_table[:n].expand(n_kv, -1, -1)
        else:
            key_cos, key_sin = rows(cos_table, key_positions), rows(sin_table, key_positions)
        return self.kernel(
            query,
            keys,
            values,
            allowed,
            cos_table[query_positions],
            sin_table[query_positions],
            key_cos,
            key_sin,
            scaling,
            query_weights(layer.policy.decay_per_query, chunk, query.device),
            matmul,
            leading,
        )


def in_rows(states: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`states` [n_kv_heads, slots, head_dim] at the slots `order` [n_kv_heads, n]: [n_kv_heads, n, head_dim]
    (one `index_select` of rows, ~10x cheaper on CPU than `gather` along the slots)."""
    n_kv, slots, head_dim = states.shape
    flat = order + torch.arange(n_kv, device=order.device).unsqueeze(1) * slots
    return states.reshape(n_kv * slots, head_dim).index_select(0, flat.view(-1)).view(n_kv, -1, head_dim)


def query_weights(decay: float, chunk: int, device: torch.device) -> torch.Tensor | None:
    """`slot_attention`'s weights [chunk] of a chunk's queries in the score increments under decay γ: query i's
    probabilities are decayed by the chunk's later queries, γ**(chunk-1-i) (docs/spec.md); None for γ = 1 or
    one query."""
    if decay == 1.0 or chunk == 1:
        return None
    return decay ** torch.arange(chunk - 1, -1, -1, dtype=torch.float32, device=device)


class NativeReadPath(ChunkPath):
    """The chunk path with a bf16 read's rotations and softmax as C calls (`h2o_kernels.native_read`); a call it does
    not fit (a window layer's masked slots, fewer than `read_rows` rows) goes to the reference."""

    name = "c-read"
    kernel = staticmethod(native_read.slot_attention)


CHUNK = ChunkPath()
C_READ = NativeReadPath()

"""Memory accounting from a model config alone (no weights): weights by quantisation, KV cache, activations.

Every figure is bytes and follows how the code allocates (SPEC.md "Memory accounting"):
- weights: parameters of a Llama-style decoder; `8bit` (bitsandbytes LLM.int8) stores each decoder Linear as
  int8 plus one fp32 scale per output row, `4bit` (nf4) as 4-bit codes plus one fp32 absmax per 64 weights;
  embeddings, norms and lm_head stay in the float dtype (transformers never quantises them).
- KV cache, H2O: what `LayerStore` preallocates — `budget + chunk` slots per KV head, each holding K and V
  (int8 adds two fp32 scales) plus the score, index and position arrays (29 bytes).
- KV cache, full: a dense cache of `context` tokens (K and V only), what a plain full-attention run holds.
- A model with sliding-window layers (Gemma 3): those hold `window - 1 + chunk` slots per KV head under H2O
  (the window, whatever the budget) and `min(context, window)` tokens in a plain run; the budget, the
  per-head figures and the recall archive are the global layers'.
- activations: the largest transient buffers of one chunk — the `[n_heads, chunk, slots]` fp32 attention
  logits and probabilities with the rotated/dequantised keys, the MLP, or the `[chunk, vocab]` fp32 logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

QUANTS = ("none", "8bit", "4bit")
NF4_BLOCK = 64  # bitsandbytes' default 4-bit block size
SLOT_STATE_BYTES = 4 + 4 + 4 + 8 + 8 + 1  # scores, seen, last_probs (f32); token_index, rank (i64); valid
SCALE_BYTES = 4  # one fp32 scale per token for K and one for V in an int8 cache
CONTEXTS = tuple(2**p for p in range(12, 21))  # 4K ... 1M


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder that memory depends on."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    context: int
    tied_embeddings: bool
    window: int = 0  # tokens a sliding-window layer attends over (0: none)
    windowed_layers: int = 0  # layers that attend over `window` tokens; the others take the budget

    @property
    def budgeted_layers(self) -> int:
        """The layers that attend globally: the policy, the budget and a recall archive are theirs."""
        return self.n_layers - self.windowed_layers

    def window_slots(self, chunk: int) -> int:
        """Slots per KV head of a sliding-window layer: the `window - 1` tokens kept between calls and the
        chunk (`h2o_cli.cache.window.WindowLayer`); 0 without one."""
        return self.window - 1 + chunk if self.windowed_layers else 0

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers config (or anything with the same attribute names)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        n_heads = config.num_attention_heads
        types = getattr(config, "layer_types", None) or []
        window = int(getattr(config, "sliding_window", None) or 0)
        windowed = sum(kind == "sliding_attention" for kind in types) if window else 0
        return cls(
            n_layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            n_heads=n_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // n_heads,
            vocab=config.vocab_size,
            intermediate=config.intermediate_size,
            context=int(config.max_position_embeddings),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            window=window if windowed else 0,
            windowed_layers=windowed,
        )

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(out_features, in_features) of one decoder layer's Linear modules (q, k, v, o, gate, up, down)."""
        attention_width = self.n_heads * self.head_dim
        kv_width = self.n_kv_heads * self.head_dim
        return [
            (attention_width, self.hidden),
            (kv_width, self.hidden),
            (kv_width, self.hidden),
            (self.hidden, attention_width),
            (self.intermediate, self.hidden),
            (self.intermediate, self.hidden),
            (self.hidden, self.intermediate),
        ]

    def float_params(self) -> int:
        """Parameters never quantised: embeddings, lm_head (unless tied), RMSNorm weights."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.hidden * (2 * self.n_layers + 1)

    def linear_params(self) -> int:
        return self.n_layers * sum(out * inp for out, inp in self.linear_shapes())

    def read_copy_bytes(self) -> int:
        """Bytes of the bf16 copy `--dtype auto` keeps for reads: every linear layer and the output layer
        (`h2o_cli.models.precision.read_in_bf16`)."""
        return 2 * (self.linear_params() + self.vocab * self.hidden)

    def params(self) -> int:
        return self.float_params() + self.linear_params()


def weight_bytes(shape: ModelShape, quant: str = "none", dtype_bytes: int = 4) -> int:
    """Bytes of the weights with `quant` in none/8bit/4bit; float parts in `dtype_bytes` per value."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, not {quant!r}")
    floats = shape.float_params() * dtype_bytes
    if quant == "none":
        return floats + shape.linear_params() * dtype_bytes
    if quant == "8bit":  # int8 weight + fp32 row scale (SCB)
        rows = shape.n_layers * sum(out for out, _ in shape.linear_shapes())
        return floats + shape.linear_params() + rows * 4
    # nf4: two codes per byte, fp32 absmax per block, a 16-entry fp32 code table per Linear
    blocks = shape.n_layers * sum(-(-out * inp // NF4_BLOCK) for out, inp in shape.linear_shapes())
    tables = shape.n_layers * len(shape.linear_shapes()) * 16 * 4
    return floats + shape.linear_params() // 2 + blocks * 4 + tables


def kv_value_bytes(kv_bits: int | None, dtype_bytes: int) -> int:
    """Bytes of one stored K or V element."""
    return {None: dtype_bytes, 16: 2, 8: 1}[kv_bits]


def token_kv_bytes(shape: ModelShape, kv_bits: int | None, dtype_bytes: int) -> int:
    """Bytes of one token's K and V in one KV head (int8 adds its two scales)."""
    return 2 * shape.head_dim * kv_value_bytes(kv_bits, dtype_bytes) + (
        2 * SCALE_BYTES if kv_bits == 8 else 0
    )


def h2o_head_bytes(shape: ModelShape, slots: int, kv_bits: int | None, dtype_bytes: int) -> int:
    """Bytes `LayerStore` holds for one KV head with `slots` slots (K/V, scales, score/index arrays)."""
    return slots * (token_kv_bytes(shape, kv_bits, dtype_bytes) + SLOT_STATE_BYTES)


def h2o_cache_bytes(shape: ModelShape, budget: int, chunk: int, kv_bits: int | None, dtype_bytes: int) -> int:
    """Bytes of a whole `H2OCache`: every KV head of a global layer `budget + chunk` slots, of a
    sliding-window layer `window - 1 + chunk`."""
    budgeted = shape.budgeted_layers * h2o_head_bytes(shape, budget + chunk, kv_bits, dtype_bytes)
    windowed = shape.windowed_layers * h2o_head_bytes(shape, shape.window_slots(chunk), kv_bits, dtype_bytes)
    return shape.n_kv_heads * (budgeted + windowed)


def archive_bytes(
    shape: ModelShape, capacity: int, block_size: int, dtype_bytes: int, bits: int | None = None
) -> int:
    """Bytes of the `recall` archive of every layer (`h2o_cli.cache.recall.archive.PageArchive`): K/V of `capacity` tokens
    stored as `bits` (`--archive-bits`: None = the compute dtype, 16, 8 = int8 plus an fp32 scale per token, KV
    head and K or V) and their int64 token index, plus per (block of `block_size` tokens, KV head) fp32 min and
    max keys."""
    return sum(archive_split(shape, capacity, block_size, dtype_bytes, bits, "disk"))


def archive_split(
    shape: ModelShape, capacity: int, block_size: int, dtype_bytes: int, bits: int | None, storage: str
) -> tuple[int, int]:
    """`archive_bytes` as (in RAM, on disk) for `storage` "ram" or "disk" (`--archive disk` or a PATH): the
    token index always stays in RAM, the K/V (and scales) and the block summaries go to the file."""
    kv = capacity * shape.n_kv_heads * token_kv_bytes(shape, bits, dtype_bytes)
    index = capacity * 8
    summaries = (capacity // block_size) * shape.n_kv_heads * shape.head_dim * 2 * 4
    ram = shape.n_layers * index
    disk = shape.n_layers * (kv + summaries)
    return (ram + disk, 0) if storage == "ram" else (ram, disk)


def choice_bytes(shape: ModelShape, capacity: int, page_size: int, shortlist: int) -> int:
    """Bytes in RAM that `recall`'s page choice (attention scores, carried) keeps beside the archive, every
    layer: the keys of the `shortlist` pages an answer step scores (float16, per KV head), each ring page's
    carried score (per KV head) and first token index, the summaries of its sections of 256 tokens (as
    h2o_cli.cache.recall.archive's, repeated here: this module is a leaf) and the C step's scratch per ring
    slot and page. Scratch sized by S and the recall slots is left out. Constant past `shortlist` pages,
    whatever the text's length."""
    pages, n_kv = capacity // page_size, shape.n_kv_heads
    sections = -(-pages // max(1, 256 // page_size))
    held = n_kv * shortlist * (page_size * shape.head_dim * 2 + 8)  # the keys, and each column's page
    carried = pages * (n_kv * 4 + 8)
    summaries = n_kv * sections * 2 * shape.head_dim * 4
    scratch = 10 * capacity + pages * (49 + 8 * n_kv)
    return shape.n_layers * (held + carried + summaries + scratch)


def full_head_bytes(shape: ModelShape, context: int, kv_bits: int | None, dtype_bytes: int) -> int:
    """Bytes of a dense cache of `context` tokens for one KV head."""
    return context * token_kv_bytes(shape, kv_bits, dtype_bytes)


def activation_bytes(
    shape: ModelShape, chunk: int, slots: int, kv_bits: int | None, dtype_bytes: int, logits_copies: int = 2
) -> dict[str, int]:
    """Largest transient buffers of one forward chunk over `slots` cached entries (one layer at a time).

    attention: fp32 logits + probabilities `[n_heads, chunk, slots]`, the `allowed` mask, rotated keys and
    their cos/sin `[n_kv, slots, head_dim]`, plus K/V converted to the compute dtype when stored otherwise.
    logits: `[chunk, vocab]` fp32 (`logits_copies` = 2 with the log-softmax of a perplexity run).
    """
    kv_elems = shape.n_kv_heads * slots * shape.head_dim
    converted = 2 * kv_elems * dtype_bytes if kv_value_bytes(kv_bits, dtype_bytes) != dtype_bytes else 0
    attention = 2 * shape.n_heads * chunk * slots * 4 + shape.n_kv_heads * chunk * slots
    attention += 3 * kv_elems * dtype_bytes + converted
    mlp = 3 * chunk * shape.intermediate * dtype_bytes
    logits = logits_copies * chunk * shape.vocab * 4
    hidden = 4 * chunk * shape.hidden * dtype_bytes
    return {
        "attention": attention,
        "mlp": mlp,
        "logits": logits,
        "hidden": hidden,
        "peak": hidden + max(attention, mlp, logits),
    }


def memory_table(
    shape: ModelShape,
    budget: int,
    chunk: int = 256,
    quant: str = "none",
    kv_bits: int | None = None,
    dtype_bytes: int = 4,
    contexts: tuple[int, ...] = CONTEXTS,
    page_size: int = 16,
    archive_max: int = 1_048_576,
    block_size: int = 4,
    archive_bits: int | None = None,
    archive_storage: str = "ram",
    shortlist: int = 512,
    recall_layers: int | None = None,
    read_copy_bytes: int = 0,
) -> dict:
    """Weights (with `read_copy_bytes` of a bf16 copy for reads, `read_copy_bytes`), KV cache (full vs H2O, per head and total) and activation peaks for each context length;
    the `recall` archive per token and at `archive_max` tokens (pages of `page_size`, summaries per `block_size`
    tokens), stored as `archive_bits`
    in `archive_storage` (ram or disk), split into RAM and disk bytes, and per token for every `--archive-bits`;
    what its page choice keeps in RAM beside it (`choice_bytes`: answer steps score a `shortlist` of pages),
    in `recall_layers` layers (`--recall-layers`; None: every one)."""
    weights = weight_bytes(shape, quant, dtype_bytes) + read_copy_bytes
    archived = replace(shape, n_layers=shape.budgeted_layers if recall_layers is None else recall_layers)
    heads = shape.budgeted_layers * shape.n_kv_heads  # the sliding-window layers' heads are counted apart
    window_heads = shape.windowed_layers * shape.n_kv_heads
    slots = budget + chunk
    h2o_head = h2o_head_bytes(shape, slots, kv_bits, dtype_bytes)
    window_head = h2o_head_bytes(shape, shape.window_slots(chunk), kv_bits, dtype_bytes)
    h2o_activations = activation_bytes(shape, chunk, slots, kv_bits, dtype_bytes)["peak"]
    split = archive_split(archived, archive_max, block_size, dtype_bytes, archive_bits, archive_storage)

    def per_token(bits: int | None, storage: str) -> tuple[float, float]:
        """(RAM, disk) archive bytes per token, the summaries shared out over a page."""
        ram, disk = archive_split(archived, page_size, block_size, dtype_bytes, bits, storage)
        return ram / page_size, disk / page_size

    rows = []
    for context in contexts:
        full_head = full_head_bytes(shape, context, kv_bits, dtype_bytes)
        full_windows = window_heads * full_head_bytes(shape, min(context, shape.window), kv_bits, dtype_bytes)
        h2o_kv = h2o_head * heads + window_head * window_heads
        full_activations = activation_bytes(shape, chunk, context, kv_bits, dtype_bytes)["peak"]
        rows.append(
            {
                "context": context,
                "within_window": context <= shape.context,
                "full_kv_bytes": full_head * heads + full_windows,
                "full_kv_bytes_per_head": full_head,
                "h2o_kv_bytes": h2o_kv,
                "h2o_kv_bytes_per_head": h2o_head,
                "full_activation_bytes": full_activations,
                "h2o_activation_bytes": h2o_activations,
                "full_total_bytes": weights + full_head * heads + full_windows + full_activations,
                "h2o_total_bytes": weights + h2o_kv + h2o_activations,
            }
        )
    return {
        "params": shape.params(),
        "quant": quant,
        "kv_bits": kv_bits,
        "dtype_bytes": dtype_bytes,
        "budget_tokens": budget,
        "chunk": chunk,
        "slots_per_head": slots,
        "kv_heads_total": heads,
        "kv_heads_per_layer": shape.n_kv_heads,
        "windowed_layers": shape.windowed_layers,
        "window_slots_per_head": shape.window_slots(chunk),
        "window_kv_bytes_per_head": window_head if shape.windowed_layers else 0,
        "window_tokens": shape.window,
        "context_window": shape.context,
        "weights_bytes": weights,
        "read_copy_bytes": read_copy_bytes,
        "recall_archive_bits": archive_bits,
        "recall_archive_storage": archive_storage,
        "recall_archive_bytes_per_token": per_token(archive_bits, "ram")[0],
        "recall_archive_ram_bytes_per_token": per_token(archive_bits, archive_storage)[0],
        "recall_archive_disk_bytes_per_token": per_token(archive_bits, archive_storage)[1],
        "recall_archive_bytes_per_token_by_bits": {
            str(bits) if bits else "model": per_token(bits, "ram")[0] for bits in (None, 16, 8)
        },
        "recall_archive_tokens": archive_max,
        "recall_layers": archived.n_layers,
        "recall_archive_bytes": archive_bytes(archived, archive_max, block_size, dtype_bytes, archive_bits),
        "recall_archive_ram_bytes": split[0],
        "recall_archive_disk_bytes": split[1],
        "recall_choice_bytes": choice_bytes(archived, archive_max, page_size, shortlist),
        "rows": rows,
    }

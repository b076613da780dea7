"""What a cache holds and costs, as plain data: `H2OCache.report()` and `H2OCache.layer_slots()`.

Commands, the chat panel, the eval tables and the analyses read these, never the cache's layers, stores,
archives or policy, so the cache may change how it keeps things without breaking what they print.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from h2o_cli.config import CacheSettings
from h2o_cli.memory import ModelShape


@dataclass(frozen=True)
class ArchiveReport:
    """A recalling cache's archive now (docs/spec.md, recall: reporting); each field is a key of `--json`.

    - `archive_storage`: "ram" or "disk"; `archive_path`: the file of a disk archive (None in RAM);
      `archive_kept`: whether that file outlives the run (`--keep-archive`); `archive_bits`: bits per stored
      K/V element (`--archive-bits`).
    - `archive_bytes` (all layers, preallocated) = `archive_ram_bytes` (token index, summaries, and the K/V of a
      RAM archive) + `archive_disk_bytes` (the K/V of a file archive); `archive_token_bytes`: bytes per token.
    - `archive_capacity`: tokens the ring holds at most; `archive_tokens`: tokens held now; `archive_reach` =
      `archive_oldest`: the oldest token still recallable.
    - `recall_slots`: slots per KV head refilled at every step; `recall_lead`: the lead head as LAYER.HEAD,
      or "none"; `lead_pages`, `lead_next`: its best pages (or "fill": as many as fill the recall slots) and
      the pages after each that every head takes after a question (0 without a lead); `lead_outliers`: the
      multiple of the median page's score at which a further lead page comes too (0: off); `lead_text`: whether
      chunks of text recall the lead's pages; `recall_place`: where R sits among the resident entries
      (`--recall-place`); `recall_slot_bytes`: bytes of the recall slots.
    - `choice_bytes`: what the page choice keeps in RAM beside them (carried scores, section summaries, the
      shortlist's held keys, scratch).
    - `recalled_per_step`: tokens recalled per KV head and step (mean over layers and steps), of which
      `recall_hits` were already in the recall slots and `archive_reads_per_step` were read.
    """

    archive_storage: str
    archive_path: str | None
    archive_kept: bool
    archive_bits: int
    archive_bytes: int
    archive_ram_bytes: int
    archive_disk_bytes: int
    archive_token_bytes: int
    archive_capacity: int
    archive_tokens: int
    archive_reach: int
    archive_oldest: int
    recall_slots: int
    recall_lead: str
    lead_pages: int | str
    lead_next: int
    lead_outliers: float
    lead_text: bool
    recall_place: str
    recall_slot_bytes: int
    choice_bytes: int
    recalled_per_step: float
    recall_hits: float
    archive_reads_per_step: float


@dataclass(frozen=True)
class CacheReport:
    """A cache's figures now. Slot counts and counters are per KV head (every head and global layer has the
    same).

    - `settings`: the settings in use (budget in tokens); `shape`: the decoder's numbers (`ModelShape`);
      `quant`: the weights' `--quant`; `positions`: the positions in use (the policy may overrule the asked).
    - `resident_slots`: entries kept after every step (the budget; a policy that never evicts keeps its whole
      span); `recall_slots`: slots refilled from the archive at every step (`recall`; else 0);
      `budget_tokens` = both, what attention reads besides the chunk.
    - `heavy_slots`: resident entries kept for what they are (heavy hitters, sinks); `recent_slots`: the
      rest of the resident entries, the newest. `recent_window`: the newest entries the policy protects
      (its own split of its budget, `CacheSettings.recent`); it differs from `recent_slots` only for a
      policy that never evicts, whose budget does not bound what it keeps.
    - `sinks`, `h2o_sinks`: the policy's `--sinks` / `--h2o-sinks` (0 for a policy without them);
      `score_decay`: γ by which every score is multiplied per query token (1 = plain sums).
    - `slots`: buffer slots (resident + chunk); `length`: entries held now; `tokens_seen`: tokens read;
      `evictions`: entries evicted so far.
    - `nbytes`: bytes of every layer's preallocated buffers (`H2OCache.nbytes`, the archive apart);
      `compute_bytes`: bytes of one element of the dtype attention runs in; `kv_element_bytes`: of one
      stored K or V element (1 for int8).
    - `archive`: the recall archive's figures (`ArchiveReport`, `H2OCache.archive_summary`), None without
      one; `archive_row` gives them as `--json` prints them.
    - `windowed_layers`: layers that attend over a sliding window (Gemma 3) and keep it beside the budget;
      `window_slots`: slots per KV head of each (the window less one, plus the chunk), 0 without them;
      `window_bytes`: their buffers' bytes. Every other figure above is the global layers' (`nbytes` counts
      both); `window_row` is what `--json` prints.
    - `pinned_slots`: resident entries per KV head that no policy evicts (`H2OCache.pin`; they count inside
      `resident_slots`); `pinned_tokens`: token indices pinned, resident, evicted before the pin, or not
      read yet.
    """

    settings: CacheSettings
    shape: ModelShape
    quant: str
    positions: str
    resident_slots: int
    recall_slots: int
    heavy_slots: int
    recent_window: int
    sinks: int
    h2o_sinks: int
    score_decay: float
    slots: int
    length: int
    tokens_seen: int
    evictions: int
    nbytes: int
    compute_bytes: int
    kv_element_bytes: int
    archive: ArchiveReport | None
    windowed_layers: int = 0
    window_slots: int = 0
    pinned_slots: int = 0
    pinned_tokens: int = 0
    window_bytes: int = 0

    @property
    def archive_row(self) -> dict:
        """The archive's figures under the keys `--json` prints (its field names), {} without an archive."""
        return {} if self.archive is None else asdict(self.archive)

    @property
    def window_row(self) -> dict:
        """The sliding-window layers' figures under the keys `--json` prints."""
        return {"windowed_layers": self.windowed_layers, "window_slots": self.window_slots}

    @property
    def has_lead(self) -> bool:
        """Whether a lead head ranks the archive's pages for every layer (`--recall-lead`): a question is then
        read twice, once for the lead's ranking and once for the answer."""
        return self.archive is not None and self.archive.recall_lead != "none"

    @property
    def policy(self) -> str:
        return self.settings.policy

    @property
    def budget_tokens(self) -> int:
        """Resident plus recalled slots: what attention reads per KV head besides the chunk."""
        return self.resident_slots + self.recall_slots

    @property
    def recent_slots(self) -> int:
        """Resident slots for the newest entries (the resident ones that are not heavy)."""
        return self.resident_slots - self.heavy_slots

    @property
    def bytes_per_head(self) -> int:
        """Bytes of one global layer's buffers per KV head."""
        budgeted = self.shape.n_layers - self.windowed_layers
        return (self.nbytes - self.window_bytes) // (budgeted * self.shape.n_kv_heads)

    @property
    def window_bytes_per_head(self) -> int:
        """Bytes of one sliding-window layer's buffers per KV head (0 without them)."""
        return self.window_bytes // max(self.windowed_layers * self.shape.n_kv_heads, 1)

    @property
    def full_kv_bytes(self) -> int:
        """Bytes a plain full KV cache (keys and values, no eviction) would need for the tokens seen: a
        sliding-window layer's holds its window at most."""
        shape = self.shape
        per_token = 2 * shape.n_kv_heads * shape.head_dim * self.kv_element_bytes
        windows = shape.windowed_layers * min(self.tokens_seen, shape.window)
        return per_token * (shape.budgeted_layers * self.tokens_seen + windows)


@dataclass(frozen=True)
class LayerSlots:
    """What one layer's slots hold now (`H2OCache.layer_slots()`), for maps and analyses of what is kept.

    Views of the live buffers, each `[n_kv_heads, slots]`: read (or copy) them before the cache's next call,
    and never write them. `valid` marks the slots holding an entry; `token_index` (meaningless where not
    valid) the token each holds, `rank` its order by token index among the head's entries (0 = oldest),
    `scores` its accumulated attention, `last_probs` the attention the latest query gave it, `pinned` whether
    it is pinned (`H2OCache.pin`: never evicted). `length`: entries per head; `tokens_seen`: tokens read. `recalled` `[n_kv_heads, recall_slots]`: with a recalling policy,
    the tokens each head read back from the archive in the last step (-1 = empty slot); None otherwise.
    `window`: the layer attends over a sliding window (its own, beside the budget; all its entries recent).
    """

    token_index: torch.Tensor
    rank: torch.Tensor
    valid: torch.Tensor
    scores: torch.Tensor
    last_probs: torch.Tensor
    length: int
    tokens_seen: int
    recalled: torch.Tensor | None = None
    pinned: torch.Tensor | None = None
    window: bool = False


__all__ = ["ArchiveReport", "CacheReport", "LayerSlots"]

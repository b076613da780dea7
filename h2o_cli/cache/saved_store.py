"""What a saved read (`h2o_cli.saved`) keeps of a layer's store, and how it is put back: a base of
`LayerStore`, kept apart so the store stays about its slots and their eviction."""

from __future__ import annotations

import torch


class SavedLayerStore:
    """Every buffer of a `LayerStore` whole (the pinned flags too), its pins and its counters."""

    def saved_arrays(self) -> dict[str, torch.Tensor]:
        """Every state buffer by name, `pinned` included (the live tensors, not copies), and the lowest free
        slot of each head [n_kv_heads, 1] when known (`free_hint`): what `load_saved` puts back."""
        arrays = {name: getattr(self, name) for name in self._pinned_names()}
        if self._free_hint is not None:
            arrays["free_hint"] = self._free_hint
        return arrays

    def saved_counters(self) -> dict:
        """The counters `load_saved` puts back beside `saved_arrays`, with the pinned token indices."""
        return {
            "length": self.length,
            "active": self.active,
            "tokens_seen": self.tokens_seen,
            "evictions": self.evictions,
            "pins": sorted(self.pins),
            "pinning": self.pinning,
        }

    def load_saved(self, arrays, counters: dict) -> None:
        """Put back `saved_arrays` (a mapping by name, of this store's shapes) and `saved_counters`: the store
        is then as it was when they were taken, down to which slot the next token takes and what is pinned."""
        for name in self._pinned_names():
            getattr(self, name).copy_(arrays[name])
        hint = arrays.get("free_hint")
        self._free_hint = None if hint is None else hint.to(self.token_index.device, copy=True)
        self._views.clear()
        self.length, self.active = counters["length"], counters["active"]
        self.tokens_seen, self.evictions = counters["tokens_seen"], counters["evictions"]
        self.pins, self.pinning = set(counters["pins"]), counters["pinning"]
        self.pinned_count = int(self.pinned[0].sum())

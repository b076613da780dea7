"""What a saved read (`h2o_cli.saved`) keeps of a recall archive, and how it is put back: a base of
`ArchiveStore`, kept apart so the store stays about the ring, its index and summaries."""

from __future__ import annotations

import torch

from h2o_cli.cache.recall.limits import GROW_TOKENS

# The page scoring's carried state (`PageScoring`) goes with the archive where the store is one.
SCORING_ARRAYS = ("carried", "carried_start")
SCORING_COUNTERS = ("scored", "_sections_at")


class SavedStore:
    """The ring's written part, the token index, the summaries and the counters of an `ArchiveStore`."""

    def saved_arrays(self) -> dict[str, torch.Tensor]:
        """The ring slots written so far (`span`: every slot past it is empty) of the K/V (and scales), the
        token index and the blocks' summaries; the page scoring's carried scores and the summaries of the
        sections over `span`: views of the live tensors (a mapped file's pages are read when written out).
        What `load_saved` puts back."""
        used, blocks = self.span, self.span // self.block_size
        arrays = {"keys": self.keys[:, :used], "values": self.values[:, :used]}
        if self.quantized:
            arrays |= {"key_scales": self.key_scales[:, :used], "value_scales": self.value_scales[:, :used]}
        arrays |= {"token_index": self.token_index[:used], "summary": self.summary[:, :blocks]}
        arrays |= {name: getattr(self, name) for name in SCORING_ARRAYS if hasattr(self, name)}
        if hasattr(self, "section_summary"):
            sections = -(-used // self.page_size // self.section_pages)
            arrays["section_summary"] = self.section_summary[:, :sections]
        return arrays

    def saved_counters(self) -> dict:
        """The counters beside `saved_arrays` (the scoring's too: how often scores were carried, and when the
        section summaries were refreshed)."""
        counters = {
            "tokens": self.tokens,
            "floor": self._floor,
            "epoch": self.epoch,
            "capacity": self.capacity,
        }
        counters |= {name: getattr(self, name) for name in SCORING_COUNTERS if hasattr(self, name)}
        return counters

    def load_saved(self, arrays, counters: dict) -> None:
        """Put back `saved_arrays` (a mapping by name; the ring's written part) and `saved_counters` into an
        archive of the same shape: its unwritten part stays as built (empty); what lies in a file that adopted
        the save's (`ArchiveFile.adopt`) is in place already. What a step kept of the old
        state is void (`epoch`), and a mapped file's pages leave the process (`release`)."""
        self.tokens, self._floor = counters["tokens"], counters["floor"]
        # Never an epoch this archive had, so a save loaded twice is a new state for what keys on it.
        self.epoch = max(self.epoch, counters["epoch"]) + 1
        adopted = self.region is not None and self.region.file.adopted
        if self.region is not None:  # the slots about to be written through the mapping, on disk first
            self.region.resume(self.tokens, self.capacity)
            self.region.reserve(self.tokens, self.capacity, GROW_TOKENS)
        for name, saved in self.saved_arrays().items():  # sized by `tokens`, now the saved count
            if not (adopted and self.region.file.holds(saved)):  # an adopted file holds the saved bytes
                saved.copy_(arrays[name])
        for name in SCORING_COUNTERS:
            if hasattr(self, name):
                setattr(self, name, counters[name])
        if hasattr(self, "_held_keys"):
            self._held_keys = None  # the held keys are read again from the archive
        self.release()

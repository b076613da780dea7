"""The fixed-memory KV cache: everything between the model's attention and the eviction policies.

Where each part lives (docs/design.md has the full map):
- `model_cache.py`: `H2OCache`, the model-level cache (transformers `Cache`), built from a `CacheSettings`.
- `layer.py`: `H2OLayer`, one decoder layer's cache and the choice of path for each call.
- `store.py`: `LayerStore`, the preallocated per-layer buffers (slots, scores, ranks) written in place.
- `step.py`: the one-token decode step on the torch path.
- `positions.py`: RoPE un-/re-rotation and rolling ranks. `attention.py`: the "h2o" attention hook.
- `kvquant.py`: 16/8-bit K/V storage. `threads.py`: the decode step's thread count.
- `report.py`: `CacheReport` and `LayerSlots`, what a cache holds and costs as plain data (what commands read).
- `families.py`: the model families the cache supports, a model's text config and context window.
- `recall/`: the `recall` policy's layer, step, archive (RAM and file) and limits.

The names below are imported on first use, so that a module of this package (say `recall.limits`) can be
imported without loading the whole cache.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from h2o_cli.cache.layer import H2OLayer
    from h2o_cli.cache.model_cache import H2OCache, compute_dtype
    from h2o_cli.cache.recall.layer import RecallLayer

_HOMES = {
    "H2OCache": "h2o_cli.cache.model_cache",
    "compute_dtype": "h2o_cli.cache.model_cache",
    "H2OLayer": "h2o_cli.cache.layer",
    "RecallLayer": "h2o_cli.cache.recall.layer",
}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["H2OCache", "H2OLayer", "RecallLayer", "compute_dtype"]

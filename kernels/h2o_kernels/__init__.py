"""Attention kernels over the slot cache: pure-torch references (the CPU path) and Triton kernels (CUDA).

The folder is `kernels/` at the top of the repo; the package is `h2o_kernels` (a top-level package named
`kernels` would be mistaken by transformers for the unrelated hub-kernels distribution).
Each Triton kernel (`triton_decode.py`, `triton_prefill.py`) has a reference with the same signature
(`decode.py`, `prefill.py`); `dispatch.py` picks one per device.
"""

from h2o_kernels.dispatch import decode_attention, prefill_attention, use_triton
from h2o_kernels.reference import slot_attention

__all__ = ["slot_attention", "decode_attention", "prefill_attention", "use_triton"]

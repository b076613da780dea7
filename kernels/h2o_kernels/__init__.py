"""Attention kernels over the slot cache: a pure-torch reference (the CPU path) and Triton kernels.

The folder is `kernels/` at the top of the repo; the package is `h2o_kernels` (a top-level package named
`kernels` would be mistaken by transformers for the unrelated hub-kernels distribution).
"""

from h2o_kernels.reference import slot_attention

__all__ = ["slot_attention"]

"""How a call is attended: one small object per path, chosen once per call by `choose_path`.

A path takes the model's K/V into a `Call` (`Path.take`, from `H2OLayer.update`) and attends it (`Path.attend`,
from `H2OLayer.attend`). The bodies are the same for every layer: a layer with recall slots supplies its R (the
recalled set) and the positions of S ∪ R through the layer's hooks (`H2OLayer.recall_chunk`, `step_entries`,
`c_recall`, `fixed_entries`), and a layer without them supplies R = ∅.

| path | file | when |
|---|---|---|
| `CHUNK` | `chunk.py` | the reference: any call (in sub-chunks that fit the spare slots) |
| `TRITON` | `triton.py` | the chunk path on the fused Triton kernels (CUDA, a layer that has them) |
| `C_READ` | `chunk.py` | the chunk path with a bf16 read's rotations and softmax as C calls (CPU, `--dtype auto`) |
| `TORCH_STEP` | `torch_step.py` | one token in far fewer ops (float32/64, the standard RoPE), on one thread |
| `C_STEP` | `c_step.py` | the torch step as one C call, once S is full (CPU, a `kernel_victim` policy) |
| `FIXED_STEP` | `fixed.py` | one token in fixed shapes from tensors only: capturable (`--compile`) |
"""

from __future__ import annotations

import torch
from h2o_kernels import use_triton
from h2o_kernels.dispatch import use_native

from h2o_cli.cache.paths.base import Call, Path
from h2o_cli.cache.paths.c_step import C_STEP
from h2o_cli.cache.paths.chunk import C_READ, CHUNK
from h2o_cli.cache.paths.fixed import FIXED_STEP
from h2o_cli.cache.paths.torch_step import TORCH_STEP
from h2o_cli.cache.paths.triton import TRITON


def choose_path(layer, states: torch.Tensor) -> Path:
    """The path of a call of `states` [1, n_kv_heads, chunk, head_dim] (the model's keys) into `layer`.

    While the cache runs fixed steps (`H2OCache.fixed_step`) the fixed step. Else a one-token call takes a step
    when the store computes in float32/64 (the call in its dtype), no Triton kernel runs it, and
    `DecodeMaps.usable` says the rotation allows it: the C step once S is full and the layer has its buffers
    (`_c_buffers`), unless the token is pinned (the C step writes it unmarked), else the torch step. Otherwise the chunk path, on the Triton kernels where they run, the
    layer has them and the call is one token or undecayed (the prefill kernel sums a chunk's probabilities
    unweighted), or with the C rotations and softmax (`C_READ`) for a bf16 read (`--dtype auto`, at least `read_rows` tokens)
    where the C step could run (`--kernels auto` or `native`, a C compiler)."""
    if layer.fixed:
        return FIXED_STEP
    chunk, store = states.shape[2], layer.store
    triton = use_triton(states.device, layer.settings.kernels)
    if chunk == 1 and layer.steps_possible(states) and not triton:
        full = store.length == store.budget and store.tokens_seen not in store.pins
        return C_STEP if full and layer._c_buffers is not None else TORCH_STEP
    if triton and layer.fused_kernels and (chunk == 1 or layer.policy.decay_per_query == 1.0):
        return TRITON
    if (
        layer.read_matmul is torch.bfloat16
        and chunk >= layer.read_rows
        and use_native(states.device, layer.settings.kernels)
    ):
        return C_READ
    return CHUNK


__all__ = ["CHUNK", "C_READ", "C_STEP", "FIXED_STEP", "TORCH_STEP", "TRITON", "Call", "Path", "choose_path"]

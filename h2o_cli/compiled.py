"""A one-token forward over the H2O cache, captured once by torch.compile and replayed (`--compile`).

The cache's buffers are fixed and written by index, and its fixed decode step (h2o_cli.cache.fixed_step)
reads no Python counter and syncs nothing, so the whole forward — the model's layers, the cache's write,
attention, scores and eviction — is one graph (`fullgraph=True`): on the CPU inductor fuses it, on CUDA
`mode="reduce-overhead"` replays it as a CUDA graph (gpt-fast's way). What stays outside: the token id and
its index going in (two tiny tensors), the logits coming out, and the cache's Python counters advancing.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from h2o_cli.cache import H2OCache

# Inductor's own settings for the step: casts kept as written. By default (`emulate_precision_casts` off) a
# cast to 16 bits that inductor fuses into the next op keeps its float32 value, so the page masses a recall
# step scores over keys held in float16 (`as_held`) came out unrounded, 1e-4 from the eager step's
# (docs/design.md, "Can a decode step be captured whole?").
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


def inductor_settings():
    """A context (reusable) in which inductor compiles with `INDUCTOR_OPTIONS`."""
    import torch._inductor.config

    return torch._inductor.config.patch(INDUCTOR_OPTIONS)


def compile_options(device: torch.device) -> dict:
    """`torch.compile`'s backend and mode for `device`: inductor everywhere; on CUDA replayed as a CUDA graph."""
    if torch.device(device).type == "cuda":
        return {"backend": "inductor", "mode": "reduce-overhead"}
    return {"backend": "inductor"}


class CompiledStep:
    """`step(token) -> logits [vocab]`: feed one token id through `model` and `cache`, as
    `model(input_ids=[[token]], cache=cache).logits[0, -1]` does, on the cache's fixed step.

    `backend`/`mode` go to `torch.compile` (default: `compile_options`); `compile=False` runs the same fixed
    step without compiling it. The first call compiles (seconds to minutes: the graph holds every layer); later
    calls replay, with no recompilation however full the cache is.
    """

    def __init__(
        self,
        model,
        cache: H2OCache,
        backend: str | None = None,
        mode: str | None = None,
        compile: bool = True,
    ) -> None:
        cache.fix_steps()
        self.model, self.cache = model, cache
        self.device = model.device
        if compile:
            options = compile_options(self.device) if backend is None else {"backend": backend}
            if mode is not None:
                options["mode"] = mode
            if options.get("mode") == "reduce-overhead":
                mark_static(cache)  # CUDA graphs may write the cache's buffers in place
            self._forward = torch.compile(self._eager_forward, fullgraph=True, **options)
        else:
            self._forward = self._eager_forward
        self._settings = inductor_settings() if compile else nullcontext()  # other backends ignore them

    def _eager_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        output = self.model(input_ids=input_ids, position_ids=position_ids, cache=self.cache, use_cache=True)
        return output.logits[0, -1]

    def __call__(self, token: int) -> torch.Tensor:
        cache = self.cache
        input_ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
        position_ids = torch.tensor([[cache.tokens_seen]], dtype=torch.long, device=self.device)
        # no autograd: a model's weights require grad unless frozen, and a graph kept for a backward pass
        # would hold every step's activations (on CUDA, in the graph's memory pool, until it runs out)
        # inductor reads its settings when it compiles, at the first call (torch.compile takes no `options`
        # beside a `mode`, so they are set around each call)
        with torch.no_grad(), cache.fixed_step(), self._settings:
            logits = self._forward(input_ids, position_ids)
        return logits.clone() if logits.device.type == "cuda" else logits  # a CUDA graph reuses its output


def mark_static(cache: H2OCache) -> None:
    """Tell dynamo that the cache's tensors keep their addresses (as a module's buffers do), so a CUDA graph
    may read and write them in place instead of copying them in and out at every replay."""
    for tensor in cache.fixed_buffers():
        torch._dynamo.mark_static_address(tensor)

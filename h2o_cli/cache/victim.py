"""Which entry a one-token step evicts: one home for the choice between the `kernel_victim` rule (lowest score
outside the recent window, ties to the oldest: `h2o_kernels.reference.lowest_outside_recent`) and the policy's
own `evict`, for the torch and Triton steps and, in fixed shapes, the fixed step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from h2o_kernels.reference import lowest_outside_recent

from h2o_cli.cache.store import LayerStore
from h2o_cli.policies import select_evictions
from h2o_cli.policies.base import keep_pinned


def one_over_by_kernel_rule(store: LayerStore, policy) -> bool:
    """Whether the step's eviction is exactly one entry chosen by the `kernel_victim` rule (the store holds
    one entry over its budget, the policy's victim is that rule and no entry is pinned), which a kernel may
    find in its own pass. (The C step takes pins itself: `cache_step`'s `pinned`.)"""
    return policy.kernel_victim and store.length - store.budget == 1 and not store.pinned_count


def evict_after_step(store: LayerStore, policy) -> None:
    """Eviction after a one-token step on packed slots: under `one_over_by_kernel_rule` one min over the packed
    slots (no priority array); otherwise the policy's own `evict` (which keeps pinned entries)."""
    if one_over_by_kernel_rule(store, policy):
        views = store.first_slots(store.active)
        limit = store.length - policy.recent_slots
        store.drop(lowest_outside_recent(views["scores"], views["rank"], limit))
    else:
        store.evict(policy)


@dataclass
class FixedState:
    """What a policy's `priority` reads (`SlotState`) over every slot of a store, with `length` a tensor
    [n_kv_heads, 1] (a plain class: a captured graph traces it)."""

    valid: torch.Tensor
    token_index: torch.Tensor
    rank: torch.Tensor
    scores: torch.Tensor
    seen: torch.Tensor
    last_probs: torch.Tensor
    length: torch.Tensor


def evict_fixed(store: LayerStore, policy, length: torch.Tensor) -> None:
    """Eviction after a fixed step: `length` [n_kv_heads, 1] entries per head after the write; one entry
    leaves where it passes the budget, chosen by the policy's rule (`evict_after_step` in fixed shapes: the
    `kernel_victim` rule over every slot, empty ones masked, or the policy's priorities, with pinned entries
    kept once the store was given pins: `keep_pinned`)."""
    if not policy.evicts:
        return
    # `pinning`, not `pinned_count`: a captured step branches on it, and a count that changes every turn would
    # recompile it every turn.
    if policy.kernel_victim and not store.pinning:
        victim = lowest_outside_recent(store.scores, store.rank, length - policy.recent_slots, store.valid)
    else:
        state = FixedState(
            store.valid, store.token_index, store.rank, store.scores, store.seen, store.last_probs, length
        )
        priority = policy.priority(state)
        if store.pinning:
            priority = keep_pinned(priority, store.valid, store.pinned)
        victim = select_evictions(priority, store.token_index, 1)
    store.drop_fixed(victim, length > store.budget)

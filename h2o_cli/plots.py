"""Figures (matplotlib, PNG): attention sparsity, the power law of accumulated scores, heavy-hitter maps, curves.

Functions that measure take a model and ids and return arrays; functions that draw take those arrays and a
path, write a PNG and return the path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.policies import policy_class, policy_names
from h2o_cli.streaming import stream_perplexity


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@torch.inference_mode()
def attention_maps(model, ids: Sequence[int]) -> list[torch.Tensor]:
    """Plain eager attention of `model`'s weights on `ids` (<= ~1K tokens): per layer [n_heads, q, k]."""
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager", dtype=torch.float32)
    eager.load_state_dict(model.state_dict())
    eager.eval()
    out = eager(torch.tensor([list(ids)]), output_attentions=True, use_cache=False)
    return [layer[0].float() for layer in out.attentions]


def sparsity_per_layer(maps: Sequence[torch.Tensor], threshold: float = 0.01) -> np.ndarray:
    """Observation 1: share of causal attention entries below `threshold` x their row's maximum, per layer."""
    values = []
    for attention in maps:
        q = attention.shape[-1]
        causal = torch.tril(torch.ones(q, q, dtype=torch.bool))
        small = attention < threshold * attention.amax(-1, keepdim=True)
        values.append(float((small & causal).sum() / (causal.sum() * attention.shape[0])))
    return np.array(values)


def accumulated_scores(maps: Sequence[torch.Tensor]) -> np.ndarray:
    """Observation 2: per layer, the attention each key received summed over queries and heads [layers, keys]."""
    return np.stack([attention.sum(dim=(0, 1)).numpy() for attention in maps])


@torch.inference_mode()
def heavy_hitter_map(model, ids: Sequence[int], budget: int, chunk: int = 32) -> np.ndarray:
    """Which token each (layer, KV head) keeps after streaming `ids` with the h2o policy: [layers, kv_heads, tokens]."""
    cache = H2OCache(model, CacheSettings(budget=budget, policy="h2o", chunk=chunk))
    stream_perplexity(model, cache, [list(ids)], chunk)
    layers = cache.layer_slots()
    kept = np.zeros((len(layers), layers[0].valid.shape[0], len(ids)), dtype=np.float32)
    for number, layer in enumerate(layers):
        for head in range(layer.valid.shape[0]):
            index = layer.token_index[head][layer.valid[head]].numpy()
            kept[number, head, index] = 1.0
    return kept


def plot_sparsity(sparsity: np.ndarray, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(np.arange(len(sparsity)), 100 * sparsity, color="#3b6ea5")
    ax.set_xlabel("layer")
    ax.set_ylabel("attention entries < 1% of row max (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Observation 1: attention is sparse in every layer")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_power_law(scores: np.ndarray, path: Path, layers: Sequence[int] | None = None) -> Path:
    plt = _pyplot()
    layers = layers or sorted({0, len(scores) // 2, len(scores) - 1})
    fig, ax = plt.subplots(figsize=(6, 4))
    for layer in layers:
        ranked = np.sort(scores[layer])[::-1]
        ax.loglog(np.arange(1, len(ranked) + 1), ranked, label=f"layer {layer}")
    ax.set_xlabel("token rank")
    ax.set_ylabel("accumulated attention score")
    ax.set_title("Observation 2: accumulated scores follow a power law")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_heavy_hitters(kept: np.ndarray, path: Path) -> Path:
    plt = _pyplot()
    layers, heads, tokens = kept.shape
    fig, ax = plt.subplots(figsize=(9, 5))
    ax.imshow(kept.reshape(layers * heads, tokens), aspect="auto", interpolation="nearest", cmap="Greys")
    ax.set_xlabel("token position")
    ax.set_ylabel(f"layer x KV head ({layers} x {heads})")
    ax.set_title("Tokens the h2o policy keeps (black) at the end of the stream")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_budget_curve(rows: Sequence[dict], path: Path, metric: str = "ppl") -> Path:
    """One line per policy: `metric` against `budget` (rows from `h2o compare --json` or `h2o eval --json`)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    policies = sorted({row["policy"] for row in rows})
    for policy in policies:
        points = sorted(
            (row["budget"], row[metric]) for row in rows if row["policy"] == policy and metric in row
        )
        # A policy that never evicts runs at one budget: a reference line.
        if points and policy in policy_names() and not policy_class(policy).evicts:
            ax.axhline(points[0][1], color="black", linestyle="--", label=policy)
            continue
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("budget (fraction)")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs budget")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

"""Which model families the H2O cache supports, and the text config and context window of a (possibly
multimodal) model. The cache's own: the model loader asks it, never the reverse."""

from __future__ import annotations

from h2o_cli.errors import UnsupportedModelError

# Every layer attends globally: each takes the policy and the budget.
GLOBAL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Sliding-window layers (`layer_types`) beside global ones: a window layer keeps its own window, exactly.
WINDOWED_FAMILIES = ("gemma3_text",)
SUPPORTED_FAMILIES = GLOBAL_FAMILIES + WINDOWED_FAMILIES
SLIDING = "sliding_attention"


def text_config(model):
    """The decoder's config (a multimodal config holds it inside)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def context_window(model) -> int:
    """The model's context window in tokens (`max_position_embeddings`)."""
    return int(text_config(model).max_position_embeddings)


def family_refusal(family: str) -> str | None:
    """The one line that refuses a family the cache cannot serve (None: supported). Read from a config's
    `model_type` or a GGUF header's `general.architecture` (`h2o_cli.models.gguf`), before anything loads."""
    if family in SUPPORTED_FAMILIES:
        return None
    return (
        f"model family {family!r} is not supported by the H2O cache (supported: {', '.join(SUPPORTED_FAMILIES)}); "
        "it needs rotary positions and transformers' attention interface"
    )


def windowed_layers(config) -> list[bool]:
    """For each decoder layer, whether it attends over a sliding window (`layer_types`); all False for a
    family whose layers all attend globally."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [kind == SLIDING and bool(getattr(config, "sliding_window", None)) for kind in types]


def check_family(model) -> None:
    """Raise `UnsupportedModelError` unless the model is a rotary, AttentionInterface-based family we support."""
    config = text_config(model)
    family = getattr(config, "model_type", "?")
    refusal = family_refusal(family)
    if refusal:
        raise UnsupportedModelError(refusal)
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError(f"{family} model caps its attention logits; the H2O cache does not")
    if getattr(getattr(model, "model", None), "rotary_emb", None) is None:
        raise UnsupportedModelError(f"{family} model has no rotary embedding module; cannot re-rotate keys")

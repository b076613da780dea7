"""Which model families the H2O cache supports, and the text config and context window of a (possibly
multimodal) model. The cache's own: the model loader asks it, never the reverse."""

from __future__ import annotations

from h2o_cli.errors import UnsupportedModelError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def text_config(model):
    """The decoder's config (a multimodal config holds it inside)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def context_window(model) -> int:
    """The model's context window in tokens (`max_position_embeddings`)."""
    return int(text_config(model).max_position_embeddings)


def check_family(model) -> None:
    """Raise `UnsupportedModelError` unless the model is a rotary, AttentionInterface-based family we support."""
    config = text_config(model)
    family = getattr(config, "model_type", "?")
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"model family {family!r} is not supported by the H2O cache (supported: {', '.join(SUPPORTED_FAMILIES)}); "
            "it needs rotary positions and transformers' attention interface"
        )
    if getattr(getattr(model, "model", None), "rotary_emb", None) is None:
        raise UnsupportedModelError(f"{family} model has no rotary embedding module; cannot re-rotate keys")

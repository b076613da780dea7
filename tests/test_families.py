"""Every model family the README claims whose layers all attend globally (Llama, Mistral, Qwen2, Qwen3), as
tiny random-weight models: the cache with the full policy equals plain transformers, and an evicting policy
equals the naive reference. Gemma 3 (sliding-window layers beside global ones) is tests/test_gemma.py's."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY_SIZES
from naive import naive_model_nll

from h2o_cli.cache import H2OCache
from h2o_cli.cache.families import GLOBAL_FAMILIES, SUPPORTED_FAMILIES
from h2o_cli.config import CacheSettings

SIZES = TINY_SIZES


def family_pair(family: str):
    """(plain sdpa model, identical model for the H2O cache) of a tiny random config of `family`."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    extra = (
        {"head_dim": 16} if family in ("mistral", "qwen3") else {}
    )  # their defaults (128) assume big models
    if family == "mistral":
        extra["sliding_window"] = None
    config = config_class(**SIZES, **extra)
    torch.manual_seed(0)
    reference = model_class(config).eval()
    with torch.no_grad():  # random biases (Qwen2 q/k/v) and norm weights, so every term is exercised
        for name, param in reference.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model = model_class(copy.deepcopy(config)).eval()
    model.load_state_dict(reference.state_dict())
    return reference, model


def test_every_supported_family_is_covered():
    assert set(GLOBAL_FAMILIES) == {"llama", "mistral", "qwen2", "qwen3"}
    assert set(SUPPORTED_FAMILIES) - set(GLOBAL_FAMILIES) == {"gemma3_text"}  # tests/test_gemma.py


@pytest.mark.parametrize("family", GLOBAL_FAMILIES)
def test_full_policy_equals_plain_transformers(family):
    reference, model = family_pair(family)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(1))
    cache = H2OCache(model, CacheSettings(budget=64, policy="full", positions="original", chunk=16))
    with torch.inference_mode():
        plain = reference(input_ids=ids).logits[0]
        ours = torch.cat(
            [model(input_ids=ids[:, start : start + 16], cache=cache).logits[0] for start in range(0, 60, 16)]
        )
    torch.testing.assert_close(ours, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", GLOBAL_FAMILIES)
@pytest.mark.parametrize("positions", ["rolling", "original"])
def test_evicting_policy_equals_the_naive_reference(family, positions):
    _, model = family_pair(family)
    ids = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    settings = CacheSettings(budget=12, policy="h2o", positions=positions, chunk=4)
    cache = H2OCache(model, settings)
    with torch.inference_mode():
        logits = torch.cat(
            [
                model(input_ids=torch.tensor([ids[start : start + 4]]), cache=cache).logits[0]
                for start in range(0, 48, 4)
            ]
        )
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    got = [-float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert got == pytest.approx(naive_model_nll(model, ids, settings, chunk=4), abs=2e-4)

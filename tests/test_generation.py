"""Sampling and detokenizing as transformers does them: seeded draws equal `generate`'s, streamed text equals
`tokenizer.decode` of all the ids."""

from __future__ import annotations

import pytest
import torch

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.generation import Sampling, TextStreamer, generate_ids

TEXT = (
    "Café déjà vu — naïve résumé; 日本語のテキスト, 中文字符 and Ελληνικά. Emoji: 🦙🔥 👩‍💻 🇫🇷!\n"
    "Plain ASCII after them, then more: ñ ü ß ø å 😀😃 and a line end.\n"
)


@pytest.fixture(scope="module")
def byte_tokenizer(excerpt):
    """A small byte-level BPE (as GPT-2's, SmolLM2's): characters outside its merges split into byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator([excerpt], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def streamed(tokenizer, ids: list[int]) -> tuple[str, list[str]]:
    streamer = TextStreamer(tokenizer)
    pieces = [streamer.push(token) for token in ids]
    return streamer.printed, pieces


def test_streamed_text_equals_decode_of_all_ids(byte_tokenizer):
    ids = byte_tokenizer(TEXT)["input_ids"]
    assert len(ids) > len(TEXT.encode()) // 2  # many characters really are split over byte tokens
    text, pieces = streamed(byte_tokenizer, ids)
    assert text == "".join(pieces) == byte_tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert all("\ufffd" not in piece for piece in pieces)  # never half a character


def test_special_tokens_are_skipped_like_decode(byte_tokenizer):
    eos = byte_tokenizer.eos_token_id
    ids = byte_tokenizer("ok 🦙")["input_ids"] + [eos] + byte_tokenizer(" done")["input_ids"]
    assert streamed(byte_tokenizer, ids)[0] == byte_tokenizer.decode(ids, skip_special_tokens=True)


def test_slow_tokenizer_path_gives_the_same_text(byte_tokenizer):
    """A tokenizer without a Rust backend falls back to decoding the answer each token."""

    class Slow:
        def decode(self, ids, skip_special_tokens=False):
            return byte_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = byte_tokenizer(TEXT)["input_ids"]
    assert streamed(Slow(), ids)[0] == TEXT


def test_embedded_tokenizer_streams_exactly_without_redecoding(smollm, excerpt, monkeypatch):
    _, tokenizer = smollm
    text = excerpt[:2000] + TEXT
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    want = tokenizer.decode(ids, skip_special_tokens=True)
    with monkeypatch.context() as patch:  # incremental: the answer is never decoded again as a whole
        patch.setattr(tokenizer, "decode", lambda *args, **kwargs: pytest.fail("re-decoded the answer"))
        assert streamed(tokenizer, ids)[0] == want


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 1.0), (1.0, 0.8), (1.3, 0.5), (0.0, 1.0)])
def test_seeded_sampling_equals_transformers_generate(tiny_pair, temperature, top_p):
    """Same seed, same tokens as `generate(do_sample=True)` on plain transformers (its warpers, its draw)."""
    reference, model = tiny_pair
    prompt = torch.tensor([[5, 9, 17, 3, 40, 41, 77, 12]])
    sampling = Sampling(max_new_tokens=24, temperature=temperature, top_p=top_p, seed=1234)
    cache = H2OCache(model, CacheSettings(budget=256, policy="full", positions="original"))
    with torch.no_grad():
        logits = model(input_ids=prompt, cache=cache, use_cache=True).logits[0, -1]
    ours = list(generate_ids(model, cache, logits, sampling))

    torch.manual_seed(1234)  # generate draws from the global generator; ours from its own, seeded alike
    theirs = reference.generate(
        prompt, max_new_tokens=24, do_sample=temperature > 0, temperature=temperature or None,
        top_p=top_p, top_k=0, eos_token_id=None, pad_token_id=0, min_new_tokens=24,
    )[0, prompt.shape[1] :].tolist()  # fmt: skip
    assert ours == theirs
    assert temperature == 0 or len(set(ours)) > 4  # really sampled, not one repeated token

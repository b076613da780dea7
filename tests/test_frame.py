"""Pinned tokens (docs/spec.md, pinned tokens): never evicted, on every path, as the naive simulation with pins
(tests/naive.py `choose_victim_pinned`) says; the chat pins its template's tokens and shows them."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from conftest import feed_against_naive
from h2o_kernels import native
from naive import naive_model_nll
from test_eviction import make_layer
from test_fixed_step import FixedSteps
from test_native_step import make_layer as make_native_layer
from test_native_step import needs_compiler

from h2o_cli.cache import H2OCache
from h2o_cli.config import CacheSettings
from h2o_cli.errors import UsageError

N_HEADS = 4
# Pins early and late, more than a budget of 8's heavy share: some steps find every older entry pinned and
# must take the oldest unpinned entry of the recent window.
PINS = {0, 2, 3, 5, 11, 19}
POLICIES = [
    dict(policy="h2o"),
    dict(policy="h2o", score_norm="mean", positions="original"),
    dict(policy="h2o", score_decay=0.8),
    dict(policy="sink", sinks=2),
    dict(policy="tova"),
    dict(policy="local"),
]


def feed_pinned(layer, store, settings, inv_freq, chunks, pins, dtype=torch.float64) -> None:
    """Random chunks through `layer` (its `store` pinned with `pins`) and the naive simulation with the same
    pins: outputs and every head's kept tokens agree after each chunk, and every pinned token read is kept."""
    store.pin(set(pins))

    def pins_kept(store) -> None:
        read = sorted(t for t in pins if t < store.tokens_seen)
        for j in range(store.n_kv_heads):
            assert set(read) <= set(store.token_index[j][store.valid[j]].tolist())
            assert sorted(store.token_index[j][store.pinned[j]].tolist()) == read
        assert store.pinned_count == len(read)

    feed_against_naive(layer, settings, inv_freq, chunks, N_HEADS, pins_kept, dtype, frozenset(pins))


@pytest.mark.parametrize("overrides", POLICIES, ids=lambda o: "-".join(str(v) for v in o.values()))
@pytest.mark.parametrize("chunks", [[1] * 30, [5, 1, 7, 3, 1, 1, 9, 2, 1, 1, 1]], ids=["decode", "chunked"])
def test_chunk_and_torch_step_keep_pins_as_the_naive_simulation(overrides, chunks):
    torch.manual_seed(3)
    settings = CacheSettings(budget=8, chunk=9, kernels="torch", **overrides)
    layer, inv_freq = make_layer(settings)
    feed_pinned(layer, layer.store, settings, inv_freq, chunks, frozenset(PINS))


@pytest.mark.parametrize("overrides", POLICIES[:5], ids=lambda o: "-".join(str(v) for v in o.values()))
def test_fixed_step_keeps_pins_as_the_naive_simulation(overrides):
    torch.manual_seed(4)
    settings = CacheSettings(budget=8, chunk=9, **overrides)
    layer, inv_freq = make_layer(settings)
    pins = frozenset(t for t in PINS if t < 9)  # the fixed step cannot pin a token it writes (refused)
    fixed = FixedSteps(layer)
    feed_pinned(fixed, layer.store, settings, inv_freq, [9] + [1] * 25, pins)
    assert fixed.steps == 25


@needs_compiler
@pytest.mark.parametrize("overrides", [{}, {"score_decay": 0.9}, {"positions": "original"}])
def test_c_step_keeps_pins_as_the_naive_simulation(overrides):
    """The C step's victim skips pinned entries (and takes the oldest unpinned when pins fill the heavy share):
    it runs (mocked count) and agrees with the naive simulation, a pinned token itself taking the torch step."""
    from naive import inv_freq_of
    from test_native_step import CONFIG, HEAD_DIM

    torch.manual_seed(5)
    layer = make_native_layer("native", **overrides)
    pins = frozenset({0, 1, 2, 3, 4, 14, 30})  # 5 of a heavy share of 5 (budget 10): the fallback runs
    with mock.patch.object(native, "step", wraps=native.step) as c_calls:
        feed_pinned(
            layer, layer.store, layer.settings, inv_freq_of(CONFIG, HEAD_DIM), [6, 5] + [1] * 30, pins,
            dtype=torch.float32,
        )  # fmt: skip
    assert c_calls.call_count == 30 - 2  # every step of the full store but the pinned tokens 14 and 30


@pytest.mark.parametrize("policy", ["h2o", "sink", "tova", "recall"])
def test_a_pinned_cache_is_the_naive_simulation_on_a_tiny_model(tiny_pair, policy):
    """Pins through `H2OCache.pin` on a tiny random Llama: every prediction's NLL and every layer's kept tokens
    equal the naive simulation's with the same pins."""
    _, model = tiny_pair
    ids = torch.randint(0, 128, (90,), generator=torch.Generator().manual_seed(6)).tolist()
    extra = {"recall_ratio": 0.25, "archive_max": 128} if policy == "recall" else {}
    settings = CacheSettings(budget=24, policy=policy, chunk=8, **extra)
    pins = frozenset({0, 1, 2, 20, 21, 40, 41, 60})
    cache = H2OCache(model, settings)
    cache.pin(pins)
    sizes = [16] + [8] * 4 + [1] * 42
    got, start = [], 0
    with torch.inference_mode():
        for size in sizes:
            piece = ids[start : start + size]
            logits = model(input_ids=torch.tensor([piece]), cache=cache, use_cache=True).logits[0]
            got.append(torch.log_softmax(logits.double(), dim=-1))
            start += size
    logprobs = torch.cat(got)
    ours = [-float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    states: list = []
    want = naive_model_nll(model, ids, settings.resolved(512), sizes=sizes, pinned=pins, states=states)
    assert ours == pytest.approx(want, abs=2e-4)
    for number, (slots, heads) in enumerate(zip(cache.layer_slots(), states, strict=True)):
        for j, head in enumerate(heads):
            kept = sorted(slots.token_index[j][slots.valid[j]].tolist())
            assert kept == head.alive_indices(), f"layer {number} head {j}"
            assert pins <= set(kept)
    assert cache.report().pinned_slots == len(pins)


def test_pins_past_half_the_budget_are_refused(tiny_pair):
    _, model = tiny_pair
    cache = H2OCache(model, CacheSettings(budget=8, chunk=4))
    cache.pin(range(4))
    with pytest.raises(UsageError, match="half"):
        cache.pin([10])
    cache.unpin([0])
    cache.pin([10])
    assert cache.report().pinned_tokens == 4


# A ChatML-like template over the word tokenizer's words: w3 opens a message, w4 ends it.
TEMPLATE = (
    "{% for m in messages %}w3 {{ m['role'] }} {{ m['content'] }} w4 {% endfor %}"
    "{% if add_generation_prompt %}w3 assistant {% endif %}"
)


def chat_session(model, keep_frame: bool, policy: str = "sink", compiled: bool = False, turns: int = 8):
    from conftest import word_tokenizer

    from h2o_cli.chat import ChatSession
    from h2o_cli.generation import Sampling

    tokenizer = word_tokenizer(128)
    tokenizer.chat_template = TEMPLATE
    settings = CacheSettings(budget=64, chunk=8, policy=policy, kernels="torch")
    session = ChatSession(
        model,
        tokenizer,
        settings,
        Sampling(max_new_tokens=4),
        "w9 w9",
        compiled=compiled,
        keep_frame=keep_frame,
    )
    words = torch.randint(10, 128, (turns, 40), generator=torch.Generator().manual_seed(8))
    session.answers = []
    with torch.inference_mode():
        for number, row in enumerate(words.tolist()):
            with torch._dynamo.config.patch(error_on_recompile=compiled and number > 0):
                session.answers.append(session.ask(" ".join(f"w{word}" for word in row)))
    return session


def resident_everywhere(session, tokens) -> bool:
    tokens = torch.tensor(sorted(tokens))
    return all(
        torch.isin(tokens, slots.token_index[head][slots.valid[head]]).all()
        for slots in session.cache.layer_slots()
        for head in range(slots.token_index.shape[0])
    )


@pytest.mark.parametrize("policy", ["sink", "h2o"])
def test_the_chat_keeps_its_frame_under_eviction(tiny_pair, policy):
    """Eight 40-word messages through a budget of 64: the template's tokens the chat records are exactly the
    template's words, and with `keep_frame` its pins (the system header, then the newest markers, 8 slots) stay
    resident in every layer and head, where without pins `sink` evicts the system message's."""
    _, model = tiny_pair
    pinned = chat_session(model, keep_frame=True, policy=policy)
    assert pinned.cache.tokens_seen > 5 * 64
    template_words = {pinned.tokenizer.convert_tokens_to_ids(word) for word in ("w3", "w4", "w9", "w0")}
    assert {pinned.ids[t] for t in pinned.frame} <= template_words
    content = set(range(len(pinned.ids))) - set(pinned.frame)
    assert not {pinned.ids[t] for t in content} & {3, 4}  # a message's or answer's words are not template
    pins = pinned.frame_pins(64)
    assert len(pins) == 64 // 8 and pins[:5] == [0, 1, 2, 3, 4]  # "w3 system w9 w9 w4": the system message
    assert resident_everywhere(pinned, pins)
    assert pinned.cache.report().pinned_slots == len(pins) == pinned.stats()["pinned_slots"]
    unpinned = chat_session(model, keep_frame=False, policy=policy)
    assert list(unpinned.frame) == list(pinned.frame)[: len(unpinned.frame)]
    if policy == "sink":  # (h2o's sums favour old tokens: on this model it keeps the system message itself)
        assert not resident_everywhere(unpinned, unpinned.frame_pins(64)[:5])


def test_the_panel_shows_the_pinned_slots(tiny_pair):
    from rich.console import Console

    from h2o_cli.chat.snapshot import take_snapshot
    from h2o_cli.cli.panel import PanelView, render_panel

    _, model = tiny_pair
    session = chat_session(model, keep_frame=True)
    console = Console(width=140, record=True, color_system=None)
    console.print(render_panel(take_snapshot(session.cache), PanelView(), 140, 40))
    assert "; 8 pinned)" in console.export_text()
    session.keep_frame = False
    session.rebuild(session.settings)
    console = Console(width=140, record=True, color_system=None)
    console.print(render_panel(take_snapshot(session.cache), PanelView(), 140, 40))
    assert "pinned" not in console.export_text()


@pytest.mark.slow  # dynamo traces the tiny model's forward: tens of seconds on a shared CPU
def test_the_captured_step_keeps_the_frame_without_recompiling(tiny_pair, monkeypatch):
    """`chat --compile --keep-frame`: the answers and kept tokens of a plain session, and the captured step
    traced once although the pins change every turn."""
    from h2o_cli import compiled

    monkeypatch.setattr(compiled, "compile_options", lambda device: {"backend": "eager"})
    _, model = tiny_pair
    plain, captured = (chat_session(model, True, "h2o", flag, turns=4) for flag in (False, True))
    assert captured.answers == plain.answers
    for ours, theirs in zip(captured.cache.layer_slots(), plain.cache.layer_slots(), strict=True):
        for head in range(ours.token_index.shape[0]):
            kept = (slots.token_index[head][slots.valid[head]].sort().values for slots in (ours, theirs))
            assert torch.equal(*kept)
    assert captured.cache.report().pinned_slots == plain.cache.report().pinned_slots > 0

"""The `recall` policy's one-token step in C (h2o_kernels/archive.c and step.c, `RecallLayer._c_step`)
against its torch step (`--kernels torch`): the same recalled tokens in the same order, the same resident sets
and statistics, and the outputs and scores to float tolerance, call by call; and where the torch step stays."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import assert_same_store, feed_against_naive, feed_chunk, feed_torch_and_c, tiny_config
from h2o_kernels import native
from naive import inv_freq_of
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from h2o_cli.cache import H2OCache, RecallLayer
from h2o_cli.cache.positions import Rope
from h2o_cli.cache.recall.archive import PageArchive, PageSettings
from h2o_cli.cache.recall.archive_file import ArchiveFile
from h2o_cli.cache.recall.c_step import RecallCStep, StepScores
from h2o_cli.cache.recall.layer import LeadMode
from h2o_cli.cache.store import LayerStore
from h2o_cli.config import CacheSettings

N_HEADS, N_KV, HEAD_DIM = 6, 2, 16
needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


CONFIG = tiny_config(hidden_size=N_HEADS * HEAD_DIM, num_attention_heads=N_HEADS, num_key_value_heads=N_KV)


def make_layer(
    kernels: str,
    budget: int = 20,
    archive_max: int = 64,
    page_size: int = 4,
    file: Path | None = None,
    **extra,
):
    settings = CacheSettings(
        budget=budget,
        chunk=6,
        policy="recall",
        page_size=page_size,
        archive_max=archive_max,
        kernels=kernels,
        **extra,
    ).resolved(512)
    resident = settings.budget - round(settings.budget * settings.recall_ratio)
    store = LayerStore(N_KV, HEAD_DIM, resident, 6, torch.float32, torch.device("cpu"))
    layer = RecallLayer(store, settings, Rope(LlamaRotaryEmbedding(CONFIG), HEAD_DIM), 512)
    region = None
    if file is not None:  # the archive's K/V in a mapped file, as `--archive PATH` keeps them
        size = PageArchive.stored_bytes(N_KV, HEAD_DIM, settings.archive_max, torch.float32, None)
        layer.archive_file = ArchiveFile(file, size)
        region = layer.archive_file.region(size)
    layer.add_archive(settings.archive_max, torch.float32, torch.device("cpu"), region=region)
    return layer


def mapped_rss_kib(path: Path) -> int:
    """KiB of the mapping of `path` resident in this process (/proc/self/smaps; Linux)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: address range, perms, ..., path
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def same_state(c_layer: RecallLayer, torch_layer: RecallLayer, where) -> None:
    ours, theirs = c_layer.archive, torch_layer.archive  # the C archive write: bit for bit
    assert ours.tokens == theirs.tokens and torch.equal(ours.token_index, theirs.token_index), where
    held = ours.token_index >= 0
    assert torch.equal(ours.keys[:, held], theirs.keys[:, held]), where
    assert torch.equal(ours.values[:, held], theirs.values[:, held]), where
    used = ours.span // ours.page_size
    assert torch.equal(ours.summary[:, :used], theirs.summary[:, :used]), where
    assert torch.equal(c_layer.recall_index, torch_layer.recall_index), where
    torch.testing.assert_close(c_layer.recall_keys, torch_layer.recall_keys, rtol=0, atol=0)
    torch.testing.assert_close(c_layer.recall_values, torch_layer.recall_values, rtol=0, atol=0)
    assert_same_store(c_layer.store, torch_layer.store, where)
    assert (c_layer.recalled, c_layer.hits, c_layer.steps) == (
        torch_layer.recalled,
        torch_layer.hits,
        torch_layer.steps,
    ), where


def run_both(steps: int, chunks=(6, 5), tie_keys: bool = False, c_file: Path | None = None, **options):
    """The same chunks (a prefill, then one-token steps) through a torch-step and a C-step layer, comparing
    the outputs and the whole state after each call. `tie_keys`: most keys are zero (exactly so after the
    model's rotation is undone), so many pages share their summaries and hence their bounds (ties: by age).
    `c_file`: the C layer's archive in this file (the torch layer's stays in RAM). The C calls are counted
    (`native.step`): none from the torch layer, one for each one-token call of the C layer once S is full
    (else both arms ran the torch step and the comparison proved nothing)."""
    torch_layer, c_layer = make_layer("torch", **options), make_layer("native", file=c_file, **options)
    torch.manual_seed(7)
    start, not_full = 0, 0
    with mock.patch.object(native, "step", wraps=native.step) as c_calls:
        for chunk in [*chunks] + [1] * steps:
            q = torch.randn(N_HEADS, chunk, HEAD_DIM) * 2
            k = torch.randn(N_KV, chunk, HEAD_DIM) * 2
            if tie_keys:
                k[:, torch.rand(chunk) < 0.8] = 0.0
            v = torch.randn(N_KV, chunk, HEAD_DIM)
            taken = c_calls.call_count
            want, got = feed_torch_and_c(torch_layer, c_layer, q, k, v, start, c_calls)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
            same_state(c_layer, torch_layer, start)
            not_full += c_calls.call_count > taken and bool((c_layer.recall_index < 0).any())
            start += chunk
    assert c_calls.call_count >= steps - 24  # S fills within a few steps of any prefill here (budget <= 40)
    return torch_layer, c_layer, not_full


@needs_compiler
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"positions": "original"},
        {"heavy_ratio": 0.8},
        {"recall_ratio": 0.75, "page_size": 3, "archive_max": 48},
        {"budget": 40, "archive_max": 64, "page_size": 1},
        {"budget": 40, "archive_max": 64, "page_size": 8, "block_size": 2},
        {"page_score": "attention", "page_size": 8, "block_size": 2, "shortlist": 3, "page_carry": 0.9},
        {"page_score": "attention", "page_size": 4, "shortlist": 6, "step_shortlist": 2, "page_carry": 0.9},
        {"score_decay": 0.95},
        {"recall_place": "contiguous"},
        {"recall_place": "contiguous", "heavy_ratio": 1.0, "page_score": "attention", "page_carry": 0.9},
    ],
    ids=[
        "rolling",
        "original",
        "mostly-heavy",
        "page-3",
        "page-1",
        "page-8-blocks-2",
        "attention",
        "step-shortlist",
        "decay",
        "contiguous",
        "contiguous-no-recent",
    ],  # fmt: skip
)
def test_c_recall_step_equals_the_torch_step(options):
    """150 steps: the archive of 64 tokens wraps many times (its oldest pages dropped), and the early steps
    find fewer candidates than recall slots (heads whose R is not full)."""
    torch_layer, c_layer, not_full = run_both(150, **options)
    assert isinstance(c_layer._c_buffers, RecallCStep)  # the C path ran, not a fallback
    assert torch_layer._c_buffers is None
    assert c_layer.archive.tokens > 2 * c_layer.archive.capacity  # the ring wrapped
    assert c_layer.recalled_total > 0 and c_layer.hits_total > 0


@needs_compiler
@pytest.mark.parametrize("options", [{}, {"page_score": "attention", "page_size": 8, "block_size": 2,
                                      "shortlist": 3, "page_carry": 0.9}], ids=["bound", "attention"])  # fmt: skip
def test_c_recall_step_on_a_file_archive_equals_the_torch_step(tmp_path, options):
    """A float32 archive in a mapped file takes the C step too (it writes and reads through the mapping, then
    releases the pages), with the RAM archive's results; the process keeps none of the file's pages."""
    torch_layer, c_layer, _ = run_both(150, c_file=tmp_path / "archive.bin", **options)
    assert isinstance(c_layer._c_buffers, RecallCStep) and c_layer.archive.region is not None
    assert c_layer.archive.tokens > 2 * c_layer.archive.capacity  # the ring wrapped
    assert c_layer.recalled_total > 0 and c_layer.hits_total > 0
    step = [torch.randn(N_HEADS, 1, HEAD_DIM), *torch.randn(2, N_KV, 1, HEAD_DIM)]  # q, k, v of one more step
    feed_chunk(c_layer, *step, c_layer.archive.tokens)  # (the comparisons above read the file's pages in)
    assert mapped_rss_kib(tmp_path / "archive.bin") == 0


@needs_compiler
def test_a_chunk_longer_than_a_file_archive_keeps_its_last_tokens_as_the_torch_write(tmp_path):
    """A prefill of more tokens than a file archive holds, written by C through the mapping token by token:
    the ring keeps the chunk's last `capacity` tokens (each overwrites its slot), as the torch write's pieces
    leave it."""
    _, c_layer, _ = run_both(30, chunks=(80, 5), c_file=tmp_path / "archive.bin", archive_max=48, page_size=8)
    assert c_layer.archive.capacity < 80 and c_layer.archive.region is not None


@needs_compiler
@pytest.mark.parametrize("positions", ["rolling", "original"])
def test_c_recall_step_with_partly_empty_recall_slots(positions):
    """A prefill of one token: S fills (and the C step starts) while the archive holds fewer candidates than
    recall slots, so the heads' R fill over several C steps; the positions shift as the chunk path's."""
    _, _, not_full = run_both(40, chunks=(1,), budget=24, archive_max=128, positions=positions)
    assert not_full > 0


@needs_compiler
@pytest.mark.parametrize(
    "page_size, step_shortlist", [(16, 0), (4, 0), (16, 3)], ids=["page-16", "page-4", "step-shortlist-3"]
)
def test_c_step_scores_are_the_torch_step_bounds(page_size, step_shortlist):
    """`StepScores.bounds` on steps that score the carried shortlist, or every page while fewer (archive.c's
    `archive_step_scores`, its held keys read only where pages enter the shortlist or were written since) against
    `PageArchive.step_bounds` on a twin archive: the same scores to float rounding and the same best pages,
    step after step, while the ring wraps, chunks rescore every page (so pages still being written are held and
    must be read again), after a rewind and after a reset."""
    n_kv, group, capacity = 3, 3, 7 * page_size  # 7 ring pages, 5 scored: pages being written are among them
    torch_archive, c_archive = (
        PageArchive(
            n_kv,
            HEAD_DIM,
            capacity,
            PageSettings(page_size, attention=True, shortlist=5, carry=0.9, step_shortlist=step_shortlist),
            torch.float32,
            torch.device("cpu"),
        )
        for _ in range(2)
    )
    scores = StepScores(c_archive)
    torch.manual_seed(5)
    scored = 0
    for step in range(6 * capacity):
        if step == capacity:  # a scorer going back: both forget the newest tokens
            for archive in (torch_archive, c_archive):
                archive.rewind(archive.tokens - 3 * page_size // 2)
        if step == 3 * capacity:  # a new text, read past where the old one stopped: nothing held is valid
            length = c_archive.tokens + page_size // 2
            for archive in (torch_archive, c_archive):
                archive.reset()
            key, value = torch.randn(2, n_kv, length, HEAD_DIM)
            for archive in (torch_archive, c_archive):
                archive.write(key, value)
        key, value = torch.randn(2, n_kv, 1 if step else 3 * page_size, HEAD_DIM)
        for archive in (torch_archive, c_archive):
            archive.write(key, value)
        if step % 8 == 0:  # a chunk scores every page afresh: the page being written enters the shortlist
            chunk = torch.randn(n_kv, 4 * group, HEAD_DIM) * 2
            for archive in (torch_archive, c_archive):
                archive.bounds(chunk, archive.span // page_size, chunk=4)
        query = torch.randn(n_kv, group, HEAD_DIM) * 2
        assert c_archive.steps_score_carried_shortlist() == torch_archive.steps_score_carried_shortlist()
        want, got = torch_archive.step_bounds(query), scores.bounds(query)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        best = min(4, want.shape[1])
        assert torch.equal(got.topk(best).indices, want.topk(best).indices), step
        scored += c_archive.steps_score_carried_shortlist()
    assert scored > 4 * capacity and c_archive.tokens > 4 * capacity  # the C scores ran, the ring wrapped


@needs_compiler
def test_c_recall_step_breaks_bound_ties_as_the_torch_step():
    """Pages of one token, most of them zero keys: those pages' bounds are all 0, ranked oldest first."""
    torch_layer, c_layer, _ = run_both(120, tie_keys=True, page_size=1, archive_max=48)
    zero_pages = (c_layer.archive.summary == 0).all(dim=2)
    assert (zero_pages.sum(dim=1) > c_layer.recall_index.shape[1]).all()  # more tied pages than slots


@needs_compiler
@pytest.mark.parametrize("options", [{"archive_bits": 8}, {"archive_bits": 16}, {"kernels": "torch"}])
def test_int8_or_16bit_archives_keep_the_torch_step(tiny_pair, options):
    """Archives other than float32 ones (and `--kernels torch`) take the torch step."""
    _, model = tiny_pair
    cache = H2OCache(model, CacheSettings(budget=24, policy="recall", chunk=8, **options))
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        model(ids[:, :30], cache=cache)
        for step in range(30, 40):
            model(ids[:, step : step + 1], cache=cache)
    assert all(layer._c_buffers is None for layer in cache.layers)
    cache.close()


@needs_compiler
@pytest.mark.model
@pytest.mark.parametrize(
    ("positions", "lead"), [("rolling", "none"), ("original", "none"), ("rolling", "18.2")]
)
def test_c_recall_step_on_the_embedded_model(smollm, excerpt, positions, lead, monkeypatch):
    """The embedded model reads a text through a torch-step cache; every layer call is also given, with the
    same inputs, to the same layer of a C-step cache: the same recalled tokens and resident sets, outputs and
    scores to float tolerance, over 160 decode calls on a ring of 128 tokens that wraps (with a lead head: a
    question of 16 tokens, then 144 answer steps, each layer recalling the lead's pages). Both take the page
    scores from torch: real keys tie (a page's score equals another's to the last bit), and the C scores'
    float rounding would break such a tie the other way; they are checked on the model below."""
    monkeypatch.setattr(native, "has_step_scores", lambda: False)
    model, tokenizer = smollm
    ids = tokenizer(excerpt)["input_ids"][:320]
    options = dict(budget=64, policy="recall", chunk=32, page_size=4, archive_max=128, positions=positions,
                   recall_lead=lead)  # fmt: skip
    leading = H2OCache(model, CacheSettings(**options, kernels="torch"))
    shadow = H2OCache(model, CacheSettings(**options, kernels="native"))
    compared = []
    for theirs, mine in zip(leading.layers, shadow.layers, strict=True):

        def update(key_states, value_states, *args, kwargs=None, _theirs=theirs, _mine=mine, **extra):
            result = type(_theirs).update(_theirs, key_states, value_states, *args, kwargs=kwargs, **extra)
            _mine.update(
                key_states, value_states, kwargs={"position_ids": (kwargs or {}).get("position_ids")}
            )
            return result

        def attend(query, scaling, _theirs=theirs, _mine=mine):
            want = type(_theirs).attend(_theirs, query, scaling)
            got = _mine.attend(query, scaling)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            same_state(_mine, _theirs, _theirs.store.tokens_seen)
            compared.append(query.shape[2])
            return want

        theirs.update, theirs.attend = update, attend
    first = 160
    with torch.no_grad():
        for start in range(0, 160, 32):
            model(torch.tensor([ids[start : start + 32]]), cache=leading)
        if lead != "none":  # a question: the answer steps recall the lead's pages
            first = 176
            with leading.asking(16), shadow.asking(16):
                model(torch.tensor([ids[160:first]]), cache=leading)
        for step in range(first, 320):
            model(torch.tensor([ids[step : step + 1]]), cache=leading)
    assert compared.count(1) == (320 - first) * len(leading.layers)
    assert all(isinstance(layer._c_buffers, RecallCStep) for layer in shadow.layers)
    assert shadow.layers[0].archive.tokens > 2 * shadow.layers[0].archive.capacity
    if lead != "none":
        assert all(layer.lead_mode is not LeadMode.OWN for layer in shadow.layers)
        assert min(layer.recalled_total for layer in shadow.layers) > 0


@needs_compiler
@pytest.mark.model
def test_c_step_scores_on_the_embedded_model(smollm, excerpt, monkeypatch):
    """A C-step cache reads a text with the embedded model; at every decode call of every layer, the C page
    scores (`StepScores.bounds`, keys held in half precision) equal torch's `step_bounds` on the same archive
    and carried scores to float rounding, while the shortlist's held keys follow a ring that wraps."""
    model, tokenizer = smollm
    ids = tokenizer(excerpt)["input_ids"][:320]
    settings = CacheSettings(
        budget=64,
        policy="recall",
        chunk=32,
        page_size=16,
        archive_max=256,
        step_shortlist=6,
        kernels="native",
        lead_text=False,  # every layer's steps score pages (with lead text only the lead's do)
    )
    cache = H2OCache(model, settings)
    c_bounds, compared = StepScores.bounds, []

    def bounds(self, query):
        archive = self.archive
        if not archive.steps_score_carried_shortlist():
            return c_bounds(self, query)
        carried = (archive.carried.clone(), archive.carried_start.clone(), archive._held_keys)
        want = archive.step_bounds(query)  # torch, then the carried scores as they were, for C
        archive.carried.copy_(carried[0]), archive.carried_start.copy_(carried[1])
        archive._held_keys = carried[2]
        got = c_bounds(self, query)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        compared.append(archive.span // archive.page_size > archive.step_shortlist)
        return got

    monkeypatch.setattr(StepScores, "bounds", bounds)
    with torch.no_grad():
        for start in range(0, 160, 32):
            model(torch.tensor([ids[start : start + 32]]), cache=cache)
        for step in range(160, 320):
            model(torch.tensor([ids[step : step + 1]]), cache=cache)
    assert len(compared) >= 100 * len(cache.layers) and sum(compared) > len(compared) // 2  # shortlists ran
    assert cache.layers[0].archive.tokens > cache.layers[0].archive.capacity  # the ring wrapped


def test_without_a_compiler_the_torch_recall_step_runs(monkeypatch, tmp_path):
    """`--kernels native` and no C compiler: the torch step, no C call, outputs, resident sets and recalled
    tokens by docs/spec.md (the naive simulation, which has no archive cap: the archive holds every token)."""
    monkeypatch.setenv("H2O_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    native.library.cache_clear()
    native.available.cache_clear()
    try:
        layer = make_layer("native", archive_max=64)
        torch.manual_seed(7)
        with mock.patch.object(native, "step", wraps=native.step) as c_calls:
            feed_against_naive(
                layer, layer.settings, inv_freq_of(CONFIG, HEAD_DIM), [6, 5] + [1] * 20, N_HEADS,
                dtype=torch.float32,
            )  # fmt: skip
    finally:
        native.library.cache_clear()
        native.available.cache_clear()
    assert c_calls.call_count == 0 and layer._c_buffers is None
    assert layer.archive.oldest == 0 and layer.recalled_total > 0


@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("positions", ["rolling", "original"])
def test_both_decode_steps_equal_the_chunk_path(tiny_pair, positions, kernels):
    """With a RAM archive under `auto` the C step now takes a full S's decode calls, so the torch step is held
    to the chunk path here too (tests/test_recall_step.py's check, one setting): bit for bit the same recalled
    tokens and resident sets, logits to float tolerance.

    The C attention rounds differently from torch's (~1e-7), so from the second layer on the page bounds differ
    by that much, and two pages that tie at the cut can swap: with the positional page score this sequence
    has such a tie (layer 1, step 89, bounds equal to 6 digits), so it runs on the unrotated score, where it
    has none. The C and torch steps on identical inputs, positional score included, are compared call by call
    above."""
    from test_recall_step import run

    _, model = tiny_pair
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(11))
    options = dict(
        budget=24, policy="recall", chunk=8, positions=positions, page_size=3, archive_max=48,
        page_score="unrotated",
    )  # fmt: skip
    fast = H2OCache(model, CacheSettings(**options, kernels=kernels))
    slow = H2OCache(model, CacheSettings(**options))
    for layer in slow.layers:
        layer._step_path = False  # every call on the chunk path
    torch.testing.assert_close(
        run(model, fast, ids, 60, 8), run(model, slow, ids, 60, 8), rtol=1e-5, atol=1e-5
    )
    for mine, theirs in zip(fast.layers, slow.layers, strict=True):
        assert (mine._c_buffers is not None) == (kernels == "native" and native.compiler() is not None)
        assert torch.equal(mine.recall_index, theirs.recall_index)
        for head in range(mine.store.n_kv_heads):
            kept = mine.store.token_index[head][mine.store.valid[head]].sort().values
            assert torch.equal(kept, theirs.store.token_index[head][theirs.store.valid[head]].sort().values)
        assert (mine.recalled_total, mine.hits_total) == (theirs.recalled_total, theirs.hits_total)

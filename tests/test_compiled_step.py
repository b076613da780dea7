"""A whole one-token forward over the cache captured by `torch.compile(fullgraph=True)` (h2o_cli.compiled): no
graph break and no host sync (fullgraph fails on either), no recompilation from one step to the next, and the
same greedy tokens and logits as the eager default path, token by token, past a full cache (an eviction every
step). The layer-level rule is tests/test_fixed_step.py."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from h2o_cli.cache import H2OCache
from h2o_cli.compiled import CompiledStep
from h2o_cli.config import CacheSettings

POLICIES = ["h2o", "sink", "local", "tova", "recall"]
FIGURES = ("length", "tokens_seen", "evictions")
ARCHIVE_FIGURES = ("archive_tokens", "archive_reach", "recalled_per_step", "recall_hits")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing (and leaves nothing behind for the next)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def same_logits(got: torch.Tensor, want: torch.Tensor, number: int) -> None:
    """A float32 model's step: the same greedy token, the logits to float rounding, on the logits' own scale
    (the embedded model's reach ~30, the tiny random Llama's stay below 1)."""
    assert int(got.argmax()) == int(want.argmax()), f"step {number}"
    # Float rounding only, but 30 layers amplify it at some tokens: at one step of this text under `local`
    # the torch step and the chunk path (the reference) already differ by 9e-3 with logits of ~30, 3e-4 of the
    # largest |logit|. So the absolute tolerance is 7e-4 of it (2e-2 there).
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=7e-4 * scale, msg=f"step {number}")


def decode_both(
    model, ids: torch.Tensor, settings: CacheSettings, steps: int, backend: str | None, check=same_logits
):
    """Prefill `ids` [1, n] (eagerly) into two caches, then decode `steps` greedy tokens on each: one by the
    model's eager forward on the default path, one by `CompiledStep`. After the first step (the compilation)
    any recompilation is an error. `backend` None: `CompiledStep`'s own choice (`compile_options`, what
    `--compile` runs), not counted. `check(got, want, step)` compares the logits at every step (the reference's
    token is fed to both); returns (eager cache, compiled cache, compile counter or None)."""
    eager, captured = H2OCache(model, settings), H2OCache(model, settings)
    with torch.inference_mode():
        logits = model(ids, cache=eager).logits[0, -1]
        model(ids, cache=captured)
    counter = None if backend is None else CompileCounterWithBackend(backend)
    step = CompiledStep(model, captured, backend=counter)
    token = int(logits.argmax())
    for number in range(steps):
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([[token]], device=ids.device), cache=eager).logits[0, -1]
            with torch._dynamo.config.patch(error_on_recompile=number > 0):
                got = step(token)
        check(got, want, number)
        token = int(want.argmax())
    return eager, captured, counter


def assert_same_cache(eager: H2OCache, captured: H2OCache, hits_rel: float | None = None) -> None:
    """The same counters, the same kept tokens per head, the same archive figures; `hits_rel`: the recall hits
    per step to that relative tolerance (a 16-bit model's paths can recall other pages at a near tie)."""
    mine, theirs = captured.report(), eager.report()
    assert [getattr(mine, name) for name in FIGURES] == [getattr(theirs, name) for name in FIGURES]
    for ours, reference in zip(captured.stores, eager.stores, strict=True):
        for head in range(ours.n_kv_heads):
            kept = ours.token_index[head][ours.valid[head]].sort().values
            assert torch.equal(kept, reference.token_index[head][reference.valid[head]].sort().values)
    if mine.archive:
        exact = [key for key in ARCHIVE_FIGURES if key != "recall_hits"]
        assert [getattr(mine.archive, key) for key in exact] == pytest.approx(
            [getattr(theirs.archive, key) for key in exact]
        )
        assert mine.archive.recall_hits == pytest.approx(theirs.archive.recall_hits, rel=hits_rel)


@pytest.fixture(scope="module")
def prompt(smollm, excerpt) -> torch.Tensor:
    """200 tokens of real text: at budget 32 every decode step evicts."""
    return smollm[1](excerpt, return_tensors="pt").input_ids[:, :200]


@pytest.fixture(scope="module")
def first_layers(smollm):
    """The embedded model cut to its first two decoder layers (the same modules and weights, no copy): the
    graph holds every op of a layer, the first layer's and a later one's, and traces in seconds rather than
    the whole model's minutes (the `slow` tests here and tests/test_compiled_whole.py take the whole model)."""
    model, inner = shallow_copy(smollm[0]), shallow_copy(smollm[0].model)
    model.config = inner.config = copy.deepcopy(model.config)
    model.config.num_hidden_layers = 2
    inner.layers = torch.nn.ModuleList(list(inner.layers)[:2])
    model.model = inner
    yield model
    assert len(smollm[0].model.layers) == smollm[0].config.num_hidden_layers == 30  # the session's is whole


def shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A module sharing `module`'s submodules and weights, whose own submodules can be replaced without
    touching `module` (a plain `copy.copy` shares the dict that holds them)."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


@pytest.mark.parametrize("policy", POLICIES)
def test_captured_decode_equals_eager(first_layers, prompt, policy):
    """The embedded model's layers, 64 greedy steps past a full cache, the forward traced whole by dynamo
    (`fullgraph=True`: a graph break or a host sync fails; the `eager` backend runs the traced graph as it is).
    Recall's archive in RAM and no lead, as the fixed step takes them (its default reach goes to a file)."""
    settings = CacheSettings(budget=32, chunk=16, policy=policy, archive="ram", recall_lead="none")
    eager, captured, counter = decode_both(first_layers, prompt, settings, 64, "eager")
    assert counter.frame_count == 1  # one graph, compiled once
    assert eager.report().evictions > 64  # every decode step evicted
    assert_same_cache(eager, captured)


# A 16-bit model's fixed step against its eager chunk path (the reference). Both keep K/V in 16 bits and the
# softmax in float32, but the chunk path takes the query·key product in the model's dtype and the fixed step in
# float32; the attention outputs differ by 16-bit rounding, the next layers carry that on, and the logits come
# out rounded to the model's dtype (bf16: 8 significant bits, a step of 0.25 between 32 and 64). So the
# difference is absolute, spread over the vocabulary: with the embedded model's two layers on this text (logits
# up to ~80), over 64 steps under every policy, at most 0.75 (three such steps) and at most 0.16 on average over
# the vocabulary at a step (0.04 over the whole run).
BF16_LOGITS = {"most": 1.0, "mean": 0.25}


class SixteenBitLogits:
    """`decode_both`'s check for a 16-bit model: |logit - reference logit| at most `most` and on average over
    the vocabulary at most `mean`; the greedy token the reference's or a near tie of it (the reference's best
    logit within `most` of its logit for the fixed step's choice). Counts the steps whose token differs."""

    def __init__(self, most: float, mean: float) -> None:
        self.most, self.mean = most, mean
        self.other_tokens = 0

    def __call__(self, got: torch.Tensor, want: torch.Tensor, number: int) -> None:
        got, want = got.float(), want.float()
        difference = (got - want).abs()
        assert float(difference.max()) <= self.most, (number, float(difference.max()))
        assert float(difference.mean()) <= self.mean, (number, float(difference.mean()))
        top = int(got.argmax())
        if top != int(want.argmax()):
            self.other_tokens += 1
            assert float(want.max() - want[top]) <= self.most, number


@pytest.fixture(scope="module")
def first_layers_bf16(first_layers):
    """The two-layer cut in bfloat16 (a copy: the session's model stays float32), as a GPU runs it."""
    return copy.deepcopy(first_layers).to(torch.bfloat16)


@pytest.mark.parametrize("policy", POLICIES)
def test_captured_bf16_decode_matches_the_bf16_chunk_path(first_layers_bf16, prompt, policy):
    """A bfloat16 model on the fixed step (K/V stored in bf16, attention and scores in float32), traced whole
    (`fullgraph=True`, no recompilation), 64 steps past a full cache: the eager bf16 forward's logits and
    tokens to bf16 rounding (`SixteenBitLogits`), the same counters and kept tokens, the store still bf16."""
    settings = CacheSettings(budget=32, chunk=16, policy=policy, archive="ram", recall_lead="none")
    check = SixteenBitLogits(**BF16_LOGITS)
    eager, captured, counter = decode_both(first_layers_bf16, prompt, settings, 64, "eager", check)
    assert counter.frame_count == 1
    assert eager.report().evictions > 64
    assert check.other_tokens <= 2  # near ties of bf16 logits: 0 or 1 of 64 steps on this text
    # The recalled pages can differ at a near tie of the page bounds: the second layer's queries differ by bf16
    # rounding (the recall hits per step differ by 0.7 % on this text).
    assert_same_cache(eager, captured, hits_rel=0.02)
    for store in captured.stores:
        assert store.keys.dtype == store.values.dtype == store.compute_dtype == torch.bfloat16
        assert store.scores.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fixed_step_of_a_16_bit_model_follows_its_chunk_path(tiny_pair, dtype):
    """The tiny random Llama in 16 bits, its fixed step run eagerly (`compile=False`: no trace), from a chunked
    prompt through 40 tokens that evict: the chunk path's logits to 16-bit rounding and its kept tokens, a
    16-bit store; and no further than the chunk path from float32 arithmetic (the same 16-bit weights in a
    float32 model, its own cache: the C step)."""
    model = copy.deepcopy(tiny_pair[1]).to(dtype)
    exact = copy.deepcopy(model).float()
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(4))
    settings = CacheSettings(budget=12, chunk=8, policy="h2o")
    eager, fixed, reference = H2OCache(model, settings), H2OCache(model, settings), H2OCache(exact, settings)
    with torch.inference_mode():
        token = int(model(ids, cache=eager).logits[0, -1].argmax())
        model(ids, cache=fixed)
        exact(ids, cache=reference)
    # Logits below 1 here, where bf16's step is 2**-8 or finer: observed at most 0.004 (bf16), 0.0005 (fp16),
    # on average over the vocabulary 0.001 and 0.0001.
    step, check = CompiledStep(model, fixed, compile=False), SixteenBitLogits(most=2**-6, mean=2**-8)
    errors = torch.zeros(2)  # mean |logit - float32 logit| of the fixed step, of the chunk path
    for number in range(40):
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([[token]]), cache=eager).logits[0, -1]
            got = step(token)
            truth = exact(input_ids=torch.tensor([[token]]), cache=reference).logits[0, -1]
        check(got, want, number)
        errors += torch.stack([(got.float() - truth).abs().mean(), (want.float() - truth).abs().mean()])
        token = int(want.argmax())
    assert fixed.report().evictions == 20 + 40 - 12
    assert_same_cache(eager, fixed)
    assert fixed.stores[0].keys.dtype == fixed.stores[0].values.dtype == dtype
    assert errors[0] <= 1.05 * errors[1], (
        errors
    )  # observed 2 % below (the model's own 16-bit layers dominate)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_inductor_decode_equals_eager(smollm, prompt, policy):
    """As above, compiled by inductor (what `--compile` runs on a CPU). No lead head in either cache: the fixed
    step takes none, and `auto` would give the eager one a lead whose pages its steps follow."""
    settings = CacheSettings(budget=32, chunk=16, policy=policy, recall_lead="none")
    eager, captured, counter = decode_both(smollm[0], prompt, settings, 64, "inductor")
    assert counter.frame_count == 1
    assert_same_cache(eager, captured)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_graph_decode_equals_eager(tiny_pair, policy):
    """On CUDA, replayed as a CUDA graph (`mode="reduce-overhead"`, what `--compile` runs there). The tiny
    random Llama: a GPU machine need not hold the embedded model's file."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = copy.deepcopy(tiny_pair[1]).cuda()
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(3)).cuda()
    settings = CacheSettings(budget=32, chunk=16, policy=policy, page_size=2)
    eager, captured, _ = decode_both(model, ids, settings, 64, None)  # reduce-overhead
    assert captured.report().evictions > 0
    assert_same_cache(eager, captured)


@pytest.mark.heavy  # dynamo traces the whole forward: seconds per policy
@pytest.mark.parametrize("policy", ["h2o", "sink", "recall"])  # the victim by min, by priority; recall
def test_filling_cache_decodes_in_one_graph(tiny_pair, policy):
    """From an empty cache, every token a captured step (as `stream --chunk 1 --compile` feeds them): the
    shapes do not change while the cache fills, so the one graph serves before and after evictions start."""
    _, model = tiny_pair
    ids = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(5))
    settings = CacheSettings(budget=12, chunk=4, policy=policy, page_size=2)
    eager, captured, counter = decode_both(model, ids, settings, 40, "eager")
    assert counter.frame_count == 1
    assert eager.report().evictions > 0
    assert_same_cache(eager, captured)


@pytest.mark.parametrize(("policy", "span"), [("h2o", None), ("recall", 120)])
def test_stream_perplexity_on_the_captured_step_equals_eager(first_layers, excerpt, smollm, policy, span):
    """`stream_perplexity` with `--chunk 1` from an empty cache: the same perplexity through the captured step
    as through the model's forward (the library path `h2o stream --ppl --chunk 1 --compile` takes); under
    recall with the archive sized to the text, as `stream --max-tokens` sizes it (every ring page scored)."""
    from h2o_cli.streaming import stream_perplexity

    ids = smollm[1](excerpt).input_ids[:120]
    settings = CacheSettings(budget=32, chunk=1, policy=policy, recall_lead="none")
    eager = stream_perplexity(first_layers, H2OCache(first_layers, settings, archive_span=span), [ids], 1)
    cache = H2OCache(first_layers, settings, archive_span=span)
    step = CompiledStep(first_layers, cache, backend="eager")
    captured = stream_perplexity(first_layers, cache, [ids], 1, step=step)
    assert (
        captured.predictions == eager.predictions == 119
        and cache.report().evictions == 120 - cache.stores[0].budget
    )
    assert captured.ppl == pytest.approx(eager.ppl, rel=1e-5)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"policy": "recall", "archive": "disk"}, "--archive ram"),
        ({"policy": "recall", "positions": "original"}, "--page-score unrotated"),
    ],
)
def test_settings_the_fixed_step_cannot_take_are_usage_errors(
    tiny_pair, tmp_path, monkeypatch, options, words
):
    """One line naming the fix (exit 2 at the CLI), before anything is compiled."""
    from h2o_cli.errors import UsageError

    monkeypatch.setenv("H2O_HOME", str(tmp_path))
    _, model = tiny_pair
    options = dict(options)
    model = model.to(options.pop("dtype", torch.float32))
    cache = H2OCache(model, CacheSettings(budget=12, chunk=4, page_size=2, **options))
    with pytest.raises(UsageError, match=words):
        CompiledStep(model, cache, backend="eager")
    cache.close()


@pytest.mark.slow
def test_stream_ppl_compile_flag_gives_the_eager_perplexity():
    """`h2o stream FILE --ppl --chunk 1 --compile` (inductor, the whole model) prints the eager perplexity."""
    from test_cli_stream import EXCERPT, h2o

    args = ["--ppl", "--json", "--budget", "32", "--max-tokens", "96", "--chunk", "1"]
    eager = h2o("stream", EXCERPT, *args)
    compiled = h2o("stream", EXCERPT, *args, "--compile", timeout=1800)
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr.decode()
    eager_report, compiled_report = json.loads(eager.stdout), json.loads(compiled.stdout)
    assert compiled_report["predictions"] == eager_report["predictions"] == 95
    assert compiled_report["ppl"] == pytest.approx(eager_report["ppl"], rel=1e-5)


def test_captured_step_keeps_no_autograd_graph(tiny_pair):
    """A model whose weights require grad (any model not frozen): the step's logits carry no autograd graph,
    so nothing of a step's activations outlives it (with one, a CUDA graph's pool grew until it ran out)."""
    _, model = tiny_pair
    assert all(weight.requires_grad for weight in model.parameters())
    cache = H2OCache(model, CacheSettings(budget=12, chunk=4, policy="h2o"))
    with torch.inference_mode():
        model(torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(2)), cache=cache)
    step = CompiledStep(model, cache, compile=False)
    logits = step(5)
    assert not logits.requires_grad and logits.grad_fn is None


@pytest.mark.heavy  # dynamo traces the whole forward: seconds
def test_generate_ids_on_the_captured_step_gives_the_same_answer(tiny_pair):
    """`generate_ids` (what `stream` and `chat` answer with) through `CompiledStep`: the same greedy ids as
    through the model's forward, after a chunked prompt, and the cache's report continues exactly."""
    from h2o_cli.generation import Sampling, generate_ids

    _, model = tiny_pair
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(8))
    settings, sampling = CacheSettings(budget=12, chunk=8), Sampling(max_new_tokens=24)
    answers, reports = [], []
    for compiled in (False, True):
        cache = H2OCache(model, settings)
        with torch.inference_mode():
            logits = model(ids, cache=cache).logits[0, -1]
        step = CompiledStep(model, cache, backend="eager") if compiled else None
        answers.append(list(generate_ids(model, cache, logits, sampling, step=step)))
        reports.append([getattr(cache.report(), name) for name in FIGURES])
    assert answers[0] == answers[1] and len(answers[0]) == 24
    assert reports[0] == reports[1] == [12, 30 + 24, 30 + 24 - 12]


def test_chat_answers_on_the_captured_step_as_without_it(first_layers, smollm, monkeypatch):
    """`h2o chat --compile`'s session: two turns (the second after a prefill on the same cache, which the
    captured step must follow without recompiling) give the answers and the cache figures of a plain session."""
    from h2o_cli import compiled
    from h2o_cli.chat import ChatSession
    from h2o_cli.generation import Sampling

    monkeypatch.setattr(compiled, "compile_options", lambda device: {"backend": "eager"})  # traced, fast
    sessions = [
        ChatSession(first_layers, smollm[1], CacheSettings(budget=24, chunk=16), Sampling(12), compiled=flag)
        for flag in (False, True)
    ]
    for number, message in enumerate(["Hello there.", "Tell me about the sea."]):
        with torch._dynamo.config.patch(error_on_recompile=number > 0):
            plain, captured = (session.ask(message) for session in sessions)
        assert captured == plain
    assert [sessions[1].cache.report().tokens_seen, sessions[1].cache.report().evictions] == [
        sessions[0].cache.report().tokens_seen,
        sessions[0].cache.report().evictions,
    ]


@pytest.mark.heavy  # inductor compiles the page choice: tens of seconds
def test_inductor_scores_pages_on_keys_held_in_float16():
    """A span-sized archive (as `stream --max-tokens` builds it: every ring page within the step shortlist, so
    a step scores every page by attention mass over keys held in float16) compiled by inductor as
    `CompiledStep` compiles: the page masses and the choice of R are the eager fixed step's. Inductor by
    default keeps a fused cast to float16 in float32 (the masses moved by 1e-4, the recalled pages with them);
    `CompiledStep` has it round as written."""
    from h2o_cli.cache.recall.archive import PageArchive, PageSettings
    from h2o_cli.compiled import inductor_settings

    torch.manual_seed(0)
    n_kv, head_dim, written = 3, 64, 200
    settings = PageSettings(16, attention=True, shortlist=512, carry=0.9)
    archive = PageArchive(n_kv, head_dim, 304, settings, torch.float32, torch.device("cpu"))
    keys, values = torch.randn(n_kv, written, head_dim) * 3, torch.randn(n_kv, written, head_dim)
    for token in range(written):
        archive.write_fixed(keys[:, token : token + 1], values[:, token : token + 1], torch.tensor([token]))
        archive.stepped_fixed()
    assert archive.pages <= archive.step_shortlist  # every page scored: the branch a span takes
    resident = torch.full((n_kv, 65), -1)
    resident[:, :40] = torch.stack([torch.randperm(written - 1)[:40] for _ in range(n_kv)])
    resident[:, 40] = written - 1
    query = torch.randn(n_kv, 3, head_dim)
    captured = copy.deepcopy(archive)
    want = archive.choose_fixed(query, resident, 32)
    with inductor_settings():
        got = torch.compile(lambda q: captured.choose_fixed(q, resident, 32), fullgraph=True)(query)
    torch.testing.assert_close(captured.carried, archive.carried, rtol=0, atol=1e-6)  # 1e-4 off unrounded
    assert torch.equal(got[1], want[1]) and torch.equal(got[0][got[1]], want[0][want[1]])


@pytest.mark.heavy  # inductor compiles two layers: tens of seconds
def test_inductor_recall_step_keeps_the_eager_fixed_step_state(first_layers, excerpt, smollm):
    """The embedded model's two layers under recall with the archive sized to the text (as `stream
    --max-tokens` sizes it), from an empty cache through 80 tokens (48 past a full one), compiled by inductor
    as `--compile` compiles it: after every step each layer holds what the eager fixed step holds (S's token
    indices, empty slots included, and R's), and the logits agree to float rounding. Inductor once compiled the
    recall step's rolling ranks so that they overwrote S's token indices (the whole model's perplexity went
    from 18 to 165)."""
    ids = smollm[1](excerpt).input_ids[:80]
    settings = CacheSettings(budget=32, chunk=1, policy="recall", recall_lead="none")
    eager, captured = (H2OCache(first_layers, settings, archive_span=len(ids)) for _ in range(2))
    reference, step = CompiledStep(first_layers, eager, compile=False), CompiledStep(first_layers, captured)
    for number, token in enumerate(ids):
        same_logits(step(token), reference(token), number)
        for ours, theirs in zip(captured.layers, eager.layers, strict=True):
            assert torch.equal(ours.store.token_index, theirs.store.token_index), number
            assert torch.equal(ours.store.valid, theirs.store.valid), number
            assert torch.equal(ours.recall_index, theirs.recall_index), number
    assert captured.report().evictions == eager.report().evictions == len(ids) - captured.stores[0].budget

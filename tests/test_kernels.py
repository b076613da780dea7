"""Triton kernels against their pure-torch references (CPU: TRITON_INTERPRET=1; set before triton loads)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
pytestmark = pytest.mark.triton

from h2o_kernels import decode as decode_ref  # noqa: E402
from h2o_kernels import prefill as prefill_ref  # noqa: E402
from h2o_kernels import triton_decode, triton_prefill  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rope_tables(length: int, head_dim: int, dtype: torch.dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)


def slot_state(n_kv: int, slots: int, length: int, seed: int):
    """A slot cache with `length` valid entries per head in scattered slots, ranks dense by token index."""
    gen = torch.Generator().manual_seed(seed)
    valid = torch.zeros(n_kv, slots, dtype=torch.bool)
    token_index = torch.full((n_kv, slots), -1, dtype=torch.int64)
    rank = torch.zeros(n_kv, slots, dtype=torch.int64)
    for head in range(n_kv):
        chosen = torch.randperm(slots, generator=gen)[:length]
        tokens = torch.sort(torch.randperm(4 * slots, generator=gen)[:length]).values
        valid[head, chosen] = True
        token_index[head, chosen] = tokens
        rank[head, chosen] = torch.arange(length)
    return valid.to(DEVICE), token_index.to(DEVICE), rank.to(DEVICE)


def tolerance(result: torch.Tensor, exact: torch.Tensor, torch_result: torch.Tensor) -> bool:
    """FlagAttention's rule: kernel error <= 2 * torch's own error (same dtype) + 1e-5."""
    torch_err = (torch_result.double() - exact.double()).abs().max().item()
    kernel_err = (result.double() - exact.double()).abs().max().item()
    return kernel_err <= 2 * torch_err + 1e-5


def check_decode(dtype, n_heads, n_kv, slots, length, recent=8):
    """The decode kernel against the torch reference and the float64 reference (FlagAttention's rule), and
    its eviction candidate by hand."""
    head_dim = 32
    gen = torch.Generator().manual_seed(slots)
    query = torch.randn(n_heads, head_dim, generator=gen)
    keys = torch.randn(n_kv, slots, head_dim, generator=gen)
    values = torch.randn(n_kv, slots, head_dim, generator=gen)
    valid, token_index, rank = slot_state(n_kv, slots, length, seed=slots)
    scores = torch.rand(n_kv, slots, generator=gen).to(DEVICE)
    recent_rank = length - recent

    def run(fn, q_dtype, table_dtype):
        cos, sin = rope_tables(length + 1, head_dim, table_dtype)
        s = scores.clone()
        args = (
            query.to(DEVICE, q_dtype),
            keys.to(DEVICE, q_dtype),
            values.to(DEVICE, q_dtype),
            valid,
            rank,
            rank,
        )
        out = fn(*args, token_index, length, cos, sin, head_dim**-0.5, s, recent_rank)
        return (*out, s)

    exact = run(decode_ref.decode_attention, torch.float64, torch.float64)
    torch_out = run(decode_ref.decode_attention, dtype, dtype)
    kernel_out = run(triton_decode.decode_attention, dtype, dtype)
    for index in (0, 1, 3):  # output, increments, updated scores
        assert tolerance(kernel_out[index], exact[index], torch_out[index])
    assert kernel_out[0].dtype == dtype
    # The candidate, by hand on the kernel's own updated scores: the lowest score outside the recent window,
    # ties to the oldest token (SPEC.md), whatever slot it sits in; -1 for a head with no such entry.
    eligible = valid & (rank < recent_rank)
    priority = torch.where(eligible, kernel_out[3], float("inf"))
    lowest = eligible & (priority == priority.min(dim=1, keepdim=True).values)
    want = torch.where(lowest, token_index, torch.iinfo(torch.int64).max).argmin(dim=1)
    want = torch.where(eligible.any(dim=1), want, -1)
    assert torch.equal(kernel_out[2], want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n_heads", "n_kv", "slots", "length"), [(6, 2, 63, 40), (4, 4, 33, 33), (9, 3, 130, 97)]
)
def test_decode_matches_reference(dtype, n_heads, n_kv, slots, length):
    check_decode(dtype, n_heads, n_kv, slots, length)


@pytest.mark.parametrize("tiles", [(16, 16), (16, 32), (16, 48), (32, 32)], ids=str)
@pytest.mark.parametrize(
    ("n_heads", "n_kv", "slots", "length", "recent"),
    [
        (6, 2, 63, 40, 8),  # GQA, odd slot count: the last range is partial
        (8, 2, 63, 63, 8),  # every slot valid
        (4, 4, 97, 5, 2),  # few valid entries: some ranges hold none (their partial max is -inf)
        (6, 3, 63, 1, 0),  # a single cached token: one probability of 1, candidate only outside the window
        (6, 3, 63, 1, 1),  # ... and none when it is the recent window: -1
    ],
)
def test_decode_split_ranges_match_reference(monkeypatch, tiles, n_heads, n_kv, slots, length, recent):
    """The slot axis cut into several ranges (the combine pass merges their partial max, sum, output and
    candidates): the same results as the reference, whatever the cut."""
    block_n, split_size = tiles
    monkeypatch.setattr(
        triton_decode, "decode_tiles", lambda slots, *_: (block_n, split_size, -(-slots // split_size))
    )
    check_decode(torch.float32, n_heads, n_kv, slots, length, recent)
    check_decode(torch.bfloat16, n_heads, n_kv, slots, length, recent)


def test_decode_tiles_split_the_slots_into_whole_blocks():
    for slots, n_kv, group, head_dim in [
        (1, 1, 1, 64),
        (63, 2, 3, 32),
        (4096, 8, 4, 128),
        (32768, 32, 1, 128),
    ]:
        block_n, split_size, splits = triton_decode.decode_tiles(slots, n_kv, group, head_dim)
        assert split_size % block_n == 0 and (splits - 1) * split_size < slots <= splits * split_size
        assert 1 <= splits <= triton_decode.MAX_SPLITS
    assert triton_decode.decode_tiles(32768, 8, 4, 128)[2] > 1  # a long cache is spread over programs


def test_decode_candidate_ties_go_to_oldest():
    n_kv, slots, head_dim = 2, 16, 16
    valid, token_index, rank = slot_state(n_kv, slots, 12, seed=1)
    cos, sin = rope_tables(13, head_dim, torch.float32)
    query = torch.zeros(4, head_dim, device=DEVICE)  # uniform attention: every valid entry ties
    kv = torch.randn(n_kv, slots, head_dim, device=DEVICE)
    scores = torch.zeros(n_kv, slots, device=DEVICE)
    *_, candidate = triton_decode.decode_attention(
        query, kv, kv, valid, rank, rank, token_index, 12, cos, sin, 0.25, scores, 8
    )
    oldest = torch.where(valid, token_index, 10**9).argmin(dim=1)
    assert torch.equal(candidate, oldest)


def run_prefill(fn, dtype, table_dtype, tensors, state, chunk, head_dim):
    query, keys, values = (t.to(DEVICE, dtype) for t in tensors)
    valid, token_index, rank = state
    first_index = int(token_index.max()) + 1 - chunk
    length = int(valid.sum(dim=1).max())
    cos, sin = rope_tables(length + 1, head_dim, table_dtype)
    return fn(
        query, keys, values, valid, token_index, rank, first_index, length - chunk, cos, sin, head_dim**-0.5
    )


def chunk_state(n_kv: int, slots: int, old: int, chunk: int, seed: int):
    """`old` cached entries (scattered slots and token indices) plus a chunk of `chunk` new consecutive tokens."""
    valid, token_index, rank = slot_state(n_kv, slots, old + chunk, seed)
    first = 4 * slots + 1
    for head in range(n_kv):
        newest = torch.where(valid[head] & (rank[head] >= old))[0]
        token_index[head, newest] = first + rank[head, newest] - old
    return valid, token_index, rank


def check_prefill(dtypes, n_heads, n_kv, slots, old, chunk):
    """The prefill kernel against the torch reference and the float64 reference (FlagAttention's rule)."""
    head_dim = 32
    gen = torch.Generator().manual_seed(chunk)
    tensors = (
        torch.randn(n_heads, chunk, head_dim, generator=gen),
        torch.randn(n_kv, slots, head_dim, generator=gen),
        torch.randn(n_kv, slots, head_dim, generator=gen),
    )
    state = chunk_state(n_kv, slots, old, chunk, seed=chunk)
    exact = run_prefill(
        prefill_ref.prefill_attention, torch.float64, torch.float64, tensors, state, chunk, head_dim
    )
    for dtype in dtypes:
        torch_out = run_prefill(prefill_ref.prefill_attention, dtype, dtype, tensors, state, chunk, head_dim)
        kernel_out = run_prefill(
            triton_prefill.prefill_attention, dtype, dtype, tensors, state, chunk, head_dim
        )
        for got, want, theirs in zip(kernel_out, exact, torch_out, strict=True):
            assert tolerance(got, want, theirs)
        assert kernel_out[0].dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n_heads", "n_kv", "slots", "old", "chunk"), [(6, 2, 70, 40, 23), (4, 4, 63, 0, 63)]
)
def test_prefill_matches_reference(dtype, n_heads, n_kv, slots, old, chunk):
    check_prefill([dtype], n_heads, n_kv, slots, old, chunk)


@pytest.mark.parametrize("tiles", [(16, 16), (16, 32)], ids=str)
@pytest.mark.parametrize(
    ("n_heads", "n_kv", "slots", "old", "chunk"), [(6, 2, 90, 40, 37), (4, 4, 63, 0, 63)]
)
def test_prefill_query_and_slot_blocks_match_reference(monkeypatch, tiles, n_heads, n_kv, slots, old, chunk):
    """Several query blocks (forward pass) and slot blocks (column pass), partial last blocks included."""
    monkeypatch.setattr(triton_prefill, "tiles", lambda *_: tiles)
    check_prefill([torch.float32, torch.bfloat16], n_heads, n_kv, slots, old, chunk)


@pytest.mark.slow
def test_prefill_long_chunk_4001():
    head_dim, chunk = 16, 4001
    gen = torch.Generator().manual_seed(0)
    tensors = (
        torch.randn(2, chunk, head_dim, generator=gen),
        torch.randn(1, chunk + 7, head_dim, generator=gen),
        torch.randn(1, chunk + 7, head_dim, generator=gen),
    )
    state = chunk_state(1, chunk + 7, 0, chunk, seed=3)
    exact = run_prefill(
        prefill_ref.prefill_attention, torch.float64, torch.float64, tensors, state, chunk, head_dim
    )
    torch_out = run_prefill(
        prefill_ref.prefill_attention, torch.float32, torch.float32, tensors, state, chunk, head_dim
    )
    kernel_out = run_prefill(triton_prefill.prefill_attention, torch.float32, torch.float32, tensors, state, chunk,
                             head_dim)  # fmt: skip
    for got, want, theirs in zip(kernel_out, exact, torch_out, strict=True):
        assert tolerance(got, want, theirs)


@pytest.mark.parametrize(
    "overrides",
    [
        {"policy": "h2o"},
        {"policy": "tova"},
        {"policy": "h2o", "score_decay": 0.9},
        {"policy": "h2o", "h2o_sinks": 3},
    ],
    ids=lambda o: "-".join(str(v) for v in o.values()),
)
def test_cache_on_kernels_matches_reference_path(tiny_pair, monkeypatch, overrides):
    """The whole cache (prefill chunks, decode, eviction) on the Triton path equals the torch path (decayed
    scores: the decode kernel adds to scores decayed before it runs; chunks take the torch path)."""
    from h2o_kernels import dispatch

    import h2o_cli.cache.paths as cache_module
    from h2o_cli.cache import H2OCache
    from h2o_cli.config import CacheSettings

    _, model = tiny_pair
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    settings = CacheSettings(budget=16, chunk=8, **overrides)

    def run() -> tuple[torch.Tensor, list]:
        cache = H2OCache(model, settings)
        logits = []
        with torch.inference_mode():
            for piece in (ids[:, :12], ids[:, 12:20]):  # two prefill chunks, the second one evicts
                logits.append(model(input_ids=piece, cache=cache, use_cache=True).logits[0])
            for step in range(20, 40):  # decode with one eviction per step
                logits.append(model(input_ids=ids[:, step : step + 1], cache=cache, use_cache=True).logits[0])
        return torch.cat(logits), [(s.token_index.clone(), s.scores.clone()) for s in cache.stores]

    reference_logits, reference_state = run()
    monkeypatch.setattr(cache_module, "use_triton", lambda *args: True)
    monkeypatch.setattr(dispatch, "use_triton", lambda *args: True)
    kernel_logits, kernel_state = run()
    torch.testing.assert_close(kernel_logits, reference_logits, rtol=1e-4, atol=1e-4)
    for (tokens, scores), (ref_tokens, ref_scores) in zip(kernel_state, reference_state, strict=True):
        assert torch.equal(torch.sort(tokens, dim=1).values, torch.sort(ref_tokens, dim=1).values)
        torch.testing.assert_close(scores, ref_scores, rtol=1e-4, atol=1e-5)


def test_cache_on_kernels_splits_a_long_call_like_the_reference_path(tiny_pair, monkeypatch):
    """A 30-token call with 8 spare slots (budget 16) is split in the cache into sub-chunks (24, then 6):
    the fused Triton path gets consistent inputs for each and equals the torch path."""
    from h2o_kernels import dispatch

    import h2o_cli.cache.paths as cache_module
    from h2o_cli.cache import H2OCache
    from h2o_cli.config import CacheSettings

    _, model = tiny_pair
    ids = torch.randint(0, model.config.vocab_size, (1, 34), generator=torch.Generator().manual_seed(1))

    def run() -> tuple[torch.Tensor, list]:
        cache = H2OCache(model, CacheSettings(budget=16, chunk=8))
        slots = [store.keys.data_ptr() for store in cache.stores]
        with torch.inference_mode():
            logits = [model(input_ids=ids[:, :30], cache=cache, use_cache=True).logits[0]]
            for step in range(30, 34):
                logits.append(model(input_ids=ids[:, step : step + 1], cache=cache, use_cache=True).logits[0])
        assert [store.keys.data_ptr() for store in cache.stores] == slots and cache.length == 16
        return torch.cat(logits), [s.token_index.clone() for s in cache.stores]

    reference_logits, reference_tokens = run()
    monkeypatch.setattr(cache_module, "use_triton", lambda *args: True)
    monkeypatch.setattr(dispatch, "use_triton", lambda *args: True)
    kernel_logits, kernel_tokens = run()
    torch.testing.assert_close(kernel_logits, reference_logits, rtol=1e-4, atol=1e-4)
    for tokens, ref_tokens in zip(kernel_tokens, reference_tokens, strict=True):
        assert torch.equal(torch.sort(tokens, dim=1).values, torch.sort(ref_tokens, dim=1).values)


COMPILE_FOR_SM90 = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from h2o_kernels import triton_decode, triton_prefill


def compile_for_sm90(fn, types, constants):
    names = [name for name in fn.arg_names if name not in constants]
    signature = dict(zip(names, types.split(), strict=True)) | dict.fromkeys(constants, "constexpr")
    indices = {(fn.arg_names.index(name),): value for name, value in constants.items()}
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=indices),
                                  target=GPUTarget("cuda", 90, 32))
    except FileNotFoundError as error:  # no ptxas beside this triton
        print("SKIP", error)
        sys.exit(0)
    assert compiled.asm["cubin"], fn
    print("compiled", fn.__name__)


group, head_dim = 4, 128
block_n = triton_decode.decode_tiles(4096, 8, group, head_dim)[0]
decode = {"GROUP": group, "BLOCK_G": 4, "BLOCK_N": block_n, "HEAD_DIM": head_dim}
compile_for_sm90(triton_decode._partial_kernel,
                 "*bf16 *bf16 *bf16 *u8 *i64 *bf16 *bf16 *fp32 *fp32 *fp32 *fp32 i32 fp32 i32 i32 i32", decode)
compile_for_sm90(triton_decode._combine_kernel,
                 "*fp32 *fp32 *fp32 *fp32 *u8 *i64 *i64 *fp32 *bf16 *fp32 *fp32 *i64 *i64 *i32 *i64 i32 i32 i32 i32",
                 decode | {"BLOCK_S": 16})
block_m, block_n = triton_prefill.tiles(1024, head_dim)
prefill = {"GROUP": group, "BLOCK_M": block_m, "BLOCK_N": block_n, "HEAD_DIM": head_dim, "DOT": 1}
compile_for_sm90(triton_prefill._forward_kernel,
                 "*bf16 *bf16 *bf16 *u8 *i64 *i64 *bf16 *bf16 *bf16 *fp32 i32 i32 fp32 i32 i32", prefill)
compile_for_sm90(triton_prefill._column_kernel,
                 "*bf16 *bf16 *u8 *i64 *i64 *bf16 *bf16 *fp32 *fp32 *fp32 i32 i32 fp32 i32 i32", prefill)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the other tests compile and run the kernels")
def test_kernels_compile_for_an_h100_class_gpu_without_one():
    """The real Triton compiler (not the interpreter) takes every kernel to a cubin for sm_90, bf16 inputs,
    GQA group 4, head dim 128: what the interpreter tolerates and the compiler refuses (a plain Python global
    read inside a kernel, once) fails here, before a GPU lease is spent on it. A subprocess: under
    TRITON_INTERPRET=1 `@triton.jit` makes functions only the interpreter runs."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": f"{repo}{os.pathsep}{repo / 'kernels'}"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.startswith("SKIP"):
        pytest.skip(done.stdout.strip())
    assert done.stdout.count("compiled") == 4, done.stdout

"""Precision per phase (`--dtype auto` on a CPU with native bf16): read calls multiply in bf16, the rest stays fp32."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config, word_tokenizer
from torch.utils._python_dispatch import TorchDispatchMode

from h2o_cli.models import precision
from h2o_cli.models.device import pick_read_dtype
from h2o_cli.models.precision import READ_ROWS, PhaseLinear, cpu_has_bf16, matmul_precision, read_in_bf16

MATMULS = {"mm", "addmm", "bmm", "matmul", "linear", "_weight_int8pack_mm"}


class MatmulDtypes(TorchDispatchMode):
    """The dtypes of the tensors each matmul op dispatched while active was given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[set[torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in MATMULS:
            self.seen.append({arg.dtype for arg in args if isinstance(arg, torch.Tensor)})
        return func(*args, **(kwargs or {}))


def cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: fpu sse2 avx2 {flags}\n\n")
    return path


@pytest.mark.parametrize(
    ("flags", "expected"),
    [("avx512f avx512_bf16", True), ("amx_tile amx_bf16", True), ("avx512f avx512bw", False), ("", False)],
)
def test_bf16_is_detected_from_the_cpu_flags(tmp_path, flags, expected):
    assert cpu_has_bf16(cpuinfo(tmp_path, flags)) is expected


def test_no_cpuinfo_means_no_bf16(tmp_path):
    assert cpu_has_bf16(tmp_path / "missing") is False


@pytest.mark.parametrize("has_bf16", [True, False])
def test_only_auto_on_a_bf16_cpu_reads_in_bf16(monkeypatch, has_bf16):
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: has_bf16)
    cpu = torch.device("cpu")
    assert pick_read_dtype("auto", cpu) == (torch.bfloat16 if has_bf16 else None)
    for dtype in ("float32", "bfloat16", "float16"):
        assert pick_read_dtype(dtype, cpu) is None
    assert pick_read_dtype("auto", torch.device("cuda")) is None  # a GPU keeps its own auto (bf16 weights)


def linear_pair(bias: bool = True) -> tuple[torch.nn.Linear, torch.nn.Module]:
    """(an fp32 nn.Linear, the same weights after `read_in_bf16`)."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 40, bias=bias)
    phased = torch.nn.Sequential(torch.nn.Linear(96, 40, bias=bias))
    phased[0].load_state_dict(plain.state_dict())
    read_in_bf16(phased)
    return plain, phased[0]


@pytest.mark.parametrize("rows", [1, 2, READ_ROWS - 1])
def test_a_decode_size_call_is_the_fp32_linear_exactly(rows):
    plain, phased = linear_pair()
    assert isinstance(phased, PhaseLinear)
    x = torch.randn(1, rows, 96)
    with MatmulDtypes() as spy:
        got = phased(x)
    assert torch.equal(got, plain(x))
    assert spy.seen and all(dtypes == {torch.float32} for dtypes in spy.seen)


@pytest.mark.parametrize("rows", [READ_ROWS, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_a_read_call_multiplies_in_bf16_and_stays_near_fp32(rows, bias):
    plain, phased = linear_pair(bias)
    x = torch.randn(1, rows, 96)
    with MatmulDtypes() as spy:
        got = phased(x)
    assert spy.seen and all(dtypes == {torch.bfloat16} for dtypes in spy.seen)  # the matmul ran in bf16
    want = plain(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert not torch.equal(got, want)
    # bf16 inputs and weights (8 bits of mantissa): within a few units of 2**-8 of each output's scale
    scale = (x.abs() @ plain.weight.abs().T).max()
    assert (got - want).abs().max() <= 2**-6 * scale
    bf16 = torch.nn.functional.linear(
        x.bfloat16().float(),
        plain.weight.bfloat16().float(),
        None if plain.bias is None else plain.bias.bfloat16().float(),
    )
    assert torch.allclose(got, bf16, rtol=2**-7, atol=1e-3)  # bf16 products summed in fp32, rounded once


def test_only_plain_fp32_linears_change_and_the_state_dict_does_not(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(tie_word_embeddings=True)).eval()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    read_in_bf16(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is PhaseLinear for m in linears)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied; the copy is the head's own
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    report = matmul_precision(model)
    copies = sum(m.weight.numel() for m in linears) * 2  # no biases in a Llama
    assert report == {"read_matmul": "bfloat16", "decode_matmul": "float32", "read_copy_bytes": copies}


def saved_tiny(tmp_path, tie: bool = False):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path / "tiny"
    LlamaForCausalLM(tiny_config(tie_word_embeddings=tie)).save_pretrained(folder)
    word_tokenizer(128).save_pretrained(folder)
    return folder


def test_float32_loads_todays_model(tmp_path, monkeypatch):
    """`--dtype float32` on a bf16 CPU: no linear changed, and a read's logits equal a model loaded the way
    `load_model` loaded it before precision per phase (transformers' own, then the h2o attention), bit for bit."""
    from transformers import AutoModelForCausalLM

    from h2o_cli.cache import H2OCache
    from h2o_cli.cache.attention import enable
    from h2o_cli.config import CacheSettings
    from h2o_cli.models import load_model
    from h2o_cli.streaming import forward_chunk

    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    folder = saved_tiny(tmp_path)
    model, _ = load_model(str(folder), device="cpu", dtype="float32")
    assert not any(isinstance(m, PhaseLinear) for m in model.modules())
    assert matmul_precision(model)["read_matmul"] == "float32"
    today = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    enable(today)
    ids = torch.randint(0, 128, (48,)).tolist()
    settings = CacheSettings(budget=24, chunk=16)
    ours, theirs = H2OCache(model, settings), H2OCache(today, settings)
    for start in range(0, 48, 16):
        piece = ids[start : start + 16]
        assert torch.equal(forward_chunk(model, ours, piece), forward_chunk(today, theirs, piece))


@pytest.mark.parametrize("tie", [False, True])
def test_the_cache_under_auto_is_plain_transformers_with_the_same_linears(tmp_path, monkeypatch, tie):
    """`--dtype auto` on a (mocked) bf16 CPU, `policy=full`: the cache's logits, chunk by chunk (reads of 16,
    then a 5-token call and one-token steps in fp32), equal plain transformers' (sdpa, its own cache) with the
    same bf16 linears to float rounding, far closer than either is to the fp32 model: the cache's attention is
    the same fp32 attention, and the read really ran in bf16. (The attention's own bf16 matmuls, which a read
    under auto also takes, are turned off here: tests/test_read_attention.py holds them to their reference.)"""
    from transformers import AutoModelForCausalLM, DynamicCache

    from h2o_cli.cache import H2OCache
    from h2o_cli.config import CacheSettings
    from h2o_cli.models import load_model
    from h2o_cli.streaming import forward_chunk

    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    folder = saved_tiny(tmp_path, tie)
    model, _ = load_model(str(folder), device="cpu", dtype="auto")
    assert model.h2o_read_dtype == torch.bfloat16
    plain = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    fp32 = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    read_in_bf16(plain)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (56,)).tolist()
    cache = H2OCache(model, CacheSettings(budget=1.0, policy="full", chunk=16).resolved(256))
    assert {layer.read_matmul for layer in cache.layers} == {torch.bfloat16}
    for layer in cache.layers:
        layer.read_matmul = None
    plain_cache, fp32_cache = DynamicCache(config=plain.config), DynamicCache(config=fp32.config)
    calls = [(0, 16), (16, 32), (32, 48), (48, 53), (53, 54), (54, 55), (55, 56)]
    for start, end in calls:
        piece = ids[start:end]
        ours = forward_chunk(model, cache, piece)
        with torch.inference_mode():
            theirs = plain(input_ids=torch.tensor([piece]), cache=plain_cache, use_cache=True).logits[0]
            exact = fp32(input_ids=torch.tensor([piece]), cache=fp32_cache, use_cache=True).logits[0]
        gap = (theirs - exact).abs().max()
        assert (ours - theirs).abs().max() <= 1e-4 + 0.05 * gap, (start, end)
        if start == 0:
            assert gap > 1e-3  # the first read's rounding is bf16's, not fp32's


@pytest.mark.parametrize("tie", [True, False])
def test_h2o_memory_counts_the_bf16_copy_the_loader_makes(tie):
    """`h2o memory --dtype auto` adds `ModelShape.read_copy_bytes` to the weights: the bytes of the copies
    `read_in_bf16` actually makes on a model of that shape (tied output layer or not)."""
    import transformers

    from h2o_cli.memory import ModelShape, memory_table

    config = tiny_config(tie_word_embeddings=tie)
    model = read_in_bf16(transformers.LlamaForCausalLM(config).eval())
    shape = ModelShape.from_config(config)
    assert shape.read_copy_bytes() == precision.read_copy_bytes(model)
    plain, with_copy = (
        memory_table(shape, 32),
        memory_table(shape, 32, read_copy_bytes=shape.read_copy_bytes()),
    )
    assert with_copy["weights_bytes"] - plain["weights_bytes"] == precision.read_copy_bytes(model)
    assert (
        with_copy["rows"][0]["h2o_total_bytes"] - plain["rows"][0]["h2o_total_bytes"]
        == shape.read_copy_bytes()
    )

"""Per-layer placement: each layer's cache lives where its attention runs (weights, or accelerate's hook when
the weights are offloaded), `--device-map` loads through accelerate, and offloaded models score as plain ones."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_stream, tiny_config, word_tokenizer

from h2o_cli.config import CacheSettings

pytest.importorskip("accelerate")


@pytest.fixture
def tiny_folder(tmp_path, monkeypatch):
    """A tiny random Llama saved with a word-level tokenizer (what `load_model` reads from a folder), and an
    `$H2O_HOME` of its own: a disk offload makes its folder there (one per model path), not in the user's."""
    from transformers import LlamaForCausalLM

    monkeypatch.setenv("H2O_HOME", str(tmp_path / "home"))

    torch.manual_seed(0)
    folder = tmp_path / "tiny"
    LlamaForCausalLM(tiny_config()).save_pretrained(folder)
    word_tokenizer(128).save_pretrained(folder)
    return folder


def split_map(tmp_path, second: str) -> str:
    """A device-map file: embeddings, layer 0, norm and head on the CPU; layer 1 on `second`."""
    mapping = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": second,
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
    path = tmp_path / f"map-{second}.json"
    path.write_text(json.dumps(mapping))
    return str(path)


def test_each_layers_buffers_follow_its_execution_device():
    """A layer whose attention runs elsewhere (an accelerate hook's execution device, here `meta` standing in
    for a second device) gets its store, scores and recall archive there; the others stay with their weights."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook, add_hook_to_module
    from transformers import LlamaForCausalLM

    from h2o_cli.cache import H2OCache
    from h2o_cli.cache.model_cache import execution_device, layer_devices

    model = LlamaForCausalLM(tiny_config(num_hidden_layers=3)).eval()
    add_hook_to_module(model.model.layers[1].self_attn, AlignDevicesHook(execution_device="meta"))
    hooks = SequentialHook(AlignDevicesHook(io_same_device=True), AlignDevicesHook(execution_device="meta"))
    add_hook_to_module(model.model.layers[2], hooks)  # on the decoder layer, its attention without a hook
    with torch.device("meta"):  # offloaded weights: only the hook says where the layer runs
        model.model.layers[2].self_attn.q_proj.weight = torch.nn.Parameter(torch.empty(96, 96))
    model.model.layers[2].self_attn.k_proj.to("meta")
    model.model.layers[2].self_attn.v_proj.to("meta")
    model.model.layers[2].self_attn.o_proj.to("meta")
    expected = [torch.device("cpu"), torch.device("meta"), torch.device("meta")]
    assert layer_devices(model) == expected
    assert execution_device(model.model.layers[0].self_attn.q_proj) == torch.device("cpu")
    assert execution_device(model.model.layers[0].self_attn) is None  # no weights of its own, no hook
    for settings in (
        CacheSettings(budget=8, policy="h2o", chunk=8),
        CacheSettings(budget=16, policy="recall", chunk=8),
    ):
        cache = H2OCache(model, settings)
        assert cache.devices == expected
        for layer, device in zip(cache.layers, expected, strict=True):
            store = layer.store
            for name in ("keys", "values", "scores", "token_index", "valid"):
                assert getattr(store, name).device == device, (name, device)
            if settings.policy == "recall":
                assert layer.recall_keys.device == device
                assert all(
                    tensor.device == device
                    for tensor in vars(layer.archive).values()
                    if torch.is_tensor(tensor)
                )


def test_device_map_file_plans_each_layer_on_its_execution_device(tmp_path):
    """`planned_layer_devices` (what `h2o memory --device-map` counts): a layer mapped to cpu or disk runs on
    the map's first GPU, as accelerate offloads it; without a GPU, on the CPU."""
    from h2o_cli.models.loading import planned_layer_devices

    config = tiny_config(num_hidden_layers=4)
    mapping = {
        "model.embed_tokens": 0,
        "model.layers.0": "cuda:1",
        "model.layers.1": 0,
        "model.layers.2": "cpu",
    }
    mapping.update(
        {"model.layers.3": "disk", "model.norm": "cpu", "lm_head": "cpu", "model.rotary_emb": "cpu"}
    )
    path = tmp_path / "map.json"
    path.write_text(json.dumps(mapping))
    assert planned_layer_devices(config, str(path), torch.float32) == ["cuda:1", "cuda:0", "cuda:0", "cuda:0"]
    assert planned_layer_devices(tiny_config(), split_map(tmp_path, "disk"), torch.float32) == ["cpu", "cpu"]
    assert planned_layer_devices(config, "auto", torch.float32) == ["cpu"] * 4  # this machine: no GPU
    path.write_text(json.dumps({"model.layers.0": "cpu"}))
    with pytest.raises(Exception, match="names no device for model.layers.1.self_attn"):
        planned_layer_devices(config, str(path), torch.float32)


def test_memory_reports_the_cache_per_device(tmp_path):
    from typer.testing import CliRunner

    from h2o_cli.cli.app import app

    result = CliRunner().invoke(
        app, ["memory", "--model", "smollm2-135m", "--budget", "100", "--device-map", "auto", "--json"]
    )
    assert result.exit_code == 0, result.output
    table = json.loads(result.stdout)
    (placed,) = table["cache_by_device"].items()
    assert placed[0] == "cpu" and placed[1]["layers"] == 30
    assert placed[1]["h2o_kv_bytes"] == table["rows"][0]["h2o_kv_bytes"]


@pytest.mark.parametrize("offload", ["disk", "cpu_offload"])
def test_offloaded_model_streams_like_a_plain_load(tiny_folder, tmp_path, offload):
    """A model whose second layer is offloaded to disk (`--device-map FILE`) or every layer offloaded by
    `accelerate.cpu_offload` (weights on `meta` between calls) gives the logits and perplexity of a plain
    load through the evicting cache."""
    from h2o_cli.models import load_model

    plain, _ = load_model(str(tiny_folder), device="cpu", dtype="float32")
    if offload == "disk":
        model, _ = load_model(
            str(tiny_folder), device="cpu", dtype="float32", device_map=split_map(tmp_path, "disk")
        )
        assert model.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    else:
        from accelerate import cpu_offload

        model, _ = load_model(str(tiny_folder), device="cpu", dtype="float32")
        cpu_offload(model, execution_device=torch.device("cpu"))
        assert all(param.device.type == "meta" for param in model.model.layers.parameters())
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(1))
    settings = CacheSettings(budget=20, policy="h2o", chunk=8)
    expected, plain_cache = run_stream(plain, settings, ids, 8)
    got, cache = run_stream(model, settings, ids, 8)
    assert cache.devices == [torch.device("cpu")] * 2
    assert torch.allclose(got, expected, atol=1e-5)
    nll = [torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]) for logits in (got, expected)]
    assert float(nll[0]) == pytest.approx(float(nll[1]), abs=1e-6)
    assert cache.report().evictions == plain_cache.report().evictions > 0


@pytest.mark.gpu
def test_cuda_and_cpu_split_streams_like_one_device(tiny_folder, tmp_path):
    """A real split: layer 0 on cuda:0, layer 1 on the CPU (offloaded, run on cuda:0 by accelerate) and
    a layer on cuda:0 throughout: the caches sit on the execution devices; logits equal a plain CUDA load."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from h2o_cli.models import load_model

    path = tmp_path / "split.json"
    mapping = {"model.embed_tokens": "cuda:0", "model.rotary_emb": "cuda:0", "model.layers.0": "cuda:0"}
    mapping.update({"model.layers.1": "cpu", "model.norm": "cuda:0", "lm_head": "cuda:0"})
    path.write_text(json.dumps(mapping))
    plain, _ = load_model(str(tiny_folder), device="cuda", dtype="float32")
    model, _ = load_model(str(tiny_folder), device="cuda", dtype="float32", device_map=str(path))
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(1)).cuda()
    settings = CacheSettings(budget=20, policy="h2o", kernels="torch")
    expected, _ = run_stream(plain, settings, ids, 8)
    got, cache = run_stream(model, settings, ids, 8)
    assert [device.type for device in cache.devices] == ["cuda", "cuda"]
    assert torch.allclose(got.cpu(), expected.cpu(), atol=1e-4)

"""What bik's vLLM plugin refuses, and when it stays off (in-process; no engine is started)."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

import bik
from bik.integrations import vllm as plugin
from plugin_inputs import sampling_metadata


@pytest.mark.parametrize("kwargs, what", [
    ({"alibi_slopes": [0.5] * 9}, "ALiBi"),
    ({"sliding_window": 128}, "sliding window"),
    ({"logits_soft_cap": 30.0}, "soft-cap"),
    ({"kv_cache_dtype": "fp8"}, "fp8 KV cache"),
    ({"attn_type": "encoder_only"}, "encoder_only attention"),
])
def test_attention_refuses_what_bik_does_not_serve(kwargs, what):
    from bik.integrations.vllm.attention import BikCPUAttentionImpl

    args = {"num_heads": 9, "head_size": 64, "scale": 0.125, "num_kv_heads": 3,
            "alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto"} | kwargs
    with pytest.raises(NotImplementedError, match=f"bik.integrations.vllm: .*{what}"):
        BikCPUAttentionImpl(**args)


def test_linear_refuses_pipeline_parallelism(monkeypatch):
    import types

    import torch
    from bik.integrations.vllm import linear
    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: types.SimpleNamespace(world_size=2))
    layer = torch.nn.Linear(4, 4)
    with pytest.raises(NotImplementedError, match="pipeline parallel size 2 is not served"):
        linear._dispatch(layer, remove_weight=True)


def test_a_row_parallel_layer_that_does_not_reduce_is_refused():
    import types

    from bik.integrations.vllm import linear

    forward = linear._row_parallel(lambda self, x: "tp1")
    layer = types.SimpleNamespace(tp_size=2, reduce_results=False, skip_bias_add=False)
    with pytest.raises(NotImplementedError, match="reduce_results=False"):
        forward(layer, None)
    assert forward(types.SimpleNamespace(tp_size=1), None) == "tp1"


def test_plugin_is_off_without_bik_vllm(monkeypatch):
    monkeypatch.delenv("BIK_VLLM", raising=False)
    monkeypatch.setitem(plugin._state, "registered", False)
    plugin.register()
    assert not plugin._state["registered"] and not bik.is_enabled()


def test_plugin_refuses_another_vllm_version(monkeypatch):
    monkeypatch.setenv("BIK_VLLM", "1")
    monkeypatch.setitem(plugin._state, "registered", False)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match="tested with vllm 0.32.0 only"):
        plugin.register()
    assert not bik.is_enabled()


def test_vllms_own_kernels_are_watched(monkeypatch, caplog):
    from bik.integrations.vllm import guard
    from vllm import _custom_ops as ops

    monkeypatch.setattr(ops, "onednn_mm", lambda *a: "ran")
    monkeypatch.setattr(guard, "UNROUTED", {})
    guard.install()
    assert ops.onednn_mm(1, 2) == "ran" and ops.onednn_mm(3) == "ran"
    assert guard.UNROUTED == {"onednn_mm": 2}
    assert "onednn_mm ran while the bik plugin is on" in caplog.text


def test_sampler_draw_is_bik_sample_keyed_by_seed_and_position():
    """A row's token is bik.sample's for its (seed, position), alone or among other rows; a
    batch-dependent draw (vLLM's own: noise by batch row) is not."""
    import torch
    from bik.integrations.vllm.sampler import BikSampler, keyed

    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    seed, position = torch.tensor([5, 6, 7, 8]), torch.tensor([10, 3, 99, 0])
    temperature = [0.8, 0.0, 1.3, 0.8]
    sampler = BikSampler()
    with keyed(sampler, (seed, position)):
        batched, _ = sampler.sample(logits.clone(), sampling_metadata(temperature))
    for row in range(4):
        with keyed(sampler, (seed[row:row + 1], position[row:row + 1])):
            alone, _ = sampler.sample(logits[row:row + 1].clone(),
                                      sampling_metadata([temperature[row]]))
        assert torch.equal(alone, batched[row:row + 1])
    assert batched[1] == logits[1].argmax()  # the greedy row
    expected = bik.sample(logits[0:1] / 0.8, seed=5, position=10).tokens
    assert torch.equal(batched[0:1], expected)
    # Control: the same rows keyed by their index in the batch, as a per-row stream is.
    moved = bik.sample(logits[2:3] / 1.3, seed=7, position=0).tokens
    assert not torch.equal(moved, batched[2:3])


def test_sampler_refuses_unknown_modes_and_unkeyed_calls():
    import torch
    from bik.integrations.vllm.sampler import BikSampler

    with pytest.raises(NotImplementedError, match="bik.integrations.vllm: logprobs_mode"):
        BikSampler("tempered_logprobs")
    with pytest.raises(RuntimeError, match="no \\(seed, position\\) per row"):
        BikSampler().sample(torch.zeros(1, 4), sampling_metadata([1.0]))


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
@pytest.mark.parametrize("filters", [False, True])
def test_processed_logprobs_are_bik_samples_at_the_drawn_token(mode, filters):
    """Processed mode returns the tempered logits the draw saw (greedy rows untempered; with
    top-k / top-p, the dropped tokens at -inf), or their bik.log_softmax, whose entry at each
    drawn token is bik.sample's logprob bit for bit (one normaliser); torch's log_softmax of the
    same logits is not (the control)."""
    import torch
    from bik.integrations.vllm.sampler import BikSampler, keyed

    torch.manual_seed(0)
    logits = torch.randn(6, 49152) * 3
    seed, position = torch.arange(6) + 5, torch.arange(6) * 7
    temperature = [0.7, 0.0, 1.0, 1.3, 0.7, 1.0]
    top_k = torch.tensor([0, 0, 40, 49152, 0, 7], dtype=torch.int32) if filters else None
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.5, 1.0, 0.8]) if filters else None
    with keyed(sampler := BikSampler(mode), (seed, position)):
        tokens, processed = sampler.sample(logits.clone(), sampling_metadata(
            temperature, top_k=top_k, top_p=top_p, max_num_logprobs=0))
    t = torch.tensor(temperature)
    z = logits / torch.where(t > 0, t, 1.0)[:, None]
    greedy = t == 0
    want = bik.sample(z, seed=seed, position=position, temperature=(~greedy).float(),
                      top_k=None if top_k is None else torch.where(greedy, 0, top_k.long()),
                      top_p=None if top_p is None else torch.where(greedy, 1.0, top_p))
    assert torch.equal(tokens, want.tokens)
    dropped = processed == float("-inf")
    assert bool(dropped[[0, 2, 3, 5]].any(1).all()) == filters and not dropped[1].any()
    if mode == "processed_logits":
        assert torch.equal(processed[~dropped], z[~dropped])
        return
    assert torch.equal(processed.gather(1, tokens[:, None])[:, 0], want.logprobs)
    stock = torch.log_softmax(z, -1).gather(1, tokens[:, None])[:, 0]
    assert not torch.equal(stock, want.logprobs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the dot path's pair panels
def test_repack_after_a_weight_update_reads_the_new_weights(dtype):
    """vLLM writes a weight update into the old tensors (weight.data.copy_), which a pack cannot
    see; repack (run after every reload_weights) packs the new values. The control: the panels
    packed before the update still give the old product."""
    import torch
    from bik.integrations.vllm import linear

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    layer = torch.nn.Linear(64, 48, bias=False, dtype=dt)
    layer.cpu_linear = linear._packed_linear(layer.weight)
    stale = layer.cpu_linear
    x = torch.randn(3, 64).to(dt)
    layer.weight.data.copy_(torch.randn(48, 64))
    fresh = bik.linear(x, layer.weight)
    assert not torch.equal(stale(x, layer.weight, None), fresh)
    model = torch.nn.Sequential(layer, torch.nn.Linear(4, 4))  # no bik pack in the second
    assert linear.repack(model) == 1
    assert torch.equal(layer.cpu_linear(x, layer.weight, None), fresh)


def test_a_direct_load_weights_repacks_too():
    """TRL's colocated trainer pushes weights with model.load_weights, not reload_weights: the
    plugin wraps it on every model it loads (installed on both model runners)."""
    import torch
    from bik.integrations.vllm import linear
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 16, bias=False)

        def load_weights(self, weights):
            for name, w in weights:
                self.get_parameter(name).data.copy_(w)
            return {name for name, _ in weights}

    torch.manual_seed(0)
    model = Model()
    model.proj.cpu_linear = linear._packed_linear(model.proj.weight)
    stale = model.proj.cpu_linear
    linear._watch_loads(model)
    linear._watch_loads(model)  # once only
    x, new = torch.randn(2, 32), torch.randn(16, 32)
    assert model.load_weights([("proj.weight", new)]) == {"proj.weight"}
    assert torch.equal(model.proj.cpu_linear(x, model.proj.weight, None), bik.linear(x, new))
    assert not torch.equal(stale(x, model.proj.weight, None), bik.linear(x, new))
    linear.install()
    assert CPUModelRunner.load_model.bik_wrapped


def test_a_packed_layer_traces_into_a_full_graph():
    """vLLM compiles its model with torch.compile(fullgraph=True) unless enforce_eager: the
    packed product is an opaque op there (Dynamo cannot trace the extension call; measured: the
    engine failed to start), with the eager call's bits. A repack keeps the layer's handle,
    which a graph vLLM compiled holds as a constant (vLLM drops Dynamo's guards), so the op
    with that handle reads the new panels."""
    import torch
    from bik.integrations.vllm import linear

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48, bias=False)
    layer.cpu_linear = linear._packed_linear(layer.weight)
    x = torch.randn(3, 64)
    compiled = torch.compile(lambda t: layer.cpu_linear(t, layer.weight, None), fullgraph=True,
                             backend="aot_eager")
    assert torch.equal(compiled(x), layer.cpu_linear(x, layer.weight, None))
    handle = layer.cpu_linear.handle
    layer.weight.data.copy_(torch.randn(48, 64))
    linear.repack(torch.nn.Sequential(layer))
    assert layer.cpu_linear.handle == handle
    assert torch.equal(torch.ops.bik_vllm.packed_linear(x, None, handle),
                       bik.linear(x, layer.weight))

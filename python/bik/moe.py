"""Mixture-of-experts layers as Hugging Face transformers computes them, for engines that must
give a trainer's bits: each family's router formula and transformers' default experts
implementation (``grouped_mm``), transcribed op for op.

The code is torch code, and it is batch-invariant under ``bik.enable()`` (or
``bik.batch_invariant_mode()``), which routes its softmax, topk, sort, sigmoid, sums, SiLU and
grouped products to bik exactly as it does for the trainer running transformers' own code: the
same ops on the same values, so the same bits (docs/design.md, "Mixture of experts"). vLLM's
plugin serves FusedMoE with it (bik/integrations/vllm/moe.py), and
:func:`bik.distributed.expert_parallel_experts` shards the experts over ranks with it.

    weights, ids = bik.moe.route("qwen3_moe", logits, top_k=8, renormalize=True)
    out = bik.moe.experts(x, ids, weights, w13, w2)   # w13 [E, 2I, H] gate then up, w2 [E, H, I]
"""

from __future__ import annotations

import collections
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["FAMILIES", "ONE_CALL", "Pairs", "PackedExperts", "combine", "expert_rows", "experts",
           "route", "sort_pairs"]

# Calls served by the one-call C++ route (csrc/native/moe.h), "router" and "experts", in this
# process: the vLLM plugin reports them (its stats()), so a test can see the route served.
ONE_CALL: collections.Counter = collections.Counter()


# ---- routers: logits [T, E] -> (weights [T, k], ids [T, k]) --------------------------------------

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
        module = _fused_module(logits)
        routed = None if module is None else module.moe_route_softmax(
            logits, top_k, renormalize, _FUSED_SOFTMAX[family])
        if routed is not None:
            ONE_CALL["router"] += 1
            return routed
    return FAMILIES[family](logits, top_k, renormalize=renormalize, n_group=n_group,
                            topk_group=topk_group, correction_bias=correction_bias,
                            scaling=scaling)


def _fused_module(*tensors: torch.Tensor):
    """bik's C++ MoE functions (csrc/native/moe.h) where they give this module's torch code's
    bits: under bik.enable() (theirs are the enabled code's), its C++ kernels loaded, nothing
    traced and no autograd to record; None elsewhere. Each function also returns None for a
    call it does not serve; the torch code then runs."""
    from bik.mode import _enable

    if not _enable.is_enabled() or torch.compiler.is_compiling():
        return None
    if any(t.device.type != "cpu" or (t.requires_grad and torch.is_grad_enabled())
           for t in tensors):
        return None
    from bik.ops import _native
    from bik.runtime import native_ext

    return native_ext.module() if _native.ready() else None


# ---- experts: transformers' grouped_mm implementation, in three steps -----------------------------

class Pairs(NamedTuple):
    """The (token, slot) pairs sorted by expert: ``perm`` the sort's permutation, ``selected``
    the pairs' token rows, ``weights`` their routing weights, ``ends`` [E] each expert's
    cumulative end (int32), all in sorted order."""

    perm: torch.Tensor
    selected: torch.Tensor
    weights: torch.Tensor
    ends: torch.Tensor


def sort_pairs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: int) -> Pairs:
    """The pairs sorted by expert (exact: a stable sort, gathers, a histogram)."""
    k = ids.shape[-1]
    expert_ids_g, perm = torch.sort(ids.reshape(-1))
    histc_input = expert_ids_g.float() if x.device.type == "cpu" else expert_ids_g.int()
    per_expert = torch.histc(histc_input, bins=experts, min=0, max=experts - 1)
    return Pairs(perm, x[perm // k], weights.reshape(-1)[perm],
                 torch.cumsum(per_expert, dim=0, dtype=torch.int32))


def _version(weight: torch.Tensor) -> int | None:
    """The weight's version counter; None for an inference tensor, which keeps none."""
    try:
        return weight._version
    except RuntimeError:
        return None


class PackedExperts:
    """Every expert's two weights packed once for the CPU kernel (``bik.PackedWeight``, whose
    product is ``bik.linear``'s bit for bit, and so a grouped product's row): the experts'
    products without packing each weight again on every call, which at decode sizes costs
    more than the product (bik.linear 54 µs, packed 14 µs on a [384, 512] fp32 expert, one
    token, 2 threads). The panels are a copy: weights changed in place must be packed again
    (a new PackedExperts)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor):
        import bik

        self.w13 = [bik.PackedWeight(w) for w in w13]
        self.w2 = [bik.PackedWeight(w) for w in w2]
        # for the one-call route (csrc/native/moe.h): the panels' addresses, how they were
        # packed, and the weights' versions (one counter per stacked tensor, its experts' views
        # share it)
        self._panels13 = torch.tensor([p._panels_ptr for p in self.w13], dtype=torch.int64)
        self._panels2 = torch.tensor([p._panels_ptr for p in self.w2], dtype=torch.int64)
        self._inter = w2.shape[-1]
        self._splits = (self.w13[0]._split, self.w2[0]._split)
        self._dot = self.w13[0]._dot
        self._sources = [(weakref.ref(w), _version(w)) for w in (w13, w2)]

    def fused(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """:func:`experts` with these packs in one C++ call (csrc/native/moe.h: the same
        bits), or None where it does not serve (then the torch code runs)."""
        module = _fused_module(x, weights)
        if module is None:
            return None
        for source, version in self._sources:
            weight = source()
            if weight is not None and _version(weight) != version:
                raise ValueError(f"bik.moe.PackedExperts: the experts' weights changed after "
                                 f"packing (version {version} -> {_version(weight)}); pack "
                                 f"them again")
        return module.moe_experts(x, ids, weights, self._panels13, self._panels2, self._inter,
                                  *self._splits, self._dot)

    @staticmethod
    def serves(w13: torch.Tensor) -> bool:
        return w13.device.type == "cpu" and w13.dtype in (torch.float32, torch.bfloat16)


def _grouped(x: torch.Tensor, ends: torch.Tensor, w: torch.Tensor, packs) -> torch.Tensor:
    """``torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)``, or with ``packs`` the same
    rows expert by expert from the packed weights (rows past the last end zero)."""
    if packs is None:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
    out = x.new_zeros((x.shape[0], w.shape[1]))
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = packs[expert](x[start:end])
        start = end
    return out


def expert_rows(selected: torch.Tensor, ends: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, packed: PackedExperts | None = None) -> torch.Tensor:
    """Each sorted pair's expert output (not yet weighted): the gate-up grouped product, SiLU
    of the gate times up, the down grouped product. Every row depends on its pair alone.
    ``packed``: the same weights packed (:class:`PackedExperts`), the same bits."""
    proj = _grouped(selected.to(w13.dtype), ends, w13, None if packed is None else packed.w13)
    gate, up = proj.chunk(2, dim=-1)
    proj = F.silu(gate) * up
    return _grouped(proj.to(w2.dtype), ends, w2, None if packed is None else packed.w2)


def combine(rows: torch.Tensor, pairs: Pairs, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """The outputs weighted, put back in (token, slot) order and summed over the slots in slot
    order (``.view(T, k, H).sum(1)``), in ``dtype``."""
    weighted = rows * pairs.weights.unsqueeze(-1)
    inv_perm = torch.empty_like(pairs.perm)
    inv_perm[pairs.perm] = torch.arange(pairs.perm.size(0), device=rows.device)
    weighted = weighted[inv_perm]
    return weighted.view(tokens, -1, rows.shape[-1]).sum(dim=1).to(dtype)


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor, packed: PackedExperts | None = None) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts implementation (its default), op for op: x [T, H],
    ids / weights [T, k] (the router's), w13 [E, 2I, H] (gate then up), w2 [E, H, I]; the
    result [T, H] in x's dtype. ``packed``: w13 and w2 packed (:class:`PackedExperts`; the
    CPU, fp32 / bf16), the same bits, faster at decode sizes."""
    fused = None if packed is None else packed.fused(x, ids, weights)
    if fused is not None:
        ONE_CALL["experts"] += 1
        return fused
    pairs = sort_pairs(x, ids, weights, w13.shape[0])
    rows = expert_rows(pairs.selected, pairs.ends, w13, w2, packed)
    return combine(rows, pairs, x.shape[0], x.dtype)

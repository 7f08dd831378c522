"""transformers' two other experts implementations, op for op, for an engine whose trainer runs
them: ``eager`` (a loop over the experts hit, in ascending id, each adding its weighted outputs
with ``index_add_`` into a zeroed tensor of the model's dtype: a token's outputs are summed in
expert-id order, rounded to the model's dtype after each add) and ``batched_mm`` (a bmm per
(token, slot) pair with that pair's expert's weights, then the slot sum as ``grouped_mm``'s).
Under ``bik.enable()`` their linears, bmm, SiLU and sums are bik's; ``index_add_`` is torch's,
sequential on the CPU (docs/design.md, "Mixture of experts")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from bik.moe.packed import PackedExperts

__all__ = ["batched_mm_experts", "eager_experts"]


def eager_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, packed: PackedExperts | None = None) -> torch.Tensor:
    """The ``eager`` implementation (the modeling files' own experts loop). ``packed``: each
    expert's products from its packed weights (``bik.linear``'s bits, as ``F.linear``'s under
    bik.enable())."""
    experts = w13.shape[0]
    final = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(ids, num_classes=experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit[:, 0].tolist():
        if expert == experts:
            continue
        slot, token = torch.where(mask[expert])
        current = x[token]
        proj = (F.linear(current, w13[expert]) if packed is None
                else packed.w13[expert](current))
        gate, up = proj.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        out = F.linear(hidden, w2[expert]) if packed is None else packed.w2[expert](hidden)
        out = out * weights[token, slot, None]
        final.index_add_(0, token, out.to(final.dtype))
    return final


def batched_mm_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The ``batched_mm`` implementation: every pair's expert weights gathered, one bmm of
    [S, 2I, H] by the pairs' rows as columns, SiLU of the gate times up, one bmm by the down
    weights, the outputs weighted and summed over the slots. (Its products are bmm's, one
    column each: no packed route, whose products are linear's.)"""
    tokens, k = ids.shape
    selected = x.repeat_interleave(k, dim=0)
    expert_ids = ids.reshape(-1)
    proj = torch.bmm(w13[expert_ids], selected.unsqueeze(-1)).squeeze(-1)
    gate, up = proj.chunk(2, dim=-1)
    hidden = F.silu(gate) * up
    out = torch.bmm(w2[expert_ids], hidden.unsqueeze(-1)).squeeze(-1)
    weighted = out * weights.reshape(-1).unsqueeze(-1)
    return weighted.view(tokens, k, x.shape[-1]).sum(dim=1).to(x.dtype)

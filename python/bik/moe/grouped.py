"""transformers' ``grouped_mm`` experts implementation (its default), op for op, in three steps:
the (token, slot) pairs sorted by expert, each pair's expert output, and the combine. With the
experts packed (:class:`~bik.moe.PackedExperts`) the whole runs as one C++ call where it can
(one_call.py), with the same bits."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from bik.moe import one_call

if TYPE_CHECKING:
    from bik.moe.packed import PackedExperts

__all__ = ["Pairs", "combine", "expert_rows", "grouped_mm_experts", "sort_pairs"]


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


def grouped_mm_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor,
                       packed: PackedExperts | None = None) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts implementation (its default), op for op: x [T, H],
    ids / weights [T, k] (the router's), w13 [E, 2I, H] (gate then up), w2 [E, H, I]; the
    result [T, H] in x's dtype. ``packed``: w13 and w2 packed (:class:`PackedExperts`; the
    CPU, fp32 / bf16), the same bits, faster at decode sizes."""
    fused = None if packed is None else packed.fused(x, ids, weights)
    if fused is not None:
        one_call.ONE_CALL["experts"] += 1
        return fused
    pairs = sort_pairs(x, ids, weights, w13.shape[0])
    rows = expert_rows(pairs.selected, pairs.ends, w13, w2, packed)
    return combine(rows, pairs, x.shape[0], x.dtype)

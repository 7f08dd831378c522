"""Mixture-of-experts layers as Hugging Face transformers computes them, for engines that must
give a trainer's bits: each family's router formula (routers.py) and each of transformers'
experts implementations (``grouped_mm``, its default: grouped.py; ``eager`` and
``batched_mm``: loops.py), transcribed op for op.

The code is torch code, and it is batch-invariant under ``bik.enable()`` (or
``bik.batch_invariant_mode()``), which routes its softmax, topk, sort, sigmoid, sums, SiLU and
products to bik exactly as it does for the trainer running transformers' own code: the same ops
on the same values, so the same bits (docs/design.md, "Mixture of experts"). vLLM's plugin
serves FusedMoE with it (bik/integrations/vllm/moe.py), and
:func:`bik.distributed.expert_parallel_experts` shards the experts over ranks with it. With the
experts packed (packed.py), the softmax routers and the ``grouped_mm`` experts run as one C++
call each where they can (one_call.py, csrc/native/moe.h), with the same bits.

    weights, ids = bik.moe.route("qwen3_moe", logits, top_k=8, renormalize=True)
    out = bik.moe.experts(x, ids, weights, w13, w2)   # w13 [E, 2I, H] gate then up, w2 [E, H, I]
"""

from __future__ import annotations

import os

import torch

from bik.moe.grouped import Pairs, combine, expert_rows, grouped_mm_experts, sort_pairs
from bik.moe.loops import batched_mm_experts, eager_experts
from bik.moe.one_call import ONE_CALL
from bik.moe.packed import PackedExperts
from bik.moe.routers import FAMILIES, route

__all__ = ["EXPERTS_ENV", "FAMILIES", "IMPLEMENTATIONS", "ONE_CALL", "Pairs", "PackedExperts",
           "combine", "expert_rows", "experts", "experts_implementation", "route", "sort_pairs"]

# transformers' experts implementations (``experts_implementation=``), each transcribed
IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")
# the one an engine computes, to be the trainer's (transformers' default when unset)
EXPERTS_ENV = "BIK_MOE_EXPERTS"


def experts_implementation() -> str:
    """``BIK_MOE_EXPERTS``: the experts implementation of the trainer an engine must match
    (``grouped_mm`` when unset, transformers' default); anything else is an error naming it."""
    value = os.environ.get(EXPERTS_ENV, "") or "grouped_mm"
    if value not in IMPLEMENTATIONS:
        raise ValueError(f"bik: {EXPERTS_ENV}={value!r}; expected one of "
                         f"{', '.join(IMPLEMENTATIONS)} (transformers' experts_implementation)")
    return value


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor, packed: PackedExperts | None = None,
            implementation: str = "grouped_mm") -> torch.Tensor:
    """transformers' experts ``implementation`` op for op: x [T, H], ids / weights [T, k] (the
    router's), w13 [E, 2I, H] (gate then up), w2 [E, H, I]; the result [T, H] in x's dtype.
    ``packed``: w13 and w2 packed (:class:`PackedExperts`; the CPU, fp32 / bf16), the same
    bits, faster at decode sizes (``batched_mm``, whose products are bmm's, does not use it)."""
    if implementation == "grouped_mm":
        return grouped_mm_experts(x, ids, weights, w13, w2, packed)
    if implementation == "eager":
        return eager_experts(x, ids, weights, w13, w2, packed)
    if implementation == "batched_mm":
        return batched_mm_experts(x, ids, weights, w13, w2)
    raise ValueError(f"bik.moe.experts: implementation {implementation!r}; expected one of "
                     f"{', '.join(IMPLEMENTATIONS)}")

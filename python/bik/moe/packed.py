"""Every expert's weights packed once for bik's CPU matmul kernel: the experts' products without
packing each weight again on every call, and with them the experts in one C++ call."""

from __future__ import annotations

import weakref

import torch

from bik.moe import one_call
from bik.ops.matmul.packed import weight_version

__all__ = ["PackedExperts"]


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
        self._sources = [(weakref.ref(w), weight_version(w)) for w in (w13, w2)]

    def fused(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """:func:`experts` with these packs in one C++ call (csrc/native/moe.h: the same
        bits), or None where it does not serve (then the torch code runs)."""
        module = one_call.fused_module(x, weights)
        if module is None:
            return None
        for source, version in self._sources:
            weight = source()
            if weight is not None and weight_version(weight) != version:
                raise ValueError(f"bik.moe.PackedExperts: the experts' weights changed after "
                                 f"packing (version {version} -> {weight_version(weight)}); pack "
                                 f"them again")
        return module.moe_experts(x, ids, weights, self._panels13, self._panels2, self._inter,
                                  *self._splits, self._dot)

    @staticmethod
    def serves(w13: torch.Tensor) -> bool:
        return w13.device.type == "cpu" and w13.dtype in (torch.float32, torch.bfloat16)

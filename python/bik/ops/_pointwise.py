"""exp for backward formulas: each output a pure function of its input value.

On CPU tensors torch's vectorised kernels may round a SIMD body and a scalar tail differently,
which would let an element's bits depend on its position in the tensor (so on the batch). The
CPU extension's exp2f (:func:`unary_f32`) has no such split. On CUDA every element runs
the same instruction sequence, so torch's kernels are used.
"""

from __future__ import annotations

import torch

from bik.ops._checks import require, require_cpu
from bik.runtime import cpu_ext

__all__ = ["exp2_f32", "exp_f32", "unary_f32"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def unary_f32(fn: str, x: torch.Tensor) -> torch.Tensor:
    """exp2 or log2 of x elementwise via exp2f/log2f: each output a pure function of its input
    value (torch's CPU kernels may round a SIMD body and a scalar tail differently)."""
    ext = cpu_ext.require()
    require_cpu("bik.ops._pointwise.unary_f32", x=x)
    require(x.dtype == torch.float32, "bik.ops._pointwise.unary_f32", "x must be fp32")
    x = x.contiguous()
    out = torch.empty_like(x)
    ext.unary_f32(x.data_ptr(), out.data_ptr(), x.numel(), fn)
    return out


def exp2_f32(x: torch.Tensor) -> torch.Tensor:
    """2**x for an fp32 tensor."""
    if x.device.type != "cpu" or not cpu_ext.available():
        return torch.exp2(x)
    return unary_f32("exp2", x)


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """e**x for an fp32 tensor, within about 1.5 ulp: x * log2(e) is formed in fp64 and split
    into hi (fp32) + lo, and e**x = 2**hi * (1 + lo * ln 2) (|lo| <= 2**-24 |hi|)."""
    if x.device.type != "cpu" or not cpu_ext.available():
        return torch.exp(x)
    t = x.double() * LOG2E
    hi = t.float()
    lo = (t - hi.double()).float()
    return exp2_f32(hi) * (1.0 + lo * LN2)

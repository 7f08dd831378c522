"""A linear layer's weight packed once for the CPU matmul kernel (speed only, same bits).

The CPU kernel runs SIMD lanes across N, so it reads B in panels of ``nrw`` columns, each
[K][nrw] contiguous; a weight [N, K] (``b = weight.t()``) is transposed into that layout on
every call. At decode sizes that transpose costs more than the product. :class:`PackedWeight`
writes the panels once (csrc/cpu ``matmul_pack_b``, the kernel's own packing routine) and the
kernel reads them in place: the micro kernel sees the same values in the same order, so the
result is ``bik.linear(x, weight, bias)`` bit for bit (tests/matmul/test_packed_weight.py).
"""

from __future__ import annotations

import math

import torch

from bik.configs import matmul_split
from bik.ops._checks import check_float_dtype, check_tensor
from bik.ops._registry import backend_variant, resolve_backend
from bik.runtime import cpu_ext

_OP = "bik.PackedWeight"


class PackedWeight:
    """``weight`` [N, K] (CPU; bf16, fp16 or fp32) packed for the CPU matmul kernel.

    ``packed(x, bias=None)`` equals ``bik.linear(x, weight, bias)`` bit for bit, for any x
    [..., K] of the weight's dtype, without reading ``weight`` again (it may be freed). The
    panels are fp32: 4 bytes per weight element (twice a bf16 weight). They are laid out
    for this process's CPU path (``bik.kernels`` ISA "auto"), so they are not to be saved.
    """

    def __init__(self, weight: torch.Tensor):
        check_tensor(_OP, "weight", weight, 2)
        check_float_dtype(_OP, "weight", weight)
        if weight.device.type != "cpu":
            raise ValueError(f"{_OP}: weight is on {weight.device}; packing serves the CPU "
                             f"backend only (use bik.linear on {weight.device.type})")
        resolve_backend("matmul", "cpu", weight.device, label=_OP)
        ext = cpu_ext.require()
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        n, k = self.shape
        self._isa = backend_variant("cpu")
        nrw = ext.matmul_panel_width(self._isa)
        # fp16 has no in-kernel widening: widen first (exact), as the unpacked path does.
        w = weight if weight.dtype != torch.float16 else weight.float()
        self._panels = torch.zeros(math.ceil(n / nrw) * k * nrw, dtype=torch.float32)
        ext.matmul_pack_b(w.data_ptr(), w.stride(1), w.stride(0), k, n,
                          w.dtype == torch.bfloat16, self._isa, self._panels.data_ptr())

    def __repr__(self) -> str:
        return f"PackedWeight(shape={list(self.shape)}, dtype={self.dtype}, isa={self._isa})"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        check_tensor(_OP, "x", x)
        if x.device.type != "cpu":
            raise ValueError(f"{_OP}: x is on {x.device}; the packed weight is on the CPU")
        if x.dtype != self.dtype:
            raise ValueError(f"{_OP}: x is {x.dtype}, the weight was {self.dtype}")
        if x.dim() == 0 or x.shape[-1] != k:
            raise ValueError(f"{_OP}: x {list(x.shape)} and weight {list(self.shape)} disagree "
                             f"on K (x's last dim must equal {k})")
        if bias is not None:
            check_tensor(_OP, "bias", bias, 1)
            check_float_dtype(_OP, "bias", bias)
            if bias.shape[0] != n or bias.device.type != "cpu":
                raise ValueError(f"{_OP}: bias {list(bias.shape)} on {bias.device} must be a "
                                 f"CPU [{n}]")
        rows = math.prod(x.shape[:-1])
        out = torch.zeros(rows, n, dtype=torch.float32)
        if k == 0:  # no panels to point at: the contract's 0.0f (+ bias[n]), as the kernel does
            if bias is not None:
                out = out + bias.float()
        elif rows and n:
            a = x.reshape(rows, k).float()  # exact; the rows are small next to the weight
            b32 = None if bias is None else bias.float().contiguous()
            cpu_ext.require().matmul_f32(
                a.data_ptr(), a.stride(0), a.stride(1), 0, 0, 0,
                0 if b32 is None else b32.data_ptr(), out.data_ptr(), n, rows, n, k,
                matmul_split(self.dtype, n, k).split, torch.get_num_threads(), self._isa,
                packed=self._panels.data_ptr())
        return out.to(x.dtype).reshape(*x.shape[:-1], n)

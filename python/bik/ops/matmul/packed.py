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
import weakref

import torch

from bik.configs import matmul_split
from bik.ops._checks import check_float_dtype, check_tensor
from bik.ops._registry import backend_variant, resolve_backend
from bik.runtime import cpu_ext

_OP = "bik.PackedWeight"


class PackedWeight:
    """``weight`` [N, K] (CPU; bf16, fp16 or fp32) packed for the CPU matmul kernel.

    ``packed(x, bias=None)`` equals ``bik.linear(x, weight, bias)`` bit for bit, for any x
    [..., K] of the weight's dtype, without reading ``weight`` again (it may be freed). Any
    strides are accepted: a transposed or sliced weight is read through its strides and
    copied into the panels. fp32 and fp16 panels are fp32 (4 bytes per weight element); a
    bf16 weight on the bf16 dot path (:func:`bik.runtime.cpu_ext.bf16_dot`) is packed into
    the instruction's pair words, 2 bytes per element as the weight itself, and otherwise into
    fp32 panels. The panels are laid out for this process's CPU path, so they are not to be
    saved.

    The panels are a copy: a weight changed after packing must be packed again (a new
    ``PackedWeight``). A change made through torch's ops bumps the weight's version counter,
    and a call then raises naming both versions; a write through ``weight.data`` (as vLLM's
    weight loaders do) bumps none, so whoever writes that way repacks (the vLLM plugin does
    after every weight load).
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
        self._split = matmul_split(self.dtype, n, k).split
        self._ext = ext
        self._dot = weight.dtype == torch.bfloat16 and cpu_ext.bf16_dot()
        self._kernel = cpu_ext.bf16_kernel() or "fma"  # the AMX and dot kernels share panels
        self._source = weakref.ref(weight)
        self._version = weight_version(weight)
        if self._dot:  # pair words (int32 storage), each split's pairs from its start
            rows = ext.matmul_dot_pair_rows(k, self._split)
            self._panels = torch.zeros(math.ceil(n / nrw) * rows * nrw, dtype=torch.int32)
            ext.matmul_pack_b_pairs(weight.data_ptr(), weight.stride(1), weight.stride(0), k,
                                    n, self._split, self._isa, self._panels.data_ptr())
            self._panels_ptr = self._panels.data_ptr()
            return
        # fp16 has no in-kernel widening: widen first (exact), as the unpacked path does.
        w = weight if weight.dtype != torch.float16 else weight.float()
        self._panels = torch.zeros(math.ceil(n / nrw) * k * nrw, dtype=torch.float32)
        ext.matmul_pack_b(w.data_ptr(), w.stride(1), w.stride(0), k, n,
                          w.dtype == torch.bfloat16, self._isa, self._panels.data_ptr())
        self._panels_ptr = self._panels.data_ptr()

    def __repr__(self) -> str:
        path = ", bf16 dot" if self._dot else ""
        return f"PackedWeight(shape={list(self.shape)}, dtype={self.dtype}, isa={self._isa}{path})"

    def _check_unchanged(self) -> None:
        weight = self._source()
        if weight is not None and (now := weight_version(weight)) != self._version:
            raise ValueError(f"{_OP}: the weight changed after packing (version {self._version} "
                             f"-> {now}); pack it again")

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        fast = _native_product()
        if fast is not None and type(x) is torch.Tensor:
            self._check_unchanged()
            # None: a call the C++ route does not serve (the checks below then name what)
            out = fast(x, bias, self._panels_ptr, n, k, self._split, self._dot)
            if out is not None:
                return out
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
        self._check_unchanged()
        rows = math.prod(x.shape[:-1])
        if k == 0 or not rows or not n:  # no panels to point at: the contract's 0.0f (+ bias)
            out = torch.zeros(rows, n, dtype=torch.float32)
            if bias is not None:
                out = out + bias.float()
        else:
            # bf16 rows as they are on the dot path; else widened (exact), small next to W
            a = x if x.dim() == 2 else x.reshape(rows, k)  # an engine's rows: already 2-D
            a = a if self._dot else a.float()
            b32 = None if bias is None else bias.float().contiguous()
            # the kernel writes every element: fp32, or bf16 rounded as .to() rounds
            bf16 = x.dtype == torch.bfloat16
            out = torch.empty(rows, n, dtype=torch.bfloat16 if bf16 else torch.float32)
            # positional: pybind11's keyword matching costs several µs on a decode-sized call
            self._ext.matmul_f32(
                a.data_ptr(), a.stride(0), a.stride(1), 0, 0, 0,
                0 if b32 is None else b32.data_ptr(), out.data_ptr(), n, rows, n, k,
                self._split, torch.get_num_threads(), self._isa, 0, 0, self._dot, 1, 0, 0, 0,
                self._panels_ptr, self._dot, self._kernel, cpu_ext.fp32_fma(), bf16)
        out = out if x.dtype == out.dtype else out.to(x.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def weight_version(weight: torch.Tensor) -> int | None:
    """The weight's version counter; None for an inference tensor, which keeps none (and cannot
    be changed in place outside inference mode)."""
    try:
        return weight._version
    except RuntimeError:
        return None


def _native_product():
    """The C++ route of a packed product once bik's dispatcher kernels are loaded (bik.enable()
    loads them; ~8 µs of Python less a call): the same kernel call, the same bits. None
    before, while torch.compile traces, or with BIK_ENABLE_NATIVE=0."""
    from bik.ops import _native
    from bik.runtime import native_ext

    if torch.compiler.is_compiling() or not _native._loaded(split_rule=False):
        return None
    return native_ext.module().packed_linear

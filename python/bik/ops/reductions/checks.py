"""Argument checks and shapes of bik::softmax, bik::log_softmax and bik::mean, shared by the
op's declaration (op.py) and its backward (backward.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bik.ops._checks import SUPPORTED_DTYPES, check_float_dtype, check_tensor


def check_x_and_dtype(op: str, x, dtype) -> torch.dtype:
    check_tensor(op, "x", x)
    check_float_dtype(op, "x", x)
    if dtype is None:
        return x.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: dtype {dtype} is not supported; use bfloat16, float16 or "
                        f"float32 (or None for x's dtype)")
    return dtype


def norm_dim(op: str, x: torch.Tensor, dim) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{op}: dim must be an int, got {type(dim).__name__}")
    ndim = max(x.dim(), 1)  # a 0-D tensor has one (implicit) dim, as in torch
    if not -ndim <= dim < ndim:
        raise ValueError(f"{op}: dim {dim} is out of range for x of shape {list(x.shape)} "
                         f"(expected -{ndim} <= dim < {ndim})")
    return dim % ndim


def norm_dims(op: str, x: torch.Tensor, dims: Sequence[int]) -> list[int]:
    """Reduced dims, sorted ascending; [] (or every dim) means all of x's dims."""
    norm = [norm_dim(op, x, d) for d in dims]
    if len(set(norm)) != len(norm):
        raise ValueError(f"{op}: dim {list(dims)} names a dim twice for x of shape "
                         f"{list(x.shape)}")
    if x.dim() == 0 or not norm:
        return list(range(x.dim()))
    return sorted(norm)


def mean_shape(x: torch.Tensor, dims: list[int], keepdim: bool) -> list[int]:
    if keepdim:
        return [1 if d in dims else s for d, s in enumerate(x.shape)]
    return [s for d, s in enumerate(x.shape) if d not in dims]


def unit_stride_rows(x2: torch.Tensor) -> torch.Tensor:
    return x2 if x2.shape[1] <= 1 or x2.stride(1) == 1 else x2.contiguous()

"""The floating-point dtypes bik serves, and every way the code spells them: one table.

``short`` keys the config tables and the CLI; ``cuda`` is the suffix of the CUDA C++ kernel
symbols; ``cuda_kind`` is the ``bik_cvt::Kind`` code (csrc/cuda/bik_convert.cuh) a CUDA kernel
reads to store its output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["DTYPES", "SUPPORTED_DTYPES", "DType", "by_short", "dtype_name", "info"]


class DType(NamedTuple):
    dtype: torch.dtype
    short: str
    cuda: str
    cuda_kind: int


DTYPES = (
    DType(torch.bfloat16, "bf16", "bf16", 1),
    DType(torch.float16, "fp16", "f16", 2),
    DType(torch.float32, "fp32", "f32", 0),
)
SUPPORTED_DTYPES = tuple(d.dtype for d in DTYPES)
_BY_DTYPE = {d.dtype: d for d in DTYPES}
_BY_SHORT = {d.short: d for d in DTYPES}


def info(dtype: torch.dtype) -> DType:
    """The row of ``dtype`` (KeyError for a dtype bik does not serve: callers validate first)."""
    return _BY_DTYPE[dtype]


def by_short(short: str) -> torch.dtype:
    """"bf16" / "fp16" / "fp32" -> the torch dtype."""
    return _BY_SHORT[short].dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name without the prefix ("bfloat16"), for error messages."""
    return str(dtype).removeprefix("torch.")

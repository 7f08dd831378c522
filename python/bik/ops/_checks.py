"""Input checks shared by the ops: every error names the op and the offending shape/dtype/device."""

from __future__ import annotations

import math

import torch

from bik._dtypes import SUPPORTED_DTYPES, dtype_name
from bik._env import flag

FP32_MAX = torch.finfo(torch.float32).max  # eps is used in fp32

# BIK_DEBUG_CHECKS=1: the ops check device data (lengths, pages, slots, sampling parameters)
# even when the caller passed host metadata, and check that metadata against it. Each such
# check reads from the device, so this is for debugging, not for CUDA graph capture.
_DEBUG_CHECKS = flag("BIK_DEBUG_CHECKS")


def debug_checks() -> bool:
    """Whether BIK_DEBUG_CHECKS asked for the device-data checks despite host metadata."""
    return _DEBUG_CHECKS


def require(ok: bool, fn: str, what: str) -> None:
    """A check guarding the memory a raw pointer reaches: the CPU launchers hand data_ptr()s to
    C++, so a wrong shape or dtype there would read or write outside a tensor. ``assert`` would
    do under ``python -O`` nothing at all."""
    if not ok:
        raise ValueError(f"{fn}: {what}")


def require_cpu(fn: str, **tensors: torch.Tensor | None) -> None:
    """Every tensor given is a CPU tensor (a device pointer read on the host would crash)."""
    for name, t in tensors.items():
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"{fn}: {name} is on {t.device}; this launcher reads CPU memory")


def check_tensor(op: str, name: str, t: object, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:  # sparse, mkldnn: bik's kernels read strided memory
        raise TypeError(f"{op}: {name} must be a dense (strided) tensor, got layout "
                        f"{str(t.layout).removeprefix('torch.')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {list(t.shape)}")
    return t


def check_float_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{op}: {name} has dtype {dtype_name(t.dtype)}; supported: bfloat16, float16, float32"
        )


def check_same_dtype(op: str, names: tuple[str, str], a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise TypeError(
            f"{op}: {names[0]} ({dtype_name(a.dtype)}) and {names[1]} ({dtype_name(b.dtype)}) "
            f"must have the same dtype"
        )


def check_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{op}: {first_name} is on {first.device} but {name} is on {t.device}; "
                f"all inputs must be on one device"
            )


def check_out_dtype(op: str, out_dtype: torch.dtype | None, default: torch.dtype) -> torch.dtype:
    if out_dtype is None:
        return default
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{op}: out_dtype {out_dtype} is not supported; use bfloat16, float16 or float32"
        )
    return out_dtype


def check_eps(op: str, eps: float) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise TypeError(f"{op}: eps must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0 or eps > FP32_MAX:
        raise ValueError(f"{op}: eps must be finite in fp32 and >= 0, got {eps}")

"""bik::rms_norm and bik::fused_add_rms_norm with a fixed reduction tiling over the hidden dim.

Contract (docs/design.md#rmsnorm): y = (h * rstd) * weight with rstd = 1/sqrt(mean(h^2) + eps),
computed in fp32 and cast to the input dtype; the sum of squares of a row is reduced in one
order fixed by (hidden size, arch, backend), never by the number of rows. With a residual,
h = x + residual is rounded to the input dtype, normalised, and returned as the new residual.
"""

from __future__ import annotations

import math

import torch

from bik._backend import require_backend, resolve_backend
from bik.ops._checks import (
    check_eps,
    check_float_dtype,
    check_same_device,
    check_tensor,
    register_no_backward,
)

__all__ = ["rms_norm"]

torch.library.define("bik::rms_norm", "(Tensor x, Tensor weight, float eps, str backend) -> Tensor")
torch.library.define(
    "bik::fused_add_rms_norm",
    "(Tensor x, Tensor residual, Tensor weight, float eps, str backend) -> (Tensor, Tensor)",
)


def _check_norm(op: str, x, weight, eps, residual=None) -> None:
    check_tensor(op, "x", x, 2)
    check_tensor(op, "weight", weight, 1)
    check_float_dtype(op, "x", x)
    check_float_dtype(op, "weight", weight)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"{op}: weight {list(weight.shape)} does not match the hidden size of x "
            f"{list(x.shape)}"
        )
    if residual is not None:
        check_tensor(op, "residual", residual, 2)
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual {list(residual.shape)} must match x {list(x.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"{op}: residual ({residual.dtype}) must have x's dtype ({x.dtype})")
    check_eps(op, eps)
    check_same_device(op, x=x, weight=weight, residual=residual)


def _add_residual(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    # Elementwise, so batch-invariant; rounded to x.dtype exactly as the Triton kernel does.
    # contiguous: the returned h must match the fake's layout whatever x's strides are.
    return (x.float() + residual.float()).to(x.dtype).contiguous()


def _cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from bik.kernels import cpu

    x32 = x.float()
    if x32.shape[1] > 1 and x32.stride(1) != 1:
        x32 = x32.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    cpu.rms_norm_f32(x32, weight.float().contiguous(), float(eps), out)
    return out.to(x.dtype)


register_no_backward("bik::rms_norm", "bik.rms_norm")
register_no_backward("bik::fused_add_rms_norm", "bik.rms_norm")


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()


@torch.library.impl("bik::rms_norm", ("cpu", "cuda"))
def _rms_norm_impl(x, weight, eps, backend):
    op = "bik.rms_norm"
    _check_norm(op, x, weight, eps)
    require_backend(op, backend, x.device)
    if backend == "cpu":
        return _cpu_rms_norm(x, weight, eps)
    from bik.kernels.triton_rms_norm import launch_rms_norm

    x = _unit_stride_rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch_rms_norm(x, weight.contiguous(), float(eps), out)
    return out


@torch.library.register_fake("bik::rms_norm")
def _rms_norm_fake(x, weight, eps, backend):
    _check_norm("bik.rms_norm", x, weight, eps)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.impl("bik::fused_add_rms_norm", ("cpu", "cuda"))
def _fused_add_rms_norm_impl(x, residual, weight, eps, backend):
    op = "bik.rms_norm"
    _check_norm(op, x, weight, eps, residual)
    require_backend(op, backend, x.device)
    if backend == "cpu":
        h = _add_residual(x, residual)
        return _cpu_rms_norm(h, weight, eps), h
    from bik.kernels.triton_rms_norm import launch_rms_norm

    x, residual = _unit_stride_rows(x), _unit_stride_rows(residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch_rms_norm(x, weight.contiguous(), float(eps), out, residual=residual, h_out=h)
    return out, h


@torch.library.register_fake("bik::fused_add_rms_norm")
def _fused_add_rms_norm_fake(x, residual, weight, eps, backend):
    _check_norm("bik.rms_norm", x, weight, eps, residual)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             residual: torch.Tensor | None = None, backend: str | None = None):
    """Batch-invariant RMSNorm over the last dim, optionally fused with the residual add.

    Args:
        x: [..., H], bf16/fp16/fp32. Every leading dim is a row.
        weight: [H], any supported dtype (used in fp32).
        eps: finite, >= 0.
        residual: optional, same shape and dtype as x.
        backend: "triton", "cpu" or None (by device).

    Returns:
        ``out`` (x's shape and dtype) without a residual; ``(out, h)`` with one, where
        ``h = x + residual`` rounded to x.dtype and ``out = rms_norm(h)``. Each row's bits depend
        only on that row, weight, eps and the kernel configuration (see :func:`bik.fingerprint`).
        A row containing NaN or inf gives NaN for that row only (inf makes mean(h^2) inf).
    """
    op = "bik.rms_norm"
    check_tensor(op, "x", x)
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least 1 dim, got a 0-D tensor")
    backend = resolve_backend(op, backend, x.device)
    rows = math.prod(x.shape[:-1])  # not reshape(-1, H): H may be 0
    x2 = x.reshape(rows, x.shape[-1])
    if residual is None:
        return torch.ops.bik.rms_norm(x2, weight, eps, backend).reshape(x.shape)
    check_tensor(op, "residual", residual)
    if residual.shape != x.shape:
        raise ValueError(f"{op}: residual {list(residual.shape)} must match x {list(x.shape)}")
    out, h = torch.ops.bik.fused_add_rms_norm(
        x2, residual.reshape(rows, x.shape[-1]), weight, eps, backend
    )
    return out.reshape(x.shape), h.reshape(x.shape)

"""bik::rms_norm and bik::fused_add_rms_norm with a fixed reduction tiling over the hidden dim.

Contract (docs/design.md#rmsnorm): y = (h * rstd) * weight with rstd = 1/sqrt(mean(h^2) + eps),
computed in fp32 and cast to the input dtype; the sum of squares of a row is reduced in one
order fixed by (hidden size, arch, backend), never by the number of rows. With a residual,
h = x + residual is rounded to the input dtype, normalised, and returned as the new residual.
"""

from __future__ import annotations

import math

import torch

from bik.ops._call import call
from bik.ops._native import kernel_for
from bik.ops._checks import (
    check_eps,
    check_float_dtype,
    check_same_device,
    check_tensor,
)
from bik.ops._define import define
from bik.ops._registry import TABLE, documented, resolve_backend

# Every backend module (triton.py, cuda.py, cpu.py) defines the row's entry point
#   launch_rms_norm(args, out [M, H], h_out=None) -> None
# with ``args`` the op's record as _check_norm returns it (x [M, H] with unit stride along H,
# weight [H] contiguous, eps a float, and for the fused op residual like x): it normalises the
# rows of x into out; with ``h_out``, the rows of h_out = x + residual rounded to x's dtype.


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()


def _check_norm(op: str, args):
    """The check of bik::rms_norm and of bik::fused_add_rms_norm (whose record adds
    ``residual``): the record back with unit-stride rows, a contiguous weight and a float eps."""
    x, weight, residual = args.x, args.weight, getattr(args, "residual", None)
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
    eps = args.eps
    check_eps(op, eps)
    check_same_device(op, x=x, weight=weight, residual=residual)
    x2, w2, eps2 = _unit_stride_rows(x), weight.contiguous(), float(eps)
    r2 = None if residual is None else _unit_stride_rows(residual)
    if x2 is x and w2 is weight and eps2 is eps and r2 is residual:
        return args  # the common case, without _replace's ~0.7 us
    fixed = {"x": x2, "weight": w2, "eps": eps2}
    return args._replace(**fixed, **({} if residual is None else {"residual": r2}))


def _run_norm(launch, args):
    """bik::rms_norm's out, or with a residual bik::fused_add_rms_norm's (out, h)."""
    x = args.x
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not hasattr(args, "residual"):
        launch(args, out)
        return out
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch(args, out, h)
    return out, h


# ---- backward (docs/design.md#backward): fp32, built only from bik ops and correctly rounded
# elementwise ops (+ - * / sqrt: the same bits in a SIMD body and a scalar tail), so a row's
# grad_x depends only on that row, its upstream gradient and the weight. With xhat = x * rstd:
#   grad_x = rstd * (g*w - xhat * mean(g*w*xhat)) = rstd * (g*w - x * rstd^2 * mean(g*w*x))
#   grad_w = sum over rows of g * xhat   (ones[1, M] @ ...: fixed order, not batch-invariant)
# rstd is recomputed with bik::mean (its last bit may differ from the forward kernel's). The
# CUDA C++ backend has no mean kernel: its backward's two row means run on Triton (CUDA tensors).


def _mean_backend(backend: str) -> str:
    return backend if backend in TABLE["mean"].backends else "triton"


def _rms_norm_grads(ctx, h, weight, grad, need_x, need_w):
    """grad_x and grad_w of out = rms_norm(h) (the formula above), eps and backend from ctx."""
    eps, backend = ctx.eps, ctx.backend
    x32, g32, w32 = h.float(), grad.float(), weight.float()
    mean_backend = _mean_backend(backend)
    mean = torch.ops.bik.mean
    rstd = 1.0 / torch.sqrt(mean(x32 * x32, [1], True, torch.float32, mean_backend) + eps)
    xhat = x32 * rstd
    grad_x = grad_w = None
    if need_x:
        gw = g32 * w32
        dot = mean(gw * xhat, [1], True, torch.float32, mean_backend)  # [M, 1]
        grad_x = rstd * (gw - xhat * dot)
    if need_w:
        terms = (g32 * xhat).contiguous()
        ones = terms.new_ones((1, terms.shape[0]))  # ones * t is exact: a fixed-order sum
        grad_w = torch.ops.bik.matmul(ones, terms, None, weight.dtype, backend)
        grad_w = grad_w.reshape(weight.shape)
    return grad_x, grad_w


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, backend = inputs
    del output
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.backend = eps, backend


def _rms_norm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    grad_x, grad_w = _rms_norm_grads(ctx, x, weight, grad, need_x, need_w)
    return None if grad_x is None else grad_x.to(x.dtype), grad_w, None, None


def _fused_setup(ctx, inputs, output):
    _, weight, eps, _, backend = inputs
    ctx.save_for_backward(output[1], weight)  # h = x + residual as rounded and normalised
    ctx.eps, ctx.backend = eps, backend


def _fused_backward(ctx, grad_out, grad_h):
    h, weight = ctx.saved_tensors
    need_x, need_w, _, need_r = ctx.needs_input_grad[:4]
    grad_hn, grad_w = _rms_norm_grads(ctx, h, weight, grad_out, need_x or need_r, need_w)
    grad_x = grad_r = None
    if need_x or need_r:
        # h's rounding is taken as the identity: d h / d x = d h / d residual = 1.
        total = grad_hn if grad_h is None else grad_hn + grad_h.float()
        total = total.to(h.dtype)
        grad_x = total if need_x else None
        grad_r = (total.clone() if need_x else total) if need_r else None
    return grad_x, grad_w, None, grad_r, None


# One check and one run for both ops: the fused op's arguments are rms_norm's, then residual.
define("rms_norm", "(Tensor x, Tensor weight, float eps, str backend) -> Tensor",
       check=_check_norm, run=_run_norm,
       autograd=(_rms_norm_backward, _rms_norm_setup), native=kernel_for("rms_norm", kernel="norm"))
define("fused_add_rms_norm",
       "(Tensor x, Tensor weight, float eps, Tensor residual, str backend) -> (Tensor, Tensor)",
       label="bik.rms_norm", check=_check_norm, run=_run_norm,
       autograd=(_fused_backward, _fused_setup), native=kernel_for("fused_add_rms_norm", kernel="norm"))


@documented("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             residual: torch.Tensor | None = None, backend: str | None = None):
    """Batch-invariant RMSNorm over the last dim, optionally fused with the residual add.

    Args:
        x: [..., H], bf16/fp16/fp32. Every leading dim is a row.
        weight: [H], any supported dtype (used in fp32).
        eps: finite, >= 0.
        residual: optional, same shape and dtype as x.
        backend: {backends} "cuda" gives the bits of "cpu".

    Returns:
        ``out`` (x's shape and dtype) without a residual; ``(out, h)`` with one, where
        ``h = x + residual`` rounded to x.dtype and ``out = rms_norm(h)``. Each row's bits depend
        only on that row, weight, eps and the kernel configuration (see :func:`bik.fingerprint`).
        Non-finite rows stay within their row: a NaN makes the row NaN; an inf makes
        mean(h^2) inf, so rstd = 0: inf entries become NaN and finite ones 0 (or -0). h^2
        overflows fp32 for |h| >~ 1.8e19, which acts as inf there: the whole row becomes 0.
    """
    op = "bik.rms_norm"
    check_tensor(op, "x", x)
    check_tensor(op, "weight", weight)
    check_eps(op, eps)  # here: torch.ops.bik's float argument would turn True into 1.0
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least 1 dim, got a 0-D tensor")
    backend = resolve_backend("rms_norm", backend, x.device, label=op)
    rows = x.dim() == 2  # already rows: no reshape (each costs ~1.5 µs at decode sizes)
    x2 = x if rows else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # H may be 0
    if residual is None:
        out = call("rms_norm", x2, weight, eps, backend)
        return out if rows else out.reshape(x.shape)
    check_tensor(op, "residual", residual)
    if residual.shape != x.shape:
        raise ValueError(f"{op}: residual {list(residual.shape)} must match x {list(x.shape)}")
    r2 = residual if rows else residual.reshape(x2.shape)
    out, h = call("fused_add_rms_norm", x2, weight, eps, r2, backend)
    return (out, h) if rows else (out.reshape(x.shape), h.reshape(x.shape))

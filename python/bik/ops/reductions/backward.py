"""Backward of bik::softmax, bik::log_softmax and bik::mean, built only from bik ops.

Contract (docs/design.md#backward): the input gradient of a row depends only on that row's
output, its upstream gradient and bik.fingerprint(), never on the other rows. Per row of the
reduced dim, in fp32, with g the upstream gradient and y the forward's output:

    softmax:      dx = y * (g - <g, y>)
    log_softmax:  dx = g - p * <g, 1>,  p = bik::softmax(x) in fp32
    mean:         dx = g / n            (broadcast over the n reduced elements)

The row sums <., .> are bik::matmul against a column of ones: the products by 1 are exact and
the sum runs in bik::matmul's fixed K order, so the row's bits cannot follow the batch. p is
recomputed by bik's softmax rather than exp(y): torch's vectorised CPU exp may round a SIMD body
and its tail differently, and a registered op stays traceable (opcheck, torch.compile). p is
softmax's order, not the sampler's normaliser the log_softmax forward uses: the gradient is
held to fp64 (tests), not to the sampler's bits. The
rest is elementwise (+ - * /), each element a function of its own values only, wherever it
sits. The result is rounded once to x's dtype, as torch's backward is.
"""

from __future__ import annotations

import math

import torch

from bik.ops.reductions.checks import norm_dim, norm_dims


def row_sums(rows: torch.Tensor, backend: str) -> torch.Tensor:
    """fp32 [M, n] -> [M, 1]: each row's sum in bik::matmul's fixed order."""
    ones = rows.new_ones((rows.shape[1], 1))
    return torch.ops.bik.matmul(rows.contiguous(), ones, None, torch.float32, backend)


def _as_rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """t with dim d last, as fp32 [rows, n] (a 0-D t is one row of one)."""
    tm = t.reshape(1) if t.dim() == 0 else t.movedim(d, -1)
    return tm.float().reshape(math.prod(tm.shape[:-1]), tm.shape[-1])


def _from_rows(r: torch.Tensor, shape: torch.Size, dtype: torch.dtype, d: int) -> torch.Tensor:
    """Inverse of _as_rows for a tensor of ``shape``, rounded once to ``dtype``."""
    if len(shape) == 0:
        return r.reshape(()).to(dtype)
    moved = [*shape[:d], *shape[d + 1:], shape[d]]
    return r.reshape(moved).movedim(-1, d).to(dtype).contiguous()


def _setup(ctx, x, dim, backend, saved):
    ctx.save_for_backward(saved)
    ctx.dim = norm_dim("bik.softmax", x, dim)
    ctx.x_dtype, ctx.x_shape, ctx.backend = x.dtype, x.shape, backend


def _softmax_setup(ctx, inputs, output):
    x, dim, _dtype, backend = inputs
    _setup(ctx, x, dim, backend, output)


def _log_softmax_setup(ctx, inputs, output):
    x, dim, _dtype, backend = inputs
    del output
    _setup(ctx, x, dim, backend, x)


def _softmax_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    d = ctx.dim
    y2, g2 = _as_rows(y, d), _as_rows(grad, d)
    dx = y2 * (g2 - row_sums(g2 * y2, ctx.backend))
    return _from_rows(dx, ctx.x_shape, ctx.x_dtype, d), None, None, None


def _log_softmax_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    d = ctx.dim
    p = torch.ops.bik.softmax(x, d, torch.float32, ctx.backend)
    p2, g2 = _as_rows(p, d), _as_rows(grad, d)
    dx = g2 - p2 * row_sums(g2, ctx.backend)
    return _from_rows(dx, x.shape, x.dtype, d), None, None, None


def _mean_setup(ctx, inputs, output):
    x, dim, keepdim, _dtype, backend = inputs
    del output, backend
    dims = norm_dims("bik.mean", x, dim)
    ctx.dims, ctx.keepdim = dims, keepdim
    ctx.x_dtype, ctx.x_shape = x.dtype, x.shape
    ctx.n = math.prod(x.shape[d] for d in dims)


def _mean_backward(ctx, grad):
    g = grad.float()
    if not ctx.keepdim:
        for d in ctx.dims:  # ascending, so each unsqueeze lands where the dim was
            g = g.unsqueeze(d)
    dx = (g / ctx.n).expand(ctx.x_shape).to(ctx.x_dtype).contiguous()
    return dx, None, None, None, None


# (backward, setup_context) per op, for its declaration in op.py
AUTOGRAD = {"softmax": (_softmax_backward, _softmax_setup),
            "log_softmax": (_log_softmax_backward, _log_softmax_setup),
            "mean": (_mean_backward, _mean_setup)}

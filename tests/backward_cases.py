"""Backward checks shared by the CPU tests and the Triton interpreter tests.

Row invariance of a gradient is checked with the harness: the pool holds, per row, the input
row and the fixed upstream gradient of that row side by side, so a row's upstream gradient is
the same whether it is computed alone or inside a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import bik
import torch
from bik.testing import InvarianceReport, rows_alone_vs_batched


def grad_rows(forward: Callable[[torch.Tensor], torch.Tensor], k: int) -> Callable:
    """fn(rows [M, k + n]) -> d/dx sum(forward(x) * u) with x = rows[:, :k], u = rows[:, k:]."""

    def fn(rows: torch.Tensor) -> torch.Tensor:
        x = rows[:, :k].detach().clone().requires_grad_()
        u = rows[:, k:]
        out = forward(x)
        torch.autograd.backward(out, u.reshape(out.shape))
        return x.grad

    return fn


def linear_grad_a_report(backend: str, dtype, ms: Sequence[int], k: int, n: int,
                         gen: torch.Generator) -> InvarianceReport:
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    pool = torch.randn(max(ms), k + n, generator=gen).to(dtype)
    fn = grad_rows(lambda x: bik.linear(x, w, bias, backend=backend), k)
    return rows_alone_vs_batched(fn, pool, ms, name=f"linear grad_a {backend} {dtype} K={k}")


def rms_norm_grad_x_report(backend: str, dtype, ms: Sequence[int], h: int,
                           gen: torch.Generator, fused: bool = False) -> InvarianceReport:
    w = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    if not fused:
        pool = torch.randn(max(ms), 2 * h, generator=gen).to(dtype)
        fn = grad_rows(lambda x: bik.rms_norm(x, w, 1e-6, backend=backend), h)
    else:  # per row: x, residual, upstream of out, upstream of h
        pool = torch.randn(max(ms), 4 * h, generator=gen).to(dtype)

        def fn(rows):
            x = rows[:, :h].detach().clone().requires_grad_()
            r = rows[:, h:2 * h].detach().clone().requires_grad_()
            out, hh = bik.rms_norm(x, w, 1e-6, residual=r, backend=backend)
            torch.autograd.backward((out, hh), (rows[:, 2 * h:3 * h], rows[:, 3 * h:]))
            return torch.cat([x.grad, r.grad], dim=1)

    name = f"rms_norm{' fused' if fused else ''} grad_x {backend} {dtype} H={h}"
    return rows_alone_vs_batched(fn, pool, ms, name=name)


def bmm_grad_a_report(backend: str, dtype, ms: Sequence[int], nb: int, k: int, n: int,
                      gen: torch.Generator) -> InvarianceReport:
    """Rows are dim 1 of a [B, M, K]: the pool is [M, B, K + N] and is transposed per call."""
    b = torch.randn(nb, k, n, generator=gen).to(dtype)
    pool = torch.randn(max(ms), nb, k + n, generator=gen).to(dtype)

    def fn(rows):
        a = rows[:, :, :k].transpose(0, 1).detach().clone().requires_grad_()
        out = bik.bmm(a, b, backend=backend)
        out.backward(rows[:, :, k:].transpose(0, 1))
        return a.grad.transpose(0, 1)

    return rows_alone_vs_batched(fn, pool, ms, name=f"bmm grad_a {backend} {dtype}")

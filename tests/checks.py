"""Small helpers every op's tests share (op-specific bodies live in tests/<op>/)."""

from __future__ import annotations

import torch

__all__ = ["ACCURACY_FLOOR", "ACCURACY_RATIO", "DTYPES", "accuracy_bound", "assert_invariant",
           "grad_rows", "max_err", "randn"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Accuracy against fp64: bik's max error may be at most RATIO x the error of an independent
# implementation in the same dtype (torch on the CPU) plus FLOOR x eps(dtype) x scale. The
# ratios are about twice the worst measured ones; each op's tests state what they measured.
ACCURACY_RATIO = {torch.float32: 16.0, torch.bfloat16: 2.0, torch.float16: 2.0}
ACCURACY_FLOOR = 2.0


def randn(gen: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def assert_invariant(reports) -> None:
    """Every InvarianceReport is ok; else the summaries of the ones that are not."""
    bad = [r.summary() for r in reports if not r.ok]
    assert not bad, "\n".join(bad)


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref).abs().max().item()


def accuracy_bound(dtype: torch.dtype, indep: torch.Tensor, ref: torch.Tensor) -> float:
    """The bound above for an output of ``dtype``, given an independent result and fp64 ref."""
    scale = ref.abs().max().item()
    return ACCURACY_RATIO[dtype] * max_err(indep, ref) + ACCURACY_FLOOR * torch.finfo(
        dtype).eps * scale


def grad_rows(forward, k: int):
    """fn(rows [M, k + n]) -> d/dx sum(forward(x) * u) with x = rows[:, :k], u = rows[:, k:]:
    per row, the input and its fixed upstream gradient side by side, so a row's upstream
    gradient is the same alone or inside a batch (for the invariance harness)."""

    def fn(rows: torch.Tensor) -> torch.Tensor:
        x = rows[:, :k].detach().clone().requires_grad_()
        u = rows[:, k:]
        out = forward(x)
        torch.autograd.backward(out, u.reshape(out.shape))
        return x.grad

    return fn

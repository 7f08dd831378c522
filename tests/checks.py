"""Small helpers every op's tests share (op-specific bodies live in tests/<op>/)."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "assert_invariant", "max_err", "randn"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def randn(gen: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def assert_invariant(reports) -> None:
    """Every InvarianceReport is ok; else the summaries of the ones that are not."""
    bad = [r.summary() for r in reports if not r.ok]
    assert not bad, "\n".join(bad)


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref).abs().max().item()

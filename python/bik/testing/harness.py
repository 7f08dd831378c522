"""Exact row-invariance checks for any row-wise op ``fn(rows) -> rows``.

``fn`` maps a batch [M, ...] to outputs whose row i belongs to input row i (matmul with a
fixed B, RMSNorm with a fixed weight, ...). A row passes only if its output bits are equal
to the bits it gets when computed alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

__all__ = ["M_SWEEP", "InvarianceReport", "probe_every_position", "rows_alone_vs_batched",
           "same_bits"]

# The batch sizes a full sweep covers: small, odd, powers of two and their neighbours.
M_SWEEP = (1, 2, 3, 4, 7, 8, 16, 31, 64, 127, 128, 255, 256, 1000)

RowOp = Callable[[torch.Tensor], torch.Tensor]


class InvarianceReport(NamedTuple):
    """What one invariance check compared and which (batch size, row) pairs differed."""

    name: str
    comparisons: int
    mismatches: tuple[tuple[int, int], ...]  # (M or batch size, row index)

    @property
    def ok(self) -> bool:
        return self.comparisons > 0 and not self.mismatches

    def summary(self) -> str:
        verdict = "bit-identical" if self.ok else f"{len(self.mismatches)} rows differ"
        return f"{self.name}: {verdict} ({self.comparisons} rows compared)"


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Exact equality of the bit patterns: NaN equals the same NaN, +0.0 differs from -0.0
    (``torch.equal`` alone gets both wrong for this purpose)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.dtype.is_floating_point:
        view = _INT_VIEW[x.element_size()]
        return torch.equal(x.contiguous().view(view), y.contiguous().view(view))
    return torch.equal(x, y)


def rows_alone_vs_batched(fn: RowOp, pool: torch.Tensor, ms: Sequence[int] = M_SWEEP,
                          name: str = "op") -> InvarianceReport:
    """Compare every row of ``fn(pool[:M])`` for each M in ``ms`` with ``fn(pool[i:i+1])``.

    ``pool`` needs at least max(ms) rows. Costs max(ms) single-row calls plus len(ms) batches.
    """
    top = max(ms)
    if pool.shape[0] < top:
        raise ValueError(f"pool has {pool.shape[0]} rows; the sweep needs {top}")
    alone = [fn(pool[i:i + 1])[0] for i in range(top)]
    mismatches, comparisons = [], 0
    for m in ms:
        batched = fn(pool[:m])
        for i in range(m):
            comparisons += 1
            if not same_bits(batched[i], alone[i]):
                mismatches.append((m, i))
    return InvarianceReport(name, comparisons, tuple(mismatches))


def probe_every_position(fn: RowOp, probe: torch.Tensor, neighbours: torch.Tensor,
                         name: str = "op") -> InvarianceReport:
    """Insert the single row ``probe`` [1, ...] at every position among ``neighbours``.

    The probe's output must equal its output alone at every position, so the result cannot
    depend on where in the batch (or in a tile) a request lands.
    """
    alone = fn(probe)[0]
    mismatches = []
    size = neighbours.shape[0] + 1
    for j in range(size):
        batch = torch.cat([neighbours[:j], probe, neighbours[j:]])
        if not same_bits(fn(batch)[j], alone):
            mismatches.append((size, j))
    return InvarianceReport(name, size, tuple(mismatches))

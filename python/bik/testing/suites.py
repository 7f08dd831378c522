"""Ready-made invariance suites per op, used by the test-suite and by `bik check`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bik._dtypes import dtype_name
from bik.testing.harness import (
    InvarianceReport,
    probe_every_position,
    rows_alone_vs_batched,
    same_bits,
)

__all__ = ["bmm_suite", "matmul_suite", "reduction_suite", "rms_norm_suite"]


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def matmul_suite(*, device, dtype: torch.dtype, backend: str | None, ms: Sequence[int],
                 shapes: Sequence[tuple[int, int]], seed: int = 0,
                 probe_batch: int = 0) -> list[InvarianceReport]:
    """Rows alone vs batched for each (N, K), B contiguous and as a ``weight.t()`` view."""
    from bik import matmul

    gen = torch.Generator().manual_seed(seed)
    reports = []
    for n, k in shapes:
        pool = _randn(gen, max(ms), k, dtype=dtype, device=device)
        for layout, b in (("B[K,N]", _randn(gen, k, n, dtype=dtype, device=device)),
                          ("W[N,K].t()", _randn(gen, n, k, dtype=dtype, device=device).t())):
            bias = _randn(gen, n, dtype=torch.float32, device=device)

            def fn(a, b=b, bias=bias):
                return matmul(a, b, bias, backend=backend)

            name = f"matmul {dtype_name(dtype)} N={n} K={k} {layout}"
            reports.append(rows_alone_vs_batched(fn, pool, ms, name=name))
            if probe_batch:
                neighbours = _randn(gen, probe_batch - 1, k, dtype=dtype, device=device)
                reports.append(probe_every_position(fn, pool[:1], neighbours,
                                                    name=name + " probe"))
    return reports


def rms_norm_suite(*, device, dtype: torch.dtype, backend: str | None, ms: Sequence[int],
                   hiddens: Sequence[int], seed: int = 0,
                   probe_batch: int = 0) -> list[InvarianceReport]:
    """Rows alone vs batched for plain and residual-fused RMSNorm at each hidden size."""
    from bik import rms_norm

    gen = torch.Generator().manual_seed(seed)
    reports = []
    for hidden in hiddens:
        pool = _randn(gen, max(ms), 2, hidden, dtype=dtype, device=device)
        weight = _randn(gen, hidden, dtype=dtype, device=device)
        name = f"rms_norm {dtype_name(dtype)} H={hidden}"
        reports.append(rows_alone_vs_batched(
            lambda x, w=weight: rms_norm(x[:, 0], w, backend=backend), pool, ms, name=name))

        def fused(x, w=weight):  # pack (out, h) so both outputs are compared per row
            out, h = rms_norm(x[:, 0], w, residual=x[:, 1], backend=backend)
            return torch.stack([out, h], dim=1)

        reports.append(rows_alone_vs_batched(fused, pool, ms, name=name + " +residual"))
        if probe_batch:
            neighbours = _randn(gen, probe_batch - 1, 2, hidden, dtype=dtype, device=device)
            reports.append(probe_every_position(fused, pool[:1], neighbours,
                                                name=name + " +residual probe"))
    return reports


def bmm_suite(*, device, dtype: torch.dtype, backend: str | None, ms: Sequence[int],
              n: int, k: int, batch: int = 3, seed: int = 0) -> list[InvarianceReport]:
    """bmm rows alone vs batched along M in every batch entry, and entries alone vs in a batch."""
    from bik import bmm

    gen = torch.Generator().manual_seed(seed)
    pool = _randn(gen, max(ms), batch, k, dtype=dtype, device=device)  # rows first for the harness
    b = _randn(gen, batch, k, n, dtype=dtype, device=device)
    name = f"bmm {dtype_name(dtype)} B={batch} N={n} K={k}"
    by_rows = rows_alone_vs_batched(
        lambda x: bmm(x.transpose(0, 1), b, backend=backend).transpose(0, 1), pool, ms,
        name=name)
    # Entries: row i of bmm over the first e entries equals it over all entries.
    entries = pool[: max(ms)].transpose(0, 1)  # [batch, M, K]
    full = bmm(entries, b, backend=backend)
    mismatches = tuple((e, i) for e in range(1, batch)
                       if not same_bits(bmm(entries[:e], b[:e], backend=backend), full[:e])
                       for i in (0,))
    return [by_rows, InvarianceReport(name + " entries", batch - 1, mismatches)]


def reduction_suite(*, device, dtype: torch.dtype, backend: str | None, ms: Sequence[int],
                    lengths: Sequence[int], seed: int = 0,
                    probe_batch: int = 0) -> list[InvarianceReport]:
    """Rows alone vs batched for softmax, log_softmax (also half -> fp32), mean over the last
    dim, mean over two dims and softmax over a middle dim, at each row length."""
    from bik import log_softmax, mean, softmax

    gen = torch.Generator().manual_seed(seed)
    reports = []
    for n in lengths:
        tag = f"{dtype_name(dtype)} n={n}"
        pool = _randn(gen, max(ms), n, dtype=dtype, device=device) * 3
        pool3 = _randn(gen, max(ms), 3, n, dtype=dtype, device=device)
        checks = [
            (f"softmax {tag}", pool, lambda x: softmax(x, backend=backend)),
            (f"log_softmax {tag}", pool, lambda x: log_softmax(x, backend=backend)),
            (f"log_softmax {tag} -> float32", pool,
             lambda x: log_softmax(x, dtype=torch.float32, backend=backend)),
            (f"mean {tag}", pool, lambda x: mean(x, -1, backend=backend)),
            (f"mean {tag} dims (1, 2)", pool3, lambda x: mean(x, (2, 1), backend=backend)),
            (f"softmax {tag} dim=1 of [M, n, 3]", pool3,
             lambda x: softmax(x.transpose(1, 2), dim=1, backend=backend)),
        ]
        for name, data, fn in checks:
            reports.append(rows_alone_vs_batched(fn, data, ms, name=name))
            if probe_batch:
                neighbours = _randn(gen, probe_batch - 1, *data.shape[1:], dtype=dtype,
                                    device=device)
                reports.append(probe_every_position(fn, data[:1], neighbours,
                                                    name=name + " probe"))
    return reports

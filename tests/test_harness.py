"""The invariance harness can fail: it rejects batch-dependent references and stock torch.mm.

Every invariance test in this suite uses these same harness functions, so these tests are the
proof that a green invariance test means something.
"""

import pytest
import torch
from bik.testing import (
    InvarianceReport,
    probe_every_position,
    rows_alone_vs_batched,
    split_by_m_matmul,
    split_by_m_rms_norm,
)

MS = (1, 2, 3, 4, 7, 8, 16, 31)


def test_rejects_split_by_m_matmul(gen):
    pool = torch.randn(31, 64, generator=gen)
    b = torch.randn(64, 48, generator=gen)
    report = rows_alone_vs_batched(lambda a: split_by_m_matmul(a, b), pool, MS)
    assert not report.ok
    # Rows only differ once M crosses a split boundary (M > 2), and then most of them do.
    assert all(m > 2 for m, _ in report.mismatches)
    assert len(report.mismatches) > report.comparisons // 2


def test_rejects_split_by_m_rms_norm(gen):
    pool = torch.randn(31, 111, generator=gen)
    w = torch.randn(111, generator=gen)
    report = rows_alone_vs_batched(lambda x: split_by_m_rms_norm(x, w), pool, MS)
    assert not report.ok
    assert all(m > 2 for m, _ in report.mismatches)


def test_probe_rejects_split_by_m(gen):
    probe = torch.randn(1, 64, generator=gen)
    neighbours = torch.randn(20, 64, generator=gen)
    b = torch.randn(64, 32, generator=gen)
    report = probe_every_position(lambda a: split_by_m_matmul(a, b), probe, neighbours)
    assert report.comparisons == 21
    assert len(report.mismatches) == 21  # batch of 21 rows: the split differs from M = 1


@pytest.mark.parametrize("n,k", [(64, 64), (96, 33), (128, 4096)])
def test_rejects_stock_cpu_fp32_mm(gen, n, k):
    """Measured on the project's CPUs: a row at M = 1 differs from the same row at M >= 4."""
    pool = torch.randn(8, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    report = rows_alone_vs_batched(lambda a: torch.mm(a, b), pool, (1, 4, 8))
    assert not report.ok
    assert {m for m, _ in report.mismatches} <= {4, 8}


def test_identity_passes_and_empty_report_is_not_ok(gen):
    pool = torch.randn(16, 8, generator=gen)
    assert rows_alone_vs_batched(lambda x: x * 2, pool, (1, 5, 16)).ok
    assert not InvarianceReport("nothing", 0, ()).ok


def test_nan_rows_compare_by_bits():
    pool = torch.full((4, 3), float("nan"))
    assert rows_alone_vs_batched(lambda x: x + 1, pool, (1, 4)).ok


def test_pool_too_small_is_an_error(gen):
    with pytest.raises(ValueError, match="needs 8"):
        rows_alone_vs_batched(lambda x: x, torch.zeros(4, 2), (1, 8))


def test_signed_zeros_and_nans_compare_by_bits():
    from bik.testing import same_bits

    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert same_bits(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    pool = torch.randn(8, 4)
    flips_zero_sign = lambda x: torch.zeros_like(x) * (1 if x.shape[0] == 1 else -1)
    assert not rows_alone_vs_batched(flips_zero_sign, pool, (1, 8)).ok

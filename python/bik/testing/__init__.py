"""The invariance harness, shared by tests/ and by `bik check`.

Every comparison is exact: the bit patterns must be equal (NaN = same NaN, +0.0 != -0.0).
The harness ships deliberately batch-dependent references (:mod:`bik.testing.controls`) so
that users and tests can see it reject a kernel that is not batch-invariant.
"""

from bik.testing.controls import (
    row_keyed_sample,
    split_by_m_matmul,
    split_by_m_mean,
    split_by_m_rms_norm,
    split_by_m_softmax,
)
from bik.testing.harness import (
    InvarianceReport,
    probe_every_position,
    rows_alone_vs_batched,
    same_bits,
)

__all__ = [
    "InvarianceReport",
    "probe_every_position",
    "row_keyed_sample",
    "rows_alone_vs_batched",
    "same_bits",
    "split_by_m_matmul",
    "split_by_m_mean",
    "split_by_m_rms_norm",
    "split_by_m_softmax",
]

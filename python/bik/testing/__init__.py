"""The invariance harness, shared by tests/ and by `bik check`.

Every comparison is exact (``torch.equal`` on the row's bits). The harness ships deliberately
batch-dependent references (:mod:`bik.testing.references`) so that users and tests can see it
reject a kernel that is not batch-invariant.
"""

from bik.testing.harness import InvarianceReport, probe_every_position, rows_alone_vs_batched
from bik.testing.references import split_by_m_matmul, split_by_m_rms_norm

__all__ = [
    "InvarianceReport",
    "probe_every_position",
    "rows_alone_vs_batched",
    "split_by_m_matmul",
    "split_by_m_rms_norm",
]

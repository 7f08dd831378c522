"""The invariance harness, shared by tests/ and by `bik check`.

Every comparison is exact: the bit patterns must be equal (NaN = same NaN, +0.0 != -0.0).
The harness ships deliberately batch-dependent references (:mod:`bik.testing.controls`) so
that users and tests can see it reject a kernel that is not batch-invariant.
"""

from bik.testing import controls, harness
from bik.testing.controls import *  # noqa: F403
from bik.testing.harness import *  # noqa: F403

__all__: list[str] = []
__all__ += controls.__all__
__all__ += harness.__all__

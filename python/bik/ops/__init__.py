"""The torch.ops.bik.* contracts. Importing this package registers every op."""

from bik.ops import (  # noqa: F401  (registration side effects)
    attention,
    matmul,
    reductions,
    rms_norm,
    sampling,
)

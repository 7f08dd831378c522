"""The torch.ops.bik.* contracts. Importing this package registers every op."""

from bik.ops import matmul, rms_norm  # noqa: F401  (registration side effects)

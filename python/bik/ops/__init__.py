"""The torch.ops.bik.* contracts. Importing this package registers every op."""

from bik.ops import attention, matmul, rms_norm  # noqa: F401  (registration side effects)
from bik.ops import attention_backward  # noqa: F401  (registration side effects)
from bik.ops import reductions  # noqa: F401  (registration side effects)
from bik.ops import sampling  # noqa: F401  (registration side effects)

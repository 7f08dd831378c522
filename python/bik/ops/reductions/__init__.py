"""bik::softmax, bik::log_softmax and bik::mean (op.py) and their backward (backward.py);
backends triton.py, cpu.py; the contract in torch: reference.py (tests only)."""

from bik.ops.reductions import backward as _backward  # noqa: F401  (registers autograd)
from bik.ops.reductions.op import log_softmax, mean, softmax

__all__ = ["log_softmax", "mean", "softmax"]

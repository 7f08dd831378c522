"""bik::softmax, bik::log_softmax and bik::mean (op.py); backends triton.py, cpu.py; the contract
in torch: reference.py (tests only)."""

from bik.ops.reductions.op import log_softmax, mean, softmax

__all__ = ["log_softmax", "mean", "softmax"]

"""bik::rms_norm and bik::fused_add_rms_norm (op.py); backends triton.py, cuda.py, cpu.py; the
contract in torch: reference.py (tests only)."""

from bik.ops.rms_norm.op import rms_norm

__all__ = ["rms_norm"]

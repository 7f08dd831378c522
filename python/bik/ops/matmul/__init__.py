"""bik::matmul and bik::bmm (op.py); backends triton.py, cuda.py, cpu.py; the contract in torch:
reference.py (tests only)."""

from bik.ops.matmul.op import bmm, linear, matmul

__all__ = ["bmm", "linear", "matmul"]

"""bik::matmul and bik::bmm (op.py); backends triton.py, cuda.py, cpu.py; a weight packed once
for the CPU kernel: packed.py; bik::grouped_matmul, a mixture of experts' products, and its
weight gradient (grouped.py; backends triton_grouped.py, cpu.py); the contract in torch:
reference.py (tests only)."""

from bik.ops.matmul.grouped import grouped_matmul
from bik.ops.matmul.op import bmm, linear, matmul
from bik.ops.matmul.packed import PackedWeight

__all__ = ["PackedWeight", "bmm", "grouped_matmul", "linear", "matmul"]

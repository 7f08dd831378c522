"""Launcher for the CUDA C++ RMSNorm (csrc/cuda/rms_norm.cu): bit-identical to the CPU backend.

One 16-lane group per row, 8 rows per 128-thread block; the per-row reduction order is the CPU
contract's (16 lane sums in ascending order, folded 8, 4, 2, 1), fixed by nothing but the
hidden size, so every row's bits are the same whatever the batch and equal the CPU path's.
"""

from __future__ import annotations

import torch

from bik._dtypes import info
from bik.runtime import cuda_jit
from bik.runtime.cuda_jit import f32, i64

__all__ = ["ROWS_PER_BLOCK", "launch_rms_norm"]

ROWS_PER_BLOCK = 8
_THREADS = 128


def launch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                    residual: torch.Tensor | None = None,
                    h_out: torch.Tensor | None = None) -> None:
    """Normalise rows of x [M, H] into out [M, H]; with residual, also write h_out = x + r.

    x, residual, out, h_out: CUDA, one dtype (fp32/bf16/fp16), unit stride along H; weight [H]
    contiguous (fp32/bf16/fp16, used in fp32). eps is rounded to fp32 (as on the CPU).
    """
    m, hidden = x.shape
    if m == 0 or hidden == 0:
        return
    for name, t in (("x", x), ("out", out), ("residual", residual), ("h_out", h_out)):
        if t is not None and (t.dtype != x.dtype or (hidden > 1 and t.stride(1) != 1)):
            raise ValueError(f"cuda rms_norm: {name} must have x's dtype and unit stride along H")
    if (residual is None) != (h_out is None):
        raise ValueError("cuda rms_norm: residual and h_out come together")
    if not weight.is_contiguous() or weight.shape != (hidden,):
        raise ValueError("cuda rms_norm: weight must be a contiguous [H] tensor")
    kernel = cuda_jit.get_kernel("rms_norm",
                                 f"bik_rms_norm_{info(x.dtype).cuda}_{info(weight.dtype).cuda}",
                                 x.device)
    has_res = residual is not None
    grid = ((m + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK, 1, 1)
    cuda_jit.launch(kernel, grid, (_THREADS, 1, 1), 0,
                    x, i64(x.stride(0)), residual, i64(residual.stride(0) if has_res else 0),
                    weight, out, i64(out.stride(0)), h_out, i64(h_out.stride(0) if has_res else 0),
                    i64(m), i64(hidden), f32(eps), device=x.device)

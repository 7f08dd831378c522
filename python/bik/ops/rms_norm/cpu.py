"""CPU launcher of the fixed-order fp32 RMSNorm (csrc/cpu/contract.h in ``bik._cpu_kernels``)."""

from __future__ import annotations

import torch

from bik.ops._checks import require, require_cpu
from bik.runtime import cpu_ext


def rms_norm_f32(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    *,
    num_threads: int | None = None,
    isa: str = "auto",
) -> None:
    """out[M, H] = rms_norm(x[M, H]) * weight[H], fp32, with the contract's 16-lane sum.

    x: fp32 with unit stride along H (any row stride); weight: fp32 [H] contiguous;
    out: fp32 [M, H] contiguous. eps is rounded to fp32. Rows are independent, so each row's
    bits do not depend on M, its position, num_threads or ``isa``.
    """
    ext = cpu_ext.require()
    fn = "bik.ops.rms_norm.cpu.rms_norm_f32"
    require_cpu(fn, x=x, weight=weight, out=out)
    require(x.dim() == 2, fn, "x must be 2-D")
    M, H = x.shape
    require(out.shape == (M, H) and out.is_contiguous() and weight.shape == (H,), fn,
            f"x {list(x.shape)} needs a contiguous out of its shape and weight [{H}]")
    require(x.dtype == weight.dtype == out.dtype == torch.float32 and weight.is_contiguous(),
            fn, "x, weight and out must be fp32, weight contiguous")
    if M == 0 or H == 0:
        return
    require(x.stride(1) == 1 or H == 1, fn, "x needs unit stride along H")
    ext.rms_norm_f32(
        x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), H, M, H, float(eps),
        torch.get_num_threads() if num_threads is None else num_threads,
        isa,
    )  # fmt: skip


def launch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                    residual: torch.Tensor | None = None,
                    h_out: torch.Tensor | None = None) -> None:
    """The op's launcher on the CPU: x, residual [M, H] with unit stride along H, weight [H]
    contiguous, out / h_out [M, H] contiguous in x's dtype. Inputs are upcast to fp32 (exact)
    and the result is rounded once to out's dtype."""
    if residual is not None:
        # Elementwise, so batch-invariant; rounded to x.dtype exactly as the GPU kernels do.
        h_out.copy_(x.float() + residual.float())
        x = h_out
    direct = out.dtype == torch.float32
    out32 = out if direct else torch.empty(x.shape, dtype=torch.float32, device=out.device)
    x32 = x.float()  # exact; an upcast of strided 16-bit rows may come back with other strides
    if x32.shape[1] > 1 and x32.stride(1) != 1:
        x32 = x32.contiguous()
    rms_norm_f32(x32, weight.float().contiguous(), float(eps), out32)
    if not direct:
        out.copy_(out32)

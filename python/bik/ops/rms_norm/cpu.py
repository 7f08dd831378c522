"""CPU launcher of the fixed-order fp32 RMSNorm (csrc/cpu/contract.h in ``bik._cpu_kernels``)."""

from __future__ import annotations

import torch

from bik.ops._checks import require, require_cpu
from bik.runtime import cpu_ext


def launch_rms_norm(args, out: torch.Tensor, h_out: torch.Tensor | None = None, *,
                    num_threads: int | None = None, isa: str | None = None) -> None:
    """The op's launcher on the CPU (the entry point in ops/rms_norm/op.py): inputs are
    upcast to fp32 (exact), normalised by csrc/cpu's kernel with the contract's 16-lane sum,
    and the result is rounded once to out's dtype (contiguous [M, H], x's dtype, as h_out).
    Rows are independent, so each row's bits depend neither on M, nor on its position, nor on
    ``num_threads`` or ``isa`` (knobs of speed only; None: all threads, the best ISA)."""
    ext = cpu_ext.require()
    x, weight = args.x, args.weight
    fn = "bik.ops.rms_norm.cpu.launch_rms_norm"
    require_cpu(fn, x=x, weight=weight, out=out)
    require(x.dim() == 2, fn, "x must be 2-D")
    m, hidden = x.shape
    require(out.shape == (m, hidden) and out.is_contiguous() and weight.shape == (hidden,)
            and weight.is_contiguous(), fn,
            f"x {list(x.shape)} needs a contiguous out of its shape and a contiguous weight "
            f"[{hidden}]")
    if x.dtype == out.dtype == torch.bfloat16 and (h_out is None or h_out.dtype == x.dtype):
        _launch_bf16(ext, args, out, h_out, num_threads, isa)
        return
    if h_out is not None:
        # Elementwise, so batch-invariant; rounded to x.dtype exactly as the GPU kernels do.
        h_out.copy_(x.float() + args.residual.float())
        x = h_out
    x32 = x.float()  # exact; an upcast of strided 16-bit rows may come back with other strides
    if x32.shape[1] > 1 and x32.stride(1) != 1:
        x32 = x32.contiguous()
    direct = out.dtype == torch.float32
    out32 = out if direct else torch.empty(x.shape, dtype=torch.float32, device=out.device)
    w32 = weight.float()  # named: the kernel reads it after this line
    if m and hidden:
        ext.rms_norm_f32(
            x32.data_ptr(), x32.stride(0), w32.data_ptr(),
            out32.data_ptr(), hidden, m, hidden, float(args.eps),
            torch.get_num_threads() if num_threads is None else num_threads, isa or "auto",
        )  # fmt: skip
    if not direct:
        out.copy_(out32)


def _launch_bf16(ext, args, out, h_out, num_threads, isa) -> None:
    """bf16 rows straight into the kernel (csrc's rms_norm_bf16): the same steps as the fp32
    path above, h = x + residual rounded to bf16, the row widened, normalised, rounded once,
    without the fp32 copies of every row, which at decode sizes cost more than the norm."""
    x, weight = args.x, args.weight
    m, hidden = x.shape
    if not (m and hidden):
        return
    w32 = weight if weight.dtype == torch.float32 else weight.float()
    residual = None if h_out is None else args.residual
    if residual is not None and hidden > 1 and residual.stride(1) != 1:
        residual = residual.contiguous()
    ext.rms_norm_bf16(
        x.data_ptr(), x.stride(0), 0 if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), w32.data_ptr(), out.data_ptr(), hidden,
        0 if h_out is None else h_out.data_ptr(), hidden, m, hidden, float(args.eps),
        torch.get_num_threads() if num_threads is None else num_threads, isa or "auto",
    )  # fmt: skip

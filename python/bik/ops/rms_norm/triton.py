"""Triton RMSNorm (optionally with the residual add fused in) with a fixed reduction tiling.

One program normalises one row. The sum of squares is accumulated lane-wise over chunks of
BLOCK_H elements (chunk 0, 1, ... in order), then the BLOCK_H lanes are summed by one
``tl.sum``. BLOCK_H and num_warps come from ``bik.configs.rms_norm_config`` (keyed by
hidden size and arch, never by the number of rows), so every row of a given hidden size is
reduced by the same compiled tree whatever the batch.

With a residual, h = (x + residual) is computed in fp32 and rounded to the input dtype;
that rounded h is both what is normalised and what is returned, so
``fused_add_rms_norm(x, r) == (rms_norm(h), h)`` bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bik._arch import device_arch
from bik.configs import rms_norm_config
from bik.runtime.triton_launch import launch


@triton.jit
def _load_row_chunk(x_ptr, r_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr):
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0)
        # Round h to the storage dtype first: the stored h and the normalised h are one value.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, h_ptr,
    H, eps,
    stride_x, stride_r, stride_out, stride_h,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    cols = tl.arange(0, BLOCK_H)

    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + cols
        mask = offs < H
        x = _load_row_chunk(x_row, r_row, offs, mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(h_ptr + row * stride_h + offs, x, mask=mask)
        xf = x.to(tl.float32)
        acc += xf * xf
    mean = tl.sum(acc, axis=0) / H
    rstd = 1.0 / tl.sqrt_rn(mean + eps)

    # Second pass recomputes h from x and residual rather than reading back the stores above:
    # another thread of this program may have written them, and recomputing gives the same bits.
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + cols
        mask = offs < H
        x = _load_row_chunk(x_row, r_row, offs, mask, HAS_RESIDUAL).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (x * rstd) * w
        tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def launch_rms_norm(args, out: torch.Tensor, h_out: torch.Tensor | None = None) -> None:
    """Normalise the rows of args.x [M, H] (unit stride along H) into out; with h_out, write
    h_out = x + args.residual and normalise it (the entry point in ops/rms_norm/op.py)."""
    x = args.x
    m, hidden = x.shape
    if m == 0 or hidden == 0:
        return
    cfg = rms_norm_config(x.dtype, hidden, device_arch(x.device))
    has_res = h_out is not None
    residual = args.residual if has_res else None
    launch(rms_norm_kernel, (m,),
           x, residual if has_res else x, args.weight, out, h_out if has_res else out,
           hidden, args.eps,
           x.stride(0), residual.stride(0) if has_res else 0, out.stride(0),
           h_out.stride(0) if has_res else 0,
           HAS_RESIDUAL=has_res, BLOCK_H=cfg.block_h, num_warps=cfg.num_warps,
           )

"""Triton softmax, log_softmax and mean over rows, with a fixed chunking of each row.

One program reduces one row of x [M, N] (unit stride along N). The row is read in chunks of
BLOCK elements (chunk 0, 1, ... in order); lane l of an fp32 accumulator of BLOCK lanes adds
element c * BLOCK + l of chunk c, and one ``tl.sum`` folds the BLOCK lanes at the end. BLOCK and
num_warps come from ``bik.configs.reduction_config(N, arch)`` — never from M — so every row of
a given length is reduced by the same compiled tree whatever the batch.

softmax / log_softmax take four passes over the row: the max (exact, so its order does not
matter); the anchor j0, the first element whose exp(x - max) is not 0 (a min, exact); the
lane-wise sum of exp(x - max) from j0 on, lane l adding element j0 + c * BLOCK + l; then the
outputs. The anchor is why a row's bits do not move with padding: leading masked entries
(-inf, or the lowest value HF adds) have exp(x - max) == 0 exactly, and without the anchor they
would shift every real entry to another lane of the tree (measured in the interpreter: 1-8
leading pads gave other bits for 5 of the 8 pad counts). A row without leading zeros has j0 = 0
and its old bits. A pass reloads the row instead of keeping it in registers so any N runs with
one BLOCK; rows up to BLOCK are one chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bik._arch import device_arch
from bik.configs import reduction_config


@triton.jit
def softmax_kernel(x_ptr, out_ptr, N, stride_x, stride_out,
                   LOG: tl.constexpr, BLOCK: tl.constexpr, ANCHOR: tl.constexpr):
    # bik launches ANCHOR=True; False exists for the test that shows the padding check can fail.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    cols = tl.arange(0, BLOCK)

    # Pass 1: the row max (exact; NaN rows become NaN through the sum below either way).
    mx_lanes = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        offs = c0 + cols
        x = tl.load(x_row + offs, mask=offs < N, other=float("-inf")).to(tl.float32)
        mx_lanes = tl.maximum(mx_lanes, x)
    mx = tl.max(mx_lanes, axis=0)

    # Pass 2: the anchor, the first element whose exp(x - max) is not 0 (N if none).
    j0 = 0
    if ANCHOR:
        first = tl.full((BLOCK,), N, dtype=tl.int32)
        for c0 in range(0, N, BLOCK):
            offs = c0 + cols
            mask = offs < N
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            first = tl.minimum(first, tl.where(mask & (tl.exp(x - mx) != 0.0), offs, N))
        j0 = tl.min(first, axis=0)

    # Pass 3: lane-wise sum of exp(x - max) over chunks from j0 in order, then one fixed tree.
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(j0, N, BLOCK):
        offs = c0 + cols
        mask = offs < N
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.where(mask, tl.exp(x - mx), 0.0)
    total = tl.sum(acc, axis=0)

    # Pass 4: the outputs, rounded once to the output dtype.
    lse = tl.log(total)
    for c0 in range(0, N, BLOCK):
        offs = c0 + cols
        mask = offs < N
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            y = (x - mx) - lse
        else:
            y = tl.math.div_rn(tl.exp(x - mx), total)
        tl.store(out_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def mean_kernel(x_ptr, out_ptr, N, n_f32, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        offs = c0 + cols
        acc += tl.load(x_row + offs, mask=offs < N, other=0.0).to(tl.float32)
    # n_f32 is N rounded to fp32 on the host (as the CPU kernel's (float)n); exact division.
    mean = tl.math.div_rn(tl.sum(acc, axis=0), n_f32)
    tl.store(out_ptr + row, mean.to(out_ptr.dtype.element_ty))


def launch_softmax(x: torch.Tensor, out: torch.Tensor, *, log: bool) -> None:
    """out[M, N] = (log_)softmax of each row of x[M, N]; both unit stride along N."""
    m, n = x.shape
    if m == 0 or n == 0:
        return
    cfg = reduction_config(n, device_arch(x.device))
    softmax_kernel[(m,)](x, out, n, x.stride(0), out.stride(0),
                         LOG=log, BLOCK=cfg.block, ANCHOR=True, num_warps=cfg.num_warps)


def launch_mean(x: torch.Tensor, out: torch.Tensor) -> None:
    """out[M] = mean of each row of x[M, N] (N >= 1, unit stride along N); out contiguous."""
    m, n = x.shape
    if m == 0:
        return
    cfg = reduction_config(n, device_arch(x.device))
    mean_kernel[(m,)](x, out, n, float(n), x.stride(0), BLOCK=cfg.block,
                      num_warps=cfg.num_warps)

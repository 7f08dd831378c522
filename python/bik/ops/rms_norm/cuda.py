"""Launcher for the CUDA C++ RMSNorm (csrc/cuda/rms_norm.cu): bit-identical to the CPU backend.

The per-row reduction order is the CPU contract's (16 lane sums in ascending order, folded 8, 4,
2, 1), fixed by nothing but the hidden size, so every row's bits are the same whatever the batch
and equal the CPU path's. Two instances of one kernel hold those 16 lanes differently
(csrc/cuda/rms_norm.cu): the vector one moves 16 bytes per load and store (4 fp32 or 8 16-bit
lanes per thread) and runs whenever the rows, the weight and the hidden size are aligned to
that vector; the scalar one (a lane per thread) takes any alignment. A third kernel, for
decode-sized batches, gives each row a block of 128 threads (the row loaded into shared memory
by all of them, the 16 lanes summed from there by 16 threads): the others give a row 2 to 16
threads each walking it with dependent loads, ~40-70 us at M = 1 (predicted from the code,
not measured). Same bits every way.
"""

from __future__ import annotations

import torch

from bik._dtypes import DTYPES, info
from bik.runtime import cuda_jit
from bik.runtime.cuda_jit import F32, I64, PTR

_LANES = 16  # the contract's lane count (csrc/cuda/rms_norm.cuh)

# bik_rms_norm[_vec]_<x dtype>_<weight dtype> (csrc/cuda/rms_norm.cu): one parameter list.
KERNELS = cuda_jit.declare(
    "rms_norm",
    [f"bik_rms_norm{v}_{x.cuda}_{w.cuda}" for v in ("", "_vec", "_row") for x in DTYPES
     for w in DTYPES],
    [("x", PTR), ("stride_x", I64), ("residual", PTR), ("stride_r", I64), ("weight", PTR),
     ("out", PTR), ("stride_out", I64), ("h_out", PTR), ("stride_h", I64), ("rows", I64),
     ("hidden", I64), ("eps", F32)])


ROW_THREADS = 128  # bik_rms_norm_row_*: a block per row (csrc/cuda/rms_norm.cu kRowThreads)
ROW_MAX_HIDDEN = 8192  # its shared-memory row (kRowMaxHidden)
ROW_MAX_ROWS = 1024  # below this the other kernels fill fewer than ~32 blocks (speed only)


def use_row_kernel(rows: int, hidden: int) -> bool:
    """A block per row for decode-sized batches whose row fits its shared memory. Speed only:
    every kernel gives the contract's bits."""
    return rows <= ROW_MAX_ROWS and hidden <= ROW_MAX_HIDDEN


def threads_per_block(vec: int) -> int:
    """128 threads (8 rows) for the scalar instance; 64 for the vector one (16 fp32 or 32 16-bit
    rows), so that a prefill of a few thousand rows still spreads over every SM."""
    return 128 if vec == 1 else 64


def vector_width(x: torch.Tensor, weight: torch.Tensor, tensors) -> int:
    """Elements per load for x [M, H] and its companions: 16 bytes' worth when every pointer,
    row stride and H are aligned to it (the weight to as many of its own elements), else 1."""
    vec = 16 // x.element_size()
    hidden = x.shape[1]
    aligned = hidden % vec == 0 and weight.data_ptr() % (vec * weight.element_size()) == 0
    for t in tensors:
        aligned = aligned and t.data_ptr() % 16 == 0 and (t.shape[0] <= 1 or t.stride(0) % vec == 0)
    return vec if aligned else 1


def launch_rms_norm(args, out: torch.Tensor, h_out: torch.Tensor | None = None) -> None:
    """Normalise the rows of args.x [M, H] into out [M, H]; with h_out, also write
    h_out = x + args.residual (the entry point in ops/rms_norm/op.py).

    x, residual, out, h_out: CUDA, one dtype (fp32/bf16/fp16), unit stride along H; weight [H]
    contiguous (fp32/bf16/fp16, used in fp32). eps is rounded to fp32 (as on the CPU).
    """
    x, weight, eps = args.x, args.weight, args.eps
    residual = None if h_out is None else args.residual
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
    rows_tensors = [t for t in (x, out, residual, h_out) if t is not None]
    dtypes = f"{info(x.dtype).cuda}_{info(weight.dtype).cuda}"
    has_res = residual is not None
    if use_row_kernel(m, hidden):
        name, threads, grid = f"bik_rms_norm_row_{dtypes}", ROW_THREADS, (m, 1, 1)
    else:
        vec = vector_width(x, weight, rows_tensors)
        name = f"bik_rms_norm{'_vec' if vec > 1 else ''}_{dtypes}"
        threads = threads_per_block(vec)
        rows_per_block = threads // (_LANES // vec)
        grid = ((m + rows_per_block - 1) // rows_per_block, 1, 1)
    cuda_jit.launch_kernel(KERNELS, name, grid, (threads, 1, 1), 0,
                           x, x.stride(0), residual, residual.stride(0) if has_res else 0,
                           weight, out, out.stride(0), h_out, h_out.stride(0) if has_res else 0,
                           m, hidden, eps, device=x.device)

"""Triton bik::grouped_matmul: bik::matmul's FOLD tiles (triton.py) over groups of rows.

A program finds its tile from the groups' ends, read on the device (no sync, so a CUDA graph
can capture the launch): grid axis 0 holds, in group order, ceil(rows_g / BLOCK_M) tiles per
group, then the tiles of the rows past the last end (written as zeros); the programs left over
(the grid is sized by S and G alone) do nothing. A tile's rows all belong to one group, and
its K loop is bik::matmul's (``_splits_dot`` / ``_split_dot`` with the tile and split of
``matmul_config`` / ``matmul_split`` for (dtype, N, K)), so each row gets bik.linear's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bik._arch import device_arch
from bik.configs import matmul_config, matmul_split_rule
from bik.ops.matmul.triton import _plan, _split_dot, _splits_dot
from bik.runtime.triton_launch import launch


@triton.jit
def _find_tile(ends_ptr, pid, S, G, BLOCK_M: tl.constexpr):
    """(group, first row, end of its rows) of tile ``pid``; group -1 for a tile of the rows past
    the last end (G for a program with no tile: its first row is then >= S). Each end is
    clamped to [previous end, S]."""
    start = tl.zeros((), dtype=tl.int64)
    seen = tl.zeros((), dtype=tl.int64)
    group = tl.full((), G, dtype=tl.int32)
    row0 = tl.zeros((), dtype=tl.int64)
    row_end = tl.zeros((), dtype=tl.int64)
    for g in range(0, G):
        end = tl.minimum(tl.maximum(tl.load(ends_ptr + g).to(tl.int64), start), S)
        tiles = (end - start + BLOCK_M - 1) // BLOCK_M
        hit = (pid >= seen) & (pid < seen + tiles)
        group = tl.where(hit, g, group)
        row0 = tl.where(hit, start + (pid - seen) * BLOCK_M, row0)
        row_end = tl.where(hit, end, row_end)
        seen += tiles
        start = end
    tail = (group == G) & (pid >= seen)
    group = tl.where(tail, -1, group)
    row0 = tl.where(tail, start + (pid - seen) * BLOCK_M, row0)
    row_end = tl.where(tail, S, row_end)
    return group, row0, row_end


# S and G are never specialised: one compiled kernel for every batch.
@triton.jit(do_not_specialize=["S", "G"])
def grouped_matmul_kernel(
    a_ptr, b_ptr, ends_ptr, c_ptr,
    S, G, N, K, SPLIT,
    stride_am, stride_ak,
    stride_bg, stride_bk, stride_bn,
    stride_cm, stride_cn,
    INPUT_PRECISION: tl.constexpr,
    MULTI_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    group, row0, row_end = _find_tile(ends_ptr, tl.program_id(0).to(tl.int64), S, G, BLOCK_M)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < row_end
    mask_n = offs_n < N
    mask_c = mask_m[:, None] & mask_n[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if group < 0:  # rows past the last end
        tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty),
                 mask=mask_c)
    elif row0 < row_end:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = (b_ptr + group.to(tl.int64) * stride_bg + offs_k[:, None] * stride_bk
                  + offs_n[None, :] * stride_bn)
        if MULTI_SPLIT:
            total = _splits_dot(a_ptrs, b_ptrs, offs_k, mask_m, mask_n, K, SPLIT, stride_ak,
                                stride_bk, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            total = _split_dot(a_ptrs, b_ptrs, offs_k, mask_m, mask_n, 0, K, stride_ak,
                               stride_bk, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask_c)


def launch_grouped_matmul(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor,
                          out: torch.Tensor) -> None:
    """out[S, N] from a [S, K], b [G, K, N], ends [G] (on the device), validated by the op."""
    s, k = a.shape
    g, _, n = b.shape
    if s == 0 or n == 0:
        return
    plan = _plan(a.dtype, n, k, k, device_arch(a.device), None, matmul_split_rule(), False,
                 matmul_config)
    cfg = plan.cfg
    # Enough programs for every group's tiles and the tail's: sum(ceil(r_g / BM)) + ceil(tail /
    # BM) <= ceil(S / BM) + G.
    grid = (-(-s // cfg.block_m) + g, -(-n // cfg.block_n))
    launch(grouped_matmul_kernel, grid,
           a, b, ends, out, s, g, n, k, plan.split, *a.stride(), *b.stride(), *out.stride(),
           INPUT_PRECISION=plan.fold["INPUT_PRECISION"], MULTI_SPLIT=plan.fold["MULTI_SPLIT"],
           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)

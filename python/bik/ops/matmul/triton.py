"""Triton matmul on bik's fixed K-split contract: the batch-invariant reduction order.

Each output tile of one batch entry is computed split by split (bik.configs.matmul_split: a
split length S from K alone, never M): split s sums ``acc = dot(a_tile, b_tile, acc)`` over
[s*S, min((s+1)*S, K)) in steps of BLOCK_K from a zero fp32 accumulator (``_split_dot``), and
the partials are folded in ascending s (``t = p_0; t = t + p_s``), then + bias, then one
rounding. Inside a split the order is fixed by (BLOCK_K, the dot instruction) — from
``bik.configs.matmul_config``, which does not see M — and is the same whether the tile holds 1
valid row or BLOCK_M. Rows beyond M are masked to zero on load and never stored, so no index
wraps around (the failure mode of kernels that take ``offs % M``).

Three launch modes, one split order (bik/ops/matmul/schedule.py): FOLD (grid axis 1 = 1; the
program runs its splits in order, in one K loop that folds each split's partial where it ends
and restarts the accumulator from zero, ``_splits_dot``: the loads stay in flight across split
boundaries) and SPREAD (grid axis 1 = the split, ``_split_dot``; fp32 partials to a workspace,
and the tile's last program to take a ticket folds them in order, in the same launch) load
tiles through pointers; PERSISTENT
(``matmul_tma_kernel``, Hopper, large M) keeps one program per SM looping over output tiles,
loads A and B through TMA tensor descriptors and folds each tile's splits as FOLD does. TMA fills out-of-bounds elements with zeros, which is what the pointer kernels' masks
load, the k steps are the same BLOCK_K steps from each split's start, and the dot is the same
instruction (checked on the PTX for every mode): same bits by construction.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from bik._arch import device_arch
from bik.configs import matmul_config, matmul_split, matmul_split_rule
from bik.ops.matmul.schedule import (persistent_programs, spread_bytes, use_persistent,
                                     use_spread)
from bik.runtime.counters import zeroed_counters
from bik.runtime.triton_launch import launch


@triton.jit
def _split_dot(a_ptrs, b_ptrs, offs_k, mask_m, mask_n, lo, hi, stride_ak, stride_bk,
               INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """One split's partial: acc = 0, then acc = dot(a, b, acc) over [lo, hi) in BLOCK_K steps.
    Every launch mode calls this, so every mode meets the same instructions in the same order."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    lo64 = tl.cast(lo, tl.int64)  # lo * stride may pass 2**31 elements (a [K, N] row-major B)
    a_ptrs += lo64 * stride_ak
    b_ptrs += lo64 * stride_bk
    for k0 in range(lo, hi, BLOCK_K):
        mask_k = (offs_k + k0) < hi
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _splits_dot(a_ptrs, b_ptrs, offs_k, mask_m, mask_n, K, SPLIT, stride_ak, stride_bk,
                INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """Every split of [0, K) folded, in one K loop: step i is split s = i // steps' j-th
    BLOCK_K step, acc = dot(a, b, acc) from a zero accumulator as in _split_dot; where a
    split ends the partial enters the total (t = p_0; t = t + p_s, s ascending) and acc
    restarts from zero. The same dots and adds in the same order as a _split_dot per split,
    but the loads run ahead across split boundaries: one pipelined loop per tile, not a
    prologue and a drain per split."""
    steps = tl.cdiv(SPLIT, BLOCK_K)
    last = tl.cdiv(K, SPLIT) - 1
    n_steps = last * steps + tl.cdiv(K - last * SPLIT, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, n_steps):
        s = i // steps
        start = s * SPLIT
        k0 = start + (i - s * steps) * BLOCK_K
        hi = tl.minimum(start + SPLIT, K)
        mask_k = (offs_k + k0) < hi
        k64 = tl.cast(k0, tl.int64)  # k0 * stride may pass 2**31 elements
        a = tl.load(a_ptrs + k64 * stride_ak, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs + k64 * stride_bk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if k0 + BLOCK_K >= hi:  # split s ends: fold its partial, restart from zero
            total = tl.where(s == 0, acc, total + acc)  # p_0 itself: -0.0 stays -0.0
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return total


@triton.jit
def _tile_of(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile ``pid`` in grouped order (L2 reuse): a permutation of which
    program computes which tile, nothing else."""
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % group_size) % rows_in_group, (pid % group_size) // rows_in_group


@triton.jit
def _fold_partials(ws_ptr, batch, offs_m, offs_n, mask_c, M, N, N_SPLITS):
    """SPREAD's fold, in the tile's last program: t = p_0; t = t + p_s for s ascending, read
    back from the fp32 workspace [batch, n_splits, M, N]. ``.cg``: the partials were written by
    other programs, so they are read from L2, never from this SM's L1."""
    ws = ws_ptr + (batch * N_SPLITS * M + offs_m)[:, None] * N + offs_n[None, :]
    total = tl.load(ws, mask=mask_c, other=0.0, cache_modifier=".cg")
    for _ in range(1, N_SPLITS):
        ws += M * N
        total = total + tl.load(ws, mask=mask_c, other=0.0, cache_modifier=".cg")
    return total


# M is never specialised (Triton would compile M == 1 and M % 16 == 0 separately): one compiled
# kernel serves every M, so no batch size can select different code.
@triton.jit(do_not_specialize=["M"])
def matmul_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, ws_ptr, ticket_ptr,
    M, N, K, SPLIT,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    SPREAD: tl.constexpr,  # grid axis 1 = split, partials to ws (else all splits here)
    MULTI_SPLIT: tl.constexpr,  # K > SPLIT (FOLD then loops over the splits)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # The batch is folded into grid axis 0 (axis 1 is capped at 65535 on CUDA).
    tiles = num_pid_m * num_pid_n
    batch = (tl.program_id(0) // tiles).to(tl.int64)
    pid_m, pid_n = _tile_of(tl.program_id(0) % tiles, num_pid_m, num_pid_n, GROUP_M)

    # int64 offsets: M*K or K*N may exceed 2**31 elements for LM-head sized problems.
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask_c = mask_m[:, None] & mask_n[None, :]
    a_ptrs = a_ptr + batch * stride_ab + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + batch * stride_bb + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    # SPREAD: this program's split. FOLD: axis 1 has one program, so s = 0, the first split
    # (a runtime 0, so every caller of _split_dot hands it the same kind of bounds).
    last = True
    if SPREAD:
        s = tl.program_id(1)
        n_splits = tl.num_programs(1)
        lo = s * SPLIT
        part = _split_dot(a_ptrs, b_ptrs, offs_k, mask_m, mask_n, lo, tl.minimum(lo + SPLIT, K),
                          stride_ak, stride_bk, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        # Workspace fp32 [batch, n_splits, M, N], contiguous.
        row = (batch * n_splits + s) * M + offs_m
        tl.store(ws_ptr + row[:, None] * N + offs_n[None, :], part, mask=mask_c)
        # Every thread's partial stored, then one release / acquire ticket per program: the
        # tile's last program to arrive sees every partial, folds them, and returns the ticket
        # to zero (bik.runtime.counters: the next kernel on the stream finds it so).
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        last = ticket == n_splits - 1
        total = part  # (an if defines a value on both paths)
        if last:
            tl.debug_barrier()
            total = _fold_partials(ws_ptr, batch, offs_m, offs_n, mask_c, M, N, n_splits)
            tl.store(ticket_ptr + tl.program_id(0), 0)
    else:
        if MULTI_SPLIT:
            total = _splits_dot(a_ptrs, b_ptrs, offs_k, mask_m, mask_n, K, SPLIT, stride_ak,
                                stride_bk, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        else:  # FOLD's one split: t = p_0 itself
            total = _split_dot(a_ptrs, b_ptrs, offs_k, mask_m, mask_n, 0, K, stride_ak,
                               stride_bk, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    if last:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            total = total + bias[None, :]
        c_ptrs = (c_ptr + batch * stride_cb + offs_m[:, None] * stride_cm
                  + offs_n[None, :] * stride_cn)
        tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask_c)


@triton.jit
def _tma_split_dot(a_desc, b_desc, off_m, off_n, lo, hi, B_NK: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """_split_dot with TMA loads: acc = 0, then acc = dot(a, b, acc) over [lo, hi) in BLOCK_K
    steps. A split ends on a BLOCK_K boundary or at K (launch_matmul checks), and TMA zero-fills
    past K and past M, N: the tiles the pointer loop's masks load."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        a = a_desc.load([off_m, k0])
        if B_NK:  # B given as the [N, K] weight of a linear layer (K contiguous)
            b = b_desc.load([off_n, k0]).T
        else:
            b = b_desc.load([k0, off_n])
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _tma_splits_dot(a_desc, b_desc, off_m, off_n, K, SPLIT, B_NK: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_splits_dot with TMA loads (splits end on BLOCK_K boundaries: step i starts at
    i * BLOCK_K, and split s ends at its last step): every split folded in one K loop."""
    steps = SPLIT // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = i * BLOCK_K
        a = a_desc.load([off_m, k0])
        if B_NK:
            b = b_desc.load([off_n, k0]).T
        else:
            b = b_desc.load([k0, off_n])
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if ((i + 1) % steps == 0) | (k0 + BLOCK_K >= K):  # split i // steps ends
            total = tl.where(i < steps, acc, total + acc)  # p_0 itself: -0.0 stays -0.0
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return total


@triton.jit(do_not_specialize=["M", "num_programs"])
def matmul_tma_kernel(
    a_desc, b_desc, bias_ptr, c_ptr,
    M, N, K, SPLIT, num_programs,
    stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    MULTI_SPLIT: tl.constexpr,
    B_NK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """PERSISTENT: ``num_programs`` programs (one per SM) take the output tiles in turn; each
    tile is FOLD's: t = p_0; t = t + p_s, s ascending; + bias; one rounding. One batch entry."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for pid in range(tl.program_id(0), num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = _tile_of(pid, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if MULTI_SPLIT:
            total = _tma_splits_dot(a_desc, b_desc, off_m, off_n, K, SPLIT, B_NK,
                                    INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            total = _tma_split_dot(a_desc, b_desc, off_m, off_n, 0, K, B_NK, INPUT_PRECISION,
                                   BLOCK_M, BLOCK_N, BLOCK_K)
        offs_m = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
        offs_n = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            total = total + bias[None, :]
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty),
                 mask=(offs_m < M)[:, None] & mask_n[None, :])


def _tma_operands(a: torch.Tensor, b: torch.Tensor, cfg, split: int):
    """(a_desc, b_desc, b_nk) for PERSISTENT, or None when TMA cannot take these operands: one
    batch entry, unit stride along K for A and along K or N for B, 16-byte aligned bases and
    row strides, rows that neither repeat (stride 0: an expanded operand) nor overlap, and
    splits that end on BLOCK_K boundaries."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if a.shape[0] != 1 or split % cfg.block_k:
        return None
    a2, b2 = a[0], b[0]
    size = a.element_size()

    def aligned(t, row_stride, row_len):
        # A tensor map's row stride must be a positive multiple of 16 bytes; a stride below
        # the row's length (0 when expanded) would have TMA read rows that overlap.
        return t.data_ptr() % 16 == 0 and (row_stride * size) % 16 == 0 and \
            row_stride >= max(row_len, 1)

    if a2.stride(1) != 1 or not aligned(a2, a2.stride(0), a2.shape[1]):
        return None
    if b2.stride(0) == 1 and aligned(b2, b2.stride(1), b2.shape[0]):  # [K, N] view of [N, K]
        return (TensorDescriptor.from_tensor(a2, [cfg.block_m, cfg.block_k]),
                TensorDescriptor.from_tensor(b2.t(), [cfg.block_n, cfg.block_k]), True)
    if b2.stride(1) == 1 and aligned(b2, b2.stride(0), b2.shape[1]):
        return (TensorDescriptor.from_tensor(a2, [cfg.block_m, cfg.block_k]),
                TensorDescriptor.from_tensor(b2, [cfg.block_k, cfg.block_n]), False)
    return None


def input_precision(dtype: torch.dtype) -> str:
    # fp32 runs as IEEE fp32 (never TF32); 16-bit inputs have one dot precision anyway.
    return "ieee" if dtype == torch.float32 else "tf32"


class _Plan(NamedTuple):
    """What a launch of one (dtype, layer, K, arch, split rule, bias) needs besides M: found
    once (``_plan``), so a call does only M's arithmetic before its launches."""

    cfg: object  # MatmulConfig
    split: int
    n_splits: int
    fold: dict  # matmul_kernel's constexprs and options, FOLD
    spread: dict  # the same, SPREAD
    tma: dict  # matmul_tma_kernel's (B_NK added per call)


@functools.lru_cache(maxsize=1024)
def _plan(dtype: torch.dtype, key_n: int, key_k: int, k: int, arch: str, split: int | None,
          split_rule: tuple, has_bias: bool, config=matmul_config) -> _Plan:
    """The plan for a key; ``split_rule`` (matmul_split's constants and BIK_MATMUL_SPLIT) and
    ``config`` (the table's function, which a test may replace) are part of the key. A test
    that edits the tile table itself must ``_plan.cache_clear()``."""
    del split_rule
    cfg = config(dtype, key_n, key_k, arch)
    split = matmul_split(dtype, key_n, key_k).split if split is None else split
    n_splits = max(1, -(-k // split))
    if n_splits > 65535:
        raise ValueError(f"bik: backend='triton' matmul: K = {k} gives {n_splits} splits "
                         f"(max 65535)")
    common = dict(HAS_BIAS=has_bias, INPUT_PRECISION=input_precision(dtype))
    tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    multi = n_splits > 1
    return _Plan(cfg, split, n_splits,
                 fold=common | dict(SPREAD=False, MULTI_SPLIT=multi) | tiles,
                 spread=common | dict(SPREAD=True, MULTI_SPLIT=multi) | tiles,
                 tma=common | dict(MULTI_SPLIT=multi) | tiles)


def launch_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor, *, layer: tuple[int, int] | None = None,
                  split: int | None = None, spread: bool | None = None,
                  persistent: bool | None = None) -> None:
    """out[B, M, N] = a[B, M, K] @ b[B, K, N] (+ bias[N]), all validated by the caller.

    Any strides are accepted (batch stride 0 broadcasts b); ``out`` is written, not read.
    ``layer``: the (N, K) of the whole layer the tables (tile and K-split) are looked up with,
    default this call's (a shard of a sharded layer passes the layer's). ``split``: an explicit
    K-split length (tests). ``spread`` / ``persistent`` None = by arch and work size (the bits
    do not depend on them); ``persistent=True`` where TMA cannot take the operands runs FOLD.
    """
    nb, m, k = a.shape
    n = b.shape[2]
    if nb == 0 or m == 0 or n == 0:
        return
    arch = device_arch(a.device)
    key_n, key_k = layer or (n, k)
    plan = _plan(a.dtype, key_n, key_k, k, arch, split, matmul_split_rule(), bias is not None,
                 matmul_config)
    cfg, n_splits = plan.cfg, plan.n_splits
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n) * nb
    spread = use_spread(tiles, n_splits, **spread_bytes(nb, m, n, k, n_splits, a.element_size())) \
        if spread is None else bool(spread) and n_splits > 1
    bias_arg = bias.contiguous() if bias is not None else out
    if persistent is None:
        persistent = use_persistent(arch, a.dtype, tiles)
    descs = _tma_operands(a, b, cfg, plan.split) if persistent else None
    if descs is not None:
        a_desc, b_desc, b_nk = descs
        programs = persistent_programs(a.device, tiles)
        launch(matmul_tma_kernel, (programs,),
               a_desc, b_desc, bias_arg, out, m, n, k, plan.split, programs,
               out.stride(1), out.stride(2), B_NK=b_nk, **plan.tma)
        return
    # SPREAD's fp32 partials [batch, n_splits, M, N] and a ticket per tile; FOLD reads
    # neither (out stands in).
    if spread:
        ws = torch.empty((nb, n_splits, m, n), dtype=torch.float32, device=a.device)
        tickets = zeroed_counters(a.device, tiles)
    else:
        ws = tickets = out
    launch(matmul_kernel, (tiles, n_splits if spread else 1),
           a, b, bias_arg, out, ws, tickets, m, n, k, plan.split, *a.stride(), *b.stride(),
           *out.stride(), **(plan.spread if spread else plan.fold))


# bik::bmm's entry: the same kernel (the CPU backend alone runs bmm on another bf16 sequence).
launch_bmm = launch_matmul

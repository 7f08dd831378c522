"""Triton softmax, log_softmax and mean over rows, with a fixed order of each row's sum.

One program reduces one row of x [M, N] (unit stride along N). Every knob that shapes a sum
comes from N and the arch (``bik.configs.reduction_config``, ``sampler_chunks``) — never from
M — so every row of a given length is reduced by the same compiled order whatever the batch.

softmax and mean read the row in chunks of BLOCK elements (chunk 0, 1, ... in order); lane l of
an fp32 accumulator of BLOCK lanes adds element c * BLOCK + l of chunk c, and one ``tl.sum``
folds the BLOCK lanes at the end. softmax takes four passes over the row: the max (exact, so
its order does not matter); the anchor j0, the first element whose exp(x - max) is not 0 (a
min, exact); the lane-wise sum of exp(x - max) from j0 on, lane l adding element
j0 + c * BLOCK + l; then the outputs. The anchor is why a row's softmax bits do not move with
padding (eager attention's masked scores): leading masked entries (-inf, or the lowest value HF
adds) have exp(x - max) == 0 exactly, and without the anchor they would shift every real entry
to another lane of the tree (measured in the interpreter: 1-8 leading pads gave other bits for
5 of the 8 pad counts). A row without leading zeros has j0 = 0.

log_softmax is the sampler's normaliser instead (docs/design.md#sampler, "The normaliser"), so
that ``bik.log_softmax(z).gather(t)`` is ``bik.sample(z).logprobs`` bit for bit: m = max (exact;
a row whose m is not finite, or that holds a NaN, is all NaN), terms bik_exp(x - m), their sum
in the order ``sampler_chunks(N)`` writes down (G groups, chunks of CHUNK from each group's
start folded by halves, chunk sums then group totals ascending from +0), lse = bik_log(sum),
y = (x - m) - lse. The building blocks are the sampler's own (ops/_normaliser_triton.py) and
the kernel is compiled without fp fusion, as the sampler's are: exactly rounded ops only.

A pass reloads the row instead of keeping it in registers so any N runs with one BLOCK.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bik._arch import device_arch
from bik.configs import reduction_config, sampler_chunks
from bik.ops._normaliser_triton import NO_FUSION, add_chunk_sums, bik_exp, bik_log, chunk_sums
from bik.runtime.triton_launch import launch


@triton.jit
def softmax_kernel(x_ptr, out_ptr, N, stride_x, stride_out,
                   BLOCK: tl.constexpr, ANCHOR: tl.constexpr):
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
    for c0 in range(0, N, BLOCK):
        offs = c0 + cols
        mask = offs < N
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.math.div_rn(tl.exp(x - mx), total)
        tl.store(out_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def log_softmax_kernel(x_ptr, out_ptr, N, GROUP_LEN, stride_x, stride_out, G: tl.constexpr,
                       CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, NCH: tl.constexpr,
                       BLOCK: tl.constexpr):
    # Launched with NO_FUSION: the bits are the sampler's logprob's only if no mul + add fuses.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    cols = tl.arange(0, BLOCK)

    # Pass 1: the max (exact in any order) and whether the row holds a NaN: a GPU's max drops
    # NaN, and the sampler's invalid row is flagged, not left to propagate.
    mx_lanes = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    nan_lanes = tl.zeros((BLOCK,), dtype=tl.int32)
    for c0 in range(0, N, BLOCK):
        offs = c0 + cols
        x = tl.load(x_row + offs, mask=offs < N, other=float("-inf")).to(tl.float32)
        nan_lanes = nan_lanes | (x != x).to(tl.int32)  # noqa: PLR0124 (NaN)
        mx_lanes = tl.maximum(mx_lanes, x)
    m = tl.max(mx_lanes, axis=0)
    bad = (tl.max(nan_lanes, axis=0) > 0) | (m == float("inf")) | (m == float("-inf"))
    m_safe = tl.where(bad, 0.0, m)

    # Pass 2: S = sum of bik_exp(x - m) in the normaliser's order: per group, NCH chunks of
    # CHUNK side by side from the group's start (missing tokens +0), each folded by halves,
    # the chunk sums into the group total ascending from +0; then the group totals ascending.
    tile = tl.arange(0, NCH)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    total = tl.full((), 0.0, tl.float32)
    for g in range(G):
        g0 = g * GROUP_LEN
        g_end = g0 + GROUP_LEN
        group_total = tl.full((), 0.0, tl.float32)
        for c0 in range(g0, g_end, CHUNK * NCH):
            offs = c0 + tile
            mask = offs < g_end
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            terms = tl.where(mask, bik_exp(x - m_safe), 0.0)
            group_total = add_chunk_sums(group_total, chunk_sums(terms, NCH, CHUNK, LOG2_CHUNK),
                                         NCH)
        total = total + group_total
    # S >= 1 for a valid row (the max's term is bik_exp(0) = 1); 1 keeps bik_log's input normal.
    lse = bik_log(tl.where(bad, 1.0, total))

    # Pass 3: y = (x - m) - lse, rounded once to the output dtype; an invalid row is all NaN.
    for c0 in range(0, N, BLOCK):
        offs = c0 + cols
        mask = offs < N
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.where(bad, float("nan"), (x - m_safe) - lse)
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


def log_softmax_launch_args(n: int, arch: str) -> tuple[int, dict]:
    """(the group length, log_softmax_kernel's constexprs and num_warps) for rows of length n:
    the normaliser's order from ``sampler_chunks(n)``; BLOCK (the max and output passes) and
    NCH, the chunks folded side by side per step (the config's block, at most a group's worth,
    at least one chunk), are speed only: no bit depends on them."""
    cfg = reduction_config(n, arch)
    groups, chunk = sampler_chunks(n)
    group_len = n // groups
    nch = max(1, min(cfg.block, 1 << max(0, group_len - 1).bit_length()) // chunk)
    return group_len, {"G": groups, "CHUNK": chunk, "LOG2_CHUNK": chunk.bit_length() - 1,
                       "NCH": nch, "BLOCK": cfg.block, "num_warps": cfg.num_warps}


def launch_softmax(x: torch.Tensor, out: torch.Tensor, *, log: bool) -> None:
    """out[M, N] = (log_)softmax of each row of x[M, N]; both unit stride along N."""
    m, n = x.shape
    if m == 0 or n == 0:
        return
    arch = device_arch(x.device)
    if log:
        group_len, meta = log_softmax_launch_args(n, arch)
        launch(log_softmax_kernel, (m,), x, out, n, group_len, x.stride(0), out.stride(0), **meta,
               **NO_FUSION)
        return
    cfg = reduction_config(n, arch)
    launch(softmax_kernel, (m,), x, out, n, x.stride(0), out.stride(0),
           BLOCK=cfg.block, ANCHOR=True, num_warps=cfg.num_warps)


def launch_mean(x: torch.Tensor, out: torch.Tensor) -> None:
    """out[M] = mean of each row of x[M, N] (N >= 1, unit stride along N); out contiguous."""
    m, n = x.shape
    if m == 0:
        return
    cfg = reduction_config(n, device_arch(x.device))
    launch(mean_kernel, (m,), x, out, n, float(n), x.stride(0), BLOCK=cfg.block,
           num_warps=cfg.num_warps)

"""Triton matmul with no split-K: the batch-invariant reduction order.

Each program owns one BLOCK_M x BLOCK_N output tile of one batch entry and walks K from 0
to K in steps of BLOCK_K, accumulating ``acc = dot(a_tile, b_tile, acc)`` in fp32. The
order in which an output element's products are summed is therefore fixed by (BLOCK_K,
the dot instruction, K) — all taken from ``bik.configs.matmul_config`` which does not see
M — and is the same whether the tile holds 1 valid row or BLOCK_M. Rows beyond M are
masked to zero on load and never stored, so no index wraps around (the failure mode of
kernels that take ``offs % M``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bik._arch import device_arch
from bik.configs import matmul_config

__all__ = ["launch_matmul", "matmul_kernel"]


# M is never specialised (Triton would compile M == 1 and M % 16 == 0 separately): one compiled
# kernel serves every M, so no batch size can select different code.
@triton.jit(do_not_specialize=["M"])
def matmul_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr,
    M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # The batch is folded into grid axis 0 (axis 1 is capped at 65535 on CUDA).
    tiles = num_pid_m * num_pid_n
    batch = (tl.program_id(0) // tiles).to(tl.int64)
    pid = tl.program_id(0) % tiles
    # Grouped tile order for L2 reuse. It only permutes which program computes which tile.
    group_size = GROUP_M * num_pid_n
    group_id = pid // group_size
    first_m = group_id * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    # int64 offsets: M*K or K*N may exceed 2**31 elements for LM-head sized problems.
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + batch * stride_ab + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + batch * stride_bb + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (offs_k + k0) < K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    c_ptrs = c_ptr + batch * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def input_precision(dtype: torch.dtype) -> str:
    # fp32 runs as IEEE fp32 (never TF32); 16-bit inputs have one dot precision anyway.
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor) -> None:
    """out[B, M, N] = a[B, M, K] @ b[B, K, N] (+ bias[N]), all validated by the caller.

    Any strides are accepted (batch stride 0 broadcasts b); ``out`` is written, not read.
    """
    nb, m, k = a.shape
    n = b.shape[2]
    if nb == 0 or m == 0 or n == 0:
        return
    cfg = matmul_config(a.dtype, n, k, device_arch(a.device))
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n) * nb,)
    matmul_kernel[grid](
        a, b, bias.contiguous() if bias is not None else out, out,
        m, n, k,
        a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        HAS_BIAS=bias is not None,
        INPUT_PRECISION=input_precision(a.dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

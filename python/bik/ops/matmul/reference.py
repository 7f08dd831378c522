"""The matmul contracts written literally in torch (the spec; imported by tests only).

:func:`matmul_cpu_reference` is the CPU backend's contract (csrc/cpu/contract.h): for each
output c[m, n], ``acc = 0; acc = acc + a[m, k] * b[k, n]`` for k ascending, every multiply and
every add rounded to fp32 (no FMA, no reassociation), then ``+ bias[n]`` if a bias is given (so
K == 0 gives ``0.0f + bias[n]``). bik/ops/matmul/cpu.py must give its bits exactly.

:func:`matmul_split_k_reference` is the CUDA backend's fp32 contract (csrc/cuda/matmul.cu): K
is cut into splits of ``split`` (from bik.configs.cuda_matmul_config); each split runs the
sequence above from a fresh acc = 0, the splits' partial sums are folded in ascending order,
then the bias is added. With K <= split it is the CPU contract.

Both are built from fp32 elementwise torch ops, which are correctly rounded and never fused, so
they give the contract's bits on any device; they are slow (one torch op per K step).
"""

from __future__ import annotations

import torch

__all__ = ["matmul_cpu_reference", "matmul_split_k_reference"]


def matmul_cpu_reference(a: torch.Tensor, b: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]), fp32, by the CPU contract: k ascending, each op
    rounded."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    for k in range(a.shape[1]):
        acc = acc + a[:, k : k + 1] * b[k : k + 1, :]
    return acc if bias is None else acc + bias


def matmul_split_k_reference(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor,
                             split: int) -> torch.Tensor:
    """a [M, K] @ b [K, N] + bias [N], fp32, by the CUDA contract: per split of ``split`` K
    steps, acc = 0 then acc = acc + a[:, k] * b[k] for k ascending; the splits folded in
    order; + bias."""
    total = None
    for lo in range(0, max(a.shape[1], 1), split):
        acc = torch.zeros(a.shape[0], b.shape[1], device=a.device)
        for kk in range(lo, min(lo + split, a.shape[1])):
            acc = acc + a[:, kk:kk + 1] * b[kk:kk + 1, :]
        total = acc if total is None else total + acc
    return total + bias

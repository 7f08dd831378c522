"""The rms_norm contract written literally in torch (the spec; imported by tests only).

:func:`rms_norm_cpu_reference` is the CPU backend's contract (csrc/cpu/contract.h), per row
x[0..H-1], weight w[H], eps rounded to fp32 first:

* 16 lanes: ``s[l] = 0`` for l < 16; for j ascending, ``s[j % 16] = s[j % 16] + x[j] * x[j]``
  (each multiply and add rounded to fp32);
* the fold: for w = 8, 4, 2, 1, ``s[l] = s[l] + s[l + w]`` for l < w;
* ``mean = s[0] / H``, ``rstd = 1 / sqrt(mean + eps)``, each correctly rounded to fp32;
* ``y[j] = (x[j] * rstd) * w[j]`` (two multiplies, in that order).

bik/ops/rms_norm/cpu.py must give its bits exactly. Rows are independent.
"""

from __future__ import annotations

import torch


def rms_norm_cpu_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, H] (fp32) normalised per row by the CPU contract, times w [H]."""
    M, H = x.shape
    s = torch.zeros(M, 16, dtype=torch.float32, device=x.device)
    for j in range(H):
        s[:, j % 16] = s[:, j % 16] + x[:, j] * x[:, j]
    for width in (8, 4, 2, 1):
        s[:, :width] = s[:, :width] + s[:, width : 2 * width]
    # Correct rounding, which torch's fp32 CPU ops do not all give: fp32 torch.sqrt is off by an
    # ulp on some inputs (measured, torch 2.13), and division by a 0-dim tensor may become a
    # multiply by its reciprocal. fp64 sqrt/div of fp32 values, rounded once to fp32, is exact.
    total = s[:, 0:1]
    mean = (total.double() / float(H)).float()
    q = mean + torch.full_like(mean, eps)
    rstd = (1.0 / torch.sqrt(q.double()).float().double()).float()
    return (x * rstd) * w

"""bik's matmul K-split contract written literally in torch (the spec; imported by tests only).

For each output c[m, n] of a [M, K] @ b [K, N] (+ bias [N]) with plan (G, S) from
:func:`bik.configs.matmul_split` (docs/design.md, "The matmul K-split"):

* K is cut into G equal groups of K / G; each group into splits of S elements from the
  group's start, the last one ragged;
* split j of group g: ``p = 0; p = p + a[m, k] * b[k, n]`` for its k ascending, every multiply
  and every add rounded to fp32 (no FMA, no reassociation): the *mul-add* sequence; or, the
  *fma* one, ``p = fma(a[m, k], b[k, n], p)``, each step rounded once;
* inside a group: ``t = p_0; t = t + p_j`` for j ascending;
* across groups: ``T = t_0; T = T + t_g`` for g ascending; then ``T + bias[n]`` (so K == 0
  gives ``0.0f + bias[n]``).

The mul-add sequence is the CUDA backend's SIMT fp32 one (csrc/cuda/matmul.cu) and the CPU
backend's under ``BIK_CPU_FP32=mul-add``; the fma one is the CPU backend's default wherever its
kernel passes (csrc/cpu/contract.h, :func:`bik.runtime.cpu_ext.fp32_fma`), bit for bit; 16-bit GPU kernels keep the same splits and folds with
their dot instruction inside a split. Built from fp32 elementwise torch ops, which are
correctly rounded and never fused, so it gives the contract's bits on any device; it is slow
(one torch op per K step).
"""

from __future__ import annotations

import torch

from bik.configs import MatmulSplit


def split_ranges(k: int, plan: MatmulSplit) -> list[list[tuple[int, int]]]:
    """[group][split] -> (lo, hi) of the K range it sums; every group holds at least one split
    (so K == 0 is one empty split)."""
    if plan.groups < 1 or plan.split < 1 or k % plan.groups:
        raise ValueError(f"bik: K = {k} does not cut into {plan.groups} groups of splits of "
                         f"{plan.split}")
    glen = k // plan.groups
    return [[(g * glen + lo, g * glen + min(lo + plan.split, glen))
             for lo in range(0, max(glen, 1), plan.split)] for g in range(plan.groups)]


def fma_step(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``p + a*b`` (fp32) rounded once to nearest even: C's fmaf, written out without an FMA.
    In fp64 the product is exact (24 + 24 <= 53 bits) and so is the sum's error (TwoSum), but
    rounding the fp64 sum to fp32 rounds twice, which goes wrong exactly where that sum lands on
    the midpoint of two floats while the exact value does not: there the error's sign picks the
    side."""
    prod = a.double() * b.double()
    s = prod + p.double()
    r = s.float()
    bb = s - prod
    err = (prod - (s - bb)) + (p.double() - bb)
    inf = torch.tensor(float("inf"))
    other = torch.nextafter(r, torch.where(s > r.double(), inf, -inf))

    def wide(f: torch.Tensor) -> torch.Tensor:  # 2^128 stands for the float past the largest
        return torch.where(f.isinf(), torch.copysign(torch.tensor(2.0**128), f.double()),
                           f.double())

    at_mid = s.isfinite() & (r.double() != s) & (err != 0) & (s == (wide(r) + wide(other)) / 2)
    upper = torch.where(wide(r) > wide(other), r, other)
    lower = torch.where(wide(r) > wide(other), other, r)
    return torch.where(at_mid, torch.where(err > 0, upper, lower), r)


def matmul_contract_reference(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                              plan: MatmulSplit, *, fma: bool = False) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) in fp32 by the K-split contract with ``plan``, on the
    mul-add sequence, or the fma one (:func:`fma_step`) with ``fma``."""
    a, b = a.float(), b.float()

    def split_sum(lo: int, hi: int) -> torch.Tensor:
        p = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
        for kk in range(lo, hi):
            ak, bk = a[:, kk:kk + 1], b[kk:kk + 1, :]
            p = fma_step(p, ak, bk) if fma else p + ak * bk
        return p

    return _fold_splits(a.shape[1], plan, split_sum, bias)


def _fold_splits(k: int, plan: MatmulSplit, split_sum, bias: torch.Tensor | None) -> torch.Tensor:
    """The K-split contract's folds around a split's partial ``split_sum(lo, hi)``: inside a
    group ``t = p_0; t = t + p_j``, across groups ``T = t_0; T = T + t_g``, then + bias."""
    total = None
    for group in split_ranges(k, plan):
        group_total = None
        for lo, hi in group:
            p = split_sum(lo, hi)
            group_total = p if group_total is None else group_total + p
        total = group_total if total is None else total + group_total
    return total if bias is None else total + bias.float()


def _daz(x: torch.Tensor) -> torch.Tensor:
    """bf16 ``x`` read as the bf16 dot instruction reads it: a zero exponent field is a zero of
    its sign (denormals in)."""
    bits = x.view(torch.int16).int() & 0x7F80
    return torch.where(bits == 0, torch.copysign(torch.zeros_like(x), x), x)


def bf16_dot_step(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One step of contract.h's bf16 dot sequence: ``p + a*b`` (p fp32; a, b bf16) with the
    product exact, one round to nearest even at fp32's precision with an unbounded exponent,
    then a result below 2^-126 in magnitude flushed to a zero of its sign. In fp64 the product
    of two bf16 values is exact, and rounding p + a*b to fp64 then to 24 bits equals rounding it
    once (53 >= 2 * 24 + 2)."""
    s = p.double() + _daz(a).double() * _daz(b).double()
    small = (s.abs() < 2.0**-100) & (s != 0)
    # 24-bit rounding below fp32's exponent range: scaling by 2^200 is exact in fp64
    r = (torch.where(small, s, torch.zeros_like(s)) * 2.0**200).float().double() * 2.0**-200
    flushed = small & (r.abs() < 2.0**-126)
    out = torch.where(small, r, s).float()
    return torch.where(flushed, torch.copysign(torch.zeros_like(out), s.float()), out)


def matmul_bf16_dot_reference(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                              plan: MatmulSplit) -> torch.Tensor:
    """bf16 a [M, K] @ bf16 b [K, N] (+ bias [N]) in fp32 by contract.h's bf16 dot sequence
    (the CPU's bf16 path): the K-split contract's splits and folds, each split
    ``p = 0; p = step(p, a[m, k], b[k, n])`` for k ascending (:func:`bf16_dot_step`), and one
    ``step(p, 0, 0)`` after a split of odd length (the zero half of its last pair: a -0 partial
    becomes +0)."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise ValueError(f"bik: the bf16 dot contract takes bf16 a and b, got {a.dtype}, "
                         f"{b.dtype}")
    zero = torch.zeros((), dtype=torch.bfloat16)

    def split_sum(lo: int, hi: int) -> torch.Tensor:
        p = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
        for kk in range(lo, hi):
            p = bf16_dot_step(p, a[:, kk:kk + 1], b[kk:kk + 1, :])
        return bf16_dot_step(p, zero, zero) if (hi - lo) % 2 else p

    return _fold_splits(a.shape[1], plan, split_sum, bias)


def grouped_matmul_reference(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor,
                             dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Group g's rows of a times b[g] in ``dtype`` (fp64 for accuracy checks); rows past the
    last end zero."""
    parts, start = [], 0
    for g, end in enumerate(ends.tolist()):
        parts.append(a[start:end].to(dtype) @ b[g].to(dtype))
        start = end
    parts.append(torch.zeros(a.shape[0] - start, b.shape[2], dtype=dtype))
    return torch.cat(parts)  # (differentiable: no in-place writes)

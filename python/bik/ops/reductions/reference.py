"""softmax / log_softmax / mean contracts in torch (imported by tests only).

This is the spec of csrc/cpu/reductions.h (written in csrc/cpu/contract.h), one IEEE-754
binary32 operation at a time, each rounded to nearest even. Per row x[0..n-1] of fp32:

* the 16-lane sum (:func:`lane_sum16`): ``s[l] = +0.0`` for l = 0..15; for j ascending,
  ``s[j % 16] = s[j % 16] + t[j]``; then for w = 8, 4, 2, 1: ``s[l] = s[l] + s[l + w]`` for
  l < w; the sum is ``s[0]``. Only lane j % 16 is touched by element j (no padding adds).
* softmax (:func:`softmax_cpu_reference`): ``mx = max_j x[j]`` (exact; NaN if the row holds a
  NaN); ``e[j] = expf(x[j] - mx)``; ``S`` = the 16-lane sum of e; ``y[j] = e[j] / S``
  (correctly rounded division).
* log_softmax (:func:`log_softmax_reference`, every backend): the sampler's normaliser.
  ``m = max_j x[j]``; a row whose m is not finite (a NaN, a +inf, all -inf) is NaN; else
  ``e[j] = bik_exp(x[j] - m)``, ``S = vocab_sum(e)`` in the order of
  ``bik.configs.sampler_chunks(n)`` and ``y[j] = (x[j] - m) - bik_log(S)``, from the torch
  transcriptions in ops/_normaliser.py (the sampler's own tests hold those to its kernels).
* mean (:func:`mean_cpu_reference`, n >= 1): the 16-lane sum of x, divided by ``(float)n``.

expf is the C library's (called through ctypes): pure functions of their argument, the
same functions the compiled kernels call, whose bits torch's vectorised exp need not match.
Nothing in the sequence depends on the number of rows, a row's position or the thread count;
the tests compare the kernels with these functions bit for bit.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from bik.configs import sampler_chunks
from bik.ops._normaliser import bik_exp_torch, bik_log_torch, vocab_sum_torch

LANES = 16

_LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
_LIBM.expf.restype = ctypes.c_float
_LIBM.expf.argtypes = [ctypes.c_float]


def _libm(name: str, x: torch.Tensor) -> torch.Tensor:
    """The C library's ``name`` (expf) of each fp32 element (exact round trips: an fp32
    value is a Python float and a c_float exactly)."""
    fn = getattr(_LIBM, name)
    values = [fn(v) for v in x.flatten().tolist()]
    return torch.tensor(values, dtype=torch.float32).reshape(x.shape)


def lane_sum16(t: torch.Tensor) -> torch.Tensor:
    """The contract's 16-lane sum of each row of t [M, n] (fp32): [M]."""
    assert t.dtype == torch.float32 and t.dim() == 2
    s = torch.zeros(t.shape[0], LANES, dtype=torch.float32)
    for j0 in range(0, t.shape[1], LANES):
        chunk = t[:, j0:j0 + LANES]
        w = chunk.shape[1]
        s[:, :w] = s[:, :w] + chunk
    for w in (8, 4, 2, 1):
        s[:, :w] = s[:, :w] + s[:, w:2 * w]
    return s[:, 0].clone()


def softmax_cpu_reference(x: torch.Tensor) -> torch.Tensor:
    """softmax of each row of x [M, n] (fp32, n >= 1) on the CPU backend: [M, n]."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] >= 1
    mx = x.amax(-1, keepdim=True)
    e = _libm("expf", x - mx)
    return e / lane_sum16(e)[:, None]


def log_softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """log_softmax of each row of x [M, n] (fp32, n >= 1) on every backend: [M, n]."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] >= 1
    m = x.amax(-1, keepdim=True)
    bad = ~torch.isfinite(m) | x.isnan().any(-1, keepdim=True)
    m = torch.where(bad, torch.zeros_like(m), m)
    d = x - m
    terms = bik_exp_torch(d)
    lse = bik_log_torch(vocab_sum_torch(terms, *sampler_chunks(x.shape[1]))[:, None])
    return torch.where(bad, torch.full_like(x, float("nan")), d - lse)


def mean_cpu_reference(x: torch.Tensor) -> torch.Tensor:
    """mean of each row of x [M, n] (fp32, n >= 1): [M]."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] >= 1
    return lane_sum16(x) / torch.tensor(float(x.shape[1]), dtype=torch.float32)

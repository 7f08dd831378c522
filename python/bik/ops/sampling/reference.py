"""The sampler's contract (docs/design.md#sampler) written literally in torch (imported by tests
only).

:func:`noise` is the Gumbel noise of every token of a row: for token id t at position p of a
request with seed s, ``bits`` = word 0 of Philox4x32-10 with counter (t, p mod 2^32, p >> 32,
STREAM_SAMPLE) and key (s mod 2^32, s >> 32); ``u = (2 * (bits >> 9) + 1) * 2^-24``;
``g = 0 - bik_log(0 - bik_log(u))``. Philox and the Gumbel map are the CPU backend's elementwise
building blocks (bik/ops/sampling/cpu.py), which the tests hold to Random123's known answers,
to fp64 and to the Triton kernels' bits. :func:`gumbel_max` is the pick at temperature 1 with
no filter and no skipped noise: argmax of x + g, ties to the lowest index.

:func:`filtered_probs` is the distribution a row is drawn from, in fp64: the logits divided by
the temperature, then top-k, then top-p (tokens tied with the boundary kept), then min-p.
"""

from __future__ import annotations

import math

import torch

from bik.ops.sampling.cpu import gumbel_from_unit, philox4x32_10
from bik.ops.sampling.noise import STREAM_SAMPLE

__all__ = ["filtered_probs", "gumbel_max", "noise"]


def noise(seed: int, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [B, vocab]: the noise g of every token id for one seed and positions [B] (int64)."""
    rows = position.shape[0]
    tok = torch.arange(vocab).repeat(rows)
    p = position.repeat_interleave(vocab)
    counter = torch.stack([tok, p & 0xFFFFFFFF, p >> 32, torch.full_like(p, STREAM_SAMPLE)], 1)
    key = torch.tensor([[seed & 0xFFFFFFFF, seed >> 32]]).expand(rows * vocab, 2)
    words = philox4x32_10(counter, key)[:, 0]
    u = ((words >> 9) * 2 + 1).float() * 2.0**-24
    return gumbel_from_unit(u).reshape(rows, vocab)


def gumbel_max(logits: torch.Tensor, seed: int, position: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the token of each fp32 row of logits [B, V] at temperature 1, no filter."""
    return (logits + noise(seed, position, logits.shape[1])).argmax(1)


def filtered_probs(logits: torch.Tensor, t: float, top_k: int, top_p: float,
                   min_p: float) -> torch.Tensor:
    """fp64 [V]: the tempered, filtered distribution of one row of logits [V] (T > 0)."""
    z = logits.double() / t
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < len(z):
        keep &= torch.zeros_like(keep).scatter(0, torch.argsort(-z, stable=True)[:top_k], True)
    p = torch.softmax(z.masked_fill(~keep, -math.inf), 0)
    if top_p < 1:
        order = torch.argsort(-p, stable=True)
        cut = int((torch.cumsum(p[order], 0) >= top_p).nonzero()[0, 0])
        keep &= p >= p[order[cut]]
    p = torch.softmax(z.masked_fill(~keep, -math.inf), 0)
    keep &= p >= min_p * p.max()
    return torch.softmax(z.masked_fill(~keep, -math.inf), 0)

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

:func:`vocab_sum` is the normaliser's summation order, transcribed from the contract: groups,
chunks from each group's start (zero-padded), each folded pairwise by halves, chunk sums
ascending within a group, group totals ascending. :func:`logprob` is a kept token's logprob from it, with
``bik_exp`` and ``bik_log`` as torch ops.
"""

from __future__ import annotations

import math

import torch

from bik.ops.sampling.cpu import gumbel_from_unit, philox4x32_10
from bik.ops._normaliser import bik_exp_torch, bik_log_torch
from bik.ops.sampling.noise import STREAM_SAMPLE


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


def vocab_sum(terms: torch.Tensor, groups: int, chunk: int) -> torch.Tensor:
    """fp32 [B]: the sum of fp32 terms [B, V] per row in the normaliser's order."""
    rows, v = terms.shape
    group_len = v // groups
    total = torch.zeros(rows, dtype=torch.float32)
    for g in range(groups):
        g_end = (g + 1) * group_len
        group_total = torch.zeros(rows, dtype=torch.float32)
        for c0 in range(g * group_len, g_end, chunk):
            s = torch.zeros(rows, chunk, dtype=torch.float32)
            n = min(c0 + chunk, g_end) - c0
            s[:, :n] = terms[:, c0:c0 + n]
            w = chunk // 2
            while w >= 1:
                s[:, :w] = s[:, :w] + s[:, w:2 * w]
                w //= 2
            group_total = group_total + s[:, 0]
        total = total + group_total
    return total


def top_p_cut(z: torch.Tensor, top_p: float, groups: int, chunk: int) -> torch.Tensor:
    """fp32 [B]: top-p's v_p for tempered logits z [B, V] (top-k off): the largest value of the
    row whose mass, vocab_sum(bik_exp(z - m) over z >= v), reaches top_p * S. Found by bisection
    over the row's distinct values, descending (the mass is monotone in v)."""
    terms = bik_exp_torch(z - z.amax(1, keepdim=True))
    target = top_p * vocab_sum(terms, groups, chunk)
    cut = torch.empty(z.shape[0], dtype=torch.float32)
    for r in range(z.shape[0]):
        values = torch.unique(z[r]).flip(0)

        def reaches(i: int, r=r, values=values) -> bool:
            sel = torch.where(z[r:r + 1] >= values[i], terms[r:r + 1], 0.0)
            return bool(vocab_sum(sel, groups, chunk)[0] >= target[r])

        lo, hi = 0, len(values) - 1  # the first index that reaches the target
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if reaches(mid) else (mid + 1, hi)
        cut[r] = values[lo]
    return cut


def logprob(z: torch.Tensor, kept: torch.Tensor, token: torch.Tensor, groups: int,
            chunk: int) -> torch.Tensor:
    """fp32 [B]: (z_c - m) - bik_log(vocab_sum(bik_exp(z - m) over the kept tokens)) for tempered
    logits z [B, V], the final keep mask [B, V] and the chosen tokens [B]; m is the max of z over
    the kept tokens (the max is always kept)."""
    m = torch.where(kept, z, float("-inf")).amax(1, keepdim=True)
    terms = torch.where(kept, bik_exp_torch(z - m), torch.zeros_like(z))
    z_c = z.gather(1, token[:, None])
    return ((z_c - m) - bik_log_torch(vocab_sum(terms, groups, chunk)[:, None]))[:, 0]

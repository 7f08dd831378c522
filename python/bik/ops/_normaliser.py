"""The one normaliser of bik's logprobs, in torch: ``bik_exp``, ``bik_log`` and the order of
``vocab_sum``, shared by the sampler (ops/sampling: top-p's masses, the chosen token's
logprob) and log_softmax (ops/reductions), so that a token's log_softmax entry is the logprob
the sampler reports for it, bit for bit. An op slice may not import another slice, so the
shared pieces live here, below both (docs/design.md#the-normaliser; csrc/cpu/normaliser.h is
the C++ and ops/_normaliser_triton.py the Triton side). Each op is one rounded fp32 op over a
whole tensor (eager torch, no fusion), so every device gives the kernels' bits.
"""

from __future__ import annotations

import torch

__all__ = ["bik_exp_torch", "bik_log_torch", "group_totals_torch", "vocab_sum_torch"]

_LOG_COEFFS = (-0.07866687327623367, 0.12821781635284424, -0.13101640343666077,
               0.14188995957374573, -0.1662759929895401, 0.2000196874141693,
               -0.2500077188014984, 0.33333322405815125, -0.4999999701976776)


def bik_log_torch(x: torch.Tensor) -> torch.Tensor:
    """bik_log (csrc/cpu/sampling.h) with torch's elementwise ops, bit for bit, on any device:
    for fp32 positive normal x. Each op is a separate rounded fp32 op (eager torch, no fusion)."""
    b = x.contiguous().view(torch.int32)
    e = (b >> 23) - 127
    mb = (b & 0x007FFFFF) | 0x3F800000
    big = mb > 0x3FB504F3
    mb = torch.where(big, mb - 0x00800000, mb)
    e = torch.where(big, e + 1, e)
    f = mb.view(torch.float32) - 1.0
    q = f * _LOG_COEFFS[0] + _LOG_COEFFS[1]
    for c in _LOG_COEFFS[2:]:
        q = q * f + c
    p = q * f + 1.0
    lg = f * p
    ef = e.to(torch.float32)
    return ef * 0.693145751953125 + (ef * 1.428606765330187e-06 + lg)


# bik_exp (csrc/cpu/sampling.h): log2(e), Cody-Waite ln 2 = C1 + C2, Cephes expf's E5 .. E0; each
# the double equal to the fp32 constant. EXP_LOG2E is therefore not ops/_pointwise.py's LOG2E
# (the double nearest log2(e), for products formed in fp64) but that value rounded to fp32:
# bik_exp multiplies in fp32 on every backend, and a constant that is exactly an fp32 gives
# the same product whether a backend reads it as a float or as a double.
EXP_LOG2E = 1.4426950216293335
EXP_C1, EXP_C2 = 0.693359375, -0.00021219444170128554
EXP_COEFFS = (0.00019875691214110702, 0.001398199936375022, 0.008333452045917511,
              0.04166579619050026, 0.1666666567325592, 0.5)
EXP_MIN = -86.0  # below: 0 (and -inf: 0)


def bik_exp_torch(x: torch.Tensor) -> torch.Tensor:
    """bik_exp (csrc/cpu/sampling.h) with torch's elementwise ops, bit for bit, on any device,
    for fp32 x <= 0 (the sampler's exp(z - m)). Each op a separately rounded fp32 op."""
    live = x >= EXP_MIN
    xs = torch.where(live, x, torch.zeros_like(x))
    k = torch.floor(xs * EXP_LOG2E + 0.5)
    r = (xs - k * EXP_C1) - k * EXP_C2
    q = r * EXP_COEFFS[0] + EXP_COEFFS[1]
    for c in EXP_COEFFS[2:]:
        q = q * r + c
    p = (q * (r * r) + r) + 1.0
    scale = ((k.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(live, p * scale, torch.zeros_like(x))


def group_totals_torch(terms: torch.Tensor, group_len: int, chunk: int) -> torch.Tensor:
    """fp32 [B, n]: the normaliser's total of each group of ``group_len`` consecutive terms in
    fp32 terms [B, n * group_len] (terms >= +0), in the contract's order: chunks of ``chunk``
    (a power of two) from the group's start, zero-padded, each folded pairwise by halves
    (s[t] = s[t] + s[t + w], w = chunk/2 .. 1), the chunk sums added in ascending order from +0.
    Every step is one rounded fp32 add over a whole tensor, so any device gives the bits of the
    kernels' vocab_sum for those groups."""
    rows, width = terms.shape
    groups = width // group_len
    chunks = -(-group_len // chunk)
    s = terms.reshape(rows, groups, group_len)
    if chunks * chunk != group_len:  # the ragged last chunk's missing terms are +0
        s = torch.nn.functional.pad(s, (0, chunks * chunk - group_len))
    s = s.reshape(rows, groups, chunks, chunk)
    w = chunk // 2
    while w >= 1:
        s = s[..., :w] + s[..., w:2 * w]
        w //= 2
    total = torch.zeros(rows, groups, dtype=torch.float32, device=terms.device)
    for c in range(chunks):
        total = total + s[..., c, 0]
    return total


def vocab_sum_torch(terms: torch.Tensor, groups: int, chunk: int) -> torch.Tensor:
    """fp32 [B]: the normaliser of fp32 terms [B, V] (>= +0) per row: the ``groups`` totals
    (:func:`group_totals_torch`) added in ascending order from +0."""
    totals = group_totals_torch(terms, terms.shape[1] // groups, chunk)
    total = torch.zeros(terms.shape[0], dtype=torch.float32, device=terms.device)
    for g in range(groups):
        total = total + totals[:, g]
    return total

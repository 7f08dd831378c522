"""The sampler contract's pieces every backend shares, written with torch's elementwise ops.

``greedy_limit`` makes a row greedy below a temperature, ``log_min_p`` turns min-p into the
threshold every backend applies; ``STREAM_SAMPLE`` is the Philox counter word that separates
this draw from future ones; ``gumbel_torch`` is the noise of given token ids, which a
vocab-parallel rank computes on its shard (bik.distributed.vocab_parallel_sample), on any
device, with the kernels' bits. The
normaliser's pieces (``bik_exp``, ``bik_log``, the group totals) are shared with log_softmax
and live in ops/_normaliser.py.
"""

from __future__ import annotations

import torch

from bik.configs import SAMPLER_GREEDY_BELOW
from bik.ops._normaliser import bik_log_torch

STREAM_SAMPLE = 0  # Philox counter word 3; other values are reserved for future draws


def seed_int64(seed: int, label: str = "bik.sample") -> int:
    """A seed in [0, 2**64) as the int64 of the same bits, which the kernels read: the noise
    key is the seed's two 32-bit halves, so every 64-bit seed (``random.getrandbits(64)``,
    ``torch.Generator.initial_seed()``) is its own key. ValueError (naming ``label``) outside
    [0, 2**64)."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"{label}: seed must be in [0, 2**64), got {seed}")
    return seed - 2**64 if seed >= 2**63 else seed
FLT_MIN = 1.1754943508222875e-38
# The noise's exact extremes over all 2^23 u (csrc/cpu/sampling.h kGumbelMin / kGumbelMax).
GUMBEL_MIN, GUMBEL_MAX = -2.8115408420562744, 16.63553237915039

def greedy_limit(temperature: torch.Tensor) -> torch.Tensor:
    """The contract's greedy limit: a temperature below SAMPLER_GREEDY_BELOW becomes 0, for every
    backend (a device op: nothing read back; the Triton kernels apply it as they load)."""
    return torch.where(temperature < SAMPLER_GREEDY_BELOW, 0.0, temperature)


def log_min_p(min_p: torch.Tensor) -> torch.Tensor:
    """bik_log(min_p) (identical on every backend); -inf where min_p == 0 (off). min_p below the
    smallest normal fp32 is raised to it."""
    lg = bik_log_torch(min_p.clamp(min=FLT_MIN))
    return torch.where(min_p > 0, lg, torch.full_like(lg, float("-inf")))


# Philox4x32-10 (Random123's round): multipliers and key bumps.
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


def _mul_hi_lo(m: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product m * c (m, c < 2^32) in int64 arithmetic that
    never overflows: c is split into 16-bit halves, each partial product < 2^48."""
    a = m * (c & 0xFFFF)
    b = m * (c >> 16)
    lo = (((b & 0xFFFF) << 16) + a) & _U32
    hi = (b + (a >> 16)) >> 16
    return hi, lo


def philox4x32_10_torch(c0, c1, c2, c3, k0, k1) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10's four output words for counters (c0..c3) and keys (k0, k1): int64 tensors
    (or ints) holding uint32 values, broadcast together; the words likewise. Any device."""
    for r in range(10):
        if r:
            k0, k1 = (k0 + _PHILOX_W0) & _U32, (k1 + _PHILOX_W1) & _U32
        hi0, lo0 = _mul_hi_lo(_PHILOX_M0, c0)
        hi1, lo1 = _mul_hi_lo(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def gumbel_torch(seed: torch.Tensor, position: torch.Tensor, token: torch.Tensor,
                 stream: int = STREAM_SAMPLE) -> torch.Tensor:
    """fp32 noise g of the contract for int64 tensors seed, position (a 64-bit value each, as
    the kernels read them) and token ids, broadcast together: Philox word 0 of counter (token,
    position lo, position hi, stream) and key (seed lo, seed hi), u = (2 (bits >> 9) + 1) 2^-24,
    g = 0 - bik_log(0 - bik_log(u)). The bits of every backend's noise."""
    word = philox4x32_10_torch(token, position & _U32, (position >> 32) & _U32,
                               torch.full_like(token, stream), seed & _U32,
                               (seed >> 32) & _U32)[0]
    u = ((word >> 9) * 2 + 1).to(torch.float32) * 2.0**-24  # exact: a 24-bit odd integer
    return 0.0 - bik_log_torch(0.0 - bik_log_torch(u))

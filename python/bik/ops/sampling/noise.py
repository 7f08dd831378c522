"""The sampler contract's pieces every backend shares, written with torch's elementwise ops.

``bik_log`` is the logarithm of the noise and of the logprob's normaliser, ``bik_exp`` the
exponential of the normaliser's terms (csrc/cpu/sampling.h), here bit for bit on any device;
``log_min_p`` turns min-p into the threshold every backend applies; ``STREAM_SAMPLE`` is the
Philox counter word that separates this draw from future ones. ``gumbel_torch`` (the noise of
given token ids) and ``group_totals_torch`` (the normaliser's per-group sums) are what a
vocab-parallel rank computes on its shard (bik.distributed.vocab_parallel_sample), on any
device, with the kernels' bits.
"""

from __future__ import annotations

import torch

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

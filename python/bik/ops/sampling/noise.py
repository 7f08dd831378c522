"""The sampler contract's pieces every backend shares, written with torch's elementwise ops.

``bik_log`` is the logarithm of the noise and of the logprob's normaliser, ``bik_exp`` the
exponential of the normaliser's terms (csrc/cpu/sampling.h), here bit for bit on any device;
``log_min_p`` turns min-p into the threshold every backend applies; ``STREAM_SAMPLE`` is the
Philox counter word that separates this draw from future ones.
"""

from __future__ import annotations

import torch

__all__ = ["FLT_MIN", "STREAM_SAMPLE", "bik_exp_torch", "bik_log_torch", "log_min_p"]

STREAM_SAMPLE = 0  # Philox counter word 3; other values are reserved for future draws
FLT_MIN = 1.1754943508222875e-38

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
# the double equal to the fp32 constant.
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

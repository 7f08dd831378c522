"""The one normaliser's Triton building blocks: bik_exp, bik_log and the fold of its sum.

bik::sample's logprobs (and top-p's masses) and bik::log_softmax divide by the same normaliser
(docs/design.md#sampler, "The normaliser"): S = the sum of bik_exp(x - m) over the row in the
order ``bik.configs.sampler_chunks`` writes down, then bik_log(S). A token's log_softmax is
its sampled logprob bit for bit only because both kernels run these very functions. An op's
slice never imports another slice (tests/test_house_rules.py), so the code the sampler and the
softmaxes share lives below both, here in ops/ (its torch twin: ops/_normaliser.py).

Only exactly rounded fp32 operations, in one written order: every kernel that calls them is
compiled with ``NO_FUSION``, so no multiply and add contract into an fma (the CPU's
``-ffp-contract=off``), and the fold is explicit reshapes, not a ``tl.sum`` tree whose shape the
compiler picks.
"""

from __future__ import annotations

import triton
import triton.language as tl

NO_FUSION = {"enable_fp_fusion": False}


@triton.jit
def bik_log(x):
    """Natural log of positive normal fp32 values from exactly rounded ops
    (csrc/cpu/normaliser.h)."""
    b = x.to(tl.uint32, bitcast=True)
    e = (b >> 23).to(tl.int32) - 127
    mb = (b & 0x007FFFFF) | 0x3F800000
    big = mb > 0x3FB504F3
    mb = tl.where(big, mb - 0x00800000, mb)
    e = tl.where(big, e + 1, e)
    f = mb.to(tl.float32, bitcast=True) - 1.0
    q = f * -0.07866687327623367 + 0.12821781635284424
    q = q * f + -0.13101640343666077
    q = q * f + 0.14188995957374573
    q = q * f + -0.1662759929895401
    q = q * f + 0.2000196874141693
    q = q * f + -0.2500077188014984
    q = q * f + 0.33333322405815125
    q = q * f + -0.4999999701976776
    p = q * f + 1.0
    l = f * p
    ef = e.to(tl.float32)
    return ef * 0.693145751953125 + (ef * 1.428606765330187e-06 + l)


@triton.jit
def bik_exp(x):
    """exp of fp32 x <= 0 from exactly rounded ops (csrc/cpu/normaliser.h): 0 below -86."""
    live = x >= -86.0
    xs = tl.where(live, x, 0.0)
    k = tl.floor(xs * 1.4426950216293335 + 0.5)
    r = (xs - k * 0.693359375) - k * -0.00021219444170128554
    q = r * 0.00019875691214110702 + 0.001398199936375022
    q = q * r + 0.008333452045917511
    q = q * r + 0.04166579619050026
    q = q * r + 0.1666666567325592
    q = q * r + 0.5
    p = (q * (r * r) + r) + 1.0
    scale = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(live, p * scale, 0.0)


@triton.jit
def _halves(s, NCH: tl.constexpr, W: tl.constexpr):
    """[NCH, 2W] -> [NCH, W]: s[t] + s[t + W], one step of the chunk's fold, written out (a sum
    of two values is one rounded add, whatever the order)."""
    return tl.sum(tl.reshape(s, (NCH, 2, W)), axis=1)


@triton.jit
def chunk_sums(s, NCH: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr):
    """[NCH, CHUNK] terms -> [NCH] chunk sums, each chunk folded pairwise by halves."""
    for k in tl.static_range(LOG2_CHUNK):
        s = _halves(s, NCH, CHUNK >> (k + 1))
    return tl.reshape(s, (NCH,))


@triton.jit
def add_chunk_sums(group_total, sums, NCH: tl.constexpr):
    """group_total + sums[0] + ... + sums[NCH - 1]: the [NCH] chunk sums of one tile enter the
    running group total one rounded add at a time, in ascending chunk order (the contract's
    fold; a tl.sum of one non-negative value among zeros is that value, exactly)."""
    slots = tl.arange(0, NCH)
    for c in tl.static_range(NCH):
        group_total = group_total + tl.sum(tl.where(slots == c, sums, 0.0), axis=0)
    return group_total

"""Triton Gumbel-max sampler: tokens and logprobs bit-identical to the CPU path.

Row-local launches, each over every row (rows of the other kind return at once):

* rows without top-p: the normaliser's G vocabulary groups side by side, G programs per row
  (triton_groups.py: each group's max and flag, then each group's mass; m, the min-p threshold
  and the flag from the group-0 program; the group totals folded ascending in torch);
* rows with top-p (triton_top_p.py, one launch per pass, G programs per row): from the same
  group maxima, the top-p cut found in a few passes that each probe several thresholds at once
  (not 32 bisection passes), the min-p threshold m + log_min_p and bik_log of the kept mass
  for the logprob.
  Every mass is bik_exp(z - m) summed in the normaliser's written order (chunks of the
  vocabulary, each folded by halves through explicit reshapes (``chunk_sums``), chunk sums and
  group totals ascending), never a ``tl.sum`` tree of the compiler's choosing. Exactly rounded
  ops only, compiled with ``enable_fp_fusion=False``: the CPU's bits.
* ``gumbel_pick_kernel`` (grid rows x vocabulary splits of SPLIT tokens): z = div_rn(x, T), the
  keep mask from exact thresholds, score = z + g with g from Philox4x32-10 and bik_log, and the
  split's winner under (value desc, index asc). No exp, no approximate op, no division other
  than div_rn, compiled with ``enable_fp_fusion=False``: tests grep both kernels' sm_90 PTX.
* the partial winners are merged in torch (max value, then lowest index): the order is total,
  so any split and any merge order give the same token.

The noise layout, bik_log, bik_exp and the normaliser's order are specified in
csrc/cpu/sampling.h and docs/design.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bik._arch import device_arch
from bik.configs import sampler_chunks, sampling_config
from bik.ops.sampling.split_vocab import sample_split_vocab

__all__ = ["bik_exp", "bik_log", "chunk_sums", "gumbel_pick_kernel", "launch_sample",
           "max_and_flag", "noise_parts_kernel", "philox4x32_10", "sample_rows", "unit_gumbel"]

INT32_MAX = tl.constexpr(2**31 - 1)
# The noise's exact extremes over all 2^23 u (fp32): a token with fl(z + G_MAX) < fl(m + G_MIN)
# scores below the max token whatever the noise, so its noise need not be computed.
G_MIN = tl.constexpr(-2.8115408420562744)
G_MAX = tl.constexpr(16.63553237915039)
NO_FUSION = {"enable_fp_fusion": False}


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 (Random123's round) on uint32 tensors; returns the four output words."""
    for _ in tl.static_range(10):
        _c0, _c2 = c0, c2
        c0 = tl.math.umulhi(0xCD9E8D57, _c2) ^ c1 ^ k0
        c2 = tl.math.umulhi(0xD2511F53, _c0) ^ c3 ^ k1
        c1 = tl.mul(0xCD9E8D57, _c2, sanitize_overflow=False)
        c3 = tl.mul(0xD2511F53, _c0, sanitize_overflow=False)
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def bik_log(x):
    """Natural log of positive normal fp32 values from exactly rounded ops (see sampling.h)."""
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
    """exp of fp32 x <= 0 from exactly rounded ops (see sampling.h): 0 below -86."""
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
def unit_gumbel(bits):
    """u = (2 * (bits >> 9) + 1) * 2^-24 (exact), then 0 - bik_log(0 - bik_log(u))."""
    u = (((bits >> 9) << 1) | 1).to(tl.float32) * 5.960464477539063e-08
    return 0.0 - bik_log(0.0 - bik_log(u))


@triton.jit
def noise_parts_kernel(in_ptr, out_ptr, n, FN: tl.constexpr, BLOCK: tl.constexpr):
    """Test access to the building blocks: FN 0 = philox (in uint32 [n, 6] -> out [n, 4]),
    1 = bik_log (fp32 -> fp32), 2 = Gumbel of u (fp32 -> fp32), 3 = bik_exp (fp32 -> fp32)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if FN == 0:
        w = []
        for j in tl.static_range(6):
            w.append(tl.load(in_ptr + offs * 6 + j, mask=mask, other=0).to(tl.uint32, bitcast=True))
        w0, w1, w2, w3 = philox4x32_10(w[0], w[1], w[2], w[3], w[4], w[5])
        tl.store(out_ptr + offs * 4, w0.to(tl.int32, bitcast=True), mask=mask)
        tl.store(out_ptr + offs * 4 + 1, w1.to(tl.int32, bitcast=True), mask=mask)
        tl.store(out_ptr + offs * 4 + 2, w2.to(tl.int32, bitcast=True), mask=mask)
        tl.store(out_ptr + offs * 4 + 3, w3.to(tl.int32, bitcast=True), mask=mask)
    else:
        x = tl.load(in_ptr + offs, mask=mask, other=0.5)
        if FN == 1:
            y = bik_log(x)
        elif FN == 2:
            y = 0.0 - bik_log(0.0 - bik_log(x))
        else:
            y = bik_exp(x)
        tl.store(out_ptr + offs, y, mask=mask)


@triton.jit
def _key(v):
    """fp32 order key as int64: key(a) < key(b) iff a < b, for non-NaN values."""
    b = v.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _from_key(k):
    b = k.to(tl.int32)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _tempered(x_row, offs, mask, temp):
    x = tl.load(x_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
    t_safe = tl.where(temp > 0.0, temp, 1.0)
    return tl.where(temp > 0.0, tl.math.div_rn(x, t_safe), x)


@triton.jit
def _kept_k(z, offs, vk, ik):
    return (z > vk) | ((z == vk) & (offs <= ik))


@triton.jit
def max_and_flag(x_row, start, end, temp, vk, ik, BLOCK: tl.constexpr):
    """Over tokens [start, end): the max z of the top-k-kept tokens (exact in any order) and
    whether any z is NaN or +inf (int32 0/1)."""
    cols = tl.arange(0, BLOCK)
    mx = tl.full((BLOCK,), float("-inf"), tl.float32)
    bad = tl.zeros((BLOCK,), tl.int32)
    for c0 in range(start, end, BLOCK):
        offs = c0 + cols
        mask = offs < end
        z = _tempered(x_row, offs, mask, temp)
        bad = bad | ((z != z) | (z == float("inf"))).to(tl.int32)  # noqa: PLR0124 (NaN)
        mx = tl.maximum(mx, tl.where(mask & _kept_k(z, offs, vk, ik), z, float("-inf")))
    return tl.max(mx, axis=0), tl.max(bad, axis=0)


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
def _vocab_mass(x_row, V, GROUP_LEN, temp, vk, ik, threshold, m_safe, CHUNK: tl.constexpr,
                LOG2_CHUNK: tl.constexpr, NCH: tl.constexpr, RAW: tl.constexpr):
    """The normaliser's sum (csrc/cpu/sampling.h vocab_sum) of bik_exp(z - m) over the tokens
    kept by top-k with z >= threshold; RAW: of the fp32 terms at x_row themselves (tests).
    NCH chunks at a time as an [NCH, CHUNK] tile (the missing tokens of a ragged chunk: +0),
    each folded pairwise by halves (explicit reshapes, not a tl.sum tree); chunk sums enter the
    group total one by one in ascending order (a tl.sum of one value among zeros is that value,
    exactly), group totals likewise."""
    total = tl.full((), 0.0, tl.float32)
    for g0 in range(0, V, GROUP_LEN):
        total = total + group_mass(x_row, g0, g0 + GROUP_LEN, temp, vk, ik, threshold, m_safe,
                                   CHUNK, LOG2_CHUNK, NCH, RAW)
    return total


@triton.jit
def group_mass(x_row, g0, g_end, temp, vk, ik, threshold, m_safe, CHUNK: tl.constexpr,
               LOG2_CHUNK: tl.constexpr, NCH: tl.constexpr, RAW: tl.constexpr):
    """One group's total of _vocab_mass's terms over tokens [g0, g_end): its chunks from g0,
    each folded by halves, the chunk sums added in ascending order from +0."""
    cols = tl.arange(0, CHUNK)[None, :]
    slots = tl.arange(0, NCH)
    group_total = tl.full((), 0.0, tl.float32)
    for c0 in range(g0, g_end, CHUNK * NCH):
        offs = c0 + slots[:, None] * CHUNK + cols
        mask = offs < g_end
        if RAW:
            s = tl.load(x_row + offs, mask=mask, other=0.0)
        else:
            z = _tempered(x_row, offs, mask, temp)
            keep = mask & _kept_k(z, offs, vk, ik) & (z >= threshold)
            s = tl.where(keep, bik_exp(z - m_safe), 0.0)
        sums = chunk_sums(s, NCH, CHUNK, LOG2_CHUNK)
        for c in tl.static_range(NCH):
            group_total = group_total + tl.sum(tl.where(slots == c, sums, 0.0), axis=0)
    return group_total


@triton.jit
def vocab_sum_kernel(t_ptr, V, GROUP_LEN, out_ptr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
                     NCH: tl.constexpr):
    """Test access to the normaliser's order: out[row] = vocab_sum of the fp32 terms [B, V]."""
    row = tl.program_id(0).to(tl.int64)
    total = _vocab_mass(t_ptr + row * V, V, GROUP_LEN, 1.0, 0.0, 0, 0.0, 0.0, CHUNK, LOG2_CHUNK,
                        NCH, True)
    tl.store(out_ptr + row, total)


@triton.jit
def gumbel_pick_kernel(x_ptr, stride_x, V, key_ptr, temp_ptr, vk_ptr, ik_ptr, vlo_ptr, m_ptr,
                       part_val_ptr, part_idx_ptr, n_splits,
                       SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    x_row = x_ptr + row * stride_x
    temp = tl.load(temp_ptr + row)
    vk = tl.load(vk_ptr + row)
    ik = tl.load(ik_ptr + row)
    v_lo = tl.load(vlo_ptr + row)
    floor = tl.load(m_ptr + row) + G_MIN  # the max token's lowest possible score
    # Philox key (seed lo, hi) and counter words 1..3 (position lo, hi, stream), uint32.
    k0 = tl.load(key_ptr + row * 5).to(tl.uint32)
    k1 = tl.load(key_ptr + row * 5 + 1).to(tl.uint32)
    p_lo = tl.load(key_ptr + row * 5 + 2).to(tl.uint32)
    p_hi = tl.load(key_ptr + row * 5 + 3).to(tl.uint32)
    stream = tl.load(key_ptr + row * 5 + 4).to(tl.uint32)
    cols = tl.arange(0, BLOCK)
    best_v = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_i = tl.full((BLOCK,), INT32_MAX, tl.int32)
    for c0 in range(0, SPLIT, BLOCK):
        offs = split * SPLIT + c0 + cols
        mask = offs < V
        z = _tempered(x_row, offs, mask, temp)
        keep = mask & _kept_k(z, offs, vk, ik) & (z >= v_lo) & (z > float("-inf"))
        s = z
        # Skip the noise of a chunk none of whose tokens can reach the max token's floor (an
        # exact bound, so the token is the same as with the noise: docs/design.md#sampler).
        contender = keep & (z + G_MAX >= floor)
        if (temp > 0.0) & (tl.max(contender.to(tl.int32), axis=0) > 0):
            zero = tl.zeros((BLOCK,), tl.uint32)
            bits, _, _, _ = philox4x32_10(offs.to(tl.uint32), zero + p_lo, zero + p_hi,
                                          zero + stream, zero + k0, zero + k1)
            s = z + unit_gumbel(bits)
        s = tl.where(contender, s, float("-inf"))
        better = s > best_v  # chunks ascend, so ties keep the lower index per lane
        best_v = tl.where(better, s, best_v)
        best_i = tl.where(better, offs, best_i)
    top = tl.max(best_v, axis=0)
    idx = tl.min(tl.where(best_v == top, best_i, INT32_MAX), axis=0)
    tl.store(part_val_ptr + row * n_splits + split, top)
    tl.store(part_idx_ptr + row * n_splits + split, idx)


def _chunks_per_tile(arch: str, chunk: int) -> int:
    """Chunks folded side by side per step of the stats kernel: the config's block of tokens
    (at least one chunk). The order of the sums does not depend on it."""
    return max(1, sampling_config(arch).block // chunk)


def launch_sample(logits: torch.Tensor, key: torch.Tensor, temperature: torch.Tensor,
                  vk: torch.Tensor, ik: torch.Tensor, top_p: torch.Tensor,
                  log_min_p: torch.Tensor):
    """Run the statistics kernels and the pick. logits [B, V] with unit stride along V; key
    int64 [B, 5] (seed lo, seed hi, position lo, position hi, stream; each in [0, 2^32)); per-row fp32
    temperature, top-k threshold (vk fp32, ik int32), top_p, log_min_p. Returns (m, log_s, bad,
    part_val, part_idx) for the ops layer to merge."""
    b, v = logits.shape
    cfg = sampling_config(device_arch(logits.device))
    dev = logits.device
    m = torch.empty(b, dtype=torch.float32, device=dev)
    v_lo = torch.empty(b, dtype=torch.float32, device=dev)
    log_s = torch.empty(b, dtype=torch.float32, device=dev)
    bad = torch.empty(b, dtype=torch.int32, device=dev)
    n_splits = triton.cdiv(v, cfg.split)
    part_val = torch.empty(b, n_splits, dtype=torch.float32, device=dev)
    part_idx = torch.empty(b, n_splits, dtype=torch.int32, device=dev)
    if b == 0:
        return m, log_s, bad, part_val, part_idx
    from bik.ops.sampling.triton_groups import (  # they build on this module's helpers
        finish_plain_rows,
        launch_group_mass,
        launch_group_max,
    )
    from bik.ops.sampling.triton_top_p import launch_top_p_stats

    stride = logits.stride(0)
    groups, chunk = sampler_chunks(v)
    nch = _chunks_per_tile(device_arch(logits.device), chunk)
    shape = {"groups": groups, "num_warps": cfg.num_warps, "options": NO_FUSION}
    gmax, gbad = launch_group_max(logits, temperature, vk, ik, block=cfg.block, **shape)
    gtot = launch_group_mass(logits, temperature, vk, ik, top_p, log_min_p, gmax, gbad, m,
                             v_lo, bad, chunk=chunk, nch=nch, **shape)
    launch_top_p_stats(logits, temperature, vk, ik, top_p, log_min_p, gmax, gbad, m, v_lo,
                       log_s, bad, chunk=chunk, nch=nch, **shape)
    gumbel_pick_kernel[(b, n_splits)](logits, stride, v, key, temperature, vk, ik, v_lo, m,
                                      part_val, part_idx, n_splits, SPLIT=cfg.split,
                                      BLOCK=cfg.block, num_warps=cfg.num_warps, **NO_FUSION)
    return m, finish_plain_rows(gtot, bad, top_p, log_s), bad, part_val, part_idx


def run_noise_part(fn: str, x: torch.Tensor, n: int) -> torch.Tensor:
    """Test helper: philox (x uint32-as-int64 [n, 6]), log, gumbel or exp (x fp32 [n])."""
    code = {"philox": 0, "log": 1, "gumbel": 2, "exp": 3}[fn]
    block = 1024 if code == 0 else 65536  # big blocks: the interpreter pays per program
    if code == 0:
        inp = x.to(torch.int64).to(torch.int32).contiguous()  # low 32 bits, two's complement
        out = torch.empty(n, 4, dtype=torch.int32, device=x.device)
    else:
        inp = x.contiguous()
        out = torch.empty_like(inp)
    noise_parts_kernel[(triton.cdiv(n, block),)](inp, out, n, FN=code, BLOCK=block, **NO_FUSION)
    if code == 0:
        return out.to(torch.int64) & 0xFFFFFFFF
    return out


def vocab_sum(terms: torch.Tensor) -> torch.Tensor:
    """Test helper: fp32 [B], the normaliser's sum of fp32 terms [B, V] per row."""
    b, v = terms.shape
    groups, chunk = sampler_chunks(v)
    out = torch.empty(b, dtype=torch.float32, device=terms.device)
    nch = _chunks_per_tile(device_arch(terms.device), chunk)
    vocab_sum_kernel[(b,)](terms.contiguous(), v, v // groups, out, CHUNK=chunk,
                           LOG2_CHUNK=chunk.bit_length() - 1, NCH=nch, **NO_FUSION)
    return out


def sample_rows(x, seed, position, temperature, top_k, top_p, log_min_p,
                max_top_k=None):
    """The op's entry point on this backend (see bik/ops/sampling/op.py)."""
    return sample_split_vocab(launch_sample, x, seed, position, temperature, top_k, top_p,
                              log_min_p, max_top_k)

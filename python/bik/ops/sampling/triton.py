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
csrc/cpu/sampling.h and docs/design.md. The building blocks the three kernel modules share
(the tempered load, top-k's keep test, one group's mass) live in triton_common.py, which
imports none of them: this module imports the two statistics modules, and they import only
triton_common.py. bik_log, bik_exp and the normaliser's fold are shared with bik::log_softmax,
so they live below both slices, in ops/_normaliser_triton.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bik._arch import device_arch
from bik.configs import sampler_chunks, sampling_config
from bik.ops._normaliser_triton import NO_FUSION, bik_log
from bik.ops.sampling.split_vocab import sample_split_vocab
from bik.ops.sampling.triton_common import _chunks_per_tile, _kept_k, _tempered
from bik.ops.sampling.triton_groups import finish_plain_rows, launch_group_mass, launch_group_max
from bik.ops.sampling.triton_top_p import launch_top_p_stats

INT32_MAX = tl.constexpr(2**31 - 1)
# The noise's exact extremes over all 2^23 u (fp32): a token with fl(z + G_MAX) < fl(m + G_MIN)
# scores below the max token whatever the noise, so its noise need not be computed.
G_MIN = tl.constexpr(-2.8115408420562744)
G_MAX = tl.constexpr(16.63553237915039)


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
def unit_gumbel(bits):
    """u = (2 * (bits >> 9) + 1) * 2^-24 (exact), then 0 - bik_log(0 - bik_log(u))."""
    u = (((bits >> 9) << 1) | 1).to(tl.float32) * 5.960464477539063e-08
    return 0.0 - bik_log(0.0 - bik_log(u))


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


def sample_rows(x, seed, position, temperature, top_k, top_p, log_min_p,
                max_top_k=None):
    """The op's entry point on this backend (see bik/ops/sampling/op.py)."""
    return sample_split_vocab(launch_sample, x, seed, position, temperature, top_k, top_p,
                              log_min_p, max_top_k)

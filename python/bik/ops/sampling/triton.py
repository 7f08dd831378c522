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
from bik.ops.sampling.noise import STREAM_SAMPLE, greedy_limit
from bik.ops.sampling.split_vocab import topk_threshold
from bik.ops.sampling.triton_common import (
    INT32_MAX,
    Workspace,
    _chunks_per_tile,
    _kept_k,
    _tempered,
    row_slots,
    row_temperature,
    row_topk,
    topk_args,
)
from bik.ops.sampling.triton_groups import launch_group_mass, launch_group_max
from bik.ops.sampling.triton_top_p import launch_top_p_stats
from bik.runtime.triton_launch import launch

STREAM = tl.constexpr(STREAM_SAMPLE)
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
def gumbel_pick_kernel(x_ptr, stride_x, V, seed_ptr, pos_ptr, temp_ptr, vk_ptr, ik_ptr, ws_f, FW,
                       ws_i, IW, G: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                       TOPK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    x_row = x_ptr + row * stride_x
    _, _, m_slot, vlo_slot, _, part_val, _, _, part_idx = row_slots(ws_f, FW, ws_i, IW, row, G)
    temp = row_temperature(temp_ptr, row)
    vk, ik = row_topk(vk_ptr, ik_ptr, row, TOPK)
    v_lo = tl.load(vlo_slot)
    floor = tl.load(m_slot) + G_MIN  # the max token's lowest possible score
    # Philox key (seed lo, hi) and counter words 1..3 (position lo, hi, stream), uint32.
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    p_lo = (pos & 0xFFFFFFFF).to(tl.uint32)
    p_hi = ((pos >> 32) & 0xFFFFFFFF).to(tl.uint32)
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
            bits, _w1, _w2, _w3 = philox4x32_10(offs.to(tl.uint32), zero + p_lo, zero + p_hi,
                                          zero + STREAM, zero + k0, zero + k1)
            s = z + unit_gumbel(bits)
        s = tl.where(contender, s, float("-inf"))
        better = s > best_v  # chunks ascend, so ties keep the lower index per lane
        best_v = tl.where(better, s, best_v)
        best_i = tl.where(better, offs, best_i)
    top = tl.max(best_v, axis=0)
    idx = tl.min(tl.where(best_v == top, best_i, INT32_MAX), axis=0)
    tl.store(part_val + split, top)
    tl.store(part_idx + split, idx)


@triton.jit
def finish_kernel(x_ptr, stride_x, temp_ptr, top_p_ptr, ws_f, FW, ws_i, IW, tokens_ptr,
                  logprobs_ptr, n_splits, G: tl.constexpr, SPLITS_P2: tl.constexpr,
                  PLAIN: tl.constexpr):
    """One program per row: the splits' winners merged under (value desc, index asc), the
    group totals of a row without top-p folded ascending from +0 and bik_log'd (the top-p
    search wrote its own log S), and the token's logprob (z - m) - log S, each an exactly
    rounded fp32 op (no fusion): the bits of the CPU's sequence. Token -1 and NaN for an
    invalid row."""
    row = tl.program_id(0).to(tl.int64)
    _, gtot, m_slot, _, logs_slot, part_val, _, bad_slot, part_idx = row_slots(
        ws_f, FW, ws_i, IW, row, G)
    lanes = tl.arange(0, SPLITS_P2)
    vals = tl.load(part_val + lanes, mask=lanes < n_splits, other=float("-inf"))
    idxs = tl.load(part_idx + lanes, mask=lanes < n_splits, other=INT32_MAX)
    top = tl.max(vals, axis=0)
    idx = tl.min(tl.where(vals == top, idxs, INT32_MAX), axis=0)
    bad = tl.load(bad_slot) != 0
    invalid = bad | (top == float("-inf"))
    total = tl.full((), 0.0, tl.float32)
    for g in tl.static_range(G):  # group totals ascending from +0
        total = total + tl.load(gtot + g)
    log_s = bik_log(tl.where(bad, 1.0, total))
    if not PLAIN:
        if tl.load(top_p_ptr + row) < 1.0:
            log_s = tl.load(logs_slot)
    temp = row_temperature(temp_ptr, row)
    token = tl.where(invalid, 0, idx)
    x_c = tl.load(x_ptr + row * stride_x + token).to(tl.float32)
    z_c = tl.where(temp > 0.0, tl.math.div_rn(x_c, tl.where(temp > 0.0, temp, 1.0)), x_c)
    logprob = (z_c - tl.load(m_slot)) - log_s
    tl.store(tokens_ptr + row, tl.where(invalid, -1, idx).to(tl.int64))
    tl.store(logprobs_ptr + row, tl.where(invalid, float("nan"), logprob))


def launch_sample(x: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
                  temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, max_top_k: int | None = None,
                  any_top_p: bool | None = None):
    """(tokens int64 [B], logprobs fp32 [B]) of x [B, V] (unit stride along V, any float
    dtype, read in place) with the op's per-row parameters as the caller gave them (the greedy
    limit and min-p's log are applied in the kernels). Host metadata: ``max_top_k`` (0: no top-k
    row; None: one host sync finds it), ``any_top_p`` (False: no top-p row, the search is not
    launched; None: launched, its programs return at once for rows without top-p). With
    neither top-k nor top-p rows: 4 launches and 4 allocations, nothing else."""
    b, v = x.shape
    dev = x.device
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    logprobs = torch.empty(b, dtype=torch.float32, device=dev)
    if b == 0:
        return tokens, logprobs
    arch = device_arch(dev)
    cfg = sampling_config(arch)
    groups, chunk = sampler_chunks(v)
    nch = _chunks_per_tile(arch, chunk)
    n_splits = -(-v // cfg.split)
    vk = ik = None
    if max_top_k != 0:
        vk, ik = topk_threshold(x, greedy_limit(temperature), top_k, max_top_k)
    ws = Workspace.allocate(b, groups, n_splits, dev)
    plain = any_top_p is False
    shape = {"chunk": chunk, "nch": nch, "num_warps": cfg.num_warps, "options": NO_FUSION}
    launch_group_max(x, temperature, vk, ik, ws, block=cfg.block, num_warps=cfg.num_warps,
                     options=NO_FUSION)
    launch_group_mass(x, temperature, vk, ik, top_p, min_p, ws, plain=plain, **shape)
    if not plain:
        launch_top_p_stats(x, temperature, vk, ik, top_p, min_p, ws, **shape)
    launch(gumbel_pick_kernel, (b, n_splits), x, x.stride(0), v, seed, position, temperature,
           *topk_args(vk, ik, ws), *ws.args(), G=groups,
           SPLIT=cfg.split, BLOCK=cfg.block, TOPK=vk is not None,
           num_warps=cfg.num_warps, **NO_FUSION)
    launch(finish_kernel, (b,), x, x.stride(0), temperature, top_p, *ws.args(), tokens, logprobs,
           n_splits, G=groups, SPLITS_P2=1 << (n_splits - 1).bit_length(),
           PLAIN=plain, num_warps=1, **NO_FUSION)
    return tokens, logprobs


def sample_rows(x, seed, position, temperature, top_k, top_p, min_p, max_top_k=None,
                any_top_p=None):
    """The op's entry point on this backend (see bik/ops/sampling/op.py)."""
    return launch_sample(x, seed, position, temperature, top_k, top_p, min_p, max_top_k,
                         any_top_p)

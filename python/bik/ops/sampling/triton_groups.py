"""The Triton sampler's statistics for rows without top-p, spread over the normaliser's groups.

A row without top-p needs three statistics: its max m (over the top-k-kept tokens), its invalid
flag, and the logprob's normaliser S = vocab_sum(bik_exp(z - m)) over the kept tokens. Its
vocabulary is the normaliser's G groups (bik.configs.sampler_chunks), so G programs per row
work side by side instead of one walking the whole row:

* ``group_max_kernel`` (rows x groups, every row): each group's max and invalid flag (the
  top-p search starts from them too);
* ``group_mass_kernel`` (rows x groups): m is the max of the G maxima (a max is exact in any
  order), then each program sums its group in the contract's order (triton_common.group_mass:
  chunks folded by halves, chunk sums ascending from +0); the group-0 program writes m, the
  min-p threshold and the flag for the pick;
* the G group totals are folded in ascending order from +0 and passed through bik_log in torch
  (``finish_plain_rows``): separately rounded fp32 ops, so the bits of the single-program sum.

Rows with top-p < 1 return at once from group_mass_kernel: triton_top_p's passes take them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bik.ops._normaliser import bik_log_torch
from bik.ops.sampling.triton_common import group_mass, max_and_flag


@triton.jit
def group_max_kernel(x_ptr, stride_x, GROUP_LEN, temp_ptr, vk_ptr, ik_ptr, gmax_ptr, gbad_ptr,
                     G: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    g0 = g.to(tl.int64) * GROUP_LEN
    mx, bad = max_and_flag(x_ptr + row * stride_x, g0, g0 + GROUP_LEN, tl.load(temp_ptr + row),
                           tl.load(vk_ptr + row), tl.load(ik_ptr + row), BLOCK)
    tl.store(gmax_ptr + row * G + g, mx)
    tl.store(gbad_ptr + row * G + g, bad)


@triton.jit
def group_mass_kernel(x_ptr, stride_x, GROUP_LEN, temp_ptr, vk_ptr, ik_ptr, top_p_ptr,
                      log_min_p_ptr, gmax_ptr, gbad_ptr, gtot_ptr, m_ptr, vlo_ptr, bad_ptr,
                      G: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
                      NCH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    if tl.load(top_p_ptr + row) < 1.0:
        return
    lanes = tl.arange(0, G)
    m = tl.max(tl.load(gmax_ptr + row * G + lanes), axis=0)
    is_bad = (tl.max(tl.load(gbad_ptr + row * G + lanes), axis=0) > 0) | (m == float("-inf"))
    m_safe = tl.where(is_bad, 0.0, m)
    v_lo = tl.maximum(float("-inf"), m_safe + tl.load(log_min_p_ptr + row))
    g0 = g.to(tl.int64) * GROUP_LEN
    total = group_mass(x_ptr + row * stride_x, g0, g0 + GROUP_LEN, tl.load(temp_ptr + row),
                       tl.load(vk_ptr + row), tl.load(ik_ptr + row), v_lo, m_safe, CHUNK,
                       LOG2_CHUNK, NCH, False)
    tl.store(gtot_ptr + row * G + g, total)
    if g == 0:
        tl.store(m_ptr + row, m_safe)
        tl.store(vlo_ptr + row, v_lo)
        tl.store(bad_ptr + row, is_bad.to(tl.int32))


def launch_group_max(logits, temperature, vk, ik, *, groups: int, block: int, num_warps: int,
                     options: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """group_max_kernel over every (row, group): the G maxima fp32 [B, G] and flags int32
    [B, G] that both the plain rows' mass kernel and the top-p search start from."""
    b, v = logits.shape
    gmax = torch.empty(b, groups, dtype=torch.float32, device=logits.device)
    gbad = torch.empty(b, groups, dtype=torch.int32, device=logits.device)
    group_max_kernel[(b, groups)](logits, logits.stride(0), v // groups, temperature, vk, ik,
                                  gmax, gbad, G=groups, BLOCK=block, num_warps=num_warps,
                                  **options)
    return gmax, gbad


def launch_group_mass(logits, temperature, vk, ik, top_p, log_min_p, gmax, gbad, m, v_lo, bad,
                      *, groups: int, chunk: int, nch: int, num_warps: int,
                      options: dict) -> torch.Tensor:
    """group_mass_kernel over every (row, group) (top-p rows return at once); m, v_lo and bad
    are written for the other rows. Returns the group totals fp32 [B, G]."""
    b, v = logits.shape
    gtot = torch.empty(b, groups, dtype=torch.float32, device=logits.device)
    group_mass_kernel[(b, groups)](logits, logits.stride(0), v // groups, temperature, vk, ik,
                                   top_p, log_min_p, gmax, gbad, gtot, m, v_lo, bad, G=groups,
                                   CHUNK=chunk, LOG2_CHUNK=chunk.bit_length() - 1, NCH=nch,
                                   num_warps=num_warps, **options)
    return gtot


def finish_plain_rows(gtot: torch.Tensor, bad: torch.Tensor, top_p: torch.Tensor,
                      log_s: torch.Tensor) -> torch.Tensor:
    """log S for every row: the group totals folded ascending from +0 and bik_log'd where the
    row has no top-p (an invalid row: bik_log(1)), the top-p search's value elsewhere."""
    total = torch.zeros(gtot.shape[0], dtype=torch.float32, device=gtot.device)
    for g in range(gtot.shape[1]):
        total = total + gtot[:, g]
    plain = bik_log_torch(torch.where(bad != 0, 1.0, total))
    return torch.where(top_p < 1.0, log_s, plain)

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
* the G group totals are folded in ascending order from +0 and passed through bik_log by the
  finish kernel (triton.py), exactly rounded fp32 ops: the bits of the single-program sum.

Rows with top-p < 1 return at once from group_mass_kernel: triton_top_p's passes take them
(with ``PLAIN``, the host's word that no row uses top-p, the kernel does not look).
"""

from __future__ import annotations

import triton
import triton.language as tl

from bik.ops.sampling.triton_common import (
    group_mass,
    max_and_flag,
    row_log_min_p,
    row_slots,
    row_temperature,
    row_topk,
    topk_args,
)
from bik.runtime.triton_launch import launch


@triton.jit
def group_max_kernel(x_ptr, stride_x, GROUP_LEN, temp_ptr, vk_ptr, ik_ptr, ws_f, FW, ws_i, IW,
                     G: tl.constexpr, BLOCK: tl.constexpr, TOPK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    gmax, _, _, _, _, _, gbad, _, _ = row_slots(ws_f, FW, ws_i, IW, row, G)
    vk, ik = row_topk(vk_ptr, ik_ptr, row, TOPK)
    g0 = g.to(tl.int64) * GROUP_LEN
    mx, bad = max_and_flag(x_ptr + row * stride_x, g0, g0 + GROUP_LEN,
                           row_temperature(temp_ptr, row), vk, ik, BLOCK)
    tl.store(gmax + g, mx)
    tl.store(gbad + g, bad)


@triton.jit
def group_mass_kernel(x_ptr, stride_x, GROUP_LEN, temp_ptr, vk_ptr, ik_ptr, top_p_ptr,
                      min_p_ptr, ws_f, FW, ws_i, IW, G: tl.constexpr, CHUNK: tl.constexpr,
                      LOG2_CHUNK: tl.constexpr, NCH: tl.constexpr, TOPK: tl.constexpr,
                      PLAIN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    if not PLAIN:
        if tl.load(top_p_ptr + row) < 1.0:
            return
    gmax, gtot, m_out, vlo_out, _, _, gbad, bad_out, _ = row_slots(ws_f, FW, ws_i, IW, row, G)
    lanes = tl.arange(0, G)
    m = tl.max(tl.load(gmax + lanes), axis=0)
    is_bad = (tl.max(tl.load(gbad + lanes), axis=0) > 0) | (m == float("-inf"))
    m_safe = tl.where(is_bad, 0.0, m)
    v_lo = tl.maximum(float("-inf"), m_safe + row_log_min_p(min_p_ptr, row))
    vk, ik = row_topk(vk_ptr, ik_ptr, row, TOPK)
    g0 = g.to(tl.int64) * GROUP_LEN
    total = group_mass(x_ptr + row * stride_x, g0, g0 + GROUP_LEN,
                       row_temperature(temp_ptr, row), vk, ik, v_lo, m_safe, CHUNK, LOG2_CHUNK,
                       NCH, False)
    tl.store(gtot + g, total)
    if g == 0:
        tl.store(m_out, m_safe)
        tl.store(vlo_out, v_lo)
        tl.store(bad_out, is_bad.to(tl.int32))


def launch_group_max(logits, temperature, vk, ik, ws, *, block: int, num_warps: int,
                     options: dict) -> None:
    """group_max_kernel over every (row, group): each group's max and flag into the workspace
    ``ws`` (triton_common.Workspace), where both the plain rows' mass kernel and the top-p
    search start from them. vk / ik None: no row uses top-k."""
    b, v = logits.shape
    g = ws.groups
    launch(group_max_kernel, (b, g), logits, logits.stride(0), v // g, temperature,
           *topk_args(vk, ik, ws), *ws.args(), G=g, BLOCK=block,
           TOPK=vk is not None, num_warps=num_warps, **options)


def launch_group_mass(logits, temperature, vk, ik, top_p, min_p, ws, *, plain: bool,
                      chunk: int, nch: int, num_warps: int, options: dict) -> None:
    """group_mass_kernel over every (row, group): the group totals, m, v_lo and the flag of the
    rows without top-p into ``ws`` (top-p rows return at once; ``plain``: the host vouches
    there are none)."""
    b, v = logits.shape
    g = ws.groups
    launch(group_mass_kernel, (b, g), logits, logits.stride(0), v // g, temperature,
           *topk_args(vk, ik, ws), top_p, min_p, *ws.args(), G=g,
           CHUNK=chunk, LOG2_CHUNK=chunk.bit_length() - 1, NCH=nch,
           TOPK=vk is not None, PLAIN=plain, num_warps=num_warps, **options)


"""What the Triton sampler's kernel modules share: one module below all three, so none imports
another's kernels.

triton.py (the pick and the entry point), triton_groups.py (the statistics of rows without
top-p) and triton_top_p.py (the top-p search) import their common building blocks from here:

* the fp32 order key (``_key`` / ``_from_key``), the tempered load (``_tempered``: z = div_rn(x,
  T)) and top-k's keep test (``_kept_k``), which every kernel applies the same way;
* ``max_and_flag`` (a range's max z and invalid flag) and ``group_mass`` (one normaliser
  group's total of the kept tokens' terms);
* the chunks folded side by side per step (``_chunks_per_tile``);
* a row's parameters as every kernel reads them (``row_temperature``: the contract's greedy
  limit; ``row_log_min_p``; ``row_topk``: the top-k threshold, or keep-all when the call has
  no top-k row) and the row's statistics workspace (``row_slots`` and its host side,
  :class:`Workspace`): the greedy limit, min-p's log and every buffer the kernels hand each
  other are device work inside the kernels, so a temperature-only call issues no torch op but
  four allocations (tests/sampling/test_sampling_launches.py).

bik_log, bik_exp, the normaliser's fold (``chunk_sums``, ``add_chunk_sums``) and the launch
options (``NO_FUSION``: every sampler kernel is compiled without fp fusion) are the one
normaliser's, shared with bik::log_softmax: they live in ops/_normaliser_triton.py, below both
slices, and the kernel modules import them from there.

The entry point imports the two statistics modules; they import nothing of the slice but this
module (and noise.py's torch helpers): the import graph is acyclic (tests/test_house_rules.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from bik.configs import SAMPLER_GREEDY_BELOW, sampling_config
from bik.ops._normaliser_triton import add_chunk_sums, bik_exp, bik_log, chunk_sums
from bik.ops.sampling.noise import FLT_MIN

GREEDY_BELOW = tl.constexpr(SAMPLER_GREEDY_BELOW)
MIN_P_FLOOR = tl.constexpr(FLT_MIN)
INT32_MAX = tl.constexpr(2**31 - 1)


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
def row_temperature(temp_ptr, row):
    """The row's temperature under the contract's greedy limit (noise.greedy_limit): below
    SAMPLER_GREEDY_BELOW it is 0 (greedy). An fp32 compare and select, as in torch."""
    t = tl.load(temp_ptr + row)
    return tl.where(t < GREEDY_BELOW, 0.0, t)


@triton.jit
def row_log_min_p(min_p_ptr, row):
    """noise.log_min_p of the row's min_p: bik_log(max(min_p, FLT_MIN)), -inf when off (0)."""
    p = tl.load(min_p_ptr + row)
    return tl.where(p > 0.0, bik_log(tl.maximum(p, MIN_P_FLOOR)), float("-inf"))


@triton.jit
def row_topk(vk_ptr, ik_ptr, row, TOPK: tl.constexpr):
    """The row's top-k threshold (vk, ik) (split_vocab.topk_threshold); without TOPK (no row
    of the call uses top-k: max_top_k = 0) the keep-all threshold, nothing loaded."""
    if TOPK:
        vk = tl.load(vk_ptr + row)
        ik = tl.load(ik_ptr + row)
    else:
        vk = tl.full((), float("-inf"), tl.float32)
        ik = tl.full((), INT32_MAX, tl.int32)
    return vk, ik


@triton.jit
def row_slots(ws_f, FW, ws_i, IW, row, G: tl.constexpr):
    """Pointers to a row's statistics in the workspace (:class:`Workspace`): (gmax [G],
    gtot [G], m, v_lo, log_s, part_val [splits], gbad [G], bad, part_idx [splits])."""
    f = ws_f + row * FW
    i = ws_i + row * IW
    return f, f + G, f + 2 * G, f + 2 * G + 1, f + 2 * G + 2, f + 2 * G + 3, i, i + G, i + G + 1


class Workspace(NamedTuple):
    """The statistics the sampler's kernels hand each other, two allocations for the call:
    per row, fp32 [gmax (G) | gtot (G) | m | v_lo | log_s | part_val (splits)] and int32
    [gbad (G) | bad | part_idx (splits)] (``row_slots`` reads the layout)."""

    f: torch.Tensor  # fp32 [B, FW]
    i: torch.Tensor  # int32 [B, IW]
    groups: int
    splits: int

    @classmethod
    def allocate(cls, rows: int, groups: int, splits: int, device) -> Workspace:
        return cls(torch.empty(rows, 2 * groups + 3 + splits, dtype=torch.float32,
                               device=device),
                   torch.empty(rows, groups + 1 + splits, dtype=torch.int32, device=device),
                   groups, splits)

    def args(self) -> tuple:
        """The kernels' (ws_f, FW, ws_i, IW) arguments."""
        return self.f, self.f.shape[1], self.i, self.i.shape[1]

    def column(self, name: str) -> torch.Tensor:
        """A per-row statistic as a [B] view (tests and tools: m, v_lo, log_s, bad)."""
        g = self.groups
        if name == "bad":
            return self.i[:, g]
        return self.f[:, 2 * g + ("m", "v_lo", "log_s").index(name)]


def topk_args(vk, ik, ws: Workspace) -> tuple:
    """The kernels' vk / ik pointers; without top-k (TOPK=False: never read) the workspace's."""
    return (vk, ik) if vk is not None else (ws.f, ws.i)


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
def group_mass(x_row, g0, g_end, temp, vk, ik, threshold, m_safe, CHUNK: tl.constexpr,
               LOG2_CHUNK: tl.constexpr, NCH: tl.constexpr, RAW: tl.constexpr):
    """One normaliser group's total (csrc/cpu/sampling.h vocab_sum) over tokens [g0, g_end):
    bik_exp(z - m_safe) of the tokens kept by top-k with z >= threshold, or with RAW the fp32
    terms at x_row themselves (tests). NCH chunks at a time from g0 as an [NCH, CHUNK] tile (the
    missing tokens of a ragged chunk: +0), each folded pairwise by halves (explicit reshapes, not
    a tl.sum tree); the chunk sums enter the total one by one in ascending order from +0 (a
    tl.sum of one value among zeros is that value, exactly)."""
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
        group_total = add_chunk_sums(group_total, chunk_sums(s, NCH, CHUNK, LOG2_CHUNK), NCH)
    return group_total


def _chunks_per_tile(arch: str, chunk: int) -> int:
    """Chunks folded side by side per step of the stats kernel: the config's block of tokens
    (at least one chunk). The order of the sums does not depend on it."""
    return max(1, sampling_config(arch).block // chunk)

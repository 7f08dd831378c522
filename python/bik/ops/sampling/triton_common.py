"""What the Triton sampler's kernel modules share: one module below all three, so none imports
another's kernels.

triton.py (the pick and the entry point), triton_groups.py (the statistics of rows without
top-p) and triton_top_p.py (the top-p search) import their common building blocks from here:

* the fp32 order key (``_key`` / ``_from_key``), the tempered load (``_tempered``: z = div_rn(x,
  T)) and top-k's keep test (``_kept_k``), which every kernel applies the same way;
* ``max_and_flag`` (a range's max z and invalid flag) and ``group_mass`` (one normaliser
  group's total of the kept tokens' terms);
* the chunks folded side by side per step (``_chunks_per_tile``).

bik_log, bik_exp, the normaliser's fold (``chunk_sums``, ``add_chunk_sums``) and the launch
options (``NO_FUSION``: every sampler kernel is compiled without fp fusion) are the one
normaliser's, shared with bik::log_softmax: they live in ops/_normaliser_triton.py, below both
slices, and the kernel modules import them from there.

The entry point imports the two statistics modules; they import nothing of the slice but this
module (and noise.py's torch helpers): the import graph is acyclic (tests/test_house_rules.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from bik.configs import sampling_config
from bik.ops._normaliser_triton import add_chunk_sums, bik_exp, chunk_sums


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

"""Triton test kernels for the sampler's building blocks: the product kernels' own @triton.jit
helpers (bik/ops/sampling/triton.py, triton_common.py, bik/ops/_normaliser_triton.py) run on
given inputs, for tests/sampling/test_sampling_noise.py and test_sampling_normaliser.py. Test
code, so it lives in the test tree, not in the shipped package.

* ``run_noise_part``: Philox4x32-10, bik_log, the Gumbel map of u and bik_exp, elementwise;
* ``vocab_sum``: the normaliser's sum of given fp32 terms, through the very group_mass the
  statistics kernels call (its RAW mode), group totals ascending from +0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from bik._arch import device_arch
from bik.configs import sampler_chunks
from bik.ops._normaliser_triton import NO_FUSION, bik_exp, bik_log
from bik.ops.sampling.triton import philox4x32_10
from bik.ops.sampling.triton_common import _chunks_per_tile, group_mass

__all__ = ["run_noise_part", "vocab_sum"]


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
def vocab_sum_kernel(t_ptr, V, GROUP_LEN, out_ptr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
                     NCH: tl.constexpr):
    """Test access to the normaliser's order: out[row] = vocab_sum of the fp32 terms [B, V]."""
    row = tl.program_id(0).to(tl.int64)
    total = _vocab_mass(t_ptr + row * V, V, GROUP_LEN, 1.0, 0.0, 0, 0.0, 0.0, CHUNK, LOG2_CHUNK,
                        NCH, True)
    tl.store(out_ptr + row, total)


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

"""The CPU backend's softmax / log_softmax / mean kernels (csrc/cpu/reductions.h,
csrc/cpu/normaliser.h) against their literal contracts, written in torch in
bik/ops/reductions/reference.py.

CPU only (the plain process; skipped without the extension): for rows shorter than, equal to
and longer than the 16 lanes, with and without a tail, softmax and mean are the contract's bits
(expf the C library's); log_softmax is the sampler's normaliser for rows of one group and of 8
groups, with a group of one chunk and of several; above the one-thread threshold neither the
thread count nor the ISA changes a bit.
"""

from __future__ import annotations

import pytest
import torch
from bik.ops.reductions.cpu import log_softmax_f32, mean_f32, softmax_f32
from bik.ops.reductions.reference import (
    log_softmax_reference,
    mean_cpu_reference,
    softmax_cpu_reference,
)
from bik.runtime import cpu_ext

pytestmark = [pytest.mark.cpu,
              pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 111, 500])
def test_cpu_kernels_follow_the_contract_bit_for_bit(n, gen):
    x = torch.randn(4, n, generator=gen) * 5
    got = torch.empty(4, n)
    softmax_f32(x, got)
    assert torch.equal(_bits(got), _bits(softmax_cpu_reference(x)))
    got = torch.empty(4)
    mean_f32(x, got)
    assert torch.equal(_bits(got), _bits(mean_cpu_reference(x)))


# One group (7, 1001, 2050: no multiple of 8) and 8 groups of 2, 125 and 1100 tokens (a group of
# two chunks, the second ragged); 49152 is SmolLM2's vocabulary.
@pytest.mark.parametrize("n", [1, 7, 16, 1000, 1001, 2050, 8800, 49152])
def test_cpu_log_softmax_is_the_normaliser_bit_for_bit(n, gen):
    x = torch.randn(3, n, generator=gen) * 4
    x[0, n // 2] = float("-inf")
    got = torch.empty_like(x)
    log_softmax_f32(x, got)
    assert torch.equal(_bits(got), _bits(log_softmax_reference(x)))


def test_cpu_log_softmax_rows_without_a_finite_max_are_nan():
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[0.0, inf, 1.0], [-inf, -inf, -inf], [0.0, nan, 1.0], [-inf, 0.0, 2.0]])
    got = torch.empty_like(x)
    log_softmax_f32(x, got)
    assert got[:3].isnan().all()
    assert torch.equal(got[3], log_softmax_reference(x[3:])[0])
    assert got[3, 0] == -inf and torch.allclose(got[3], torch.log_softmax(x[3], 0))


def test_cpu_kernels_threads_and_isa_do_not_change_bits(gen):
    x = torch.randn(300, 1500, generator=gen)  # above the one-thread threshold
    one, two = torch.empty_like(x), torch.empty_like(x)
    softmax_f32(x, one, num_threads=1)
    softmax_f32(x, two, num_threads=2)
    assert torch.equal(one, two)
    runs = []
    for threads, isa in [(1, "generic"), (2, "auto")] + [(1, i) for i in ("avx2", "avx512")
                                                         if cpu_ext.require().isa_supported(i)]:
        runs.append(torch.empty_like(x))
        log_softmax_f32(x, runs[-1], num_threads=threads, isa=isa)
    assert all(torch.equal(_bits(r), _bits(runs[0])) for r in runs)
    one, two = torch.empty(300), torch.empty(300)
    mean_f32(x, one, num_threads=1)
    mean_f32(x, two, num_threads=2)
    assert torch.equal(one, two)

"""The CPU backend's softmax / log_softmax / mean kernels (csrc/cpu/reductions.h) against the
literal contract of csrc/cpu/contract.h, written in torch in bik/ops/reductions/reference.py.

CPU only (the plain process; skipped without the extension): for rows shorter than, equal to
and longer than the 16 lanes, with and without a tail, the kernels' bits are the contract's bit
for bit (expf / logf the C library's); above the one-thread threshold the thread count changes
no bit.
"""

from __future__ import annotations

import pytest
import torch
from bik.ops.reductions.cpu import mean_f32, softmax_f32
from bik.ops.reductions.reference import mean_cpu_reference, softmax_cpu_reference
from bik.runtime import cpu_ext

pytestmark = [pytest.mark.cpu,
              pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 111, 500])
def test_cpu_kernels_follow_the_contract_bit_for_bit(n, gen):
    x = torch.randn(4, n, generator=gen) * 5
    for log in (False, True):
        got = torch.empty(4, n)
        softmax_f32(x, got, log=log)
        assert torch.equal(_bits(got), _bits(softmax_cpu_reference(x, log=log))), log
    got = torch.empty(4)
    mean_f32(x, got)
    assert torch.equal(_bits(got), _bits(mean_cpu_reference(x)))


def test_cpu_kernels_threads_do_not_change_bits(gen):
    x = torch.randn(300, 1500, generator=gen)  # above the one-thread threshold
    for log in (False, True):
        one, two = torch.empty_like(x), torch.empty_like(x)
        softmax_f32(x, one, log=log, num_threads=1)
        softmax_f32(x, two, log=log, num_threads=2)
        assert torch.equal(one, two)
    one, two = torch.empty(300), torch.empty(300)
    mean_f32(x, one, num_threads=1)
    mean_f32(x, two, num_threads=2)
    assert torch.equal(one, two)

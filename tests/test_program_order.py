"""The kernels with a cross-program protocol keep their bits whatever order their programs
run in (tests/program_order.py: the interpreter with each launch's programs shuffled by a
seed): SPLIT attention (tickets; the last program to arrive folds every partial), the
sampler's top-p passes, SPREAD matmul (partials, then a fold). Negative control: a kernel whose
programs add into one fp32 accumulator in arrival order gives other bits for some seed.
"""

from __future__ import annotations

import attention_checks as ac
import bik
import pytest
import torch
import triton
import triton.language as tl
from program_order import shuffled_programs
from targets import targets

SEEDS = range(4)
pytestmark = pytest.mark.parametrize("target", targets("interpreter"))


def _orders(fn):
    """fn() in grid order, then under each seed's shuffled order."""
    first = fn()
    outs = []
    for seed in SEEDS:
        with shuffled_programs(seed):
            outs.append(fn())
    return first, outs


def test_split_attention_keeps_its_bits_in_any_program_order(target, monkeypatch):
    from bik.ops.attention import triton as triton_attention

    batch = ac.mixed_batch(16)
    monkeypatch.setattr(triton_attention, "use_split_mode", lambda *args: False)
    fold = batch("triton")
    monkeypatch.setattr(triton_attention, "use_split_mode", lambda *args: True)
    monkeypatch.setattr(triton_attention, "splits_per_program", lambda *args: 1)
    first, outs = _orders(lambda: batch("triton"))
    assert torch.equal(first, fold)
    assert all(torch.equal(out, fold) for out in outs)


def test_sampler_top_p_passes_keep_their_tokens_in_any_program_order(target):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 2000, generator=gen) * 2
    params = {"seed": torch.tensor([1, 2]), "position": torch.tensor([7, 8]),
              "temperature": 0.9, "top_p": torch.tensor([0.9, 0.5])}
    cpu = bik.sample(logits, backend="cpu", **params)
    first, outs = _orders(lambda: bik.sample(logits, backend="triton", **params))
    for out in (first, *outs):
        assert torch.equal(out.tokens, cpu.tokens) and torch.equal(out.logprobs, cpu.logprobs)


def test_spread_matmul_keeps_its_bits_in_any_program_order(target):
    from bik.ops.matmul import triton as triton_matmul

    gen = torch.Generator().manual_seed(6)
    a, w = torch.randn(1, 5, 300, generator=gen), torch.randn(24, 300, generator=gen)

    def run(spread):
        out = torch.empty(1, 5, 24)
        triton_matmul.launch_matmul(a, w.t()[None], None, out, split=64, spread=spread,
                                    persistent=False)
        return out

    fold = run(False)
    first, outs = _orders(lambda: run(True))
    assert all(torch.equal(out, fold) for out in (first, *outs))


@triton.jit
def _arrival_order_sum(x_ptr, out_ptr):
    # Each program adds its value into one accumulator: the sum's rounding follows arrival.
    tl.atomic_add(out_ptr, tl.load(x_ptr + tl.program_id(0)))


def test_an_arrival_order_fold_is_caught(target):
    """The negative control: fp32 addition in arrival order gives other bits for at least one
    shuffled order, so the tests above would see an order-dependent fold."""
    x = torch.tensor([1e8, 1.0, -1e8, 1.0, 3.0, -7.5, 1e-3, 2.5e7] * 4)

    def run():
        out = torch.zeros(1)
        _arrival_order_sum[(x.numel(),)](x, out)
        return out

    first, outs = _orders(run)
    assert any(not torch.equal(out, first) for out in outs)

"""bik.PackedWeight: a weight packed once for the CPU matmul kernel gives bik.linear's bits.

Packing is a speed change only (the kernel reads its panels in place instead of transposing
the weight on every call), so the test is bitwise equality with bik.linear(backend="cpu")
over dtypes, N tails, K blocking (K > 2048), row counts on both sides of the few-rows blocking
switch, bias, threads and leading dims; and a row's bits alone equal its bits in a batch, with
a control showing the comparison catches a batch-dependent product.
"""

from __future__ import annotations

import bik
import pytest
import torch
from bik.runtime import cpu_ext
from checks import alone_rows, first_bad_m

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason())


def _case(n, k, m, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return w, x, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(1, 1), (33, 17), (100, 64), (960, 576), (40, 2100), (7, 0)])
@pytest.mark.parametrize("m", [1, 5, 17, 70])
def test_packed_equals_linear(dtype, n, k, m):
    w, x, bias = _case(n, k, m, dtype)
    packed = bik.PackedWeight(w)
    for b in (None, bias):
        assert torch.equal(packed(x, b), bik.linear(x, w, b, backend="cpu"))


@pytest.mark.parametrize("threads", [1, 2])
def test_packed_equals_linear_at_any_thread_count_and_rank(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w, _, bias = _case(300, 200, 1, torch.bfloat16, seed=1)
        x = torch.randn(2, 3, 200).to(torch.bfloat16)
        out = bik.PackedWeight(w)(x, bias)
        assert out.shape == (2, 3, 300)
        assert torch.equal(out, bik.linear(x, w, bias, backend="cpu"))
    finally:
        torch.set_num_threads(old)


def test_packed_from_a_strided_weight_and_strided_rows():
    base = torch.randn(64, 2 * 96)
    w = base[:, ::2]  # [64, 96], column stride 2
    x = torch.randn(96, 9).t()  # [9, 96], row stride 1
    packed = bik.PackedWeight(w)
    before = packed(x)
    assert torch.equal(before, bik.linear(x, w, backend="cpu"))
    w.add_(1.0)  # the panels are a copy: a stale pack refuses rather than answer
    with pytest.raises(ValueError, match=r"bik.PackedWeight: the weight changed after packing "
                                         r"\(version 0 -> 1\); pack it again"):
        packed(x)
    repacked = bik.PackedWeight(w)
    after = repacked(x)
    assert torch.equal(after, bik.linear(x, w, backend="cpu"))
    # A write through .data moves no version: as documented, the writer repacks.
    w.data.copy_(base[:, 1::2])
    assert torch.equal(repacked(x), after)
    assert not torch.equal(bik.PackedWeight(w)(x), after)


def test_packed_rows_alone_equal_batched_and_the_check_can_fail():
    w, x, bias = _case(200, 300, 130, torch.float32, seed=2)
    packed = bik.PackedWeight(w)

    def fn(rows):
        return packed(rows, bias)

    assert first_bad_m(fn, x, alone_rows(fn, x)) is None

    def by_batch(rows):  # a deliberately batch-dependent product: K order follows M
        if rows.shape[0] == 1:
            return fn(rows)
        return rows.flip(-1) @ w.flip(-1).t() + bias

    assert first_bad_m(by_batch, x, alone_rows(by_batch, x)) is not None


@pytest.mark.parametrize("make, call, error, match", [
    (lambda: torch.randn(4), None, ValueError, "weight must be 2-D"),
    (lambda: torch.randn(4, 4).to(torch.int32), None, TypeError, "weight"),
    (lambda: torch.randn(4, 4), lambda p: p(torch.randn(2, 5)), ValueError, "disagree on K"),
    (lambda: torch.randn(4, 4), lambda p: p(torch.randn(2, 4).double()), ValueError, "x is"),
    (lambda: torch.randn(4, 4), lambda p: p(torch.randn(2, 4), torch.randn(3)), ValueError,
     "bias"),
])
def test_packed_bad_input_names_the_op(make, call, error, match):
    with pytest.raises((error, TypeError, ValueError), match=f"bik.PackedWeight.*{match}"):
        packed = bik.PackedWeight(make())
        call(packed)

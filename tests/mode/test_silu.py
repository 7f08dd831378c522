"""SiLU under the front ends: stock CPU silu rounds its SIMD body and scalar tail differently,
so an element's bits depend on where it sits in the tensor; bik routes silu (and its backward)
to x / (1 + exp(-x)) in fp32, whose every element takes the same path."""

import bik
import pytest
import torch
import torch.nn.functional as F
from bik.runtime import cpu_ext
from bik.testing import rows_alone_vs_batched

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")

FRONT_ENDS = {"mode": bik.batch_invariant_mode, "enabled": bik.enabled}
SIZES = (1, 3, 5, 8, 16)


# Not a multiple of the CPU's SIMD step (16 floats on AVX2, 32 on AVX-512): alone and in a
# batch a row's elements meet the vector body and the scalar tail differently. (176 was a
# multiple of AVX2's 16: there stock silu measured row-invariant.)
WIDTH = 172


def _pool(gen, dtype=torch.float32):
    return (4 * torch.randn(16, WIDTH, generator=gen)).to(dtype)


def _grad_rows(rows):
    x = rows[:, :WIDTH].detach().clone().requires_grad_()
    F.silu(x).backward(rows[:, WIDTH:])
    return x.grad


def test_stock_silu_is_not_row_invariant(gen):
    """Measured negative control: rows of batch sizes 3 to 16 differ from the row alone (19 of
    33 at width 176 on AVX-512; at 176 AVX2 has no tail, hence WIDTH). Stock silu_backward was measured row-invariant at this width; bik routes it anyway
    so that a gradient's formula matches the routed forward's."""
    assert not rows_alone_vs_batched(F.silu, _pool(gen), SIZES).ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("front", FRONT_ENDS)
def test_silu_rows_invariant_and_close_to_stock(front, dtype, gen):
    pool = _pool(gen, dtype)
    with torch.no_grad(), FRONT_ENDS[front]():
        report = rows_alone_vs_batched(F.silu, pool, SIZES)
        got = F.silu(pool)
    assert report.ok, report.summary()
    torch.testing.assert_close(got, F.silu(pool))
    assert bik.mode_stats().routed.get("aten.silu.default", 0) > 0


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_silu_grads_rows_invariant_and_close_to_stock(front, gen):
    pool = torch.cat([_pool(gen), torch.randn(16, WIDTH, generator=gen)], dim=1)
    with FRONT_ENDS[front]():
        report = rows_alone_vs_batched(_grad_rows, pool, SIZES)
        got = _grad_rows(pool)
    assert report.ok, report.summary()
    torch.testing.assert_close(got, _grad_rows(pool), rtol=1e-5, atol=1e-6)

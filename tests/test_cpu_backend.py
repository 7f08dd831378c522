"""The CPU backend (fixed-order C++ kernels): invariance, accuracy, layouts, edge cases, opcheck.

Invariance is exact (torch.equal) and the same harness provably fails on stock torch.mm and on
a batch-dependent reference (tests/test_harness.py).
"""

import bik
import cases
import pytest
import torch
from bik.runtime import cpu_ext
from bik.testing.harness import M_SWEEP
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")

SHAPES = [(64, 64), (48, 33), (40, 128), (17, 255)]  # K: powers of two and odd


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_matmul_rows_invariant_over_m_sweep(dtype):
    cases.check_matmul_invariance("cpu", dtype, M_SWEEP, SHAPES[:2], probe_batch=40)


@pytest.mark.parametrize("shape", SHAPES[2:])
def test_matmul_rows_invariant_more_shapes(shape):
    cases.check_matmul_invariance("cpu", torch.float32, (1, 3, 4, 8, 31, 64, 127), [shape])


def test_matmul_invariant_llama_width():
    cases.check_matmul_invariance("cpu", torch.bfloat16, (1, 2, 4, 16, 64), [(256, 4096)])


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_rms_norm_rows_invariant(dtype):
    cases.check_rms_norm_invariance("cpu", dtype, M_SWEEP, (111, 500, 4096), probe_batch=40)


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_bmm_rows_and_entries_invariant(dtype):
    cases.check_bmm_invariance("cpu", dtype, (1, 2, 4, 7, 31, 64))


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("mnk", [(1, 64, 64), (19, 99, 989), (64, 256, 1024)])
def test_matmul_accuracy(dtype, mnk, gen):
    cases.check_matmul_accuracy("cpu", dtype, *mnk, gen)


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("hidden", [1, 111, 4096])
def test_rms_norm_accuracy(dtype, hidden, gen):
    cases.check_rms_norm_accuracy("cpu", dtype, 9, hidden, gen)


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_layouts_agree(dtype, gen):
    cases.check_layouts_agree("cpu", dtype, gen)


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_empty_dims(dtype):
    cases.check_empty_dims("cpu", dtype)


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_non_finite_stays_in_its_row(dtype, gen):
    cases.check_non_finite("cpu", dtype, gen)


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_fused_add_rms_norm_equals_unfused(dtype, gen):
    cases.check_fused_equals_unfused("cpu", dtype, gen)


def test_opcheck(gen):
    cases.check_opcheck("cpu", gen)


@settings(deadline=None, derandomize=True, max_examples=60)
@given(m=st.integers(1, 70), n=st.integers(1, 70), k=st.integers(0, 90), row=st.integers(0, 69),
       a_t=st.booleans(), b_t=st.booleans(), step=st.integers(1, 3),
       dtype=st.sampled_from(cases.DTYPES), bias=st.booleans())
def test_hypothesis_shapes_and_strides(m, n, k, row, a_t, b_t, step, dtype, bias):
    """Any shape and layout: a row alone equals it in the batch, layouts equal contiguous copies,
    and the result is accurate."""
    gen = torch.Generator().manual_seed(m * 10_000 + n * 100 + k)
    a = cases.randn(gen, k, m, dtype=dtype).t() if a_t else cases.randn(gen, m, k, dtype=dtype)
    b = cases.randn(gen, n * step, k, dtype=dtype).t()[:, ::step] if b_t else \
        cases.randn(gen, k, n * step, dtype=dtype)[:, ::step]
    c = cases.randn(gen, n) if bias else None
    row %= m
    full = bik.matmul(a, b, c)
    assert torch.equal(full, bik.matmul(a.contiguous(), b.contiguous(), c))
    assert torch.equal(full[row], bik.matmul(a[row:row + 1], b, c)[0])
    ref = a.double() @ b.double() + (0 if c is None else c.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert torch.allclose(full.double(), ref, atol=tol * (1 + k) ** 0.5, rtol=tol)

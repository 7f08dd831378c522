"""bik.matmul / bik.linear / bik.bmm forward: invariance, accuracy, layouts, edge cases, opcheck.

Targets: the CPU backend (fixed-order C++ kernels) and the Triton kernels run on the CPU by
TRITON_INTERPRET=1 (their own process), each at the sizes it affords. Invariance is exact
(torch.equal); the same harness provably fails on stock torch.mm and on a batch-dependent
reference (tests/test_harness.py), and in the interpreter on bik's own Triton program with a
BLOCK_K chosen by M (below).

What the interpreter proves: bik's real Triton programs (grid and tile-order math, int64
offsets, masks for M/N/K not multiples of the tiles, arbitrary strides, the K loop order, bias,
the fp32 accumulation and the output casts) compute correct results, and each row's result is
independent of M and of the row's position in its tile *given a dot that treats every row of a
tile alike*. conftest.py swaps the interpreter's numpy dot (position-dependent fp32, broken
bf16) for such a fixed-tree dot and makes its fp32->bf16 cast round to nearest even.

What it cannot prove: that the GPU's tensor-core dot treats every row of a tile alike, or
anything about compiled code generation. Those are the GPU tests' job
(tests/matmul/test_matmul_gpu.py, tests/matmul/test_matmul_cuda_gpu.py);
tests/test_triton_compile.py compiles every config for sm_90 and sm_80.
"""

from __future__ import annotations

import bik
import pytest
import torch
from bik.testing.harness import M_SWEEP
from bik.testing.suites import bmm_suite, matmul_suite
from checks import DTYPES, accuracy_bound, assert_invariant, max_err, randn
from hypothesis import given, settings
from hypothesis import strategies as st
from targets import targets
from torch.library import opcheck

SHAPES = [(64, 64), (48, 33), (40, 128), (17, 255)]  # (N, K) on the CPU: K powers of two and odd
INTERPRETER_MS = (1, 2, 3, 16, 17, 33)
INTERPRETER_SHAPES = [(40, 33), (32, 64)]


def _fp32_only_in_the_interpreter(target, dtype):
    if target.small and dtype != torch.float32:
        pytest.skip("fp32 only in the interpreter (~1 ms a program)")


def check_matmul_invariance(target, dtype, ms, shapes, probe_batch=0):
    assert_invariant(matmul_suite(device=target.device, dtype=dtype, backend=target.backend,
                                  ms=ms, shapes=shapes, probe_batch=probe_batch))


# ---- invariance ----------------------------------------------------------------------------


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_rows_invariant(target, dtype):
    if target.small:
        check_matmul_invariance(target, dtype, INTERPRETER_MS, INTERPRETER_SHAPES, probe_batch=18)
    else:
        check_matmul_invariance(target, dtype, M_SWEEP, SHAPES[:2], probe_batch=40)


@pytest.mark.parametrize("target", targets("cpu"))
@pytest.mark.parametrize("shape", SHAPES[2:])
def test_matmul_rows_invariant_more_shapes(target, shape):
    check_matmul_invariance(target, torch.float32, (1, 3, 4, 8, 31, 64, 127), [shape])


@pytest.mark.parametrize("target", targets("cpu"))
def test_matmul_invariant_llama_width(target):
    check_matmul_invariance(target, torch.bfloat16, (1, 2, 4, 16, 64), [(256, 4096)])


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_rows_and_entries_invariant(target, dtype):
    _fp32_only_in_the_interpreter(target, dtype)
    ms, n, k = ((1, 2, 17), 20, 33) if target.small else ((1, 2, 4, 7, 31, 64), 24, 40)
    assert_invariant(bmm_suite(device=target.device, dtype=dtype, backend=target.backend, ms=ms,
                               n=n, k=k))


@pytest.mark.parametrize("target", targets("interpreter"))
def test_same_suite_rejects_a_k_step_chosen_by_m(target, monkeypatch):
    """Negative control: the suite's own invariance check, on the suite's own dot, rejects the
    same Triton program when BLOCK_K is picked by M (what M-bucketed tile tables risk)."""
    import dataclasses

    from bik.ops.matmul import triton as triton_matmul

    fixed = triton_matmul.matmul_config
    launch = triton_matmul.launch_matmul

    def launch_with_k_step_by_m(a, b, bias, out):
        block_k = 16 if a.shape[1] == 1 else 64
        monkeypatch.setattr(triton_matmul, "matmul_config",
                            lambda *key: dataclasses.replace(fixed(*key), block_k=block_k))
        triton_matmul._plan.cache_clear()  # launch plans are cached per key, without M
        launch(a, b, bias, out)

    monkeypatch.setattr(triton_matmul, "launch_matmul", launch_with_k_step_by_m)
    try:
        with pytest.raises(AssertionError, match="rows differ"):
            check_matmul_invariance(target, torch.float32, INTERPRETER_MS, [(32, 64)],
                                    probe_batch=18)
    finally:
        triton_matmul._plan.cache_clear()  # no plan built from the patched table survives


# ---- accuracy against fp64 -----------------------------------------------------------------

# The bound is checks.accuracy_bound. Measured (CPU backend, 15 shapes up to K = 4096): fp32
# matmul up to 8.8x torch's error (one sequential K sum vs MKL's blocked sums); bf16/fp16 1.0x
# (the output rounding dominates). Bounds are about twice the worst measured ratio.
ACCURACY_MNK = [(1, 64, 64), (19, 99, 989), (64, 256, 1024)]
INTERPRETER_ACCURACY_MNK = [(1, 16, 16), (19, 45, 70), (33, 64, 31)]


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_accuracy(target, dtype, case, gen):
    m, n, k = (INTERPRETER_ACCURACY_MNK if target.small else ACCURACY_MNK)[case]
    a, b, bias = randn(gen, m, k, dtype=dtype), randn(gen, k, n, dtype=dtype), randn(gen, n)
    ref = a.double() @ b.double() + bias.double()
    got = bik.matmul(a, b, bias, backend=target.backend)
    indep = (torch.mm(a.float(), b.float()) + bias).to(dtype)
    assert got.dtype == dtype and got.shape == (m, n)
    assert max_err(got, ref) <= accuracy_bound(dtype, indep, ref)


# ---- layouts and edge cases ----------------------------------------------------------------


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_layouts_agree(target, dtype, gen):
    """Strided, transposed and batched views give the bits of contiguous copies."""
    backend, m, n, k = target.backend, 19, 40, 33
    a = randn(gen, m, k, dtype=dtype)
    w = randn(gen, n, k, dtype=dtype)
    ref = bik.matmul(a, w.t().contiguous(), backend=backend)
    assert torch.equal(bik.matmul(a, w.t(), backend=backend), ref)  # W.t() view, no copy
    assert torch.equal(bik.linear(a, w, backend=backend), ref)
    wide = randn(gen, k, 2 * n, dtype=dtype)
    assert torch.equal(bik.matmul(a, wide[:, ::2], backend=backend),
                       bik.matmul(a, wide[:, ::2].contiguous(), backend=backend))
    at = randn(gen, k, m, dtype=dtype).t()  # column-major a
    assert torch.equal(bik.matmul(at, w.t(), backend=backend),
                       bik.matmul(at.contiguous(), w.t(), backend=backend))
    a3 = a.reshape(1, m, k).expand(3, m, k)
    assert torch.equal(bik.matmul(a3, w.t(), backend=backend), ref.expand(3, m, n))
    assert torch.equal(bik.matmul(a[0], w.t(), backend=backend), ref[0])  # 1-D a
    batched_b = torch.stack([w.t(), w.t().flip(0)])
    bmm = bik.bmm(a3[:2], batched_b, backend=backend)
    assert torch.equal(bmm[0], ref)
    assert torch.equal(bmm[1], bik.matmul(a, w.t().flip(0), backend=backend))
    assert torch.equal(bik.bmm(a3[:2, :1], batched_b, backend=backend), bmm[:, :1])


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_dims(target, dtype):
    _fp32_only_in_the_interpreter(target, dtype)
    backend = target.backend
    z = bik.matmul(torch.zeros(0, 5, dtype=dtype), torch.ones(5, 3, dtype=dtype), backend=backend)
    assert z.shape == (0, 3)
    bias = torch.arange(3.0)
    k0 = bik.matmul(torch.zeros(4, 0, dtype=dtype), torch.zeros(0, 3, dtype=dtype), bias,
                    backend=backend)
    assert torch.equal(k0, bias.to(dtype).expand(4, 3))
    assert bik.matmul(torch.ones(2, 5, dtype=dtype), torch.ones(5, 0, dtype=dtype),
                      backend=backend).shape == (2, 0)


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_stays_in_its_row(target, dtype, gen):
    """NaN/inf stay in their own row: other rows keep the bits they have without them."""
    _fp32_only_in_the_interpreter(target, dtype)
    backend = target.backend
    a, b = randn(gen, 6, 32, dtype=dtype), randn(gen, 32, 20, dtype=dtype)
    clean = bik.matmul(a, b, backend=backend)
    a[2, 5] = float("nan")
    a[4, 7] = float("inf")
    out = bik.matmul(a, b, backend=backend)
    assert out[2].isnan().all()
    assert not out[4].isfinite().any()  # +-inf, or NaN where inf meets opposite signs
    keep = [0, 1, 3, 5]
    assert torch.equal(out[keep], clean[keep])
    b0 = torch.zeros(32, 20, dtype=dtype)
    assert bik.matmul(a, b0, backend=backend)[4].isnan().all()  # inf * 0 = NaN


@pytest.mark.parametrize("target", targets())
def test_opcheck(target, gen):
    backend, dtype = target.backend, torch.float32
    a, b, bias = randn(gen, 5, 24, dtype=dtype), randn(gen, 24, 16, dtype=dtype), randn(gen, 16)
    samples = [
        (torch.ops.bik.matmul.default, (a, b, bias, None, backend)),
        (torch.ops.bik.matmul.default, (a, b.t().contiguous().t(), None, torch.float32, backend)),
        (torch.ops.bik.bmm.default, (a.expand(2, 5, 24).contiguous(),
                                     b.expand(2, 24, 16).contiguous(), None, backend)),
    ]
    for op, args in samples:
        opcheck(op, args)


# ---- hypothesis ----------------------------------------------------------------------------


@pytest.mark.parametrize("target", targets("cpu"))
@settings(deadline=None, derandomize=True, max_examples=60)
@given(m=st.integers(1, 70), n=st.integers(1, 70), k=st.integers(0, 90), row=st.integers(0, 69),
       a_t=st.booleans(), b_t=st.booleans(), step=st.integers(1, 3),
       dtype=st.sampled_from(DTYPES), bias=st.booleans())
def test_hypothesis_shapes_and_strides(target, m, n, k, row, a_t, b_t, step, dtype, bias):
    """Any shape and layout: a row alone equals it in the batch, layouts equal contiguous copies,
    and the result is accurate."""
    backend = target.backend
    gen = torch.Generator().manual_seed(m * 10_000 + n * 100 + k)
    a = randn(gen, k, m, dtype=dtype).t() if a_t else randn(gen, m, k, dtype=dtype)
    b = randn(gen, n * step, k, dtype=dtype).t()[:, ::step] if b_t else \
        randn(gen, k, n * step, dtype=dtype)[:, ::step]
    c = randn(gen, n) if bias else None
    row %= m
    full = bik.matmul(a, b, c, backend=backend)
    assert torch.equal(full, bik.matmul(a.contiguous(), b.contiguous(), c, backend=backend))
    assert torch.equal(full[row], bik.matmul(a[row:row + 1], b, c, backend=backend)[0])
    ref = a.double() @ b.double() + (0 if c is None else c.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert torch.allclose(full.double(), ref, atol=tol * (1 + k) ** 0.5, rtol=tol)


@pytest.mark.parametrize("target", targets("interpreter"))
@settings(deadline=None, derandomize=True, max_examples=15)
@given(m=st.integers(1, 40), n=st.integers(1, 70), k=st.integers(1, 70),
       row=st.integers(0, 39), transposed=st.booleans())
def test_hypothesis_matmul_row_alone_equals_row_in_batch(target, m, n, k, row, transposed):
    """The interpreter's (smaller) version: fp32, B contiguous or as weight.t()."""
    backend = target.backend
    gen = torch.Generator().manual_seed(m * 10_000 + n * 100 + k)
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(n, k, generator=gen).t() if transposed else torch.randn(k, n, generator=gen)
    row = row % m
    full = bik.matmul(a, b, backend=backend)
    assert torch.equal(full[row], bik.matmul(a[row:row + 1], b, backend=backend)[0])
    assert torch.allclose(full.double(), a.double() @ b.double(), atol=1e-4, rtol=1e-4)

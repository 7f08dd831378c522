"""The Triton softmax / log_softmax / mean kernels, run on the CPU by TRITON_INTERPRET=1 (`make
test` runs the interpreter tests in their own process; elsewhere this module is skipped).

What this proves: the real Triton programs — the chunk loop over a row, masks for rows that
are not a multiple of BLOCK, int64 row offsets, strides, the three softmax passes, the casts —
compute correct results, and each row's bits are independent of M and of its position, with
the interpreter's BLOCK of 64 so that rows of a few hundred cross several chunks. What it
cannot prove: the bits of the GPU's compiled tl.sum tree or ex2/lg2 (tests/test_gpu.py
territory); tests/test_triton_compile.py compiles every config for sm_90 and sm_80.
"""

import dataclasses

import bik
import pytest
import reduction_cases as rc
import torch
from conftest import INTERPRETER
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 (own process)"),
]

MS = (1, 2, 3, 16, 17, 33)
LENGTHS = (1, 111, 128)  # odd, and a power of two of two chunks


@pytest.mark.parametrize("dtype", rc.DTYPES)
def test_rows_invariant(dtype):
    # every position among neighbours for fp32 only: the interpreter costs ~1 ms per program
    rc.check_invariance("triton", dtype, MS, LENGTHS,
                        probe_batch=9 if dtype == torch.float32 else 0)


@pytest.mark.parametrize("dtype", rc.DTYPES)
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "mean"])
def test_accuracy_vs_fp64(op, dtype, gen):
    for n in (1, 64, 500):
        rc.check_accuracy("triton", op, dtype, 5, n, gen)
        if dtype != torch.float32:
            rc.check_accuracy("triton", op, dtype, 5, n, gen, out_dtype=torch.float32)


@pytest.mark.parametrize("dtype", rc.DTYPES)
def test_output_dtypes_and_half_to_float(dtype, gen):
    rc.check_output_dtypes("triton", dtype, gen)


def test_dims_and_layouts(gen):
    rc.check_dims_and_layouts("triton", torch.float32, gen)


def test_empty():
    rc.check_empty("triton", torch.float32)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: inf - inf
@pytest.mark.parametrize("dtype", rc.DTYPES)
def test_non_finite_stays_in_its_row(dtype, gen):
    rc.check_non_finite("triton", dtype, gen)


def test_opcheck(gen):
    rc.check_opcheck("triton", gen)


@settings(deadline=None, derandomize=True, max_examples=15)
@given(m=st.integers(1, 20), n=st.integers(1, 200), row=st.integers(0, 19),
       op=st.sampled_from(["softmax", "log_softmax", "mean"]), transposed=st.booleans())
def test_hypothesis_row_alone_equals_row_in_batch(m, n, row, op, transposed):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = (torch.randn(n, m, generator=gen).t() if transposed else
         torch.randn(m, n, generator=gen)) * 3
    row %= m
    fn = ((lambda t: bik.mean(t, -1, backend="triton")) if op == "mean" else
          (lambda t: getattr(bik, op)(t, backend="triton")))
    full = fn(x)
    assert torch.equal(full[row], fn(x[row:row + 1])[0])
    ref = x.double().mean(-1) if op == "mean" else getattr(torch, op)(x.double(), -1)
    assert torch.allclose(full.double(), ref, atol=1e-5, rtol=1e-5)


def test_harness_catches_a_block_chosen_by_m(gen, monkeypatch):
    """Negative control on this path: the same Triton program with BLOCK picked by the number
    of rows (what a row-count-tuned tiling risks) must fail the harness."""
    from bik.ops.reductions import triton as triton_reductions
    from bik.testing import rows_alone_vs_batched

    fixed = triton_reductions.reduction_config
    x = torch.randn(12, 500, generator=gen) * 3
    fn = lambda t: bik.softmax(t, backend="triton")
    ms = (1, 4, 12)
    assert rows_alone_vs_batched(fn, x, ms).ok  # the fixed BLOCK: invariant
    launch = triton_reductions.launch_softmax

    def launch_with_block_by_m(t, out, *, log):
        block = 16 if t.shape[0] == 1 else 64
        monkeypatch.setattr(triton_reductions, "reduction_config",
                            lambda *key: dataclasses.replace(fixed(*key), block=block))
        launch(t, out, log=log)

    monkeypatch.setattr(triton_reductions, "launch_softmax", launch_with_block_by_m)
    assert not rows_alone_vs_batched(fn, x, ms).ok

"""The Triton kernels, run on the CPU by TRITON_INTERPRET=1 (`make test` runs this module in
its own process with the variable set; elsewhere it is skipped).

What this proves: bik's real Triton programs — grid and tile-order math, int64 offsets,
masks for M/N/K not multiples of the tiles, arbitrary strides, the K loop order, bias, the
fp32 accumulation and the output casts — compute correct results, and each row's result is
independent of M and of the row's position in its tile *given a dot that treats every row of a
tile alike*. conftest.py swaps the interpreter's numpy dot (position-dependent fp32, broken
bf16) for such a sequential dot and makes its fp32->bf16 cast round to nearest even.

What it cannot prove: that the GPU's tensor-core dot treats every row of a tile alike, or
anything about compiled code generation. Those are the GPU tests' job (tests/test_gpu.py);
tests/test_triton_compile.py compiles every config for sm_90 and sm_80.
"""

import bik
import cases
import pytest
import torch
from conftest import INTERPRETER
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 (own process)"),
]

MS = (1, 2, 3, 16, 17, 33)


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_matmul_rows_invariant(dtype):
    cases.check_matmul_invariance("triton", dtype, MS, [(40, 33), (32, 64)], probe_batch=18)


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_rms_norm_rows_invariant(dtype):
    cases.check_rms_norm_invariance("triton", dtype, MS, (1, 111, 128), probe_batch=12)


def test_bmm_rows_and_entries_invariant():
    cases.check_bmm_invariance("triton", torch.float32, (1, 2, 17), n=20, k=33)


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("mnk", [(1, 16, 16), (19, 45, 70), (33, 64, 31)])
def test_matmul_accuracy(dtype, mnk, gen):
    cases.check_matmul_accuracy("triton", dtype, *mnk, gen)


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_rms_norm_accuracy(dtype, gen):
    cases.check_rms_norm_accuracy("triton", dtype, 5, 200, gen)


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_layouts_agree(dtype, gen):
    cases.check_layouts_agree("triton", dtype, gen)


def test_empty_dims():
    cases.check_empty_dims("triton", torch.float32)


def test_non_finite_stays_in_its_row(gen):
    cases.check_non_finite("triton", torch.float32, gen)


@pytest.mark.parametrize("dtype", cases.DTYPES)
def test_fused_add_rms_norm_equals_unfused(dtype, gen):
    cases.check_fused_equals_unfused("triton", dtype, gen)


def test_opcheck(gen):
    cases.check_opcheck("triton", gen)


@settings(deadline=None, derandomize=True, max_examples=15)
@given(m=st.integers(1, 40), n=st.integers(1, 70), k=st.integers(1, 70),
       row=st.integers(0, 39), transposed=st.booleans())
def test_hypothesis_matmul_row_alone_equals_row_in_batch(m, n, k, row, transposed):
    gen = torch.Generator().manual_seed(m * 10_000 + n * 100 + k)
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(n, k, generator=gen).t() if transposed else torch.randn(k, n, generator=gen)
    row = row % m
    full = bik.matmul(a, b, backend="triton")
    assert torch.equal(full[row], bik.matmul(a[row:row + 1], b, backend="triton")[0])
    assert torch.allclose(full.double(), a.double() @ b.double(), atol=1e-4, rtol=1e-4)


def test_same_suite_rejects_a_k_step_chosen_by_m(monkeypatch):
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
        launch(a, b, bias, out)

    monkeypatch.setattr(triton_matmul, "launch_matmul", launch_with_k_step_by_m)
    with pytest.raises(AssertionError, match="rows differ"):
        cases.check_matmul_invariance("triton", torch.float32, MS, [(32, 64)], probe_batch=18)

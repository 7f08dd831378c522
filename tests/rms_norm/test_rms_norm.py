"""bik.rms_norm and its fused residual add forward: invariance, accuracy, edge cases, opcheck.

Targets: the CPU backend (fixed-order C++ kernels) and the Triton kernels run on the CPU by
TRITON_INTERPRET=1 (their own process; see tests/matmul/test_matmul.py for what the
interpreter can and cannot prove), each at the sizes it affords. Invariance is exact
(torch.equal): every row alone vs inside the batch over the M sweep, and a probe at every
position; the harness provably fails on a batch-dependent rms_norm (tests/test_harness.py).
The fused form (``residual=``) returns h = x + r rounded to x.dtype and exactly the plain
rms_norm of h. GPU: tests/rms_norm/test_rms_norm_gpu.py.
"""

from __future__ import annotations

import bik
import pytest
import torch
from bik.testing.harness import M_SWEEP, same_bits
from bik.testing.suites import rms_norm_suite
from checks import DTYPES, accuracy_bound, assert_invariant, max_err, randn
from targets import targets
from torch.library import opcheck


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_invariant(target, dtype):
    if target.small:
        ms, hiddens, probe_batch = (1, 2, 3, 16, 17, 33), (1, 111, 128), 12
    else:
        ms, hiddens, probe_batch = M_SWEEP, (111, 500, 4096), 40
    assert_invariant(rms_norm_suite(device=target.device, dtype=dtype, backend=target.backend,
                                    ms=ms, hiddens=hiddens, probe_batch=probe_batch))


# The bound is checks.accuracy_bound. Measured (CPU backend, 15 shapes up to H = 4096): fp32
# rms_norm up to 1.3x torch's error; bf16/fp16 1.0x (the output rounding dominates). Bounds are
# about twice the worst measured ratio.


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_accuracy(target, dtype, gen):
    m, hiddens = (5, (200,)) if target.small else (9, (1, 111, 4096))
    for hidden in hiddens:
        x, w = randn(gen, m, hidden, dtype=dtype), randn(gen, hidden, dtype=dtype)
        x64 = x.double()
        ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        got = bik.rms_norm(x, w, 1e-6, backend=target.backend)
        indep = torch.nn.functional.rms_norm(x.float(), (hidden,), w.float(), 1e-6).to(dtype)
        assert got.dtype == dtype and got.shape == x.shape, hidden
        assert max_err(got, ref) <= accuracy_bound(dtype, indep, ref), hidden


def _fp32_only_in_the_interpreter(target, dtype):
    if target.small and dtype != torch.float32:
        pytest.skip("fp32 only in the interpreter (~1 ms a program)")


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_dims(target, dtype):
    _fp32_only_in_the_interpreter(target, dtype)
    assert bik.rms_norm(torch.zeros(0, 7, dtype=dtype), torch.ones(7, dtype=dtype),
                        backend=target.backend).shape == (0, 7)


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_stays_in_its_row(target, dtype, gen):
    """NaN/inf stay in their own row: other rows keep the bits they have without them."""
    _fp32_only_in_the_interpreter(target, dtype)
    x, w = randn(gen, 5, 48, dtype=dtype), randn(gen, 48, dtype=dtype)
    clean = bik.rms_norm(x, w, backend=target.backend)
    x[1, 3] = float("nan")
    x[3, 0] = float("inf")
    out = bik.rms_norm(x, w, backend=target.backend)
    assert out[1].isnan().all()  # NaN poisons the row's mean
    assert out[3, 0].isnan() and (out[3, 1:] == 0).all()  # inf: rstd = 0, inf * 0 = NaN
    assert torch.equal(out[[0, 2, 4]], clean[[0, 2, 4]])


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_equals_unfused(target, dtype, gen):
    x, r, w = (randn(gen, 7, 96, dtype=dtype), randn(gen, 7, 96, dtype=dtype),
               randn(gen, 96, dtype=dtype))
    out, h = bik.rms_norm(x, w, residual=r, backend=target.backend)
    assert torch.equal(h, (x.float() + r.float()).to(dtype))
    assert torch.equal(out, bik.rms_norm(h, w, backend=target.backend))


@pytest.mark.parametrize("target", targets())
def test_opcheck(target, gen):
    backend, dtype = target.backend, torch.float32
    x, r, w = randn(gen, 3, 40, dtype=dtype), randn(gen, 3, 40, dtype=dtype), randn(gen, 40)
    opcheck(torch.ops.bik.rms_norm.default, (x, w, 1e-6, backend))
    opcheck(torch.ops.bik.fused_add_rms_norm.default, (x, w, 1e-5, r, backend))


@pytest.mark.parametrize("target", targets("cpu"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_overlapping_half_rows_give_the_bits_of_a_copy(target, dtype, gen):
    # x.unfold gives rows that overlap (strides (1, 1)); their fp32 upcast comes back with
    # strides (1, 3), which the CPU kernel must not be handed as is.
    x = torch.randn(10, generator=gen).to(dtype).unfold(0, 8, 1)
    w = torch.randn(8, generator=gen).to(dtype)
    assert same_bits(bik.rms_norm(x, w, backend=target.backend),
                     bik.rms_norm(x.contiguous(), w, backend=target.backend))

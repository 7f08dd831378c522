"""bik.softmax, bik.log_softmax and bik.mean on the CPU backend (fixed-order C++ kernels):
invariance over the M sweep and probe positions, the kernels against a literal implementation
of their contract (csrc/cpu/contract.h), accuracy, dtypes, dims, NaN/inf, errors, opcheck,
torch.compile, and the harness rejecting M-dependent references. The same bodies run on the
Triton kernels in tests/test_reductions_interpreter.py."""

import ctypes
import ctypes.util
import inspect

import bik
import cases
import numpy as np
import pytest
import reduction_cases as rc
import torch
from bik import configs
from bik.ops.reductions.cpu import mean_f32, softmax_f32
from bik.runtime import cpu_ext
from bik.testing import split_by_m_mean, split_by_m_softmax
from bik.testing.harness import M_SWEEP
from bik.testing.suites import reduction_suite
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")

LENGTHS = (1, 111, 500, 4096)  # odd and powers of two


@pytest.mark.parametrize("dtype", rc.DTYPES)
def test_rows_invariant_over_m_sweep(dtype):
    rc.check_invariance("cpu", dtype, M_SWEEP, LENGTHS[:3])


@pytest.mark.parametrize("dtype", rc.DTYPES)
def test_rows_invariant_long_rows_and_every_position(dtype):
    rc.check_invariance("cpu", dtype, (1, 2, 3, 4, 7, 8, 16, 31, 64), LENGTHS[3:],
                        probe_batch=24)


@pytest.mark.parametrize("reference", [split_by_m_softmax, split_by_m_mean])
def test_harness_rejects_a_sum_split_by_m(reference, gen):
    rc.check_harness_rejects_split_by_m(reference, gen)


@pytest.mark.parametrize("dtype", rc.DTYPES)
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "mean"])
@pytest.mark.parametrize("n", LENGTHS + (50_000,))
def test_accuracy_vs_fp64(op, dtype, n, gen):
    rc.check_accuracy("cpu", op, dtype, 9, n, gen)
    if dtype != torch.float32:
        rc.check_accuracy("cpu", op, dtype, 9, n, gen, out_dtype=torch.float32)


@pytest.mark.parametrize("dtype", rc.DTYPES)
def test_output_dtypes_and_half_to_float(dtype, gen):
    rc.check_output_dtypes("cpu", dtype, gen)


@pytest.mark.parametrize("dtype", rc.DTYPES)
def test_dims_and_layouts(dtype, gen):
    rc.check_dims_and_layouts("cpu", dtype, gen)


@pytest.mark.parametrize("dtype", rc.DTYPES)
def test_empty(dtype):
    rc.check_empty("cpu", dtype)


@pytest.mark.parametrize("dtype", rc.DTYPES)
def test_non_finite_stays_in_its_row(dtype, gen):
    rc.check_non_finite("cpu", dtype, gen)


def test_opcheck(gen):
    rc.check_opcheck("cpu", gen)


def test_reduction_config_never_sees_m():
    assert list(inspect.signature(configs.reduction_config).parameters) == ["n", "arch"]


# ---- the C++ kernels against a literal implementation of contract.h ---------------------------

_LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
for _name in ("expf", "logf"):
    getattr(_LIBM, _name).restype = ctypes.c_float
    getattr(_LIBM, _name).argtypes = [ctypes.c_float]


def _lanes16(terms: np.ndarray) -> np.float32:
    """s[j % 16] = s[j % 16] + terms[j], j ascending; then the 8, 4, 2, 1 fold (all fp32)."""
    s = np.zeros(16, np.float32)
    for j0 in range(0, len(terms), 16):
        chunk = terms[j0:j0 + 16]
        s[:len(chunk)] = s[:len(chunk)] + chunk
    for w in (8, 4, 2, 1):
        s[:w] = s[:w] + s[w:2 * w]
    return s[0]


def _contract_softmax(row: np.ndarray, log: bool) -> np.ndarray:
    mx = row.max()
    d = row - mx
    e = np.array([_LIBM.expf(float(v)) for v in d], np.float32)
    total = _lanes16(e)
    if log:
        return d - np.float32(_LIBM.logf(float(total)))
    return e / total


@pytest.mark.parametrize("n", [1, 15, 16, 17, 111, 500])
def test_cpu_kernels_follow_the_contract_bit_for_bit(n, gen):
    x = torch.randn(4, n, generator=gen) * 5
    for log in (False, True):
        got = torch.empty(4, n)
        softmax_f32(x, got, log=log)
        want = np.stack([_contract_softmax(r, log) for r in x.numpy()])
        assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), log
    got = torch.empty(4)
    mean_f32(x, got)
    want = np.array([_lanes16(r) / np.float32(n) for r in x.numpy()], np.float32)
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))


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


# ---- errors -----------------------------------------------------------------------------------

X = torch.zeros(4, 8)


@pytest.mark.parametrize(
    "call, exc, pattern",
    [
        (lambda: bik.softmax(X.double()), TypeError, "bik.softmax: x has dtype float64"),
        (lambda: bik.log_softmax(X.int()), TypeError, "bik.log_softmax: x has dtype int32"),
        (lambda: bik.mean(X.double(), 0), TypeError, "bik.mean: x has dtype float64"),
        (lambda: bik.softmax(X, 2), ValueError,
         r"bik.softmax: dim 2 is out of range for x of shape \[4, 8\]"),
        (lambda: bik.log_softmax(X, -3), ValueError,
         r"bik.log_softmax: dim -3 is out of range for x of shape \[4, 8\]"),
        (lambda: bik.mean(X, (0, 5)), ValueError,
         r"bik.mean: dim 5 is out of range for x of shape \[4, 8\]"),
        (lambda: bik.mean(X, (1, -1)), ValueError,
         r"bik.mean: dim \[1, -1\] names a dim twice for x of shape \[4, 8\]"),
        (lambda: bik.mean(X, 1.0), TypeError, "bik.mean: dim must be an int"),
        (lambda: bik.softmax(X, (0, 1)), TypeError, "bik.softmax: dim must be an int"),
        (lambda: bik.softmax(X, dtype=torch.int32), TypeError, "bik.softmax: dtype torch.int32"),
        (lambda: bik.mean(X, 0, dtype=torch.float64), TypeError, "bik.mean: dtype torch.float64"),
        (lambda: bik.softmax("x"), TypeError, "bik.softmax: x must be a torch.Tensor, got str"),
        (lambda: bik.mean(X, 0, backend="gpu"), ValueError, "bik.mean: unknown backend 'gpu'"),
    ],
)
def test_bad_input_names_op_and_shape(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_registered_ops_check_inputs_too():
    with pytest.raises(ValueError, match=r"bik.mean: dim \[0, 0\] names a dim twice"):
        torch.ops.bik.mean(X, [0, 0], False, None, "cpu")
    with pytest.raises(ValueError, match="bik.softmax: dim 9 is out of range"):
        torch.ops.bik.softmax(X, 9, None, "cpu")


# ---- torch.compile ----------------------------------------------------------------------------

def _block(x):
    p = bik.softmax(x, -1)
    return p, bik.log_softmax(x, 1, dtype=torch.float32), bik.mean(p, (0, 2), keepdim=True)


def test_compiled_fullgraph_matches_eager_bits(gen):
    x = torch.randn(5, 3, 64, generator=gen).half()
    torch._dynamo.reset()
    got = torch.compile(_block, fullgraph=True, dynamic=False)(x)
    for e, g in zip(_block(x), got):
        assert torch.equal(e, g)
    ops = []

    def capture(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    torch.compile(_block, fullgraph=True, backend=capture)(x)
    assert {"bik.softmax", "bik.log_softmax", "bik.mean"} <= set(ops)


# ---- hypothesis -------------------------------------------------------------------------------

@settings(deadline=None, derandomize=True, max_examples=60)
@given(m=st.integers(1, 40), n=st.integers(1, 300), row=st.integers(0, 39),
       dtype=st.sampled_from(rc.DTYPES), op=st.sampled_from(["softmax", "log_softmax", "mean"]),
       transposed=st.booleans())
def test_hypothesis_row_alone_equals_row_in_batch(m, n, row, dtype, op, transposed):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = (torch.randn(n, m, generator=gen).t() if transposed else
         torch.randn(m, n, generator=gen)).to(dtype) * 3
    row %= m
    fn = (lambda t: bik.mean(t, -1)) if op == "mean" else getattr(bik, op)
    full = fn(x)
    assert torch.equal(full[row], fn(x[row:row + 1])[0])
    assert torch.equal(full, fn(x.contiguous()))


# ---- GPU (skipped without CUDA) ---------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", rc.DTYPES)
def test_gpu_rows_invariant_and_accurate(dtype):
    """The compiled Triton kernels at real sizes: every row at M up to 4096 equals the row alone
    (one chunk, several chunks, a Llama-3 vocabulary), and accuracy vs fp64 on the device."""
    ms = (1, 2, 3, 4, 7, 8, 16, 31, 64, 127, 128, 255, 256, 1000, 4096)
    rc.assert_invariant(reduction_suite(device="cuda", dtype=dtype, backend="triton", ms=ms,
                                        lengths=(111, 4096)))
    rc.assert_invariant(reduction_suite(device="cuda", dtype=dtype, backend="triton",
                                        ms=(1, 2, 8, 64, 300), lengths=(128256,)))
    gen = torch.Generator().manual_seed(0)
    for op in ("softmax", "log_softmax", "mean"):
        for n in (1, 111, 4096, 128256):
            x = cases.randn(gen, 9, n, dtype=dtype).cuda() * 4
            ref = (x.double().mean(-1) if op == "mean" else
                   getattr(torch, op)(x.double(), -1))
            got = bik.mean(x, -1) if op == "mean" else getattr(bik, op)(x)
            indep = (x.float().mean(-1) if op == "mean" else
                     getattr(torch, op)(x.float(), -1)).to(dtype)
            scale = x.abs().max().item() if op == "mean" else ref.abs().max().item()
            bound = rc._bound(indep, ref, dtype, scale)
            assert rc._max_err(got, ref) <= bound, (op, n)

"""Test bodies for bik.softmax / bik.log_softmax / bik.mean, shared by the CPU-backend tests
(tests/test_reductions.py) and the Triton-interpreter tests (tests/test_reductions_interpreter.py),
so every backend runs the same assertions at the sizes it can afford."""

from __future__ import annotations

import bik
import torch
from bik.testing import rows_alone_vs_batched
from bik.testing.suites import reduction_suite
from cases import DTYPES, assert_invariant, randn
from torch.library import opcheck

__all__ = ["DTYPES"]

# Accuracy against fp64: bik's max error may be at most RATIO x the error of an independent
# implementation of the same output dtype (torch on the CPU, fp32 inside, one final rounding)
# plus FLOOR x eps(out dtype) x scale. Measured worst ratios (CPU backend, n up to 50000):
# softmax fp32 1.3x, log_softmax 1.0x, mean fp32 10.5x at n = 50000 (16 sequential lane sums vs
# torch's cascade sum; the floor term dominates there), half -> fp32 outputs up to 2.0x, bf16 /
# fp16 outputs 1.0x (the final rounding dominates). The same bounds as matmul's (cases.py).
ACCURACY_RATIO = {torch.float32: 16.0, torch.bfloat16: 2.0, torch.float16: 2.0}
ACCURACY_FLOOR = 2.0

OPS = {
    "softmax": (bik.softmax, torch.softmax),
    "log_softmax": (bik.log_softmax, torch.log_softmax),
}


def check_invariance(backend, dtype, ms, lengths, probe_batch=0):
    assert_invariant(reduction_suite(device="cpu", dtype=dtype, backend=backend, ms=ms,
                                     lengths=lengths, probe_batch=probe_batch))


def _max_err(x, ref):
    return (x.double() - ref).abs().max().item()


def _bound(indep, ref, out_dtype, scale):
    return (ACCURACY_RATIO[out_dtype] * _max_err(indep, ref)
            + ACCURACY_FLOOR * torch.finfo(out_dtype).eps * scale)


def accuracy_ratio(backend, op, dtype, rows, n, gen, out_dtype=None):
    """(bik's max error vs fp64, the bound) for one op on random data (also used to measure)."""
    x = randn(gen, rows, n, dtype=dtype) * 4
    out_dtype = out_dtype or dtype
    if op == "mean":
        ref = x.double().mean(-1)
        got = bik.mean(x, -1, dtype=out_dtype, backend=backend)
        indep = x.float().mean(-1).to(out_dtype)
        scale = x.abs().max().item()
    else:
        fn, torch_fn = OPS[op]
        ref = torch_fn(x.double(), -1)
        got = fn(x, -1, dtype=out_dtype, backend=backend)
        indep = torch_fn(x.float(), -1).to(out_dtype)
        scale = ref.abs().max().item()
    assert got.dtype == out_dtype and got.shape == ref.shape
    return _max_err(got, ref), _bound(indep, ref, out_dtype, scale)


def check_accuracy(backend, op, dtype, rows, n, gen, out_dtype=None):
    err, bound = accuracy_ratio(backend, op, dtype, rows, n, gen, out_dtype)
    assert err <= bound, (op, dtype, n, err, bound)


def check_output_dtypes(backend, dtype, gen):
    """dtype=float32 on half input (aten's half_to_float) equals computing on the upcast input:
    no rounding to half anywhere; a narrower dtype rounds the fp32 result once."""
    x = randn(gen, 6, 77, dtype=dtype)
    for fn in (bik.softmax, bik.log_softmax):
        wide = fn(x, dtype=torch.float32, backend=backend)
        assert wide.dtype == torch.float32
        assert torch.equal(wide, fn(x.float(), backend=backend))
        for narrow in (torch.float16, torch.bfloat16):
            assert torch.equal(fn(x, dtype=narrow, backend=backend), wide.to(narrow))
        assert fn(x, backend=backend).dtype == dtype
    wide = bik.mean(x, 1, dtype=torch.float32, backend=backend)
    assert torch.equal(wide, bik.mean(x.float(), 1, backend=backend))
    assert torch.equal(bik.mean(x, 1, dtype=torch.float16, backend=backend), wide.half())


def check_dims_and_layouts(backend, dtype, gen):
    """Any dim gives the bits of the same rows laid out last; mean over several dims is the mean
    of the flattened row (reduced dims in ascending order); views equal contiguous copies."""
    x = randn(gen, 5, 6, 7, dtype=dtype)
    for fn in (bik.softmax, bik.log_softmax):
        last = fn(x.transpose(1, 2).contiguous(), -1, backend=backend)
        got = fn(x, 1, backend=backend)
        assert got.is_contiguous() and got.shape == x.shape
        assert torch.equal(got, last.transpose(1, 2))
        assert torch.equal(fn(x, -2, backend=backend), got)
        assert torch.equal(fn(x.transpose(0, 2), 1, backend=backend),
                           fn(x.transpose(0, 2).contiguous(), 1, backend=backend))
    flat = bik.mean(x.permute(1, 0, 2).reshape(6, 35), -1, backend=backend)
    for dims in ((0, 2), (2, 0), [-1, 0], (0, -1)):
        assert torch.equal(bik.mean(x, dims, backend=backend), flat)
    assert bik.mean(x, (0, 2), keepdim=True, backend=backend).shape == (1, 6, 1)
    assert torch.equal(bik.mean(x, (0, 2), keepdim=True, backend=backend).flatten(), flat)
    everything = bik.mean(x.reshape(-1), 0, backend=backend)
    for dims in (None, (), [], (0, 1, 2), (2, 1, 0)):
        got = bik.mean(x, dims, backend=backend)
        assert got.shape == () and torch.equal(got, everything)
    assert bik.mean(x, None, keepdim=True, backend=backend).shape == (1, 1, 1)
    xt = x.transpose(0, 1)  # a non-contiguous view
    assert torch.equal(bik.mean(xt, 2, backend=backend),
                       bik.mean(xt.contiguous(), 2, backend=backend))
    assert torch.equal(bik.mean(x, 1, backend=backend),
                       bik.mean(x.transpose(1, 2).contiguous(), 2, backend=backend))
    s = randn(gen, 1, dtype=dtype)[0]  # 0-D, as torch: softmax 1, log_softmax 0, mean itself
    assert bik.softmax(s, 0, backend=backend).item() == 1.0
    assert bik.log_softmax(s, -1, backend=backend).item() == 0.0
    assert torch.equal(bik.mean(s, backend=backend), s)


def check_empty(backend, dtype):
    for fn in (bik.softmax, bik.log_softmax):
        assert fn(torch.zeros(0, 9, dtype=dtype), backend=backend).shape == (0, 9)
        assert fn(torch.zeros(3, 0, dtype=dtype), backend=backend).shape == (3, 0)
    assert bik.mean(torch.zeros(0, 9, dtype=dtype), 1, backend=backend).shape == (0,)
    nan = bik.mean(torch.zeros(3, 0, dtype=dtype), 1, backend=backend)  # 0/0, as torch
    assert nan.shape == (3,) and nan.isnan().all()


def check_non_finite(backend, dtype, gen):
    """NaN/inf stay in their own row, with torch's values; other rows keep their bits."""
    x = randn(gen, 7, 40, dtype=dtype)
    clean = {f: f(x, backend=backend) for f in (bik.softmax, bik.log_softmax)}
    clean_mean = bik.mean(x, -1, backend=backend)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3] = float("-inf")
    x[4, :39] = float("-inf")  # one finite entry: softmax 1 there, 0 elsewhere
    x[5, 7] = float("-inf")
    x[6, 0], x[6, 1] = float("inf"), float("-inf")
    keep = [0]
    for f in (bik.softmax, bik.log_softmax):
        out = f(x, backend=backend)
        ref = (torch.softmax if f is bik.softmax else torch.log_softmax)(x.float(), -1)
        for r in (1, 2, 3, 6):
            assert out[r].isnan().all(), (f.__name__, r)
        assert torch.equal(out[4].float(), ref[4]), f.__name__
        assert out[5].isnan().sum() == 0 and out[5, 7] == ref[5, 7]  # 0, or -inf for log
        assert torch.equal(out[keep], clean[f][keep])
    m = bik.mean(x, -1, backend=backend)
    assert m[1].isnan() and m[2] == float("inf") and m[3] == float("-inf") and m[6].isnan()
    assert torch.equal(m[keep], clean_mean[keep])


def check_harness_rejects_split_by_m(reference, gen, ms=(1, 2, 4, 17, 64), n=500):
    """The harness must be able to fail: a reference whose sum is split by M is rejected."""
    pool = randn(gen, max(ms), n) * 3
    report = rows_alone_vs_batched(reference, pool, ms, name=reference.__name__)
    assert not report.ok and report.comparisons == sum(ms)


def check_opcheck(backend, gen, dtype=torch.float32):
    x = randn(gen, 3, 4, 37, dtype=dtype)
    samples = [
        (torch.ops.bik.softmax.default, (x, -1, None, backend)),
        (torch.ops.bik.softmax.default, (x, 1, torch.float16, backend)),
        (torch.ops.bik.log_softmax.default, (x, 0, None, backend)),
        (torch.ops.bik.log_softmax.default, (x.half(), -1, torch.float32, backend)),
        (torch.ops.bik.mean.default, (x, [-1], False, None, backend)),
        (torch.ops.bik.mean.default, (x, [0, 2], True, torch.float32, backend)),
        (torch.ops.bik.mean.default, (x, [], False, None, backend)),
    ]
    for op, args in samples:
        opcheck(op, args)

"""Test bodies shared by the CPU-backend tests and the Triton-interpreter tests.

Each function takes the backend and the sizes to use, so the same assertions run on every
backend at the sizes that backend can afford (the interpreter costs ~1 ms per program).
"""

from __future__ import annotations

import bik
import torch
from bik.testing.suites import bmm_suite, matmul_suite, rms_norm_suite
from torch.library import opcheck

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Accuracy against fp64: bik's max error may be at most RATIO x the error of an independent
# implementation in the same dtype (torch on the CPU) plus FLOOR x eps(dtype) x scale. Ratios
# are set from measured data (docs/design.md, "Accuracy").
# Measured (CPU backend, 15 shapes up to K = 4096): fp32 matmul up to 8.8x torch's error (one
# sequential K sum vs MKL's blocked sums), rms_norm 1.3x; bf16/fp16 1.0x (the output rounding
# dominates). Bounds are about twice the worst measured ratio.
ACCURACY_RATIO = {torch.float32: 16.0, torch.bfloat16: 2.0, torch.float16: 2.0}
ACCURACY_FLOOR = 2.0


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def assert_invariant(reports):
    bad = [r.summary() for r in reports if not r.ok]
    assert not bad, "\n".join(bad)


def check_matmul_invariance(backend, dtype, ms, shapes, probe_batch=0):
    assert_invariant(matmul_suite(device="cpu", dtype=dtype, backend=backend, ms=ms,
                                  shapes=shapes, probe_batch=probe_batch))


def check_rms_norm_invariance(backend, dtype, ms, hiddens, probe_batch=0):
    assert_invariant(rms_norm_suite(device="cpu", dtype=dtype, backend=backend, ms=ms,
                                    hiddens=hiddens, probe_batch=probe_batch))


def check_bmm_invariance(backend, dtype, ms, n=24, k=40):
    assert_invariant(bmm_suite(device="cpu", dtype=dtype, backend=backend, ms=ms, n=n, k=k))


def _max_err(x, ref):
    return (x.double() - ref).abs().max().item()


def check_matmul_accuracy(backend, dtype, m, n, k, gen):
    a, b, bias = randn(gen, m, k, dtype=dtype), randn(gen, k, n, dtype=dtype), randn(gen, n)
    ref = a.double() @ b.double() + bias.double()
    got = bik.matmul(a, b, bias, backend=backend)
    indep = (torch.mm(a.float(), b.float()) + bias).to(dtype)
    scale = ref.abs().max().item()
    bound = ACCURACY_RATIO[dtype] * _max_err(indep, ref) + ACCURACY_FLOOR * torch.finfo(
        dtype).eps * scale
    assert got.dtype == dtype and got.shape == (m, n)
    assert _max_err(got, ref) <= bound


def check_rms_norm_accuracy(backend, dtype, m, hidden, gen):
    x, w = randn(gen, m, hidden, dtype=dtype), randn(gen, hidden, dtype=dtype)
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    got = bik.rms_norm(x, w, 1e-6, backend=backend)
    indep = torch.nn.functional.rms_norm(x.float(), (hidden,), w.float(), 1e-6).to(dtype)
    bound = ACCURACY_RATIO[dtype] * _max_err(indep, ref) + ACCURACY_FLOOR * torch.finfo(
        dtype).eps * ref.abs().max().item()
    assert got.dtype == dtype and got.shape == x.shape
    assert _max_err(got, ref) <= bound


def check_layouts_agree(backend, dtype, gen, m=19, n=40, k=33):
    """Strided, transposed and batched views give the bits of contiguous copies."""
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


def check_empty_dims(backend, dtype):
    z = bik.matmul(torch.zeros(0, 5, dtype=dtype), torch.ones(5, 3, dtype=dtype), backend=backend)
    assert z.shape == (0, 3)
    bias = torch.arange(3.0)
    k0 = bik.matmul(torch.zeros(4, 0, dtype=dtype), torch.zeros(0, 3, dtype=dtype), bias,
                    backend=backend)
    assert torch.equal(k0, bias.to(dtype).expand(4, 3))
    assert bik.matmul(torch.ones(2, 5, dtype=dtype), torch.ones(5, 0, dtype=dtype),
                      backend=backend).shape == (2, 0)
    assert bik.rms_norm(torch.zeros(0, 7, dtype=dtype), torch.ones(7, dtype=dtype),
                        backend=backend).shape == (0, 7)


def check_non_finite(backend, dtype, gen):
    """NaN/inf stay in their own row: other rows keep the bits they have without them."""
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

    x, w = randn(gen, 5, 48, dtype=dtype), randn(gen, 48, dtype=dtype)
    clean = bik.rms_norm(x, w, backend=backend)
    x[1, 3] = float("nan")
    x[3, 0] = float("inf")
    out = bik.rms_norm(x, w, backend=backend)
    assert out[1].isnan().all()  # NaN poisons the row's mean
    assert out[3, 0].isnan() and (out[3, 1:] == 0).all()  # inf: rstd = 0, inf * 0 = NaN
    assert torch.equal(out[[0, 2, 4]], clean[[0, 2, 4]])


def check_fused_equals_unfused(backend, dtype, gen):
    x, r, w = (randn(gen, 7, 96, dtype=dtype), randn(gen, 7, 96, dtype=dtype),
               randn(gen, 96, dtype=dtype))
    out, h = bik.rms_norm(x, w, residual=r, backend=backend)
    assert torch.equal(h, (x.float() + r.float()).to(dtype))
    assert torch.equal(out, bik.rms_norm(h, w, backend=backend))


def check_opcheck(backend, gen, dtype=torch.float32):
    a, b, bias = randn(gen, 5, 24, dtype=dtype), randn(gen, 24, 16, dtype=dtype), randn(gen, 16)
    x, r, w = randn(gen, 3, 40, dtype=dtype), randn(gen, 3, 40, dtype=dtype), randn(gen, 40)
    samples = [
        (torch.ops.bik.matmul.default, (a, b, bias, None, backend)),
        (torch.ops.bik.matmul.default, (a, b.t().contiguous().t(), None, torch.float32, backend)),
        (torch.ops.bik.bmm.default, (a.expand(2, 5, 24).contiguous(),
                                     b.expand(2, 24, 16).contiguous(), None, backend)),
        (torch.ops.bik.rms_norm.default, (x, w, 1e-6, backend)),
        (torch.ops.bik.fused_add_rms_norm.default, (x, r, w, 1e-5, backend)),
    ]
    for op, args in samples:
        opcheck(op, args)

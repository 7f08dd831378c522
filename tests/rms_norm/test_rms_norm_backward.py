"""Backward of bik.rms_norm and its fused residual add (docs/design.md#backward).

Proven on the CPU backend: the gradients are correct (against stock autograd, with a tolerance
from measured data), the fused form's gradients are the plain ones plus grad_h, the
registrations are opcheck-clean with requires_grad, the gradients take their inputs' dtypes, and
the weight gradient is the fixed-order row reduction the docs state. Proven on the CPU backend
and on the Triton kernels in the interpreter: the input gradient grad_x (and grad_residual) of a
row is bit-identical alone and inside any batch; the same harness rejects a batch-dependent
rms_norm backward (negative control).
"""

from __future__ import annotations

import bik
import pytest
import torch
import torch.nn.functional as F
from bik.testing import InvarianceReport, rows_alone_vs_batched, split_by_m_rms_norm
from checks import DTYPES, check_grads_against_stock, grad_rows, grads_of, sequential_row_sum
from targets import targets
from torch.library import opcheck

MS = (1, 2, 3, 4, 7, 8, 16, 31, 64)
INTERPRETER_MS = (1, 2, 3, 17)

# Accuracy against fp64 autograd: bik's normalised max error (max |grad - ref| / max |ref|) may
# be at most RATIO x stock torch's error in the same dtype, or FLOOR x eps(dtype).
# Measured (CPU, rms_norm 5 shapes up to H = 4096): fp32 rms_norm up to 2.45x torch's error (one
# sequential sum vs blocked sums); bf16/fp16 at most 0.45x (bik keeps the backward in fp32,
# torch's is in the input dtype).
RATIO = 5.0
FLOOR = 2.0


@pytest.mark.parametrize("target", targets("cpu", "gpu-triton", "gpu-cuda"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mh", [(1, 16), (19, 111), (64, 500)])
def test_rms_norm_grads_match_stock(target, dtype, mh, gen):
    # gpu-cuda: the CUDA C++ backend has no mean kernel, so its backward's row means run on
    # Triton (ops/rms_norm/op.py); this is where that path runs.
    m, h = mh
    x, u = 3 * torch.randn(m, h, generator=gen), torch.randn(m, h, generator=gen)
    w = 1 + 0.1 * torch.randn(h, generator=gen)
    dev = target.device
    check_grads_against_stock(lambda x, w: bik.rms_norm(x, w, 1e-6, backend=target.backend),
                              lambda x, w: F.rms_norm(x, (h,), w, 1e-6),
                              [x.to(dev, dtype), w.to(dev, dtype)], [u.to(dev, dtype)],
                              ratio=RATIO, floor=FLOOR)


@pytest.mark.parametrize("target", targets("cpu"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rms_norm_grads_match_stock(target, dtype, gen):
    m, h = 19, 111
    x, r, w = (torch.randn(m, h, generator=gen).to(dtype), torch.randn(m, h, generator=gen),
               (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype))
    r = r.to(dtype)
    ups = [torch.randn(m, h, generator=gen).to(dtype) for _ in range(2)]

    def stock(x, r, w):  # bik rounds h to x.dtype; stock autograd sees that as the identity
        hh = x + r
        return F.rms_norm(hh, (h,), w, 1e-6), hh

    check_grads_against_stock(
        lambda x, r, w: bik.rms_norm(x, w, 1e-6, residual=r, backend=target.backend), stock,
        [x, r, w], ups, ratio=RATIO, floor=FLOOR)


@pytest.mark.parametrize("target", targets("cpu"))
def test_fused_rms_norm_grads_are_the_plain_ones_plus_grad_h(target, gen):
    backend = target.backend
    x, r = torch.randn(7, 40, generator=gen), torch.randn(7, 40, generator=gen)
    w = torch.randn(40, generator=gen)
    g_out, g_h = torch.randn(7, 40, generator=gen), torch.randn(7, 40, generator=gen)
    gx, gr, gw = grads_of(lambda x, r, w: bik.rms_norm(x, w, 1e-6, residual=r, backend=backend),
                        [x, r, w], [g_out, g_h])
    h = x + r  # fp32: the rounding to x.dtype is exact here
    ghn, gw_plain = grads_of(lambda h, w: bik.rms_norm(h, w, 1e-6, backend=backend), [h, w],
                           [g_out])
    assert torch.equal(gx, ghn + g_h) and torch.equal(gr, gx) and torch.equal(gw, gw_plain)
    # Only h used: its gradient passes straight to x and residual.
    gx, gr, gw = grads_of(
        lambda x, r, w: bik.rms_norm(x, w, 1e-6, residual=r, backend=backend)[1], [x, r, w],
        [g_h])
    assert torch.equal(gx, g_h) and torch.equal(gr, g_h) and not gw.any()


@pytest.mark.parametrize("target", targets("cpu"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_with_grad(target, dtype, gen):
    def leaf(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt).requires_grad_()

    x, r = leaf(3, 40), leaf(3, 40)
    opcheck(torch.ops.bik.rms_norm.default, (x, leaf(40), 1e-6, target.backend))
    opcheck(torch.ops.bik.fused_add_rms_norm.default, (x, leaf(40), 1e-5, r, target.backend))


@pytest.mark.parametrize("target", targets("cpu"))
def test_grad_dtypes_follow_the_inputs(target, gen):
    x = torch.randn(4, 8, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(8, generator=gen).half().requires_grad_()  # fp16 weight on bf16 x
    bik.rms_norm(x, w, backend=target.backend).float().sum().backward()
    assert (x.grad.dtype, w.grad.dtype) == (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("target", targets("cpu"))
def test_only_the_needed_grads_and_empty_batches(target, gen):
    x = torch.randn(0, 8, generator=gen)
    nw = torch.randn(8, generator=gen, requires_grad=True)
    bik.rms_norm(x, nw, backend=target.backend).sum().backward()
    assert torch.equal(nw.grad, torch.zeros(8))


# ---- invariance: exact, with a negative control ----------------------------------------------


def _rms_norm_grad_x_report(backend: str, dtype, ms, h: int, gen: torch.Generator,
                            fused: bool = False) -> InvarianceReport:
    w = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    if not fused:
        pool = torch.randn(max(ms), 2 * h, generator=gen).to(dtype)
        fn = grad_rows(lambda x: bik.rms_norm(x, w, 1e-6, backend=backend), h)
    else:  # per row: x, residual, upstream of out, upstream of h
        pool = torch.randn(max(ms), 4 * h, generator=gen).to(dtype)

        def fn(rows):
            x = rows[:, :h].detach().clone().requires_grad_()
            r = rows[:, h:2 * h].detach().clone().requires_grad_()
            out, hh = bik.rms_norm(x, w, 1e-6, residual=r, backend=backend)
            torch.autograd.backward((out, hh), (rows[:, 2 * h:3 * h], rows[:, 3 * h:]))
            return torch.cat([x.grad, r.grad], dim=1)

    name = f"rms_norm{' fused' if fused else ''} grad_x {backend} {dtype} H={h}"
    return rows_alone_vs_batched(fn, pool, ms, name=name)


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_grad_x_rows_invariant(target, dtype, fused, gen):
    if target.small and dtype != torch.float32:
        pytest.skip("fp32 only in the interpreter (~1 ms a program)")
    ms, hs = (INTERPRETER_MS, (111,)) if target.small else (MS, (111, 500))
    for h in hs:
        rep = _rms_norm_grad_x_report(target.backend, dtype, ms, h, gen, fused=fused)
        assert rep.ok, rep.summary()


def test_batch_dependent_rms_norm_grad_x_is_caught(gen):
    # Measured: stock F.rms_norm's backward is row-invariant on this CPU, so the negative
    # control is autograd through bik.testing's split_by_m_rms_norm (sum of squares split by M).
    h = 111
    w = torch.randn(h, generator=gen)
    pool = torch.randn(16, 2 * h, generator=gen)
    fn = grad_rows(lambda x: split_by_m_rms_norm(x, w), h)
    rep = rows_alone_vs_batched(fn, pool, (1, 2, 3, 4, 16))
    assert not rep.ok, rep.summary()


# ---- weight gradient: fixed order, deterministic, not batch-invariant ------------------------

@pytest.mark.parametrize("target", targets("cpu"))
def test_rms_norm_weight_grad_is_the_ascending_row_sum(target, gen):
    def rms_norm(x, w):
        return bik.rms_norm(x, w, 1e-6, backend=target.backend)

    x, u = torch.randn(21, 64, generator=gen), torch.randn(21, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    _, gw = grads_of(rms_norm, [x, w], [u])
    rstd = 1.0 / torch.sqrt(bik.mean(x * x, dim=1, keepdim=True) + 1e-6)
    assert torch.equal(gw, sequential_row_sum(u * (x * rstd)))
    assert torch.equal(grads_of(rms_norm, [x, w], [u])[1], gw)

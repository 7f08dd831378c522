"""Backward of bik.softmax, bik.log_softmax and bik.mean (bik/ops/reductions/backward.py).

Proven on every target this machine runs (CPU backend; Triton kernels in the interpreter):
the input gradient of a row is bit-identical alone and inside any batch, at every position;
the same harness rejects a backward whose row sums split by M (stock torch's backward of these
ops was row-invariant on this CPU, so it cannot be the negative control); the gradients match
fp64 autograd within a bound measured against stock fp32 autograd; opcheck passes.
"""

from __future__ import annotations

import bik
import pytest
import torch
from bik.testing import probe_every_position, rows_alone_vs_batched, split_by_m_mean
from checks import grad_rows
from targets import targets
from torch.library import opcheck

OPS = ("softmax", "log_softmax", "mean")
STOCK = {"softmax": lambda x: torch.softmax(x, -1), "log_softmax": lambda x: torch.log_softmax(x, -1),
         "mean": lambda x: x.mean(-1, keepdim=True)}


def _bik(op: str, backend: str):
    if op == "mean":
        return lambda x: bik.mean(x, -1, keepdim=True, backend=backend)
    return lambda x: getattr(bik, op)(x, -1, backend=backend)


def _sizes(target):
    return ((1, 2, 3, 17), (5, 111)) if target.small else ((1, 2, 3, 4, 7, 16, 31, 64),
                                                           (1, 111, 500, 4096))


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_x_rows_invariant(target, op, dtype, gen):
    if target.small and dtype == torch.float16:
        pytest.skip("fp16 adds nothing to fp32/bf16 in the interpreter (same kernel program)")
    ms, lengths = _sizes(target)
    for n in lengths:
        width = n + (1 if op == "mean" else n)  # per row: x, then its upstream gradient
        pool = torch.randn(max(ms), width, generator=gen).to(dtype)
        fn = grad_rows(_bik(op, target.backend), n)
        rep = rows_alone_vs_batched(fn, pool, ms, name=f"{op} grad_x {target} {dtype} n={n}")
        assert rep.ok, rep.summary()
        probe = probe_every_position(fn, pool[:1], pool[1:9], name=f"{op} grad_x probe n={n}")
        assert probe.ok, probe.summary()


def test_batch_dependent_softmax_grad_is_caught(gen):
    """A softmax backward whose row sums <g, y> are split by M (bik.testing's split_by_m_mean
    times n), the GEMM-library habit: the harness that passes bik must reject it."""
    n = 111

    def grad(rows):
        x, g = rows[:, :n], rows[:, n:]
        y = torch.softmax(x, -1)
        return y * (g - split_by_m_mean(g * y)[:, None] * n)

    rep = rows_alone_vs_batched(grad, torch.randn(16, 2 * n, generator=gen), (1, 2, 3, 4, 16))
    assert not rep.ok, rep.summary()


# Accuracy against fp64 autograd (normalised max error, as tests/checks.py): at most
# RATIO x stock torch's error in the same dtype, or FLOOR x eps. Measured (CPU, these shapes):
# bik 0.0-1.3 eps, at most 1.6x stock's error (log_softmax fp32, 0.92 vs 0.59 eps); bf16/fp16
# at most 1.2x (the output rounding dominates).
RATIO, FLOOR = 4.0, 2.0


@pytest.mark.parametrize("target", targets("cpu"))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 7), (9, 111), (4, 4096)])
def test_grads_match_fp64_autograd(target, op, dtype, shape, gen):
    x = torch.randn(shape, generator=gen)
    out_shape = (shape[0], 1) if op == "mean" else shape
    u = torch.randn(out_shape, generator=gen)
    grads = {}
    for name, fn, dt in (("bik", _bik(op, target.backend), dtype), ("stock", STOCK[op], dtype),
                         ("fp64", STOCK[op], torch.float64)):
        leaf = x.to(dt).detach().clone().requires_grad_()
        fn(leaf).backward(u.to(dt))
        grads[name] = leaf.grad
    assert grads["bik"].dtype == dtype and grads["bik"].shape == x.shape
    ref = grads["fp64"]
    scale = ref.abs().max().clamp_min(1e-30)
    err = ((grads["bik"].double() - ref).abs().max() / scale).item()
    err_stock = ((grads["stock"].double() - ref).abs().max() / scale).item()
    assert err <= max(RATIO * err_stock, FLOOR * torch.finfo(dtype).eps), (err, err_stock)


@pytest.mark.parametrize("target", targets("cpu"))
def test_grads_over_other_dims_dtypes_and_keepdim(target, gen):
    x = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    for dims, keep in (((0, 2), False), ((1,), True), ((), False)):
        leaf = x.float().requires_grad_()
        bik.mean(leaf, dims, keep, dtype=torch.bfloat16, backend=target.backend).sum().backward()
        n = x.numel() if not dims else x.shape[dims[0]] * (x.shape[dims[1]] if len(dims) > 1 else 1)
        assert leaf.grad.dtype == torch.float32 and torch.equal(leaf.grad,
                                                                 torch.full_like(leaf, 1 / n))
    for op in ("softmax", "log_softmax"):
        leaf = x.float().requires_grad_()
        getattr(bik, op)(leaf, 1, dtype=torch.float32, backend=target.backend).sum().backward()
        ref = x.clone().requires_grad_()
        getattr(torch, op)(ref, 1).sum().backward()
        torch.testing.assert_close(leaf.grad.double(), ref.grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("target", targets("cpu"))
def test_opcheck_with_grad(target, gen):
    x = torch.randn(5, 9, generator=gen, requires_grad=True)
    for args in ((torch.ops.bik.softmax, (x, 1, None, target.backend)),
                 (torch.ops.bik.log_softmax, (x, -1, torch.float32, target.backend)),
                 (torch.ops.bik.mean, (x, [0, 1], True, None, target.backend))):
        opcheck(*args)

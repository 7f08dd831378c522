"""bik::matmul and bik::bmm: matrix products whose rows do not depend on the batch.

Contract (docs/design.md#matmul): for every output element the K reduction runs in one
fixed order that depends on (dtype, N, K, arch, backend) and never on M, on the row's
position, or on what else is in the batch. fp32 inputs run as IEEE fp32, never TF32.
"""

from __future__ import annotations

import math

import torch

from bik.ops._call import call
from bik.ops._checks import (
    check_float_dtype,
    check_out_dtype,
    check_same_device,
    check_same_dtype,
    check_tensor,
)
from bik.ops._define import define
from bik.ops._registry import documented, launcher, resolve_backend
from bik.ops import _native as native

# Every backend module (triton.py, cuda.py, cpu.py) defines the row's entry point
#   launch_matmul(a [B, M, K], b [B, K, N], bias [N] | None, out [B, M, N], *,
#                 layer: (N, K) | None = None, split: int | None = None) -> None
# for inputs validated here; ``out`` (any supported dtype) is written, not read. ``layer``: the
# (N, K) of the whole layer the tables are looked up with (a shard of a sharded layer passes
# its layer's); ``split``: an explicit K-split length (tests). A backend may add keyword-only
# knobs that change speed only, default None (tests/test_registry.py checks the signatures).


def _check_mm(op: str, args, a_rank: int = 2):
    """Validate a 2-D product (bik::matmul's record) or a batched 3-D one (bik::bmm's, which
    has no bias); return the record as it is (an out_dtype of None stands for a's dtype)."""
    a, b, bias = args.a, args.b, getattr(args, "bias", None)
    check_tensor(op, "a", a, a_rank)
    check_tensor(op, "b", b, a_rank)
    check_float_dtype(op, "a", a)
    check_same_dtype(op, ("a", "b"), a, b)
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"{op}: a {list(a.shape)} and b {list(b.shape)} disagree on K "
            f"({a.shape[-1]} vs {b.shape[-2]})"
        )
    if a_rank == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(
            f"{op}: a {list(a.shape)} and b {list(b.shape)} disagree on the batch size"
        )
    if bias is not None:
        check_tensor(op, "bias", bias, 1)
        check_float_dtype(op, "bias", bias)
        if bias.shape[0] != b.shape[-1]:
            raise ValueError(f"{op}: bias {list(bias.shape)} does not match N = {b.shape[-1]}")
    check_same_device(op, a=a, b=b, bias=bias)
    check_out_dtype(op, args.out_dtype, a.dtype)
    return args


def _run_matmul(launch, args):
    a, b = args.a, args.b
    out = torch.empty((a.shape[0], b.shape[1]), dtype=args.out_dtype or a.dtype,
                      device=a.device)
    launch(a.unsqueeze(0), b.unsqueeze(0), args.bias, out.unsqueeze(0))
    return out


def _fake_matmul(args):
    return args.a.new_empty((args.a.shape[0], args.b.shape[1]), dtype=args.out_dtype)


def _check_bmm(op, args):
    return _check_mm(op, args, a_rank=3)


def _run_bmm(launch, args):
    a, b = args.a, args.b
    out = torch.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=args.out_dtype or a.dtype,
                      device=a.device)
    launch(a, b, None, out)
    return out


def _fake_bmm(args):
    a = args.a
    return a.new_empty((a.shape[0], a.shape[1], args.b.shape[2]), dtype=args.out_dtype)


# ---- backward (docs/design.md#backward): built only from bik ops, so every backend keeps
# bik's fixed orders. grad_a = g @ b^T is row-invariant like the forward; grad_b = a^T @ g and
# grad_bias = ones[1, M] @ g reduce over the rows in the K order of bik::matmul (fixed for a
# given M, ascending row index on the CPU backend) -- deterministic, not batch-invariant.

def _operands(g: torch.Tensor, x: torch.Tensor, dtype: torch.dtype):
    """g and x in one dtype for a bik product: as they are when g already has x's dtype
    (``dtype``), else both upcast to fp32 (exact), so accumulation is fp32 either way."""
    g = g.contiguous()  # an upstream gradient may be expanded (stride 0)
    if g.dtype == dtype:
        return g, x
    return g.float(), x.float()


def _matmul_setup(ctx, inputs, output):
    a, b, bias, out_dtype, backend = inputs
    del output, out_dtype
    ctx.save_for_backward(a, b)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.backend = backend


def _matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    mm = torch.ops.bik.matmul
    grad_a = grad_b = grad_bias = None
    if need_a:
        g, bt = _operands(grad, b.t(), a.dtype)
        grad_a = mm(g, bt, None, a.dtype, ctx.backend)
    if need_b:
        g, at = _operands(grad, a.t(), b.dtype)
        grad_b = mm(at, g, None, b.dtype, ctx.backend)
    if need_bias:
        g = grad.contiguous()
        ones = g.new_ones((1, g.shape[0]))  # ones * g is exact: a fixed-order column sum
        grad_bias = mm(ones, g, None, ctx.bias_dtype, ctx.backend).reshape(g.shape[1])
    return grad_a, grad_b, grad_bias, None, None


def _bmm_setup(ctx, inputs, output):
    a, b, out_dtype, backend = inputs
    del output, out_dtype
    ctx.save_for_backward(a, b)
    ctx.backend = backend


def _bmm_backward(ctx, grad):
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    grad_a = grad_b = None
    if need_a:
        g, bt = _operands(grad, b.transpose(1, 2), a.dtype)
        grad_a = torch.ops.bik.bmm(g, bt, a.dtype, ctx.backend)
    if need_b:
        g, at = _operands(grad, a.transpose(1, 2), b.dtype)
        grad_b = torch.ops.bik.bmm(at, g, b.dtype, ctx.backend)
    return grad_a, grad_b, None, None


define("matmul",
       "(Tensor a, Tensor b, Tensor? bias, ScalarType? out_dtype, str backend) -> Tensor",
       check=_check_mm, run=_run_matmul, fake=_fake_matmul,
       autograd=(_matmul_backward, _matmul_setup),
       native=native.kernel_for("matmul", split_rule=True))
define("bmm", "(Tensor a, Tensor b, ScalarType? out_dtype, str backend) -> Tensor",
       check=_check_bmm, run=_run_bmm, fake=_fake_bmm, autograd=(_bmm_backward, _bmm_setup),
       native=native.kernel_for("bmm", split_rule=True))


@documented("matmul")
def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None, backend: str | None = None) -> torch.Tensor:
    """Batch-invariant ``a @ b (+ bias)``.

    Args:
        a: [..., K]; every leading dim is a row (a 1-D a is one row). bf16, fp16 or fp32.
        b: [K, N], same dtype as a, any strides (``weight.t()`` of an nn.Linear needs no copy).
        bias: optional [N], any supported dtype; added in fp32 before the final cast.
        out_dtype: output dtype (default a.dtype). Accumulation is always fp32.
        backend: {backends}

    Returns:
        [..., N]. Each output row's bits depend only on that row of ``a``, on ``b``/``bias``,
        and on the kernel configuration (see :func:`bik.fingerprint`), never on how many
        other rows are in ``a`` or where the row sits. fp32 runs as IEEE fp32, never TF32.
    """
    op = "bik.matmul"
    check_tensor(op, "a", a)
    if a.dim() == 0:
        raise ValueError(f"{op}: a must have at least 1 dim, got a 0-D tensor")
    backend = resolve_backend("matmul", backend, a.device, label=op)
    if a.dim() == 2:  # the op checks it, once
        return call("matmul", a, b, bias, out_dtype, backend)
    check_tensor(op, "b", b, 2)
    if a.shape[-1] != b.shape[0]:  # before the reshape, to name the caller's shapes
        raise ValueError(f"{op}: a {list(a.shape)} and b {list(b.shape)} disagree on K "
                         f"({a.shape[-1]} vs {b.shape[0]})")
    rows = math.prod(a.shape[:-1])  # not reshape(-1, K): K may be 0
    out = call("matmul", a.reshape(rows, a.shape[-1]), b, bias, out_dtype, backend)
    return out.reshape(*a.shape[:-1], b.shape[1])


def matmul_shard(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor, *, layer: tuple[int, int], backend: str) -> None:
    """bik::matmul's kernel into ``out`` [B, M, N] for validated a [B, M, K], b [B, K, N], with
    the tables of the whole ``layer`` (N, K) of which this product is a shard, so a tensor-
    parallel rank reduces each element in the unsharded layer's order (bik.distributed)."""
    launcher("matmul", backend, a.device)(a, b, bias, out, layer=layer)


@documented("matmul")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None, backend: str | None = None) -> torch.Tensor:
    """Batch-invariant ``F.linear``: x [..., K], weight [N, K] (no copy), bias [N] -> [..., N].

    Same contract as :func:`matmul` (it is ``matmul(x, weight.t(), bias)``).

    Args:
        backend: {backends}
    """
    op = "bik.linear"
    check_tensor(op, "x", x)
    check_tensor(op, "weight", weight, 2)
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: x {list(x.shape)} and weight {list(weight.shape)} disagree on "
                         f"K (x's last dim must equal weight.shape[1])")
    if x.dim() == 2:  # a decode step's shape: straight to the op, which checks the rest once
        return call("matmul", x, weight.t(), bias, out_dtype,
                    resolve_backend("matmul", backend, x.device, label=op))
    return matmul(x, weight.t(), bias, out_dtype=out_dtype, backend=backend)


@documented("bmm")
def bmm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None,
        backend: str | None = None) -> torch.Tensor:
    """Batch-invariant ``torch.bmm``: a [B, M, K] @ b [B, K, N] -> [B, M, N].

    Every row of every batch entry has bits independent of M and of B.

    Args:
        backend: {backends}
    """
    check_tensor("bik.bmm", "a", a, 3)
    backend = resolve_backend("bmm", backend, a.device)
    return call("bmm", a, b, out_dtype, backend)

"""bik::grouped_matmul: the rows of a, in groups, each group times its own matrix (a mixture of
experts' expert products, torch's ``grouped_mm`` of 2-D rows by 3-D groups), and its weight
gradient, bik::grouped_matmul_weight_grad.

Contract (docs/design.md#mixture-of-experts): rows [ends[g-1], ends[g]) of a [S, K] (ends[-1]
taken as 0) times b[g] [K, N]; every row's bits are bik::matmul's for that row and b[g] (the
K order of (dtype, N, K, arch, backend)), never a function of how many rows a group has, of
where the row sits, or of the other groups. Rows past the last end are zero.
"""

from __future__ import annotations

import torch

from bik._arch import dry_run_arch
from bik.ops._call import call
from bik.ops._checks import (
    check_float_dtype,
    check_out_dtype,
    check_same_device,
    check_same_dtype,
    check_tensor,
)
from bik.ops._define import define
from bik.ops._registry import documented, resolve_backend

# Every backend module (triton_grouped.py, cpu.py) defines the row's entry point
#   launch_grouped_matmul(a [S, K], b [G, K, N], ends [G] int, out [S, N]) -> None
# for inputs validated here; ``out`` (contiguous, any supported dtype) is written, not read.

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_shapes(op: str, args):
    """What a fake call can check: shapes, dtypes, devices (no tensor data)."""
    a, b, ends = args.a, args.b, args.ends
    check_tensor(op, "a", a, 2)
    check_tensor(op, "b", b, 3)
    check_tensor(op, "ends", ends, 1)
    check_float_dtype(op, "a", a)
    check_same_dtype(op, ("a", "b"), a, b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{op}: a {list(a.shape)} and b {list(b.shape)} disagree on K "
                         f"({a.shape[1]} vs {b.shape[1]})")
    if ends.dtype not in _INDEX_DTYPES or ends.shape[0] != b.shape[0]:
        raise ValueError(f"{op}: ends must be int32 or int64 of shape [{b.shape[0]}] (one end "
                         f"per group of b), got {ends.dtype} {list(ends.shape)}")
    check_same_device(op, a=a, b=b, ends=ends)
    check_out_dtype(op, args.out_dtype, a.dtype)
    return args


def _check(op: str, args):
    """The shapes, and on the CPU the ends themselves. On a GPU the ends stay device data
    (reading them would sync and break graph capture): the kernel clamps each end to
    [previous end, S], so bad ends give empty groups, never a read outside a."""
    args = _check_shapes(op, args)
    ends = args.ends
    # (Under the dry run, CPU tensors stand for a GPU's: not read either.)
    if ends.device.type == "cpu" and ends.numel() and dry_run_arch() is None:
        s = args.a.shape[0]
        prev = torch.cat([ends.new_zeros(1), ends[:-1]])
        bad = ((ends < prev) | (ends > s)).nonzero()
        if bad.numel():
            g = int(bad[0, 0])
            raise ValueError(f"{op}: ends must be non-decreasing and within the {s} rows of a; "
                             f"ends[{g}] = {int(ends[g])} after {int(prev[g])}")
    return args


def _run(launch, args):
    out = torch.empty((args.a.shape[0], args.b.shape[2]), dtype=args.out_dtype or args.a.dtype,
                      device=args.a.device)
    launch(args.a, args.b, args.ends, out)
    return out


# ---- backward (docs/design.md#backward): grad_a = grad @ b[g]^T per group, a grouped product
# itself (row-invariant like the forward); grad_b[g] = a_g^T @ grad_g, a_g and grad_g group
# g's rows, by bik::matmul: a fixed order for the group's rows (not batch-invariant: every row
# of the group enters the sum). The groups' ends are read on the host there (a sync on a GPU),
# which is why it is an op of its own, bik::grouped_matmul_weight_grad: AOT autograd and
# torch.compile see one opaque call, not a data-dependent loop.

def group_weight_grad(a_rows: torch.Tensor, grad_rows: torch.Tensor, dtype: torch.dtype,
                      backend: str) -> torch.Tensor:
    """One group: a_rows [r, K]^T @ grad_rows [r, N] -> [K, N] of ``dtype``, by bik::matmul
    (the row's entry)."""
    return torch.ops.bik.matmul(a_rows.t(), grad_rows, None, dtype, backend)


def _check_weight_grad(op: str, args):
    check_tensor(op, "a", args.a, 2)
    check_tensor(op, "grad", args.grad, 2)
    check_tensor(op, "ends", args.ends, 1)
    if args.grad.shape[0] != args.a.shape[0] or args.grad.dtype != args.a.dtype:
        raise ValueError(f"{op}: grad {list(args.grad.shape)} {args.grad.dtype} must have the "
                         f"rows and dtype of a {list(args.a.shape)} {args.a.dtype}")
    check_same_device(op, a=args.a, grad=args.grad, ends=args.ends)
    return args


def _run_weight_grad(launch, args, *, backend):
    a, grad = args.a, args.grad
    out = torch.zeros((args.ends.shape[0], a.shape[1], grad.shape[1]), dtype=args.out_dtype,
                      device=a.device)
    start = 0
    for group, end in enumerate(args.ends.tolist()):
        end = min(max(end, start), a.shape[0])  # the forward's clamp
        if end > start:
            out[group] = launch(a[start:end], grad[start:end], args.out_dtype, backend)
        start = end
    return out


def _fake_weight_grad(args):
    return args.a.new_empty((args.ends.shape[0], args.a.shape[1], args.grad.shape[1]),
                            dtype=args.out_dtype)


define("grouped_matmul_weight_grad",
       "(Tensor a, Tensor grad, Tensor ends, ScalarType out_dtype, str backend) -> Tensor",
       label="bik.grouped_matmul", check=_check_weight_grad, run=_run_weight_grad,
       fake=_fake_weight_grad)


def _setup(ctx, inputs, output):
    a, b, ends, out_dtype, backend = inputs
    del output, out_dtype
    ctx.save_for_backward(a, b, ends)
    ctx.backend = backend


def _operands(grad: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """The upstream gradient in the inputs' dtype, or fp32 (both operands upcast, exact)."""
    grad = grad.contiguous()
    return (grad, False) if grad.dtype == dtype else (grad.float(), True)


def _backward(ctx, grad):
    a, b, ends = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    g, up = _operands(grad, a.dtype)
    grad_a = grad_b = None
    if need_a:
        bt = b.transpose(1, 2)
        grad_a = torch.ops.bik.grouped_matmul(g, bt.float() if up else bt, ends, a.dtype,
                                              ctx.backend)
    if need_b:
        grad_b = torch.ops.bik.grouped_matmul_weight_grad(a.float() if up else a, g, ends,
                                                          b.dtype, ctx.backend)
    return grad_a, grad_b, None, None, None


define("grouped_matmul",
       "(Tensor a, Tensor b, Tensor ends, ScalarType? out_dtype, str backend) -> Tensor",
       check=_check, fake_check=_check_shapes, run=_run, autograd=(_backward, _setup))


@documented("grouped_matmul")
def grouped_matmul(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, *,
                   out_dtype: torch.dtype | None = None,
                   backend: str | None = None) -> torch.Tensor:
    """Batch-invariant grouped product: group g's rows of ``a`` times ``b[g]``.

    Args:
        a: [S, K] rows, grouped: group g is rows ``ends[g-1] .. ends[g]-1`` (``ends[-1]`` = 0).
        b: [G, K, N], a's dtype, any strides (``w.transpose(1, 2)`` of experts' [G, N, K]
            weights needs no copy).
        ends: [G] int32/int64, cumulative and non-decreasing, at most S (torch's ``offs``).
            Checked on the CPU; on a GPU they are not read by the host, and an end below the
            one before it or past S is clamped there.
        out_dtype: output dtype (default a.dtype). Accumulation is always fp32.
        backend: {backends}

    Returns:
        [S, N]. Each row's bits equal ``bik.matmul(row, b[g])``'s, whatever the number of rows
        in its group or in the others, and wherever the row sits; rows past ``ends[G-1]`` are
        zero.
    """
    op = "bik.grouped_matmul"
    check_tensor(op, "a", a)
    backend = resolve_backend("grouped_matmul", backend, a.device, label=op)
    return call("grouped_matmul", a, b, ends, out_dtype, backend)

"""bik::softmax, bik::log_softmax and bik::mean with a fixed reduction order per row.

Contract (docs/design.md#softmax-log_softmax-and-mean): the op is computed in fp32 over rows
of length n (softmax: the `dim` axis; mean: the reduced dims, flattened in ascending dim
order). A row's max is exact; its sum (of exp(x - max), or of x) is reduced in an order fixed
by (n, arch, backend), never by the number of rows. The result is rounded once to the output
dtype (``dtype`` if given, else x's dtype). log_softmax's sum is the sampler's normaliser
(bik_exp, vocab_sum's groups and chunks, bik_log: ops/_normaliser.py), so a token's entry is
the logprob bik.sample reports for it; softmax's is the pad-invariant order of eager attention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import torch

from bik.ops._call import call
from bik.ops._checks import check_tensor
from bik.ops._define import define
from bik.ops._registry import documented, resolve_backend
from bik.ops.reductions.backward import AUTOGRAD
from bik.ops.reductions.checks import (
    check_x_and_dtype,
    mean_shape,
    norm_dim,
    norm_dims,
    unit_stride_rows,
)

# Every backend module (triton.py, cpu.py) defines the rows' entry points, for validated rows
# with unit stride:
#   launch_softmax(x [M, N], out [M, N], *, log: bool) -> None
#   launch_mean(x [M, N >= 1], out [M]) -> None
# ``out`` is contiguous in the output dtype (written, not read).


# ---- softmax / log_softmax -------------------------------------------------------------------

def _check_softmax(op, args):
    x = args.x
    return args._replace(dim=norm_dim(op, x, args.dim), dtype=check_x_and_dtype(op, x, args.dtype))


def _run_softmax(launch, args, *, log: bool) -> torch.Tensor:
    """softmax / log_softmax along the normalised dim of a validated x."""
    x, d = args.x, args.dim
    xm = x.reshape(1) if x.dim() == 0 else x.movedim(d, -1)
    n = xm.shape[-1]
    rows = math.prod(xm.shape[:-1])  # not reshape(-1, n): n may be 0
    x2 = unit_stride_rows(xm.reshape(rows, n))
    out = torch.empty(rows, n, dtype=args.dtype or x.dtype, device=x.device)
    launch(x2, out, log=log)
    if x.dim() == 0:
        return out.reshape(())
    return out.reshape(xm.shape).movedim(-1, d).contiguous()


def _fake_softmax(args):
    return torch.empty(args.x.shape, dtype=args.dtype, device=args.x.device)


def _check_mean(op, args):
    x = args.x
    dtype = check_x_and_dtype(op, x, args.dtype)
    return args._replace(dim=norm_dims(op, x, args.dim), dtype=dtype)


def _run_mean(launch, args) -> torch.Tensor:
    """mean over the normalised (sorted, distinct) dims of a validated x."""
    x, dims = args.x, args.dim
    out_dtype = args.dtype or x.dtype
    shape = mean_shape(x, dims, args.keepdim)
    kept = [d for d in range(x.dim()) if d not in dims]
    rows = math.prod([x.shape[d] for d in kept])
    n = math.prod([x.shape[d] for d in dims])
    if rows == 0:
        return torch.empty(shape, dtype=out_dtype, device=x.device)
    if n == 0:  # the mean of nothing is 0/0, as in torch
        return torch.full(shape, float("nan"), dtype=out_dtype, device=x.device)
    # Reduced dims last, in ascending order, flattened into one row of n elements.
    x2 = unit_stride_rows(x.permute(kept + dims).reshape(rows, n))
    out = torch.empty(rows, dtype=out_dtype, device=x.device)
    launch(x2, out)
    return out.reshape(shape)


def _fake_mean(args):
    x = args.x
    return torch.empty(mean_shape(x, args.dim, args.keepdim), dtype=args.dtype, device=x.device)


define("softmax", "(Tensor x, int dim, ScalarType? dtype, str backend) -> Tensor",
       check=_check_softmax, run=partial(_run_softmax, log=False), fake=_fake_softmax,
       autograd=AUTOGRAD["softmax"])
define("log_softmax", "(Tensor x, int dim, ScalarType? dtype, str backend) -> Tensor",
       check=_check_softmax, run=partial(_run_softmax, log=True), fake=_fake_softmax,
       autograd=AUTOGRAD["log_softmax"])
define("mean", "(Tensor x, int[] dim, bool keepdim, ScalarType? dtype, str backend) -> Tensor",
       check=_check_mean, run=_run_mean, fake=_fake_mean,
       autograd=AUTOGRAD["mean"])


# ---- the public functions --------------------------------------------------------------------

@documented("softmax")
def softmax(x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None,
            backend: str | None = None) -> torch.Tensor:
    """Batch-invariant softmax along ``dim``.

    Args:
        x: any shape, bf16/fp16/fp32. Every position of the other dims is a row.
        dim: the softmax axis (negative counts from the end).
        dtype: output dtype (bf16/fp16/fp32), default x's. Computed in fp32 from x's values
            either way (x is never rounded to ``dtype`` first); ``dtype=torch.float32`` on half
            input is aten's ``_softmax(x, dim, half_to_float=True)``.
        backend: {backends}

    Returns:
        x's shape, contiguous. Each row's bits depend only on that row and
        :func:`bik.fingerprint`. A row with a NaN or +inf is NaN; an all -inf row is NaN.
    """
    op = "bik.softmax"
    check_x_and_dtype(op, x, dtype)
    norm_dim(op, x, dim)
    backend = resolve_backend("softmax", backend, x.device)
    return call("softmax", x, dim, dtype, backend)


@documented("log_softmax")
def log_softmax(x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None,
                backend: str | None = None) -> torch.Tensor:
    """Batch-invariant log_softmax along ``dim``: ``(x - max) - log(sum(exp(x - max)))``.

    Same arguments and promise as :func:`softmax`; ``dtype=torch.float32`` on half input is
    aten's ``_log_softmax(x, dim, half_to_float=True)`` (no rounding to half on the way).
    The exp, the sum's order and the log are the sampler's normaliser: for fp32 logits ``z``
    already divided by the temperature, ``log_softmax(z).gather(-1, t)`` equals, bit for bit,
    the ``logprobs`` :func:`bik.sample` reports for the tokens ``t`` it draws with no filter.
    """
    op = "bik.log_softmax"
    check_x_and_dtype(op, x, dtype)
    norm_dim(op, x, dim)
    backend = resolve_backend("log_softmax", backend, x.device)
    return call("log_softmax", x, dim, dtype, backend)


@documented("mean")
def mean(x: torch.Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False, *,
         dtype: torch.dtype | None = None, backend: str | None = None) -> torch.Tensor:
    """Batch-invariant mean over one or several dims.

    Args:
        x: any shape, bf16/fp16/fp32.
        dim: an int, a tuple/list of ints, or None / () for every dim (torch's
            ``mean(dim=[])`` reduces everything too). The reduced dims are flattened, in
            ascending dim order, into one row per position of the kept dims.
        keepdim: keep reduced dims with size 1.
        dtype: output dtype, default x's; the sum is fp32 either way.
        backend: {backends}

    Returns:
        The mean, rounded once to the output dtype. Each output element's bits depend only on
        its own row and :func:`bik.fingerprint`. An empty row gives NaN (0/0), as in torch.
    """
    op = "bik.mean"
    check_tensor(op, "x", x)
    if dim is None:
        dims = []
    elif isinstance(dim, int) and not isinstance(dim, bool):
        dims = [dim]
    elif isinstance(dim, (tuple, list)) and all(
            isinstance(d, int) and not isinstance(d, bool) for d in dim):
        dims = list(dim)
    else:
        raise TypeError(f"{op}: dim must be an int, a tuple/list of ints or None, got {dim!r}")
    backend = resolve_backend("mean", backend, x.device)
    return call("mean", x, dims, bool(keepdim), dtype, backend)

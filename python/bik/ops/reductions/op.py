"""bik::softmax, bik::log_softmax and bik::mean with a fixed reduction order per row.

Contract (docs/design.md#softmax-log_softmax-and-mean): the op is computed in fp32 over rows
of length n (softmax: the `dim` axis; mean: the reduced dims, flattened in ascending dim
order). A row's max is exact; its sum (of exp(x - max), or of x) is reduced in an order fixed
by (n, arch, backend), never by the number of rows. The result is rounded once to the output
dtype (``dtype`` if given, else x's dtype).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from bik.ops._checks import SUPPORTED_DTYPES, check_float_dtype, check_tensor
from bik.ops._registry import define, documented, implementation, resolve_backend

__all__ = ["log_softmax", "mean", "run_mean", "run_softmax", "softmax"]

# Every backend module (triton.py, cpu.py) defines, for validated rows with unit stride:
#   launch_softmax(x [M, N], out [M, N], *, log: bool) -> None
#   launch_mean(x [M, N >= 1], out [M]) -> None
# ``out`` is contiguous in the output dtype (written, not read).
define("softmax", "(Tensor x, int dim, ScalarType? dtype, str backend) -> Tensor")
define("log_softmax", "(Tensor x, int dim, ScalarType? dtype, str backend) -> Tensor")
define("mean", "(Tensor x, int[] dim, bool keepdim, ScalarType? dtype, str backend) -> Tensor")


# ---- checks (shared by the public functions, the kernels' impls and the fake impls) ----------

def _check_x_and_dtype(op: str, x, dtype) -> torch.dtype:
    check_tensor(op, "x", x)
    check_float_dtype(op, "x", x)
    if dtype is None:
        return x.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: dtype {dtype} is not supported; use bfloat16, float16 or "
                        f"float32 (or None for x's dtype)")
    return dtype


def _norm_dim(op: str, x: torch.Tensor, dim) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{op}: dim must be an int, got {type(dim).__name__}")
    ndim = max(x.dim(), 1)  # a 0-D tensor has one (implicit) dim, as in torch
    if not -ndim <= dim < ndim:
        raise ValueError(f"{op}: dim {dim} is out of range for x of shape {list(x.shape)} "
                         f"(expected -{ndim} <= dim < {ndim})")
    return dim % ndim


def _norm_dims(op: str, x: torch.Tensor, dims: Sequence[int]) -> list[int]:
    """Reduced dims, sorted ascending; [] (or every dim) means all of x's dims."""
    norm = [_norm_dim(op, x, d) for d in dims]
    if len(set(norm)) != len(norm):
        raise ValueError(f"{op}: dim {list(dims)} names a dim twice for x of shape "
                         f"{list(x.shape)}")
    if x.dim() == 0 or not norm:
        return list(range(x.dim()))
    return sorted(norm)


def _mean_shape(x: torch.Tensor, dims: list[int], keepdim: bool) -> list[int]:
    if keepdim:
        return [1 if d in dims else s for d, s in enumerate(x.shape)]
    return [s for d, s in enumerate(x.shape) if d not in dims]


def _unit_stride_rows(x2: torch.Tensor) -> torch.Tensor:
    return x2 if x2.shape[1] <= 1 or x2.stride(1) == 1 else x2.contiguous()


# ---- softmax / log_softmax -------------------------------------------------------------------

def _softmax(x, dim, dtype, backend, log: bool):
    key = "log_softmax" if log else "softmax"
    op = f"bik.{key}"
    out_dtype = _check_x_and_dtype(op, x, dtype)
    d = _norm_dim(op, x, dim)
    return run_softmax(implementation(key, backend, x.device, label=op), x, d, out_dtype, log)


def run_softmax(launch, x, d: int, out_dtype: torch.dtype, log: bool) -> torch.Tensor:
    """bik::softmax / log_softmax along the normalised dim ``d`` of a validated x."""
    xm = x.reshape(1) if x.dim() == 0 else x.movedim(d, -1)
    n = xm.shape[-1]
    rows = math.prod(xm.shape[:-1])  # not reshape(-1, n): n may be 0
    x2 = _unit_stride_rows(xm.reshape(rows, n))
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    launch(x2, out, log=log)
    if x.dim() == 0:
        return out.reshape(())
    return out.reshape(xm.shape).movedim(-1, d).contiguous()


def _softmax_fake(x, dim, dtype, log: bool):
    op = "bik.log_softmax" if log else "bik.softmax"
    out_dtype = _check_x_and_dtype(op, x, dtype)
    _norm_dim(op, x, dim)
    return torch.empty(x.shape, dtype=out_dtype, device=x.device)


@torch.library.impl("bik::softmax", ("cpu", "cuda"))
def _softmax_impl(x, dim, dtype, backend):
    return _softmax(x, dim, dtype, backend, log=False)


@torch.library.register_fake("bik::softmax")
def _softmax_fake_impl(x, dim, dtype, backend):
    return _softmax_fake(x, dim, dtype, log=False)


@torch.library.impl("bik::log_softmax", ("cpu", "cuda"))
def _log_softmax_impl(x, dim, dtype, backend):
    return _softmax(x, dim, dtype, backend, log=True)


@torch.library.register_fake("bik::log_softmax")
def _log_softmax_fake_impl(x, dim, dtype, backend):
    return _softmax_fake(x, dim, dtype, log=True)


# ---- mean ------------------------------------------------------------------------------------

@torch.library.impl("bik::mean", ("cpu", "cuda"))
def _mean_impl(x, dim, keepdim, dtype, backend):
    op = "bik.mean"
    out_dtype = _check_x_and_dtype(op, x, dtype)
    dims = _norm_dims(op, x, dim)
    return run_mean(implementation("mean", backend, x.device, label=op), x, dims, keepdim,
                    out_dtype)


def run_mean(launch, x, dims: list[int], keepdim: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """bik::mean over the normalised (sorted, distinct) ``dims`` of a validated x."""
    shape = _mean_shape(x, dims, keepdim)
    kept = [d for d in range(x.dim()) if d not in dims]
    rows = math.prod([x.shape[d] for d in kept])
    n = math.prod([x.shape[d] for d in dims])
    if rows == 0:
        return torch.empty(shape, dtype=out_dtype, device=x.device)
    if n == 0:  # the mean of nothing is 0/0, as in torch
        return torch.full(shape, float("nan"), dtype=out_dtype, device=x.device)
    # Reduced dims last, in ascending order, flattened into one row of n elements.
    x2 = _unit_stride_rows(x.permute(kept + dims).reshape(rows, n))
    out = torch.empty(rows, dtype=out_dtype, device=x.device)
    launch(x2, out)
    return out.reshape(shape)


@torch.library.register_fake("bik::mean")
def _mean_fake(x, dim, keepdim, dtype, backend):
    op = "bik.mean"
    out_dtype = _check_x_and_dtype(op, x, dtype)
    dims = _norm_dims(op, x, dim)
    return torch.empty(_mean_shape(x, dims, keepdim), dtype=out_dtype, device=x.device)


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
    _check_x_and_dtype(op, x, dtype)
    _norm_dim(op, x, dim)
    backend = resolve_backend("softmax", backend, x.device)
    return torch.ops.bik.softmax(x, dim, dtype, backend)


@documented("log_softmax")
def log_softmax(x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None,
                backend: str | None = None) -> torch.Tensor:
    """Batch-invariant log_softmax along ``dim``: ``(x - max) - log(sum(exp(x - max)))``.

    Same arguments and promise as :func:`softmax`; ``dtype=torch.float32`` on half input is
    aten's ``_log_softmax(x, dim, half_to_float=True)`` (no rounding to half on the way).
    """
    op = "bik.log_softmax"
    _check_x_and_dtype(op, x, dtype)
    _norm_dim(op, x, dim)
    backend = resolve_backend("log_softmax", backend, x.device)
    return torch.ops.bik.log_softmax(x, dim, dtype, backend)


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
    return torch.ops.bik.mean(x, dims, bool(keepdim), dtype, backend)

"""The aten ops bik's mode routes forward, one handler each (docs/api.md#bikbatch_invariant_mode),
built with the helper kit (_kit.py). The handlers of the ops that backward formulas call are in
_grad_routes.py, SDPA's in _attention_routes.py; _handlers.py joins the three tables.
"""

from __future__ import annotations

import math

import torch

import bik.ops  # noqa: F401  (registers torch.ops.bik.*)
from bik.mode._kit import (
    Fallback,
    WarnedFallback,
    aten_args,
    cast_first,
    handler_table,
    need,
    prepare,
    reduced_dims,
    torch_raises,
)
from bik.ops._call import call
from bik.ops._pointwise import silu_f32

__all__ = ["FORWARD_HANDLERS"]

aten = torch.ops.aten


def _broadcast(a: tuple, b: tuple) -> tuple:
    """torch.broadcast_shapes without the exception (so a compiled graph traces it)."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and x != 1 and y != 1:
            raise torch_raises("batch shapes that do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def _matmul_rows(a: torch.Tensor, b: torch.Tensor, bias, backend: str, out_dtype=None):
    """a [..., K] @ b [K, N] (+ bias [N]) on bik::matmul, every leading dim of a a row."""
    rows = math.prod(a.shape[:-1])
    out = _call("matmul", a.reshape(rows, a.shape[-1]), b, bias, out_dtype, backend)
    return out.reshape(*a.shape[:-1], b.shape[-1])


def _call(op: str, *args):
    """bik::<op> on arguments this module has checked (ops/_call.py picks the route)."""
    return call(op, *args, validated=True)


def _write_out(func, out: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    if out.dtype != result.dtype or out.device != result.device:
        raise Fallback("out= tensor of another dtype or device")
    if out.shape != result.shape:
        out.resize_(result.shape)
    return out.copy_(result)


def _check_mm(a, b, rank: int = 2) -> None:
    need(a.dim() == rank and b.dim() == rank, "operand ranks")
    need(a.shape[-1] == b.shape[-2], "operand shapes")
    need(rank == 2 or a.shape[0] == b.shape[0], "batch sizes")


def _mm(func, a, b, out=None):
    backend = prepare(func, a, b)
    _check_mm(a, b)
    r = _call("matmul", a, b, None, None, backend)
    return r if out is None else _write_out(func, out, r)


def _addmm(func, bias, a, b, *, beta=1, alpha=1, out=None):
    backend = prepare(func, bias, a, b)
    _check_mm(a, b)
    m, n = a.shape[0], b.shape[-1]
    # torch's broadcasting rule: bias must expand to [M, N]
    need(bias.dim() <= 2 and _broadcast(tuple(bias.shape), (m, n)) == (m, n),
          "a bias that does not broadcast to [M, N]")
    if beta == 1 and alpha == 1 and bias.dim() >= 1 and bias.numel() == n \
            and bias.shape[-1] == n and (bias.dim() < 2 or bias.shape[0] == 1):
        r = _call("matmul", a, b, bias.reshape(n), None, backend)  # bias added in fp32
    else:  # alpha/beta honoured elementwise on bik's fp32 product (elementwise is invariant)
        if alpha == 0:  # BLAS semantics, as torch: a @ b is ignored (inf/NaN included)
            r = torch.zeros((m, n), dtype=torch.float32, device=a.device)
        else:
            r = _call("matmul", a, b, None, torch.float32, backend)
            if alpha != 1:
                r = r * alpha
        if beta != 0:  # beta == 0 ignores bias, NaN included, as torch does
            bias_mn = bias.expand(m, n).float()
            r = r + bias_mn * beta if beta != 1 else r + bias_mn
        r = r.to(a.dtype)
    return r if out is None else _write_out(func, out, r)


def _mv(func, a, v, out=None):  # [M, K] @ [K]: each output element is one row of a
    backend = prepare(func, a, v)
    need(a.dim() == 2 and v.dim() == 1 and a.shape[1] == v.shape[0],
          "operand shapes")
    r = _call("matmul", a, v.unsqueeze(1), None, None, backend).squeeze(1)
    return r if out is None else _write_out(func, out, r)


def _dot(func, a, b, out=None):
    backend = prepare(func, a, b)
    need(a.dim() == 1 and b.dim() == 1 and a.shape == b.shape,
          "operand shapes")
    r = _call("matmul", a.unsqueeze(0), b.unsqueeze(1), None, None, backend).reshape(())
    return r if out is None else _write_out(func, out, r)


def _not_routed(func, *args, **kwargs):
    raise WarnedFallback("not routed through bik yet (stock kernel, may vary with the batch)")


def _bmm(func, a, b, out=None):
    backend = prepare(func, a, b)
    _check_mm(a, b, rank=3)
    r = _call("bmm", a, b, None, backend)
    return r if out is None else _write_out(func, out, r)


def _matmul(func, a, b):
    backend = prepare(func, a, b)
    need(a.dim() > 0 and b.dim() > 0, "a 0-D operand")
    k_b = b.shape[0] if b.dim() == 1 else b.shape[-2]
    need(a.shape[-1] == k_b, "operand shapes")
    if b.dim() == 2:
        return _matmul_rows(a, b, None, backend)
    if b.dim() == 1:
        return _matmul_rows(a, b.unsqueeze(1), None, backend).squeeze(-1)
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    batch = _broadcast(tuple(a2.shape[:-2]), tuple(b.shape[:-2]))
    m, k, n = a2.shape[-2], a2.shape[-1], b.shape[-1]
    nb = math.prod(batch)  # not -1: a tensor with no elements makes -1 ambiguous
    a3 = a2.expand(*batch, m, k).reshape(nb, m, k)
    b3 = b.expand(*batch, k, n).reshape(nb, k, n)
    r = _call("bmm", a3, b3, None, backend).reshape(*batch, m, n)
    return r.squeeze(-2) if a.dim() == 1 else r


def _linear(func, x, weight, bias=None):
    backend = prepare(func, x, weight, bias)
    if weight.dim() != 2:
        raise Fallback("weight that is not 2-D")
    if bias is not None and bias.dim() != 1:
        raise Fallback("bias that is not 1-D")
    need(x.dim() > 0 and x.shape[-1] == weight.shape[1],
          "input and weight shapes")
    need(bias is None or bias.shape[0] == weight.shape[0],
          "bias and weight shapes")
    return _matmul_rows(x, weight.t(), bias, backend)


def _softmax_like(log: bool):
    name = "log_softmax" if log else "softmax"

    def checked(x, dim) -> int:
        if not isinstance(dim, int):
            raise Fallback("a named or missing dim")
        if x.dim() == 0:
            raise Fallback("0-D input")
        (d,) = reduced_dims(x, dim)
        return d

    def internal(func, x, dim, half_to_float):  # aten::_softmax / _log_softmax
        backend = prepare(func, x)
        return _call(name, x, checked(x, dim), torch.float32 if half_to_float else None,
                     backend)

    def public(func, x, dim, dtype=None):  # aten::softmax.int / log_softmax.int
        d = checked(x, dim)
        x = cast_first(x, dtype)
        backend = prepare(func, x)
        return _call(name, x, d, None, backend)

    return internal, public


def _mean(func, x, dim=None, keepdim=False, *, dtype=None):
    dims = reduced_dims(x, dim)
    x = cast_first(x, dtype)
    backend = prepare(func, x)
    if x.dim() == 0:
        raise Fallback("0-D input")
    return _call("mean", x, dims, bool(keepdim), None, backend)


def _rms_norm_parts(func, args: tuple, kwargs: dict):
    """aten rms_norm's call -> (out, x as rows, eps, backend): both rms_norm handlers."""
    call_args = aten_args(func, args, kwargs)
    x, weight, eps, normalized_shape = (call_args.input, call_args.weight, call_args.eps,
                                        call_args.normalized_shape)
    backend = prepare(func, x)
    if weight is not None:
        prepare(func, weight)
    if len(normalized_shape) != 1 or x.dim() == 0 or normalized_shape[0] != x.shape[-1]:
        raise Fallback("normalized_shape other than the last dim")
    h = x.shape[-1]
    need(weight is None or tuple(weight.shape) == (h,),
          "weight shape")
    if weight is None:
        weight = torch.ones(h, dtype=x.dtype, device=x.device)
    # Stock rms_norm defaults to the fp32 epsilon for every input dtype (bf16's would be 0.0078).
    eps = torch.finfo(torch.float32).eps if eps is None else float(eps)
    x2 = x.reshape(math.prod(x.shape[:-1]), h)
    out = _call("rms_norm", x2, weight, eps, backend)
    return out.reshape(x.shape), x2, eps, backend


def _rms_norm(func, *args, **kwargs):
    return _rms_norm_parts(func, args, kwargs)[0]


def _fused_rms_norm(func, *args, **kwargs):
    out, x2, eps, backend = _rms_norm_parts(func, args, kwargs)
    x32 = x2.float()
    ms = _call("mean", x32 * x32, [1], True, None, backend)
    return out, torch.rsqrt(ms + eps).reshape(*out.shape[:-1], 1)


def _silu(func, x):
    """Stock CPU silu moves an element's bits with its position in the tensor (its SIMD body
    and scalar tail round differently; tests/mode/test_silu.py measures it); bik's silu_f32
    does not."""
    prepare(func, x)
    return silu_f32(x.float()).to(x.dtype)


_softmax_internal, _softmax_public = _softmax_like(log=False)
_log_softmax_internal, _log_softmax_public = _softmax_like(log=True)

_ROUTES = (  # (aten op, overload, handler); ops missing from an older torch are skipped
    ("mm", "default", _mm),
    ("mm", "out", _mm),
    ("addmm", "default", _addmm),
    ("addmm", "out", _addmm),
    ("bmm", "default", _bmm),
    ("bmm", "out", _bmm),
    ("matmul", "default", _matmul),
    ("mv", "default", _mv),
    ("mv", "out", _mv),
    ("dot", "default", _dot),
    ("addmv", "default", _not_routed),
    ("baddbmm", "default", _not_routed),
    ("addbmm", "default", _not_routed),
    ("linear", "default", _linear),
    ("_softmax", "default", _softmax_internal),
    ("_log_softmax", "default", _log_softmax_internal),
    ("softmax", "int", _softmax_public),
    ("log_softmax", "int", _log_softmax_public),
    ("mean", "dim", _mean),
    ("mean", "default", _mean),
    ("silu", "default", _silu),
    ("rms_norm", "default", _rms_norm),
    ("_fused_rms_norm", "default", _fused_rms_norm),
)


FORWARD_HANDLERS = handler_table(_ROUTES)

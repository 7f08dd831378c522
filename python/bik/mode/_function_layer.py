"""batch_invariant_mode's function layer: a TorchFunctionMode that maps torch's Python API
(F.linear, torch.matmul and ``@``, softmax, mean, sum, F.silu, F.rms_norm, SDPA, ...) onto the aten
handlers of _handlers.py, so bik's ops are called above autograd.

This is the layer torch.compile traces: Dynamo inlines ``__torch_function__``, so a compiled
graph holds ``bik::*`` custom ops where the model called these functions, Inductor keeps them as
extern calls (it cannot fuse what it cannot see into), and AOTAutograd takes their backward
from bik's registered autograd. Each adapter below binds one torch signature to the aten
overload whose handler serves it; raising Fallback (or a binding TypeError) hands the call to
the stock function unchanged, so torch's errors and semantics stay torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from bik.mode._handlers import HANDLERS
from bik.mode._kit import Fallback
from bik.mode._stats import route

__all__ = ["ADAPTERS", "BikFunctionMode"]

aten = torch.ops.aten
Tensor = torch.Tensor


def _no_out(out, *tensors) -> None:
    if out is not None:
        raise Fallback("out=")


def _out_without_grad(out, *tensors) -> None:
    # torch refuses out= when autograd would record the op: let it say so.
    if out is not None and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise Fallback("out= under autograd")


def _with_out(default, out_overload, args, out):
    _out_without_grad(out, *args)
    return (default, args, {}) if out is None else (out_overload, args, {"out": out})


def _mm(input, mat2, *, out=None):
    return _with_out(aten.mm.default, aten.mm.out, (input, mat2), out)


def _bmm(input, mat2, *, out=None):
    return _with_out(aten.bmm.default, aten.bmm.out, (input, mat2), out)


def _mv(input, vec, *, out=None):
    return _with_out(aten.mv.default, aten.mv.out, (input, vec), out)


def _dot(input, tensor, *, out=None):
    _no_out(out)
    return aten.dot.default, (input, tensor), {}


def _addmm(input, mat1, mat2, *, beta=1, alpha=1, out=None):
    _out_without_grad(out, input, mat1, mat2)
    kwargs = {"beta": beta, "alpha": alpha}
    if out is None:
        return aten.addmm.default, (input, mat1, mat2), kwargs
    return aten.addmm.out, (input, mat1, mat2), {**kwargs, "out": out}


def _matmul(input, other, *, out=None):
    _no_out(out)
    if not isinstance(other, Tensor):
        raise Fallback("a non-tensor operand")
    return aten.matmul.default, (input, other), {}


def _rmatmul(self, other):
    return _matmul(other, self)


def _linear(input, weight, bias=None):
    return aten.linear.default, (input, weight, bias), {}


def _softmax_like(op):
    def method(input, dim, dtype=None):  # torch.softmax / Tensor.softmax
        return op, (input, dim, dtype), {}

    def functional(input, dim=None, _stacklevel=3, dtype=None):  # F.softmax: dim may be None
        return op, (input, dim, dtype), {}

    return method, functional


def _reduction(op_all, op_dims):
    def adapter(input, dim=None, keepdim=False, *, dtype=None, out=None):
        _no_out(out)
        if dim is None and not keepdim:  # x.sum() / x.mean(): the aten overload without dims
            return op_all, (input,), {"dtype": dtype}
        return op_dims, (input, dim, keepdim), {"dtype": dtype}

    return adapter


def _silu(input, inplace=False):
    if inplace:
        raise Fallback("inplace=True")
    return aten.silu.default, (input,), {}


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    if not isinstance(normalized_shape, (list, tuple, torch.Size)):
        raise Fallback("normalized_shape not a sequence")  # torch raises its TypeError
    return aten.rms_norm.default, (input, list(normalized_shape), weight, eps), {}


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    return (aten.scaled_dot_product_attention.default,
            (query, key, value, attn_mask, dropout_p, is_causal),
            {"scale": scale, "enable_gqa": enable_gqa})


_softmax, _f_softmax = _softmax_like(aten.softmax.int)
_log_softmax, _f_log_softmax = _softmax_like(aten.log_softmax.int)
_mean = _reduction(aten.mean.default, aten.mean.dim)
_sum = _reduction(aten.sum.default, aten.sum.dim_IntList)

ADAPTERS = {
    torch.mm: _mm, Tensor.mm: _mm,
    torch.bmm: _bmm, Tensor.bmm: _bmm,
    torch.mv: _mv, Tensor.mv: _mv,
    torch.dot: _dot, Tensor.dot: _dot,
    torch.addmm: _addmm, Tensor.addmm: _addmm,
    torch.matmul: _matmul, Tensor.matmul: _matmul, Tensor.__matmul__: _matmul,
    Tensor.__rmatmul__: _rmatmul,
    F.linear: _linear,
    torch.softmax: _softmax, Tensor.softmax: _softmax, F.softmax: _f_softmax,
    torch.log_softmax: _log_softmax, Tensor.log_softmax: _log_softmax,
    F.log_softmax: _f_log_softmax,
    torch.mean: _mean, Tensor.mean: _mean,
    torch.sum: _sum, Tensor.sum: _sum,
    F.silu: _silu,
    F.rms_norm: _rms_norm, torch.rms_norm: _rms_norm,
    F.scaled_dot_product_attention: _sdpa,
}


class BikFunctionMode(TorchFunctionMode):
    """Maps the functions in ADAPTERS to bik's handlers; passes every other call through.

    Fallbacks are not counted here: in eager code the stock call reaches the dispatch layer,
    which routes or counts it with the precise aten op; under torch.compile nothing is
    counted."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        adapter = ADAPTERS.get(func)
        if adapter is None:
            return func(*args, **kwargs)
        try:
            op, op_args, op_kwargs = adapter(*args, **kwargs)
        except (Fallback, TypeError):  # TypeError: a signature torch will judge itself
            return func(*args, **kwargs)
        return route(op, _ALONE[op], op_args, op_kwargs, lambda: func(*args, **kwargs),
                     count_fallbacks=False)


def _alone(handler):
    """``handler`` run with batch_invariant_mode's dispatch layer popped, in eager code: the
    aten calls a handler makes itself (empty, views, bik's ops) need no routing, and each
    would cost a trip through the dispatch layer (several µs: torch wraps every
    ``__torch_dispatch__`` in a Dynamo-disable guard). A fallback's stock call runs after the
    layer is back, so the dispatch layer still routes or counts it."""
    def run(func, *args, **kwargs):
        if torch.compiler.is_compiling():
            return handler(func, *args, **kwargs)
        depth = torch._C._len_torch_dispatch_stack()
        top = torch._C._get_dispatch_stack_at(depth - 1) if depth else None
        if not getattr(top, "bik_layer", False):
            return handler(func, *args, **kwargs)
        torch._C._pop_torch_dispatch_stack(None)
        try:
            return handler(func, *args, **kwargs)
        finally:
            torch._C._push_on_torch_dispatch_stack(top)

    return run


_ALONE = {op: _alone(handler) for op, handler in HANDLERS.items()}

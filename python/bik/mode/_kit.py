"""The mode's helper kit: what every route module (_forward_routes.py, _attention_routes.py,
_grad_routes.py) builds its handlers with. A handler gets ``(func, *args, **kwargs)`` as aten
passes them and returns what ``func`` would, computed by bik's ops (through the route chooser,
ops/_call.py); it raises :class:`Fallback` to hand the call to the original kernel (counted,
and warned once where ``warn``), which also gives input torch rejects torch's own error.
"""

from __future__ import annotations

from collections import namedtuple
from functools import cache

import torch

from bik._dtypes import dtype_name
from bik.ops._checks import SUPPORTED_DTYPES
from bik.ops._registry import default_backend

__all__ = ["Fallback", "WarnedFallback", "aten_args", "backend_for", "cast_first",
           "handler_table", "need", "prepare", "reduced_dims", "torch_raises"]

aten = torch.ops.aten


class Fallback(Exception):
    """Raised by a handler: this call goes to the original kernel, for ``reason``."""

    # No __init__ override: Dynamo traces raising and catching this inside a compiled function
    # and cannot trace an exception subclass's super().__init__.
    warn = False

    @property
    def reason(self) -> str:
        return self.args[0]


class WarnedFallback(Fallback):
    """A Fallback worth a :class:`bik.BatchInvarianceWarning` (once per reason)."""

    warn = True


@cache
def _aten_record(func) -> tuple[type, tuple]:
    arguments = func._schema.arguments
    record = namedtuple(f"{func._schema.name.split('::')[-1]}_args", [a.name for a in arguments])
    defaults = tuple(a.default_value if a.has_default_value() else None for a in arguments)
    return record, defaults


def aten_args(func, args: tuple, kwargs: dict):
    """The call's arguments as a record named by aten's own schema of ``func`` (``.input``,
    ``.weight``), defaults filled in: a handler reads aten's arguments by name rather than
    restating aten's signature as its parameters."""
    record, defaults = _aten_record(func)
    values = list(args)
    for name, default in zip(record._fields[len(args):], defaults[len(args):]):
        values.append(kwargs.get(name, default))
    return record._make(values)


def backend_for(t: torch.Tensor) -> str:
    backend = default_backend(t.device)  # a dict lookup by the device type, no device query
    if backend is None:
        raise Fallback(f"device {t.device.type} has no bik backend")
    return backend


def torch_raises(what: str) -> Fallback:
    """Input torch rejects: the stock op runs, so the caller gets torch's own exception. The
    reason is a fixed phrase (it keys mode_stats, and is built on every checked call)."""
    return Fallback(f"{what} (torch raises its own error)")


def need(ok: bool, what: str) -> None:
    """Raise :func:`torch_raises` (``what``) unless ``ok``: a check torch makes too."""
    if not ok:
        raise torch_raises(what)


_SERVED = frozenset(SUPPORTED_DTYPES)


def prepare(func, *tensors: torch.Tensor | None) -> str:
    """Check that bik serves these operands; return the backend. Raises Fallback otherwise.

    Under the function layer the handlers run above autograd and bik's ops record their own
    backward; under the dispatch layer and bik.enable() they run below it, where autograd has
    already recorded the stock backward formula, whose aten ops are routed in turn
    (_grad_routes.py)."""
    first = tensors[0]
    dtype, device = first.dtype, first.device
    if dtype not in _SERVED:
        raise Fallback(f"dtype {dtype_name(dtype)}")
    for t in tensors[1:]:
        if t is not None and (t.dtype != dtype or t.device != device):
            if t.dtype not in _SERVED:
                raise Fallback(f"dtype {dtype_name(t.dtype)}")
            raise Fallback("operands of different dtypes or devices")
    return backend_for(first)


def cast_first(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """x for a reduction called with ``dtype=``: torch casts x to it first. A dtype bik does
    not serve raises Fallback."""
    if dtype is None:
        return x
    if dtype not in SUPPORTED_DTYPES:
        raise Fallback(f"dtype {dtype}")
    return x.to(dtype)


def reduced_dims(x: torch.Tensor, dim) -> list[int]:
    """``dim`` of a reduction (None, an int, or a sequence of ints) as sorted non-negative
    dims; torch's IndexError / RuntimeError cases (out of range, repeated) raise Fallback."""
    nd = x.dim()
    if dim is None:
        return list(range(nd))
    if isinstance(dim, int):
        dim = [dim]
    if not all(isinstance(d, int) for d in dim):
        raise Fallback("named or non-integer dims")
    bound = max(nd, 1)  # torch accepts dim 0 / -1 for a 0-D tensor
    if any(not -bound <= d < bound for d in dim):
        raise torch_raises("dim out of range")
    dims = sorted({d % bound for d in dim})
    if len(dims) != len(dim):
        raise torch_raises("repeated dims")
    return list(range(nd)) if not dims else dims


def handler_table(routes) -> dict:
    """{aten overload: handler} from (op name, overload name, handler) rows; ops missing from
    this torch are skipped."""
    return {getattr(getattr(aten, name), overload): handler
            for name, overload, handler in routes
            if hasattr(aten, name) and hasattr(getattr(aten, name), overload)}

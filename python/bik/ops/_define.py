"""One declaration per op: :func:`define` registers ``bik::<op>`` and keeps what every route
needs (ops/_call.py), so an op's interface is written in its schema and nowhere else: its
``check``, ``run`` and ``fake`` take one record of the schema's arguments and read them by name.

An op's ``op.py`` declares, next to its row in ``ops/_registry.TABLE``::

    define("bmm", "(Tensor a, Tensor b, ScalarType? out_dtype, str backend) -> Tensor",
           check=check_bmm, run=run_bmm, fake=fake_bmm, autograd=(backward, setup_context))

* ``args``, the record they take, is ``Declared.Args``: a named tuple of the schema's arguments
  in order, ``backend`` left out (``args.x``, ``args.weight``), built from the schema.
* ``check(label, args)`` validates them and returns the record normalised (dims sorted and
  >= 0, ``args._replace(...)``), or ``args`` itself. A normalised record is itself a valid
  call of the op: a caller that has validated its inputs may pass them on without a second
  check (``call(..., validated=True)``).
* ``run(launch, args)`` computes the op from a record in that form with ``launch``, a
  backend's entry point (the row's ``entry``); a ``run`` with a keyword-only ``backend``
  parameter also gets the backend's name (an op built from other bik ops passes it on).
* ``fake(args)`` returns outputs of the right shapes and dtypes (torch.compile, opcheck).
  Optional: without it the fake is ``run`` with a launch that does nothing, which is exact for
  an op whose ``run`` only allocates its outputs and launches (reads no tensor data).

From these, ``define`` registers the op's CPU/CUDA implementation (check, then run on the
backend the call names), its fake implementation (check, then fake), its autograd formula or
the row's refusal, and records the op in :data:`DECLARED` for the route chooser.
"""

from __future__ import annotations

import inspect
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bik.ops._registry import TABLE, implementation, register_refusal

__all__ = ["DECLARED", "Declared", "define"]


@dataclass(frozen=True)
class Declared:
    """What the routes need to know about one op (built by :func:`define`)."""

    op: str
    label: str  # the public function the messages name
    check: Callable  # (label, args) -> args normalised
    run: Callable  # (launch, args) -> outputs
    fake: Callable | None  # (args) -> outputs with shapes only; None: run, launching nothing
    native: Callable | None  # () -> the C++ dispatcher op for compiled CPU graphs, or None
    arguments: tuple[str, ...]  # the schema's argument names
    Args: type  # the record check / run / fake take: a named tuple of the arguments but backend
    backend_at: int | None  # position of ``str backend`` among them (None: no backend)
    tensors: tuple[int, ...]  # positions of the Tensor / Tensor? arguments
    trailing: tuple  # defaults of the trailing arguments a call may leave out
    run_takes_backend: bool  # run(launch, *args, backend=...)

    def complete(self, args: tuple) -> tuple:
        """``args`` with omitted trailing defaults filled in."""
        missing = len(self.arguments) - len(args)
        return args + self.trailing[len(self.trailing) - missing:] if missing else args

    def record(self, args: tuple):
        """The ``Args`` record of a complete call's ``args`` (``backend`` dropped)."""
        at = self.backend_at
        return tuple.__new__(self.Args, args if at is None else args[:at] + args[at + 1:])

    def run_on(self, launch, backend: str, body):
        """``run`` with ``launch`` on the validated record ``body``."""
        if self.run_takes_backend:
            return self.run(launch, body, backend=backend)
        return self.run(launch, body)


DECLARED: dict[str, Declared] = {}


def _trailing_defaults(arguments) -> tuple:
    defaults = []
    for a in reversed(arguments):
        if not a.has_default_value():
            break
        defaults.append(a.default_value)
    return tuple(reversed(defaults))


def _no_launch(*args, **kwargs) -> None:
    """The launch a derived fake passes to ``run``: the outputs it allocated stay as they are."""


def define(op: str, schema: str, *, check: Callable, run: Callable, fake: Callable | None = None,
           label: str | None = None, fake_check: Callable | None = None,
           autograd: tuple[Callable, Callable] | None = None,
           native: Callable | None = None) -> Declared:
    """Declare ``bik::<op>`` (see the module docstring).

    ``label``: the public name in error messages (default ``bik.<op>``). ``fake_check``: the
    checks a fake call runs, for an op whose ``check`` reads device data (default ``check``).
    ``autograd``: ``(backward, setup_context)``, given exactly when the op's row has a
    backward; an op whose row refuses one gets the refusal. ``native``: for compiled CPU graphs
    with grad off, a function returning the C++ dispatcher op that serves a call (with the
    arguments ``check`` returns), or None when it is unavailable."""
    row = TABLE[op]  # KeyError here: an op without a row cannot be defined
    if (autograd is not None) != row.backward:
        raise ValueError(f"bik::{op}: its row says backward={row.backward}, but the "
                         f"declaration {'gives' if autograd else 'lacks'} an autograd formula")
    label = label or f"bik.{op}"
    torch.library.define(f"bik::{op}", schema)
    arguments = getattr(torch.ops.bik, op).default._schema.arguments
    names = tuple(a.name for a in arguments)
    decl = Declared(op=op, label=label, check=check, run=run, fake=fake, native=native,
                    arguments=names,
                    Args=namedtuple(f"{op}_args", [n for n in names if n != "backend"]),
                    backend_at=names.index("backend") if "backend" in names else None,
                    tensors=tuple(i for i, a in enumerate(arguments)
                                  if str(a.type).startswith("Tensor")),
                    trailing=_trailing_defaults(arguments),
                    run_takes_backend="backend" in inspect.signature(run).parameters)
    shape_check = fake_check or check

    def impl(*args):
        args = decl.complete(args)
        body = check(label, decl.record(args))
        if decl.backend_at is None:  # data movement: no backend to choose
            return run(None, body)
        backend = args[decl.backend_at]
        device = args[decl.tensors[0]].device
        return decl.run_on(implementation(op, backend, device, label=label), backend, body)

    def fake_impl(*args):
        args = decl.complete(args)
        body = shape_check(label, decl.record(args))
        if fake is not None:
            return fake(body)
        backend = None if decl.backend_at is None else args[decl.backend_at]
        return decl.run_on(_no_launch, backend, body)

    torch.library.impl(f"bik::{op}", ("cpu", "cuda"), impl)
    torch.library.register_fake(f"bik::{op}", fake_impl)
    if autograd is not None:
        backward, setup_context = autograd
        torch.library.register_autograd(f"bik::{op}", backward, setup_context=setup_context)
    elif row.backends:  # an op without backends (data movement) has no autograd either way
        register_refusal(op, row.refusal)
    DECLARED[op] = decl
    return decl

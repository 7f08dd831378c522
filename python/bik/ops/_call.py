"""The route chooser: how one call of a bik op reaches its kernel, for every front end.

Three routes compute the same bits; what differs is who can observe the call:

* **direct**: the op's ``check`` (skipped for arguments the caller has validated) and ``run``
  with the backend's entry point, in this thread, with nothing else. ``torch.ops.bik.matmul``
  on a one-row product costs ~20 µs of dispatcher, autograd wrapper and Python around a ~1 µs
  kernel (``bik bench boundary``); where nothing can observe the difference the call skips
  them: not while torch.compile traces, not for tensor subclasses (fake, functional), not
  while a TorchDispatchMode other than bik's own pass-through layer is active (it must see
  the op), and not when autograd must record the op's backward.
* **native**: an op that declares a C++ dispatcher kernel (``native=``) is called as that
  kernel on the CPU in a graph compiled with grad off (the compiled step then runs no Python
  around it), and on the direct route once the kernels are loaded (``bik.enable()`` or a
  compiled graph loaded them; the direct route never starts their build): after the op's
  check, the C++ kernel runs in place of the Python launcher, called as the loaded module's
  function rather than through torch.ops (bik.linear 25 -> 17 -> 16 µs on a 1 x 64 x 64
  product: bench/results/cpu-boundary-pybind-2026-12-05.json), while it gives the launcher's
  bits and errors: the split rule it loaded with is today's and the CPU extension is loaded
  (``native.py``).
  Same kernel entry, same bits (tests/mode/test_enable_native.py).
* **torch.ops.bik**: everything else (tracing, autograd, subclasses, other modes).

The public functions (``bik.matmul`` ...), the mode's handlers and every front end call
:func:`call`; only ops/ imports a backend's launcher.
"""

from __future__ import annotations

import torch

from bik.ops._checks import debug_checks
from bik.ops._define import DECLARED
from bik.ops._registry import launcher

__all__ = ["call", "direct_ok"]

_Tensor = torch.Tensor
_AUTOGRAD = torch._C.DispatchKey.AutogradFunctionality  # excluded below autograd, any device
_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded


def _only_bik_modes() -> bool:
    depth = torch._C._len_torch_dispatch_stack()
    return depth == 0 or (depth == 1 and getattr(torch._C._get_dispatch_stack_at(0),
                                                 "bik_layer", False))


def direct_ok(*tensors) -> bool:
    """True when a call on these tensors may skip torch.ops.bik (see the module docstring)."""
    if torch.compiler.is_compiling() or not _only_bik_modes():
        return False
    # Below autograd (a dispatcher override, a dispatch mode) the backward is recorded already.
    grad = torch.is_grad_enabled() and not _is_excluded(_AUTOGRAD)
    for t in tensors:
        # Not a tensor at all: the op's check names the argument (the dispatcher would not).
        if isinstance(t, _Tensor) and (type(t) is not _Tensor or (grad and t.requires_grad)):
            return False
    return True


def _native_on_cpu(decl, args) -> bool:
    """The op has a C++ kernel and the call runs on the CPU: its backend, or for an op without
    one (data movement) the device of its first tensor."""
    if decl.native is None:
        return False
    if decl.backend_at is None:
        first = args[decl.tensors[0]]
        return isinstance(first, _Tensor) and first.device.type == "cpu"
    return args[decl.backend_at] == "cpu"


def _tensor_args(decl, args) -> bool:
    """Every Tensor argument a tensor (or an optional one None): anything else is left to the
    op's check, which names it (the dispatcher's type error would not name bik's op)."""
    for i in decl.tensors:
        if not isinstance(args[i], _Tensor) and args[i] is not None:
            return False
    return True


def _compiling_without_grad() -> bool:
    """Compiling (not exporting: an exported program keeps bik's portable ops) with grad off."""
    return torch.compiler.is_compiling() and not torch.compiler.is_exporting() \
        and not torch.is_grad_enabled()


def call(op: str, *args, validated: bool = False):
    """Run ``bik::<op>`` on ``args`` (the schema's arguments in order, ``backend`` resolved).

    ``validated=True``: the caller has checked the arguments and passes them in the form the
    op's ``check`` returns (dims normalised); the direct route then skips the
    check. The other routes check anyway: they are the op itself."""
    decl = DECLARED[op]
    if direct_ok(*[args[i] for i in decl.tensors]):
        args = decl.complete(args)
        body = decl.record(args)
        native = _native_on_cpu(decl, args)
        # (BIK_DEBUG_CHECKS: the op's check reads the device data its kernel would trust)
        if native and decl.native.checks_itself and not debug_checks() \
                and _tensor_args(decl, args):
            kernel = decl.native(loaded_only=True)
            if kernel is not None:  # it checks what it serves and hands the rest to bik's op
                return kernel(*body)
        if not validated:
            body = decl.check(decl.label, body)
        if decl.backend_at is None:
            return decl.run(None, body)
        backend = args[decl.backend_at]
        if native and not decl.native.checks_itself:
            kernel = decl.native(loaded_only=True)
            if kernel is not None:
                return kernel(*body)
        device = args[decl.tensors[0]].device
        return decl.run_on(launcher(op, backend, device), backend, body)
    if decl.native is not None and decl.backend_at is not None \
            and args[decl.backend_at] == "cpu" and _compiling_without_grad():
        kernel = decl.native()
        if kernel is not None:
            return kernel(*decl.record(decl.complete(args)))
    return getattr(torch.ops.bik, op)(*args)

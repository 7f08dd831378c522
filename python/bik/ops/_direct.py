"""When bik may skip ``torch.ops.bik``'s dispatcher and autograd wrapper for a call.

``torch.ops.bik.matmul`` on a one-row product costs ~20 µs of dispatch, register_autograd's
wrapper and Python around a ~1 µs kernel (``bik bench boundary``). Where nothing can observe the
difference, a caller may run the op's launch (``run_*`` in its op.py) itself: not while
torch.compile traces, not for tensor subclasses (fake, functional), not while a
TorchDispatchMode other than bik's own pass-through layer is active (it must see the op), and
not when autograd must record the op's backward.
"""

from __future__ import annotations

import torch

__all__ = ["direct_ok"]

_Tensor = torch.Tensor
_AUTOGRAD = torch._C.DispatchKey.AutogradFunctionality  # excluded below autograd, any device
_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded


def _only_bik_modes() -> bool:
    depth = torch._C._len_torch_dispatch_stack()
    return depth == 0 or (depth == 1 and getattr(torch._C._get_dispatch_stack_at(0),
                                                 "bik_layer", False))


def direct_ok(*tensors) -> bool:
    """True when a call on these tensors may run the op's launch directly."""
    if torch.compiler.is_compiling() or not _only_bik_modes():
        return False
    # Below autograd (a dispatcher override, a dispatch mode) the backward is recorded already.
    grad = torch.is_grad_enabled() and not _is_excluded(_AUTOGRAD)
    for t in tensors:
        if t is not None and (type(t) is not _Tensor or (grad and t.requires_grad)):
            return False
    return True

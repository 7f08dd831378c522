"""batch_invariant_mode's dispatch layer: a TorchDispatchMode that sees every aten call below
autograd in eager code (the backward formulas' ops, C++ composites, what the function layer
did not map) and routes the ones in ``HANDLERS``.

It declares ``ignore_compile_internals``: torch.compile then neither skips the frame nor
traces this mode (the function layer above puts bik's ops into the graph), and the compiled
artifact runs with the mode on, so its calls into aten (extern matmuls, fallbacks) still
reach the handlers.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bik.mode._handlers import HANDLERS
from bik.mode._stats import route

__all__ = ["BikDispatchMode"]

_composite: dict = {}


def _is_composite(func) -> bool:
    known = _composite.get(func)
    if known is None:
        # prim:: ops (prim.device under torch.export) are not in the dispatcher's registry:
        # asking about them raised inside torch's tracer, which aborted the process.
        known = _composite[func] = func.namespace == "aten" and \
            torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")
    return known


class BikDispatchMode(TorchDispatchMode):
    bik_layer = True  # ops/_call.py: bik's ops may skip this mode (it passes them through)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = HANDLERS.get(func)
        if handler is None:
            if _is_composite(func):
                # Seen above its decomposition (e.g. under inference_mode): decompose with the
                # mode on, so its matmuls and reductions reach the handlers as under no_grad.
                with self:
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            return func(*args, **kwargs)
        return route(func, handler, args, kwargs, lambda: func(*args, **kwargs))

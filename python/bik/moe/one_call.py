"""The one-call C++ route of bik.moe (csrc/native/moe.h): where it serves, and a count of the
calls it served."""

from __future__ import annotations

import collections

import torch

__all__ = ["ONE_CALL", "fused_module"]

# Calls served by the one-call route, "router" and "experts", in this process: the vLLM plugin
# reports them (its stats()), so a test can see the route served.
ONE_CALL: collections.Counter = collections.Counter()


def fused_module(*tensors: torch.Tensor):
    """bik's C++ MoE functions where they give bik.moe's torch code's bits: under
    bik.enable() (theirs are the enabled code's), its C++ kernels loaded, nothing traced and
    no autograd to record; None elsewhere. Each function also returns None for a call it does
    not serve; the torch code then runs."""
    from bik.mode import _enable

    if not _enable.is_enabled() or torch.compiler.is_compiling():
        return None
    if any(t.device.type != "cpu" or (t.requires_grad and torch.is_grad_enabled())
           for t in tensors):
        return None
    from bik.ops import _native
    from bik.runtime import native_ext

    return native_ext.module() if _native.ready() else None

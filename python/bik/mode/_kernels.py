"""The bik ops a handler calls: ``torch.ops.bik`` or, where nothing can tell the difference,
the same ops' launch without the dispatcher and autograd round trip.

Calling ``torch.ops.bik.matmul`` from a handler costs the dispatcher, the autograd wrapper
that register_autograd installs, and the op's own validation, on top of what the handler has
already checked: about 25 µs against a ~4 µs kernel for a one-row product (bik bench
boundary). Below autograd (bik.enable()'s overrides, the dispatch layer) and in eager code with
nothing to record, the handler calls the op's ``run_*`` (validated by the handler, once)
instead. ``torch.ops.bik`` stays the path wherever it is observable: while torch.compile or a
tracer runs (fake or functional tensors, a TorchDispatchMode still on the stack), and where
autograd must record bik's backward.
"""

from __future__ import annotations

import torch

from bik.ops.matmul import native as _native
from bik.ops._direct import direct_ok
from bik.ops._registry import launcher
from bik.ops.matmul.op import run_bmm, run_matmul
from bik.ops.reductions.op import run_mean, run_softmax
from bik.ops.rms_norm.op import run_rms_norm

__all__ = ["bik_ops"]

class _Direct:
    """torch.ops.bik's signatures, for inputs a handler has validated."""

    @staticmethod
    def matmul(a, b, bias, out_dtype, backend):
        return run_matmul(launcher("matmul", backend, a.device), a, b, bias,
                          out_dtype or a.dtype)

    @staticmethod
    def bmm(a, b, out_dtype, backend):
        return run_bmm(launcher("bmm", backend, a.device), a, b, out_dtype or a.dtype)

    @staticmethod
    def softmax(x, dim, dtype, backend):
        return run_softmax(launcher("softmax", backend, x.device), x, dim, dtype or x.dtype,
                           log=False)

    @staticmethod
    def log_softmax(x, dim, dtype, backend):
        return run_softmax(launcher("log_softmax", backend, x.device), x, dim,
                           dtype or x.dtype, log=True)

    @staticmethod
    def mean(x, dim, keepdim, dtype, backend):
        return run_mean(launcher("mean", backend, x.device), x, dim, keepdim, dtype or x.dtype)

    @staticmethod
    def rms_norm(x, weight, eps, backend):
        return run_rms_norm(launcher("rms_norm", backend, x.device), x, weight, eps)

    # attention: its cost is the kernel's, not the boundary's
    attention_varlen = torch.ops.bik.attention_varlen
    attention_varlen_backward = torch.ops.bik.attention_varlen_backward


class _Compiled:
    """torch.ops.bik's signatures for a graph being compiled with grad off: the CPU products
    as ``bik_aten::matmul`` / ``bmm`` (C++: no Python impl or autograd wrapper at run time,
    where the compiled step calls them ~200 times; csrc/aten/dispatch_cpu.cpp), the rest as
    ``torch.ops.bik``."""

    @staticmethod
    def matmul(a, b, bias, out_dtype, backend):
        if backend != "cpu" or not _native.ready():  # asked only here: it may build them
            return torch.ops.bik.matmul(a, b, bias, out_dtype, backend)
        return torch.ops.bik_aten.matmul(a, b, bias, out_dtype)

    @staticmethod
    def bmm(a, b, out_dtype, backend):
        if backend != "cpu" or not _native.ready():
            return torch.ops.bik.bmm(a, b, out_dtype, backend)
        return torch.ops.bik_aten.bmm(a, b, out_dtype)

    softmax = torch.ops.bik.softmax
    log_softmax = torch.ops.bik.log_softmax
    mean = torch.ops.bik.mean
    rms_norm = torch.ops.bik.rms_norm
    attention_varlen = torch.ops.bik.attention_varlen
    attention_varlen_backward = torch.ops.bik.attention_varlen_backward


def _compiled_products() -> bool:
    """Compiling (not exporting: an exported program keeps bik's portable ops) with grad
    off."""
    return torch.compiler.is_compiling() and not torch.compiler.is_exporting() \
        and not torch.is_grad_enabled()


def bik_ops(*tensors):
    """``_Direct`` when no one can observe skipping torch.ops.bik for these inputs
    (ops/_direct.py), ``_Compiled`` in a graph compiled with grad off, else ``torch.ops.bik``.
    Dims handed to the direct ops must be normalised (sorted, >= 0)."""
    if direct_ok(*tensors):
        return _Direct
    return _Compiled if _compiled_products() else torch.ops.bik

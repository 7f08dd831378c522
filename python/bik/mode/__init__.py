"""bik's batch-invariant mode: stock aten ops run on bik's kernels while it is on.

``with bik.batch_invariant_mode():`` pushes a ``TorchDispatchMode`` onto this thread's mode
stack. Every aten call below autograd reaches it; the ops in ``HANDLERS`` (matmuls, softmax,
mean, sum, RMSNorm, plain SDPA, and the reductions of their backward formulas) run on
``torch.ops.bik.*`` when their dtypes and shapes are ones bik serves, everything else runs the
original kernel, which a dispatch mode never replaces. Handlers: bik/mode/_routes.py (forward)
and bik/mode/_grad_routes.py (backward); flags: bik/mode/_numerics.py. Design and limits:
docs/design.md (the batch-invariant mode), docs/integration.md.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from bik.mode._grad_routes import GRAD_HANDLERS
from bik.mode._numerics import acquire_flags, release_flags
from bik.mode._routes import HANDLERS as _FORWARD_HANDLERS
from bik.mode._routes import Fallback

__all__ = [
    "BatchInvarianceWarning",
    "ModeStats",
    "batch_invariant_mode",
    "is_batch_invariant_mode_enabled",
    "mode_stats",
    "reset_mode_stats",
    "set_batch_invariant_mode",
]

_NAME = "bik.batch_invariant_mode"


class BatchInvarianceWarning(UserWarning):
    """An op under the mode ran on a stock kernel that is not batch-invariant (once per reason)."""


class ModeStats(NamedTuple):
    routed: dict[str, int]  # aten op -> calls bik served
    fallbacks: dict[str, int]  # "aten op: reason" -> calls the original kernel served


_routed: Counter = Counter()
_fallbacks: Counter = Counter()
_warned: set[str] = set()


def mode_stats() -> ModeStats:
    """Counts (all threads, since the last reset) of calls the mode routed to bik and of calls
    it gave to the original kernel, with the reason."""
    return ModeStats(dict(_routed), dict(_fallbacks))


def reset_mode_stats() -> None:
    """Zero the counters of :func:`mode_stats` and re-arm the once-per-reason warnings."""
    _routed.clear()
    _fallbacks.clear()
    _warned.clear()


HANDLERS = {**_FORWARD_HANDLERS, **GRAD_HANDLERS}
_composite: dict = {}


def _is_composite(func) -> bool:
    known = _composite.get(func)
    if known is None:
        known = _composite[func] = torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd")
    return known


class _BikDispatchMode(TorchDispatchMode):
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
        try:
            out = handler(func, *args, **kwargs)
        except Fallback as fb:
            key = f"{func}: {fb.reason}"
            _fallbacks[key] += 1
            if fb.warn and key not in _warned:
                _warned.add(key)
                warnings.warn(f"{_NAME}: {key}; this call ran the stock kernel, which is not "
                              f"batch-invariant", BatchInvarianceWarning, stacklevel=2)
            return func(*args, **kwargs)
        _routed[str(func)] += 1
        return out


# ---- the public switch -----------------------------------------------------------------------

_tls = threading.local()  # depth and mode object of this thread


def is_batch_invariant_mode_enabled() -> bool:
    """True when the mode is on in the calling thread."""
    return getattr(_tls, "depth", 0) > 0


def set_batch_invariant_mode(enabled: bool) -> None:
    """Turn the mode on (``True``) or leave one level of it (``False``) in the calling thread.

    Calls nest: each ``True`` needs one ``False``; the outermost ``True`` pushes bik's dispatch
    mode and turns TF32 off, the matching ``False`` pops it and restores the flags exactly.
    ``False`` without a matching ``True`` in this thread raises RuntimeError, as does leaving
    the mode while a TorchDispatchMode entered after it is still active.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"bik.set_batch_invariant_mode: enabled must be a bool, got "
                        f"{type(enabled).__name__}")
    depth = getattr(_tls, "depth", 0)
    if enabled:
        if depth == 0:
            mode = _BikDispatchMode()
            acquire_flags()
            try:
                mode.__enter__()
            except BaseException:
                release_flags()
                raise
            _tls.mode = mode
        _tls.depth = depth + 1
        return
    if depth == 0:
        raise RuntimeError("bik.set_batch_invariant_mode(False): the mode is not on in this "
                           "thread (each False must match an earlier True in the same thread)")
    if depth == 1:
        mode = _tls.mode
        if _get_current_dispatch_mode() is not mode:
            raise RuntimeError(
                f"bik.set_batch_invariant_mode(False): another TorchDispatchMode "
                f"({type(_get_current_dispatch_mode()).__name__}) was entered after bik's mode "
                f"and is still active; exit it first")
        try:
            mode.__exit__(None, None, None)
        finally:
            _tls.mode = None
            _tls.depth = 0
            release_flags()
        return
    _tls.depth = depth - 1


@contextmanager
def batch_invariant_mode() -> Iterator[None]:
    """Run stock PyTorch ops on bik's batch-invariant kernels inside the block (this thread).

    Routed: aten mm, addmm (alpha/beta honoured), bmm (and their .out forms), mv, dot, matmul,
    linear, _softmax/softmax, _log_softmax/log_softmax, mean (any dims), sum (any dims),
    rms_norm/_fused_rms_norm, and scaled_dot_product_attention / the CPU flash kernel when there
    is no mask, no dropout and equal-length sequences (causal with Lq == Lk, or no mask).
    bf16/fp16/fp32 on CPU and CUDA. Other dtypes and cases run the original kernel (counted in
    :func:`mode_stats`; attention fallbacks warn once with :class:`BatchInvarianceWarning`).

    Training: under grad, autograd records each op's stock backward formula above the mode;
    call ``.backward()`` inside the mode and that formula's aten ops are routed too (the
    matmuls, ``sum``, ``_softmax_backward_data``, ``_log_softmax_backward_data``,
    ``_fused_rms_norm_backward`` and the CPU flash-attention backward, which runs
    ``bik::attention_varlen_backward``). A row's input gradients are then batch-invariant and
    weight gradients are fixed-order sums over the rows (docs/design.md#backward). A backward
    run outside the mode uses stock kernels (correct, not invariant).
    Re-entrant and exception-safe; TF32 is off (process-wide) while any thread is in the mode.
    """
    set_batch_invariant_mode(True)
    try:
        yield
    finally:
        set_batch_invariant_mode(False)

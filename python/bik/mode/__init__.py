"""bik's front ends: stock torch code on bik's batch-invariant kernels.

- ``bik.batch_invariant_mode()`` (this thread): a function layer (TorchFunctionMode,
  _function_layer.py) that maps torch's Python API to bik ops, which is what torch.compile
  traces, over a dispatch layer (TorchDispatchMode, _dispatch_layer.py) that in eager code
  also routes the aten ops the function layer never sees (backward formulas, C++ composites).
- ``bik.enable()`` (every thread, _enable.py): bik's handlers registered over aten's CPU/CUDA
  kernels at the dispatcher, the original kernels serving what bik does not.

Both run the handlers of _routes.py / _grad_routes.py and count in :func:`mode_stats`.
Which to use when: docs/integration.md. Design: docs/design.md#front-ends.
"""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from bik.mode._dispatch_layer import BikDispatchMode
from bik.mode._enable import disable, enable, enabled, is_enabled
from bik.mode._function_layer import BikFunctionMode
from bik.mode._numerics import acquire_flags, release_flags
from bik.mode._stats import BatchInvarianceWarning, ModeStats, mode_stats, reset_mode_stats

__all__ = [
    "BatchInvarianceWarning",
    "ModeStats",
    "batch_invariant_mode",
    "disable",
    "enable",
    "enabled",
    "is_batch_invariant_mode_enabled",
    "is_enabled",
    "mode_stats",
    "reset_mode_stats",
    "set_batch_invariant_mode",
]

_tls = threading.local()  # this thread's eager entries: depth, the dispatch layer, the stack


def _eager_enter() -> None:
    depth = getattr(_tls, "depth", 0)
    if depth == 0:
        layer = BikDispatchMode()
        acquire_flags()
        try:
            layer.__enter__()
        except BaseException:
            release_flags()
            raise
        _tls.dispatch_layer = layer
    _tls.depth = depth + 1


def _misnesting(layer: BikFunctionMode) -> str | None:
    """Why leaving now would not pop bik's own layers (a mode entered after them is still
    active), or None."""
    stack_len = torch._C._len_torch_function_stack()
    top = torch._C._get_function_stack_at(stack_len - 1) if stack_len else None
    if top is not layer:
        return (f"bik.batch_invariant_mode: another TorchFunctionMode ({type(top).__name__}) "
                f"was entered after bik's mode and is still active")
    if getattr(_tls, "depth", 0) == 1 and _get_current_dispatch_mode() is not _tls.dispatch_layer:
        return (f"bik.batch_invariant_mode: another TorchDispatchMode "
                f"({type(_get_current_dispatch_mode()).__name__}) was entered after bik's mode "
                f"and is still active")
    return None


def _check_exit(layer: BikFunctionMode) -> None:
    """Leaving must pop bik's own layers: refuse while a mode entered after them is active."""
    problem = _misnesting(layer)
    if problem is not None:
        raise RuntimeError(f"{problem}; exit it first")


def _pop_from_under(stack_len, stack_at, pop, push, layer, fix_up=None) -> None:
    """Take ``layer`` out of a mode stack from under the modes entered after it, which stay
    active in their order (``fix_up(those modes, the lowest last)`` runs before they are pushed
    back)."""
    above = []
    while stack_len() and stack_at(stack_len() - 1) is not layer:
        above.append(pop())
    if stack_len():
        pop()
    try:
        if above and fix_up is not None:
            fix_up(above)
    finally:  # the other modes go back whatever happens
        for mode in reversed(above):
            push(mode)


def _leave_misnested(layer: BikFunctionMode) -> None:
    """Turn this entry of bik's mode off although a mode entered after it is still on: bik's
    layers leave the stacks from under it, the numerics flags are released, and the other mode
    stays active (it is its owner's to exit)."""
    c = torch._C
    _pop_from_under(c._len_torch_function_stack, c._get_function_stack_at,
                    c._pop_torch_function_stack, c._push_on_torch_function_stack, layer)
    if _tls.depth == 1 and _get_current_dispatch_mode() is _tls.dispatch_layer:
        _eager_exit()  # only the function layer was misnested
        return
    if _tls.depth == 1:
        dispatch = _tls.dispatch_layer
        saved = [dispatch.old_dispatch_mode_flags.pop(),
                 dispatch.old_non_infra_dispatch_mode_flags.pop(),
                 dispatch.old_without_ignore_compile_internals_dispatch_mode_flags.pop()]

        def inherit_flags(above):  # what the mode right above restores on exit: bik's saved
            mode = above[-1]
            names = ("old_dispatch_mode_flags", "old_non_infra_dispatch_mode_flags",
                     "old_without_ignore_compile_internals_dispatch_mode_flags")
            flags = [getattr(mode, n, None) for n in names]
            # Only an instance entered once, through __enter__ (which filled these deques):
            # otherwise which entry is bik's cannot be told, and the flags are left as they are.
            if above.count(mode) == 1 and all(flags):
                for deque, value in zip(flags, saved):
                    deque[-1] = value

        # The global "a mode is on" flags stay as they are: the other mode keeps them true.
        _pop_from_under(c._len_torch_dispatch_stack, c._get_dispatch_stack_at,
                        lambda: c._pop_torch_dispatch_stack(None),
                        c._push_on_torch_dispatch_stack, dispatch, inherit_flags)
        _tls.dispatch_layer = None
        release_flags()
    _tls.depth -= 1


def _eager_exit() -> None:
    depth = _tls.depth
    if depth == 1:
        layer, _tls.dispatch_layer = _tls.dispatch_layer, None
        try:
            layer.__exit__(None, None, None)
        finally:
            release_flags()
    _tls.depth = depth - 1


class _BatchInvariantMode(BikFunctionMode):
    """The function layer; in eager code its first entry in a thread also pushes the dispatch
    layer and turns TF32 off. Inside a function torch.compile traces, entering it pushes the
    function layer only (the dispatch layer cannot be traced, and process flags are eager
    state)."""

    def __enter__(self):
        if not torch.compiler.is_compiling():
            _eager_enter()
        try:
            return super().__enter__()
        except BaseException:
            if not torch.compiler.is_compiling():
                _eager_exit()
            raise

    def __exit__(self, exc_type, exc, tb):
        if not torch.compiler.is_compiling():
            problem = _misnesting(self)
            if problem is not None:
                # A block cannot be left twice: turn bik's mode off anyway. An exception in
                # flight is the user's and propagates; without one, say what was left open.
                _leave_misnested(self)
                if exc_type is None:
                    raise RuntimeError(f"{problem}: this block's bik mode is now off, the "
                                       f"other mode is still on (exit modes in reverse order)")
                return
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            if not torch.compiler.is_compiling():
                _eager_exit()


def is_batch_invariant_mode_enabled() -> bool:
    """True when the mode is on in the calling thread (eager entries)."""
    return getattr(_tls, "depth", 0) > 0


def set_batch_invariant_mode(enabled: bool) -> None:
    """Enter (``True``) or leave one level of (``False``) :func:`batch_invariant_mode` in the
    calling thread, for code that cannot use a ``with`` block.

    Calls nest: each ``True`` needs one ``False`` in the same thread; ``False`` without a
    matching ``True`` raises RuntimeError, as does leaving while a TorchDispatchMode entered
    after it is still active.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"bik.set_batch_invariant_mode: enabled must be a bool, got "
                        f"{type(enabled).__name__}")
    stack = _tls.__dict__.setdefault("set_stack", [])
    if enabled:
        mode = _BatchInvariantMode()
        mode.__enter__()
        stack.append(mode)
        return
    if not stack:
        raise RuntimeError("bik.set_batch_invariant_mode(False): the mode is not on in this "
                           "thread (each False must match an earlier True in the same thread)")
    _check_exit(stack[-1])  # raises, leaving the stack as it is, if it cannot leave
    stack[-1].__exit__(None, None, None)
    stack.pop()


def batch_invariant_mode() -> BikFunctionMode:
    """Run stock PyTorch code on bik's batch-invariant kernels inside the block (this thread).

    ``with bik.batch_invariant_mode(): ...`` works in eager code, around
    ``torch.compile(model, fullgraph=True)`` calls, and inside a compiled function.

    Routed: torch.mm / addmm (alpha/beta honoured) / bmm / mv / dot (and their ``out=``),
    matmul and ``@``, F.linear, softmax / log_softmax, mean and sum (any dims, ``dtype=``),
    F.rms_norm (and the aten ops behind all of them), and scaled_dot_product_attention
    without dropout: unmasked (is_causal with Lq == Lk, or no mask), or with a padding
    (+ causal) attn_mask, each sequence's real queries and keys compacted into one varlen
    sequence (mode/_masks.py: which masks are served; masked calls are routed in eager code,
    not under torch.compile or during CUDA graph capture; while autograd records, their
    backward runs per sequence too, on bik::attention_varlen_backward).
    bf16/fp16/fp32 on CPU and CUDA. Other dtypes and cases, and input torch rejects,
    run the stock function (so torch's own errors are raised), counted in
    :func:`mode_stats`; attention fallbacks warn once with :class:`BatchInvarianceWarning`.

    Compiled: the graph holds ``bik::*`` ops where the model called these functions, and
    Inductor keeps them as extern calls. Autograd: a routed op's backward is bik's registered
    batch-invariant backward; in eager code, ``.backward()`` inside the mode also routes the
    aten ops of stock backward formulas (docs/design.md#backward).
    Re-entrant and exception-safe; TF32 is off (process-wide) while any thread is in the
    eager mode. Other threads are not affected: see :func:`bik.enable` for engines.
    """
    return _BatchInvariantMode()

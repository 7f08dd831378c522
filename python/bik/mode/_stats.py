"""What the front ends did, counted for every thread: calls bik served and calls the original
kernel served (with the reason), and the once-per-reason BatchInvarianceWarning.

:func:`route` is the one place a front end runs a handler, so the three front ends
(batch_invariant_mode's function and dispatch layers, bik.enable()'s dispatcher overrides)
count and warn alike. Nothing is counted while torch.compile traces: a traced count would
happen once per compilation, not once per call.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch

from bik.mode._kit import Fallback

__all__ = ["BatchInvarianceWarning", "ModeStats", "count_native", "mode_stats", "reset_mode_stats",
           "route"]

_NAME = "bik"


class BatchInvarianceWarning(UserWarning):
    """An op under bik ran on a stock kernel that is not batch-invariant (once per reason)."""


class ModeStats(NamedTuple):
    routed: dict[str, int]  # aten op -> calls bik served
    fallbacks: dict[str, int]  # "aten op: reason" -> calls the original kernel served


_lock = threading.Lock()  # Counter updates are read-modify-write; engines call from threads
_routed: Counter = Counter()  # keyed by the op object; named when read (str(op) costs ~1 µs)
_fallbacks: Counter = Counter()
_warned: set[str] = set()
_native: list = []  # (names, read, reset) of C++ kernels' own counts (bik.enable(): _enable.py)


def count_native(names: list[str], read: Callable[[], list[int]],
                 reset: Callable[[], None]) -> None:
    """Add the calls C++ kernels served (``read()``: counts in ``names``' order) to
    :func:`mode_stats`' routed counts."""
    _native.append((names, read, reset))


def mode_stats() -> ModeStats:
    """Counts (all threads, every front end, since the last reset) of eager calls bik served
    and of calls it gave to the original kernel, with the reason. Compiled code is not counted
    call by call: see docs/integration.md for how to inspect a compiled graph."""
    with _lock:
        routed = Counter({str(op): n for op, n in _routed.items()})
        fallbacks = dict(_fallbacks)
    for names, read, _ in _native:
        routed.update({name: n for name, n in zip(names, read()) if n})
    return ModeStats(dict(routed), fallbacks)


def reset_mode_stats() -> None:
    """Zero the counters of :func:`mode_stats` and re-arm the once-per-reason warnings."""
    with _lock:
        _routed.clear()
        _fallbacks.clear()
        _warned.clear()
    for _, _, reset in _native:
        reset()


def _count_fallback(func, fb: Fallback) -> None:
    key = f"{func}: {fb.reason}"
    with _lock:
        _fallbacks[key] += 1
        first = fb.warn and key not in _warned
        if first:
            _warned.add(key)
    if first:
        warnings.warn(f"{_NAME}: {key}; this call ran the stock kernel, which is not "
                      f"batch-invariant", BatchInvarianceWarning, stacklevel=4)


def route(func, handler: Callable, args, kwargs, stock: Callable, *,
          count_fallbacks: bool = True):
    """``handler(func, *args, **kwargs)``, counted; on Fallback, ``stock()``.

    ``count_fallbacks=False`` where a layer below sees the stock call again and counts it
    with a more precise reason (batch_invariant_mode's function layer above its dispatch
    layer)."""
    try:
        out = handler(func, *args, **kwargs)
    except Fallback as fb:
        if count_fallbacks and not torch.compiler.is_compiling():
            _count_fallback(func, fb)
        return stock()
    if not torch.compiler.is_compiling():
        with _lock:
            _routed[func] += 1
    return out

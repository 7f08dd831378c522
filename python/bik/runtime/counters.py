"""Zeroed int32 counters that a kernel returns to zero: the tickets of single-launch folds.

A kernel that spreads one output tile over several programs and lets the last to arrive fold
the partials (an atomic ticket per tile) needs its tickets at zero when it starts. Allocating
``torch.zeros`` per call costs an aten op and a memset launch. Instead each kernel that takes
:func:`zeroed_counters` resets every ticket it used before it exits (the last program, which
alone reads it after the others), so the buffer is zero again for the next kernel on the same
stream: kernels on one stream run one after another, so no two ever share a ticket.

One buffer per (device, stream), grown when a call needs more (a new zeroed buffer; the old one
is released to the caching allocator, which reuses it on that stream only after the work queued
there). While a CUDA graph is being captured, a call gets a fresh ``torch.zeros`` (captured as
a memset node), so a graph never holds the eager buffer of a stream it may be replayed beside.
On the CPU (the Triton interpreter, the dry run) there is one buffer per thread.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["zeroed_counters"]

_MIN = 1024
_BUFFERS: dict[tuple, torch.Tensor] = {}
_LOCK = threading.Lock()


def _key(device: torch.device) -> tuple | None:
    """The buffer's key, or None while the current stream is capturing a CUDA graph."""
    if device.type != "cuda":
        return (device.type, threading.get_ident())
    if torch.cuda.is_current_stream_capturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return ("cuda", index, torch._C._cuda_getCurrentRawStream(index))


def zeroed_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 counters on ``device``, all zero when the current stream reaches
    the kernel that takes them; that kernel must leave every counter it touches at zero."""
    key = _key(device)
    if key is None:
        return torch.zeros(max(n, 1), dtype=torch.int32, device=device)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < n:
        with _LOCK:
            buf = _BUFFERS.get(key)
            if buf is None or buf.numel() < n:
                size = max(_MIN, 1 << max(0, n - 1).bit_length())
                buf = _BUFFERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return buf

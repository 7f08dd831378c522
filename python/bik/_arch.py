"""Which device a kernel runs for: the GPU arch key of the config tables, or the interpreter.

Below every kernel and config lookup; imports nothing of bik.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["device_arch", "interpreter_active"]


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1).

    Triton reads the variable when a kernel module is imported, so it must be set before
    the process first uses a Triton kernel; bik reads it at call time only to decide
    whether CPU tensors may go to the Triton backend.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def device_arch(device: torch.device) -> str:
    """The arch key the config tables use: 'sm90', 'sm80', ... or 'interpreter' / 'cpu'.

    Cached per device index so no call pays for a device query after the first.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_arch(index)
    return "interpreter" if interpreter_active() else "cpu"

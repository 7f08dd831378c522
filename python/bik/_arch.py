"""Which device a kernel runs for: the GPU arch key of the config tables, or the interpreter.

Below every kernel and config lookup; imports nothing of bik.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["device_arch", "dry_run_arch", "interpreter_active", "set_dry_run_arch"]

_dry_run_arch: str | None = None  # bik.runtime.triton_dry_run's target while one is active


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1).

    Triton reads the variable when a kernel module is imported, so it must be set before
    the process first uses a Triton kernel; bik reads it at call time only to decide
    whether CPU tensors may go to the Triton backend.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dry_run_arch() -> str | None:
    """The GPU arch a dry run (``bik.runtime.triton_dry_run``) emulates on the host, or None:
    while one is active, CPU tensors stand for that GPU's on the Triton route."""
    return _dry_run_arch


def set_dry_run_arch(arch: str | None) -> None:
    global _dry_run_arch
    _dry_run_arch = arch


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
    if _dry_run_arch is not None:
        return _dry_run_arch
    return "interpreter" if interpreter_active() else "cpu"

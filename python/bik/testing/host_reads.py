"""Prove on the CPU that a call would make no device-to-host read on a GPU.

A read that syncs on a GPU hides on the CPU: ``.tolist()`` of a CPU tensor is a memory copy, and
it never reaches a TorchDispatchMode. So :func:`forbid_host_reads` takes away the Python entry
points through which code copies tensor data to the host — ``Tensor.tolist / item /
__int__ / __float__ / __bool__ / __index__``, ``torch.nonzero`` and ``Tensor.nonzero`` —
for the duration of a block: any call raises :class:`HostReadError` naming it.

What it cannot see: reads inside C++ (a boolean-mask index calls nonzero in ATen), so code
under test must not rely on those on the GPU path either. The CPU kernels of bik read their
metadata in C++ by design; on a GPU the same call launches kernels that read it on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["HostReadError", "forbid_host_reads"]

_TENSOR_METHODS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "nonzero")


class HostReadError(AssertionError):
    """Code read tensor data back to the host inside :func:`forbid_host_reads`."""


def _refuse(name: str):
    def refuse(*args, **kwargs):
        del args, kwargs
        raise HostReadError(f"{name} read tensor data back to the host (a device sync on a GPU)")

    return refuse


@contextlib.contextmanager
def forbid_host_reads() -> Iterator[None]:
    """Within the block, reading tensor data on the host raises :class:`HostReadError`.

    Not thread-safe (it patches ``torch.Tensor``): use it around one call in a test.
    """
    saved = {name: getattr(torch.Tensor, name) for name in _TENSOR_METHODS}
    saved_nonzero = torch.nonzero
    try:
        for name in _TENSOR_METHODS:
            setattr(torch.Tensor, name, _refuse(f"Tensor.{name}"))
        torch.nonzero = _refuse("torch.nonzero")
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.nonzero = saved_nonzero

"""Backend names, how ``backend=None`` resolves, and the errors for a backend that cannot run.

Nothing here falls back silently: an explicit backend either runs or raises
:class:`BackendUnavailableError` naming the op, the backend and the device.
"""

from __future__ import annotations

import functools

import torch

from bik._arch import interpreter_active

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "require_backend",
    "resolve_backend",
]

BACKENDS = ("triton", "cpu", "cuda")


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here (wrong device, missing build, ...)."""


@functools.cache
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - report whatever the import says
        return f"{type(exc).__name__}: {exc}"
    return None


def resolve_backend(op: str, backend: str | None, device: torch.device) -> str:
    """Turn ``backend=None`` into a concrete name by device, and check that it can run."""
    if backend is None:
        if device.type == "cuda":
            backend = "triton"
        elif device.type == "cpu":
            backend = "cpu"
        else:
            raise BackendUnavailableError(
                f"{op}: no bik backend for device {device}; bik runs on 'cuda' and 'cpu' tensors"
            )
    require_backend(op, backend, device)
    return backend


def require_backend(op: str, backend: str, device: torch.device) -> None:
    """Raise unless ``backend`` can run ``op`` on tensors of ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"{op}: unknown backend {backend!r}; expected one of {BACKENDS} or None")
    if backend == "cpu":
        if device.type != "cpu":
            raise BackendUnavailableError(
                f"{op}: backend='cpu' got tensors on {device}; move them to the CPU or use "
                f"backend='triton'"
            )
        from bik.runtime import cpu_ext

        if not cpu_ext.available():
            raise BackendUnavailableError(f"{op}: backend='cpu' is unavailable: "
                                          f"{cpu_ext.unavailable_reason()}")
    elif backend == "triton":
        err = _triton_import_error()
        if err is not None:
            raise BackendUnavailableError(f"{op}: backend='triton' needs triton ({err})")
        if device.type == "cpu" and not interpreter_active():
            raise BackendUnavailableError(
                f"{op}: backend='triton' got CPU tensors; Triton runs CPU tensors only in its "
                f"interpreter (set TRITON_INTERPRET=1 before the process starts)"
            )
        if device.type not in ("cpu", "cuda"):
            raise BackendUnavailableError(f"{op}: backend='triton' cannot run on {device}")
    else:  # "cuda": the CUDA C++ kernels of csrc/cuda, built by NVRTC at first use
        if device.type != "cuda":
            raise BackendUnavailableError(
                f"{op}: backend='cuda' (the CUDA C++ kernels) got tensors on {device}; it runs "
                f"on CUDA tensors only (use backend='cpu' on the CPU)"
            )
        from bik.runtime import cuda_jit

        if not cuda_jit.available():
            raise BackendUnavailableError(
                f"{op}: backend='cuda' is unavailable on {device}: "
                f"{cuda_jit.unavailable_reason()}"
            )

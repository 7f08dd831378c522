"""The (op, backend) table: which backends implement each ``torch.ops.bik`` op, and its gradient.

One row per registered op. A row lists the backends that implement the op (each a module of the
op's slice, imported at first use so that bik imports without triton and TRITON_INTERPRET is
read when a Triton kernel first runs) and the op's gradient status: a batch-invariant backward
(declared with the op, ops/_define.py) or an explicit refusal (:func:`register_refusal`, so
``.backward()`` raises NotImplementedError naming the op instead of leaving ``.grad`` at None).

Nothing falls back silently: a backend the row does not list raises
:class:`BackendUnavailableError` naming the op and the backends it has; a listed backend that
cannot run on this device or build raises it too, saying why.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bik._arch import dry_run_arch, interpreter_active

__all__ = [
    "backend_variant",
    "BACKENDS",
    "DEFAULT_BACKEND",
    "TABLE",
    "BackendUnavailableError",
    "OpRow",
    "backend_doc",
    "default_backend",
    "documented",
    "implementation",
    "launcher",
    "register_refusal",
    "require_backend",
    "resolve_backend",
]

BACKENDS = ("triton", "cpu", "cuda")
# backend=None picks by the tensors' device. "cuda" (the CUDA C++ kernels) is opt-in until it
# has run on a GPU; the batch-invariant mode routes with the same choice.
DEFAULT_BACKEND = {"cuda": "triton", "cpu": "cpu"}


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here (not implemented for the op, wrong
    device, missing build, ...)."""


@dataclass(frozen=True)
class OpRow:
    """One op: its backends (name -> module of the slice that implements it), the function of
    those modules that runs it, and its gradient status."""

    backends: dict[str, str]  # {} for an op without a backend argument (data movement)
    entry: str  # every listed module defines it, with one signature per op (see its op.py)
    backward: bool  # True: a registered backward; False: backward raises NotImplementedError
    refusal: str = ""  # the hint a refused backward gives


def _slice(op: str, *names: str) -> dict[str, str]:
    return {name: f"bik.ops.{op}.{name}" for name in names}


_INFERENCE_ONLY = ("an inference-only op; run it under torch.no_grad(). For training, "
                   "bik.attention_varlen has a batch-invariant backward")

_ALL = ("triton", "cpu", "cuda")
_NOT_DIFFERENTIABLE = "sampling is not differentiable"

TABLE: dict[str, OpRow] = {
    "matmul": OpRow(_slice("matmul", *_ALL), "launch_matmul", backward=True),
    "bmm": OpRow(_slice("matmul", *_ALL), "launch_bmm", backward=True),
    "rms_norm": OpRow(_slice("rms_norm", *_ALL), "launch_rms_norm", backward=True),
    "fused_add_rms_norm": OpRow(_slice("rms_norm", *_ALL), "launch_rms_norm", backward=True),
    "softmax": OpRow(_slice("reductions", "triton", "cpu"), "launch_softmax", backward=True),
    "log_softmax": OpRow(_slice("reductions", "triton", "cpu"), "launch_softmax", backward=True),
    "mean": OpRow(_slice("reductions", "triton", "cpu"), "launch_mean", backward=True),
    # CUDA C++: not written yet (the table refuses backend='cuda' with the backends it has).
    "grouped_matmul": OpRow({"triton": "bik.ops.matmul.triton_grouped",
                             "cpu": "bik.ops.matmul.cpu"}, "launch_grouped_matmul",
                            backward=True),
    # Built from bik::matmul (one module for every backend it runs on).
    "grouped_matmul_weight_grad": OpRow({b: "bik.ops.matmul.grouped" for b in ("triton", "cpu")},
                                        "group_weight_grad", backward=False,
                                        refusal="double backward through a grouped product is "
                                                "not implemented"),
    "attention": OpRow(_slice("attention", *_ALL), "run_attention", backward=False,
                       refusal=_INFERENCE_ONLY),
    "attention_varlen": OpRow(_slice("attention", *_ALL), "run_attention", backward=True),
    # Built from bik::bmm, so it runs wherever bmm does (one module for every backend).
    "attention_varlen_backward": OpRow({b: "bik.ops.attention.backward" for b in _ALL},
                                       "sequence_grads", backward=False,
                                       refusal="double backward through attention is not "
                                               "implemented"),
    # Pure data movement (index_copy_ into the caches): no backend argument, no gradient.
    "write_kv_cache": OpRow({}, "", backward=False,
                            refusal="it writes a KV cache in place; gradients do not flow "
                                    "through the cache"),
    "sample": OpRow(_slice("sampling", *_ALL), "sample_rows", backward=False,
                    refusal=_NOT_DIFFERENTIABLE),
    "verify_draft": OpRow(_slice("sampling", *_ALL), "sample_rows", backward=False,
                          refusal=_NOT_DIFFERENTIABLE),
}


# ---- registration ------------------------------------------------------------------------------

def register_refusal(op: str, hint: str) -> None:
    def setup_context(ctx, inputs, output):
        del ctx, inputs, output

    def backward(ctx, *grads):
        raise NotImplementedError(f"bik.{op}: backward is not implemented ({hint})")

    torch.library.register_autograd(f"bik::{op}", backward, setup_context=setup_context)


# ---- choosing and checking a backend -----------------------------------------------------------

@functools.cache
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - report whatever the import says
        return f"{type(exc).__name__}: {exc}"
    return None


def _cpu_can_run(label: str, device: torch.device) -> None:
    if device.type != "cpu":
        raise BackendUnavailableError(
            f"{label}: backend='cpu' got tensors on {device}; move them to the CPU or use "
            f"backend='triton'")
    from bik.runtime import cpu_ext

    if not cpu_ext.available():
        raise BackendUnavailableError(f"{label}: backend='cpu' is unavailable: "
                                      f"{cpu_ext.unavailable_reason()}")


def _triton_can_run(label: str, device: torch.device) -> None:
    err = _triton_import_error()
    if err is not None:
        raise BackendUnavailableError(f"{label}: backend='triton' needs triton ({err})")
    # CUDA tensors first: no environment read on the GPU route's every call.
    if device.type == "cpu" and dry_run_arch() is None and not interpreter_active():
        raise BackendUnavailableError(
            f"{label}: backend='triton' got CPU tensors; Triton runs CPU tensors only in its "
            f"interpreter (set TRITON_INTERPRET=1 before the process starts)")
    if device.type not in ("cpu", "cuda"):
        raise BackendUnavailableError(f"{label}: backend='triton' cannot run on {device}")


def _cuda_can_run(label: str, device: torch.device) -> None:
    if device.type != "cuda":
        raise BackendUnavailableError(
            f"{label}: backend='cuda' (the CUDA C++ kernels) got tensors on {device}; it runs "
            f"on CUDA tensors only (use backend='cpu' on the CPU)")
    from bik.runtime import cuda_jit

    if not cuda_jit.available():
        raise BackendUnavailableError(
            f"{label}: backend='cuda' is unavailable on {device}: "
            f"{cuda_jit.unavailable_reason()}")


_CAN_RUN: dict[str, Callable[[str, torch.device], None]] = {
    "triton": _triton_can_run, "cpu": _cpu_can_run, "cuda": _cuda_can_run}


def default_backend(device: torch.device) -> str | None:
    """The backend ``backend=None`` means on ``device`` (None: bik has none there)."""
    return DEFAULT_BACKEND.get(device.type)


def require_backend(op: str, backend: str, device: torch.device, *,
                    label: str | None = None) -> None:
    """Raise unless ``op``'s row lists ``backend`` and it can run on tensors of ``device``.

    ``label`` names the public function in the message (default ``bik.<op>``)."""
    label = label or f"bik.{op}"
    if backend not in BACKENDS:
        raise ValueError(f"{label}: unknown backend {backend!r}; expected one of {BACKENDS} "
                         f"or None")
    have = TABLE[op].backends
    if backend not in have:
        raise BackendUnavailableError(
            f"{label}: backend={backend!r} does not implement this op; its backends are "
            f"{', '.join(map(repr, have))} (or None for the device's default)")
    _CAN_RUN[backend](label, device)


def resolve_backend(op: str, backend: str | None, device: torch.device, *,
                    label: str | None = None) -> str:
    """Turn ``backend=None`` into the device's default, and check that it can run ``op``."""
    if backend is None:
        backend = default_backend(device)
        if backend is None:
            raise BackendUnavailableError(
                f"{label or f'bik.{op}'}: no bik backend for device {device}; bik runs on "
                f"'cuda' and 'cpu' tensors")
    require_backend(op, backend, device, label=label)
    return backend


@functools.cache
def _module(path: str):
    return importlib.import_module(path)


def implementation(op: str, backend: str, device: torch.device, *,
                   label: str | None = None) -> Callable:
    """The function that runs ``op`` on ``backend`` (the row's entry in the backend's module),
    after :func:`require_backend`."""
    require_backend(op, backend, device, label=label)
    row = TABLE[op]
    return getattr(_module(row.backends[backend]), row.entry)


_CAN_RUN_CHECKED: set[tuple[str, str, str, str | None]] = set()


def launcher(op: str, backend: str, device: torch.device) -> Callable:
    """:func:`implementation` with its checks (backend listed, extension built, device type)
    done once per (op, backend, device type): they cannot change within a process, and the
    front ends' direct path asks on every call. The entry point itself is looked up each time,
    so a patched backend module is seen."""
    key = (op, backend, device.type, dry_run_arch())  # a dry run lets CPU tensors on Triton
    if key not in _CAN_RUN_CHECKED:
        require_backend(op, backend, device)
        _CAN_RUN_CHECKED.add(key)
    row = TABLE[op]
    return getattr(_module(row.backends[backend]), row.entry)


@functools.cache
def backend_variant(backend: str) -> str | None:
    """The code path ``backend`` takes inside this process, resolved once: the CPU backend's SIMD
    path ("avx512", "avx2" or "generic", what its kernels' ``isa="auto"`` picks), None where a
    backend has one path per device arch (Triton, CUDA C++: the arch is in the fingerprint) or
    cannot run here. The CPU contract makes every path's bits equal (tests/*/test_*_cpu_kernel.py
    compare them), so a variant changes speed only; bik.fingerprint() reports it."""
    if backend != "cpu":
        return None
    from bik.runtime import cpu_ext

    return cpu_ext.isa("auto") if cpu_ext.available() else None


# ---- documentation from the table ---------------------------------------------------------------

_BACKEND_WORDS = {"triton": '"triton"', "cpu": '"cpu"', "cuda": '"cuda" (CUDA C++)'}


def backend_doc(op: str) -> str:
    """The ``backend:`` text of a public function's docstring, from ``op``'s row."""
    names = ", ".join(_BACKEND_WORDS[b] for b in TABLE[op].backends)
    default = ", ".join(f'"{b}" for {dev.upper()} tensors' for dev, b in DEFAULT_BACKEND.items())
    return f"{names} or None (by device: {default})."


def documented(op: str):
    """Fill the ``{backends}`` placeholder of a public function's docstring from the table."""
    def fill(fn):
        if fn.__doc__:  # None under python -OO
            fn.__doc__ = fn.__doc__.replace("{backends}", backend_doc(op))
        return fn

    return fill

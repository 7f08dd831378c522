"""bik's C++ dispatcher kernels for mm / addmm / bmm on the CPU (csrc/native/native_cpu.cpp,
``torch.ops.bik_native``), made ready once per process: loaded (built at first use by
bik.runtime.native_ext), handed bik._cpu_kernels' matmul entry point, and given the fake kernels
torch.compile traces them with. ``bik.enable()`` installs them over aten's CPU kernels; a graph
compiled with grad off calls :func:`matmul` / :func:`bmm`'s op where it would call bik::matmul /
bmm on the CPU backend.

``BIK_ENABLE_NATIVE=0`` keeps every front end on its Python kernels: ``bik.enable()`` reads it
when called; a graph compiled with grad off reads it when traced (a graph compiled earlier keeps
what it was traced with).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings

import torch

from bik import configs
from bik.runtime import native_ext, cpu_ext


@torch.compiler.assume_constant_result  # asked while Dynamo traces a handler: a constant
def ready() -> bool:
    """True when the C++ kernels can serve (loaded, unless ``BIK_ENABLE_NATIVE=0``). The first
    call may build them (about 15 s, once per environment); a failed build warns once."""
    return os.environ.get("BIK_ENABLE_NATIVE", "1") != "0" and _load()


_lock = threading.Lock()  # enable() and a compile trace in another thread may both ask first
_loaded_rule = None  # the matmul split rule _load() handed the kernels, once they loaded


@functools.cache
def _load() -> bool:
    with _lock:
        if not cpu_ext.available():
            return False
        try:
            if not native_ext.load():
                raise RuntimeError(native_ext.unavailable_reason())
            entries = cpu_ext.require().c_entry_points()  # absent from an older build
            rule = configs.matmul_split_rule()
            torch.ops.bik_native.set_cpu_kernels(entries["matmul_f32"], entries["abi_version"],
                                               list(rule), cpu_ext.bf16_dot())
            _register_fakes()
            global _loaded_rule
            _loaded_rule = rule
        except Exception as exc:  # noqa: BLE001 - any failure keeps the Python kernels
            warnings.warn(f"bik: its C++ dispatcher kernels for mm / addmm / bmm are "
                          f"unavailable ({exc}); Python kernels serve them (about 15 µs a "
                          f"call more)", RuntimeWarning, stacklevel=5)
            return False
        return True


def _register_fakes() -> None:
    """bik_native::matmul / bmm trace like bik::matmul / bmm (the same checks and shapes)."""

    @torch.library.register_fake("bik_native::matmul")
    def _matmul(a, b, bias, out_dtype):
        return torch.ops.bik.matmul(a, b, bias, out_dtype, "cpu")

    @torch.library.register_fake("bik_native::bmm")
    def _bmm(a, b, out_dtype):
        return torch.ops.bik.bmm(a, b, out_dtype, "cpu")


def _loaded() -> bool:
    """ready(), but False where nothing in this process has loaded the kernels yet (an eager
    call must not start a build, about 15 s), and where the kernels would not give the Python
    launcher's bits or errors: they keep the split rule they loaded with (``BIK_MATMUL_SPLIT``
    may change it since) and the extension's entry point (which a caller may have unloaded;
    then the launcher raises the build hint)."""
    return (_loaded_rule is not None and os.environ.get("BIK_ENABLE_NATIVE", "1") != "0"
            and cpu_ext.available() and _loaded_rule == configs.matmul_split_rule())


def matmul(*, loaded_only: bool = False):
    """``bik_native::matmul`` (bik::matmul's arguments without the backend) when ready;
    ``loaded_only`` (the direct route): its kernel as the loaded module's function (no
    dispatcher: ~5 us less a call), when already loaded."""
    if loaded_only:
        return native_ext.module().matmul if _loaded() else None
    return torch.ops.bik_native.matmul if ready() else None


def bmm(*, loaded_only: bool = False):
    """``bik_native::bmm`` when ready (``loaded_only``: the module's function, when loaded)."""
    if loaded_only:
        return native_ext.module().bmm if _loaded() else None
    return torch.ops.bik_native.bmm if ready() else None

"""bik's C++ dispatcher kernels on the CPU (csrc/native, ``torch.ops.bik_native``), made ready
once per process: loaded (built at first use by bik.runtime.native_ext), handed
bik._cpu_kernels' entry points, and given the fake kernels torch.compile traces them with.
``bik.enable()`` installs its mm / addmm / bmm over aten's CPU kernels; the ops that declare
``native=kernel_for(name)`` (matmul, bmm, rms_norm, fused_add_rms_norm, attention) run them on
the direct route once loaded and in graphs compiled with grad off (ops/_call.py).

``BIK_ENABLE_NATIVE=0`` keeps every front end on its Python kernels: ``bik.enable()`` reads it
when called; a graph compiled with grad off reads it when traced (a graph compiled earlier keeps
what it was traced with).
"""

from __future__ import annotations

import functools
import re
import threading
import warnings

import torch

from bik import configs
from bik._env import flag
from bik.ops._checks import debug_checks
from bik.ops._define import DECLARED
from bik.runtime import native_ext, cpu_ext


@torch.compiler.assume_constant_result  # asked while Dynamo traces a handler: a constant
def ready() -> bool:
    """True when the C++ kernels can serve (loaded, unless ``BIK_ENABLE_NATIVE=0``). The first
    call may build them (about 15 s, once per environment); a failed build warns once."""
    return flag("BIK_ENABLE_NATIVE", True) and _load()


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
            # An older build lacks the later entries: its ABI version is refused first.
            addresses = [entries.get(n, 0) for n in ("matmul_f32", "rms_norm", "attention_paged",
                                                     "write_kv_rows", "reduce_rows")]
            torch.ops.bik_native.set_cpu_kernels(
                addresses, entries["abi_version"], list(rule), configs.CPU_ATTENTION_SPLIT,
                cpu_ext.bf16_dot(), cpu_ext.bf16_kernel() == "amx", cpu_ext.fp32_fma(),
                debug_checks())
            _register_fakes()
            _define_bound()
            global _loaded_rule
            _loaded_rule = rule
        except Exception as exc:  # noqa: BLE001 - any failure keeps the Python kernels
            warnings.warn(f"bik: its C++ dispatcher kernels (mm / addmm / bmm, RMSNorm, "
                          f"attention) are unavailable ({exc}); Python kernels serve them "
                          f"(about 15 to 90 µs a call more)", RuntimeWarning, stacklevel=5)
            return False
        return True


def _register_fakes() -> None:
    """Each bik_native op traces like its bik op on the CPU backend (the same checks and
    shapes)."""

    @torch.library.register_fake("bik_native::matmul")
    def _matmul(a, b, bias, out_dtype):
        return torch.ops.bik.matmul(a, b, bias, out_dtype, "cpu")

    @torch.library.register_fake("bik_native::bmm")
    def _bmm(a, b, out_dtype):
        return torch.ops.bik.bmm(a, b, out_dtype, "cpu")



_BOUND: dict[str, str] = {}  # op -> the csrc/native/layers.h kernel serving it (kernel_for)
_libraries: list = []  # the bik_native op definitions made here, kept for the process


def _schema_without_backend(op: str) -> str:
    """bik::<op>'s schema with its ``str backend`` argument left out."""
    schema = str(getattr(torch.ops.bik, op).default._schema).split("::", 1)[1]
    return re.sub(r"str backend, |, str backend(?=\))", "", schema)


def _define_bound() -> None:
    """bik_native::<op> for each op bound to a boxed kernel (layers.h reads a call's arguments
    in this schema's order), its fake the bik op's on the CPU backend."""
    library = torch.library.Library("bik_native", "FRAGMENT")
    _libraries.append(library)
    for op, kernel in _BOUND.items():
        library.define(_schema_without_backend(op))
        torch.ops.bik_native.bind(op, kernel)
        torch.library.register_fake(f"bik_native::{op}", functools.partial(_fake_as_bik, op))


def _fake_as_bik(op: str, *args, **kwargs):
    args += tuple(kwargs.values())
    at = DECLARED[op].backend_at
    return getattr(torch.ops.bik, op)(*args[:at], "cpu", *args[at:])


def _loaded(split_rule: bool = True) -> bool:
    """ready(), but False where nothing in this process has loaded the kernels yet (an eager
    call must not start a build, about 15 s), and where the kernels would not give the Python
    launcher's bits or errors: the extension's entry points (which a caller may have unloaded;
    then the launcher raises the build hint) and, for the products (``split_rule``), the split
    rule they loaded with (``BIK_MATMUL_SPLIT`` may change it since)."""
    return (_loaded_rule is not None and flag("BIK_ENABLE_NATIVE", True)
            and cpu_ext.available()
            and (not split_rule or _loaded_rule == configs.matmul_split_rule()))


def kernel_for(name: str, *, kernel: str | None = None, split_rule: bool = False):
    """The ``native=`` of the op ``bik::<name>``: a function returning ``bik_native::<name>``
    (bik::<name>'s arguments without the backend) when ready, or with ``loaded_only`` (the
    direct route) its kernel as the loaded module's function (no dispatcher: ~5 us less a
    call) when already loaded; None otherwise. ``kernel``: the boxed kernel of
    csrc/native/layers.h that serves it ("norm", "attention", "kv_write"): the op is then
    defined from bik::<name>'s schema when the kernels load, and the direct route calls it
    through the dispatcher (~1 µs more than a module function). ``split_rule``: the kernel picks matmul
    splits (see :func:`_loaded`)."""
    if kernel is not None:
        _BOUND[name] = kernel

    def native(*, loaded_only: bool = False):
        if loaded_only:
            if not _loaded(split_rule):
                return None
            return (getattr(torch.ops.bik_native, name).default if kernel is not None
                    else getattr(native_ext.module(), name))
        return getattr(torch.ops.bik_native, name) if ready() else None

    native.__name__ = name
    native.checks_itself = kernel is not None  # a boxed kernel: see ops/_call.py
    return native

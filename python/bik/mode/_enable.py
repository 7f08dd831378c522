"""bik.enable(): bik's handlers over aten's CPU and CUDA kernels at the dispatcher, for every
thread of the process (docs/integration.md#bikenable).

Each op in ``OVERRIDES`` gets a kernel at its backend key (``torch.library.Library("aten",
"IMPL")``) that runs the op's handler from _routes.py / _grad_routes.py and, when the handler
declines (a dtype or case bik does not serve, input torch rejects), the original kernel, taken
with ``torch.library.get_kernel`` before overriding: the right answer, counted in
``mode_stats()``. The overrides sit below autograd (the stock backward formulas' aten ops are
overridden too) and below Dynamo/AOTAutograd (compiled graphs call aten at run time); Inductor
is told to leave these ops as aten calls while bik is enabled (_inductor.py). While a handler
runs, the aten calls it makes itself go straight to the original kernels.

At the CPU key, mm / addmm / bmm get C++ kernels instead (csrc/native/native_cpu.cpp, made
ready by ops/_native.py): a Python kernel costs ~15 µs a call around a ~1 µs one-row
product. They serve the plain calls with the same kernel the handler would run and hand every
other call to the Python kernel, registered for that on ``bik_native_py::<op>`` (aten's schema).
``BIK_ENABLE_NATIVE=0``, or a build that fails, keeps the Python kernels there.
"""

from __future__ import annotations

import atexit
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from bik.ops import _native as native
from bik.mode._handlers import HANDLERS
from bik.mode._inductor import keep_as_aten_calls
from bik.mode._numerics import acquire_flags, release_flags
from bik.mode._stats import count_native, route

__all__ = ["OVERRIDES", "disable", "enable", "enabled", "is_enabled"]

aten = torch.ops.aten

# Ops with a kernel of their own at the backend key (composites such as linear, matmul and
# softmax.int decompose into these before the backend key is reached).
OVERRIDES = (
    aten.mm.default, aten.mm.out, aten.addmm.default, aten.addmm.out,
    aten.bmm.default, aten.bmm.out, aten.mv.default, aten.dot.default,
    aten._softmax.default, aten._log_softmax.default,
    aten._softmax_backward_data.default, aten._log_softmax_backward_data.default,
    aten.mean.dim, aten.sum.dim_IntList,
    aten.silu.default, aten.silu_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._grouped_mm.default, aten.topk.default, aten.sort.default, aten.sort.stable,
    aten.sigmoid.default,
)
# CUDA's elementwise kernels run one instruction sequence per element: silu is position-
# independent there already.
_CPU_ONLY = {aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
             aten.silu.default, aten.silu_backward.default, aten.sigmoid.default}

# The ops with a C++ kernel at the CPU key (csrc/native/native_cpu.cpp), in its counters' order.
NATIVE_CPU = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.silu.default,
              aten.mean.dim, aten._softmax.default)

_switch_lock = threading.Lock()
_state: dict = {}  # while enabled: {"library": Library, "native": bool, "undo_inductor": fn}
_twins: list = []  # bik_native_py::<op>, defined with their Python kernels once, kept
_busy = threading.local()  # set while a handler runs in this thread


def _schema_name(op) -> str:
    name = op._schema.name.split("::", 1)[1]
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def _override(op, handler, original):
    def kernel(keyset, *args, **kwargs):
        def stock():
            return original.call_boxed(keyset, *args, **kwargs)

        if getattr(_busy, "on", False):  # an aten call bik's own code made
            return stock()
        _busy.on = True
        try:
            return route(op, handler, args, kwargs, stock)
        finally:
            _busy.on = False

    return kernel


def _dispatch_keys() -> tuple[str, ...]:
    return ("CPU", "CUDA") if torch.cuda.is_available() else ("CPU",)


def _native_wanted() -> bool:
    """Use the C++ kernels (built on first use) unless BIK_ENABLE_NATIVE=0 or they cannot
    be built (then the Python kernels serve those ops too)."""
    if not native.ready():
        return False
    if not _twins:
        _twins.extend(_define_twins())
        count_native([str(op) for op in NATIVE_CPU], torch.ops.bik_native.served,
                     torch.ops.bik_native.reset_served)
        atexit.register(disable)  # before torch's finalizers remove the twins at exit
    return True


def _define_twins() -> list[torch.library.Library]:
    """bik_native_py::<op> with aten's schema and, at the CPU key, the Python kernel the C++ one
    hands its other calls to. Made once and kept: a C++ kernel already past its check when
    disable() runs may still hand its call over, and the C++ side caches the handles."""
    defs = torch.library.Library("bik_native_py", "DEF")
    kernels = torch.library.Library("bik_native_py", "IMPL")
    for op in NATIVE_CPU:
        defs.define(str(op._schema).split("::", 1)[1])
        original = torch.library.get_kernel(op, "CPU")  # nothing bik's is registered yet
        kernels.impl(_schema_name(op), _override(op, HANDLERS[op], original), "CPU",
                     with_keyset=True)
    return [defs, kernels]


def _register(native: bool) -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "overriding a previously registered kernel": meant
            warnings.simplefilter("ignore", UserWarning)
            for key in _dispatch_keys():
                for op in OVERRIDES:
                    if key != "CPU" and op in _CPU_ONLY:
                        continue
                    if native and key == "CPU" and op in NATIVE_CPU:
                        continue  # the C++ kernel, installed below
                    original = torch.library.get_kernel(op, key)
                    library.impl(_schema_name(op), _override(op, HANDLERS[op], original), key,
                                 with_keyset=True)
        if native:
            torch.ops.bik_native.install()
    except BaseException:
        library._destroy()
        raise
    return library


def is_enabled() -> bool:
    """True while :func:`enable` is on (process-wide)."""
    return bool(_state)


def enable() -> None:
    """Route the aten ops bik serves through bik, in every thread, until :func:`disable`.

    Covers mm / addmm / bmm (functional and ``.out``), mv, dot, softmax / log_softmax and
    their backward, mean, sum (so linear, matmul, RMSNorm written with mean, and backward
    formulas reach bik) and the CPU SDPA flash kernel, at the CPU key (and CUDA when a GPU is
    present), under eager, no_grad, inference_mode and compiled code. Idempotent: enabling
    twice is enabling once. The first call imports Inductor (about 2 s) to keep these ops as
    aten calls in graphs compiled while bik is enabled; compile after enabling (a function
    compiled before keeps the kernels it was compiled with). TF32 is off while enabled.
    """
    with _switch_lock:
        if _state:
            return
        acquire_flags()
        try:
            undo_inductor = keep_as_aten_calls()
            try:
                native = _native_wanted()
                library = _register(native)
            except BaseException:
                undo_inductor()
                raise
        except BaseException:
            release_flags()
            raise
        _state.update(library=library, native=native, undo_inductor=undo_inductor)


def disable() -> None:
    """Undo :func:`enable` exactly (the original kernels, Inductor's tables, the numerics
    flags). Idempotent: a no-op when bik is not enabled."""
    with _switch_lock:
        if not _state:
            return
        library, undo_inductor = _state.pop("library"), _state.pop("undo_inductor")
        try:
            if _state.pop("native"):
                torch.ops.bik_native.uninstall()
            library._destroy()
        finally:
            try:
                undo_inductor()
            finally:
                release_flags()


@contextmanager
def enabled() -> Iterator[None]:
    """``with bik.enabled():`` -- :func:`enable` for the block, then the previous state (a
    block inside an earlier ``enable()`` leaves bik enabled)."""
    was_on = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was_on:
            disable()

"""Launch a Triton kernel without Triton's per-call Python: :func:`launch`.

``kernel[grid](*args, **kwargs)`` runs Triton's ``JITFunction.run`` on every call: it reads its
knobs from the environment, binds the arguments by name, builds the compile-cache key from every
argument's specialisation and the options, checks the kernel's globals, and builds a launch-
metadata record, before its C launcher runs (~12 µs of Python per launch on a 2-core AMD EPYC
with AVX-512, measured with the launch itself left out: ``bik.runtime.triton_dry_run``). The first
launch of a kernel for a given specialisation goes through that path (it compiles and loads the
kernel). Every later one with the same specialisation calls the compiled kernel's launcher
directly, with the same arguments Triton's path would pass it (tested argument for argument in
the dry run): the specialisation is Triton's own (``native_specialize_impl`` on each positional
argument, with the parameter's flags), so a tensor that loses 16-byte alignment, an int that
becomes 1 or a multiple of 16, a new dtype or other constexprs take Triton's path again and get
the kernel Triton would pick.

What the direct path leaves out, and why that is safe for bik's kernels: the knobs that are
part of Triton's options (``TRITON_DEBUG``, instrumentation) are read when a specialisation is
first seen, not per call (set them before the process launches kernels); Triton's pre-run hooks
(none is registered by bik, and Triton's own autotuner is not used: configs are fixed tables);
and the check that a kernel's globals kept their values (bik's kernels read module constants
only). Launch hooks (``triton.knobs.runtime.launch_enter_hook``, which profilers and bik's
launch counting use) are passed on whenever one is registered.

Under ``TRITON_INTERPRET=1`` a kernel is the interpreter's function, which has no compiled
launcher: :func:`launch` calls it as ``kernel[grid](...)``.
"""

from __future__ import annotations

import threading
from itertools import repeat

from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.runtime.driver import driver

__all__ = ["clear", "launch"]


class _Bound:
    """One JITFunction's direct launches: per (device, specialisation, constexprs + options)
    the compiled kernel's launcher, its handle and packed metadata, and the values Triton
    appends after the positional arguments (the keyword ones, in parameter order)."""

    __slots__ = ("fn", "is_const", "specialize", "align", "positional", "runtime_names", "hits")

    def __init__(self, fn):
        self.fn = fn
        # Per parameter, the flags Triton's generated binder passes to native_specialize_impl.
        self.is_const = tuple(p.is_const for p in fn.params)
        self.specialize = tuple(not p.do_not_specialize for p in fn.params)
        self.align = tuple(not p.do_not_specialize_on_alignment for p in fn.params)
        # The direct path keys positional arguments by their specialisation and keyword ones
        # by value: a constexpr given positionally (Triton keys it by value) or a runtime
        # parameter given by name (0.0 == -0.0, 1 == 1.0) would be keyed wrongly, so such
        # calls always take Triton's path.
        self.positional = next((i for i, p in enumerate(fn.params) if p.is_constexpr),
                               len(fn.params))
        self.runtime_names = frozenset(p.name for p in fn.params if not p.is_constexpr)
        self.hits: dict = {}


_BOUND: dict[int, _Bound] = {}
_LOCK = threading.Lock()  # first launches of a kernel from several threads


def clear() -> None:
    """Forget every bound launch (the driver changed: ``triton_dry_run`` enters and leaves)."""
    with _LOCK:
        _BOUND.clear()


def _bound(kernel) -> _Bound:
    bound = _BOUND.get(id(kernel))
    if bound is None or bound.fn is not kernel:
        with _LOCK:
            bound = _BOUND[id(kernel)] = _Bound(kernel)
    return bound


def _first_launch(bound: _Bound, key, device: int, grid, args, kwargs) -> None:
    """Triton's own path (compile, load, launch); then remember what a direct launch needs."""
    kernel = bound.fn.run(*args, grid=grid, warmup=False, **kwargs)
    if kernel is None or not bound.runtime_names.isdisjoint(kwargs):
        return  # a jit cache hook vetoed the compile, or a runtime argument came by name
    if hasattr(kernel, "result"):  # async compile mode
        kernel = kernel.result()
    binder = bound.fn.device_caches[device][4]
    params = tuple(binder(*args, **kwargs)[0].values())
    with _LOCK:
        bound.hits[key] = (kernel, kernel.run, kernel.function, kernel.packed_metadata,
                           params[len(args):])


def _listening(hook) -> bool:
    """Whether a launch hook would call anything (Triton 3.6: a HookChain with its ``calls``)."""
    return bool(getattr(hook, "calls", hook))


def launch(kernel, grid: tuple, /, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, bit for bit the same launch, without Triton's per-call
    Python after the first launch of each specialisation (see the module docstring).

    ``args``: the kernel's runtime parameters, positionally; ``kwargs``: its constexprs, by
    name, and launch options (``num_warps``, ``num_stages``, ...). Other calls (a constexpr
    given positionally, a runtime parameter by name) are run, correctly, by Triton's path every
    time. ``grid``: a tuple of 1-3 ints (not a callable)."""
    if not hasattr(kernel, "device_caches"):  # the interpreter's function
        kernel[grid](*args, **kwargs)
        return
    bound = _bound(kernel)
    if len(args) > bound.positional:  # a constexpr given positionally: Triton's path
        kernel[grid](*args, **kwargs)
        return
    device = driver.active.get_current_device()
    backend = kernel.device_caches[device][3]
    spec = tuple(map(native_specialize_impl, repeat(backend), args, bound.is_const,
                     bound.specialize, bound.align))
    key = (device, spec, tuple(kwargs.items()))
    hit = bound.hits.get(key)
    if hit is None:
        _first_launch(bound, key, device, grid, args, kwargs)
        return
    compiled, run, function, packed, tail = hit
    stream = driver.active.get_current_stream(device)
    n = len(grid)
    g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if _listening(enter) or _listening(leave):  # a profiler or a launch counter is listening
        meta = compiled.launch_metadata(grid, stream, *args, *tail)
        run(g0, g1, g2, stream, function, packed, meta, enter, leave, *args, *tail)
    else:
        run(g0, g1, g2, stream, function, packed, None, None, None, *args, *tail)

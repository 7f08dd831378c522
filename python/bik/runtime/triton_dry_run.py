"""Triton's GPU path on a machine without a GPU, with only the launch itself left out.

Inside :func:`dry_run`, Triton's active driver is one that compiles for a real GPU target
(``sm_90`` by default: the PTX and cubin ptxas produces) and runs everything Triton and bik do
on the host for a launch — argument binding, specialisation, cache lookups, bik's direct
launches (``triton_launch``), launch hooks — but hands the final call to a recorder instead of
the CUDA driver. bik treats CPU tensors as tensors of that GPU meanwhile (``device_arch``
returns the target's arch, and ``backend="triton"`` accepts them), so a bik call runs its whole
GPU route on the host. The kernels never run: outputs hold whatever memory held.

What it is for: counting a call's launches and aten ops on the route a GPU would take (the
direct launch path included), timing that route's host cost with the launch excluded (``bik
bench boundary``), and checking that a direct launch hands the launcher exactly what Triton's
own path hands it. Not thread-safe and not for a process that uses a GPU (it refuses one):
it swaps a process-wide driver.

Without ``TRITON_INTERPRET=1`` only: the interpreter replaces every kernel with its own
function at import, and those never reach a driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from bik import _arch

__all__ = ["DryLaunch", "DryRun", "dry_run"]

# What the recorder reports as the device: an H200's (the target the tables are tuned for).
_PROPERTIES = {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536,
               "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 3201000,
               "mem_bus_width": 6144}


@dataclass
class DryLaunch:
    """One launch the recorder took: the kernel's name, its grid, and (with ``keep_args``)
    what the launcher was handed besides the grid and the launch hooks: the stream, the
    kernel's handle, its packed metadata and the kernel's arguments."""

    name: str
    grid: tuple[int, int, int]
    args: tuple | None = None


@dataclass
class DryRun:
    """The launches of a :func:`dry_run` block, in order."""

    launches: list[DryLaunch] = field(default_factory=list)
    keep_args: bool = False
    count: int = 0

    def names(self) -> list[str]:
        return [launch.name for launch in self.launches]


class _Recorder:
    """Stands in for Triton's CUDA launcher (``CudaLauncher``): same call, no launch. Like the
    C launcher it calls the launch hooks it is handed around the (absent) launch."""

    def __init__(self, src, metadata, run: DryRun):
        self.name = metadata.name
        self.run = run

    def __call__(self, gx, gy, gz, stream, function, packed, meta, enter, leave, *args):
        if enter is not None:
            enter(meta)
        self.run.count += 1
        kept = (stream, function, packed, *args) if self.run.keep_args else None
        self.run.launches.append(DryLaunch(self.name, (gx, gy, gz), kept))
        if leave is not None:
            leave(meta)


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        del name, shared, device
        # module, function (one handle per binary, as the driver's), registers, spills, threads
        return id(kernel), id(kernel), 0, 0, 1024

    def get_device_properties(self, device):
        del device
        return dict(_PROPERTIES)


def _driver(target, run: DryRun):
    from triton.backends.driver import DriverBase

    class DryRunDriver(DriverBase):
        def __init__(self):
            self.utils = _Utils()
            self.launcher_cls = lambda src, metadata: _Recorder(src, metadata, run)

        @staticmethod
        def is_active():
            return True

        def get_current_target(self):
            return target

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            del device

        def get_current_stream(self, device=None):
            del device
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

        def map_python_to_cpp_type(self, ty):
            return ty

        def get_benchmarker(self):
            raise RuntimeError("bik dry run: nothing runs, so nothing can be benchmarked")

        def get_empty_cache_for_benchmark(self):
            raise RuntimeError("bik dry run: no device memory")

        def clear_cache(self, cache):
            del cache

    return DryRunDriver()


def _jit_functions() -> list:
    """Every JITFunction alive (bik's, a test's, anyone's): their per-device caches may hold
    the dry run's binder, target and kernels."""
    import gc

    from triton.runtime.jit import JITFunction

    # type(), not isinstance(): the heap holds weak proxies, and isinstance() asks a dead
    # proxy for its class (ReferenceError).
    return [obj for obj in gc.get_objects() if issubclass(type(obj), JITFunction)]


@contextlib.contextmanager
def dry_run(arch: int = 90, *, keep_args: bool = False) -> Iterator[DryRun]:
    """Run Triton's GPU path for ``sm_<arch>`` on the host, launches recorded, not made.

    ``keep_args``: keep every launch's arguments (references to the tensors) in the record.
    """
    if _arch.interpreter_active():
        raise RuntimeError("bik dry run: TRITON_INTERPRET=1 is set; the interpreter's kernels "
                           "never reach a driver (run it in a process without it)")
    if torch.cuda.is_available():
        raise RuntimeError("bik dry run: this process has a GPU; measure the real launches")
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from bik.runtime import triton_launch

    run = DryRun(keep_args=keep_args)
    before = driver._active  # None on a machine without a GPU driver (the property would raise)
    outer_arch = _arch.dry_run_arch()

    def forget_kernels():
        # A kernel's per-device cache is built for the active driver's target and holds
        # kernels whose handles are its: drop them when the driver changes, so that neither a
        # later (or an outer) dry run nor anything else reuses them.
        triton_launch.clear()
        for fn in _jit_functions():
            fn.device_caches.clear()

    forget_kernels()
    driver.set_active(_driver(GPUTarget("cuda", arch, 32), run))
    _arch.set_dry_run_arch(f"sm{arch}")
    try:
        yield run
    finally:
        _arch.set_dry_run_arch(outer_arch)
        driver._active = before
        forget_kernels()

"""What one call costs on the host: its Triton launches and the aten ops it issues itself.

``count_calls()`` yields a :class:`Calls` that fills while the block runs: the name of every
Triton kernel launched (the interpreter's launcher, or Triton's launch hook on a GPU and in the
dry run), on a GPU every kernel the device ran (the profiler's device events), and a Counter of
the top-level aten ops (torch.profiler; an op nested in another aten op, or issued
by the interpreter while it runs a launch, is not the caller's and is not counted). Used by
tests/sampling/test_sampling_launches.py to hold the sampler to a handful of each.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field

import triton
from bik._arch import interpreter_active
from torch.profiler import ProfilerActivity, profile, record_function

_INSIDE_LAUNCH = "launch_count.triton_launch"


@dataclass
class Calls:
    launches: list[str] = field(default_factory=list)
    aten: collections.Counter = field(default_factory=collections.Counter)
    # On a GPU: every kernel the device ran in the block (the profiler's device events), so a
    # kernel no launch hook saw (an aten fill, a copy) is counted too. None elsewhere.
    device_kernels: list[str] | None = None

    @property
    def aten_ops(self) -> int:
        return sum(self.aten.values())


def _caller_ops(events) -> collections.Counter:
    ops = collections.Counter()
    for e in events:
        parent = e.cpu_parent
        if e.name.startswith("aten::") and not (
                parent is not None and (parent.name.startswith("aten::")
                                        or parent.name == _INSIDE_LAUNCH)):
            ops[e.name] += 1
    return ops


@contextlib.contextmanager
def _launch_spy(names: list[str]):
    if interpreter_active():
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run

        def counted(self, *args, **kwargs):
            names.append(self.fn.__name__)
            with record_function(_INSIDE_LAUNCH):
                return run(self, *args, **kwargs)

        InterpretedFunction.run = counted
        try:
            yield
        finally:
            InterpretedFunction.run = run
    else:
        def hook(metadata):  # a LazyDict: its name is there without .get()
            names.append(metadata.data["name"])

        triton.knobs.runtime.launch_enter_hook.add(hook)
        try:
            yield
        finally:
            triton.knobs.runtime.launch_enter_hook.remove(hook)


@contextlib.contextmanager
def count_calls():
    import torch

    calls = Calls()
    on_gpu = torch.cuda.is_available() and not interpreter_active()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with _launch_spy(calls.launches), profile(activities=activities) as prof:
        yield calls
        if on_gpu:
            torch.cuda.synchronize()
    events = prof.events()
    calls.aten.update(_caller_ops(events))
    if on_gpu:
        calls.device_kernels = [e.name for e in events
                                if e.device_type == torch.autograd.DeviceType.CUDA]

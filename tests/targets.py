"""Where a test body runs: one pytest param per backend target, with the marks that route it.

A test module of tests/<op>/ takes ``target`` from ``@pytest.mark.parametrize("target",
targets(...))`` and sizes its work with ``target.small`` (the interpreter pays ~1 ms a
program). Marks: ``cpu`` (the plain process), ``interpreter`` (the TRITON_INTERPRET=1 process:
`make test` runs it separately, the variable being process-wide), ``gpu`` (skipped without CUDA).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from bik._arch import interpreter_active
from bik.runtime import cpu_ext

__all__ = ["CPU", "GPU_CUDA", "GPU_TRITON", "TRITON_INTERPRETER", "Target", "targets"]


class Target(NamedTuple):
    backend: str  # the bik backend
    device: str  # where the test's tensors live
    small: bool  # True: keep grids tiny (the Triton interpreter)

    def __str__(self) -> str:
        return f"{self.backend}@{self.device}"


_NO_EXT = pytest.mark.skipif(not cpu_ext.available(), reason="CPU extension not built")
_NEEDS_INTERPRETER = pytest.mark.skipif(not interpreter_active(),
                                        reason="needs TRITON_INTERPRET=1 (own process)")
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CPU = pytest.param(Target("cpu", "cpu", False), marks=[pytest.mark.cpu, _NO_EXT], id="cpu")
TRITON_INTERPRETER = pytest.param(Target("triton", "cpu", True),
                                  marks=[pytest.mark.interpreter, _NEEDS_INTERPRETER],
                                  id="interpreter")
GPU_TRITON = pytest.param(Target("triton", "cuda", False), marks=[pytest.mark.gpu, _NEEDS_CUDA],
                          id="gpu-triton")
GPU_CUDA = pytest.param(Target("cuda", "cuda", False), marks=[pytest.mark.gpu, _NEEDS_CUDA],
                        id="gpu-cuda")

_ALL = {"cpu": CPU, "interpreter": TRITON_INTERPRETER, "gpu-triton": GPU_TRITON,
        "gpu-cuda": GPU_CUDA}


def targets(*names: str) -> list:
    """The params for ``names`` (default: cpu and interpreter, the two this machine runs)."""
    return [_ALL[n] for n in (names or ("cpu", "interpreter"))]

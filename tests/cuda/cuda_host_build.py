"""The CUDA C++ host-test infrastructure: builds a tests/cuda/cuda_host/*.cpp shim with g++ and
loads it (ctypes); the kernels-on-the-host fixture (``host``: backend="cuda" on CPU tensors, every
launch checked against the kernel's declaration, ``KERNELS`` in bik/ops/<op>/cuda.py, and run
by the g++ build); the host checks of the CUDA sources (test_cuda_plan_host.py,
test_cuda_sm90_host.py, test_cuda_kernels_host.py).

Every shim is built the same way: ``-O2 -ffp-contract=off`` (no FMA contraction, so each float
op is rounded like the device's ``__fadd_rn`` / ``__fmul_rn``) with warnings as errors. A
machine without g++ skips the test that asked for the shim. Builds are cached on disk
(tools/build_cache.py), keyed by g++'s version, the command line and every file of
tests/cuda/cuda_host, csrc/cuda and csrc/cpu: a second run, or a second pytest-xdist worker,
loads the first one's build instead of compiling again (kernels_host.cpp takes ~7 s).
"""

from __future__ import annotations

import ctypes
import importlib
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import build_cache
import numpy as np
import pytest
import torch

__all__ = ["CPU_SRC", "HOST_DIR", "SRC", "arg_kind", "build_shim", "cached_build",
           "declared_kernels", "force", "host_kernels_flag"]

HOST_DIR = Path(__file__).resolve().parent / "cuda_host"
SRC = Path(__file__).resolve().parents[2] / "csrc" / "cuda"
CPU_SRC = SRC.parent / "cpu"


def cached_build(name: str, gxx: str, commands: Callable[[Path], list[list[str]]]) -> Path:
    """The shared library ``name`` that ``commands(out)`` (g++ command lines writing ``out``)
    build, from the disk cache when the same commands ran on the same sources before."""
    key = build_cache.digest("cuda_host", name, commands(Path("OUT")),
                             build_cache.tool_version(gxx),
                             build_cache.files_digest([HOST_DIR, SRC, CPU_SRC]))

    def build(out: Path) -> None:
        for cmd in commands(out):
            subprocess.run(cmd, check=True)

    return build_cache.cached_file(name, key, build)


def build_shim(source: str, *, std: str = "c++17", flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """``tests/cuda/cuda_host/<source>`` built as a shared library (or taken from the disk
    cache) and loaded; ``flags`` go after the common ones (e.g. warnings a source needs off)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip(f"needs g++ to build {source}")
    so = cached_build(f"{Path(source).stem}.so", gxx, lambda out: [[
        gxx, "-O2", f"-std={std}", "-ffp-contract=off", "-Wall", "-Wextra", *flags, "-Werror",
        "-shared", "-fPIC", "-o", str(out), str(HOST_DIR / source)]])
    return ctypes.CDLL(str(so))


def declared_kernels() -> dict:
    """Every CUDA C++ kernel's declaration, {name: cuda_jit.KernelDecl}: the ``KERNELS`` of each
    module the registry lists for backend "cuda" (what the launchers pack their arguments by)."""
    from bik.ops._registry import TABLE

    found = {}
    for module in sorted({row.backends["cuda"] for row in TABLE.values()
                          if "cuda" in row.backends}):
        found.update(getattr(importlib.import_module(module), "KERNELS", {}))
    return found


def host_kernels_flag() -> str:
    """``-DBIK_HOST_KERNELS(X)=X(name) ...``: the declared kernels, the list kernels_host.cpp
    dispatches on (so a declared name the sources lack fails its build)."""
    return "-DBIK_HOST_KERNELS(X)=" + " ".join(f"X({name})" for name in sorted(declared_kernels()))


def arg_kind(arg) -> str:
    if arg is None or isinstance(arg, torch.Tensor):
        return "ptr"
    return {np.int32: "i32", np.int64: "i64", np.float32: "f32"}[type(arg)]


def force(monkeypatch, module, name, value):
    """Pin ``module.name`` (a schedule choice such as use_spread) to ``value``; None: leave it."""
    if value is not None:
        monkeypatch.setattr(module, name, lambda *args, **kwargs: value)

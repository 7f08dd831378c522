"""Builds a tests/cuda_host/*.cpp shim with g++ and loads it (ctypes): the host checks of the
CUDA sources (test_cuda_plan_host.py, test_cuda_sm90_host.py, test_cuda_kernels_host.py).

Every shim is built the same way: ``-O2 -ffp-contract=off`` (no FMA contraction, so each float
op is rounded like the device's ``__fadd_rn`` / ``__fmul_rn``) with warnings as errors. A
machine without g++ skips the test that asked for the shim.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["HOST_DIR", "build_shim"]

HOST_DIR = Path(__file__).resolve().parent / "cuda_host"


def build_shim(tmp_path_factory, source: str, *, std: str = "c++17",
               flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """``tests/cuda_host/<source>`` built as a shared library in a fresh temporary directory
    and loaded; ``flags`` go after the common ones (e.g. warnings a source needs off)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip(f"needs g++ to build {source}")
    so = tmp_path_factory.mktemp("cuda_host") / f"{Path(source).stem}.so"
    subprocess.run([gxx, "-O2", f"-std={std}", "-ffp-contract=off", "-Wall", "-Wextra", *flags,
                    "-Werror", "-shared", "-fPIC", "-o", str(so), str(HOST_DIR / source)],
                   check=True)
    return ctypes.CDLL(str(so))

"""The CUDA C++ host-test infrastructure: builds a tests/cuda/cuda_host/*.cpp shim with g++ and
loads it (ctypes); the kernels-on-the-host fixture (``host``: backend="cuda" on CPU tensors, every
launch checked against the kernel's C signature and run by the g++ build); the host checks of the
CUDA sources (test_cuda_plan_host.py, test_cuda_sm90_host.py, test_cuda_kernels_host.py).

Every shim is built the same way: ``-O2 -ffp-contract=off`` (no FMA contraction, so each float
op is rounded like the device's ``__fadd_rn`` / ``__fmul_rn``) with warnings as errors. A
machine without g++ skips the test that asked for the shim. Builds are cached on disk
(tools/build_cache.py), keyed by g++'s version, the command line and every file of
tests/cuda/cuda_host, csrc/cuda and csrc/cpu: a second run, or a second pytest-xdist worker,
loads the first one's build instead of compiling again (kernels_host.cpp takes ~7 s).
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import build_cache
import numpy as np
import pytest
import torch

__all__ = ["CPU_SRC", "HOST_DIR", "SRC", "arg_kind", "build_shim", "cached_build", "force",
           "kernel_signature"]

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


def kernel_signature(source: str, kernel: str) -> list[str]:
    """Parameter kinds of ``kernel`` in csrc/cuda/<source>.cu: 'ptr', 'i32', 'i64', 'f32'."""
    text = (SRC / f"{source}.cu").read_text().replace("\\\n", "\n")
    if kernel.startswith("bik_rms_norm_"):
        match = re.search(r"#define BIK_RMS_NORM_KERNEL\(NAME, VEC, XT, WT\).*?NAME\((.*?)\)\s*\{",
                          text, re.DOTALL)
    elif kernel.startswith("bik_attention_"):
        match = re.search(r"#define BIK_ATTENTION_ENTRY\(NAME, KIND, D\).*?NAME\((.*?)\)\s*\{",
                          text, re.DOTALL)
    elif source == "sampling":  # BIK_SAMPLING_KERNELS(TN, TT) defines NAME_##TN per dtype
        base = kernel.rsplit("_", 1)[0]
        match = re.search(rf"\b{base}_##TN\((.*?)\)\s*\{{", text, re.DOTALL)
    else:
        match = re.search(rf"\b{kernel}\((.*?)\)\s*\{{", text, re.DOTALL)
    assert match, kernel
    scalars = {"int": "i32", "i32": "i32", "i64": "i64", "float": "f32"}
    kinds = []
    for param in match.group(1).split(","):
        decl = " ".join(param.split())
        kinds.append("ptr" if "*" in decl else scalars[
            decl.rsplit(" ", 1)[0].replace("const ", "").replace("bik::", "")])
    return kinds


def arg_kind(arg) -> str:
    if arg is None or isinstance(arg, torch.Tensor):
        return "ptr"
    return {np.int32: "i32", np.int64: "i64", np.float32: "f32"}[type(arg)]


def force(monkeypatch, module, name, value):
    """Pin ``module.name`` (a schedule choice such as use_spread) to ``value``; None: leave it."""
    if value is not None:
        monkeypatch.setattr(module, name, lambda *args: value)

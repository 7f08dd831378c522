"""Fixtures of the CUDA C++ backend tests: the real csrc/cuda kernels built for the host."""

from __future__ import annotations

import ctypes

import bik.ops._registry
import pytest
import torch
from bik import configs
from bik.ops.attention import cuda as cuda_attention
from bik.ops.matmul import cuda as cuda_matmul
from bik.runtime import cuda_jit
from cuda_host_build import arg_kind, build_shim, declared_kernels, host_kernels_flag

_CTYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64,
           "f32": ctypes.c_float}


@pytest.fixture(scope="session")
def host_lib():
    lib = build_shim("kernels_host.cpp", std="c++20",
                     flags=("-Wno-unknown-pragmas", "-fno-strict-aliasing",
                            *configs.cuda_options("matmul"), host_kernels_flag()))
    lib.run_kernel.restype = ctypes.c_int
    lib.run_kernel.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 4 + [ctypes.c_void_p]
    lib.kernel_kinds.restype = ctypes.c_char_p
    lib.kernel_kinds.argtypes = [ctypes.c_char_p]
    return lib


class _Launches(list):
    def __init__(self):
        super().__init__()
        self.grids = []


@pytest.fixture
def host(host_lib, monkeypatch):
    """backend="cuda" on CPU tensors, every launch run by the host build of the kernels.
    Returns the launched kernels' names; ``.grids`` holds their grids."""
    launches = _Launches()
    declared = declared_kernels()

    def launch(kernel, grid, block, shared_bytes, *args, device=None):
        kinds = declared[kernel].kinds
        assert tuple(arg_kind(a) for a in args) == kinds, kernel
        assert shared_bytes == 0 and 0 < block[0] <= 1024 and block[1:] == (1, 1)
        values = [_CTYPES[k](a.data_ptr() if isinstance(a, torch.Tensor)
                             else None if a is None else a.item()) for k, a in zip(kinds, args)]
        argv = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        rc = host_lib.run_kernel(kernel.encode(), *grid, block[0], argv)
        assert rc == 0, f"{kernel}: {'deadlock' if rc == 2 else 'not runnable on the host'}"
        launches.append(kernel)
        launches.grids.append(tuple(grid))

    # backend="cuda" on CPU tensors: the host build of the kernels stands in for a GPU.
    monkeypatch.setitem(bik.ops._registry._CAN_RUN, "cuda", lambda label, device: None)
    monkeypatch.setattr(cuda_jit, "launch", launch)
    monkeypatch.setattr(cuda_jit, "get_kernel", lambda name, kernel, device, options=(): kernel)
    for mod in (cuda_matmul, cuda_attention):
        monkeypatch.setattr(mod, "device_arch", lambda device: "sm90")
    # Small K-split constants (every backend's: the CPU one follows them too), so test-sized K
    # meets groups (K a multiple of 4 x 16) and splits of 64.
    monkeypatch.setattr(configs, "MATMUL_TP_MAX", 4)
    monkeypatch.setattr(configs, "MATMUL_GROUP_ALIGN", 16)
    monkeypatch.setattr(configs, "MATMUL_SPLIT", 64)
    monkeypatch.setattr(configs, "MATMUL_ONE_SPLIT_MAX_K", 64)
    monkeypatch.setattr(configs, "_CUDA_ATTENTION_SPLIT", {"sm90": 32, "sm80": 32})
    return launches

"""The Python launchers of backend="cuda" against the kernels' real ABI, without a GPU.

``cuda_jit.get_kernel`` and ``cuda_jit.launch`` are replaced by a recorder; the launchers run on
CPU tensors; every recorded launch is checked against the kernel's PTX signature (nvcc -ptx):
the kernel exists, the argument count and each argument's size and kind (8-byte pointer/int,
4-byte int, fp32) match, and the block fits the kernel's __launch_bounds__. A mismatch here is
exactly the bug a GPU run would show as garbage or a crash.
"""

from __future__ import annotations

import functools
import shutil

import cuda_compile as cc
import numpy as np
import pytest
import torch
from bik.runtime import cuda_jit

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

_PTX_KIND = {".u64": ("int", 8), ".s64": ("int", 8), ".b64": ("int", 8), ".u32": ("int", 4),
             ".s32": ("int", 4), ".b32": ("int", 4), ".f32": ("float", 4), ".f64": ("float", 8)}


@functools.cache
def _signatures(source: str) -> dict:
    return cc.ptx_signatures(source)


class Recorder:
    def __init__(self):
        self.launches = []

    def get_kernel(self, name, kernel, device, *, options=()):
        return (name, kernel)

    def launch(self, kernel, grid, block, shared_bytes, *args, device=None):
        self.launches.append((kernel, grid, block, shared_bytes,
                              [cuda_jit._arg(a, i) for i, a in enumerate(args)]))


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(cuda_jit, "get_kernel", rec.get_kernel)
    monkeypatch.setattr(cuda_jit, "launch", rec.launch)
    return rec


def _check(launch):
    (source, kernel), grid, block, shared, args = launch
    sig = _signatures(source).get(kernel)
    assert sig is not None, f"{kernel} is not in {source}.cu"
    assert len(args) == len(sig.params), (kernel, len(args), sig.params)
    for i, (value, ptype) in enumerate(zip(args, sig.params)):
        kind, size = _PTX_KIND[ptype]
        got = ("float" if np.issubdtype(value.dtype, np.floating) else "int", value.nbytes)
        assert got == (kind, size), (kernel, i, value.dtype, ptype)
    assert all(g >= 1 for g in grid) and grid[0] < 2**31 and all(g < 2**16 for g in grid[1:])
    threads = block[0] * block[1] * block[2]
    assert sig.max_threads is None or threads <= sig.max_threads, (kernel, block)
    assert shared == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [111, 128])
def test_rms_norm_launcher_matches_kernel_abi(recorder, monkeypatch, dtype, wdtype, hidden):
    """Past the decode sizes of the block-per-row kernel: H = 128 takes the 16-byte instance
    (64 threads: 16 fp32 or 32 16-bit rows per block), H = 111 the scalar one (8 rows per
    128-thread block); a row view off the vector alignment falls back to the scalar one."""
    from bik.ops._define import DECLARED
    from bik.ops.rms_norm import cuda as cuda_rms_norm
    from bik.ops.rms_norm.cuda import launch_rms_norm

    monkeypatch.setattr(cuda_rms_norm, "ROW_MAX_ROWS", 8)  # 19 rows: past it
    norm_args, fused_args = DECLARED["rms_norm"].Args, DECLARED["fused_add_rms_norm"].Args
    x = torch.randn(19, hidden).to(dtype)
    w = torch.randn(hidden).to(wdtype)
    out = torch.empty_like(x)
    launch_rms_norm(norm_args(x, w, 1e-6), out)
    launch_rms_norm(fused_args(x, w, 1e-6, x.clone()), out, torch.empty_like(x))
    launch_rms_norm(norm_args(x[:0], w, 1e-6), out[:0])  # empty: no launch
    wide = torch.randn(19, hidden + 1).to(dtype)
    launch_rms_norm(norm_args(wide[:, 1:], w, 1e-6), out)  # rows start off the 16-byte grid
    assert len(recorder.launches) == 3
    vec = 16 // x.element_size() if hidden == 128 else 1
    for i, launch in enumerate(recorder.launches):
        _check(launch)
        kernel, grid, block = launch[0][1], launch[1], launch[2]
        lanes = vec if i < 2 else 1
        assert kernel.startswith("bik_rms_norm_vec_") == (lanes > 1), kernel
        rows_per_block = block[0] // (16 // lanes)
        assert block[0] == (64 if lanes > 1 else 128)
        assert grid[0] == -(-19 // rows_per_block)
    plain, fused = (launch[4] for launch in recorder.launches[:2])
    assert plain[2] == 0 and plain[7] == 0 and fused[2] != 0 and fused[7] != 0  # r, h
    assert plain[9] == 19 and plain[10] == hidden and plain[11] == np.float32(1e-6)


def test_rms_norm_row_kernel_launches_a_block_per_row(recorder):
    """Decode sizes (rows <= ROW_MAX_ROWS, H <= ROW_MAX_HIDDEN): bik_rms_norm_row_*, one block
    of 128 threads per row, any alignment, the same parameters; past H = 8192 the others."""
    from bik.ops._define import DECLARED
    from bik.ops.rms_norm import cuda as cuda_rms_norm

    norm_args = DECLARED["rms_norm"].Args
    for hidden in (111, 128, cuda_rms_norm.ROW_MAX_HIDDEN + 8):
        x, w = torch.randn(19, hidden), torch.randn(hidden)
        cuda_rms_norm.launch_rms_norm(norm_args(x, w, 1e-6), torch.empty_like(x))
    assert len(recorder.launches) == 3
    for launch, row in zip(recorder.launches, (True, True, False)):
        _check(launch)
        assert launch[0][1].startswith("bik_rms_norm_row_") == row, launch[0][1]
        if row:
            assert launch[1] == (19, 1, 1) and launch[2] == (128, 1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sampler_launcher_matches_kernel_abi(recorder, dtype):
    """The group max, PASSES launches of the pass kernel over (row, normaliser group), the pick."""
    from bik.ops.sampling.cuda import PASSES, SPLIT, launch_sample

    b, v = 5, 40000
    logits = torch.randn(b, v).to(dtype)
    key = torch.zeros(b, 5, dtype=torch.int64)
    f = torch.ones(b)
    outs = launch_sample(logits, key, f, f, torch.zeros(b, dtype=torch.int32), f, f)
    assert outs[3].shape == (b, -(-v // SPLIT))
    names = [launch[0][1].rsplit("_", 1)[0] for launch in recorder.launches]
    assert names == ["bik_sample_group_max"] + ["bik_sample_pass"] * PASSES + ["bik_gumbel_pick"]
    for launch in recorder.launches:
        _check(launch)
    assert {launch[1] for launch in recorder.launches[:-1]} == {(b, 8, 1)}  # V % 8 == 0
    assert recorder.launches[-1][1] == (b, -(-v // SPLIT), 1)
    with pytest.raises(ValueError, match="ik"):
        launch_sample(logits, key, f, f, torch.zeros(b, dtype=torch.int64), f, f)


def test_recorder_catches_a_wrong_signature():
    """Negative control: one argument too few, or an int where the kernel takes fp32, fails."""
    args = [cuda_jit._arg(a, 0) for a in
            (torch.ones(1), cuda_jit.i64(1), None, cuda_jit.i64(0), torch.ones(1), torch.ones(1),
             cuda_jit.i64(1), None, cuda_jit.i64(0), cuda_jit.i64(1), cuda_jit.i64(1))]
    launch = (("rms_norm", "bik_rms_norm_f32_f32"), (1, 1, 1), (128, 1, 1), 0, args)
    with pytest.raises(AssertionError):
        _check(launch)
    launch[4].append(cuda_jit.i32(1))
    with pytest.raises(AssertionError):
        _check(launch)

"""The opt-in sm_90a matmul (csrc/cuda/matmul_sm90.cu, matmul_sm90_plan.cuh) without a GPU.

* The plan header on the host (g++, tests/cuda/cuda_host/sm90_shim.cpp): the wgmma matrix
  descriptor's fields sit where the PTX ISA puts them and round-trip; the no-swizzle K-major
  shared-memory layout gives every (row, k) of a tile its own 2-byte slot inside the buffer,
  16-byte chunks stay contiguous, and what a descriptor addresses (the hardware's reading)
  is what the loaders wrote (the kernel's writing); the accumulator map covers the 64 x 128 tile
  once and matches the ISA's fragment table; every output element meets the same
  (split, k16) sequence at every M in both launch modes.
* The real kernel on the CPU (tests/cuda/cuda_host/kernels_host.cpp with wgmma emulated from the
  descriptors and the fragment table, cp.async as a copy), through the real ops and launcher
  with BIK_CUDA_SM90A=1 on a pretend sm90: the invariance suites in both launch modes, the load
  paths agree, accuracy against fp64; and since the emulated wgmma and the emulated mma.sync
  round the same k16 sums the same way, the sm_90a kernel equals the sm_80 kernel bit for bit
  there, which checks its descriptors, layout, fragment map and epilogue end to end. (On the
  GPU the two instructions need not agree.)
* The sm_90a build contains HGMMA instructions (NVRTC and nvcc); the sm_80 build only traps.
* Selection: off by default; on only for sm90 with the switch, for bf16/fp16.
The tensor core's own bits, TMA and performance need the H200
(tests/matmul/test_matmul_cuda_gpu.py).
"""

from __future__ import annotations

import ctypes
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import bik
import pytest
import torch
from bik import configs
from bik.ops.matmul import cuda as cuda_matmul
from bik.runtime import cuda_jit
from bik.testing.harness import same_bits
from bik.testing.suites import matmul_suite
from checks import assert_invariant
from cuda_host_build import build_shim, force

U64, I64, I32, U32 = ctypes.c_ulonglong, ctypes.c_longlong, ctypes.c_int, ctypes.c_uint
ROWS = (64, 128)  # A tile rows (BM), B tile rows (BN)
BK = 32


@pytest.fixture(scope="module")
def shim():
    lib = build_shim("sm90_shim.cpp")
    lib.mm90_encode_desc.restype = U64
    lib.mm90_encode_desc.argtypes = [U32] * 4
    lib.mm90_decode_desc.argtypes = [U64, ctypes.POINTER(U32)]
    lib.mm90_tile_desc.restype = U64
    lib.mm90_tile_desc.argtypes = [U32, I32, I32]
    lib.mm90_tile_offset.argtypes = [I32] * 3
    lib.mm90_tile_bytes.argtypes = [I32]
    lib.mm90_desc_element_address.restype = U32
    lib.mm90_desc_element_address.argtypes = [U64, I32, I32]
    lib.mm90_acc_coord.argtypes = [I32, I32, ctypes.POINTER(I32), ctypes.POINTER(I32)]
    lib.mm90_k_schedule.restype = I32
    lib.mm90_k_schedule.argtypes = [I32] * 7 + [ctypes.c_void_p, ctypes.c_void_p, I32]
    lib.mm90_k16_steps.restype = I64
    lib.mm90_k16_steps.argtypes = [I64, I64]
    return lib


def _decode(shim, d):
    out = (U32 * 5)()
    shim.mm90_decode_desc(d, out)
    return tuple(out)


# ---- descriptor ------------------------------------------------------------------------------

def _isa_desc(start, lbo, sbo, base_offset, swizzle):
    """The PTX ISA's matrix-descriptor table, restated: 14-bit fields of the byte values >> 4
    at bits 0, 16 and 32; base offset at bits 49-51; swizzle mode at bits 62-63."""
    return ((start >> 4) & 0x3FFF | ((lbo >> 4) & 0x3FFF) << 16 | ((sbo >> 4) & 0x3FFF) << 32
            | (base_offset & 7) << 49 | (swizzle & 3) << 62)


def test_descriptor_fields_follow_the_isa_and_round_trip(shim):
    assert shim.mm90_encode_desc(16, 0, 0, 0) == 1
    assert shim.mm90_encode_desc(0, 16, 0, 0) == 1 << 16
    assert shim.mm90_encode_desc(0, 0, 16, 0) == 1 << 32
    assert shim.mm90_encode_desc(0, 0, 0, 1) == 1 << 62  # 128B swizzle
    assert shim.mm90_encode_desc(0, 0, 0, 3) == 3 << 62  # 32B swizzle
    assert shim.mm90_encode_desc((1 << 18) - 16, (1 << 18) - 16, (1 << 18) - 16, 3) == (
        0x3FFF | 0x3FFF << 16 | 0x3FFF << 32 | 3 << 62)
    rng = random.Random(0)
    for _ in range(2000):
        start, lbo, sbo = (16 * rng.randrange(1 << 14) for _ in range(3))
        swizzle = rng.randrange(4)
        d = shim.mm90_encode_desc(start, lbo, sbo, swizzle)
        assert d == _isa_desc(start, lbo, sbo, 0, swizzle)
        assert _decode(shim, d) == (start, lbo, sbo, 0, swizzle)
    for bits in (1 << 49, 5 << 49):  # the base-offset field decodes where the ISA puts it
        assert _decode(shim, bits)[3] == bits >> 49


def test_kernel_descriptors_are_no_swizzle_k_major(shim):
    """LBO = the distance between core matrices adjacent in K (a k-slab of rows x 8), SBO = the
    distance between core matrices adjacent in M/N (8 rows x 16 B), no swizzle, base offset 0;
    the second k16 step starts two k-slabs later."""
    for rows in ROWS:
        for kstep in (0, 1):
            d = shim.mm90_tile_desc(4096, rows, kstep)
            assert _decode(shim, d) == (4096 + kstep * 2 * rows * 16, rows * 16, 128, 0, 0)


# ---- shared-memory layout --------------------------------------------------------------------

@pytest.mark.parametrize("rows", ROWS)
def test_tile_layout_is_a_bijection_into_the_buffer(shim, rows):
    size = shim.mm90_tile_bytes(rows)
    assert size == rows * BK * 2
    offsets = {}
    for r in range(rows):
        for k in range(BK):
            off = shim.mm90_tile_offset(rows, r, k)
            assert 0 <= off < size and off % 2 == 0
            offsets[off] = (r, k)
            if k % 8:  # a 16-byte chunk (8 k from a multiple of 8) is contiguous and aligned
                assert off == shim.mm90_tile_offset(rows, r, k - k % 8) + 2 * (k % 8)
            else:
                assert off % 16 == 0
    assert len(offsets) == rows * BK == size // 2  # unique, and the buffer is filled exactly


@pytest.mark.parametrize("rows", ROWS)
def test_descriptor_reads_what_the_loaders_wrote(shim, rows):
    """For each k16 instruction, element (r, k) as the hardware finds it through the descriptor
    is the slot the kernel stored (r, 16 kstep + k) in."""
    start = 8192
    for kstep in (0, 1):
        d = shim.mm90_tile_desc(start, rows, kstep)
        for r in range(rows):
            for k in range(16):
                assert shim.mm90_desc_element_address(d, r, k) == (
                    start + shim.mm90_tile_offset(rows, r, 16 * kstep + k))


# ---- accumulator fragment ------------------------------------------------------------------

def test_accumulator_map_follows_the_isa_and_covers_the_tile(shim):
    seen = set()
    row, col = I32(), I32()
    for t in range(128):
        w, lane = t // 32, t % 32
        for i in range(64):
            shim.mm90_acc_coord(t, i, ctypes.byref(row), ctypes.byref(col))
            spec = (16 * w + lane // 4 + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * (lane % 4) + i % 2)
            assert (row.value, col.value) == spec
            seen.add(spec)
    assert seen == {(r, c) for r in range(64) for c in range(128)}


# ---- k order ---------------------------------------------------------------------------------

def _schedule(shim, m, n, k, split, spread, row, col):
    cap = k + 64
    splits, ks = (I32 * cap)(), (I64 * cap)()
    count = shim.mm90_k_schedule(m, n, k, split, spread, row, col, splits, ks, cap)
    assert count <= cap
    return list(zip(splits[:count], ks[:count]))


def test_every_element_sees_the_same_k16_sequence_at_every_m(shim):
    n, k, split = 150, 300, 96  # splits [0,96) [96,192) [192,288) [288,300)
    expected = [(lo // split, k16) for lo in range(0, k, split)
                for k16 in range(lo, min(lo + split, k) + (-(min(lo + split, k) - lo)) % 32, 16)]
    assert len(expected) == sum(shim.mm90_k16_steps(lo, min(lo + split, k))
                                for lo in range(0, k, split))
    for m in (1, 2, 3, 63, 64, 65, 127, 128, 129, 200):
        for spread in (0, 1):
            for row in {0, m // 2, m - 1}:
                for col in (0, 77, 128, n - 1):
                    assert _schedule(shim, m, n, k, split, spread, row, col) == expected, (
                        m, spread, row, col)


# ---- selection -------------------------------------------------------------------------------

def test_selected_only_on_sm90_with_the_switch(monkeypatch):
    monkeypatch.delenv(configs.SM90A_MATMUL_ENV, raising=False)
    default = configs.cuda_matmul_config(torch.bfloat16, 4096, 4096, "sm90")
    assert (default.source, default.kernel) == ("matmul", "bik_matmul_bf16")
    off_table = configs.cuda_config_table()
    monkeypatch.setenv(configs.SM90A_MATMUL_ENV, "1")
    assert configs.cuda_config_table() != off_table  # so bik.fingerprint() changes too
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "f16")):
        on = configs.cuda_matmul_config(dtype, 4096, 4096, "sm90")
        assert (on.source, on.kernel) == ("matmul_sm90", f"bik_matmul_sm90_{name}")
        assert on.split_k == configs.cuda_matmul_config(dtype, 4096, 4096, "sm80").split_k
        for arch in ("sm80", "sm86", "sm100"):
            assert configs.cuda_matmul_config(dtype, 4096, 4096, arch).source == "matmul"
    assert configs.cuda_matmul_config(torch.float32, 64, 64, "sm90").source == "matmul"


# ---- SASS ------------------------------------------------------------------------------------

def _nvcc_sass(arch: str) -> str:
    import cuda_compile as cc
    from bik.runtime.cuda_aot import NVCC_FLAGS

    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        subprocess.run([shutil.which("nvcc"), "-cubin", f"-arch={arch}", *NVCC_FLAGS, "-I",
                        str(cuda_jit.source_dir()), str(cuda_jit.source_dir() / "matmul_sm90.cu"),
                        "-o", str(cubin)], check=True, capture_output=True)
        return cc.sass(cubin.read_bytes())


def test_sm90a_build_uses_hgmma_and_sm80_build_traps():
    import cuda_compile as cc

    if not cuda_jit.compiler_available() or cc.cuobjdump() is None:
        pytest.skip("needs NVRTC and cuobjdump")
    sass = {("nvrtc", arch): cc.sass(cc.nvrtc_records("matmul_sm90", arch)[0])
            for arch in cc.ARCHS}
    if shutil.which("nvcc"):
        sass.update({("nvcc", arch): _nvcc_sass(arch) for arch in cc.ARCHS})
    for (compiler, arch), text in sass.items():
        if arch == "sm_90a":
            for dtype in ("BF16", "F16"):  # two k16 instructions per BLOCK_K step, per kernel
                assert text.count(f"HGMMA.64x128x16.F32.{dtype} ") + text.count(
                    "HGMMA.64x128x16.F32 ") >= 2, compiler
            assert text.count("HGMMA.64x128x16.F32") >= 8, compiler  # 2 kernels x 2 paths x 2
            assert "BPT.TRAP" not in text, compiler
        else:
            assert "HGMMA" not in text and "BPT.TRAP" in text, compiler


# ---- the real kernel on the CPU --------------------------------------------------------------

@pytest.fixture
def sm90(host, monkeypatch):
    monkeypatch.setenv(configs.SM90A_MATMUL_ENV, "1")
    return host


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sm90_kernel_suite_on_the_host(sm90, monkeypatch, dtype):
    for spread in (True, False):
        force(monkeypatch, cuda_matmul, "use_spread", spread)
        assert_invariant(matmul_suite(device="cpu", dtype=dtype, backend="cuda",
                                      ms=(1, 2, 9), shapes=[(24, 130), (136, 40)]))
    assert f"bik_matmul_sm90_{'bf16' if dtype == torch.bfloat16 else 'f16'}" in sm90
    assert "bik_matmul_reduce" in sm90


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sm90_kernel_equals_the_emulated_sm80_kernel_and_fp64(sm90, monkeypatch, dtype):
    """Every load path (cp.async, 16-byte, element, misaligned) and both launch modes give the
    bits of the sm_80 kernel under the same emulation (same k16 order, same rounding of each
    k16 sum), and the result is accurate against fp64."""
    gen = torch.Generator().manual_seed(8)
    a = torch.randn(70, 208, generator=gen).to(dtype)
    w = torch.randn(136, 208, generator=gen).to(dtype)
    bias = torch.randn(136, generator=gen)
    ref = a.double() @ w.double().t() + bias.double()
    a_buf, w_buf = torch.empty(70, 209, dtype=dtype), torch.empty(136, 209, dtype=dtype)
    a_buf[:, 1:], w_buf[:, 1:] = a, w
    outs = []
    for spread in (True, False):
        force(monkeypatch, cuda_matmul, "use_spread", spread)
        for x, b in ((a, w.t()), (a, w.t().contiguous()), (a.t().contiguous().t(), w.t()),
                     (a_buf[:, 1:], w_buf[:, 1:].t())):
            outs.append(bik.matmul(x, b, bias, out_dtype=torch.float32, backend="cuda"))
    assert "bik_matmul_sm90_" + ("bf16" if dtype == torch.bfloat16 else "f16") in sm90
    monkeypatch.delenv(configs.SM90A_MATMUL_ENV)
    sm80 = bik.matmul(a, w.t(), bias, out_dtype=torch.float32, backend="cuda")
    assert sm90[-1].startswith("bik_matmul_") and "sm90" not in sm90[-1]
    assert all(same_bits(o, sm80) for o in outs)
    assert (outs[0].double() - ref).abs().max() <= 1e-5 * ref.abs().max()

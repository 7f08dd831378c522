"""Every CUDA C++ kernel file (csrc/cuda/*.cu, by glob) compiles for sm_80 and sm_90a with NVRTC
(what the JIT runs) and with nvcc (what the AOT build runs), warnings as errors, no FMA
contraction; registers, shared memory and spills are measured and held to budgets. No GPU needed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cuda_compile as cc
import pytest
import torch
from bik import configs
from bik.runtime import cuda_aot, cuda_jit

if not cuda_jit.compiler_available():
    pytest.skip(f"NVRTC unavailable: {cuda_jit.compiler_unavailable_reason()}",
                allow_module_level=True)

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
needs_cuobjdump = pytest.mark.skipif(cc.cuobjdump() is None, reason="no cuobjdump")

# Spill budget in bytes (nvcc's spill stores + stack frame + cuobjdump's local memory) per
# kernel; every kernel not listed gets 0. A change that spills must raise its entry
# deliberately and say why in its commit.
SPILL_BUDGET: dict[str, int] = {}
REGISTER_LIMIT = 255
SHARED_LIMIT = {"sm_80": 166_912, "sm_90a": 232_448}  # per block, opt-in (static here)

SOURCES = cc.cuda_sources()
CASES = [(s, a) for s in SOURCES for a in cc.ARCHS]
IDS = [f"{s}-{a}" for s, a in CASES]


def test_sources_are_found():
    assert {"rms_norm", "sampling"} <= set(SOURCES)
    assert cuda_jit.source_dir().joinpath("common.cuh").exists()


@pytest.fixture(scope="module")
def compiled():
    """Every (source, arch) through NVRTC and nvcc at once, on all cores (NVRTC runs without
    the GIL, nvcc in subprocesses): {(compiler, source, arch): records or the exception}."""
    jobs = [("nvrtc", s, a) for s, a in CASES]
    if NVCC is not None:
        jobs += [("nvcc", s, a) for s, a in CASES]

    def run(job):
        compiler, source, arch = job
        try:
            if compiler == "nvrtc":
                return cc.nvrtc_records(source, arch)[1]
            return cc.nvcc_records(source, arch, NVCC)
        except RuntimeError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip(jobs, pool.map(run, jobs)))


def _check_budgets(compiled, key, spilled):
    """Every kernel of ``compiled[key]`` within the register, shared-memory and spill budgets;
    ``spilled(record)`` is the compiler's measure of spill bytes."""
    records = compiled[key]
    if isinstance(records, Exception):
        pytest.fail(str(records))
    assert records, f"{key}: no kernel reported"
    arch = key[2]
    for r in records:
        assert 0 < r.registers <= REGISTER_LIMIT, r
        assert r.shared <= SHARED_LIMIT[arch], r
        assert spilled(r) <= SPILL_BUDGET.get(r.kernel, 0), r


@needs_cuobjdump
@pytest.mark.parametrize(("source", "arch"), CASES, ids=IDS)
def test_nvrtc_compiles_within_budgets(compiled, source, arch):
    _check_budgets(compiled, ("nvrtc", source, arch), lambda r: r.stack + r.local)


@needs_cuobjdump
@pytest.mark.parametrize("source", SOURCES)
def test_every_compiled_kernel_is_declared(compiled, source):
    """The kernels NVRTC builds from ``<source>.cu`` are exactly those declared with that
    source (``KERNELS`` in bik/ops/<op>/cuda.py); test_cuda_kernel_decls.py checks each
    declaration's parameters against the compiled signature."""
    from cuda_host_build import declared_kernels

    records = compiled[("nvrtc", source, "sm_80")]
    if isinstance(records, Exception):
        pytest.fail(str(records))
    declared = {name for name, decl in declared_kernels().items() if decl.source == source}
    assert {r.kernel for r in records} == declared


@needs_nvcc
@pytest.mark.parametrize(("source", "arch"), CASES, ids=IDS)
def test_nvcc_compiles_without_spills(compiled, source, arch):
    _check_budgets(compiled, ("nvcc", source, arch), lambda r: max(r.spill_stores, r.stack))


def test_nvrtc_warnings_are_errors(tmp_path, monkeypatch):
    """A warning NVRTC only prints (an unused variable) fails the build."""
    (tmp_path / "common.cuh").write_text("")
    (tmp_path / "warn.cu").write_text(
        'extern "C" __global__ void k(float* y) { int unused; y[0] = 1.0f; }\n')
    monkeypatch.setattr(cuda_jit, "source_dir", lambda: tmp_path)
    with pytest.raises(RuntimeError, match="warnings .treated as errors"):
        cuda_jit.compile_source("warn", "sm_80")


@needs_nvcc
@pytest.mark.parametrize("source", ["rms_norm", "sampling"])
def test_exact_kernels_have_no_fma_or_approximations(source):
    """PTX of RMSNorm and of both sampler kernels (the Gumbel pick, and the stats with top-p's
    cut and the logprob's normaliser from bik_exp and bik_log): only exactly rounded ops
    (div.rn, sqrt.rn), no contracted fma and no approximate instruction."""
    entries = cc.ptx_entries(source, "sm_90a", NVCC)
    assert entries
    for name, ptx in entries.items():
        for bad in ("fma.", ".approx", "ex2.", "lg2.", "rcp.", "div.full"):
            assert bad not in ptx, (name, bad)


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_rms_norm_vector_instance_moves_16_bytes(arch):
    """Every global load and store of the bik_rms_norm_vec_* kernels is a 4-wide vector (16 bytes
    of x, residual, h and out; the weight's 4 or 8 elements), and the scalar instance has none:
    the access width is the only difference between the two. The block-per-row kernels
    (bik_rms_norm_row_*, decode sizes) access global memory element by element, coalesced
    across the block, and keep the row in shared memory."""
    entries = cc.ptx_entries("rms_norm", arch, NVCC)
    vec = {k: v for k, v in entries.items() if k.startswith("bik_rms_norm_vec_")}
    row = {k: v for k, v in entries.items() if k.startswith("bik_rms_norm_row_")}
    assert len(vec) == 9 and len(row) == 9 and len(entries) == 27
    assert all(re.search(r"\bld\.shared\.", ptx) for ptx in row.values())
    for name, ptx in entries.items():
        accesses = re.findall(r"\b(?:ld|st)\.global(?:\.nc)?((?:\.v\d)?)\.\w+", ptx)
        assert accesses, name
        assert all(a == (".v4" if name in vec else "") for a in accesses), (name, accesses)


@needs_nvcc
def test_aot_build_produces_fatbins(tmp_path):
    """The function setup.py runs for BIK_BUILD_CUDA=1 (here on a copy of two sources)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("common.cuh", "rms_norm.cuh", "rms_norm.cu"):
        shutil.copy(cuda_jit.source_dir() / name, src / name)
    manifest = cuda_aot.build_fatbins(src, tmp_path / "out", nvcc=NVCC)
    fatbin = tmp_path / "out" / "rms_norm.fatbin"
    assert fatbin.stat().st_size > 10_000
    assert manifest["archs"] == ["sm_80", "sm_90a"]
    assert manifest["source_hash"] == cuda_aot.source_hash(src)
    assert (tmp_path / "out" / "manifest.json").exists()
    assert {"sm_80", "sm_90"} <= cc.list_fatbin_archs(fatbin)  # cuobjdump names sm_90a "sm_90"


@needs_nvcc
def test_matmul_tile_comes_from_configs_only(tmp_path):
    """matmul.cu restates no tile: without the -D macros of bik.configs it does not compile;
    the AOT build records the options it used, and setup.py reads the same literal."""
    src = cuda_jit.source_dir() / "matmul.cu"
    bare = subprocess.run([NVCC, "-cubin", "-arch=sm_80", "-I", str(src.parent), str(src), "-o",
                           str(tmp_path / "k.cubin")], capture_output=True, text=True, check=False)
    assert bare.returncode != 0 and "bik.configs.cuda_options('matmul')" in bare.stderr
    assert "-DBIK_MM_TC_BK=32" in configs.cuda_options("matmul")
    tile = configs.cuda_matmul_config(torch.bfloat16, 8, 8, "sm90")
    assert (tile.block_m, tile.block_n, tile.block_k) == tuple(
        configs.CUDA_DEFINES["matmul"][f"BIK_MM_TC_{x}"] for x in ("BM", "BN", "BK"))
    assert cuda_aot.read_literal(Path(configs.__file__), "CUDA_DEFINES") == configs.CUDA_DEFINES
    # Built from a copy holding the headers and two kernels: one with options, one without.
    copy = tmp_path / "src"
    copy.mkdir()
    for path in cuda_aot.source_files(src.parent):
        if path.suffix != ".cu" or path.stem in ("matmul", "rms_norm"):
            shutil.copy(path, copy / path.name)
    manifest = cuda_aot.build_fatbins(copy, tmp_path / "out", nvcc=NVCC, archs=("sm_80",),
                                      defines=configs.CUDA_DEFINES)
    assert sorted(manifest["options"]) == ["matmul", "rms_norm"]
    assert manifest["options"]["matmul"] == list(configs.cuda_options("matmul"))
    assert manifest["options"]["rms_norm"] == []


def test_cache_key_follows_sources_arch_and_options(monkeypatch):
    k = cuda_jit._cache_key("rms_norm", "sm_90a", ())
    assert k == cuda_jit._cache_key("rms_norm", "sm_90a", ())
    assert k != cuda_jit._cache_key("rms_norm", "sm_80", ())
    assert k != cuda_jit._cache_key("rms_norm", "sm_90a", ("BIK_X=1",))
    monkeypatch.setattr(cuda_jit, "_sources_hash", lambda: "changed")
    assert k != cuda_jit._cache_key("rms_norm", "sm_90a", ())


def test_cache_key_names_no_location():
    """Another clone or venv with the same sources and packages meets the same entries: the
    key holds the headers' place inside the venv and the nvidia-* versions, not sys.prefix."""
    dirs, versions = cuda_jit._toolkit_identity()
    assert sys.prefix not in repr(dirs)
    assert any(name.lower().startswith("nvidia-cuda-nvrtc") for name, _ in versions), versions


def test_disk_cache_roundtrip(tmp_path, monkeypatch):
    """The first call compiles and stores atomically; the second reads the file back."""
    monkeypatch.setenv("BIK_CUDA_CACHE", str(tmp_path))
    first = cuda_jit.cached_cubin("rms_norm", "sm_80")
    files = list(tmp_path.glob("rms_norm-sm_80-*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == first
    assert not list(tmp_path.glob(".*"))  # no temp file left behind
    files[0].write_bytes(b"sentinel")  # proves the second call reads the cache
    assert cuda_jit.cached_cubin("rms_norm", "sm_80") == b"sentinel"


def test_launch_rejects_bare_python_scalars():
    with pytest.raises(TypeError, match="i32 / i64 / f32"):
        cuda_jit._arg(3, 0)
    assert cuda_jit.i32(3).nbytes == 4 and cuda_jit.i64(3).nbytes == 8
    assert cuda_jit.f32(0.1).dtype.itemsize == 4
    with pytest.raises(OverflowError):
        cuda_jit.i32(2**31)


def test_device_target():
    assert cuda_jit.device_target((9, 0)) == "sm_90a"
    assert cuda_jit.device_target((8, 0)) == "sm_80"
    assert cuda_jit.device_target((8, 9)) == "sm_89"


def test_cuda_source_change_changes_fingerprint(monkeypatch):
    import bik

    before = bik.fingerprint("cpu")
    monkeypatch.setattr(cuda_jit, "sources_hash", lambda: "edited csrc/cuda")
    assert bik.fingerprint("cpu").source_hash != before.source_hash


def test_source_dir_prefers_shipped_sources(tmp_path, monkeypatch):
    """A wheel carries csrc/cuda as bik/_cuda_src; a checkout reads csrc/cuda in place."""
    assert cuda_jit.source_dir().name == "cuda"  # this checkout
    shipped = tmp_path / "_cuda_src"
    shipped.mkdir()
    (shipped / "x.cu").write_text("")
    monkeypatch.setattr(cuda_jit, "_PKG", tmp_path)
    assert cuda_jit.source_dir() == shipped


def test_backend_cuda_raises_clearly_without_a_gpu():
    import bik
    import torch

    if cuda_jit.available():
        pytest.skip("a usable GPU is present")
    with pytest.raises(bik.BackendUnavailableError, match=r"bik.rms_norm: backend='cuda'"):
        bik.rms_norm(torch.ones(2, 4), torch.ones(4), backend="cuda")
    with pytest.raises(bik.BackendUnavailableError, match="backend='cuda'"):
        bik.sample(torch.ones(2, 4), seed=0, position=0, backend="cuda")

"""Compile bik's CUDA C++ kernels (csrc/cuda/*.cu) for real GPU targets without a GPU, and
measure every kernel: registers, shared memory, stack, local memory, spills.

Two compilers, both with warnings as errors and no FMA contraction: NVRTC (what the JIT runs,
via :func:`bik.runtime.cuda_jit.compile_source`; resources read from the cubin with
``cuobjdump --dump-resource-usage``) and nvcc (what the AOT build runs; resources and spill
bytes from ``--resource-usage``). ``cuobjdump`` is taken from PATH or the triton wheel.

Compiles are cached on disk, keyed by every csrc/cuda file, the options and the compiler's
version: NVRTC's cubins in the JIT's own cache (``cuda_jit.cached_cubin``), nvcc's PTX and
ptxas reports in build_cache.py's; ``BIK_BUILD_CACHE=off`` compiles every time.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import build_cache
from bik.configs import cuda_options
from bik.runtime import cuda_jit
from bik.runtime.cuda_aot import NVCC_FLAGS

__all__ = ["ARCHS", "CudaCompileRecord", "cuda_sources", "cuobjdump", "list_fatbin_archs", "nvcc_records",
           "nvrtc_cubin", "nvrtc_records", "ptx_entries", "ptx_signatures", "sass"]

ARCHS = ("sm_80", "sm_90a")


class CudaCompileRecord(NamedTuple):
    source: str  # file stem: csrc/cuda/<source>.cu
    kernel: str
    arch: str
    compiler: str  # "nvrtc" or "nvcc"
    registers: int
    shared: int  # static shared memory (bytes; cuobjdump counts sm_90's reserved 1 KiB)
    stack: int
    local: int
    spill_stores: int  # nvcc only (ptxas -v); -1 where not reported
    spill_loads: int


def cuda_sources() -> list[str]:
    """Every kernel file (``*.cu``) in csrc/cuda, by stem."""
    return sorted(p.stem for p in cuda_jit.source_dir().glob("*.cu"))


def cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton

        path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(path) if path.exists() else None
    except ImportError:
        return None


_USAGE = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _cubin_usage(cubin: bytes) -> dict[str, tuple[int, int, int, int]]:
    tool = cuobjdump()
    if tool is None:
        raise RuntimeError("no cuobjdump (neither on PATH nor in the triton wheel)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([tool, "--dump-resource-usage", str(path)], capture_output=True,
                              text=True, check=True).stdout
    return {m.group(1): tuple(int(m.group(i)) for i in range(2, 6))
            for m in _USAGE.finditer(text)}


def sass(cubin: bytes) -> str:
    """The SASS of a cubin (cuobjdump -sass), for instruction checks."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([cuobjdump(), "-sass", str(path)], capture_output=True, text=True,
                              check=True).stdout


def _nvcc_key(kind: str, nvcc: str, cmd: list[str]) -> str:
    """Disk-cache key of an nvcc run: nvcc's version, the command, every csrc/cuda file."""
    return build_cache.digest(kind, cmd, build_cache.tool_version(nvcc),
                              build_cache.files_digest([cuda_jit.source_dir()]))


def ptx_entries(source: str, arch: str, nvcc: str = "nvcc") -> dict[str, str]:
    """{kernel: its PTX} from nvcc -ptx with the AOT flags (instruction checks: ``fma``,
    ``.approx`` ... are visible in PTX before ptxas expands div.rn / sqrt.rn). Cached on disk
    (build_cache.py)."""
    src_dir = cuda_jit.source_dir()

    def cmd(out):
        return [nvcc, "-ptx", f"-arch={arch}", *NVCC_FLAGS, *cuda_options(source), "-I",
                str(src_dir), str(src_dir / f"{source}.cu"), "-o", str(out)]

    def build(out: Path) -> None:
        subprocess.run(cmd(out), check=True, capture_output=True)

    text = build_cache.cached_file(f"{source}-{arch}.ptx", _nvcc_key("ptx", nvcc, cmd("OUT")),
                                   build).read_text()
    parts = re.split(r"(?=\.visible \.entry )", text)[1:]
    return {re.match(r"\.visible \.entry (\w+)", p).group(1): p for p in parts}


class PtxSignature(NamedTuple):
    params: tuple[str, ...]  # PTX parameter types in order: ".u64", ".u32", ".f32", ...
    max_threads: int | None  # .maxntid (from __launch_bounds__), total threads per block


def ptx_signatures(source: str, arch: str = "sm_90a", nvcc: str = "nvcc") -> dict:
    """{kernel: PtxSignature} of every kernel in ``source``: what a launcher must pass."""
    out = {}
    for name, ptx in ptx_entries(source, arch, nvcc).items():
        head = ptx[:ptx.index("{")]
        params = tuple(re.findall(r"\.param\s+(\.\w+)", head))
        ntid = re.search(r"\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)", head)
        total = None if ntid is None else int(ntid[1]) * int(ntid[2]) * int(ntid[3])
        out[name] = PtxSignature(params, total)
    return out


def list_fatbin_archs(fatbin: Path) -> set[str]:
    """The SASS archs in a fatbin (cuobjdump --list-elf)."""
    text = subprocess.run([cuobjdump(), "--list-elf", str(fatbin)], capture_output=True,
                          text=True, check=True).stdout
    return set(re.findall(r"\.(sm_\d+a?)\.cubin", text))


def nvrtc_cubin(source: str, arch: str) -> bytes:
    """NVRTC's cubin of ``source`` for ``arch`` with bik.configs' options: the JIT's own disk
    cache (``cuda_jit.cached_cubin``: keyed by every csrc/cuda file, arch, options and NVRTC's
    version; only a compile without errors or warnings is stored), one builder at a time, so
    concurrent callers compile it once; ``BIK_BUILD_CACHE=off`` compiles every time."""
    options = cuda_options(source)
    if not build_cache.enabled():
        return cuda_jit.compile_source(source, arch, options=options)
    with build_cache.locked(f"nvrtc-{source}-{arch}"):
        return cuda_jit.cached_cubin(source, arch, options=options)


def nvrtc_records(source: str, arch: str) -> tuple[bytes, list[CudaCompileRecord]]:
    """NVRTC-compile ``source`` for ``arch`` (:func:`nvrtc_cubin`); (cubin, one record per
    kernel)."""
    cubin = nvrtc_cubin(source, arch)
    records = [CudaCompileRecord(source, name, arch, "nvrtc", regs, shared, stack, local, -1, -1)
               for name, (regs, stack, shared, local) in sorted(_cubin_usage(cubin).items())]
    return cubin, records


_PTXAS_ENTRY = re.compile(
    r"Compiling entry function '(\S+)' for '(\S+)'.*?"
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?"
    r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?", re.DOTALL)


def nvcc_records(source: str, arch: str, nvcc: str = "nvcc") -> list[CudaCompileRecord]:
    """nvcc-compile ``source`` for ``arch`` (the AOT flags, cubin) and parse ptxas's report
    (a successful run's report is cached on disk: build_cache.py)."""
    src_dir = cuda_jit.source_dir()

    def cmd(out):
        return [nvcc, "-cubin", f"-arch={arch}", *NVCC_FLAGS, *cuda_options(source),
                "--resource-usage", "-I", str(src_dir), str(src_dir / f"{source}.cu"), "-o",
                str(out)]

    def build(report: Path) -> None:
        res = subprocess.run(cmd(report.with_suffix(".cubin")), check=False, capture_output=True,
                             text=True)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source}.cu for {arch}:\n"
                               f"{res.stdout}{res.stderr}")
        report.write_text(res.stdout + res.stderr)

    text = build_cache.cached_file(f"{source}-{arch}.ptxas.txt",
                                   _nvcc_key("nvcc-records", nvcc, cmd("OUT")), build).read_text()
    records = []
    for block in re.split(r"(?=ptxas info\s+: Compiling entry function)", text):
        m = _PTXAS_ENTRY.search(block)
        if m is None:
            continue
        name, _, stack, st, ld, regs, smem = m.groups()
        records.append(CudaCompileRecord(source, name, arch, "nvcc", int(regs), int(smem or 0),
                                         int(stack), 0, int(st), int(ld)))
    return sorted(records, key=lambda r: r.kernel)

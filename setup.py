"""Build script: the fixed-order CPU kernels (csrc/cpu) as an optional pybind11 extension.

The extension includes no torch headers, so it is tied to the Python ABI only, never to a
torch build. If no C++ compiler is present the build is skipped: bik still imports, the
Triton backend still runs, and backend="cpu" raises a clear error (see bik.runtime.cpu_ext).
"""

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pybind11
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup
from setuptools.command.build_py import build_py

CPU_SOURCES = sorted(Path("csrc/cpu").glob("*.[ch]*"))


def _source_hash() -> str:
    """Baked into the extension so bik.fingerprint() covers the C++ kernels of any install."""
    h = hashlib.sha256()
    for path in CPU_SOURCES:
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def _cache_root() -> Path | None:
    """tools/build_cache.py's place and switch (that module is not importable here)."""
    env = os.environ.get("BIK_BUILD_CACHE", "")
    if env.lower() in ("0", "off", "no", "false"):
        return None
    if env:
        return Path(env)
    return Path(os.environ.get("BIK_CACHE_DIR") or Path.home() / ".cache" / "bik") / "build"


class OptionalBuildExt(build_ext):
    """Keep installing when the compiler is missing or fails; the CPU backend reports it.

    A build is cached on disk (~15 s of g++ saved for every fresh clone or venv after the
    first), keyed by what decides its bytes: the sources' hash, the compiler's --version and
    command, the flags, the Python ABI and pybind11's version, never a path."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any toolchain failure
            print(f"bik: CPU extension not built ({exc}); backend='cpu' will be unavailable")

    def _cached(self, ext) -> Path | None:
        root = _cache_root()
        if root is None:
            return None
        compiler = list(getattr(self.compiler, "compiler_so", None) or ["c++"])
        version = subprocess.run([compiler[0], "--version"], capture_output=True, text=True,
                                 check=False).stdout
        material = repr((_source_hash(), version, compiler, ext.extra_compile_args,
                         ext.extra_link_args, ext.define_macros, sys.version,
                         sysconfig.get_config_var("EXT_SUFFIX"), pybind11.__version__))
        key = hashlib.sha256(material.encode()).hexdigest()[:20]
        return root / f"cpu_ext-{key}" / Path(self.get_ext_filename(ext.name)).name

    def build_extension(self, ext):
        target = Path(self.get_ext_fullpath(ext.name))
        try:
            cached = self._cached(ext)
        except Exception:  # noqa: BLE001 - no cache, the build runs as without one
            cached = None
        if cached is not None and cached.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            # A fresh mtime (shutil.copy, not copy2): setuptools copies an editable build into
            # the source tree only when it is newer than the file already there.
            shutil.copy(cached, target)
            print(f"bik: CPU extension from the build cache ({cached})")
            return
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"bik: CPU extension not built ({exc}); backend='cpu' will be unavailable")
            return
        if cached is not None and target.is_file():
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f".{cached.name}.{os.getpid()}")
            shutil.copy2(target, tmp)
            os.replace(tmp, cached)  # a reader never sees half a file


cpu_ext = Pybind11Extension(
    "bik._cpu_kernels",
    sources=["csrc/cpu/bindings.cpp"],
    depends=[str(p) for p in CPU_SOURCES],
    define_macros=[("BIK_CPU_SOURCE_HASH", f'"{_source_hash()}"')],
    include_dirs=["csrc/cpu"],
    cxx_std=17,
    # -ffp-contract=off: every a*b+c stays a rounded multiply then a rounded add, in every
    # code path (vector body, tails, any ISA clone), which is what makes the bits fixed.
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"],
    # libgomp.so.1: at run time the soname binds to the copy torch loaded (its thread pool).
    extra_link_args=["-fopenmp"],
)


def _env():
    """python/bik/_env.py (bik's one parser of boolean BIK_* variables) loaded by path."""
    spec = importlib.util.spec_from_file_location("_bik_env", "python/bik/_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cuda_aot():
    """python/bik/runtime/cuda_aot.py loaded by path: the build environment has no torch."""
    spec = importlib.util.spec_from_file_location("_bik_cuda_aot",
                                                  "python/bik/runtime/cuda_aot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithCuda(build_py):
    """Ship csrc/cuda as bik/_cuda_src (the JIT compiles it at first use) and csrc/native (with
    csrc/cpu/c_abi.h) as bik/_native_src (bik.runtime.native_ext compiles it at first use); with
    BIK_BUILD_CUDA=1 also build fatbins for sm_80 and sm_90a into bik/_cuda_bin (nvcc, via
    ninja when present). An editable install reads csrc/cuda in place and gets its fatbins in
    python/bik/_cuda_bin. Without the variable nothing CUDA is built, and no nvcc is needed."""

    def run(self):
        super().run()
        editable = getattr(self, "editable_mode", False)
        root = Path("python/bik") if editable else Path(self.build_lib) / "bik"
        if not editable:  # a reused build/ dir must not ship stale sources or fatbins
            dst = root / "_cuda_src"
            shutil.rmtree(dst, ignore_errors=True)
            shutil.rmtree(root / "_cuda_bin", ignore_errors=True)
            dst.mkdir(parents=True)
            for src in _cuda_aot().source_files(Path("csrc/cuda")):
                shutil.copy2(src, dst / src.name)
            # bik.enable()'s dispatcher kernels, compiled against torch at first use
            native = root / "_native_src"
            shutil.rmtree(native, ignore_errors=True)
            native.mkdir(parents=True)
            for src in (*sorted(Path("csrc/native").glob("*.[ch]*")), Path("csrc/cpu/c_abi.h")):
                shutil.copy2(src, native / src.name)
        if _env().flag("BIK_BUILD_CUDA"):
            aot = _cuda_aot()
            # configs.py imports torch, which the build has not: its tile literal is read as is.
            defines = aot.read_literal(Path("python/bik/configs.py"), "CUDA_DEFINES")
            manifest = aot.build_fatbins(Path("csrc/cuda"), root / "_cuda_bin", defines=defines)
            print(f"bik: built CUDA fatbins {sorted(manifest['files'])} for {manifest['archs']}")


# BIK_BUILD_CPU_EXT=0: install without building the extension. The vLLM venv (Makefile) uses the
# one `make venv` built in place (python/bik, same Python ABI): its editable install would
# otherwise rebuild it into the same path while the main venv's tests have it loaded.
_BUILD_CPU_EXT = _env().flag("BIK_BUILD_CPU_EXT", True)

setup(ext_modules=[cpu_ext] if _BUILD_CPU_EXT else [],
      cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPyWithCuda})

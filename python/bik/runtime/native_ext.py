"""Builds and loads bik's dispatcher kernels (csrc/native, ``torch.ops.bik_native``).

Unlike ``bik._cpu_kernels`` (no torch headers, built at install time), these kernels register
at torch's dispatcher, so they are compiled against the torch this process runs: at first use,
with the C++ compiler torch's own extensions use, into ``$BIK_NATIVE_CACHE`` or
``~/.cache/bik/native``, keyed by the sources, the torch version, the Python ABI, the flags and
the compiler, not by where the venv or the clone lives (:func:`key_material`). About 25 s once;
``python -c "import bik.runtime.native_ext as a; a.build()"`` builds ahead of time (``make
venv`` does). A tmp file + ``os.replace`` makes concurrent builders safe. The library is also a
Python extension module (:func:`module`): the direct route calls its functions without the
dispatcher.

It never raises at import; :func:`load` returns False (and :func:`unavailable_reason` says why)
when there is no compiler or the build fails, and callers then keep their Python route.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

__all__ = ["available", "build", "cache_dir", "key_material", "library_path", "load", "module",
           "source_hash", "unavailable_reason"]

_PKG = Path(__file__).resolve().parents[1]
_BUILD_TIMEOUT_S = 600
_errors: list[str] = []


def _sources() -> tuple[Path, Path]:
    """(the .cpp, the directory holding c_abi.h): ``bik/_native_src`` in an installed wheel,
    ``<repo>/csrc`` in a checkout or an editable install."""
    shipped = _PKG / "_native_src"
    if (shipped / "native_cpu.cpp").is_file():
        return shipped / "native_cpu.cpp", shipped
    csrc = _PKG.parents[1] / "csrc"
    return csrc / "native" / "native_cpu.cpp", csrc / "cpu"


def cache_dir() -> Path:
    return Path(os.environ.get("BIK_NATIVE_CACHE") or Path.home() / ".cache" / "bik" / "native")


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _command(cxx: str, out: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    source, include = _sources()
    torch_lib = Path(torch.__file__).parent / "lib"
    # A Python extension module too (the direct route's functions): Python's headers, torch's
    # pybind11 type casters (libtorch_python), the module name its PyInit_ carries.
    # -ffp-contract=off: the kernels' float expressions round each operation, as torch's
    # elementwise ops do (rope.h, native_cpu.cpp's silu), never fused into an FMA.
    return [cxx, "-O2", "-std=c++20", "-fPIC", "-shared", "-w", "-ffp-contract=off",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=bik_native",
            *(f"-I{p}" for p in cpp_extension.include_paths()),
            f"-I{sysconfig.get_paths()['include']}", f"-I{include}",
            str(source), "-o", str(out), f"-L{torch_lib}", "-lc10", "-ltorch_cpu",
            "-ltorch_python", f"-Wl,-rpath,{torch_lib}"]


def source_hash() -> str:
    """Hash of the kernels' sources (bik.fingerprint covers them)."""
    source, include = _sources()
    h = hashlib.sha256()
    for path in (source, *sorted(source.parent.glob("*.h")), include / "c_abi.h"):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def key_material() -> str:
    """What a build is keyed by: the sources' hash, the torch version and the compile command
    with torch's and the sources' directories written as placeholders, so another clone or venv
    with the same sources and torch meets the same build (make venv and make venv-vllm build
    once between them). The ``-rpath`` to a venv's torch/lib a build carries is not needed: the
    library loads after torch, whose libc10 / libtorch_cpu the loader finds by soname."""
    import torch

    source, include = _sources()
    command = " ".join(_command(_compiler() or "c++", Path("out")))
    for place, name in ((Path(torch.__file__).parent, "<torch>"), (source.parent, "<source>"),
                        (include, "<include>")):
        command = command.replace(str(place), name)
    return (f"{source_hash()} {torch.__version__} {sysconfig.get_config_var('EXT_SUFFIX')} "
            f"{command}")


def library_path() -> Path:
    """Where the build for this torch and these sources lives (it may not exist yet)."""
    h = hashlib.sha256(key_material().encode())
    return cache_dir() / f"bik_native-{h.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the kernels unless this build exists; return its path. RuntimeError (with the
    compiler's output) when it fails."""
    path = library_path()
    if path.is_file():
        return path
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(_command(cxx, Path(tmp)), capture_output=True, text=True, check=False,
                              timeout=_BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed (exit {done.returncode}):\n"
                               f"{(done.stderr or done.stdout)[-4000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def load() -> bool:
    """Build (if needed) and load the kernels into this process; True when
    ``torch.ops.bik_native`` is there. Never raises: a failure is kept for
    :func:`unavailable_reason`."""
    import torch

    try:
        path = build()
        torch.ops.load_library(str(path))
        # The same library, imported as a module (its functions: the direct route's entry).
        spec = importlib.util.spec_from_file_location("bik_native", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - no compiler, a failed build, a bad .so
        _errors.append(f"{type(exc).__name__}: {exc}")
        return False
    global _module
    _module = module
    return True


_module = None


def module():
    """The loaded kernels as a Python module (``matmul``, ``bmm``: bik_native::matmul / bmm's
    kernels without the dispatcher), or None before :func:`load` has loaded them."""
    return _module


def available() -> bool:
    """True when the kernels are loaded (or :func:`load` can load them)."""
    return load()


def unavailable_reason() -> str:
    """Why :func:`load` failed ("" when it did not, or was not called)."""
    return _errors[-1] if _errors else ""


"""Build, cache, load and launch bik's CUDA C++ kernels (csrc/cuda) through cuda-python.

Layers: ``csrc/cuda/*.cu`` hold torch-free ``extern "C" __global__`` kernels (raw pointers,
strides, sizes) over header-only device code; this module turns a source name into a loaded
kernel; ``bik/ops/<op>/cuda.py`` launchers check inputs and call :func:`launch`.

* :func:`compile_source` compiles ``<name>.cu`` with NVRTC (cuda.core ``Program``) to a cubin:
  ``-std=c++17``, no FMA contraction (``fma=False``), include dirs = the source dir, CCCL's and
  the CUDA runtime headers' (when found). NVRTC has no -Werror, so a log with a warning raises.
* :func:`get_kernel` JIT-compiles at first use for the device's arch (sm_90 → ``sm_90a``), keyed
  by (hash of every csrc/cuda file, arch, options, NVRTC version); cubins are cached in memory
  and on disk (``$BIK_CUDA_CACHE`` or ``~/.cache/bik/cuda``; tmp file + ``os.replace``, so
  concurrent processes are safe). A fatbin shipped in the package (``bik/_cuda_bin``, built by
  ``BIK_BUILD_CUDA=1 pip install .``) is preferred when its manifest's source hash matches.
* Each kernel is declared once, by the launcher module that runs it (``KERNELS`` in
  ``bik/ops/<op>/cuda.py``): a :class:`KernelDecl` per ``extern "C"`` name giving its
  ``<source>.cu`` and its parameters' names and kinds (:data:`PTR`, :data:`I32`, :data:`I64`,
  :data:`F32`). :func:`launch_kernel` packs the arguments from that declaration (tensors or
  None become pointers; ints and floats take the declared width) and refuses a wrong count or
  kind naming the kernel and the parameter; the tests read the same declarations (the host
  build of the kernels, and the check that each one matches its C signature).
* :func:`launch` runs on torch's current stream (CUDA-graph capturable). Arguments are explicit:
  tensors (or None) become pointers; ints and floats must be wrapped with :func:`i32`,
  :func:`i64`, :func:`f32` (cuda.core would pass a bare Python int as 8 bytes).

Importing this module needs neither cuda-python nor a GPU; :func:`available` says whether
kernels can run and :func:`unavailable_reason` why not.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from bik.runtime.cuda_aot import MANIFEST, source_files, source_hash

__all__ = ["F32", "I32", "I64", "PTR", "KernelDecl", "available", "cache_dir", "cached_cubin",
           "compile_source", "compiler_available", "compiler_unavailable_reason", "declare",
           "device_target", "f32", "get_kernel", "i32", "i64", "include_dirs", "launch",
           "launch_kernel", "nvrtc_version", "pack", "source_dir", "sources", "sources_hash",
           "unavailable_reason"]

_PKG = Path(__file__).resolve().parents[1]  # .../bik
_JIT_FORMAT = "1"  # bump when the way a cubin is produced changes without a source change
_DEFAULT_SMEM = 48 * 1024


# ---- explicit scalar arguments ---------------------------------------------------------------

def i32(x) -> np.int32:
    """A kernel ``int`` argument (range-checked)."""
    if not -(2**31) <= int(x) < 2**31:
        raise OverflowError(f"bik: {x} does not fit a kernel int32 argument")
    return np.int32(x)


def i64(x) -> np.int64:
    """A kernel ``long long`` argument."""
    return np.int64(x)


def f32(x) -> np.float32:
    """A kernel ``float`` argument (rounded to fp32 here, once)."""
    return np.float32(x)


# ---- kernel declarations -------------------------------------------------------------------

PTR, I32, I64, F32 = "ptr", "i32", "i64", "f32"  # a pointer, int / int32, long long, float
_KIND_NAMES = {PTR: "a pointer (tensor or None)", I32: "an int32", I64: "an int64",
               F32: "a float32"}


class KernelDecl(NamedTuple):
    """One ``extern "C"`` kernel: the file that defines it (``csrc/cuda/<source>.cu``) and its
    parameters in order, as (name, kind) pairs with kind one of PTR, I32, I64, F32."""

    source: str
    params: tuple[tuple[str, str], ...]

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(kind for _, kind in self.params)


def declare(source: str, names, params) -> dict[str, KernelDecl]:
    """{name: KernelDecl(source, params)} for kernels that share one parameter list (the
    instances of one template per dtype). ``params``: (name, kind) pairs."""
    params = tuple((str(p), k) for p, k in params)
    bad = [p for p, k in params if k not in _KIND_NAMES]
    if bad:
        raise ValueError(f"bik: {source}.cu: parameters {bad} have no kernel argument kind")
    return {name: KernelDecl(source, params) for name in names}


def pack(name: str, decl: KernelDecl, args) -> tuple:
    """``args`` as the values :func:`launch` passes for kernel ``name`` declared as ``decl``:
    tensors and None stay (pointers), Python ints and floats become the declared width. A wrong
    count, a tensor for a scalar, a float for an int or a numpy scalar of another width raises
    TypeError naming the kernel and the parameter."""
    if len(args) != len(decl.params):
        raise TypeError(f"bik: kernel {name} ({decl.source}.cu) takes {len(decl.params)} "
                        f"arguments ({', '.join(p for p, _ in decl.params)}), got {len(args)}")
    out = []
    for i, ((param, kind), value) in enumerate(zip(decl.params, args)):
        ok = {PTR: value is None or isinstance(value, torch.Tensor),
              I32: isinstance(value, (int, np.int32)) and not isinstance(value, bool),
              I64: isinstance(value, (int, np.int64)) and not isinstance(value, bool),
              F32: isinstance(value, (int, float, np.float32)) and not isinstance(value, bool)}
        if not ok[kind]:
            raise TypeError(f"bik: kernel {name} ({decl.source}.cu): argument {i} ({param}) is "
                            f"{_KIND_NAMES[kind]}, got {type(value).__name__}")
        out.append(value if kind == PTR else {I32: i32, I64: i64, F32: f32}[kind](value))
    return tuple(out)


def launch_kernel(kernels: dict, name: str, grid: tuple, block: tuple, shared_bytes: int, *args,
                  device: torch.device, options=()) -> None:
    """Launch the kernel ``name`` of the declarations ``kernels`` ({name: KernelDecl}) with
    ``args`` packed by :func:`pack`: the one way a launcher runs a kernel."""
    decl = kernels.get(name)
    if decl is None:
        raise ValueError(f"bik: kernel {name} is not declared (declared: {sorted(kernels)})")
    values = pack(name, decl, args)
    kernel = get_kernel(decl.source, name, device, options=options)
    launch(kernel, grid, block, shared_bytes, *values, device=device)


# ---- sources ---------------------------------------------------------------------------------

def source_dir() -> Path:
    """The directory holding the .cu/.cuh sources at run time: ``bik/_cuda_src`` in an
    installed wheel, ``<repo>/csrc/cuda`` in a checkout or an editable install."""
    shipped = _PKG / "_cuda_src"
    if shipped.is_dir() and any(shipped.glob("*.cu")):
        return shipped
    return _PKG.parents[1] / "csrc" / "cuda"


def _aot_dir() -> Path:
    return _PKG / "_cuda_bin"


@functools.cache
def _sources_hash() -> str:
    return source_hash(source_dir())


# ---- cuda-python / NVRTC ---------------------------------------------------------------------

def _core():
    """cuda.core's namespace (1.x: ``cuda.core``; older releases: ``cuda.core.experimental``)."""
    try:
        from cuda import core

        if hasattr(core, "Program"):
            return core
    except ImportError:
        pass
    import cuda.core.experimental as core  # type: ignore[no-redef]

    return core


@functools.cache
def _compiler_error() -> str | None:
    try:
        _core()
    except Exception as exc:  # noqa: BLE001
        return (f"cuda-python is not installed ({type(exc).__name__}: {exc}); install bik's "
                f"[cuda] extra (cuda-python, nvidia-cuda-nvrtc, nvidia-cuda-cccl)")
    try:
        nvrtc_version()
    except Exception as exc:  # noqa: BLE001
        return (f"NVRTC cannot be loaded ({type(exc).__name__}: {exc}); install "
                f"nvidia-cuda-nvrtc matching cuda-python's major version")
    return None


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library cuda-python loads."""
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if int(err) != 0:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return int(major), int(minor)


def compiler_available() -> bool:
    """True when NVRTC can compile (no GPU needed)."""
    return _compiler_error() is None


def compiler_unavailable_reason() -> str:
    return _compiler_error() or ""


@functools.cache
def _runtime_error() -> str | None:
    err = _compiler_error()
    if err is not None:
        return err
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch (torch.cuda.is_available() is False)"
    try:
        from cuda.bindings import driver

        (res,) = driver.cuInit(0)
        if int(res) != 0:
            return f"the CUDA driver did not initialise (cuInit: {res})"
    except Exception as exc:  # noqa: BLE001
        return f"the CUDA driver cannot be loaded ({type(exc).__name__}: {exc})"
    return None


def available() -> bool:
    """True when bik's CUDA kernels can be built and run here (cuda-python, NVRTC, a GPU)."""
    return _runtime_error() is None


def unavailable_reason() -> str:
    """Why the CUDA backend cannot run ("" when it can)."""
    return _runtime_error() or ""


def include_dirs() -> tuple[str, ...]:
    """Header search path for NVRTC: the sources, then CCCL (``<cuda/std/...>``) and the CUDA
    runtime headers (``cuda_bf16.h``...) where cuda.pathfinder or CUDA_HOME finds them."""
    return (str(source_dir()), *_toolkit_include_dirs())


@functools.cache
def _toolkit_include_dirs() -> tuple[str, ...]:
    dirs = []
    for lib in ("cccl", "cudart"):
        try:
            from cuda import pathfinder

            found = pathfinder.find_nvidia_header_directory(lib)
        except Exception:  # noqa: BLE001 - optional
            found = None
        if found is None and lib == "cudart":
            for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                         "/usr/local/cuda"):
                if home and (Path(home) / "include" / "cuda_runtime.h").exists():
                    found = str(Path(home) / "include")
                    break
        if found and str(found) not in dirs:
            dirs.append(str(found))
    return tuple(dirs)


def _split_options(options) -> dict:
    """``options``: macro definitions ("NAME", "NAME=VALUE" or "-DNAME=VALUE") and
    ``--maxrregcount=N``; anything else is rejected (cuda.core takes typed options)."""
    macros, extra = [], {}
    for opt in options:
        if opt.startswith("--maxrregcount="):
            extra["max_register_count"] = int(opt.split("=", 1)[1])
            continue
        body = opt.removeprefix("-D")
        if not body or body.startswith("-"):
            raise ValueError(f"bik: unsupported CUDA compile option {opt!r}")
        name, _, value = body.partition("=")
        macros.append((name, value) if value else name)
    if macros:
        extra["define_macro"] = macros
    return extra


def compile_source(name: str, arch: str, *, options=()) -> bytes:
    """NVRTC-compile ``csrc/cuda/<name>.cu`` to a cubin for ``arch`` ("sm_80", "sm_90a", ...).

    Raises RuntimeError with NVRTC's log on an error or on any warning (warnings are errors).
    """
    err = _compiler_error()
    if err is not None:
        raise RuntimeError(f"bik: cannot compile {name}.cu: {err}")
    core = _core()
    path = source_dir() / f"{name}.cu"
    opts = core.ProgramOptions(name=f"{name}.cu", arch=arch, std="c++17", fma=False,
                               include_path=list(include_dirs()), **_split_options(options))
    log = io.StringIO()
    try:
        obj = core.Program(path.read_text(), "c++", opts).compile("cubin", logs=log)
    except Exception as exc:
        raise RuntimeError(f"bik: NVRTC failed on {name}.cu for {arch}:\n{exc}") from exc
    text = log.getvalue().replace("\x00", "").strip()
    if "warning" in text.lower():
        raise RuntimeError(f"bik: NVRTC warnings (treated as errors) in {name}.cu for {arch}:\n"
                           f"{text}")
    return bytes(obj.code)


# ---- cache -----------------------------------------------------------------------------------

def cache_dir() -> Path:
    return Path(os.environ.get("BIK_CUDA_CACHE") or Path.home() / ".cache" / "bik" / "cuda")


@functools.cache
def _toolkit_identity() -> tuple:
    """The toolkit headers as the cache key sees them: where they sit inside this environment
    and the versions of the nvidia-* packages that ship them, not where the environment lives
    (a fresh venv with the same packages meets the cubins an earlier one compiled)."""
    from importlib import metadata

    dirs = tuple(d.replace(sys.prefix, "<venv>") for d in _toolkit_include_dirs())
    versions = sorted((dist.metadata["Name"] or "", dist.version)
                      for dist in metadata.distributions()
                      if (dist.metadata["Name"] or "").lower().startswith("nvidia-"))
    return dirs, tuple(versions)


def _cache_key(name: str, arch: str, options) -> str:
    payload = repr((_JIT_FORMAT, _sources_hash(), name, arch, tuple(options), nvrtc_version(),
                    _toolkit_identity()))
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_cubin(name: str, arch: str, *, options=()) -> bytes:
    """The cubin of ``name`` for ``arch`` from the disk cache, compiling (and storing) on a
    miss. An unwritable cache directory only costs a recompile next time."""
    path = cache_dir() / f"{name}-{arch}-{_cache_key(name, arch, options)}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    cubin = compile_source(name, arch, options=options)
    try:
        _atomic_write(path, cubin)
    except OSError:
        pass
    return cubin


@functools.cache
def _aot_manifest() -> dict | None:
    try:
        import json

        manifest = json.loads((_aot_dir() / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if manifest.get("source_hash") == _sources_hash() else None


def device_target(capability: tuple[int, int]) -> str:
    """The NVRTC arch for a device: sm_90 gets ``sm_90a`` (its arch-specific instructions)."""
    major, minor = capability
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def _aot_options(name: str) -> tuple[str, ...] | None:
    """The options ``<name>.fatbin`` was built with (None: no usable manifest). A fatbin built
    with other -D macros than the launcher asks for is not used: the JIT builds the right one."""
    manifest = _aot_manifest()
    if manifest is None:
        return None
    return tuple(manifest.get("options", {}).get(name, ()))


def _aot_covers(capability: tuple[int, int]) -> bool:
    manifest = _aot_manifest()
    if manifest is None:
        return False
    archs = set(manifest.get("archs", ()))
    return capability == (9, 0) and "sm_90a" in archs or capability[0] == 8 and "sm_80" in archs


# ---- loading and launching -------------------------------------------------------------------

_lock = threading.Lock()
_modules: dict = {}
_kernels: dict = {}
_smem_set: set = set()
_streams: dict = {}


def _module(name: str, capability: tuple[int, int], options):
    key = (name, capability, tuple(options))
    with _lock:
        mod = _modules.get(key)
        if mod is not None:
            return mod
    core = _core()
    fatbin = _aot_dir() / f"{name}.fatbin"
    if (_aot_options(name) == tuple(options) and _aot_covers(capability) and fatbin.exists()
            and hasattr(core.ObjectCode, "from_fatbin")):
        mod = core.ObjectCode.from_fatbin(fatbin.read_bytes())
    else:
        mod = core.ObjectCode.from_cubin(cached_cubin(name, device_target(capability),
                                                      options=options))
    with _lock:
        return _modules.setdefault(key, mod)


def get_kernel(name: str, kernel: str, device: torch.device, *, options=()):
    """The ``extern "C"`` kernel ``kernel`` of ``csrc/cuda/<name>.cu``, loaded for ``device``
    (built at first use; see the module docstring for the cache and the AOT fatbins)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"bik: CUDA kernels need a cuda device, got {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (name, kernel, index, tuple(options))
    found = _kernels.get(key)
    if found is not None:
        return found
    err = _runtime_error()
    if err is not None:
        raise RuntimeError(f"bik: CUDA kernels unavailable: {err}")
    torch.cuda.init()
    _core().Device(index).set_current()  # the primary context torch uses
    capability = torch.cuda.get_device_capability(index)
    loaded = _module(name, capability, options).get_kernel(kernel)
    with _lock:
        return _kernels.setdefault(key, loaded)


def _stream(device_index: int):
    handle = torch.cuda.current_stream(device_index).cuda_stream
    stream = _streams.get(handle)
    if stream is None:
        core = _core()
        if handle == 0 and hasattr(core, "LEGACY_DEFAULT_STREAM"):
            made = core.LEGACY_DEFAULT_STREAM
        else:
            made = core.Stream.from_handle(handle)
        stream = _streams.setdefault(handle, made)
    return stream


def _allow_dynamic_smem(kernel, nbytes: int, device_index: int) -> None:
    key = (id(kernel), device_index, nbytes)
    if key in _smem_set:
        return
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    handle = kernel.handle
    if isinstance(handle, driver.CUkernel):
        (res,) = driver.cuKernelSetAttribute(attr, nbytes, handle, device_index)
    else:
        (res,) = driver.cuFuncSetAttribute(handle, attr, nbytes)
    if int(res) != 0:
        raise RuntimeError(f"bik: cannot allow {nbytes} B of dynamic shared memory: {res}")
    _smem_set.add(key)


_SCALARS = (np.int32, np.int64, np.uint32, np.uint64, np.float32, np.float64)


def _arg(value, position: int):
    if isinstance(value, torch.Tensor):
        return np.uint64(value.data_ptr())
    if value is None:
        return np.uint64(0)
    if isinstance(value, _SCALARS):
        return value
    raise TypeError(f"bik: kernel argument {position} is {type(value).__name__}; pass tensors, "
                    f"None, or scalars wrapped with cuda_jit.i32 / i64 / f32")


def launch(kernel, grid: tuple, block: tuple, shared_bytes: int, *args,
           device: torch.device | None = None) -> None:
    """Launch ``kernel`` on torch's current stream of ``device`` (default: the current device).

    ``args``: tensors (passed as their data_ptr), None (a null pointer) or numpy scalars from
    :func:`i32`, :func:`i64`, :func:`f32`. Nothing here synchronises, so a launch inside
    ``torch.cuda.graph`` is captured like any kernel on that stream.
    """
    current = torch.cuda.current_device()
    index = current if device is None or device.index is None else device.index
    if index != current:  # make that device's (primary) context current for the launch
        with torch.cuda.device(index):
            return launch(kernel, grid, block, shared_bytes, *args, device=device)
    if shared_bytes > _DEFAULT_SMEM:
        _allow_dynamic_smem(kernel, shared_bytes, index)
    core = _core()
    config = core.LaunchConfig(grid=tuple(grid), block=tuple(block), shmem_size=shared_bytes)
    core.launch(_stream(index), config, kernel, *(_arg(a, i) for i, a in enumerate(args)))
    return None


def sources() -> list[Path]:
    """The CUDA source files (for fingerprints and compile checks)."""
    return source_files(source_dir())


def sources_hash() -> str:
    return _sources_hash()

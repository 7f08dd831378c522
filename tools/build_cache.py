"""A disk cache for the build products the tests and the compile tools make again and again:
the g++ builds of tests/cuda/cuda_host, nvcc's cubins / PTX / ptxas reports, ptxas's spill
report of a Triton kernel's PTX. (NVRTC cubins use the library's own cache,
``bik.runtime.cuda_jit.cached_cubin``.)

An entry is named by a hash of everything that decides its bytes — the tool's version, the
full command line and the content of every input file — so an edited source, another flag or
another compiler is a miss, never a stale hit. Entries live in ``$BIK_BUILD_CACHE``, else
``$BIK_CACHE_DIR/build``, else ``~/.cache/bik/build``; ``BIK_BUILD_CACHE=off`` builds into a
fresh temporary directory every time. Delete the directory to rebuild everything.

Concurrent builders (pytest-xdist workers, the compile fixtures' thread pools) are safe and
build an entry once: the builder holds an exclusive ``flock`` on ``<entry>.lock`` while it checks
and builds, and writes into a temporary name renamed into place (``os.replace``), so a reader
never sees a partial file and a crashed builder leaves no entry.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from functools import cache
from pathlib import Path

__all__ = ["REPO", "cache_root", "cached_bytes", "cached_file", "digest", "enabled",
           "files_digest", "locked", "portable", "tool_version"]


@cache
def _scratch() -> Path:
    path = Path(tempfile.mkdtemp(prefix="bik-build-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def enabled() -> bool:
    """False when ``BIK_BUILD_CACHE`` is off (every build then runs)."""
    return os.environ.get("BIK_BUILD_CACHE", "").lower() not in ("0", "off", "no", "false")


def cache_root() -> Path:
    """Where entries live (a process-private temporary directory when caching is off)."""
    env = os.environ.get("BIK_BUILD_CACHE")
    if not enabled():
        return _scratch()
    if env:
        return Path(env)
    return Path(os.environ.get("BIK_CACHE_DIR") or Path.home() / ".cache" / "bik") / "build"


REPO = Path(__file__).resolve().parents[1]


@cache
def _venv_packages() -> tuple:
    """The versions of the packages whose files a key may name by their place in the venv."""
    from importlib import metadata

    return tuple(sorted((dist.metadata["Name"] or "", dist.version)
                        for dist in metadata.distributions()
                        if (dist.metadata["Name"] or "").lower().startswith(("nvidia-", "triton"))))


def portable(text: str) -> str:
    """``text`` with this checkout's and this venv's locations as placeholders. A key names what
    is built, not where the clone lives: input files are hashed by content and the venv's
    packages by version, so a fresh clone meets the entries an earlier one built (Triton's PTX
    names its source files by absolute path; nvcc's command lines name the include dirs)."""
    return text.replace(sys.prefix, "<venv>").replace(str(REPO), "<repo>")  # .venv in REPO


def digest(*parts) -> str:
    """A short hex hash of ``parts`` (their ``repr``, :func:`portable`; with the venv's package
    versions where it names a file inside the venv)."""
    text = portable(repr(parts))
    if "<venv>" in text:
        text += repr(_venv_packages())
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def files_digest(paths: Iterable[Path]) -> str:
    """Hash of the names (:func:`portable`) and bytes of ``paths`` (directories: every file below
    them)."""
    h = hashlib.sha256()
    files = []
    for p in map(Path, paths):
        files += sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    for f in files:
        if "__pycache__" in f.parts:
            continue
        h.update(portable(str(f)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:24]


@cache
def tool_version(tool: str) -> str:
    """``tool --version``'s output (part of every key that runs the tool)."""
    done = subprocess.run([tool, "--version"], capture_output=True, text=True, check=False)
    return f"{tool}\n{done.stdout}{done.stderr}"


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def locked(name: str):
    """An exclusive lock named ``name`` (``<root>/<name>.lock``) across processes and threads:
    for a cache kept elsewhere (the NVRTC cubins) whose builders should not run twice."""
    with _locked(cache_root() / name):
        yield


def cached_file(name: str, key: str, build: Callable[[Path], None]) -> Path:
    """The entry ``<root>/<key>/<name>``: built by ``build(path)`` (which writes ``path``) on a
    miss, under the entry's lock, into a temporary directory renamed into place."""
    if not enabled():  # a fresh directory each time: nothing is reused
        out = Path(tempfile.mkdtemp(dir=_scratch())) / name
        build(out)
        if not out.is_file():
            raise RuntimeError(f"build of {name} wrote no file")
        return out
    entry = cache_root() / key
    out = entry / name
    if out.is_file():
        return out
    with _locked(entry):
        if out.is_file():  # another process built it while this one waited
            return out
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{key}."))
        try:
            build(tmp / name)
            if not (tmp / name).is_file():
                raise RuntimeError(f"build of {name} wrote no file")
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide the entry from other users
            shutil.rmtree(entry, ignore_errors=True)
            os.replace(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def cached_bytes(name: str, key: str, produce: Callable[[], bytes]) -> bytes:
    """``produce()``'s bytes, from the entry ``<root>/<key>/<name>`` when it exists."""
    return cached_file(name, key, lambda path: path.write_bytes(produce())).read_bytes()

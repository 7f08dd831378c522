"""bik.fingerprint(): everything that decides the bits bik produces, and one digest of it.

Promise: for an unchanged fingerprint digest, every bik op returns the same bits for the same
inputs. The digest covers the kernel config tables, the source of every module of the package
that can decide a bit (all of them but the few :data:`EXCLUDED` names with their reason), the
backend each op takes on the device, the device arch and the bik / torch / triton versions.
Pin it in RL and evaluation runs: when it changes, re-baseline.

``variants`` reports each backend's code path in this process (the CPU's SIMD path) outside the
digest: the CPU contract gives every path the same bits, so a trainer on an AVX-512 machine and
an engine on an AVX2 one compare equal digests, as their bits are. The CPU choices that
change bits, whether the CPU has FMA and AMX, are in the digest as two fields: which
sequences bf16 products run (``versions["cpu_bf16"]``: ``"amx+dot"`` where AMX tiles serve
the 2-D products, ``"dot"`` for the bf16 dot sequence alone, ``"widen"`` for the fp32 one),
and whether the fp32 sequence fuses its multiply-add (``versions["cpu_fp32"]``; x86 CPUs with
FMA whose start-up self-tests passed take it). Machines that differ there compare different
digests (``BIK_CPU_BF16=dot`` on an AMX machine matches an AVX-512 one without AMX;
``BIK_CPU_BF16=widen`` and ``BIK_CPU_FP32=mul-add`` match one without FMA).
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

import torch

from bik._arch import device_arch
from bik.configs import config_table
from bik.ops._registry import BACKENDS, TABLE, backend_variant, resolve_backend

__all__ = ["EXCLUDED", "OPS", "Fingerprint", "excluded_sources", "fingerprint",
           "numeric_sources", "source_hash"]

# Every op of the (op, backend) table that takes a backend: the one it resolves to is hashed.
OPS = tuple(op for op, row in TABLE.items() if row.backends)

_PKG = Path(__file__).resolve().parent

# Every .py file of the package is hashed unless it is named here: a new module is covered the
# day it is written (mode/, dvr/, distributed/, integrations/ and models/ all decide bits of
# what their users get back). A file is left out only when no result a user keeps can depend
# on it; the reason says why. Patterns are globs relative to the package root.
EXCLUDED = {
    "__main__.py": "runs the command line (cli/)",
    "cli/**/*.py": "the `bik` command: prints, benches and demos; the numbers it shows come "
                   "from the hashed modules",
    "testing/**/*.py": "the invariance harness, its suites and its batch-dependent controls: "
                       "it judges bits and returns none a user's run keeps",
    "ops/*/reference.py": "each op's contract written literally in torch, imported by the "
                          "tests only (tests/test_house_rules.py)",
    "fingerprint.py": "this module: it describes the bits and decides none",
}
# The C++ sources are covered by the hash the extension was compiled with (setup.py), so
# installed wheels are covered too; the CUDA C++ sources (csrc/cuda, shipped as bik/_cuda_src)
# and the dispatcher kernels (csrc/native) by their own hashes.


def _package_files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*.py") if "__pycache__" not in p.parts}


def excluded_sources(root: Path = _PKG) -> list[Path]:
    """The package's .py files that :data:`EXCLUDED` leaves out of the hash."""
    return sorted({p for pattern in EXCLUDED for p in root.glob(pattern)} & _package_files(root))


def numeric_sources(root: Path = _PKG) -> list[Path]:
    """The files hashed: every .py file under ``root`` (the package) but the excluded ones."""
    return sorted(_package_files(root) - set(excluded_sources(root)))


def source_hash(root: Path = _PKG) -> str:
    """Hash of the Python sources under ``root``, each under its path relative to ``root``:
    moving a file changes it, though no bit changes."""
    h = hashlib.sha256()
    for path in numeric_sources(root):
        data = path.read_bytes()
        # path and length first: no file's end can pass for the next file's start
        h.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


class Fingerprint(NamedTuple):
    digest: str
    arch: str
    backends: dict
    config_hash: str
    source_hash: str
    versions: dict
    variants: dict  # backend -> its code path here (the CPU's SIMD path); not in the digest

    def as_dict(self) -> dict:
        return self._asdict()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def _all_sources_hash() -> str:
    """The Python sources and the compiled C++ sources, as one hash."""
    from bik.runtime import native_ext, cpu_ext, cuda_jit

    h = hashlib.sha256(source_hash().encode())
    h.update(str(cpu_ext.source_hash()).encode())
    h.update(cuda_jit.sources_hash().encode())  # csrc/cuda, as the JIT sees them
    h.update(native_ext.source_hash().encode())  # bik.enable()'s C++ kernels (csrc/native)
    return h.hexdigest()[:16]


def _backend_or_error(op: str, device: torch.device) -> str:
    try:
        return resolve_backend(op, None, device)
    except Exception as exc:  # noqa: BLE001 - report, do not raise: this is a diagnostic
        return f"unavailable ({exc})"


def fingerprint(device: torch.device | str | None = None) -> Fingerprint:
    """Describe what decides bik's bits on ``device`` (default: cuda if available, else cpu)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"bik.fingerprint: device must be cpu or cuda, got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"bik.fingerprint: {device} is not available here (torch "
                           f"{torch.__version__}, CUDA build: {torch.version.cuda})")
    arch = device_arch(device)
    backends = {op: _backend_or_error(op, device) for op in OPS}
    config_hash = hashlib.sha256(
        json.dumps(config_table(), sort_keys=True).encode()
    ).hexdigest()[:16]
    from bik.runtime import cpu_ext

    versions = {"bik": _version("bik"), "torch": torch.__version__, "triton": _version("triton"),
                "cpu_contract": cpu_ext.contract_version(),
                # bf16 products: "dot" or "widen" (the fp32 sequence): other bits, so hashed
                "cpu_bf16": cpu_ext.bf16_contract(),
                # the other products: "fma" or "mul-add" (contract.h's two fp32 sequences)
                "cpu_fp32": cpu_ext.fp32_contract()}
    sources = _all_sources_hash()
    payload = json.dumps([arch, backends, config_hash, sources, versions], sort_keys=True)
    return Fingerprint(
        digest=hashlib.sha256(payload.encode()).hexdigest()[:16],
        arch=arch,
        backends=backends,
        config_hash=config_hash,
        source_hash=sources,
        versions=versions,
        variants={b: v for b in BACKENDS if (v := backend_variant(b)) is not None},
    )

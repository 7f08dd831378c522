"""bik.fingerprint(): everything that decides the bits bik produces, and one digest of it.

Promise: for an unchanged fingerprint digest, every bik op returns the same bits for the same
inputs. The digest covers the kernel config tables, the source of every kernel and config
file, the backend each op takes on the device, the device arch and the bik / torch / triton
versions. Pin it in RL and evaluation runs: when it changes, re-baseline.
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
from bik.ops._registry import TABLE, resolve_backend

__all__ = ["OPS", "Fingerprint", "fingerprint"]

# Every op of the (op, backend) table that takes a backend: the one it resolves to is hashed.
OPS = tuple(op for op, row in TABLE.items() if row.backends)

_PKG = Path(__file__).resolve().parent
# Everything whose content can decide numerics: configs, backend choice, the ops layer (upcasts,
# bias and residual rounding) and every kernel launcher. The C++ sources are covered by the
# hash the extension was compiled with (setup.py), so installed wheels are covered too; the CUDA
# C++ sources (csrc/cuda, shipped as bik/_cuda_src) by their own hash.
_NUMERIC_GLOBS = ("configs.py", "_arch.py", "_dtypes.py", "ops/*.py", "ops/*/*.py",
                  "runtime/*.py")


def numeric_sources() -> list[Path]:
    """The files hashed; an op's reference.py (the contract for tests) runs no kernel."""
    return sorted({p for pattern in _NUMERIC_GLOBS for p in _PKG.glob(pattern)
                   if p.name != "reference.py"})


class Fingerprint(NamedTuple):
    digest: str
    arch: str
    backends: dict
    config_hash: str
    source_hash: str
    versions: dict

    def as_dict(self) -> dict:
        return self._asdict()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def _source_hash() -> str:
    from bik.runtime import cpu_ext

    h = hashlib.sha256()
    for path in numeric_sources():
        h.update(path.relative_to(_PKG).as_posix().encode())
        h.update(path.read_bytes())
    h.update(str(cpu_ext.source_hash()).encode())
    from bik.runtime import cuda_jit  # the CUDA C++ sources (csrc/cuda), as the JIT sees them

    h.update(cuda_jit.sources_hash().encode())
    from bik.runtime import aten_ext  # bik.enable()'s C++ kernels (csrc/aten)

    h.update(aten_ext.source_hash().encode())
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
                "cpu_contract": cpu_ext.contract_version()}
    payload = json.dumps([arch, backends, config_hash, _source_hash(), versions], sort_keys=True)
    return Fingerprint(
        digest=hashlib.sha256(payload.encode()).hexdigest()[:16],
        arch=arch,
        backends=backends,
        config_hash=config_hash,
        source_hash=_source_hash(),
        versions=versions,
    )

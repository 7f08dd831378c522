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

from bik._backend import device_arch, resolve_backend
from bik.configs import config_table

__all__ = ["Fingerprint", "fingerprint", "OPS"]

OPS = ("matmul", "bmm", "rms_norm", "fused_add_rms_norm")

_PKG = Path(__file__).resolve().parent
# Files whose content decides numerics. The C++ sources are hashed when present (a source
# checkout); an installed wheel is covered by the extension's CONTRACT_VERSION instead.
_NUMERIC_SOURCES = ("configs.py", "kernels/triton_matmul.py", "kernels/triton_rms_norm.py",
                    "kernels/cpu.py")
_CSRC = _PKG.parent.parent / "csrc" / "cpu"


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
    h = hashlib.sha256()
    files = [_PKG / rel for rel in _NUMERIC_SOURCES]
    if _CSRC.is_dir():
        files += sorted(p for p in _CSRC.iterdir() if p.suffix in (".h", ".cpp"))
    for path in files:
        if path.exists():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _backend_or_error(op: str, device: torch.device) -> str:
    try:
        return resolve_backend(f"bik.{op}", None, device)
    except Exception as exc:  # noqa: BLE001 - report, do not raise: this is a diagnostic
        return f"unavailable ({exc})"


def fingerprint(device: torch.device | str | None = None) -> Fingerprint:
    """Describe what decides bik's bits on ``device`` (default: cuda if available, else cpu)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    arch = device_arch(device)
    backends = {op: _backend_or_error(op, device) for op in OPS}
    config_hash = hashlib.sha256(
        json.dumps(config_table(), sort_keys=True).encode()
    ).hexdigest()[:16]
    from bik.kernels import cpu

    versions = {"bik": _version("bik"), "torch": torch.__version__, "triton": _version("triton"),
                "cpu_contract": cpu.contract_version()}
    payload = json.dumps([arch, backends, config_hash, _source_hash(), versions], sort_keys=True)
    return Fingerprint(
        digest=hashlib.sha256(payload.encode()).hexdigest()[:16],
        arch=arch,
        backends=backends,
        config_hash=config_hash,
        source_hash=_source_hash(),
        versions=versions,
    )

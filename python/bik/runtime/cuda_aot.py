"""Ahead-of-time build of bik's CUDA C++ kernels (csrc/cuda/*.cu) into fatbins with nvcc.

Standard library only: setup.py loads this file by path (``BIK_BUILD_CUDA=1 pip install .``) in
a build environment that has no torch, and :mod:`bik.runtime.cuda_jit` imports it for
:func:`source_hash`, so the JIT cache and the shipped fatbins agree on what "the same sources"
means.

Each ``<name>.cu`` becomes ``<name>.fatbin`` holding SASS for sm_80 (which also runs on sm_86 /
sm_89) and sm_90a, plus compute_80 PTX; ``manifest.json`` records the source hash, archs, flags
and the nvcc version. The JIT prefers a fatbin only when the manifest's source hash equals the
hash of the sources it would compile. The build is driven by ninja when it is on PATH (parallel,
incremental), otherwise by one nvcc subprocess per file.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["AOT_ARCHS", "NVCC_FLAGS", "SOURCE_SUFFIXES", "build_fatbins", "define_options",
           "nvcc_version", "read_literal", "source_files", "source_hash"]

SOURCE_SUFFIXES = (".cu", ".cuh", ".h")
AOT_ARCHS = ("sm_80", "sm_90a")
# The numerics contract forbids contraction of a*b+c into FMA (--fmad=false); the kernels use
# __fmul_rn/__fadd_rn where the order matters anyway. Warnings are errors.
NVCC_FLAGS = ("-std=c++17", "--fmad=false", "-O3", "-Werror", "all-warnings")
MANIFEST = "manifest.json"


def source_files(src_dir: Path) -> list[Path]:
    """Every file of the CUDA sources (kernels and headers), sorted by name."""
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        return []
    return sorted(p for p in src_dir.iterdir() if p.is_file() and p.suffix in SOURCE_SUFFIXES)


def source_hash(src_dir: Path) -> str:
    """sha256 over (name, bytes) of every CUDA source file: any edit changes it."""
    h = hashlib.sha256()
    for path in source_files(src_dir):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def nvcc_version(nvcc: str = "nvcc") -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def _gencode(archs) -> list[str]:
    flags = []
    for arch in archs:
        num = arch.removeprefix("sm_")
        code = f"[sm_{num},compute_{num}]" if arch == "sm_80" else f"sm_{num}"
        flags += ["-gencode", f"arch=compute_{num},code={code}"]
    return flags


def read_literal(path: Path, name: str):
    """The value of the module-level assignment ``name = <literal>`` in the Python file ``path``,
    without running it (setup.py reads bik.configs.CUDA_DEFINES this way: no torch at build)."""
    for node in ast.parse(Path(path).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"bik: no literal assignment to {name} in {path}")


def define_options(defines: dict) -> tuple[str, ...]:
    """{NAME: value} -> ("-DNAME=value", ...) in name order (the JIT's option spelling)."""
    return tuple(f"-D{k}={v}" for k, v in sorted(defines.items()))


def _nvcc_command(nvcc: str, src: Path, out: Path, src_dir: Path, archs,
                  options: tuple[str, ...]) -> list[str]:
    return [nvcc, "-fatbin", *NVCC_FLAGS, *options, *_gencode(archs), "-I", str(src_dir),
            str(src), "-o", str(out)]


def _ninja() -> str | None:
    exe = shutil.which("ninja")
    if exe:
        return exe
    try:  # the `ninja` PyPI package puts its binary here
        import ninja  # type: ignore[import-not-found]

        path = Path(ninja.BIN_DIR) / "ninja"
        return str(path) if path.exists() else None
    except Exception:  # noqa: BLE001 - no ninja: fall back to subprocess
        return None


def _build_with_ninja(ninja: str, commands: dict[Path, list[str]], deps: list[Path],
                      out_dir: Path) -> None:
    def q(s: str) -> str:
        return s.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")

    lines = ["ninja_required_version = 1.3", "rule nvcc", "  command = $cmd",
             "  description = nvcc $out", ""]
    for out, cmd in commands.items():
        implicit = " ".join(q(str(d)) for d in deps)
        lines.append(f"build {q(str(out))}: nvcc {q(cmd[-3])} | {implicit}")
        lines.append("  cmd = " + " ".join(c.replace("$", "$$") for c in cmd))
    (out_dir / "build.ninja").write_text("\n".join(lines) + "\n")
    subprocess.run([ninja, "-C", str(out_dir)], check=True)
    (out_dir / "build.ninja").unlink()
    ninja_log = out_dir / ".ninja_log"
    if ninja_log.exists():
        ninja_log.unlink()


def build_fatbins(src_dir: Path, out_dir: Path, *, defines: dict | None = None,
                  archs=AOT_ARCHS, nvcc: str = "nvcc", use_ninja: bool | None = None) -> dict:
    """Compile every ``src_dir/*.cu`` into ``out_dir/<name>.fatbin``, ``<name>.cu`` with the -D
    macros ``defines[name]`` ({NAME: value}; bik.configs.CUDA_DEFINES); write and return the
    manifest. Raises CalledProcessError (with nvcc's message on stderr) if a file fails."""
    src_dir, out_dir = Path(src_dir).resolve(), Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    kernels = [p for p in source_files(src_dir) if p.suffix == ".cu"]
    options = {p.stem: define_options((defines or {}).get(p.stem, {})) for p in kernels}
    commands = {out_dir / f"{p.stem}.fatbin": _nvcc_command(nvcc, p, out_dir / f"{p.stem}.fatbin",
                                                            src_dir, archs, options[p.stem])
                for p in kernels}
    ninja = _ninja() if use_ninja in (None, True) else None
    if use_ninja and ninja is None:
        raise RuntimeError("bik: use_ninja=True but no ninja binary was found")
    if ninja and commands:
        _build_with_ninja(ninja, commands, source_files(src_dir), out_dir)
    else:
        for cmd in commands.values():
            subprocess.run(cmd, check=True)
    manifest = {
        "source_hash": source_hash(src_dir),
        "archs": list(archs),
        "flags": list(NVCC_FLAGS),
        "options": {name: list(opts) for name, opts in options.items()},
        "nvcc": nvcc_version(nvcc),
        "files": {out.name: hashlib.sha256(out.read_bytes()).hexdigest() for out in commands},
    }
    tmp = out_dir / f".{MANIFEST}.{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out_dir / MANIFEST)
    return manifest

"""Build script: the fixed-order CPU kernels (csrc/cpu) as an optional pybind11 extension.

The extension includes no torch headers, so it is tied to the Python ABI only, never to a
torch build. If no C++ compiler is present the build is skipped: bik still imports, the
Triton backend still runs, and backend="cpu" raises a clear error (see bik.kernels.cpu).
"""

import hashlib
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

CPU_SOURCES = sorted(Path("csrc/cpu").glob("*.[ch]*"))


def _source_hash() -> str:
    """Baked into the extension so bik.fingerprint() covers the C++ kernels of any install."""
    h = hashlib.sha256()
    for path in CPU_SOURCES:
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


class OptionalBuildExt(build_ext):
    """Keep installing when the compiler is missing or fails; the CPU backend reports it."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any toolchain failure
            print(f"bik: CPU extension not built ({exc}); backend='cpu' will be unavailable")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"bik: CPU extension not built ({exc}); backend='cpu' will be unavailable")


cpu_ext = Pybind11Extension(
    "bik._cpu_kernels",
    sources=["csrc/cpu/bindings.cpp"],
    depends=[str(p) for p in CPU_SOURCES],
    define_macros=[("BIK_CPU_SOURCE_HASH", f'"{_source_hash()}"')],
    include_dirs=["csrc/cpu"],
    cxx_std=17,
    # -ffp-contract=off: every a*b+c stays a rounded multiply then a rounded add, in every
    # code path (vector body, tails, any ISA clone), which is what makes the bits fixed.
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
)

setup(ext_modules=[cpu_ext], cmdclass={"build_ext": OptionalBuildExt})

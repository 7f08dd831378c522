"""Build script: the fixed-order CPU kernels (csrc/cpu) as an optional pybind11 extension.

The extension includes no torch headers, so it is tied to the Python ABI only, never to a
torch build. If no C++ compiler is present the build is skipped: bik still imports, the
Triton backend still runs, and backend="cpu" raises a clear error (see bik.kernels.cpu).
"""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup


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
    depends=["csrc/cpu/contract.h", "csrc/cpu/kernels_isa.h"],
    include_dirs=["csrc/cpu"],
    cxx_std=17,
    # -ffp-contract=off: every a*b+c stays a rounded multiply then a rounded add, in every
    # code path (vector body, tails, any ISA clone), which is what makes the bits fixed.
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
)

setup(ext_modules=[cpu_ext], cmdclass={"build_ext": OptionalBuildExt})

"""Loads the fixed-order fp32 CPU kernels (the ``bik._cpu_kernels`` extension).

The numerics contract (csrc/cpu/contract.h) fixes, per output element, the exact sequence of
rounded fp32 operations, so each row's bits depend only on that row's inputs: the same whatever
the batch size M, the row's position, the thread count or the CPU's SIMD width. Each op's
launcher lives in its slice (``bik/ops/<op>/cpu.py``); this module knows no op.

It never raises at import; callers check ``available()`` or call ``require()``.
"""

from __future__ import annotations

try:
    from bik import _cpu_kernels as _ext

    _IMPORT_ERROR: str | None = None
except Exception as exc:  # noqa: BLE001 - missing .so, ABI mismatch, anything
    _ext = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = ["available", "contract_version", "isa", "require", "source_hash",
           "unavailable_reason"]


def available() -> bool:
    """True when the compiled CPU extension ``bik._cpu_kernels`` imported."""
    return _ext is not None


def unavailable_reason() -> str:
    """Why the CPU backend is unavailable ("" when it is available)."""
    if _ext is not None:
        return ""
    return (
        "bik's CPU kernels (extension bik._cpu_kernels) are not built or failed to load "
        f"({_IMPORT_ERROR}). They are compiled at install time and need a C++17 compiler "
        "(GCC or Clang): install one, then reinstall bik (e.g. `pip install --force-reinstall "
        "--no-deps .`, or `python setup.py build_ext --inplace` in a checkout)."
    )


def require():
    """The extension module; RuntimeError (with :func:`unavailable_reason`) when it is absent."""
    if _ext is None:
        raise RuntimeError(unavailable_reason())
    return _ext


def isa(want: str = "auto") -> str:
    """Name of the SIMD path ``want`` resolves to ("avx512", "avx2" or "generic")."""
    return require().isa(want)


def contract_version() -> int | None:
    """The numerics-contract revision compiled into the extension (None when unavailable)."""
    return None if _ext is None else int(_ext.CONTRACT_VERSION)


def source_hash() -> str | None:
    """Hash of csrc/cpu as compiled into the extension (None when unavailable)."""
    return None if _ext is None else str(_ext.SOURCE_HASH)

"""Loads the fixed-order fp32 CPU kernels (the ``bik._cpu_kernels`` extension).

The numerics contract (csrc/cpu/contract.h) fixes, per output element, the exact sequence of
rounded fp32 operations, so each row's bits depend only on that row's inputs: the same whatever
the batch size M, the row's position, the thread count or the CPU's SIMD width. Each op's
launcher lives in its slice (``bik/ops/<op>/cpu.py``); this module knows no op.

It never raises at import; callers check ``available()`` or call ``require()``.
"""

from __future__ import annotations

import os
import warnings
from functools import cache

try:
    from bik import _cpu_kernels as _ext

    _IMPORT_ERROR: str | None = None
except Exception as exc:  # noqa: BLE001 - missing .so, ABI mismatch, anything
    _ext = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = ["BF16_ENV", "FP32_ENV", "available", "bf16_contract", "bf16_dot", "bf16_dot_refusal",
           "bf16_bmm_kernel", "bf16_kernel",
           "contract_version", "fp32_contract", "fp32_fma", "fp32_fma_refusal", "isa",
           "require", "source_hash", "unavailable_reason"]

# bf16 products' sequences (bf16_kernel): "auto" (default) puts 2-D products on contract.h's
# AMX sequence wherever its kernel passes and bmm on the dot sequence, else everything on the
# dot sequence, else the fp32 one; "amx" the same, warning where AMX is refused; "dot" the dot
# sequence everywhere; "widen" the fp32 sequence (to match a machine without FMA).
BF16_ENV = "BIK_CPU_BF16"
# "mul-add" keeps products off the bf16 dot path on the fp32 sequence that rounds the multiply
# and the add apart (the CUDA SIMT fp32 kernel's, and a CPU's without FMA); "auto" (default)
# takes the fma sequence wherever its kernel passes.
FP32_ENV = "BIK_CPU_FP32"


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


def bf16_dot_refusal(kernel: str = "fma") -> str:
    """Why a bf16 kernel cannot run here: ``kernel`` "fma" (the dot sequence's, which bik runs
    for it) or "vdpbf16ps" (the same sequence), or "amx" (contract.h's AMX sequence). The CPU
    lacks the instructions (or the OS the AMX tile state), or the start-up self-test found the
    kernel disagreeing with its sequence's transcription on a fixed probe. "" when it can run;
    the extension's absence is its own reason."""
    if _ext is None:
        return unavailable_reason()
    return str(_ext.bf16_dot_refusal(kernel))


@cache
def bf16_kernel() -> str | None:
    """The kernel this process's CPU bf16 2-D products (a and b both bf16: bik.matmul /
    linear, PackedWeight, aten mm / addmm under bik.enable(), the distributed layers, the vLLM
    plugin's linears) run: "amx" (contract.h's AMX sequence) or "fma" (its dot sequence), None
    when they widen to the fp32 sequence. bmm products never take AMX (:func:`bf16_bmm_kernel`).

    Decided once, at first use, from ``BIK_CPU_BF16`` and the kernels that pass here: "auto"
    (the default) takes AMX where its kernel and the dot sequence's both pass their self-tests,
    else the dot sequence; "amx" the same, warning where AMX is refused; "dot" the dot
    sequence; "widen" the fp32 sequence. Every route asks this one function, so they agree."""
    want = os.environ.get(BF16_ENV, "auto").strip().lower() or "auto"
    if want not in ("auto", "amx", "dot", "widen"):
        raise ValueError(f"bik: {BF16_ENV}={want!r}; expected 'auto', 'amx', 'dot' or 'widen'")
    dot = want != "widen" and bf16_dot_refusal() == ""
    if want in ("auto", "amx") and dot and bf16_dot_refusal("amx") == "":
        return "amx"
    if want == "amx":
        warnings.warn(f"bik: {BF16_ENV}=amx, but the AMX kernel cannot run here "
                      f"({bf16_dot_refusal('amx') or bf16_dot_refusal()}); bf16 products take "
                      f"the dot sequence (bik.fingerprint() says which)", RuntimeWarning,
                      stacklevel=2)
    return "fma" if dot else None


def bf16_bmm_kernel() -> str | None:
    """The kernel this process's CPU bf16 bmm products run: "fma" (the dot sequence) whenever
    bf16 products take pair words at all, else None (widened). Never AMX: a bmm is where K is
    a sequence (attention's p @ v), and AMX's 32-term blocks are cut from the split's start, so
    left padding (exact zeros at K's start) would move its bits; the dot sequence's one chain
    from +0 adds them exactly (contract.h)."""
    return "fma" if bf16_kernel() is not None else None


def bf16_dot() -> bool:
    """Whether this process's CPU bf16 products take pair words (the AMX or the dot sequence,
    :func:`bf16_kernel`), rather than widening to the fp32 sequence."""
    return bf16_kernel() is not None


def bf16_contract() -> str | None:
    """The sequences this process's CPU bf16 products run: "amx+dot" (2-D products on
    contract.h's AMX sequence, bmm on its dot sequence), "dot" (both on the dot sequence) or
    "widen" (upcast to fp32, the fp32 sequence). It decides bits, so bik.fingerprint() hashes
    it. None when the extension is unavailable."""
    if _ext is None:
        return None
    return {"amx": "amx+dot", "fma": "dot", None: "widen"}[bf16_kernel()]


def fp32_fma_refusal() -> str:
    """Why contract.h's fp32 fma sequence cannot run here: the CPU has no FMA for the widest
    ISA's vectors, or the start-up self-test found the kernel disagreeing with the
    transcription (fma_reference.h) on a fixed probe. "" when it can run; the extension's
    absence is its own reason."""
    if _ext is None:
        return unavailable_reason()
    return str(_ext.fp32_fma_refusal())


@cache
def fp32_fma() -> bool:
    """Whether this process's CPU products off the bf16 dot path (fp32, fp16, bf16 widened)
    run the fp32 fma sequence (else the mul-add one). Decided once, at first use: the kernel
    must pass here and ``BIK_CPU_FP32`` must not be "mul-add". Every route asks this one
    function, so they agree."""
    want = os.environ.get(FP32_ENV, "auto").strip().lower() or "auto"
    if want not in ("auto", "mul-add"):
        raise ValueError(f"bik: {FP32_ENV}={want!r}; expected 'auto' or 'mul-add'")
    return want == "auto" and fp32_fma_refusal() == ""


def fp32_contract() -> str | None:
    """The fp32 sequence this process's CPU products run: "fma" or "mul-add" (contract.h). It
    decides bits, so bik.fingerprint() hashes it. None when the extension is unavailable."""
    if _ext is None:
        return None
    return "fma" if fp32_fma() else "mul-add"

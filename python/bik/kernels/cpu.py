"""Thin launcher for the fixed-order fp32 CPU kernels (the ``bik._cpu_kernels`` extension).

The numerics contract (csrc/cpu/contract.h) fixes, per output element, the exact sequence of
rounded fp32 operations, so each row's bits depend only on that row's inputs: the same whatever
the batch size M, the row's position, the thread count or the CPU's SIMD width.

This module imports only torch and the extension and never raises at import; callers check
``available()``. Validation beyond cheap asserts belongs to the ops layer.
"""

from __future__ import annotations

import torch

try:
    from bik import _cpu_kernels as _ext

    _IMPORT_ERROR: str | None = None
except Exception as exc:  # noqa: BLE001 - missing .so, ABI mismatch, anything
    _ext = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = ["attention_f32", "available", "contract_version", "isa", "matmul_f32", "mean_f32",
           "rms_norm_f32", "softmax_f32", "unavailable_reason"]


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


def _require():
    if _ext is None:
        raise RuntimeError(unavailable_reason())
    return _ext


def isa(want: str = "auto") -> str:
    """Name of the SIMD path ``want`` resolves to ("avx512", "avx2" or "generic")."""
    return _require().isa(want)


def matmul_f32(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    *,
    num_threads: int | None = None,
    isa: str = "auto",
    block_k: int = 0,
    block_n: int = 0,
) -> None:
    """out[M, N] = a[M, K] @ b[K, N] (+ bias[N]), fp32, in fixed k-ascending order.

    a, b: fp32 CPU tensors with any strides (transposed, sliced, expanded); ``b`` may be a
    ``weight.t()`` view and is read without a copy. bias: fp32 [N] contiguous or None.
    out: fp32 [M, N] contiguous, preallocated, not overlapping the inputs. Each out[m, n] is
    the contract's sequence (acc = acc + a[m,k]*b[k,n], k ascending, no FMA, then + bias[n]),
    so its bits do not depend on M, on m, on num_threads (default torch.get_num_threads()),
    on ``isa`` (SIMD path) or on ``block_k``/``block_n`` (cache blocking, 0 = auto): those
    three knobs change speed only and exist for tests and tuning.
    """
    ext = _require()
    M, K = a.shape
    K2, N = b.shape
    assert K == K2 and out.shape == (M, N) and out.is_contiguous()
    assert a.dtype == b.dtype == out.dtype == torch.float32
    if bias is not None:
        assert bias.shape == (N,) and bias.dtype == torch.float32 and bias.is_contiguous()
    if M == 0 or N == 0:
        return
    ext.matmul_f32(
        a.data_ptr(), a.stride(0), a.stride(1),
        b.data_ptr(), b.stride(0), b.stride(1),
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(), N, M, N, K,
        torch.get_num_threads() if num_threads is None else num_threads,
        isa, block_k, block_n,
    )  # fmt: skip


def rms_norm_f32(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    *,
    num_threads: int | None = None,
    isa: str = "auto",
) -> None:
    """out[M, H] = rms_norm(x[M, H]) * weight[H], fp32, with the contract's 16-lane sum.

    x: fp32 with unit stride along H (any row stride); weight: fp32 [H] contiguous;
    out: fp32 [M, H] contiguous. eps is rounded to fp32. Rows are independent, so each row's
    bits do not depend on M, its position, num_threads or ``isa``.
    """
    ext = _require()
    M, H = x.shape
    assert out.shape == (M, H) and out.is_contiguous() and weight.shape == (H,)
    assert x.dtype == weight.dtype == out.dtype == torch.float32 and weight.is_contiguous()
    if M == 0 or H == 0:
        return
    assert x.stride(1) == 1 or H == 1
    ext.rms_norm_f32(
        x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), H, M, H, float(eps),
        torch.get_num_threads() if num_threads is None else num_threads,
        isa,
    )  # fmt: skip


def softmax_f32(x: torch.Tensor, out: torch.Tensor, *, log: bool = False,
                num_threads: int | None = None) -> None:
    """out[M, N] = softmax (log_softmax when ``log``) of each row of x[M, N], fp32.

    x: fp32 with unit stride along N (any row stride); out: fp32 [M, N] contiguous. The row sum
    of exp(x - max) is the contract's 16-lane sum, so each row's bits do not depend on M, its
    position or num_threads.
    """
    ext = _require()
    M, N = x.shape
    assert out.shape == (M, N) and out.is_contiguous()
    assert x.dtype == out.dtype == torch.float32
    if M == 0 or N == 0:
        return
    assert x.stride(1) == 1 or N == 1
    ext.softmax_f32(x.data_ptr(), x.stride(0), out.data_ptr(), N, M, N, bool(log),
                    torch.get_num_threads() if num_threads is None else num_threads)


def mean_f32(x: torch.Tensor, out: torch.Tensor, *, num_threads: int | None = None) -> None:
    """out[M] = mean of each row of x[M, N] (N >= 1), fp32, with the contract's 16-lane sum.

    x: fp32 with unit stride along N (any row stride); out: fp32 [M] contiguous.
    """
    ext = _require()
    M, N = x.shape
    assert out.shape == (M,) and out.is_contiguous() and N >= 1
    assert x.dtype == out.dtype == torch.float32
    if M == 0:
        return
    assert x.stride(1) == 1 or N == 1
    ext.mean_f32(x.data_ptr(), x.stride(0), out.data_ptr(), M, N,
                 torch.get_num_threads() if num_threads is None else num_threads)


def attention_f32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_offsets: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    split: int,
    scale_log2e: float,
    causal: bool,
    num_threads: int | None = None,
    isa: str = "auto",
) -> None:
    """Fixed-split attention (csrc/cpu/attention.h), the bits of ``attention_cpu_reference``.

    q: fp32 [total_q, Hq, D], unit stride along D. k, v: fp32, unit stride along D, the same
    strides; key t of sequence b, KV head h starts at element
    ``key_offsets[cu_k[b] + t] + h * k.stride(-2)`` of each (so pages may lie anywhere).
    key_offsets [cu_k[B]], cu_q [B + 1], cu_k [B + 1]: int64 contiguous, already checked
    (cu_k[b+1] - cu_k[b] >= the q_len of b, every offset inside k). out: fp32 [total_q, Hq, D]
    and lse: fp32 [total_q, Hq], contiguous. ``scale_log2e`` is rounded to fp32. num_threads
    (default torch.get_num_threads()) and ``isa`` change speed only.
    """
    ext = _require()
    if not hasattr(ext, "attention_f32"):
        raise RuntimeError("bik's CPU extension predates attention_f32; rebuild it (`python "
                           "setup.py build_ext --inplace` in a checkout, or reinstall bik)")
    total_q, hq, d = q.shape
    hkv = k.shape[-2]
    assert q.dtype == k.dtype == v.dtype == out.dtype == lse.dtype == torch.float32
    assert k.stride() == v.stride() and (d <= 1 or (q.stride(2) == 1 and k.stride(-1) == 1))
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (total_q, hq)
    assert lse.is_contiguous() and hq % hkv == 0 and cu_q.shape == cu_k.shape
    for t in (key_offsets, cu_q, cu_k):
        assert t.dtype == torch.int64 and t.is_contiguous()
    ext.attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(),
        key_offsets.data_ptr(), k.stride(-2), cu_q.data_ptr(), cu_k.data_ptr(),
        cu_k.shape[0] - 1, hq, hkv, d, split, float(scale_log2e), bool(causal),
        out.data_ptr(), lse.data_ptr(),
        torch.get_num_threads() if num_threads is None else num_threads, isa,
    )  # fmt: skip


def contract_version() -> int | None:
    """The numerics-contract revision compiled into the extension (None when unavailable)."""
    return None if _ext is None else int(_ext.CONTRACT_VERSION)


def unary_f32(fn: str, x: torch.Tensor) -> torch.Tensor:
    """exp2 or log2 of x elementwise via exp2f/log2f: each output a pure function of its input
    value (torch's CPU kernels may round a SIMD body and a scalar tail differently)."""
    ext = _require()
    assert x.dtype == torch.float32
    x = x.contiguous()
    out = torch.empty_like(x)
    ext.unary_f32(x.data_ptr(), out.data_ptr(), x.numel(), fn)
    return out


def source_hash() -> str | None:
    """Hash of csrc/cpu as compiled into the extension (None when unavailable)."""
    return None if _ext is None else str(_ext.SOURCE_HASH)

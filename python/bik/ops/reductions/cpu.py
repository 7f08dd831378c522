"""CPU launchers of the fixed-order fp32 softmax and mean (csrc/cpu/reductions.h) and of
log_softmax in the sampler's normaliser order (csrc/cpu/normaliser.h)."""

from __future__ import annotations

import torch

from bik.configs import sampler_chunks
from bik.ops._checks import require, require_cpu
from bik.runtime import cpu_ext


def softmax_f32(x: torch.Tensor, out: torch.Tensor, *, num_threads: int | None = None) -> None:
    """out[M, N] = softmax of each row of x[M, N], fp32.

    x: fp32 with unit stride along N (any row stride); out: fp32 [M, N] contiguous. The row sum
    of exp(x - max) is the contract's 16-lane sum, so each row's bits do not depend on M, its
    position, leading zeros (left padding) or num_threads.
    """
    ext = cpu_ext.require()
    fn = "bik.ops.reductions.cpu.softmax_f32"
    M, N = _check_rows(fn, x, out)
    if M == 0 or N == 0:
        return
    ext.softmax_f32(x.data_ptr(), x.stride(0), out.data_ptr(), N, M, N,
                    torch.get_num_threads() if num_threads is None else num_threads)


def log_softmax_f32(x: torch.Tensor, out: torch.Tensor, *, num_threads: int | None = None,
                    isa: str | None = None) -> None:
    """out[M, N] = log_softmax of each row of x[M, N], fp32, with the sampler's normaliser
    (bik_exp, vocab_sum's groups and chunks for N, bik_log): a token's entry is the logprob
    bik.sample reports for it at T = 1 with no filter, bit for bit.

    x: fp32 with unit stride along N (any row stride); out: fp32 [M, N] contiguous.
    ``num_threads`` and ``isa`` ("auto", "avx512", "avx2", "generic") change speed only.
    """
    ext = cpu_ext.require()
    fn = "bik.ops.reductions.cpu.log_softmax_f32"
    M, N = _check_rows(fn, x, out)
    if M == 0 or N == 0:
        return
    groups, chunk = sampler_chunks(N)
    ext.log_softmax_f32(x.data_ptr(), x.stride(0), out.data_ptr(), N, M, N, groups, chunk,
                        torch.get_num_threads() if num_threads is None else num_threads,
                        isa or "auto")


def _check_rows(fn: str, x: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:
    require_cpu(fn, x=x, out=out)
    require(x.dim() == 2, fn, "x must be 2-D")
    M, N = x.shape
    require(out.shape == (M, N) and out.is_contiguous(), fn,
            f"x {list(x.shape)} needs a contiguous out of its shape")
    require(x.dtype == out.dtype == torch.float32, fn, "x and out must be fp32")
    require(x.stride(1) == 1 or N <= 1, fn, "x needs unit stride along N")
    return M, N


def mean_f32(x: torch.Tensor, out: torch.Tensor, *, num_threads: int | None = None) -> None:
    """out[M] = mean of each row of x[M, N] (N >= 1), fp32, with the contract's 16-lane sum.

    x: fp32 with unit stride along N (any row stride); out: fp32 [M] contiguous.
    """
    ext = cpu_ext.require()
    fn = "bik.ops.reductions.cpu.mean_f32"
    require_cpu(fn, x=x, out=out)
    require(x.dim() == 2, fn, "x must be 2-D")
    M, N = x.shape
    require(out.shape == (M,) and out.is_contiguous() and N >= 1, fn,
            f"x {list(x.shape)} (N >= 1) needs a contiguous out [{M}]")
    require(x.dtype == out.dtype == torch.float32, fn, "x and out must be fp32")
    if M == 0:
        return
    require(x.stride(1) == 1 or N == 1, fn, "x needs unit stride along N")
    ext.mean_f32(x.data_ptr(), x.stride(0), out.data_ptr(), M, N,
                 torch.get_num_threads() if num_threads is None else num_threads)


def _fp32_target(out: torch.Tensor) -> torch.Tensor:
    if out.dtype == torch.float32:
        return out
    return torch.empty(out.shape, dtype=torch.float32, device=out.device)


def _fp32_rows(x: torch.Tensor) -> torch.Tensor:
    """x upcast to fp32 (exact) with unit stride along the row: the upcast of overlapping or
    strided 16-bit rows may come back with other strides."""
    x32 = x.float()
    return x32 if x32.shape[1] <= 1 or x32.stride(1) == 1 else x32.contiguous()


def launch_softmax(x: torch.Tensor, out: torch.Tensor, *, log: bool) -> None:
    """The op's launcher on the CPU: x [M, N] with unit stride along N (upcast to fp32, exact),
    out [M, N] contiguous in the output dtype (rounded once)."""
    out32 = _fp32_target(out)
    (log_softmax_f32 if log else softmax_f32)(_fp32_rows(x), out32)
    if out32 is not out:
        out.copy_(out32)


def launch_mean(x: torch.Tensor, out: torch.Tensor) -> None:
    """The op's launcher on the CPU: x [M, N] (N >= 1) with unit stride along N, out [M]."""
    out32 = _fp32_target(out)
    mean_f32(_fp32_rows(x), out32)
    if out32 is not out:
        out.copy_(out32)

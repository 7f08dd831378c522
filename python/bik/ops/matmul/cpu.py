"""CPU launcher of the fixed-order fp32 matmul (csrc/cpu/contract.h in ``bik._cpu_kernels``)."""

from __future__ import annotations

import torch

from bik.configs import matmul_split
from bik.ops._checks import require, require_cpu
from bik.runtime import cpu_ext


def matmul_f32(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    *,
    split: int | None = None,
    num_threads: int | None = None,
    isa: str = "auto",
    block_k: int = 0,
    block_n: int = 0,
    fp32_fma: bool | None = None,
) -> None:
    """out[M, N] = a[M, K] @ b[K, N] (+ bias[N]), fp32, in fixed k-ascending order.

    a, b: fp32 CPU tensors with any strides (transposed, sliced, expanded); ``b`` may be a
    ``weight.t()`` view and is read without a copy. bias: fp32 [N] contiguous or None.
    out: fp32 [M, N] contiguous, preallocated, not overlapping the inputs. Each out[m, n] is
    the contract's sequence (per K split of ``split`` elements, default
    :func:`bik.configs.matmul_split`'s: acc = 0, acc = fma(a[m,k], b[k,n], acc) for k
    ascending, or acc = acc + a[m,k]*b[k,n] with the multiply rounded on the mul-add sequence;
    the splits folded in ascending order; then + bias[n]), so its bits do not
    depend on M, on m, on num_threads (default torch.get_num_threads()),
    on ``isa`` (SIMD path) or on ``block_k``/``block_n`` (cache blocking, 0 = auto): those
    three knobs change speed only and exist for tests and tuning. ``fp32_fma``: which of
    contract.h's two fp32 sequences (default this process's, :func:`cpu_ext.fp32_fma`).
    """
    ext = cpu_ext.require()
    fn = "bik.ops.matmul.cpu.matmul_f32"
    require_cpu(fn, a=a, b=b, bias=bias, out=out)
    require(a.dim() == 2 and b.dim() == 2, fn, "a and b must be 2-D")
    M, K = a.shape
    K2, N = b.shape
    require(K == K2 and out.shape == (M, N) and out.is_contiguous(), fn,
            f"a {list(a.shape)} @ b {list(b.shape)} needs a contiguous out [{M}, {N}], got "
            f"{list(out.shape)}")
    require(a.dtype == b.dtype == out.dtype == torch.float32, fn, "a, b and out must be fp32")
    if bias is not None:
        require(bias.shape == (N,) and bias.dtype == torch.float32 and bias.is_contiguous(), fn,
                f"bias must be a contiguous fp32 [{N}]")
    if split is None:
        split = matmul_split(torch.float32, N, K).split
    require(split > 0, fn, f"split must be > 0, got {split}")
    if M == 0 or N == 0:
        return
    ext.matmul_f32(
        a.data_ptr(), a.stride(0), a.stride(1),
        b.data_ptr(), b.stride(0), b.stride(1),
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(), N, M, N, K, split,
        torch.get_num_threads() if num_threads is None else num_threads,
        isa, block_k, block_n, False, 1, 0, 0, 0, 0, False, "fma",
        cpu_ext.fp32_fma() if fp32_fma is None else fp32_fma,
    )  # fmt: skip


def launch_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor, *, layer: tuple[int, int] | None = None,
                  split: int | None = None) -> None:
    """bik::matmul's entry (2-D products): :func:`_launch_product` on this process's bf16
    kernel for them (:func:`bik.runtime.cpu_ext.bf16_kernel`: AMX where it passes)."""
    _launch_product(a, b, bias, out, layer=layer, split=split, kernel=cpu_ext.bf16_kernel())


def launch_bmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
               out: torch.Tensor, *, layer: tuple[int, int] | None = None,
               split: int | None = None) -> None:
    """bik::bmm's entry: :func:`_launch_product` on the dot sequence's kernel for bf16
    (:func:`bik.runtime.cpu_ext.bf16_bmm_kernel` says why never AMX)."""
    _launch_product(a, b, bias, out, layer=layer, split=split,
                    kernel=cpu_ext.bf16_bmm_kernel())


def launch_grouped_matmul(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor,
                          out: torch.Tensor) -> None:
    """bik::grouped_matmul's entry: out[S, N], rows [ends[g-1], ends[g]) of a [S, K] times
    b[g] [K, N], rows past the last end zero; validated by the op (ends non-decreasing, within
    S). Each group is :func:`launch_matmul` on its rows, with the tables of (N, K) whatever
    the group's size: a row's bits are bik::matmul's."""
    require_cpu("bik.ops.matmul.cpu.launch_grouped_matmul", a=a, b=b, ends=ends, out=out)
    start = 0
    for group, end in enumerate(ends.tolist()):
        if end > start:
            launch_matmul(a[start:end].unsqueeze(0), b[group].unsqueeze(0), None,
                          out[start:end].unsqueeze(0))
        start = end
    require(start <= out.shape[0], "bik.ops.matmul.cpu.launch_grouped_matmul",
            f"ends reach row {start} of {out.shape[0]}")
    out[start:].zero_()


def _launch_product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                    out: torch.Tensor, *, layer: tuple[int, int] | None, split: int | None,
                    kernel: str | None) -> None:
    """out[B, M, N] = a[B, M, K] @ b[B, K, N] (+ bias[N]), validated by the op; the result is
    rounded once to out's dtype. ``layer``: the (N, K) of the whole layer the tables are
    looked up with (default this call's; a shard of a sharded layer passes the layer's).
    ``split``: an explicit K-split length (tests).

    bf16 a and b take pair words on ``kernel`` ("amx": contract.h's AMX sequence, "fma": its
    dot sequence) when it is not None; the kernel reads both as bf16. Otherwise
    upcasting to fp32 is exact, so the fp32 sequence of :func:`matmul_f32` is the whole
    contract: a bf16 b (a weight, usually) is read as bf16 and widened inside the kernel's
    packing, the same bits as upcasting it first without an fp32 copy on every call."""
    if split is None:
        n, k = layer or (b.shape[2], a.shape[2])
        split = matmul_split(a.dtype, n, k).split
    bias32 = None if bias is None else bias.float().contiguous()
    dot = a.dtype == b.dtype == torch.bfloat16 and kernel is not None
    if b.dtype not in _PACKED_B or a.dtype != b.dtype:
        b = b.float()  # fp16 or mixed operands: B upcast first (exact)
    # the kernel writes fp32, or bf16 rounded as .to(torch.bfloat16) rounds (no second pass);
    # a strided bf16 out gets the kernel's bf16 copied in (torch's strided fp32 -> bf16 copy
    # writes NaN as 0x7fc0, its vectorized one and the kernel 0xffff)
    same = out.dtype in (torch.float32, torch.bfloat16)
    res = out if same and out.is_contiguous() else \
        torch.empty(out.shape, dtype=out.dtype if same else torch.float32)
    # a: the rows, small next to a weight; widened first (exact) off the dot path
    _launch(a if dot else a.float(), b, bias32, res, split, kernel if dot else None)
    if res is not out:
        out.copy_(res)


_PACKED_B = {torch.float32: False, torch.bfloat16: True}  # b dtype -> the kernel's b_bf16


def _launch(a, b, bias32, out, split: int, kernel: str | None) -> None:
    """fp32 (or, with a bf16 ``kernel``, bf16) a, fp32 or bf16 out, fp32 or bf16 b, every batch
    entry in one kernel call: the kernel takes pointers and element strides per entry
    (attention's bmm is dozens of tiny products; a call, or a view, per entry cost more than
    the product)."""
    n_batch, m, k = a.shape
    n = b.shape[2]
    if m == 0 or n == 0 or n_batch == 0:
        return
    (sa0, sa1, sa2), (sb0, sb1, sb2) = a.stride(), b.stride()
    pbias = 0 if bias32 is None else bias32.data_ptr()
    cpu_ext.require().matmul_f32(
        a.data_ptr(), sa1, sa2, b.data_ptr(), sb1, sb2, pbias, out.data_ptr(), n, m, n, k, split,
        torch.get_num_threads(), "auto", 0, 0, _PACKED_B[b.dtype], n_batch, sa0, sb0, m * n,
        0, kernel is not None, kernel or "fma", cpu_ext.fp32_fma(),
        out.dtype == torch.bfloat16)

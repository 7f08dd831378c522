"""CPU attention with the fixed KV split size: the C++ kernel (csrc/cpu/attention.h).

Its spec, with the same bits, is ``attention_cpu_reference`` (bik/ops/attention/reference.py):
each split of a sequence's keys reduced from a fresh state, the splits folded in ascending
order, so a token's bits do not depend on how its prompt was chunked, on the batch, or on the
page size.
"""

from __future__ import annotations

import math

import torch

from bik.configs import CPU_ATTENTION_SPLIT
from bik.ops._checks import require, require_cpu
from bik.ops._pointwise import LOG2E
from bik.ops.attention._layout import Problem
from bik.runtime import cpu_ext


def attention_f32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_offsets: torch.Tensor,
    cu_q: torch.Tensor,
    seqlens_k: torch.Tensor,
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

    q: fp32 [total_q, Hq, D], unit stride along D. k, v: fp32 or bf16 (read in place and
    widened where the kernel packs them: the bits of widening first), one dtype, unit stride
    along D, the same strides; key t of sequence b, KV head h starts at element
    ``key_offsets[b, t] + h * k.stride(-2)`` of each (so pages may lie anywhere).
    key_offsets [B, max_seqlen_k], cu_q [B + 1], seqlens_k [B]: int64 contiguous. The kernel
    checks them before reading through them (ValueError: cu_q must start at 0, never decrease
    and end at total_q; q_len <= seqlens_k[b] <= max_seqlen_k; every used offset inside k),
    so no caller needs to read them in Python. out: fp32 [total_q, Hq, D] and lse: fp32
    [total_q, Hq], contiguous. ``scale_log2e`` is rounded to fp32. num_threads (default
    torch.get_num_threads()) and ``isa`` change speed only.
    """
    ext = cpu_ext.require()
    fn = "bik.ops.attention.cpu.attention_f32"
    require_cpu(fn, q=q, k=k, v=v, key_offsets=key_offsets, cu_q=cu_q, seqlens_k=seqlens_k,
                out=out, lse=lse)
    require(q.dim() == 3 and k.dim() >= 3 and k.shape == v.shape, fn,
            "q must be [total_q, Hq, D] and k, v of one shape [..., Hkv, D]")
    total_q, hq, d = q.shape
    hkv = k.shape[-2]
    require(q.dtype == out.dtype == lse.dtype == torch.float32 and k.dtype == v.dtype
            and k.dtype in (torch.float32, torch.bfloat16), fn,
            "q, out and lse must be fp32, k and v both fp32 or both bf16")
    require(k.stride() == v.stride() and (d <= 1 or (q.stride(2) == 1 and k.stride(-1) == 1))
            and k.shape[-1] == d, fn, "k and v need q's D, equal strides, unit stride along D")
    require(out.shape == q.shape and out.is_contiguous() and lse.shape == (total_q, hq)
            and lse.is_contiguous(), fn, "out [total_q, Hq, D] and lse [total_q, Hq], contiguous")
    require(hkv > 0 and hq % hkv == 0 and cu_q.shape == (seqlens_k.shape[0] + 1,), fn,
            "Hq % Hkv == 0 and cu_q [B + 1] for seqlens_k [B]")
    require(key_offsets.dim() == 2 and key_offsets.shape[0] == seqlens_k.shape[0], fn,
            "key_offsets must be [B, max_seqlen_k]")
    for t in (key_offsets, cu_q, seqlens_k):
        require(t.dtype == torch.int64 and t.is_contiguous(), fn,
                "key_offsets, cu_q and seqlens_k must be contiguous int64")
    # Floats k's own shape reaches from its first element (not its storage's: a cache may be a
    # view of a larger pool); v has the same shape and strides.
    extent = 0 if k.numel() == 0 else 1 + sum((n - 1) * st for n, st in zip(k.shape, k.stride()))
    ext.attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), extent,
        key_offsets.data_ptr(), key_offsets.shape[1], k.stride(-2), cu_q.data_ptr(),
        seqlens_k.data_ptr(), seqlens_k.shape[0], total_q, hq, hkv, d, split,
        float(scale_log2e), bool(causal), out.data_ptr(), lse.data_ptr(),
        torch.get_num_threads() if num_threads is None else num_threads, isa,
        k.dtype == torch.bfloat16,
    )  # fmt: skip


def cpu_keys(k: torch.Tensor, v: torch.Tensor, seqlens_k: torch.Tensor, max_seqlen_k: int, *,
             table: torch.Tensor | None, base: torch.Tensor | None):
    """(k32, v32, key_offsets [B, max_seqlen_k]) for :func:`attention_cpu`, from the inputs of
    :func:`reference_keys`: key t of sequence b at element ``key_offsets[b, t]`` of k32/v32.
    Shape arithmetic only: nothing is read back from the lengths. fp32 and bf16 inputs are read
    in place (the kernel follows the offsets page by page, and widens bf16 where it packs);
    fp16 ones are gathered in one index op into fp32 [B * max_seqlen_k, Hkv, D] (exact copies;
    a slot past a sequence's length copies row 0 and is never read), reading only those rows
    of a strided cache."""
    wide = k.dtype in (torch.float32, torch.bfloat16)  # the kernel reads these in place
    n_seq, max_len = seqlens_k.shape[0], max_seqlen_k
    pos = torch.arange(max_len)
    if table is not None:  # [B, max_len]: each sequence's keys, as offsets (fp32) or rows
        block = k.shape[1]
        pages = min(-(-max_len // block), table.shape[1])
        # A page past the cache stays past it (clamped, not wrapped by the product), where the
        # kernel's offset check or the gather's index check stops it.
        page = table[:, :pages].long().clamp(-1, k.shape[0]) * (k.stride(0) if wide else block)
        within = torch.arange(block) * (k.stride(1) if wide else 1)
        at = (page[:, :, None] + within).reshape(n_seq, pages * block)[:, :max_len]
    elif wide:
        at = base.long()[:, None] + pos * k.stride(-3)
    elif k.dim() == 4:
        at = (torch.arange(n_seq) * k.shape[1])[:, None] + pos
    else:
        at = (base.long() // k.stride(0))[:, None] + pos
    at = at.contiguous()
    if wide:
        return k, v, at
    hkv, d = k.shape[-2], k.shape[-1]
    rows = torch.where(pos < seqlens_k[:, None], at, 0).reshape(-1)
    k32, v32 = _gather_rows(k, rows), _gather_rows(v, rows)
    return k32, v32, torch.arange(at.numel()).view(at.shape) * (hkv * d)


def _gather_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of t viewed as [-1, Hkv, D], widened to fp32, without copying the rest of
    t (``reshape`` would copy a strided cache view, such as vLLM's, whole on every call). A row
    outside t raises ValueError (a bad block_table entry): never a wrap to another row."""
    lead = t.shape[:-2]
    inner = math.prod(lead[1:])  # rows per index of t's first dim
    # Out of range stays out of range along dim 0 (unravel_index would wrap it).
    outer = torch.where(rows < 0, lead[0], rows // max(inner, 1))
    idx = (outer, *torch.unravel_index(rows % max(inner, 1), lead[1:])) if len(lead) > 1 \
        else (outer,)
    try:
        return t[idx].float()
    except IndexError as e:
        raise ValueError(f"a key lies outside the cache (a block_table entry out of range?): "
                         f"{e}") from None


def attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  key_offsets: torch.Tensor, cu_q: torch.Tensor, seqlens_k: torch.Tensor,
                  scale: float, causal: bool, num_threads: int | None = None):
    """The C++ kernel, with the bits of :func:`attention_cpu_reference`.

    q [total_q, Hq, D] (fp32/bf16/fp16); k, v and key_offsets from :func:`cpu_keys`; cu_q
    [B + 1] and seqlens_k [B] int tensors, checked by the kernel (ValueError). Returns
    (out [total_q, Hq, D] in q.dtype, lse [total_q, Hq] fp32, natural log). num_threads
    (default torch.get_num_threads()) changes speed only.
    """
    total_q, hq, d = q.shape
    q32 = q.float()
    if q32.stride(-1) != 1:
        q32 = q32.contiguous()
    out = torch.empty((total_q, hq, d), dtype=torch.float32)
    lse = torch.empty((total_q, hq), dtype=torch.float32)
    attention_f32(
        q32, k, v, key_offsets, cu_q.to(torch.int64).contiguous(),
        seqlens_k.to(torch.int64).contiguous(), out, lse, split=CPU_ATTENTION_SPLIT,
        scale_log2e=scale * LOG2E, causal=causal, num_threads=num_threads)
    return (out if q.dtype == torch.float32 else out.to(q.dtype)), lse


def run_attention(label: str, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's entry point on this backend (see bik/ops/attention/_layout.py)."""
    try:
        k32, v32, offsets = cpu_keys(p.k, p.v, p.seqlens_k, p.max_k_len, table=p.layout.table,
                                     base=p.layout.base)
        return attention_cpu(p.q, k32, v32, key_offsets=offsets, cu_q=p.cu_q,
                             seqlens_k=p.seqlens_k, scale=p.scale, causal=p.causal)
    except ValueError as e:  # the kernel's own checks of the lengths and pages
        raise ValueError(f"{label}: {e}") from None


def write_rows_cpu(pages: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> bool:
    """pages [P, block, Hkv, D] (a view of the caller's cache, unit stride along D, strides
    >= 0), new [tokens, Hkv, D] of its dtype, slots int64 [tokens]: row t to slot slots[t]
    where 0 <= slots[t] < P * block, in place (validated by the op). One C++ loop of row
    copies instead of torch's masked, advanced-index assignment (~60 us at decode sizes).
    False when the extension cannot (not built, an 8-byte dtype): the caller writes in torch."""
    if not cpu_ext.available() or new.element_size() not in (2, 4):
        return False
    fn = "bik.ops.attention.cpu.write_rows_cpu"
    require_cpu(fn, pages=pages, new=new, slots=slots)
    require(pages.dim() == 4 and new.dim() == 3 and new.shape[1:] == pages.shape[2:]
            and new.dtype == pages.dtype and slots.dtype == torch.int64
            and slots.shape == (new.shape[0],) and min(pages.stride(), default=0) >= 0
            and (pages.shape[-1] <= 1 or pages.stride(-1) == 1), fn,
            "pages [P, block, Hkv, D] (unit stride along D), new [tokens, Hkv, D] of its "
            "dtype and int64 slots [tokens]")
    if new.shape[-1] > 1 and new.stride(-1) != 1:
        new = new.contiguous()
    slots = slots.contiguous()
    n_pages, block, hkv, d = pages.shape
    cpu_ext.require().write_kv_rows(
        pages.data_ptr(), pages.stride(0), pages.stride(1), pages.stride(2), block,
        n_pages * block, new.data_ptr(), new.stride(0), new.stride(1), new.shape[0], hkv, d,
        new.element_size(), slots.data_ptr())
    return True

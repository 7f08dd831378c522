"""Triton attention with a fixed KV split size aligned to absolute KV positions.

One kernel serves prefill, chunked prefill, decode and verify windows. For a query row at
absolute position p, the keys 0..p (causal) are cut into splits [j*SPLIT, (j+1)*SPLIT). Each
split is reduced from a fresh (max, sum, acc) over BLOCK_N-key blocks in ascending order, and the
splits are folded in ascending j by :func:`merge_partial`, then :func:`finalize` divides. A
block or split that a row cannot see is masked to -inf, and folding it is an exact identity
(alpha = exp2(0) = 1, p = 0), so rows of a prefill tile that see fewer keys get the bits they
would get alone in decode. SPLIT, BLOCK_N, BLOCK_M and the dot shapes come from
``bik.configs.attention_config(dtype, head_dim, gqa, arch)`` — never from lengths or batch.

Two launch modes give the same bits by construction (same split partials, same fold order,
same shared functions; both compiled with ``enable_fp_fusion=False`` so no mul+add contracts
differently in one than in the other): FOLD (each program folds all splits of its tile; no
workspace; prefill-sized work) and SPLIT (one program per split writing fp32 partials, then
a merge kernel folding them in order; fills the GPU at decode-sized work).

Rows of a tile are the G query heads that share a KV head times BLOCK_T = BLOCK_M // G tokens.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from bik._arch import device_arch
from bik.configs import TRITON_ATTENTION_HEAD_DIMS, attention_config
from bik.ops.attention._layout import Problem, run_on_gpu

__all__ = ["attention_kernel", "attention_merge_kernel", "launch_attention", "run_attention"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def merge_partial(m, l, acc, m_j, l_j, acc_j):
    """Fold one split's (max, sum, acc) into the running state. Max/sums are in log2 units."""
    m_new = tl.maximum(m, m_j)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m - m_safe)
    b = tl.exp2(m_j - m_safe)
    return m_new, l * a + l_j * b, acc * a[:, None] + acc_j * b[:, None]


@triton.jit
def finalize(m, l, acc):
    """out = acc / l and the natural-log LSE; an empty row (l == 0) gives NaN, -inf."""
    out = acc / l[:, None]
    lse = (m + tl.log2(l)) * 0.6931471805599453
    return out, lse


@triton.jit
def _kv_offsets(kv_pos, kv_ok, b, table_ptr, stride_table_b, base_ptr, block_size,
                stride_page, stride_tok, PAGED: tl.constexpr):
    if PAGED:
        page = tl.load(table_ptr + b * stride_table_b + kv_pos // block_size, mask=kv_ok, other=0)
        return page.to(tl.int64) * stride_page + (kv_pos % block_size).to(tl.int64) * stride_tok
    base = tl.load(base_ptr + b)
    return base + kv_pos.to(tl.int64) * stride_tok


# Lengths and batch-sized ints are not specialised (Triton would compile 1 and multiples of 16
# separately): one compiled kernel per config serves every batch and every q_len.
@triton.jit(do_not_specialize=["block_size", "total_q", "num_heads_q"])
def attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, pacc_ptr, pml_ptr,
    cu_q_ptr, seqlens_k_ptr, table_ptr, base_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table_b,
    stride_page, stride_tok, stride_kvh,
    block_size, total_q, num_heads_q, scale_log2e,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PAGED: tl.constexpr, CAUSAL: tl.constexpr, FOLD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Axis 0 (up to 2**31 - 1 programs) takes sequences x KV heads; axes 1 and 2 (65535 max)
    # take query tiles and splits.
    b = tl.program_id(0) // HKV
    hk = tl.program_id(0) % HKV
    tile = tl.program_id(1)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if tile * BLOCK_T >= q_len:
        return
    seqlen_k = tl.load(seqlens_k_ptr + b)

    rows = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_T + rows // G
    head = hk * G + rows % G
    row_ok = (rows // G < BLOCK_T) & (tok < q_len)
    pos = seqlen_k - q_len + tok  # absolute position of each row's token
    dims = tl.arange(0, D)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)

    if CAUSAL:
        kv_end = tl.minimum(seqlen_k, seqlen_k - q_len + tl.minimum((tile + 1) * BLOCK_T, q_len))
    else:
        kv_end = seqlen_k
    n_splits = tl.cdiv(kv_end, SPLIT)
    if FOLD:
        j_lo = 0
        j_hi = n_splits
    else:
        j_lo = tl.program_id(2)
        j_hi = j_lo + 1
        if j_lo >= n_splits:
            return

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for j in range(j_lo, j_hi):
        m_j = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_j = tl.zeros((BLOCK_M,), tl.float32)
        acc_j = tl.zeros((BLOCK_M, D), tl.float32)
        lo = j * SPLIT
        hi = tl.minimum(lo + SPLIT, kv_end)
        for n0 in range(lo, hi, BLOCK_N):
            kv_pos = n0 + tl.arange(0, BLOCK_N)
            kv_ok = kv_pos < hi
            off = _kv_offsets(kv_pos, kv_ok, b, table_ptr, stride_table_b, base_ptr, block_size,
                              stride_page, stride_tok, PAGED) + hk * stride_kvh
            k = tl.load(k_ptr + off[:, None] + dims[None, :], mask=kv_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
            visible = kv_ok[None, :] & row_ok[:, None]
            if CAUSAL:
                visible = visible & (kv_pos[None, :] <= pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_j, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_j - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_j = l_j * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + off[:, None] + dims[None, :], mask=kv_ok[:, None], other=0.0)
            acc_j = acc_j * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_j = m_new
        if FOLD:
            m, l, acc = merge_partial(m, l, acc, m_j, l_j, acc_j)
        else:
            # partial layout: pml [SPLITS, 2, total_q, Hq], pacc [SPLITS, total_q, Hq, D]
            plane = total_q.to(tl.int64) * num_heads_q
            row_idx = j * plane + q_rows * num_heads_q + head
            tl.store(pml_ptr + row_idx + j * plane, m_j, mask=row_ok)
            tl.store(pml_ptr + row_idx + (j + 1) * plane, l_j, mask=row_ok)
            tl.store(pacc_ptr + row_idx[:, None] * D + dims[None, :], acc_j, mask=row_ok[:, None])

    if FOLD:
        out, lse = finalize(m, l, acc)
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse_ptr + q_rows * num_heads_q + head, lse, mask=row_ok)


@triton.jit(do_not_specialize=["total_q", "num_heads_q"])
def attention_merge_kernel(
    out_ptr, lse_ptr, pacc_ptr, pml_ptr, tok_seq_ptr, cu_q_ptr, seqlens_k_ptr,
    stride_ot, stride_oh, total_q, num_heads_q,
    G: tl.constexpr, G_P2: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Fold the SPLIT-mode partials of G heads of one token, j ascending (same functions)."""
    t = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, G_P2)
    head_ok = lane < G
    head = tl.program_id(1) * G + tl.where(head_ok, lane, 0)
    b = tl.load(tok_seq_ptr + t)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    seqlen_k = tl.load(seqlens_k_ptr + b)
    if CAUSAL:
        n_splits = tl.cdiv(seqlen_k - q_len + (t - q_start) + 1, SPLIT)
    else:
        n_splits = tl.cdiv(seqlen_k, SPLIT)
    dims = tl.arange(0, D)
    m = tl.full((G_P2,), float("-inf"), tl.float32)
    l = tl.zeros((G_P2,), tl.float32)
    acc = tl.zeros((G_P2, D), tl.float32)
    plane = total_q.to(tl.int64) * num_heads_q
    for j in range(n_splits):
        row_idx = j * plane + t * num_heads_q + head
        m_j = tl.load(pml_ptr + row_idx + j * plane, mask=head_ok, other=float("-inf"))
        l_j = tl.load(pml_ptr + row_idx + (j + 1) * plane, mask=head_ok, other=0.0)
        acc_j = tl.load(pacc_ptr + row_idx[:, None] * D + dims[None, :], mask=head_ok[:, None],
                        other=0.0)
        m, l, acc = merge_partial(m, l, acc, m_j, l_j, acc_j)
    out, lse = finalize(m, l, acc)
    tl.store(out_ptr + t * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    tl.store(lse_ptr + t * num_heads_q + head, lse, mask=head_ok)


def use_split_mode(total_q: int, num_heads_q: int, n_splits: int) -> bool:
    """Decode/verify-sized work splits the KV across programs; prefill folds in-program.
    Either choice gives the same bits; this only decides speed and workspace size."""
    return n_splits > 1 and total_q * num_heads_q * n_splits <= (1 << 20)


def launch_attention(q, k, v, out, lse, *, cu_q, seqlens_k, table, base, block_size,
                     stride_page: int, stride_tok: int, max_q_len: int, max_k_len: int,
                     scale: float, causal: bool, split_mode: bool | None = None) -> None:
    """Run the kernel(s). Key ``pos`` of sequence b (head h, dim d) lives at element offset
    ``table[b, pos // block_size] * stride_page + (pos % block_size) * stride_tok`` when paged,
    else ``base[b] + pos * stride_tok``, plus ``h * k.stride(-2) + d``; v likewise (same strides).

    ``cu_q`` int32 [B+1], ``seqlens_k`` int32 [B], ``table`` int32 [B, max_pages] or None,
    ``base`` int64 [B] when ``table`` is None. ``split_mode`` None = by work size (bits equal).
    """
    total_q, hq, d = q.shape
    hkv = k.shape[-2]
    n_seq = seqlens_k.shape[0]
    if total_q == 0 or n_seq == 0:
        return
    g = hq // hkv
    cfg = attention_config(q.dtype, d, g, device_arch(q.device))
    block_t = max(1, cfg.block_m // g)
    block_m = max(cfg.block_m, triton.next_power_of_2(g))
    n_splits = max(1, math.ceil(max_k_len / cfg.split))
    split = use_split_mode(total_q, hq, n_splits) if split_mode is None else split_mode
    paged = table is not None
    if split:
        pacc = torch.empty((n_splits, total_q, hq, d), dtype=torch.float32, device=q.device)
        pml = torch.empty((n_splits, 2, total_q, hq), dtype=torch.float32, device=q.device)
    else:
        pacc = pml = lse  # unused
    grid = (n_seq * hkv, triton.cdiv(max_q_len, block_t), n_splits if split else 1)
    dummy = seqlens_k
    attention_kernel[grid](
        q, k, v, out, lse, pacc, pml,
        cu_q, seqlens_k, table if paged else dummy, base if not paged else dummy,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        table.stride(0) if paged else 0,
        stride_page, stride_tok, k.stride(-2),
        block_size, total_q, hq, scale * LOG2E,
        HKV=hkv, G=g, D=d, BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_N=cfg.block_n,
        SPLIT=cfg.split, PAGED=paged, CAUSAL=causal, FOLD=not split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
    )
    if split:
        q_lens = cu_q[1:] - cu_q[:-1]
        tok_seq = torch.repeat_interleave(
            torch.arange(n_seq, device=q.device, dtype=torch.int32), q_lens,
            output_size=total_q)
        attention_merge_kernel[(total_q, hkv)](
            out, lse, pacc, pml, tok_seq, cu_q, seqlens_k,
            out.stride(0), out.stride(1), total_q, hq,
            G=g, G_P2=triton.next_power_of_2(g), D=d, SPLIT=cfg.split, CAUSAL=causal,
            num_warps=4, enable_fp_fusion=False,
        )


def run_attention(label: str, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's entry point on this backend (see bik/ops/attention/_layout.py)."""
    return run_on_gpu(label, "triton", TRITON_ATTENTION_HEAD_DIMS, launch_attention, p)

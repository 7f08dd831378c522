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
workspace; prefill-sized work) and SPLIT (decode-sized work: the tile's splits are spread over
programs, a few consecutive splits each, every split's partial written in fp32; the last of the
tile's programs to finish -- an atomic ticket -- reads them back and folds them in ascending
order, the merge fused into the same launch).

Rows of a tile are the G query heads that share a KV head times BLOCK_T = BLOCK_M // G tokens.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from bik._arch import device_arch
from bik.configs import TRITON_ATTENTION_HEAD_DIMS, attention_config
from bik.ops._pointwise import LOG2E
from bik.ops.attention._layout import Problem, run_on_gpu, split_workspace, splits_per_program
from bik.runtime.counters import zeroed_counters
from bik.runtime.triton_launch import launch


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
    lse = (m + tl.log2(l)) * 0.6931471805599453  # ln 2 (_pointwise.LN2): @jit reads no float global
    return out, lse


@triton.jit
def _kv_base(b, base_ptr, PAGED: tl.constexpr, BASE_MULTIPLE: tl.constexpr):
    """A contiguous cache's offset of sequence b's first key (0 when paged): loaded once per
    program, before the key loop, so the loop's loads depend on nothing loaded in it."""
    if PAGED:
        return tl.full((), 0, tl.int64)
    # int64 whatever the pointer: a paged call passes an int32 stand-in for base_ptr, and both
    # returns must have one type (Triton 3.6 types both; found by the sm_90 dry run).
    base = tl.load(base_ptr + b).to(tl.int64)
    if BASE_MULTIPLE > 1:
        # A loaded offset has no known alignment: without the host's divisor every K/V element
        # is loaded alone (head_dim 128 then spilled 1.4 KB; ptxas, sm_90).
        base = tl.multiple_of(base, BASE_MULTIPLE)
    return base


@triton.jit
def _kv_offsets(kv_pos, kv_ok, b, table_ptr, stride_table_b, kv_base, block_size,
                stride_page, stride_tok, PAGED: tl.constexpr):
    """Element offsets of keys kv_pos (their head's: ``kv_base`` holds the head offset, and
    the contiguous cache's sequence base); keys outside ``kv_ok`` read no page-table entry."""
    if PAGED:
        page = tl.load(table_ptr + b * stride_table_b + kv_pos // block_size, mask=kv_ok, other=0)
        return kv_base + page.to(tl.int64) * stride_page + \
            (kv_pos % block_size).to(tl.int64) * stride_tok
    return kv_base + kv_pos.to(tl.int64) * stride_tok


@triton.jit
def _load_partial(pml_ptr, pacc_ptr, j, q_rows, head, row_ok, dims, plane, num_heads_q,
                  D: tl.constexpr):
    """Split j's (m_j, l_j, acc_j) of the tile's rows, read past L1 (other SMs wrote them);
    rows outside ``row_ok`` read the empty state."""
    row_idx = j * plane + q_rows * num_heads_q + head
    m_j = tl.load(pml_ptr + row_idx + j * plane, mask=row_ok, other=float("-inf"),
                  cache_modifier=".cg")
    l_j = tl.load(pml_ptr + row_idx + (j + 1) * plane, mask=row_ok, other=0.0,
                  cache_modifier=".cg")
    acc_j = tl.load(pacc_ptr + row_idx[:, None] * D + dims[None, :], mask=row_ok[:, None],
                    other=0.0, cache_modifier=".cg")
    return m_j, l_j, acc_j


@triton.jit
def _fold_partials(pml_ptr, pacc_ptr, q_rows, head, row_ok, dims, n_splits, total_q,
                   num_heads_q, BLOCK_M: tl.constexpr, D: tl.constexpr):
    """SPLIT's fused merge: the tile's split partials read back and folded j ascending from
    the empty state, as FOLD folds them in registers. A split a row cannot see was stored as
    (-inf, 0, 0): folding it is an exact identity. (Loading split j + 1 before folding split j
    holds a second BLOCK_M x D tile: at head_dim 128 on sm_90 that spilled.)"""
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    plane = total_q.to(tl.int64) * num_heads_q
    for j in range(n_splits):
        m_j, l_j, acc_j = _load_partial(pml_ptr, pacc_ptr, j, q_rows, head, row_ok, dims,
                                        plane, num_heads_q, D)
        m, l, acc = merge_partial(m, l, acc, m_j, l_j, acc_j)
    return m, l, acc


# Lengths and batch-sized ints are not specialised (Triton would compile 1 and multiples of 16
# separately): one compiled kernel per config serves every batch and every q_len.
@triton.jit(do_not_specialize=["block_size", "total_q", "num_heads_q"])
def attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, pacc_ptr, pml_ptr, ticket_ptr,
    cu_q_ptr, seqlens_k_ptr, table_ptr, base_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table_b,
    stride_page, stride_tok, stride_kvh,
    block_size, total_q, num_heads_q, scale_log2e, num_bh, q_bound, k_bound,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PAGED: tl.constexpr, CAUSAL: tl.constexpr, FOLD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BASE_MULTIPLE: tl.constexpr = 1,
):
    # Axis 0 (up to 2**31 - 1 programs) takes query tiles x sequences x KV heads (a long
    # prefill with a large GQA group has more than axis 1's 65535 tiles), the tile slowest;
    # axis 2 (65535 max) takes (SPLIT) runs of consecutive splits: the tile's real splits
    # spread evenly over the launched runs (the host sized them by its bound), so a launch
    # sized by a generous bound (a captured graph) still spreads a short sequence's splits.
    tile = tl.program_id(0) // num_bh
    b = (tl.program_id(0) % num_bh) // HKV
    hk = tl.program_id(0) % HKV
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
    if (seqlen_k > k_bound) | (q_len > q_bound):
        # A length past the host bounds the launch (grid, SPLIT workspace) was sized by: a
        # caller error (BIK_DEBUG_CHECKS=1 raises it on the host). Its rows are written NaN by
        # the first split program of each tile, the last tile covering the rows past the grid;
        # nothing is computed, so no partial lands past the workspace.
        if tl.program_id(2) == 0:
            last_tile = tile == tl.num_programs(0) // num_bh - 1
            end = tl.where(last_tile, q_len, tl.minimum((tile + 1) * BLOCK_T, q_len))
            nan = tl.full((BLOCK_M, D), float("nan"), tl.float32)
            for t0 in range(tile * BLOCK_T, end, BLOCK_T):
                tok_n = t0 + rows // G
                ok_n = (rows // G < BLOCK_T) & (tok_n < end)
                rows_n = (q_start + tok_n).to(tl.int64)
                tl.store(out_ptr + rows_n[:, None] * stride_ot + head[:, None] * stride_oh
                         + dims[None, :], nan.to(out_ptr.dtype.element_ty), mask=ok_n[:, None])
                tl.store(lse_ptr + rows_n * num_heads_q + head,
                         tl.full((BLOCK_M,), float("nan"), tl.float32), mask=ok_n)
        return
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
        # Run r takes splits [r n / R, (r + 1) n / R): min(R, n) runs have work.
        runs = tl.num_programs(2)
        j_lo = (tl.program_id(2).to(tl.int64) * n_splits // runs).to(tl.int32)
        j_hi = ((tl.program_id(2).to(tl.int64) + 1) * n_splits // runs).to(tl.int32)
        # A tile without keys (only host metadata that skipped the checks gets here) is
        # finalised from the empty state by run 0 alone, as FOLD finalises it: rows of NaN,
        # never the workspace's leftovers.
        if (j_lo >= j_hi) & ((n_splits > 0) | (tl.program_id(2) > 0)):
            return

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    m_j = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_j = tl.zeros((BLOCK_M,), tl.float32)
    acc_j = tl.zeros((BLOCK_M, D), tl.float32)
    kv_base = _kv_base(b, base_ptr, PAGED, BASE_MULTIPLE) + hk * stride_kvh
    # One loop over the key blocks of splits j_lo .. j_hi - 1 (BLOCK_N divides SPLIT, so no
    # block straddles two splits): each split's (m_j, l_j, acc_j) starts empty and is folded
    # (FOLD) or stored (SPLIT) at its last block, as a loop per split would, while the next
    # blocks' loads stay in flight across the split boundary. A paged cache's page-table
    # entries are read a block ahead (``off_next``), so no K / V address waits on a load of
    # its own iteration.
    n_lo = j_lo * SPLIT
    n_hi = tl.minimum(j_hi * SPLIT, kv_end)
    off_next = _kv_offsets(n_lo + tl.arange(0, BLOCK_N), n_lo + tl.arange(0, BLOCK_N) < n_hi, b,
                           table_ptr, stride_table_b, kv_base, block_size, stride_page,
                           stride_tok, PAGED)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        j = n0 // SPLIT
        hi = tl.minimum(j * SPLIT + SPLIT, kv_end)
        kv_pos = n0 + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < hi
        off = off_next
        ahead = kv_pos + BLOCK_N
        off_next = _kv_offsets(ahead, ahead < n_hi, b, table_ptr, stride_table_b, kv_base,
                               block_size, stride_page, stride_tok, PAGED)
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
        if n0 + BLOCK_N >= hi:  # split j ends
            if FOLD:
                m, l, acc = merge_partial(m, l, acc, m_j, l_j, acc_j)
            else:
                # partial layout: pml [SPLITS, 2, total_q, Hq], pacc [SPLITS, total_q, Hq, D]
                plane = total_q.to(tl.int64) * num_heads_q
                row_idx = j * plane + q_rows * num_heads_q + head
                tl.store(pml_ptr + row_idx + j * plane, m_j, mask=row_ok)
                tl.store(pml_ptr + row_idx + (j + 1) * plane, l_j, mask=row_ok)
                tl.store(pacc_ptr + row_idx[:, None] * D + dims[None, :], acc_j,
                         mask=row_ok[:, None])
            m_j = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_j = tl.zeros((BLOCK_M,), tl.float32)
            acc_j = tl.zeros((BLOCK_M, D), tl.float32)

    last = True
    if not FOLD:
        # Every thread's partial stores, then one release / acquire ticket per program: the
        # tile's last program to arrive sees every partial, folds them, and returns the ticket
        # to zero (bik.runtime.counters: the next kernel on the stream finds it so).
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        last = ticket == tl.maximum(tl.minimum(runs, n_splits), 1) - 1
        if last:
            tl.debug_barrier()
            m, l, acc = _fold_partials(pml_ptr, pacc_ptr, q_rows, head, row_ok, dims, n_splits,
                                       total_q, num_heads_q, BLOCK_M, D)
            tl.store(ticket_ptr + tl.program_id(0), 0)
    if last:
        out, lse = finalize(m, l, acc)
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse_ptr + q_rows * num_heads_q + head, lse, mask=row_ok)


def use_split_mode(total_q: int, num_heads_q: int, n_splits: int, per_program: int) -> bool:
    """Decode/verify-sized work splits the KV across programs; prefill folds in-program, and
    so does work whose programs would each hold all of a tile's splits anyway. Either choice
    gives the same bits; this only decides speed and workspace size."""
    return n_splits > per_program and total_q * num_heads_q * n_splits <= (1 << 20)


def launch_attention(q, k, v, out, lse, *, cu_q, seqlens_k, table, base, block_size,
                     stride_page: int, stride_tok: int, max_q_len: int, max_k_len: int,
                     scale: float, causal: bool, split_mode: bool | None = None,
                     per_program: int | None = None, base_multiple: int = 1) -> None:
    """Run the kernel. Key ``pos`` of sequence b (head h, dim d) lives at element offset
    ``table[b, pos // block_size] * stride_page + (pos % block_size) * stride_tok`` when paged,
    else ``base[b] + pos * stride_tok``, plus ``h * k.stride(-2) + d``; v likewise (same strides).

    ``cu_q`` int32 [B+1], ``seqlens_k`` int32 [B], ``table`` int32 [B, max_pages] or None,
    ``base`` int64 [B] when ``table`` is None. ``split_mode`` None = by work size;
    ``per_program``: SPLIT's splits per program at the bound max_k_len, which sets the runs
    launched (grid axis 2); the kernel spreads each tile's real splits evenly over them. None =
    by work size (the bits do not depend on either). ``base_multiple``: a divisor of every
    ``base`` entry known on the host (an alignment hint for vectorised loads; 1 = none).
    """
    total_q, hq, d = q.shape
    hkv = k.shape[-2]
    n_seq = seqlens_k.shape[0]
    if total_q == 0 or n_seq == 0:
        return
    g = hq // hkv
    cfg = attention_config(q.dtype, d, g, device_arch(q.device))
    block_t = max(1, cfg.block_m // g)
    block_m = max(cfg.block_m, 1 << (g - 1).bit_length())
    n_splits = max(1, -(-max_k_len // cfg.split))
    tiles = -(-max_q_len // block_t)
    per = per_program or splits_per_program(n_seq * hkv * tiles, n_splits)
    split = use_split_mode(total_q, hq, n_splits, per) if split_mode is None else split_mode
    runs = -(-n_splits // per) if split else 1
    if n_seq * hkv * tiles >= 1 << 31 or runs > 65535:
        raise ValueError(f"bik.attention (triton): the launch needs {n_seq * hkv * tiles} "
                         f"programs on grid axis 0 (max 2**31 - 1) and {runs} on axis 2 (max "
                         f"65535) for {n_seq} sequences, max_seqlen_q={max_q_len}, "
                         f"max_seqlen_k={max_k_len}; split the call into smaller ones")
    paged = table is not None
    if split:
        pacc, pml = split_workspace(n_splits, total_q, hq, d, q.device)
        tickets = zeroed_counters(q.device, n_seq * hkv * tiles)
    else:
        pacc = pml = lse  # unused
        tickets = seqlens_k  # unused
    grid = (n_seq * hkv * tiles, 1, runs)
    dummy = seqlens_k
    launch(attention_kernel, grid,
           q, k, v, out, lse, pacc, pml, tickets,
           cu_q, seqlens_k, table if paged else dummy, base if not paged else dummy,
           q.stride(0), q.stride(1), out.stride(0), out.stride(1),
           table.stride(0) if paged else 0,
           stride_page, stride_tok, k.stride(-2),
           block_size, total_q, hq, scale * LOG2E, n_seq * hkv, max_q_len, max_k_len,
           HKV=hkv, G=g, D=d, BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_N=cfg.block_n,
           SPLIT=cfg.split, PAGED=paged, CAUSAL=causal, FOLD=not split,
           BASE_MULTIPLE=1 if paged else math.gcd(base_multiple, 16),
           DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
           num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
           )


def run_attention(label: str, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's entry point on this backend (see bik/ops/attention/_layout.py)."""
    return run_on_gpu(label, "triton", TRITON_ATTENTION_HEAD_DIMS, launch_attention, p)

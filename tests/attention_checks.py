"""attention check bodies shared by tests/attention/ and the CUDA host tests.

Each check is a function of (attn or backend, dtype, sizes, ``heads=(Hq, Hkv, D)``,
``device=``), so one body runs on every target: the CPU backend, the Triton interpreter, a GPU
(Llama heads, long sequences) and the CUDA C++ kernels compiled for the CPU (backend="cuda" with
CPU tensors). Defaults: 4 q heads, 2 kv heads, D = 64, CPU tensors.

* ``check_schedules``: one prefill vs chunked prefill vs verify windows vs sampled decode steps.
* ``check_page_sizes``, ``check_neighbours``: page sizes; random neighbours at every batch row.
* ``check_layouts_agree``: paged, contiguous-cache and varlen calls give the same bits.
* ``check_accuracy``: max error vs fp64 within a multiple of torch SDPA's in the same dtype.
"""

from __future__ import annotations

import math

import bik
import torch
from bik.testing.attention import (
    Request,
    chunking_report,
    make_request,
    neighbours_report,
    pack_paged,
    page_size_report,
)
from bik.testing.harness import InvarianceReport, same_bits
from checks import assert_invariant

__all__ = [
    "HEADS",
    "SPLIT",
    "bik_attn",
    "check_accuracy",
    "check_layouts_agree",
    "check_neighbours",
    "check_page_sizes",
    "check_schedules",
    "decode_positions",
    "decode_report",
    "mixed_batch",
    "one_call",
    "whole_prefill",
    "window_report",
]

HEADS = (4, 2, 64)  # q heads, kv heads, head_dim
SPLIT = 256  # the sm90/sm80 table's split size: decode positions probe its boundaries


def mixed_batch(head_dim: int):
    """One batch of a prefill chunk, decode rows and a verify window whose tiles see different
    numbers of splits of 32 keys (up to 5): returns fn(backend) -> the attention output."""
    gen = torch.Generator().manual_seed(4)
    lengths, q_lens = [75, 40, 130, 3], [15, 1, 4, 3]
    seqs = [make_request(gen, n, 4, 2, head_dim, torch.float32) for n in lengths]
    cache = pack_paged(seqs, lengths, 16, gen)
    q = torch.cat([s.q[n - t:] for s, n, t in zip(seqs, lengths, q_lens)])
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return lambda backend: bik_attn(backend)(q, cache.k_cache, cache.v_cache,
                                             cache.cache_seqlens, cu, cache.block_table)


def bik_attn(backend):
    def attn(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table):
        return bik.attention(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                             cu_seqlens_q=cu_seqlens_q, block_table=block_table, backend=backend)

    return attn


# --- schedules of one sequence -------------------------------------------------------------

def one_call(attn, seq: Request, start: int, end: int, cache) -> torch.Tensor:
    """Tokens start..end-1 of ``seq`` in one call over ``cache`` (lengths set to ``end``)."""
    cu = torch.tensor([0, end - start], dtype=torch.int32, device=seq.q.device)
    lens = torch.tensor([end], dtype=torch.int32, device=seq.q.device)
    return attn(seq.q[start:end], cache.k_cache, cache.v_cache, lens, cu, cache.block_table)


def whole_prefill(attn, seq: Request, page_size: int, gen) -> torch.Tensor:
    length = seq.q.shape[0]
    return one_call(attn, seq, 0, length, pack_paged([seq], [length], page_size, gen))


def window_report(attn, seq: Request, whole: torch.Tensor, window: int, tail: int,
                  page_size: int, gen) -> InvarianceReport:
    """The last ``tail`` tokens as verify windows of ``window`` tokens, each call over a fresh
    cache holding exactly the keys up to the window's end, vs the one prefill."""
    length = seq.q.shape[0]
    start = max(0, length - tail)
    outs = [one_call(attn, seq, s, min(s + window, length),
                     pack_paged([seq], [min(s + window, length)], page_size, gen))
            for s in range(start, length, window)]
    got = torch.cat(outs)
    bad = tuple((window, start + t) for t in range(got.shape[0])
                if not same_bits(got[t], whole[start + t]))
    return InvarianceReport(f"windows of {window} over the last {length - start} tokens vs one "
                            f"prefill (L={length})", got.shape[0], bad)


def decode_positions(length: int, last: int = 64) -> list[int]:
    """The last ``last`` positions and those around split boundaries and the middle."""
    near = {0, 1, length // 2}
    for j in (1, 2, length // SPLIT):
        near |= {j * SPLIT - 1, j * SPLIT, j * SPLIT + 1}
    return sorted({p for p in near if 0 <= p < length} | set(range(max(0, length - last), length)))


def decode_report(attn, seq: Request, whole: torch.Tensor, positions, page_size: int,
                  gen) -> InvarianceReport:
    """Decode steps (q_len 1) at ``positions`` vs the one prefill. The cache holds the whole
    sequence and each step's cache_seqlens stops at its token, so a step that read a key past
    its length (a later token's key) would show in the bits."""
    length = seq.q.shape[0]
    cache = pack_paged([seq], [length], page_size, gen)
    bad = tuple((1, p) for p in positions
                if not same_bits(one_call(attn, seq, p, p + 1, cache)[0], whole[p]))
    return InvarianceReport(f"decode at {len(positions)} positions vs one prefill (L={length})",
                            len(positions), bad)


def check_schedules(attn, dtype, length, *, device="cpu", heads=HEADS, chunks=(7, 64, 511),
                    windows=(4, 16, 32), tail=128, last=64, page_size=16, seed=0):
    """One prefill vs chunked prefill vs verify windows vs sampled decode steps, per token."""
    gen = torch.Generator().manual_seed(seed)
    seq = make_request(gen, length, *heads, dtype, device=device)
    reports = chunking_report(attn, seq, chunks, page_size=page_size, seed=seed) if chunks else []
    whole = whole_prefill(attn, seq, page_size, gen)
    reports += [window_report(attn, seq, whole, w, tail, page_size, gen) for w in windows]
    reports.append(decode_report(attn, seq, whole, decode_positions(length, last), page_size, gen))
    assert_invariant(reports)


def check_page_sizes(attn, dtype, length, page_sizes, *, device="cpu", heads=HEADS):
    gen = torch.Generator().manual_seed(1)
    seq = make_request(gen, length, *heads, dtype, device=device)
    assert_invariant(page_size_report(attn, seq, page_sizes))


def check_neighbours(attn, dtype, length, q_len, n_neighbours, max_len, *, device="cpu",
                     heads=HEADS, seed=2):
    """The last q_len tokens alone vs among random neighbours (random lengths and q_lens), at
    every row of the batch."""
    gen = torch.Generator().manual_seed(seed)
    seq = make_request(gen, length, *heads, dtype, device=device)
    lens = torch.randint(1, max_len, (n_neighbours,), generator=gen).tolist()
    neighbours = [make_request(gen, n, *heads, dtype, device=device) for n in lens]
    q_lens = [int(torch.randint(1, n + 1, (1,), generator=gen)) for n in lens]
    assert_invariant([neighbours_report(attn, seq, q_len, neighbours, q_lens, seed=seed)])


# --- layouts and accuracy ------------------------------------------------------------------

def check_layouts_agree(backend, dtype, lengths, *, device="cpu", heads=HEADS, causal=True):
    """Paged, contiguous-cache and varlen calls give the same bits for the same tokens."""
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(3)
    reqs = [make_request(gen, n, hq, hkv, d, dtype, device=device) for n in lengths]
    q_lens = [max(1, n // 3) for n in lengths]
    q = torch.cat([r.q[n - ql:] for r, n, ql in zip(reqs, lengths, q_lens)])
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    paged = pack_paged(reqs, lengths, 8, gen)
    out_paged = bik.attention(q, paged.k_cache, paged.v_cache, cache_seqlens=seqlens,
                              cu_seqlens_q=cu_q, block_table=paged.block_table, causal=causal,
                              backend=backend)
    contiguous_k = torch.zeros(len(lengths), max(lengths) + 5, hkv, d, dtype=dtype,
                               device=device)
    contiguous_v = torch.zeros_like(contiguous_k)
    for b, (r, n) in enumerate(zip(reqs, lengths)):
        contiguous_k[b, :n], contiguous_v[b, :n] = r.k, r.v
    out_contig = bik.attention(q, contiguous_k, contiguous_v, cache_seqlens=seqlens,
                               cu_seqlens_q=cu_q, causal=causal, backend=backend)
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)
    out_varlen, lse = bik.attention_varlen(q, torch.cat([r.k for r in reqs]),
                                           torch.cat([r.v for r in reqs]), cu_seqlens_q=cu_q,
                                           cu_seqlens_k=cu_k, causal=causal, backend=backend)
    assert same_bits(out_paged, out_contig) and same_bits(out_paged, out_varlen)
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], hq)
    assert torch.isfinite(lse).all()


def _reference(q, k, v, causal=True):
    """fp64 softmax(q k^T / sqrt(D)) v for one sequence, bottom-right aligned."""
    t, hq, d = q.shape
    length, hkv = k.shape[0], k.shape[1]
    kk = k.double().repeat_interleave(hq // hkv, 1)
    vv = v.double().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("thd,lhd->htl", q.double(), kk) / math.sqrt(d)
    if causal:
        pos = torch.arange(length, device=q.device)
        s = s.masked_fill(pos[None, None, :] > pos[length - t:][None, :, None], float("-inf"))
    return torch.einsum("htl,lhd->thd", s.softmax(-1), vv), torch.logsumexp(s, -1).T


def _sdpa(q, k, v):
    """torch's SDPA in q's dtype (math in fp32 for 16-bit on the CPU), bottom-right causal."""
    t, hq, _ = q.shape
    length, hkv = k.shape[0], k.shape[1]
    pos = torch.arange(length, device=q.device)
    mask = pos[None, :] <= pos[length - t:][:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(hq // hkv, 1).transpose(0, 1),
        v.repeat_interleave(hq // hkv, 1).transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


# Measured over 3 seeds (CPU backend lengths to 600, interpreter to 70), max error relative to
# torch SDPA's in the same dtype: CPU fp32 1.72x, bf16/fp16 1.0x; Triton fp32 0.56x, bf16 1.32x,
# fp16 1.36x (p is rounded to 16 bits before the p @ v dot). Bounds about twice that.
ATTENTION_RATIO = {torch.float32: 4.0, torch.bfloat16: 3.0, torch.float16: 3.0}


def check_accuracy(backend, dtype, lengths, q_lens, *, device="cpu", heads=HEADS):
    """Max error vs fp64 within a multiple of an independent same-dtype implementation's
    (torch SDPA on the same device); LSE close."""
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(4)
    reqs = [make_request(gen, n, hq, hkv, d, dtype, device) for n in lengths]
    q = torch.cat([r.q[n - ql:] for r, n, ql in zip(reqs, lengths, q_lens)])
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)
    out, lse = bik.attention_varlen(q, torch.cat([r.k for r in reqs]),
                                    torch.cat([r.v for r in reqs]), cu_seqlens_q=cu_q,
                                    cu_seqlens_k=cu_k, backend=backend)
    for b, (r, n, ql) in enumerate(zip(reqs, lengths, q_lens)):
        ref, ref_lse = _reference(r.q[n - ql:], r.k, r.v)
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        indep = _sdpa(r.q[n - ql:], r.k, r.v)
        err = (out[rows].double() - ref).abs().max().item()
        err_indep = (indep.double() - ref).abs().max().item()
        tol = ATTENTION_RATIO[dtype] * err_indep + 4 * torch.finfo(dtype).eps
        assert err <= tol, (b, err, err_indep)
        assert (lse[rows].double() - ref_lse).abs().max().item() <= 1e-4 * max(1, n**0.5)


# --- host bounds below a real length (tests/attention/test_attention_bounds.py and the CUDA
# host build) -------------------------------------------------------------------------------

BOUND_SENTINEL = 12345.0
BOUND_HEADS = (4, 2, 64)  # Hq, Hkv, D (a head dim both GPU backends compile)


def _bound_cache(lengths, seed, device, page=16):
    gen = torch.Generator().manual_seed(seed)
    _, hkv, d = BOUND_HEADS
    pages = [-(-n // page) for n in lengths]
    k = torch.randn(sum(pages), page, hkv, d, generator=gen).to(device)
    v = torch.randn(sum(pages), page, hkv, d, generator=gen).to(device)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.arange(at, at + n, dtype=torch.int32)
        at += n
    return k, v, table.to(device)


def _launch(module, q, k, v, table, lens, cu_q, max_q, max_k, split_mode):
    out = torch.full_like(q, BOUND_SENTINEL)
    lse = torch.full(q.shape[:2], BOUND_SENTINEL, device=q.device)
    module.launch_attention(q, k, v, out, lse, cu_q=cu_q, seqlens_k=lens, table=table,
                            base=None, block_size=16, stride_page=k.stride(0),
                            stride_tok=k.stride(1), max_q_len=max_q, max_k_len=max_k,
                            scale=BOUND_HEADS[2] ** -0.5, causal=True, split_mode=split_mode)
    return out, lse


def past_key_bound(module, monkeypatch, backend: str, device="cpu"):
    """Decode rows of sequences of 40, 130 and 70 keys launched (SPLIT, 4 splits a program)
    with max_seqlen_k = 64 through ``module``'s launch_attention, its SPLIT workspace
    allocated with guard elements after it. Returns (guards untouched, out, lse, the right
    output from a call with the true bound)."""
    lengths = [40, 130, 70]
    k, v, table = _bound_cache(lengths, 0, device)
    q = torch.randn(3, BOUND_HEADS[0], BOUND_HEADS[2],
                    generator=torch.Generator().manual_seed(1)).to(device)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    cu_q = torch.arange(4, dtype=torch.int32, device=device)
    monkeypatch.setattr(module, "use_split_mode", lambda *args: True)
    right = bik.attention(q, k, v, cache_seqlens=lens, cu_seqlens_q=cu_q, block_table=table,
                          max_seqlen_q=1, max_seqlen_k=max(lengths), backend=backend)
    real, guards = module.split_workspace, {}

    def guarded(n_splits, total_q, hq, d, dev):
        pacc, pml = real(n_splits + 2, total_q, hq, d, dev)
        pacc.fill_(BOUND_SENTINEL)
        pml.fill_(BOUND_SENTINEL)
        guards["pacc"], guards["pml"] = pacc[n_splits:], pml[n_splits:]
        return pacc[:n_splits], pml[:n_splits]

    monkeypatch.setattr(module, "split_workspace", guarded)
    monkeypatch.setattr(module, "splits_per_program", lambda *args: 4)
    out, lse = _launch(module, q, k, v, table, lens, cu_q, 1, 64, True)
    untouched = bool((guards["pacc"] == BOUND_SENTINEL).all()) and \
        bool((guards["pml"] == BOUND_SENTINEL).all())
    return untouched, out, lse, right


def keyless_sequence(module, device="cpu"):
    """Decode rows of two sequences, the first with no keys at all (host metadata that
    skipped the checks: cache_seqlens 0 under a query), launched through ``module``'s
    launch_attention in FOLD and in SPLIT (3 runs) into outputs holding BOUND_SENTINEL.
    Returns ((out, lse) FOLD, (out, lse) SPLIT)."""
    k, v, table = _bound_cache([0, 70], 0, device)
    q = torch.randn(2, BOUND_HEADS[0], BOUND_HEADS[2],
                    generator=torch.Generator().manual_seed(4)).to(device)
    lens = torch.tensor([0, 70], dtype=torch.int32, device=device)
    cu_q = torch.arange(3, dtype=torch.int32, device=device)
    return tuple(_launch(module, q, k, v, table, lens, cu_q, 1, 96, split)
                 for split in (False, True))


def past_query_bound(module, backend: str, device="cpu"):
    """Sequences with 3 and 40 new tokens launched (FOLD) with max_seqlen_q = 8 through
    ``module``'s launch_attention. Returns (out, lse, the right output)."""
    lengths = [20, 50]
    k, v, table = _bound_cache(lengths, 2, device)
    q = torch.randn(43, BOUND_HEADS[0], BOUND_HEADS[2],
                    generator=torch.Generator().manual_seed(3)).to(device)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    cu_q = torch.tensor([0, 3, 43], dtype=torch.int32, device=device)
    right = bik.attention(q, k, v, cache_seqlens=lens, cu_seqlens_q=cu_q, block_table=table,
                          max_seqlen_q=40, max_seqlen_k=50, backend=backend)
    out, lse = _launch(module, q, k, v, table, lens, cu_q, 8, 50, False)
    return out, lse, right

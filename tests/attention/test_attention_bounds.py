"""bik.attention's Triton kernel when the host metadata is wrong: a length past
``max_seqlen_k`` / ``max_seqlen_q`` (a caller error; BIK_DEBUG_CHECKS=1 raises it on the host,
tests/test_host_metadata.py) must never write past the SPLIT workspace the bound sized, nor
leave a row's output as stale memory. Such a sequence's rows come back NaN, the other rows
keep their bits. Also: a launch too large for the grid is refused by name.

Interpreter (real kernel programs) and GPU; the workspace is allocated with guard bytes
after it (``split_workspace`` patched) and the output pre-filled with a sentinel.
"""

from __future__ import annotations

import math

import bik
import pytest
import torch
from bik.ops.attention import triton as triton_attention
from targets import targets

SENTINEL = 12345.0
HQ, HKV, D = 4, 2, 16


def _cache(lengths, page=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages = [math.ceil(n / page) for n in lengths]
    k = torch.randn(sum(pages), page, HKV, D, generator=gen)
    v = torch.randn(sum(pages), page, HKV, D, generator=gen)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.arange(at, at + n, dtype=torch.int32)
        at += n
    return k, v, table


def _guarded(monkeypatch, guards: dict):
    """split_workspace with GUARD sentinel elements after each buffer, kept in ``guards``."""
    real = triton_attention.split_workspace

    def guarded(n_splits, total_q, hq, d, device):
        pacc, pml = real(n_splits + 2, total_q, hq, d, device)
        pacc.fill_(SENTINEL)
        pml.fill_(SENTINEL)
        guards["pacc"], guards["pml"] = pacc[n_splits:], pml[n_splits:]
        return pacc[:n_splits], pml[:n_splits]

    monkeypatch.setattr(triton_attention, "split_workspace", guarded)


@pytest.mark.parametrize("target", targets("interpreter", "gpu-triton"))
def test_a_key_length_past_the_bound_gives_nan_and_never_writes_past_the_workspace(
        target, monkeypatch):
    lengths = [40, 130, 70]  # the interpreter's split is 32 keys: 2, 5 and 3 splits
    bound = 64  # 2 splits: sequences 1 and 2 are past it
    k, v, table = (t.to(target.device) for t in _cache(lengths))
    q = torch.randn(len(lengths), HQ, D, generator=torch.Generator().manual_seed(1))
    q = q.to(target.device)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=target.device)
    cu_q = torch.arange(len(lengths) + 1, dtype=torch.int32, device=target.device)
    monkeypatch.setattr(triton_attention, "use_split_mode", lambda *args: True)
    args = dict(cache_seqlens=seqlens, cu_seqlens_q=cu_q, block_table=table, backend="triton")
    right = bik.attention(q, k, v, max_seqlen_q=1, max_seqlen_k=max(lengths), **args)
    guards: dict = {}
    _guarded(monkeypatch, guards)
    out = torch.full_like(q, SENTINEL)
    lse = torch.full(q.shape[:2], SENTINEL, device=q.device)
    triton_attention.launch_attention(
        q, k, v, out, lse, cu_q=cu_q, seqlens_k=seqlens, table=table, base=None, block_size=16,
        stride_page=k.stride(0), stride_tok=k.stride(1), max_q_len=1, max_k_len=bound,
        scale=D ** -0.5, causal=True, split_mode=True, per_program=4)  # one program, 4 splits
    assert bool((guards["pacc"] == SENTINEL).all()) and bool((guards["pml"] == SENTINEL).all())
    assert torch.equal(out[0], right[0])  # within the bound: its bits
    assert bool(out[1:].isnan().all()) and bool(lse[1:].isnan().all())


@pytest.mark.parametrize("target", targets("interpreter", "gpu-triton"))
def test_a_query_length_past_the_bound_gives_nan_rows_past_the_grid_too(target, monkeypatch):
    lengths = [20, 50]
    k, v, table = (t.to(target.device) for t in _cache(lengths, seed=2))
    q_lens = [3, 40]  # sequence 1 has 40 new tokens; the bound says 8
    q = torch.randn(sum(q_lens), HQ, D, generator=torch.Generator().manual_seed(3))
    q = q.to(target.device)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=target.device)
    cu_q = torch.tensor([0, 3, 43], dtype=torch.int32, device=target.device)
    right = bik.attention(q, k, v, cache_seqlens=seqlens, cu_seqlens_q=cu_q, block_table=table,
                          max_seqlen_q=40, max_seqlen_k=50, backend="triton")
    out = torch.full_like(q, SENTINEL)
    lse = torch.full(q.shape[:2], SENTINEL, device=q.device)
    triton_attention.launch_attention(
        q, k, v, out, lse, cu_q=cu_q, seqlens_k=seqlens, table=table, base=None, block_size=16,
        stride_page=k.stride(0), stride_tok=k.stride(1), max_q_len=8, max_k_len=50,
        scale=D ** -0.5, causal=True, split_mode=False)
    assert torch.equal(out[:3], right[:3])
    assert bool(out[3:].isnan().all()) and bool(lse[3:].isnan().all())


@pytest.mark.parametrize("target", targets("interpreter"))
def test_a_launch_past_the_grid_limits_is_refused_by_name(target):
    """Axis 2 holds SPLIT's runs of splits: more than 65535 is refused before any workspace
    or launch (the tensors are tiny; the bound is what sizes the grid)."""
    k, v, table = _cache([16])
    q = torch.randn(1, HQ, D)
    one = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="bik.attention \\(triton\\): .* 65535"):
        triton_attention.launch_attention(
            q, k, v, torch.empty_like(q), torch.empty(1, HQ), cu_q=one,
            seqlens_k=torch.tensor([16], dtype=torch.int32), table=table, base=None,
            block_size=16, stride_page=k.stride(0), stride_tok=k.stride(1), max_q_len=1,
            max_k_len=2**40, scale=D ** -0.5, causal=True, split_mode=True, per_program=1)

"""bik.attention on a GPU for backend "triton" and "cuda" (skipped without CUDA), at Llama-3-8B
heads (32 q / 8 kv, D = 128) and at D = 64 with other GQA ratios.

The schedule suites of tests/test_attention_gpu.py (one prefill vs chunked prefill vs verify
windows vs decode steps, page sizes, random neighbours at every row), run for both backends
and, on the CUDA backend, in both launch modes (fold in-program / split + merge kernel), which
must also agree with each other; accuracy against fp64; paged, contiguous and varlen layouts
give the same bits. Budget: about a minute on an H200.
"""

from __future__ import annotations

import attention_cases as ac
import pytest
import torch
from bik.testing.attention import make_request, pack_paged
from bik.testing.harness import same_bits
from test_attention_gpu import check_neighbours, check_page_sizes, check_schedules

pytestmark = pytest.mark.gpu

LLAMA = (32, 8, 128)
HALF = (torch.bfloat16, torch.float16)


def _require(backend: str) -> None:
    if backend == "cuda":
        from bik.runtime import cuda_jit

        if not cuda_jit.available():
            pytest.skip(f"backend='cuda' unavailable: {cuda_jit.unavailable_reason()}")


@pytest.fixture(params=["triton", "cuda"])
def backend(request):
    _require(request.param)
    return request.param


def _force_mode(monkeypatch, backend: str, split: bool | None) -> None:
    import importlib

    mod = importlib.import_module(f"bik.ops.attention.{backend}")
    if split is not None:
        monkeypatch.setattr(mod, "use_split_mode", lambda *args: split)


@pytest.mark.parametrize("mode", ["fold", "split"])
@pytest.mark.parametrize("dtype", HALF)
def test_schedules_same_bits(backend, dtype, mode, monkeypatch):
    _force_mode(monkeypatch, backend, mode == "split")
    check_schedules(ac.bik_attn(backend), dtype, 2049, chunks=(7, 511), windows=(4, 16))


@pytest.mark.parametrize("heads", [(8, 8, 64), (12, 4, 64), (40, 2, 128)])
def test_schedules_other_heads(backend, heads):
    """G = 1, 3 and 20 (more query heads per KV head than the CUDA program's 16 rows)."""
    check_schedules(ac.bik_attn(backend), torch.bfloat16, 600, heads=heads, chunks=(64,),
                    windows=(8,), tail=64, last=32)


def test_schedules_fp32(backend):
    check_schedules(ac.bik_attn(backend), torch.float32, 700, chunks=(64,), windows=(4,))


def test_page_sizes(backend):
    check_page_sizes(ac.bik_attn(backend), torch.bfloat16, 1500, (16, 1, 64))


@pytest.mark.parametrize("q_len", [1, 8, 300])
def test_random_neighbours(backend, q_len):
    check_neighbours(ac.bik_attn(backend), torch.bfloat16, 2000, q_len, n_neighbours=7,
                     max_len=3000)


@pytest.mark.parametrize("q_len", [1, 16, 300])
def test_cuda_fold_and_split_modes_agree(q_len, monkeypatch):
    _require("cuda")
    gen = torch.Generator().manual_seed(6)
    length = 4097
    seq = make_request(gen, length, *LLAMA, torch.bfloat16, device="cuda")
    cache = pack_paged([seq], [length], 16, gen)
    attn = ac.bik_attn("cuda")
    cu = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    outs = []
    for split in (False, True):
        _force_mode(monkeypatch, "cuda", split)
        outs.append(attn(seq.q[length - q_len:], cache.k_cache, cache.v_cache,
                         cache.cache_seqlens, cu, cache.block_table))
    assert same_bits(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [*HALF, torch.float32])
def test_accuracy_vs_fp64(backend, dtype):
    lengths = [1, 300, 2049] if dtype != torch.float32 else [1, 300, 1000]
    ac.check_accuracy(backend, dtype, lengths, [1, 77, lengths[-1]], hq=32, hkv=8, d=128,
                      device="cuda")


@pytest.mark.parametrize("causal", [True, False])
def test_cuda_layouts_agree(causal):
    """Paged, contiguous-cache and varlen calls give the same bits (CUDA backend)."""
    import bik

    _require("cuda")
    gen = torch.Generator().manual_seed(3)
    lengths, (hq, hkv, d) = [5, 300, 77], (8, 2, 64)
    reqs = [make_request(gen, n, hq, hkv, d, torch.bfloat16, device="cuda") for n in lengths]
    q_lens = [max(1, n // 3) for n in lengths]
    q = torch.cat([r.q[n - ql:] for r, n, ql in zip(reqs, lengths, q_lens)])
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    paged = pack_paged(reqs, lengths, 8, gen)
    out_paged = bik.attention(q, paged.k_cache, paged.v_cache, cache_seqlens=seqlens,
                              cu_seqlens_q=cu_q, block_table=paged.block_table, causal=causal,
                              backend="cuda")
    ck = torch.zeros(len(lengths), max(lengths) + 5, hkv, d, dtype=torch.bfloat16, device="cuda")
    cv = torch.zeros_like(ck)
    for b, (r, n) in enumerate(zip(reqs, lengths)):
        ck[b, :n], cv[b, :n] = r.k, r.v
    out_contig = bik.attention(q, ck, cv, cache_seqlens=seqlens, cu_seqlens_q=cu_q,
                               causal=causal, backend="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    out_varlen, lse = bik.attention_varlen(q, torch.cat([r.k for r in reqs]),
                                           torch.cat([r.v for r in reqs]), cu_seqlens_q=cu_q,
                                           cu_seqlens_k=cu_k, causal=causal, backend="cuda")
    assert same_bits(out_paged, out_contig) and same_bits(out_paged, out_varlen)
    assert lse.dtype == torch.float32 and torch.isfinite(lse).all()


def test_cuda_opcheck():
    from torch.library import opcheck

    _require("cuda")
    gen = torch.Generator().manual_seed(5)
    reqs = [make_request(gen, n, 4, 2, 64, torch.bfloat16, device="cuda") for n in (5, 300)]
    cache = pack_paged(reqs, [5, 300], 16, gen)
    q = torch.cat([reqs[0].q[3:], reqs[1].q[299:]])
    cu_q = torch.tensor([0, 2, 3], dtype=torch.int32, device="cuda")
    opcheck(torch.ops.bik.attention.default,
            (q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cu_q, cache.block_table,
             0.125, True, "cuda"))
    cu_k = torch.tensor([0, 5, 305], dtype=torch.int32, device="cuda")
    opcheck(torch.ops.bik.attention_varlen.default,
            (q, torch.cat([r.k for r in reqs]), torch.cat([r.v for r in reqs]), cu_q, cu_k,
             0.125, True, "cuda"))

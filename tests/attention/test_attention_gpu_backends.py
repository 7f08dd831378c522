"""bik.attention on a GPU for backends "triton" and "cuda" (targets gpu-triton and gpu-cuda,
skipped without CUDA; gpu-cuda also without NVRTC), at Llama-3-8B heads (32 q / 8 kv, D = 128)
and at D = 64 with other GQA ratios.

The schedule suites of tests/attention_checks.py (one prefill vs chunked prefill vs verify
windows vs decode steps, page sizes, random neighbours at every row), run for both backends
in both launch modes (fold in-program / split + merge kernel); on the CUDA backend the two
modes must also agree with each other; accuracy against fp64; paged, contiguous and varlen
layouts give the same bits and the ops pass opcheck (CUDA). Budget: about a minute on an H200.
"""

from __future__ import annotations

import pytest
import torch
from attention_checks import (
    bik_attn,
    check_accuracy,
    check_layouts_agree,
    check_neighbours,
    check_page_sizes,
    check_schedules,
)
from bik.testing.attention import make_request, pack_paged
from bik.testing.harness import same_bits
from targets import targets

pytestmark = pytest.mark.gpu

LLAMA = (32, 8, 128)
HALF = (torch.bfloat16, torch.float16)


def _require(backend: str) -> None:
    if backend == "cuda":
        from bik.runtime import cuda_jit

        if not cuda_jit.available():
            pytest.skip(f"backend='cuda' unavailable: {cuda_jit.unavailable_reason()}")


BOTH = pytest.mark.parametrize("target", targets("gpu-triton", "gpu-cuda"))
GPU_CUDA = pytest.mark.parametrize("target", targets("gpu-cuda"))


def _force_mode(monkeypatch, backend: str, split: bool | None) -> None:
    import importlib

    mod = importlib.import_module(f"bik.ops.attention.{backend}")
    if split is not None:
        monkeypatch.setattr(mod, "use_split_mode", lambda *args: split)


@pytest.mark.parametrize("mode", ["fold", "split"])
@pytest.mark.parametrize("dtype", HALF)
@BOTH
def test_schedules_same_bits(target, dtype, mode, monkeypatch):
    _require(target.backend)
    _force_mode(monkeypatch, target.backend, mode == "split")
    check_schedules(bik_attn(target.backend), dtype, 2049, device=target.device, heads=LLAMA,
                    chunks=(7, 511), windows=(4, 16))


@pytest.mark.parametrize("heads", [(8, 8, 64), (12, 4, 64), (40, 2, 128)])
@BOTH
def test_schedules_other_heads(target, heads):
    """G = 1, 3 and 20 (more query heads per KV head than the CUDA program's 16 rows)."""
    _require(target.backend)
    check_schedules(bik_attn(target.backend), torch.bfloat16, 600, device=target.device,
                    heads=heads, chunks=(64,), windows=(8,), tail=64, last=32)


@BOTH
def test_schedules_fp32(target):
    _require(target.backend)
    check_schedules(bik_attn(target.backend), torch.float32, 700, device=target.device,
                    heads=LLAMA, chunks=(64,), windows=(4,))


@BOTH
def test_page_sizes(target):
    _require(target.backend)
    check_page_sizes(bik_attn(target.backend), torch.bfloat16, 1500, (16, 1, 64),
                     device=target.device, heads=LLAMA)


@pytest.mark.parametrize("q_len", [1, 8, 300])
@BOTH
def test_random_neighbours(target, q_len):
    _require(target.backend)
    check_neighbours(bik_attn(target.backend), torch.bfloat16, 2000, q_len, n_neighbours=7,
                     max_len=3000, device=target.device, heads=LLAMA)


@pytest.mark.parametrize("q_len", [1, 16, 300])
@GPU_CUDA
def test_cuda_fold_and_split_modes_agree(target, q_len, monkeypatch):
    _require(target.backend)
    gen = torch.Generator().manual_seed(6)
    length = 4097
    seq = make_request(gen, length, *LLAMA, torch.bfloat16, device=target.device)
    cache = pack_paged([seq], [length], 16, gen)
    attn = bik_attn(target.backend)
    cu = torch.tensor([0, q_len], dtype=torch.int32, device=target.device)
    outs = []
    for split in (False, True):
        _force_mode(monkeypatch, target.backend, split)
        outs.append(attn(seq.q[length - q_len:], cache.k_cache, cache.v_cache,
                         cache.cache_seqlens, cu, cache.block_table))
    assert same_bits(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [*HALF, torch.float32])
@BOTH
def test_accuracy_vs_fp64(target, dtype):
    _require(target.backend)
    lengths = [1, 300, 2049] if dtype != torch.float32 else [1, 300, 1000]
    check_accuracy(target.backend, dtype, lengths, [1, 77, lengths[-1]], device=target.device,
                   heads=LLAMA)


@pytest.mark.parametrize("causal", [True, False])
@GPU_CUDA
def test_cuda_layouts_agree(target, causal):
    """Paged, contiguous-cache and varlen calls give the same bits (CUDA backend)."""
    _require(target.backend)
    check_layouts_agree(target.backend, torch.bfloat16, [5, 300, 77], device=target.device,
                        heads=(8, 2, 64), causal=causal)


@GPU_CUDA
def test_cuda_opcheck(target):
    from torch.library import opcheck

    _require(target.backend)
    device = target.device
    gen = torch.Generator().manual_seed(5)
    reqs = [make_request(gen, n, 4, 2, 64, torch.bfloat16, device=device) for n in (5, 300)]
    cache = pack_paged(reqs, [5, 300], 16, gen)
    q = torch.cat([reqs[0].q[3:], reqs[1].q[299:]])
    cu_q = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    opcheck(torch.ops.bik.attention.default,
            (q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cu_q, cache.block_table,
             0.125, True, target.backend))
    cu_k = torch.tensor([0, 5, 305], dtype=torch.int32, device=device)
    opcheck(torch.ops.bik.attention_varlen.default,
            (q, torch.cat([r.k for r in reqs]), torch.cat([r.v for r in reqs]), cu_q, cu_k,
             0.125, True, target.backend))

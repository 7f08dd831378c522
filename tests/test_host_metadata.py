"""Host metadata: given it, bik.attention / attention_varlen / write_kv_cache / sample /
verify_draft read nothing back from the device (what CUDA graph capture needs), and give the
bits of the validated call.

On the CPU a read cannot hide: forbid_host_reads() (bik/testing/host_reads.py) makes every
Python route from tensor data to the host raise. The interpreter target runs the Triton
launchers — the GPU path's host code — on CPU tensors under it. Negative control: the same
calls without host metadata are caught reading. The plan_* calls make the validated call's
checks once; BIK_DEBUG_CHECKS makes them despite host metadata.
"""

from __future__ import annotations

import bik
import pytest
import torch
from bik.configs import CUDA_ATTENTION_HEAD_DIMS
from bik.ops import _checks
from bik.testing.host_reads import HostReadError, forbid_host_reads
from targets import targets

LENS, Q_LENS, BLOCK, HQ, HKV, D = [5, 17, 9], [1, 4, 9], 8, 4, 2, 16


def _head_dim(target) -> int:
    """16 keeps the interpreter cheap; the CUDA C++ attention compiles only its head dims."""
    return CUDA_ATTENTION_HEAD_DIMS[0] if target.backend == "cuda" else D


def _paged(device, dtype=torch.float32, d=D):
    """A 3-sequence paged cache (decode, chunk, prefill), one spare page, its call's tensors."""
    gen = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(10, BLOCK, HKV, d, generator=gen).to(device, dtype) for _ in "kv")
    table = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=torch.int32, device=device)
    q = torch.randn(sum(Q_LENS), HQ, d, generator=gen).to(device, dtype)
    seqlens = torch.tensor(LENS, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 1, 5, 14], dtype=torch.int32, device=device)
    return q, kc, vc, {"cache_seqlens": seqlens, "cu_seqlens_q": cu, "block_table": table}


def _varlen(device, d=D):
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(sum(LENS), HKV, d, generator=gen).to(device) for _ in "kv")
    q = torch.randn(sum(Q_LENS), HQ, d, generator=gen).to(device)
    cu_k = torch.tensor([0, 5, 22, 31], dtype=torch.int32, device=device)
    cu_q = torch.tensor([0, 1, 5, 14], dtype=torch.int32, device=device)
    return q, k, v, {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}


def _logits(device, rows=4, vocab=100):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, vocab, generator=gen).to(device)
    params = {"seed": torch.arange(rows, device=device) + 11,
              "position": torch.arange(rows, device=device) + 3, "temperature": 0.7,
              "top_k": torch.tensor([0, 5, 50, 200][:rows], device=device), "top_p": 0.9}
    return x, params


def _same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ---- no reads with host metadata, the validated call's bits --------------------------------

@pytest.mark.parametrize("target", targets("cpu", "interpreter", "gpu-triton", "gpu-cuda"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_host_metadata_reads_nothing(target, dtype):
    q, kc, vc, meta = _paged(target.device, dtype, _head_dim(target))
    ref = bik.attention(q, kc, vc, **meta, backend=target.backend)
    plan = bik.plan_attention(q, kc, vc, **meta)
    assert plan == bik.AttentionPlan(max(Q_LENS), max(LENS))
    for bounds in (plan._asdict(), {"max_seqlen_q": 12, "max_seqlen_k": 24}):  # exact, loose
        with forbid_host_reads():
            out = bik.attention(q, kc, vc, **meta, **bounds, backend=target.backend)
        assert torch.equal(out, ref), bounds
    with pytest.raises(HostReadError), forbid_host_reads():  # negative control
        bik.attention(q, kc, vc, **meta, backend=target.backend)


@pytest.mark.parametrize("target", targets("cpu", "interpreter", "gpu-triton", "gpu-cuda"))
def test_attention_varlen_with_host_metadata_reads_nothing(target):
    q, k, v, meta = _varlen(target.device, _head_dim(target))
    ref = bik.attention_varlen(q, k, v, **meta, backend=target.backend)
    plan = bik.plan_attention_varlen(q, k, v, **meta)
    assert plan == bik.AttentionPlan(max(Q_LENS), max(LENS))
    with forbid_host_reads():
        out = bik.attention_varlen(q, k, v, **meta, **plan._asdict(), backend=target.backend)
    _same(out, ref)
    with pytest.raises(HostReadError), forbid_host_reads():
        bik.attention_varlen(q, k, v, **meta, backend=target.backend)


def _write(kc, vc, k, v, slots, **kw):
    kc, vc = kc.clone(), vc.clone()
    bik.write_kv_cache(kc, vc, k, v, slots, **kw)
    return kc, vc


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_write_kv_cache_unvalidated_reads_nothing(device):
    _, kc, vc, _ = _paged(device)
    k, v = torch.randn(4, HKV, D).to(device), torch.randn(4, HKV, D).to(device)
    slots = torch.tensor([3, -1, 79, 17], device=device)  # a padding token
    ref = _write(kc, vc, k, v, slots)
    assert torch.equal(ref[0].view(-1, HKV, D)[79], k[2])
    assert torch.equal(ref[0].view(-1, HKV, D)[[0, 1, 2]], kc.view(-1, HKV, D)[[0, 1, 2]])
    with forbid_host_reads():
        _same(_write(kc, vc, k, v, slots, validate=False), ref)
    with pytest.raises(HostReadError), forbid_host_reads():
        _write(kc, vc, k, v, slots)


@pytest.mark.parametrize("target", targets("interpreter"))
def test_triton_kv_writer_reads_nothing_and_matches_the_cpu_writer(target):
    """The GPU writer (a Triton kernel, CUDA's path) in the interpreter; a slot past the cache
    is skipped, as validate=False documents."""
    from bik.ops.attention.kv_cache_triton import write_rows_triton

    _, kc, vc, _ = _paged(target.device)
    k, v = torch.randn(5, HKV, 2 * D)[:, :, ::2], torch.randn(HKV, 5, D).transpose(0, 1)
    slots = torch.tensor([3, -1, 79, 17, 80])  # padding; 80 is one past the 80 slots
    ref = _write(kc, vc, k, v, slots, validate=False)
    got_k, got_v = kc.clone(), vc.clone()
    with forbid_host_reads():
        write_rows_triton(got_k, got_v, k, v, slots)  # strided k and v
    _same((got_k, got_v), ref)


@pytest.mark.parametrize("target", targets("cpu", "interpreter", "gpu-triton", "gpu-cuda"))
def test_sample_and_verify_with_max_top_k_read_nothing(target):
    x, params = _logits(target.device)
    ref = bik.sample(x, **params, backend=target.backend)
    for bound in (50, 99):  # the largest active top_k, a loose bound
        with forbid_host_reads():
            _same(bik.sample(x, **params, max_top_k=bound, any_top_p=(bound == 99) or None,
                             backend=target.backend), ref)
    with pytest.raises(HostReadError), forbid_host_reads():
        bik.sample(x, **params, backend=target.backend)
    # any_top_p=False where no row uses top-p: the search is not launched, same bits.
    plain = {**params, "top_p": 1.0}
    ref_plain = bik.sample(x, **plain, backend=target.backend)
    with forbid_host_reads():
        _same(bik.sample(x, **plain, max_top_k=50, any_top_p=False, backend=target.backend),
              ref_plain)

    window = torch.randn(4, 3, 100, generator=torch.Generator().manual_seed(3)).to(x.device)
    drafts = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]], device=x.device)
    args = (drafts, torch.tensor([2, 1, 0, 2], device=x.device), window)
    ref = bik.verify_draft(*args, **params, backend=target.backend)
    with forbid_host_reads():
        _same(bik.verify_draft(*args, **params, max_top_k=50, backend=target.backend), ref)
    with pytest.raises(HostReadError), forbid_host_reads():
        bik.verify_draft(*args, **params, backend=target.backend)


# ---- what host metadata cannot break ------------------------------------------------------

@pytest.mark.cpu
def test_bad_host_metadata_is_a_clear_error_on_the_cpu():
    q, kc, vc, meta = _paged("cpu")
    call = lambda **kw: bik.attention(q, kc, vc, **{**meta, **kw}, backend="cpu")
    with pytest.raises(ValueError, match="bik.attention: pass both max_seqlen_q"):
        call(max_seqlen_q=9)
    with pytest.raises(ValueError, match="max_seqlen_k=25 exceeds the room for 24"):
        call(max_seqlen_q=9, max_seqlen_k=25)
    with pytest.raises(ValueError, match="0 <= max_seqlen_q <= max_seqlen_k"):
        call(max_seqlen_q=9, max_seqlen_k=4)
    # The CPU kernel checks what it follows: too small a bound, a page outside the cache.
    with pytest.raises(ValueError, match="bik.attention: sequence 1 has 17 keys but "
                                         "max_seqlen_k is 16"):
        call(max_seqlen_q=9, max_seqlen_k=16)
    table = meta["block_table"].clone()
    table[1, 1] = 99
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(ValueError, match="bik.attention: .*outside the cache"):
            bik.attention(q.to(dtype), kc.to(dtype), vc.to(dtype),
                          **{**meta, "block_table": table}, max_seqlen_q=9, max_seqlen_k=24,
                          backend="cpu")
    with pytest.raises(ValueError, match="bik.sample: max_top_k must be an int >= 0"):
        x, params = _logits("cpu")
        bik.sample(x, **params, max_top_k=-1)
    with pytest.raises(TypeError, match="bik.sample: any_top_p must be a bool or None, got 0"):
        bik.sample(x, **params, any_top_p=0)
    with pytest.raises(ValueError, match="bik.sample: a row has top_p < 1 but the host "
                                         "metadata says any_top_p=False"):
        bik.sample(x, **params, any_top_p=False)  # no max_top_k: the values are checked


@pytest.mark.cpu
def test_the_cpu_kernel_refuses_metadata_that_would_read_outside_the_cache():
    """Each was a silent read elsewhere before the checks (found in review): an int64 page
    that int32 would wrap onto a real one, a cache that is a view of a larger pool, offsets
    whose sum overflows int64, queries with no sequence."""
    q, kc, vc, meta = _paged("cpu")
    bounds = {"max_seqlen_q": 9, "max_seqlen_k": 24}
    wrapped = meta["block_table"].long()
    wrapped[0, 0] = 2**32 + 1  # int32 would read it as page 1
    pool_k, pool_v = torch.cat([kc, kc]), torch.cat([vc, vc])  # 20 blocks
    beyond = meta["block_table"].clone()
    beyond[0, 0] = 12  # inside the pool, outside the 10-block cache carved from it
    for k_cache, v_cache, table in ((kc, vc, wrapped), (pool_k[:10], pool_v[:10], beyond)):
        for kw in ({}, bounds):
            with pytest.raises(ValueError, match="bik.attention: .*outside the cache"):
                bik.attention(q, k_cache, v_cache, **{**meta, "block_table": table}, **kw,
                              backend="cpu")
    huge = 2**61 - 1  # * 4 floats per key: 2**63 - 4
    k = torch.zeros(2, 1, 4)
    with pytest.raises(ValueError, match="bik.attention_varlen: .*outside the cache"):
        bik.attention_varlen(torch.ones(1, 1, 4), k, k, cu_seqlens_q=torch.tensor([0, 1]),
                             cu_seqlens_k=torch.tensor([huge, huge + 1]), causal=False,
                             max_seqlen_q=1, max_seqlen_k=1, backend="cpu")
    with pytest.raises(ValueError, match="3 queries but no sequence"):
        bik.attention(q[:3], kc, vc, cache_seqlens=torch.zeros(0, dtype=torch.int32),
                      cu_seqlens_q=torch.tensor([3]), block_table=meta["block_table"][:0],
                      max_seqlen_q=0, max_seqlen_k=0, backend="cpu")


@pytest.mark.cpu
def test_plan_makes_the_validated_calls_checks():
    q, kc, vc, meta = _paged("cpu")
    table = meta["block_table"].clone()
    table[2, 0] = -1
    with pytest.raises(ValueError, match="bik.plan_attention: block_table row 2 points outside"):
        bik.plan_attention(q, kc, vc, **{**meta, "block_table": table})
    short = torch.tensor([5, 3, 9], dtype=torch.int32)  # sequence 1: 3 keys < its 4 queries
    with pytest.raises(ValueError, match="sequence 1 has cache_seqlens 3 < q_len 4"):
        bik.plan_attention(q, kc, vc, **{**meta, "cache_seqlens": short})
    q, k, v, vmeta = _varlen("cpu")
    bad_cu = torch.tensor([0, 5, 22, 30], dtype=torch.int32)
    with pytest.raises(ValueError, match="bik.plan_attention_varlen: cu_seqlens_k must"):
        bik.plan_attention_varlen(q, k, v, **{**vmeta, "cu_seqlens_k": bad_cu})


@pytest.mark.cpu
def test_debug_checks_verify_host_metadata(monkeypatch):
    monkeypatch.setattr(_checks, "_DEBUG_CHECKS", True)
    q, kc, vc, meta = _paged("cpu")
    with pytest.raises(ValueError, match="is below the lengths' maxima 9 / 17"):
        bik.attention(q, kc, vc, **meta, max_seqlen_q=8, max_seqlen_k=24, backend="cpu")
    q, k, v, vmeta = _varlen("cpu")
    with pytest.raises(ValueError, match="bik.attention_varlen: the host metadata"):
        bik.attention_varlen(q, k, v, **vmeta, max_seqlen_q=9, max_seqlen_k=16, backend="cpu")
    x, params = _logits("cpu")
    with pytest.raises(ValueError, match="top_k exceeds the host metadata max_top_k=49"):
        bik.sample(x, **params, max_top_k=49)
    with pytest.raises(ValueError, match="temperature must be finite"):
        bik.sample(x, **{**params, "temperature": -1.0}, max_top_k=50)
    with pytest.raises(ValueError, match="any_top_p=False"):
        bik.verify_draft(torch.zeros(4, 0, dtype=torch.int64), 0, x[:, None], **params,
                         max_top_k=50, any_top_p=False)
    _, kc, vc, _ = _paged("cpu")
    k = torch.zeros(1, HKV, D)
    with pytest.raises(ValueError, match="slot 80 is outside the cache's 80 slots"):
        bik.write_kv_cache(kc, vc, k, k, torch.tensor([80]), validate=False)


@pytest.mark.parametrize("target", targets("interpreter", "gpu-triton", "gpu-cuda"))
def test_too_small_a_max_top_k_changes_tokens(target):
    """Why the bound matters (and BIK_DEBUG_CHECKS exists): on the split-vocabulary GPU path a
    max_top_k below a row's top_k keeps fewer tokens for that row, shown here to change what
    is drawn; so does a wrong any_top_p=False on Triton. (The CPU kernel reads each row's
    top_k itself and ignores the bound.)"""
    x, params = _logits(target.device, rows=1, vocab=100)
    dev = target.device
    # One row's logits drawn with 16 seeds, as 16 rows of one call (rows are independent).
    params = {**params, "top_k": torch.full((16,), 60, device=dev), "temperature": 5.0,
              "seed": torch.arange(16, device=dev), "position": torch.full((16,), 3, device=dev)}
    x = x.expand(16, -1).contiguous()
    draws = lambda bound: bik.sample(x, **params, max_top_k=bound,
                                     backend=target.backend).tokens
    assert torch.equal(draws(60), draws(99))
    assert not torch.equal(draws(60), draws(1))
    if target.backend == "triton":  # it skips the top-p search on any_top_p=False (CUDA: not)
        cut = {**params, "top_p": 0.3}
        draw_p = lambda any_top_p: bik.sample(x, **cut, max_top_k=99, any_top_p=any_top_p,
                                              backend=target.backend).tokens
        assert torch.equal(draw_p(None), draw_p(True))
        assert not torch.equal(draw_p(None), draw_p(False))


@pytest.mark.parametrize("target", targets("cpu", "interpreter", "gpu-triton", "gpu-cuda"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_strided_cache_is_written_and_read_in_place(target, dtype):
    """vLLM's layer cache, [blocks, Hkv, block_size, 2D] (a page per KV head: K rows, then V
    rows), viewed as bik's [blocks, block_size, Hkv, D]: written by write_kv_cache and read by
    attention in place, with the contiguous cache's bits. Nothing is copied whole: the views
    stay views of the engine's buffer."""
    dev, d = target.device, _head_dim(target)
    q, kc, vc, meta = _paged(dev, dtype, d)
    raw = torch.zeros(10, HKV, BLOCK, 2 * d, dtype=dtype, device=dev)
    pages = raw.view(10, HKV, 2 * BLOCK, d)
    k_view, v_view = (t.transpose(1, 2) for t in pages.chunk(2, dim=2))
    rows = torch.arange(10 * BLOCK, device=dev)
    for view in (k_view, v_view):
        assert view.data_ptr() in range(raw.data_ptr(), raw.data_ptr() + raw.nbytes)
    bik.write_kv_cache(k_view, v_view, kc.reshape(-1, HKV, d), vc.reshape(-1, HKV, d), rows,
                       validate=False)
    assert torch.equal(k_view, kc) and torch.equal(v_view, vc)
    want = bik.attention(q, kc, vc, **meta, backend=target.backend)
    with forbid_host_reads():
        got = bik.attention(q, k_view, v_view, **meta, max_seqlen_q=9, max_seqlen_k=24,
                            backend=target.backend)
    assert torch.equal(got, want)

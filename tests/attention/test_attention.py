"""bik.attention / attention_varlen / write_kv_cache: one token, the same bits under every
schedule, on the CPU backend and on the Triton kernels in the interpreter (targets()).

Proven per target: a token's output is the same in one prefill, in chunks, in decode and in
verify rows (fp32/bf16/fp16, GQA 1/3/8, and by hypothesis over lengths, chunks, page sizes and
GQA), under page sizes 1/7/16/64, among random neighbours at every batch row; paged,
contiguous-cache and varlen calls agree; accuracy vs fp64 within a measured multiple of torch
SDPA's; the ops (and write_kv_cache) pass opcheck. The Triton kernels keep the schedule, page
size, neighbour and accuracy checks in both launch modes (in-program fold, split + merge
kernel), which also agree with each other. CPU only: write_kv_cache writes its slots and skips
-1, torch.compile(fullgraph=True) keeps the bits. Negative controls: the same checks reject a
reference whose split count follows the length, stock fp32 SDPA on the CPU, and (interpreter)
the real Triton kernel with a SPLIT chosen by length.

Sizes: the CPU backend's split is 256 keys (bik.configs.CPU_ATTENTION_SPLIT), so CPU lengths
cross split boundaries; the interpreter table uses a split of 32 keys and blocks of 16, so
lengths of a few dozen cross several splits and several blocks per split (see
tests/matmul/test_matmul.py for what the interpreter can and cannot prove; the GPU tests are
tests/attention/test_attention_gpu.py and test_attention_gpu_backends.py).
"""

from __future__ import annotations

import dataclasses

import bik
import pytest
import torch
from attention_checks import (
    bik_attn,
    check_accuracy,
    check_layouts_agree,
    check_neighbours,
    check_page_sizes,
    mixed_batch,
    one_call,
    whole_prefill,
)
from bik.testing.attention import Request, chunking_report, make_request, pack_paged
from bik.testing.controls import (
    head_adaptive_attention,
    length_adaptive_attention,
    sdpa_attention,
)
from checks import DTYPES, assert_invariant
from hypothesis import given, settings
from hypothesis import strategies as st
from targets import targets
from torch.library import opcheck


def with_launch_modes(params):
    """(target, launch mode) params: the CPU backend has one mode (None); the Triton kernels
    run every test in both, each of which must keep the contract on its own."""
    out = []
    for p in params:
        modes = ("fold", "split") if p.values[0].backend == "triton" else (None,)
        out += [pytest.param(*p.values, m, marks=p.marks,
                             id=p.id if m is None else f"{p.id}-{m}") for m in modes]
    return out


def use_launch_mode(monkeypatch, mode) -> None:
    if mode is not None:
        from bik.ops.attention import triton as triton_attention

        monkeypatch.setattr(triton_attention, "use_split_mode", lambda *args: mode == "split")


TARGET_MODES = with_launch_modes(targets())


def check_chunking(attn, dtype, length, chunks, *, heads=(4, 2, 64), page_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    req = make_request(gen, length, *heads, dtype)
    assert_invariant(chunking_report(attn, req, chunks, page_size=page_size, seed=seed))


# --- schedules, page sizes, neighbours -----------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("target, mode", TARGET_MODES)
def test_prefill_chunks_decode_verify_same_bits(target, mode, dtype, monkeypatch):
    use_launch_mode(monkeypatch, mode)
    attn = bik_attn(target.backend)
    if target.small:
        check_chunking(attn, dtype, 70, (1, 7, 16, 33), heads=(4, 2, 16))
    elif dtype == torch.float32:
        for length in (1, 300, 600):
            check_chunking(attn, dtype, length, (1, 7, 64, 511))
    else:
        check_chunking(attn, dtype, 520, (1, 33, 256))


@pytest.mark.parametrize("gqa", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("target, mode", TARGET_MODES)
def test_chunking_gqa_ratios(target, mode, gqa, monkeypatch):
    use_launch_mode(monkeypatch, mode)
    length, chunks, d = (40, (1, 5), 16) if target.small else (270, (1, 16), 32)
    check_chunking(bik_attn(target.backend), torch.float32, length, chunks, heads=(*gqa, d))


@pytest.mark.parametrize("target, mode", TARGET_MODES)
def test_page_sizes(target, mode, monkeypatch):
    use_launch_mode(monkeypatch, mode)
    length, heads = (45, (4, 2, 16)) if target.small else (300, (4, 2, 64))
    check_page_sizes(bik_attn(target.backend), torch.float32, length, (16, 1, 64, 7),
                     heads=heads)


# A tensor-parallel rank's heads (bik.dvr.tp): (q heads, their KV head(s)) of an 8 q / 2 KV
# layout. Whole KV heads with all their q heads (TP 2), and at TP 4 and 8 a replica of one KV
# head with 2 or 1 of its 4 q heads: a GQA ratio of 2 or 1 instead of 4.
HEAD_SUBSETS = (((0, 1, 2, 3), (0,)), ((2, 3), (0,)), ((4, 5), (1,)), ((7,), (1,)))


def check_head_subsets(attn, length: int, d: int, seed: int = 0) -> None:
    """Every (token, q head) row of a call over a subset of the heads is the full call's bits,
    in a prefill and in a decode row."""
    gen = torch.Generator().manual_seed(seed)
    full = make_request(gen, length, 8, 2, d, torch.float32)

    def run(seq):
        prefill = whole_prefill(attn, seq, 16, torch.Generator().manual_seed(1))
        cache = pack_paged([seq], [length], 16, torch.Generator().manual_seed(2))
        return prefill, one_call(attn, seq, length - 1, length, cache)

    want = run(full)
    for q_heads, kv_heads in HEAD_SUBSETS:
        sub = Request(full.q[:, list(q_heads)], full.k[:, list(kv_heads)],
                      full.v[:, list(kv_heads)])
        for got, ref in zip(run(sub), want):
            if not torch.equal(got, ref[:, list(q_heads)]):
                raise AssertionError(f"rows differ: q heads {q_heads} with KV heads {kv_heads}")


@pytest.mark.parametrize("target, mode", TARGET_MODES)
def test_head_subsets_same_bits(target, mode, monkeypatch):
    """What a tensor-parallel rank computes (its q heads, KV heads replicated when TP exceeds
    them) is the unsharded call's bits: no config or split follows a head count."""
    use_launch_mode(monkeypatch, mode)
    check_head_subsets(bik_attn(target.backend), *((45, 16) if target.small else (300, 64)))


# (length, n_neighbours, max_len, q_lens by kind, heads) per target.small
NEIGHBOURS = {False: (400, 4, 600, {"decode": 1, "verify": 4, "chunk": 97}, (4, 2, 64)),
              True: (50, 3, 70, {"decode": 1, "verify": 4, "chunk": 19}, (4, 2, 16))}


@pytest.mark.parametrize("rows", ["decode", "verify", "chunk"])
@pytest.mark.parametrize("target, mode", TARGET_MODES)
def test_random_neighbours_and_rows(target, mode, rows, monkeypatch):
    use_launch_mode(monkeypatch, mode)
    length, n_neighbours, max_len, q_lens, heads = NEIGHBOURS[target.small]
    check_neighbours(bik_attn(target.backend), torch.float32, length, q_lens[rows],
                     n_neighbours=n_neighbours, max_len=max_len, heads=heads)


@pytest.mark.parametrize("target", targets())
@settings(deadline=None, derandomize=True, max_examples=8)
@given(length=st.integers(1, 60), chunk=st.integers(1, 20), page=st.sampled_from([1, 4, 16]),
       gqa=st.sampled_from([(2, 2), (4, 2), (3, 1)]))
def test_hypothesis_chunking(target, length, chunk, page, gqa):
    check_chunking(bik_attn(target.backend), torch.float32, length, (chunk,), heads=(*gqa, 16),
                   page_size=page)


# --- launch modes (Triton) -----------------------------------------------------------------

@pytest.mark.parametrize("target", targets("interpreter"))
def test_split_and_fold_modes_agree(target, monkeypatch):
    attn = bik_attn(target.backend)
    outs = []
    for mode in ("split", "fold"):
        use_launch_mode(monkeypatch, mode)
        gen = torch.Generator().manual_seed(0)
        req = make_request(gen, 75, 4, 2, 32, torch.bfloat16)
        cache = pack_paged([req], [75], 16, gen)
        outs.append(attn(req.q[60:], cache.k_cache, cache.v_cache, cache.cache_seqlens,
                         torch.tensor([0, 15], dtype=torch.int32), cache.block_table))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("target", targets("interpreter"))
def test_split_mode_runs_and_fused_merge_keep_fold_bits(target, monkeypatch):
    """SPLIT with 1, 2, 3 or all of a tile's splits per program (the last program to arrive
    folds every partial: the fused merge) gives FOLD's bits, for a batch of a prefill chunk,
    decode rows and a verify window whose tiles see different numbers of splits."""
    from bik.ops.attention import triton as triton_attention

    batch = mixed_batch(16)

    def run(mode, per=None):
        use_launch_mode(monkeypatch, mode)
        if per is not None:
            monkeypatch.setattr(triton_attention, "splits_per_program", lambda *args: per)
        return batch(target.backend)

    fold = run("fold")
    for per in (1, 2, 3, 5):  # 130 keys / 32 = 5 splits: 5 is one program per tile
        assert torch.equal(run("split", per), fold), per


# --- layouts, accuracy, opcheck ------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("target", targets())
def test_paged_contiguous_and_varlen_agree(target, dtype):
    lengths, heads = ([1, 20, 50], (4, 2, 32)) if target.small else ([1, 40, 300], (4, 2, 64))
    check_layouts_agree(target.backend, dtype, lengths, heads=heads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("target, mode", TARGET_MODES)
def test_accuracy(target, mode, dtype, monkeypatch):
    use_launch_mode(monkeypatch, mode)
    if target.small:
        check_accuracy(target.backend, dtype, [1, 33, 70], [1, 10, 70], heads=(4, 2, 32))
    else:
        check_accuracy(target.backend, dtype, [1, 77, 600], [1, 30, 600])


@pytest.mark.parametrize("target", targets())
def test_opcheck(target):
    gen = torch.Generator().manual_seed(5)
    reqs = [make_request(gen, n, 4, 2, 32, torch.float32) for n in (5, 9)]
    cache = pack_paged(reqs, [5, 9], 4, gen)
    q = torch.cat([reqs[0].q[3:], reqs[1].q[8:]])
    cu_q = torch.tensor([0, 2, 3], dtype=torch.int32)
    opcheck(torch.ops.bik.attention.default,
            (q, cache.k_cache, cache.v_cache, cache.cache_seqlens, cu_q, cache.block_table,
             0.2, True, target.backend))
    cu_k = torch.tensor([0, 5, 14], dtype=torch.int32)
    opcheck(torch.ops.bik.attention_varlen.default,
            (q, torch.cat([r.k for r in reqs]), torch.cat([r.v for r in reqs]), cu_q, cu_k, 0.2,
             True, target.backend))
    new_k = torch.randn(2, 2, 32, generator=gen)
    opcheck(torch.ops.bik.write_kv_cache.default,
            (cache.k_cache.clone(), cache.v_cache.clone(), new_k, new_k * 2,
             torch.tensor([3, -1])))


def test_write_kv_cache():
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(3, 2, 8)
    bik.write_kv_cache(k_cache, v_cache, k, -k, torch.tensor([5, -1, 11]))
    assert torch.equal(k_cache.view(-1, 2, 8)[5], k[0])
    assert torch.equal(v_cache.view(-1, 2, 8)[11], -k[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # the -1 slot wrote nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("validate", [True, False])
def test_write_kv_cache_cpu_copy_loop_equals_torch_indexing(monkeypatch, dtype, validate):
    """The CPU write's C++ row copies (the default) land exactly what torch's masked indexed
    assignment lands, into a strided view of a larger cache (vLLM's layout: a page holds K's
    rows then V's), with padding slots (-1) and, unvalidated, slots past the cache skipped."""
    from bik.ops.attention import cpu

    gen = torch.Generator().manual_seed(4)
    slots = torch.tensor([9, -1, 0, 23] + ([] if validate else [24, 400]))
    new_k = torch.randn(len(slots), 3, 8, generator=gen).to(dtype)

    def written(c_copy_loop: bool):
        if not c_copy_loop:
            monkeypatch.setattr(cpu, "write_rows_cpu", lambda *a: False)
        pool = torch.zeros(4, 3, 2 * 6, 8, dtype=dtype)  # [blocks, Hkv, 2 * block, D]
        k_cache, v_cache = (c.transpose(1, 2) for c in pool.chunk(2, dim=2))
        bik.write_kv_cache(k_cache, v_cache, new_k, -new_k, slots, validate=validate)
        monkeypatch.undo()
        return pool

    fast, slow = written(True), written(False)
    assert torch.equal(fast, slow)
    k_rows = fast.chunk(2, dim=2)[0].transpose(1, 2).reshape(-1, 3, 8)
    assert torch.equal(k_rows[23], new_k[3]) and int(k_rows.abs().sum(-1).sum(-1).gt(0).sum()) == 3


@pytest.mark.parametrize("target", targets("cpu"))
def test_torch_compile_fullgraph_keeps_bits(target):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 4, 32, generator=gen), torch.randn(9, 2, 32, generator=gen),
               torch.randn(9, 2, 32, generator=gen))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)

    def f(q, k, v):
        return bik.attention_varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                    backend=target.backend).out * 2

    assert torch.equal(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))


# --- negative controls ---------------------------------------------------------------------

def test_length_adaptive_reference_is_rejected():
    """Negative control: a split COUNT chosen by length fails the same chunking check."""
    with pytest.raises(AssertionError, match="rows differ"):
        check_chunking(length_adaptive_attention, torch.float32, 80, (1, 7), heads=(2, 1, 16))


def test_head_adaptive_reference_is_rejected():
    """Negative control: a split count that fills the SMs with (sequences x heads), as split-KV
    heuristics do, fails the head-subset check (a rank with fewer heads splits finer)."""
    with pytest.raises(AssertionError, match="rows differ"):
        check_head_subsets(head_adaptive_attention, 40, 16)


def test_stock_cpu_sdpa_fp32_is_rejected():
    """Measured on the project's CPUs: fp32 SDPA gives a token in decode other bits than in a
    causal prefill (2 of 2 probed tokens at lengths 64, 300 and 1000)."""
    with pytest.raises(AssertionError, match="rows differ"):
        check_chunking(sdpa_attention, torch.float32, 64, (1,))


@pytest.mark.parametrize("target", targets("interpreter"))
def test_same_check_rejects_a_split_size_chosen_by_length(target, monkeypatch):
    """Negative control on the real kernel: with SPLIT picked from the cached length (as
    length-adaptive split-KV does), the chunking check must fail."""
    from bik.ops.attention import triton as triton_attention

    fixed = triton_attention.attention_config
    launch = triton_attention.launch_attention

    def launch_with_split_by_length(*args, max_k_len, **kwargs):
        split = 16 if max_k_len < 40 else 32
        monkeypatch.setattr(triton_attention, "attention_config",
                            lambda *key: dataclasses.replace(fixed(*key), split=split))
        launch(*args, max_k_len=max_k_len, **kwargs)

    monkeypatch.setattr(triton_attention, "launch_attention", launch_with_split_by_length)
    with pytest.raises(AssertionError, match="rows differ"):
        check_chunking(bik_attn(target.backend), torch.float32, 70, (1,), heads=(4, 2, 16))

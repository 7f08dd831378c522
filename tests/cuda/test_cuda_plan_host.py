"""The CUDA kernels' index math and reduction schedule, checked on the CPU (no GPU needed).

csrc/cuda/matmul_plan.cuh and attention_plan.cuh are compiled on the host with g++
(-ffp-contract=off) together with tests/cuda/cuda_host/plan_shim.cpp, which replays the kernels'
programs (grid walk, split and block loops, skips, per-element operation order, warp butterfly
trees) from the headers' functions. These tests show, without a GPU:

* matmul: the K splits are bik.configs.matmul_split's (K alone, every arch), i.e. the groups
  and splits of the literal contract (bik/ops/matmul/reference.py); every output element meets
  the same (split, k) sequence — all of K exactly once, ascending — at every M and in both
  launch modes; the replayed fp32 kernel gives every row the bits it gets alone (M = 1 ... 130)
  in both modes, and equals the literal contract and the CPU backend bit for bit at every K.
* attention: the row limits, tile key ranges and splits follow absolute positions; the
  replayed kernel gives a token the same bits in one prefill, chunked prefill and decode, in
  fold and split mode, under every row packing, and is accurate against fp64.

The GPU tests (test_cuda_*_gpu.py) run the real kernels.
"""

from __future__ import annotations

import ctypes
import inspect
import math

import bik
import pytest
import torch
from bik import configs
from bik.ops.matmul.reference import matmul_contract_reference, split_ranges
from bik.testing.harness import rows_alone_vs_batched, same_bits
from checks import cpu_mul_add
from cuda_host_build import build_shim

I64, I32, F32P = ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p


@pytest.fixture(scope="module")
def shim():
    lib = build_shim("plan_shim.cpp")
    lib.mm_num_splits.restype = I32
    lib.mm_num_splits.argtypes = [I64, I64]
    lib.mm_split_range.argtypes = [I64, I64, I32, ctypes.POINTER(I64), ctypes.POINTER(I64)]
    lib.mm_k_schedule.restype = I32
    lib.mm_k_schedule.argtypes = [I32] * 10 + [F32P, F32P, I32]
    lib.mm_emulate_f32.argtypes = [F32P] * 4 + [I32] * 8
    lib.mm_mma_coords.argtypes = [I32, F32P, F32P, F32P]
    for name in ("attn_row_limit", "attn_tile_kv_end"):
        getattr(lib, name).restype = I64
    lib.attn_row_limit.argtypes = [I64, I64, I64, I32]
    lib.attn_tile_kv_end.argtypes = [I64, I64, I64, I32, I32]
    lib.attn_tile_splits.argtypes = [I64, I32]
    lib.attn_row_splits.argtypes = [I64, I32]
    lib.attn_keys_in_block.argtypes = [I64, I64, I32]
    lib.attn_key_offset.restype = I64
    lib.attn_key_offset.argtypes = [I64, I64, F32P, I64, F32P, I32, I64, I64]
    lib.attn_emulate_f32.argtypes = [F32P] * 5 + [I32] * 10 + [ctypes.c_float]
    return lib


def _ptr(t: torch.Tensor | None):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


# ---- matmul --------------------------------------------------------------------------------

KS = (0, 1, 15, 16, 17, 100, 1000, 1024, 2047, 2048, 2049, 3000, 4096, 4097, 14336, 28672)


def test_config_takes_no_m_and_splits_follow_k_only(shim):
    assert list(inspect.signature(configs.cuda_matmul_config).parameters) == [
        "dtype", "n", "k", "arch"]
    for arch in ("sm80", "sm90"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for k in KS:
                cfgs = {configs.cuda_matmul_config(dtype, n, k, arch) for n in (1, 77, 4096)}
                assert len(cfgs) == 1  # N does not change the splits either (today)
                cfg = cfgs.pop()
                plan = configs.matmul_split(dtype, 77, k)
                assert cfg.split_k == plan.split > 0
                n_splits = shim.mm_num_splits(k, cfg.split_k)
                assert n_splits == plan.n_splits(k) == max(1, math.ceil(k / cfg.split_k))
                lo, hi, covered, ranges = I64(), I64(), [], []
                for s in range(n_splits):
                    shim.mm_split_range(k, cfg.split_k, s, ctypes.byref(lo), ctypes.byref(hi))
                    assert lo.value == min(s * cfg.split_k, k) and lo.value <= hi.value
                    assert lo.value % cfg.block_k == 0  # splits start on a K block (16 B loads)
                    covered += range(lo.value, hi.value)
                    ranges.append((lo.value, hi.value))
                assert covered == list(range(k))  # all of K exactly once, ascending
                # The contract's groups, each one split or ungrouped: the flat fold is its fold.
                groups = split_ranges(k, plan)
                assert plan.groups == 1 or all(len(g) == 1 for g in groups)
                assert ranges == [r for g in groups for r in g], (k, plan)


def test_mma_fragment_coordinates_follow_the_ptx_table(shim):
    """The kernel reads A/B fragments and writes C through mma_*_coord; they must match the PTX
    ISA's m16n8k16 table (restated here) and cover each tile exactly once."""
    a_seen, b_seen, c_seen = [], [], []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a, b, c = (ctypes.c_int * 8)(), (ctypes.c_int * 4)(), (ctypes.c_int * 8)()
        shim.mm_mma_coords(lane, a, b, c)
        for reg in range(4):  # register reg holds a_{2reg} (low half) and a_{2reg+1}
            i = 2 * reg
            spec = (g if i < 2 or 4 <= i < 6 else g + 8, t * 2 + (i & 1) + (8 if i >= 4 else 0))
            assert (a[2 * reg], a[2 * reg + 1]) == spec
            a_seen += [spec, (spec[0], spec[1] + 1)]
        for reg in range(2):
            i = 2 * reg
            spec = (t * 2 + (i & 1) + (8 if i >= 2 else 0), g)
            assert (b[2 * reg], b[2 * reg + 1]) == spec
            b_seen += [spec, (spec[0] + 1, spec[1])]
        for e in range(4):
            spec = (g if e < 2 else g + 8, t * 2 + (e & 1))
            assert (c[2 * e], c[2 * e + 1]) == spec
            c_seen.append(spec)
    assert sorted(a_seen) == [(r, k) for r in range(16) for k in range(16)]
    assert sorted(b_seen) == [(k, n) for k in range(16) for n in range(8)]
    assert sorted(c_seen) == [(r, n) for r in range(16) for n in range(8)]


def _schedule(shim, m, n, k, split, spread, bm, bn, bk, row, col):
    cap = k + 1
    splits = (ctypes.c_int * cap)()
    ks = (ctypes.c_longlong * cap)()
    count = shim.mm_k_schedule(m, n, k, split, spread, bm, bn, bk, row, col,
                               ctypes.cast(splits, F32P), ctypes.cast(ks, F32P), cap)
    assert count <= cap
    return list(zip(splits[:count], ks[:count]))


@pytest.mark.parametrize("tile", [(64, 64, 16), (64, 128, 32)])
def test_every_element_sees_the_same_k_sequence_at_every_m(shim, tile):
    bm, bn, bk = tile
    n, k, split = 150, 300, 96  # splits [0,96) [96,192) [192,288) [288,300)
    expected = [(kk // split, kk) for kk in range(k)]
    for m in (1, 2, 3, 63, 64, 65, 127, 128, 129, 200):
        for spread in (0, 1):
            for row in {0, m // 2, m - 1}:
                for col in (0, 77, n - 1):
                    assert _schedule(shim, m, n, k, split, spread, bm, bn, bk, row, col) \
                        == expected, (m, spread, row, col)


def _emulate(shim, a, b, bias, split, spread, tile=(64, 64, 16)):
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n)
    shim.mm_emulate_f32(_ptr(a), _ptr(b), _ptr(bias), _ptr(c), m, n, k, split, spread, *tile)
    return c


def _contract(a, b, bias, split):
    """The split contract written out with torch fp32 ops (each op rounded on its own)."""
    m, k = a.shape
    total = None
    for lo in range(0, max(k, 1), split):
        acc = torch.zeros(m, b.shape[1])
        for kk in range(lo, min(lo + split, k)):
            acc = acc + a[:, kk:kk + 1] * b[kk:kk + 1, :]
        total = acc if total is None else total + acc
    return total if bias is None else total + bias


def test_replayed_fp32_kernel_rows_are_batch_invariant(shim):
    gen = torch.Generator().manual_seed(0)
    n, k, split = 70, 300, 64
    pool = torch.randn(130, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    bias = torch.randn(n, generator=gen)
    ms = (1, 2, 3, 7, 63, 64, 65, 130)
    for spread in (0, 1):
        report = rows_alone_vs_batched(lambda x, s=spread: _emulate(shim, x, b, bias, split, s),
                                       pool, ms, name=f"replayed fp32 spread={spread}")
        assert report.ok, report.summary()
    fold = _emulate(shim, pool, b, bias, split, 0)
    assert same_bits(fold, _emulate(shim, pool, b, bias, split, 1))
    assert same_bits(_emulate(shim, pool, b, bias, split, 0), _contract(pool, b, bias, split))


@pytest.mark.parametrize("k", [0, 1, 33, 300, 512, 2049, 3000, 4096])
def test_replayed_fp32_kernel_is_the_contract_and_the_cpu_backend(shim, k):
    """At every K (one split, G = 8 groups, splits of 1024) the replayed SIMT fp32 kernel is the
    literal two-level contract and the CPU backend, bit for bit, in both launch modes."""
    gen = torch.Generator().manual_seed(k)
    a, b = torch.randn(37, k, generator=gen), torch.randn(k, 45, generator=gen)
    bias = torch.randn(45, generator=gen)
    cfg = configs.cuda_matmul_config(torch.float32, 45, k, "sm90")
    want = matmul_contract_reference(a, b, bias, configs.matmul_split(torch.float32, 45, k))
    for spread in (0, 1):
        got = _emulate(shim, a, b, bias, cfg.split_k, spread,
                       (cfg.block_m, cfg.block_n, cfg.block_k))
        assert same_bits(got, want), (k, spread)
    assert same_bits(cpu_mul_add(a, b, bias), want)  # the CPU's mul-add sequence


def test_split_k_changes_bits_so_the_test_can_fail(shim):
    """Negative control: a split length picked by M would show up (different fold order)."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, 3000, generator=gen), torch.randn(3000, 16, generator=gen)
    assert not same_bits(_emulate(shim, a, b, None, 1024, 0), _emulate(shim, a, b, None, 512, 0))


# ---- attention ------------------------------------------------------------------------------

def test_row_limits_and_tile_key_ranges(shim):
    for causal in (0, 1):
        for seqlen, q_len in ((1, 1), (10, 1), (300, 7), (513, 513), (1000, 64)):
            for block_t in (1, 4, 16):
                for tile in range(math.ceil(q_len / block_t)):
                    rows = range(tile * block_t, min((tile + 1) * block_t, q_len))
                    lims = [shim.attn_row_limit(seqlen, q_len, t, causal) for t in rows]
                    # the absolute position of token t is seqlen - q_len + t
                    assert lims == [seqlen - q_len + t if causal else seqlen - 1 for t in rows]
                    end = shim.attn_tile_kv_end(seqlen, q_len, tile, block_t, causal)
                    assert end == max(lims) + 1
                    splits = shim.attn_tile_splits(end, 256)
                    assert splits == max(shim.attn_row_splits(lim, 256) for lim in lims)
    for lim in (-1, 0, 31, 32, 255, 256, 1000):
        for n0 in range(0, 1024, 32):
            used = shim.attn_keys_in_block(n0, lim, 32)
            assert used == len([p for p in range(n0, n0 + 32) if p <= lim])
        assert shim.attn_row_splits(lim, 256) == len({p // 256 for p in range(lim + 1)})


def test_key_offsets_paged_and_contiguous(shim):
    table = torch.tensor([[5, 2, 7], [1, 0, 3]], dtype=torch.int32)
    base = torch.tensor([0, 4096], dtype=torch.int64)
    for b in range(2):
        for pos in range(48):
            paged = shim.attn_key_offset(pos, b, _ptr(table), 3, None, 16, 1000, 10)
            assert paged == int(table[b, pos // 16]) * 1000 + (pos % 16) * 10
            flat = shim.attn_key_offset(pos, b, None, 0, _ptr(base), 1, 0, 10)
            assert flat == int(base[b]) + pos * 10


def _attn(shim, q, k, v, *, gh, block_t, split=32, causal=True, fold=True):
    q_len, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(q_len, hq)
    shim.attn_emulate_f32(_ptr(q), _ptr(k), _ptr(v), _ptr(out), _ptr(lse), q_len, k.shape[0],
                          hq, k.shape[1], d, gh, block_t, split, int(causal), int(fold),
                          ctypes.c_float(1.4426950408889634 / math.sqrt(d)))
    return out, lse


def test_replayed_attention_same_bits_for_every_schedule(shim):
    gen = torch.Generator().manual_seed(3)
    length, hq, hkv, d = 150, 4, 2, 16  # split 32: tokens cross four split boundaries
    q, k, v = (torch.randn(length, h, d, generator=gen) for h in (hq, hkv, hkv))
    whole, whole_lse = _attn(shim, q, k, v, gh=2, block_t=8)
    assert torch.isfinite(whole).all()
    schedules = {}
    for chunk in (1, 7, 64):
        for fold in (True, False):
            outs, lses = [], []
            for s in range(0, length, chunk):
                e = min(s + chunk, length)
                o, lse = _attn(shim, q[s:e], k[:e], v[:e], gh=2, block_t=8, fold=fold)
                outs.append(o)
                lses.append(lse)
            schedules[(chunk, fold)] = (torch.cat(outs), torch.cat(lses))
    for gh, block_t in ((1, 16), (2, 1), (2, 3)):  # other row packings, one prefill
        schedules[(gh, block_t)] = _attn(shim, q, k, v, gh=gh, block_t=block_t, fold=False)
    for name, (out, lse) in schedules.items():
        bad = [t for t in range(length) if not same_bits(out[t], whole[t])]
        assert not bad, f"{name}: tokens {bad[:10]} differ from one prefill"
        assert same_bits(lse, whole_lse), name


def test_replayed_attention_non_causal_and_accuracy(shim):
    gen = torch.Generator().manual_seed(4)
    length, hq, hkv, d = 90, 6, 2, 8
    q, k, v = (torch.randn(length, h, d, generator=gen) for h in (hq, hkv, hkv))
    for causal in (True, False):
        out, lse = _attn(shim, q, k, v, gh=3, block_t=5, causal=causal)
        alt, alt_lse = _attn(shim, q, k, v, gh=1, block_t=16, causal=causal, fold=False)
        assert same_bits(out, alt) and same_bits(lse, alt_lse)
        kk, vv = (x.double().repeat_interleave(hq // hkv, 1) for x in (k, v))
        s = torch.einsum("thd,lhd->htl", q.double(), kk) / math.sqrt(d)
        if causal:
            s = s.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.einsum("htl,lhd->thd", s.softmax(-1), vv)
        assert (out.double() - ref).abs().max() < 1e-5
        assert (lse.double() - torch.logsumexp(s, -1).T).abs().max() < 1e-5


def test_replayed_attention_split_by_length_fails(shim):
    """Negative control: a split size that followed the call (64 for a prefill, 32 for decode
    steps) gives tokens other bits, so the schedule test above can fail."""
    gen = torch.Generator().manual_seed(5)
    length, d = 100, 16
    q, k, v = (torch.randn(length, 2, d, generator=gen) for _ in range(3))
    whole, _ = _attn(shim, q, k, v, gh=2, block_t=8, split=64)
    steps = torch.cat([_attn(shim, q[p:p + 1], k[:p + 1], v[:p + 1], gh=2, block_t=8, split=32)[0]
                       for p in range(length)])
    assert sum(not same_bits(steps[t], whole[t]) for t in range(length)) > 10

"""The C++ CPU attention kernel (csrc/cpu/attention.h) gives the bits of its spec, the Python
reference ``attention_cpu_reference``, bit for bit (NaN compared as NaN, every other value by
its bit pattern): odd lengths and lengths across the 256-key split, prefill / chunk / decode /
verify rows in one batch, GQA 1/2/4/8, causal or not, head dims 16/40/64/128, fp32/bf16/fp16,
paged / contiguous / varlen layouts, strided inputs, non-finite inputs, thread counts and ISAs;
the same comparison rejects the kernel run with another split size. CPU backend only (the plain
process; skipped without the CPU extension).
"""

from __future__ import annotations

import math

import bik
import pytest
import torch
from bik.configs import CPU_ATTENTION_SPLIT
from bik.ops.attention.cpu import LOG2E, attention_cpu, attention_f32, cpu_keys
from bik.ops.attention.reference import attention_cpu_reference, reference_keys
from bik.runtime import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason=cpu_ext.unavailable_reason())

ISAS = [i for i in ("avx512", "avx2", "generic")
        if cpu_ext.available() and cpu_ext._ext.isa_supported(i)]
INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_same_bits(got, want):
    """Equal bit patterns, except that any NaN matches any NaN (the payload of a NaN is not
    part of the contract: the hardware picks it by operand order)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "NaN positions differ"
    bad = (got.view(INT[got.dtype]) != want.view(INT[want.dtype])) & ~nan
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} values differ"


def make(lens, q_lens, hq, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(sum(lens), hkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(lens), hkv, d, generator=gen).to(dtype)
    q = (torch.randn(sum(q_lens), hq, d, generator=gen) * 2).to(dtype)
    cu_k = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def reference(q, k, v, cu_q, lens, *, causal=True, table=None, base=None, scale=None):
    hkv, d = k.shape[-2], k.shape[-1]
    return attention_cpu_reference(
        q, reference_keys(k, v, table=table, base=base), cu_q=cu_q.tolist(), seqlens_k=list(lens),
        num_kv_heads=hkv, scale=1 / math.sqrt(d) if scale is None else scale, causal=causal)


def check_varlen(q, k, v, cu_q, cu_k, causal=True):
    lens = (cu_k[1:] - cu_k[:-1]).tolist()
    out, lse = bik.attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                    causal=causal, backend="cpu")
    ref_out, ref_lse = reference(q, k, v, cu_q, lens, causal=causal,
                                 base=cu_k[:-1].long() * k.stride(0))
    assert_same_bits(out, ref_out)
    assert_same_bits(lse, ref_lse)
    return out


def paged(k, v, lens, page, seed):
    """The sequences' K/V in a shuffled paged cache, NaN in every slot nobody owns."""
    hkv, d = k.shape[1], k.shape[2]
    pages = [-(-n // page) for n in lens]
    order = torch.randperm(sum(pages) + 3, generator=torch.Generator().manual_seed(seed))
    k_cache = torch.full((sum(pages) + 3, page, hkv, d), float("nan"), dtype=k.dtype)
    v_cache = k_cache.clone()
    table = torch.zeros(len(lens), max(pages, default=1), dtype=torch.int32)
    start, used = 0, 0
    for b, n in enumerate(lens):
        ids = order[used:used + pages[b]]
        used += pages[b]
        table[b, : pages[b]] = ids
        for t in range(n):
            k_cache[ids[t // page], t % page] = k[start + t]
            v_cache[ids[t // page], t % page] = v[start + t]
        start += n
    return k_cache, v_cache, table


# (lens, q_lens): one prefill, chunks, decode and verify rows, empty q rows, split boundaries.
BATCHES = [
    ([1], [1]),
    ([19], [19]),
    ([255, 256, 257], [255, 1, 4]),
    ([600, 1, 99, 513], [37, 1, 0, 513]),
    ([300, 7, 512], [300, 7, 5]),
]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_matches_reference(batch, causal):
    check_varlen(*make(*batch, 4, 2, 64, torch.float32, seed=len(batch[0])), causal=causal)


@pytest.mark.parametrize("gqa", [(3, 3), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("d", [16, 40, 128])
def test_gqa_and_head_dims(gqa, d):
    check_varlen(*make([270, 33], [270, 2], gqa[0], gqa[1], d, torch.float32, seed=d))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_16_bit(dtype, causal):
    check_varlen(*make([300, 9], [300, 3], 4, 2, 64, dtype, seed=1), causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 7, 16])
def test_paged_and_contiguous_caches(dtype, page):
    lens, q_lens = [300, 5, 257], [40, 1, 4]
    q, k, v, cu_q, cu_k = make(lens, q_lens, 4, 2, 64, dtype, seed=page)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    k_cache, v_cache, table = paged(k, v, lens, page, seed=page)
    out = bik.attention(q, k_cache, v_cache, cache_seqlens=seqlens, cu_seqlens_q=cu_q,
                        block_table=table, backend="cpu")
    ref, _ = reference(q, k_cache, v_cache, cu_q, lens, table=table)
    assert_same_bits(out, ref)
    # A strided contiguous cache [B, max_len, Hkv, D] (a view of a longer one), NaN past lengths.
    big = torch.full((2, len(lens), max(lens) + 9, 2, 64), float("nan"), dtype=dtype)
    for b, n in enumerate(lens):
        big[0, b, :n], big[1, b, :n] = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
    kc, vc = big[0, :, : max(lens) + 2], big[1, :, : max(lens) + 2]
    out_c = bik.attention(q, kc, vc, cache_seqlens=seqlens, cu_seqlens_q=cu_q, backend="cpu")
    ref_c, _ = reference(q, kc, vc, cu_q, lens, base=torch.arange(len(lens)) * kc.stride(0))
    assert_same_bits(out_c, ref_c)
    assert_same_bits(out_c, out)  # the layouts agree (the op's contract)


def test_strided_q_and_kv():
    """q, k and v as views into packed qkv rows (no copies on the fp32 path)."""
    lens, q_lens = [270, 12], [270, 3]
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(sum(lens), 2, 2, 40, generator=gen)
    qq = torch.randn(sum(q_lens), 6, 40, generator=gen)[:, 1:5]
    _, _, _, cu_q, cu_k = make(lens, q_lens, 4, 2, 40, torch.float32, seed=0)
    assert not qq.is_contiguous() and not kv[:, 0].is_contiguous()
    check_varlen(qq, kv[:, 0], kv[:, 1], cu_q, cu_k)


def _keys(k, v, cu_k):
    """cpu_keys for varlen k/v."""
    lens = cu_k[1:] - cu_k[:-1]
    return cpu_keys(k, v, lens, int(lens.max()), table=None, base=cu_k[:-1].long() * k.stride(0))


def test_threads_and_isas_do_not_change_bits():
    lens, q_lens = [700, 3, 300], [700, 1, 4]
    q, k, v, cu_q, cu_k = make(lens, q_lens, 8, 2, 64, torch.float32, seed=3)
    _, _, offsets = _keys(k, v, cu_k)
    outs = [attention_cpu(q, k, v, key_offsets=offsets, cu_q=cu_q, seqlens_k=cu_k.diff(),
                          scale=0.125, causal=True, num_threads=n) for n in (1, 2, 3, 7)]
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])
    for isa in ISAS:
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
        attention_f32(q, k, v, offsets, cu_q.long(), cu_k.diff().long(), out, lse,
                      split=CPU_ATTENTION_SPLIT, scale_log2e=0.125 * LOG2E, causal=True,
                      num_threads=2, isa=isa)
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1]), isa


def _read_keys(k32, offsets):
    """[n, Hkv, D] read the way the kernel does: element offsets[i] + h * stride(-2) + d."""
    hkv, d = k32.shape[-2], k32.shape[-1]
    size = k32.untyped_storage().nbytes() // k32.element_size() - k32.storage_offset()
    flat = torch.as_strided(k32, (size,), (1,), k32.storage_offset())
    idx = offsets[:, None, None] + torch.arange(hkv)[:, None] * k32.stride(-2) + torch.arange(d)
    return flat[idx]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_keys_point_at_what_reference_keys_reads(dtype):
    """fp32 and bf16 caches are read in place (offsets into the cache itself); fp16 ones are
    gathered into fp32 first."""
    lens = [37, 0, 300]
    _, k, v, _, cu_k = make(lens, [1, 0, 1], 2, 2, 16, dtype, seed=4)
    k_cache, v_cache, table = paged(k, v, lens, 16, seed=4)
    contiguous = torch.stack([k_cache[table[b]].flatten(0, 1)[:300] for b in range(3)])
    layouts = [(k_cache, v_cache, table, None), (k, v, None, cu_k[:-1].long() * k.stride(0)),
               (contiguous, contiguous, None, torch.arange(3) * contiguous.stride(0))]
    for kk, vv, tab, base in layouts:
        k32, v32, offsets = cpu_keys(kk, vv, torch.tensor(lens), max(lens), table=tab,
                                     base=base)
        keys_of = reference_keys(kk, vv, table=tab, base=base)
        in_place = dtype in (torch.float32, torch.bfloat16)
        assert k32.dtype == (dtype if in_place else torch.float32)
        assert (k32 is kk) == in_place and offsets.shape == (len(lens), max(lens))
        for b, n in enumerate(lens):
            rk, rv = keys_of(b, n)
            own = offsets[b, :n]
            assert torch.equal(_read_keys(k32, own).float(), rk.float())
            assert torch.equal(_read_keys(v32, own).float(), rv.float())


# ---- non-finite inputs: the kernel keeps whatever the reference does ----------------------------

def _poisoned(kind, causal, dtype=torch.float32):
    lens, q_lens = [600, 290], [600, 2]
    q, k, v, cu_q, cu_k = make(lens, q_lens, 4, 2, 16, dtype, seed=5)
    if kind == "q_nan":
        q[5, 1, 3] = float("nan")
    elif kind == "k_inf":
        k[100, 0, 2] = float("inf")
        k[700, 1, 0] = float("-inf")
    elif kind == "v_future":  # values past some rows' positions, in visible and in later splits
        v[40, 0, 1] = float("nan")
        v[300, 1, 5] = float("inf")
        v[599, 0, 7] = float("-inf")
        v[889, 1, 2] = float("nan")  # the decode sequence's last key
    elif kind == "k_huge":  # scores overflow to +-inf
        k[10:20] *= 1e38
    elif kind == "q_inf_row":
        q[600:602, 2] = float("-inf")
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: read in place
@pytest.mark.parametrize("kind", ["q_nan", "k_inf", "v_future", "k_huge", "q_inf_row"])
@pytest.mark.parametrize("causal", [True, False])
def test_non_finite_like_reference(kind, causal, dtype):
    out = check_varlen(*_poisoned(kind, causal, dtype), causal=causal)
    if kind == "q_nan":  # only the poisoned (token, head) is NaN
        nan = out.isnan().any(-1)
        assert nan[5, 1] and int(nan.sum()) == 1


def test_scale_and_tiny_shapes():
    for d in (1, 2):
        q, k, v, cu_q, cu_k = make([3, 1], [3, 1], 2, 1, d, torch.float32, seed=d)
        out, lse = bik.attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                        scale=3.7, backend="cpu")
        ref = reference(q, k, v, cu_q, [3, 1], base=cu_k[:-1].long() * k.stride(0), scale=3.7)
        assert_same_bits(out, ref[0])
        assert_same_bits(lse, ref[1])
    q, k, v, cu_q, cu_k = make([4], [0], 2, 1, 8, torch.float32, seed=0)
    out, lse = bik.attention_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="cpu")
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2)


def test_a_different_split_is_caught():
    """Negative control: the same comparison rejects the kernel run with another split size."""
    lens, q_lens = [300, 40], [300, 1]
    q, k, v, cu_q, cu_k = make(lens, q_lens, 4, 2, 64, torch.float32, seed=6)
    ref_out, _ = reference(q, k, v, cu_q, lens, base=cu_k[:-1].long() * k.stride(0))
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
    attention_f32(q, k, v, _keys(k, v, cu_k)[2], cu_q.long(), cu_k.diff().long(), out, lse,
                  split=CPU_ATTENTION_SPLIT // 2, scale_log2e=LOG2E / 8, causal=True)
    with pytest.raises(AssertionError, match="values differ"):
        assert_same_bits(out, ref_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_batch(dtype):
    q, cache = torch.zeros(0, 4, 16, dtype=dtype), torch.zeros(3, 16, 2, 16, dtype=dtype)
    none = torch.zeros(0, dtype=torch.int32)
    out = bik.attention(q, cache, cache, cache_seqlens=none, cu_seqlens_q=torch.zeros(1).int(),
                        block_table=torch.zeros(0, 2, dtype=torch.int32), backend="cpu")
    assert out.shape == (0, 4, 16)

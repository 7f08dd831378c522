"""bik_native's RMSNorm and paged attention (csrc/native/layers.h): the C++ kernels the direct
route and graphs compiled with grad off run on the CPU once the dispatcher kernels are loaded.

Proven here: they give the Python launchers' bits (fp32 and bf16, with and without the residual,
int32 and int64 metadata, vLLM's strided page layout, chunked prefill, decode and verify rows,
GQA); bik.rms_norm / bik.attention run them with the Python launchers refused, and keep the
invariance checks (rows alone vs batched; a token in a prefill, in chunks and in decode), which
fail here on a batch-dependent RMSNorm and on stock fp32 SDPA; every call they do not serve
(fp16, no host bounds, a bad page, wrong dtypes) reaches bik's op, with its bits or its error.
"""

from __future__ import annotations

import bik
import pytest
import torch
from bik.ops import _native
from bik.runtime import native_ext
from bik.testing import rows_alone_vs_batched, same_bits
from bik.testing.attention import chunking_report, make_request
from bik.testing.controls import sdpa_attention
from bik.testing.suites import rms_norm_suite
from checks import assert_invariant

pytestmark = pytest.mark.skipif(not native_ext.available(), reason="no C++ dispatcher kernels")

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture
def kernels():
    """bik_native's ops (defined from bik's schemas once the kernels load)."""
    assert _native.ready()
    return torch.ops.bik_native


def _launchers_refuse(monkeypatch):
    """The CPU backend's Python launchers raise: a call that reaches one did not go native."""
    from bik.ops.attention import cpu as attention_cpu
    from bik.ops.rms_norm import cpu as rms_norm_cpu

    def refuse(*args, **kwargs):
        raise AssertionError("the Python launcher ran")

    monkeypatch.setattr(rms_norm_cpu, "launch_rms_norm", refuse)
    monkeypatch.setattr(attention_cpu, "run_attention", refuse)


# ---- RMSNorm ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m, h", [(1, 576), (8, 576), (3, 1), (5, 777), (64, 4096)])
def test_rms_norm_kernels_give_the_launchers_bits(kernels, dtype, m, h, gen):
    x, r = (torch.randn(m, h, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(h, generator=gen).to(dtype)
    with torch.no_grad():
        assert same_bits(kernels.rms_norm(x, w, 1e-5), torch.ops.bik.rms_norm(x, w, 1e-5, "cpu"))
        got = kernels.fused_add_rms_norm(x, w, 1e-5, r)
        want = torch.ops.bik.fused_add_rms_norm(x, w, 1e-5, r, "cpu")
        assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
        # strided rows (a column slice, as vLLM's fused projections hand over)
        wide = torch.randn(m, 2 * h, generator=gen).to(dtype)
        assert wide[:, :h].stride(0) == 2 * h
        assert same_bits(kernels.rms_norm(wide[:, :h], w, 0.0),
                         torch.ops.bik.rms_norm(wide[:, :h], w, 0.0, "cpu"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_direct_route_runs_the_kernel_and_stays_row_invariant(kernels, dtype,
                                                                       monkeypatch):
    _launchers_refuse(monkeypatch)
    with torch.no_grad():
        assert_invariant(rms_norm_suite(device="cpu", dtype=dtype, backend="cpu",
                                        ms=(1, 2, 3, 8, 17, 64), hiddens=(1, 576, 777),
                                        probe_batch=12))


def test_rms_norm_control_fails_the_same_check(kernels, gen):
    """Negative control: a norm whose rows see the batch (a share of the batch's mean square
    mixed into each row's) fails the check the native kernel passes."""
    def batch_dependent(x, weight):
        x32 = x.float()
        ms = x32.pow(2).mean(-1, keepdim=True) + 1e-3 * x32.pow(2).mean()
        return (x32 * torch.rsqrt(ms + 1e-6) * weight.float()).to(x.dtype)

    pool, w = torch.randn(8, 576, generator=gen), torch.randn(576, generator=gen)
    with torch.no_grad():
        assert rows_alone_vs_batched(lambda x: bik.rms_norm(x, w), pool, (1, 8)).ok
        assert not rows_alone_vs_batched(lambda x: batch_dependent(x, w), pool, (1, 8)).ok


def test_rms_norm_calls_the_kernel_does_not_serve_reach_the_op(kernels, gen):
    x = torch.randn(4, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    with torch.no_grad():
        half = x.half()  # fp16 rows: bik's op widens them in torch
        assert same_bits(kernels.rms_norm(half, w.half(), 1e-6),
                         torch.ops.bik.rms_norm(half, w.half(), 1e-6, "cpu"))
        with pytest.raises(TypeError, match="bik.rms_norm: residual .* must have x's dtype"):
            kernels.fused_add_rms_norm(x, w, 1e-6, x.bfloat16())
        with pytest.raises(ValueError, match="bik.rms_norm: weight .* does not match"):
            kernels.rms_norm(x, w[:10], 1e-6)
        with pytest.raises(ValueError, match="bik.rms_norm: eps must be finite"):
            kernels.rms_norm(x, w, float("nan"))
        with pytest.raises(ValueError, match="bik.rms_norm: eps must be finite"):
            bik.rms_norm(x, w, -1.0)


# ---- paged attention ----------------------------------------------------------------------------

def _vllm_cache(gen, dtype, num_blocks=32, hkv=3, block=16, d=64):
    """vLLM-CPU's [num_blocks, Hkv, block, 2 * D] layer cache as bik's K and V page views."""
    kv = torch.randn(num_blocks, hkv, block, 2 * d, generator=gen).to(dtype)
    k, v = kv.view(num_blocks, hkv, 2 * block, d).chunk(2, dim=2)
    return k.transpose(1, 2), v.transpose(1, 2)


def _step(gen, dtype, q_lens, k_lens, *, hq=9, meta=torch.int32, block=16):
    k, v = _vllm_cache(gen, dtype, block=block)
    q = torch.randn(sum(q_lens), hq, k.shape[-1], generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=meta)
    lens = torch.tensor(k_lens, dtype=meta)
    pages = -(-max(k_lens) // block) + 1  # room past the longest sequence
    table = torch.randperm(k.shape[0], generator=gen)[:len(k_lens) * pages]
    table = table.view(len(k_lens), pages).to(meta)
    return q, k, v, lens, cu, table, max(q_lens), max(k_lens)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("meta", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("q_lens, k_lens", [((1,), (40,)), ((1,) * 8, tuple(range(30, 38))),
                                            ((7, 1, 3), (7, 50, 33)), ((4,), (64,))])
def test_attention_kernel_gives_the_launchers_bits(kernels, dtype, meta, q_lens, k_lens, gen):
    q, k, v, lens, cu, table, mq, mk = _step(gen, dtype, q_lens, k_lens, meta=meta)
    for bounds in ((mq, mk), (mq + 2, mk + 5)):  # larger bounds never change the bits
        got = kernels.attention(q, k, v, lens, cu, table, 0.125, True, *bounds)
        want = torch.ops.bik.attention(q, k, v, lens, cu, table, 0.125, True, "cpu", *bounds)
        assert same_bits(got, want)


def _native_attn(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table):
    plan = bik.plan_attention(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                              cu_seqlens_q=cu_seqlens_q, block_table=block_table)
    return bik.attention(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                         cu_seqlens_q=cu_seqlens_q, block_table=block_table, **plan._asdict())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_direct_route_runs_the_kernel_prefill_chunks_decode_same_bits(
        kernels, dtype, monkeypatch):
    _launchers_refuse(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    req = make_request(gen, 300, 6, 2, 32, dtype)
    with torch.no_grad():
        assert_invariant(chunking_report(_native_attn, req, (1, 7, 64), page_size=16, seed=0))


def test_attention_control_fails_the_same_check(kernels):
    """Negative control, measured here: stock fp32 SDPA gives a token in decode other bits than
    in a causal prefill."""
    gen = torch.Generator().manual_seed(0)
    req = make_request(gen, 64, 2, 1, 16, torch.float32)
    with pytest.raises(AssertionError, match="rows differ"):
        assert_invariant(chunking_report(sdpa_attention, req, (1,), page_size=16, seed=0))


def test_attention_calls_the_kernel_does_not_serve_reach_the_op(kernels, gen):
    q, k, v, lens, cu, table, mq, mk = _step(gen, torch.float32, (1, 1), (40, 20))
    with torch.no_grad():
        # fp16 (gathered in torch by the op) and no host bounds: the op's bits
        h = [t.half() for t in (q, k, v)]
        assert same_bits(kernels.attention(*h, lens, cu, table, 0.125, True, mq, mk),
                         torch.ops.bik.attention(*h, lens, cu, table, 0.125, True, "cpu", mq, mk))
        assert same_bits(kernels.attention(q, k, v, lens, cu, table, 0.125, True, None, None),
                         torch.ops.bik.attention(q, k, v, lens, cu, table, 0.125, True, "cpu"))
        with pytest.raises(TypeError, match="bik.attention: k .* must have q's dtype"):
            kernels.attention(q, k.bfloat16(), v, lens, cu, table, 0.125, True, mq, mk)
        with pytest.raises(ValueError, match="bik.attention: max_seqlen_k=.* exceeds"):
            kernels.attention(q, k, v, lens, cu, table, 0.125, True, mq, 10_000)
        # served, refused by the kernel's own check: a page outside the cache, a length past
        # the host bound
        bad = table.clone()
        bad[1, 1] = k.shape[0]
        with pytest.raises(ValueError, match="bik.attention: sequence 1: key 16 lies outside"):
            kernels.attention(q, k, v, lens, cu, bad, 0.125, True, mq, mk)
        with pytest.raises(ValueError, match="bik.attention: sequence 0 has 40 keys but"):
            kernels.attention(q, k, v, lens, cu, table, 0.125, True, mq, 30)


def test_the_kernels_compile_with_grad_off(kernels, gen):
    """A graph compiled with grad off calls bik_native's ops where it would call bik's on the
    CPU backend, with their bits."""
    q, k, v, lens, cu, table, mq, mk = _step(gen, torch.bfloat16, (1, 1), (40, 20))
    x = torch.randn(2, 576, generator=gen).bfloat16()
    w = torch.ones(576)

    def step(q, x):
        out, h = bik.rms_norm(x, w, 1e-5, residual=x)
        return bik.attention(q, k, v, cache_seqlens=lens, cu_seqlens_q=cu, block_table=table,
                             scale=0.125, max_seqlen_q=mq, max_seqlen_k=mk), out, h

    with torch.no_grad():
        want = step(q, x)
        got = torch.compile(step, fullgraph=True)(q, x)
    assert all(same_bits(a, b) for a, b in zip(got, want))


# ---- the KV cache write -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
def test_kv_write_kernel_writes_what_the_op_writes(kernels, dtype, slot_dtype, gen):
    """vLLM's strided page views and a flat [slots, Hkv, D] cache; a padding slot (-1) and a
    slot past the cache are skipped, as the op's copy loop does."""
    for layout in ("vllm", "flat"):
        caches = []
        for _ in range(2):  # the same start for the kernel and for the op
            if layout == "vllm":
                k, v = _vllm_cache(torch.Generator().manual_seed(1), dtype)
            else:
                kv = torch.randn(2, 40, 3, 64, generator=torch.Generator().manual_seed(1))
                k, v = kv.to(dtype).unbind(0)
            caches.append((k, v))
        n_slots = caches[0][0].numel() // (3 * 64)
        slots = torch.tensor([5, -1, n_slots - 1, n_slots + 3, 17], dtype=slot_dtype)
        new_k, new_v = (torch.randn(5, 3, 64, generator=gen).to(dtype) for _ in range(2))
        with torch.no_grad():
            kernels.write_kv_cache(*caches[0], new_k, new_v, slots, False)
            torch.ops.bik.write_kv_cache(*caches[1], new_k, new_v, slots, False)
        assert all(same_bits(a, b) for a, b in zip(caches[0], caches[1])), layout
        assert same_bits(caches[0][0].reshape(-1, 3, 64)[17], new_k[4]), layout


def test_kv_write_direct_route_runs_the_kernel(kernels, monkeypatch, gen):
    from bik.ops.attention import cpu as attention_cpu

    def refuse(*args, **kwargs):
        raise AssertionError("the Python copy loop ran")

    monkeypatch.setattr(attention_cpu, "write_rows_cpu", refuse)
    k, v = _vllm_cache(gen, torch.bfloat16)
    new = torch.randn(2, 3, 64, generator=gen).bfloat16()
    with torch.no_grad():
        bik.write_kv_cache(k, v, new, new, torch.tensor([3, 70]), validate=False)
        assert same_bits(k[70 // 16, 70 % 16], new[1]) and same_bits(v[0, 3], new[0])
        with pytest.raises(AssertionError, match="copy loop ran"):  # validate=True: the op's
            bik.write_kv_cache(k, v, new, new, torch.tensor([3, 70]))


def test_kv_write_calls_the_kernel_does_not_serve_reach_the_op(kernels, gen):
    k, v = _vllm_cache(gen, torch.float32)
    new = torch.randn(2, 3, 64, generator=gen)
    with torch.no_grad():
        with pytest.raises(ValueError, match="bik.write_kv_cache: slot_mapping names a slot more"):
            kernels.write_kv_cache(k, v, new, new, torch.tensor([3, 3]), True)
        with pytest.raises(ValueError, match="bik.write_kv_cache: k_cache and v_cache are the"):
            kernels.write_kv_cache(k, k, new, new, torch.tensor([3, 4]), False)
        with pytest.raises(TypeError, match="bik.write_kv_cache: new k/v"):
            kernels.write_kv_cache(k, v, new.bfloat16(), new.bfloat16(), torch.tensor([3, 4]),
                                   False)


# ---- RoPE (the vLLM plugin's, in one call) ------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_is_hugging_faces_arithmetic(kernels, dtype, rotary_dim, gen):
    """rope.h's RoPE (neox style) gives transformers' apply_rotary_pos_emb bits, the formula
    vLLM's forward_native runs too (tests/vllm_plugin compares with vLLM's own), passing the
    entries past rotary_dim through; positions out of the table are not served (None)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    module = native_ext.module()
    tokens, heads, head = 5, 3, 64
    freqs = torch.randn(100, rotary_dim // 2, generator=gen)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)
    x = torch.randn(tokens, heads * head, generator=gen).to(dtype)
    pos = torch.tensor([0, 7, 99, 7, 3])
    got = module.rope(pos, x, cache, head, rotary_dim, True)
    cos, sin = cache[pos].chunk(2, dim=-1)
    rot = x.view(tokens, heads, head)[..., :rotary_dim]  # [seq, heads, d]: cos on dim 1
    q, _ = apply_rotary_pos_emb(rot, rot, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
    want = torch.cat([q, x.view(tokens, heads, head)[..., rotary_dim:]], -1)
    assert same_bits(got, want.reshape(tokens, heads * head))
    assert module.rope(torch.tensor([100]), x[:1], cache, head, rotary_dim, True) is None
    assert module.rope(pos, x.half(), cache.half(), head, rotary_dim, True) is None


def test_rope_gptj_style_interleaves(kernels, gen):
    """GPT-J style: the even and odd entries are the pairs, each result rounded per op."""
    module = native_ext.module()
    cache = torch.randn(10, 16, generator=gen).bfloat16()
    x = torch.randn(2, 16, generator=gen).bfloat16()
    pos = torch.tensor([3, 9])
    cos, sin = cache[pos].chunk(2, dim=-1)
    x1, x2 = x[:, 0::2], x[:, 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    want = torch.stack([o1, o2], dim=-1).flatten(-2)
    assert same_bits(module.rope(pos, x, cache, 16, 16, False), want)


# ---- bik.PackedWeight's product -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_packed_product_runs_in_cpp_with_the_python_routes_bits(kernels, dtype, monkeypatch,
                                                                gen):
    """Once the kernels are loaded a packed product is one C++ call (the same kernel call as
    the Python route): the same bits, with and without a bias, on rows of any leading shape and
    strided rows; what it does not serve (fp16 panels, a wrong dtype or K) takes the Python
    route and its errors."""
    from bik.ops.matmul import packed as packed_module

    w = torch.randn(96, 70, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    pw = bik.PackedWeight(w)
    xs = [torch.randn(1, 70, generator=gen).to(dtype),
          torch.randn(2, 3, 70, generator=gen).to(dtype),
          torch.randn(5, 140, generator=gen).to(dtype)[:, ::2]]
    with torch.no_grad():
        fast = [(pw(x), pw(x, bias)) for x in xs]
        monkeypatch.setattr(packed_module, "_native_product", lambda: None)
        slow = [(pw(x), pw(x, bias)) for x in xs]
    assert all(same_bits(a, b) for f, s in zip(fast, slow) for a, b in zip(f, s))
    monkeypatch.undo()
    served = torch.float16 != dtype
    calls = []
    real = packed_module._native_product()

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(packed_module, "_native_product", lambda: counting)
    out = pw(xs[0])
    assert out.dtype == dtype and calls == [1]  # the C++ route was asked first
    assert (real(xs[0], None, pw._panels_ptr, 96, 70, pw._split, pw._dot) is not None) == served
    with pytest.raises(ValueError, match="bik.PackedWeight: x is torch.float64"):
        pw(xs[0].double())
    with pytest.raises(ValueError, match="disagree on K"):
        pw(torch.randn(1, 71).to(dtype))

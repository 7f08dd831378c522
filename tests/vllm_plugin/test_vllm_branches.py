"""The plugin's branches that the CPU engine tests do not reach, in-process on CPU tensors:
vLLM's RMSNorm IR ops on bik (which the engine runs too; here their dispatch), the CUDA
FLASH_ATTN backend's cache layout and metadata, the refusal of a backend bik does not replace,
and the GEMM vLLM's linear methods get on CUDA. None of this has run on a GPU."""

from __future__ import annotations

import inspect

import pytest

vllm = pytest.importorskip("vllm")

import bik
import torch
from bik.integrations.vllm import attention, guard, linear, norm


@pytest.fixture
def norm_installed(monkeypatch):
    """norm.install() with every global it touches restored afterwards."""
    from vllm import ir
    from vllm.platforms import current_platform

    platform = type(current_platform)  # undone by deleting it from the class (or restoring)
    monkeypatch.setattr(platform, "get_default_ir_op_priority",
                        inspect.getattr_static(platform, "get_default_ir_op_priority"))
    for name in ("rms_norm", "fused_add_rms_norm"):
        op = getattr(ir.ops, name)
        monkeypatch.setattr(op, "impls", dict(op.impls))
        monkeypatch.setattr(op, "_priority_impls", list(op._priority_impls))
        monkeypatch.setattr(op, "set_default", op.set_default)
    monkeypatch.setattr(guard, "UNROUTED", {})
    norm.install()
    norm.install()  # vLLM loads plugins several times per process
    return ir.ops, current_platform


def _priority(current_platform):
    from vllm.config import VllmConfig

    return current_platform.get_default_ir_op_priority(VllmConfig())


def test_rms_norm_ir_ops_run_bik_first(norm_installed):
    ops, current_platform = norm_installed
    config = _priority(current_platform)
    assert config.rms_norm[0] == config.fused_add_rms_norm[0] == "bik"
    assert config.rms_norm.count("bik") == 1
    config.set_default()  # what every worker does at start
    torch.manual_seed(0)
    x, residual, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    calls = norm.CALLS[0]
    assert torch.equal(ops.rms_norm(x, w, 1e-5), bik.rms_norm(x, w, 1e-5))
    out, h = ops.fused_add_rms_norm(x, residual, w, 1e-5)
    ref_out, ref_h = bik.rms_norm(x, w, 1e-5, residual=residual)
    assert torch.equal(out, ref_out) and torch.equal(h, ref_h)
    # A layer without a weight (has_weight=False) normalizes with ones.
    assert torch.equal(ops.rms_norm(x, None, 1e-5), bik.rms_norm(x, torch.ones(64), 1e-5))
    assert norm.CALLS[0] == calls + 3
    # RMS over a prefix of the row is not bik's contract: vLLM's native implementation runs.
    prefix = ops.rms_norm(x, w, 1e-5, 32)
    assert norm.CALLS[0] == calls + 3
    assert torch.allclose(prefix, ops.rms_norm.impls["native"].impl_fn(x, w, 1e-5, 32))
    assert guard.UNROUTED == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_has_transformers_rounding_points(norm_installed, dtype):
    """transformers' LlamaRMSNorm under bik.enable() (its mean on bik) gives the plugin's
    bits, plain and after the residual add (which transformers rounds to the dtype first).
    In bf16 bik's own one-rounding (h * rstd) * weight does not: the control."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ops, current_platform = norm_installed
    _priority(current_platform).set_default()
    torch.manual_seed(1)
    x, residual = torch.randn(7, 576).to(dtype), torch.randn(7, 576).to(dtype)
    hf = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(576) + 0.5)
        with bik.enabled():
            want, want_fused = hf(x), hf((x + residual).to(dtype))
    assert torch.equal(ops.rms_norm(x, hf.weight.detach(), 1e-5), want)
    out, h = ops.fused_add_rms_norm(x, residual, hf.weight.detach(), 1e-5)
    assert torch.equal(out, want_fused) and torch.equal(h, (x + residual).to(dtype))
    one_rounding = bik.rms_norm(x, hf.weight.detach(), 1e-5)
    assert torch.equal(one_rounding, want) == (dtype == torch.float32)


def test_rms_norm_priority_set_elsewhere_is_reported(norm_installed):
    ops, _ = norm_installed
    ops.rms_norm.set_default(["native"])  # e.g. ir_op_priority={"rms_norm": ["native"]}
    assert guard.UNROUTED == {"ir.rms_norm:native": 1}


def _flash_impl():
    from bik.integrations.vllm.attention_cuda import BikFlashAttentionImpl

    return BikFlashAttentionImpl(num_heads=4, head_size=8, scale=0.3, num_kv_heads=2,
                                 alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")


def test_flash_attn_cache_views_are_vllms_own_split():
    """bik's K/V views of a FLASH_ATTN layer cache are the tensors vLLM's FlashAttention
    reads: same storage, offsets, shapes and strides."""
    from bik.integrations.vllm.attention_cuda import flash_paged_kv

    kv_cache = torch.randn(6, 2, 16, 2 * 8)  # [num_blocks, Hkv, block_size, 2 * D]
    ours = flash_paged_kv(kv_cache)
    theirs = kv_cache.transpose(1, 2).split(8, dim=-1)  # flash_attn.py's forward
    for a, b in zip(ours, theirs):
        assert (a.shape, a.stride(), a.storage_offset()) == \
            (b.shape, b.stride(), b.storage_offset())
        assert a.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()


def test_flash_attn_backend_writes_and_attends_like_bik():
    """Two requests through the FLASH_ATTN impl (padded keys, a -1 padding slot) give what
    bik.attention gives on bik's own paged layout holding the same rows."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

    impl = _flash_impl()
    torch.manual_seed(1)
    block_size, hkv, d, h = 4, 2, 8, 4
    seq_lens = torch.tensor([7, 3], dtype=torch.int32)  # both prefills from empty
    block_table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    slots = [int(block_table[r, p // block_size]) * block_size + p % block_size
             for r, n in enumerate(seq_lens.tolist()) for p in range(n)]
    slot_mapping = torch.tensor(slots + [-1])  # one padding token, dropped by the writer
    n = len(slots)
    key, value = torch.randn(n + 2, hkv, d), torch.randn(n + 2, hkv, d)  # 2 rows of padding
    query = torch.randn(n + 2, h, d)
    kv_cache = torch.zeros(4, hkv, block_size, 2 * d)
    impl.do_kv_cache_update(None, key, value, kv_cache, slot_mapping)
    for t, s in enumerate(slots):  # vLLM's layout: K then V side by side in the last dim
        assert torch.equal(kv_cache[s // block_size, :, s % block_size, :d], key[t])
        assert torch.equal(kv_cache[s // block_size, :, s % block_size, d:], value[t])
    md = FlashAttentionMetadata(
        num_actual_tokens=n, max_query_len=7, query_start_loc=torch.tensor([0, 7, 10],
                                                                           dtype=torch.int32),
        max_seq_len=7, seq_lens=seq_lens, block_table=block_table, slot_mapping=slot_mapping)
    output = torch.full((n + 2, h * d), 5.0)
    calls = attention.CALLS[0]
    impl.forward(None, query, key, value, kv_cache, md, output)
    assert attention.CALLS[0] == calls + 1
    k_ref, v_ref = torch.zeros(4, block_size, hkv, d), torch.zeros(4, block_size, hkv, d)
    bik.write_kv_cache(k_ref, v_ref, key[:n], value[:n], torch.tensor(slots))
    expected = bik.attention(query[:n], k_ref, v_ref, cache_seqlens=seq_lens,
                             cu_seqlens_q=md.query_start_loc, block_table=block_table,
                             scale=0.3, max_seqlen_q=7, max_seqlen_k=7)
    assert torch.equal(output[:n], expected.reshape(n, h * d))
    assert torch.equal(output[n:], torch.full((2, h * d), 5.0))  # padding rows untouched


def test_a_layers_cache_views_follow_its_cache():
    """The views of a layer cache are made once and reused while the layer's cache is the same
    tensor over the same memory; a new cache tensor, or the same tensor re-pointed (set_),
    gets new views, so a write lands in the cache the layer holds now."""
    impl = _flash_impl()
    key = value = torch.ones(1, 2, 8)
    slot = torch.tensor([5])
    first = torch.zeros(4, 2, 4, 16)
    impl.do_kv_cache_update(None, key, value, first, slot)
    views = impl._bik_kv_views
    impl.do_kv_cache_update(None, key, value, first, slot)
    assert impl._bik_kv_views is views  # reused
    second = torch.zeros(4, 2, 4, 16)
    impl.do_kv_cache_update(None, key, value, second, slot)
    assert second[1, :, 1].eq(1).all()
    second.set_(torch.zeros(4, 2, 4, 16))  # the same tensor, other memory
    impl.do_kv_cache_update(None, key, value, second, slot)
    assert second[1, :, 1].eq(1).all()


@pytest.mark.parametrize("field, value, what", [
    ("causal", False, "non-causal attention"),
    ("rswa_window", 64, "reference sliding-window attention"),
])
def test_flash_attn_refuses_what_a_step_asks_for(field, value, what):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

    one = torch.tensor([0, 1], dtype=torch.int32)
    md = FlashAttentionMetadata(num_actual_tokens=1, max_query_len=1, query_start_loc=one,
                                max_seq_len=1, seq_lens=one[1:], block_table=one[None, :1],
                                slot_mapping=one[:1], **{field: value})
    with pytest.raises(NotImplementedError, match=f"bik.integrations.vllm: {what}"):
        _flash_impl().forward(None, torch.zeros(1, 4, 8), None, None,
                              torch.zeros(1, 2, 16, 16), md, torch.zeros(1, 32))


def test_flash_attn_backend_declares_what_bik_serves():
    from bik.integrations.vllm.attention_cuda import BikFlashAttentionBackend
    from vllm.v1.attention.backend import AttentionCGSupport

    backend = BikFlashAttentionBackend
    builder = backend.get_builder_cls()
    # Piecewise graphs only: bik plans its KV splits from each step's host maxima.
    assert builder._cudagraph_support == AttentionCGSupport.NEVER
    assert torch.float32 in backend.supported_dtypes
    assert not backend.supports_kv_cache_dtype("fp8")
    assert not backend.supports_sink() and not backend.supports_non_causal()
    assert backend.supports_attn_type("decoder") and not backend.supports_attn_type("encoder")


def test_another_attention_backend_is_refused():
    from bik.integrations.vllm.attention_cuda import BikFlashAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    for backend in (BikFlashAttentionBackend, attention.BikCPUAttentionBackend):
        assert attention.require_bik_backend(backend) is backend
    for backend in (FlashAttentionBackend, TritonAttentionBackend):
        with pytest.raises(NotImplementedError, match=f"chose the {backend.get_name()} "):
            attention.require_bik_backend(backend)


def _one_rank(monkeypatch) -> None:
    """vLLM's parallel groups as a single-rank engine has them (none exist in-process here)."""
    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_pp_group",
                        lambda: type("Group", (), {"world_size": 1})())


def test_linear_methods_get_bik_gemm_on_cuda(monkeypatch):
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform

    original = object()
    dispatch = linear._gemm_on_cuda(lambda backend="auto": original)
    assert dispatch("auto") is original  # this CPU: vLLM's own (layer.cpu_linear, bik's)
    monkeypatch.setattr(type(current_platform), "is_cuda", classmethod(lambda cls: True))
    gemm = dispatch("flashinfer_cutlass")
    assert gemm is linear._cuda_gemm
    torch.manual_seed(2)
    x, w, b = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    monkeypatch.setattr(linear, "_CHECKED", [False])
    _one_rank(monkeypatch)
    assert torch.equal(gemm(None, x, w, b), bik.linear(x, w, b))
    monkeypatch.setattr(linear, "_CHECKED", [False])
    monkeypatch.setattr(parallel_state, "get_pp_group",
                        lambda: type("Group", (), {"world_size": 2})())
    with pytest.raises(NotImplementedError, match="pipeline parallel size 2 is not served"):
        gemm(None, x, w, b)


@pytest.mark.parametrize("pack, dtype, packed", [("1", torch.float32, True),
                                                  ("1", torch.float16, True),
                                                  ("1", torch.bfloat16, "dot"),
                                                  ("0", torch.float32, False),
                                                  ("0", torch.bfloat16, False)])
def test_cpu_linear_is_bik_linear_packed_or_not(monkeypatch, pack, dtype, packed):
    """layer.cpu_linear after the plugin's weight-load hook gives bik.linear's bits, from a
    weight packed once (fp32, fp16, and bf16 on the bf16 dot path) or read on every call (bf16
    off that path, or BIK_VLLM_PACK_WEIGHTS=0)."""
    from bik.runtime import cpu_ext

    if packed == "dot":
        packed = cpu_ext.bf16_dot()
    monkeypatch.setenv("BIK_VLLM_PACK_WEIGHTS", pack)
    _one_rank(monkeypatch)
    layer = torch.nn.Linear(96, 200, dtype=dtype)
    linear._dispatch(layer, remove_weight=False)
    assert hasattr(layer.cpu_linear, "packed") == packed
    x = torch.randn(5, 96).to(dtype)
    calls = linear.CALLS[0]
    out = layer.cpu_linear(x, layer.weight, layer.bias)
    assert linear.CALLS[0] == calls + 1
    assert torch.equal(out, bik.linear(x, layer.weight, layer.bias))
    assert torch.equal(layer.cpu_linear(x[2:3], layer.weight, layer.bias), out[2:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("neox, rotary_dim", [(True, 64), (True, 32), (False, 64)])
def test_rope_in_one_call_is_vllms_forward_native(monkeypatch, dtype, neox, rotary_dim):
    """The plugin's RoPE runs bik's C++ kernel (one call for q, one for k) where it is loaded:
    forward_native's bits, on vLLM's own layer; without the kernel it is forward_native."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from bik.integrations.vllm import rope
    from bik.ops import _native

    from vllm.config import VllmConfig, set_current_vllm_config

    assert _native.ready()
    with set_current_vllm_config(VllmConfig()):
        layer = RotaryEmbedding(64, rotary_dim, 512, 10000.0, neox, dtype)
    monkeypatch.setattr(RotaryEmbedding, "forward_cpu", RotaryEmbedding.forward_cpu)
    rope.install()
    torch.manual_seed(0)
    positions = torch.tensor([0, 5, 511, 5, 77, 300])
    qkv = torch.randn(6, 15 * 64).to(dtype)  # q and k as slices of the fused projection
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    want = layer.forward_native(positions, q.clone(), k.clone())
    assert rope._in_one_call(layer, positions, q, k) is not None  # the kernel serves it
    got = layer.forward_cpu(positions, q, k)
    assert all(torch.equal(a.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           b.view(torch.int16 if dtype != torch.float32 else torch.int32))
               for a, b in zip(got, want))
    monkeypatch.setattr(rope, "_module", lambda: None)  # not loaded: vLLM's torch formula
    assert rope._in_one_call(layer, positions, q, k) is None
    assert all(torch.equal(a, b) for a, b in zip(layer.forward_cpu(positions, q, k), want))


def test_the_profiles_layer_timers_wrap_vllms_layers(monkeypatch):
    """`bik bench vllm --profile`'s wall-clock view times each LAYERS class's method: every
    class and method exists in the pinned vLLM, and a wrapped one adds its time to its group."""
    import collections
    import importlib

    from bik.cli.bench import vllm_profile

    classes = [(importlib.import_module(m), n, method, g)
               for m, names, method, g in vllm_profile.LAYERS for n in names]
    for mod, name, method, _ in classes:
        monkeypatch.setattr(getattr(mod, name), method, getattr(getattr(mod, name), method))
    spent = collections.Counter()
    vllm_profile._time_layers(spent)
    mod, name, method, group = classes[0]
    assert getattr(getattr(mod, name), method).__wrapped__ is not None
    with pytest.raises(TypeError):  # called without a layer: the error passes through, timed
        getattr(getattr(mod, name), method)()
    assert spent[group] > 0 and set(spent) == {group}


def test_request_seeds_past_64_bits_are_refused_before_the_engine(monkeypatch):
    """Issue 50: a seed of 2**64 reached the engine and wedged it (stock vLLM-CPU too), one of
    2**63 failed inside the step (vLLM seeds a torch generator, signed 64-bit: tools/soak.py
    found it), and a negative one below vLLM's -1 failed there too. With the plugin,
    SamplingParams refuses them where they are made, naming the value; -1 stays "no seed"."""
    from vllm import SamplingParams
    from vllm.v1.worker import gpu_model_runner

    from bik.integrations.vllm import sampler

    monkeypatch.setattr(SamplingParams, "_verify_args", SamplingParams._verify_args)
    monkeypatch.setattr(gpu_model_runner, "Sampler", gpu_model_runner.Sampler)
    monkeypatch.setattr(gpu_model_runner.GPUModelRunner, "_sample",
                        gpu_model_runner.GPUModelRunner._sample)
    monkeypatch.setattr(gpu_model_runner.GPUModelRunner, "_dummy_sampler_run",
                        gpu_model_runner.GPUModelRunner._dummy_sampler_run)
    assert SamplingParams(seed=2**64).seed == 2**64  # stock takes it
    sampler.install()
    sampler.install()  # vLLM loads plugins several times per process
    for bad in (2**64, 2**63, -2, 1.5, True):
        with pytest.raises(ValueError, match=f"seed must be an int in \\[0, 2\\*\\*63\\).*got "
                                             f"{bad!r}"):
            SamplingParams(temperature=1.0, seed=bad)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=0).seed == 0

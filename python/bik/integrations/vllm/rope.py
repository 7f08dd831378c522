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
        return native(self, positions, query, key)

    forward_cpu.bik_wrapped = True

    RotaryEmbedding.forward_cpu = forward_cpu

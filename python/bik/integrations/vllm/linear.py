"""vLLM's linear layers and LM head on ``bik.linear``.

CPU: at weight-load time vLLM-CPU picks a GEMM per layer in
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` (oneDNN, a packed-weight
kernel or zentorch) and stores it as ``layer.cpu_linear``; those kernels never reach aten, so
no dispatcher override sees them, and their reduction order follows the batch. That function
is private, so it is replaced only on the vLLM version the plugin pins (checked by
``register``); the replacement keeps the weight as loaded and computes with bik, from the
weight packed once at load (as vLLM's own kernels do), and packed again after every
``reload_weights`` and every ``model.load_weights`` (an RL trainer's weight update, either
way: :func:`repack`).

CUDA (not yet run on a GPU): the unquantized linear and embedding methods call the GEMM that
``dispatch_unquantized_gemm`` returns (``F.linear``, or a FlashInfer GEMM with
``--linear-backend``); the name those two modules imported is replaced by one that returns
bik's GEMM on CUDA, so no layer depends on aten routing or on the chosen linear backend.
"""

from __future__ import annotations

import functools

import torch

from bik._env import flag

__all__ = ["CALLS", "REPACKS", "ROW_PARALLEL_CALLS", "install"]

CALLS = [0]  # bik.linear calls from vLLM layers in this process
REPACKS = [0]  # layers packed again after a weight update (reload_weights)
ROW_PARALLEL_CALLS = [0]  # row-parallel layers folded through bik.distributed (TP > 1)


def _refuse_parallelism() -> None:
    from vllm.distributed import parallel_state as ps

    if (degree := ps.get_pp_group().world_size) > 1:
        raise NotImplementedError(
            f"bik.integrations.vllm: pipeline parallel size {degree} is not served (tensor "
            f"parallelism is); run with size 1 or unset BIK_VLLM")


def _row_parallel(forward):
    """RowParallelLinear.forward at TP > 1 on bik.distributed.row_parallel_linear: each rank
    computes the K-split contract's group partials of its K shard and the ranks' partials are
    folded in group order, so the output is bik.linear's on one device bit for bit at any TP
    (vLLM's all-reduce adds the ranks' shard sums in its own order: other bits, measured). A
    layer whose K cannot be cut into the contract's groups (K not a multiple of 512) is refused
    by bik.distributed with the reason."""

    @functools.wraps(forward)
    def row_forward(self, input_):
        if self.tp_size == 1:
            return forward(self, input_)
        if not self.reduce_results or self.skip_bias_add:
            raise NotImplementedError(
                f"bik.integrations.vllm: a row-parallel layer with reduce_results="
                f"{self.reduce_results}, skip_bias_add={self.skip_bias_add} is not served")
        from vllm.distributed import get_tp_group

        from bik.distributed import row_parallel_linear

        x = input_ if self.input_is_parallel else \
            input_.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        CALLS[0] += 1
        ROW_PARALLEL_CALLS[0] += 1
        tp = get_tp_group()  # gloo for CPU tensors; the device's group (not run) for CUDA ones
        out = row_parallel_linear(x, self.weight, self.bias,
                                  group=tp.device_group if x.is_cuda else tp.cpu_group)
        return (out, None) if self.return_bias else out

    row_forward.bik_wrapped = True
    return row_forward


def _bik_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    import bik

    CALLS[0] += 1
    return bik.linear(x, weight, bias)


# Each packed layer's current pack, by a handle the layer keeps across repacks: a graph vLLM
# compiled holds the handle (a constant), so a repack must not change it.
_PACKS: dict[int, object] = {}


@torch.library.custom_op("bik_vllm::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, bias: torch.Tensor | None, handle: int) -> torch.Tensor:
    """The pack's product as one opaque op, which torch.compile (vLLM's default, fullgraph)
    can put in its graph: the pack itself is a raw extension call Dynamo cannot trace."""
    return _PACKS[handle](x, bias)


@_packed_linear_op.register_fake
def _(x, bias, handle):
    return x.new_empty((*x.shape[:-1], _PACKS[handle].shape[0]))


def _packed_linear(weight: torch.Tensor, handle: int | None = None):
    """layer.cpu_linear over the weight packed once (bik.PackedWeight: bik.linear's bits);
    like vLLM's own oneDNN and packed-weight paths, it reads the panels, not the weight."""
    import bik

    handle = len(_PACKS) if handle is None else handle
    _PACKS[handle] = packed = bik.PackedWeight(weight)

    def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        del weight  # vLLM passes layer.weight; the panels packed from it are read instead
        CALLS[0] += 1
        if torch.compiler.is_compiling():
            return torch.ops.bik_vllm.packed_linear(x, bias, handle)
        return packed(x, bias)  # eager: no dispatcher round trip

    cpu_linear.packed = packed
    cpu_linear.handle = handle
    return cpu_linear


def repack(model: torch.nn.Module) -> int:
    """Packs again every layer's weight that bik packed: after a weight update, which vLLM
    writes into the old tensors (``weight.data.copy_``: no version counter moves, so a pack
    cannot tell). vLLM re-runs the processing of most layers after ``reload_weights``, but not
    of a tied LM head, whose panels were stale (measured: every sampled token's logprob off
    after an update of the embedding). Returns how many layers it packed."""
    # A weight on meta is mid-way through vLLM's layerwise reload; the layer's processing,
    # which reruns once it is loaded, packs it.
    from bik.integrations.vllm import moe

    layers = [m for m in model.modules()
              if hasattr(getattr(m, "cpu_linear", None), "packed") and not m.weight.is_meta]
    for layer in layers:
        layer.cpu_linear = _packed_linear(layer.weight, layer.cpu_linear.handle)
    return len(layers) + moe.forget_packs(model)  # MoE layers pack at their next forward


_RELOADING = [False]  # inside reload_weights, whose own wrapper repacks at the end


def _count_repacks(model: torch.nn.Module) -> None:
    REPACKS[0] += repack(model)


def _after_reload(reload_weights):
    @functools.wraps(reload_weights)
    def reload_and_repack(self, *args, **kwargs):
        from bik.integrations.vllm.reload import whole_or_nothing

        _RELOADING[0] = True  # the model's load_weights inside it leaves the repack to here
        try:  # a failed load puts the previous weights back (reload.py), packed again
            whole_or_nothing(self.get_model(), lambda: reload_weights(self, *args, **kwargs),
                             lambda: _count_repacks(self.get_model()))
        finally:
            _RELOADING[0] = False
        REPACKS[0] += repack(self.get_model())

    reload_and_repack.bik_wrapped = True
    return reload_and_repack


def _watch_loads(model: torch.nn.Module) -> None:
    """Repack after every ``model.load_weights`` too: TRL's colocated GRPO trainer pushes its
    weights by calling it directly, not through reload_weights (measured with trl 1.16: the
    engine kept sampling from the old weights, its logprobs 3.6 nats off on average, silently:
    TRL's importance-sampling mask zeroed the loss)."""
    load_weights = model.load_weights
    if getattr(load_weights, "bik_wrapped", False):
        return

    @functools.wraps(load_weights)
    def load_and_repack(*args, **kwargs):
        loaded = load_weights(*args, **kwargs)
        if not _RELOADING[0]:  # reload_weights repacks once its layers are processed
            REPACKS[0] += repack(model)
        return loaded

    load_and_repack.bik_wrapped = True
    model.load_weights = load_and_repack


def check_tied_head(model: torch.nn.Module) -> None:
    """A checkpoint that says tie_word_embeddings holds no LM head of its own: a vLLM model
    class that does not tie (measured: vllm 0.32's glm4_moe) runs with an LM head the
    checkpoint never wrote, silently. Refused, naming the class."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    embed = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    if getattr(text, "tie_word_embeddings", False) and isinstance(head, torch.Tensor) and \
            isinstance(embed, torch.Tensor) and head.data_ptr() != embed.data_ptr():
        raise NotImplementedError(
            f"bik.integrations.vllm: {type(model).__name__} does not tie its LM head to the "
            f"embedding, though the checkpoint says tie_word_embeddings: vLLM would run it "
            f"with an LM head the checkpoint does not hold; unset BIK_VLLM or untie the "
            f"checkpoint")


def _after_load_model(load_model):
    @functools.wraps(load_model)
    def load_and_watch(self, *args, **kwargs):
        load_model(self, *args, **kwargs)
        check_tied_head(self.get_model())
        _watch_loads(self.get_model())

    load_and_watch.bik_wrapped = True
    return load_and_watch


def _pack_weights(weight: torch.Tensor) -> bool:
    """fp32 / fp16 weights are packed once, and bf16 ones where bf16 products take the bf16 dot
    path (bik.runtime.cpu_ext.bf16_dot): its pair panels hold 2 bytes per element, as the
    weight does. Off that path a bf16 weight is not packed: the kernel widens it while packing
    each call, half the bytes of fp32 panels, which measured faster in vLLM's batched decode
    (4.38 s packed vs 3.83 s per-call, 8 prompts x 32 tokens, 2 cores) and about even alone.
    BIK_VLLM_PACK_WEIGHTS=0 packs none."""
    from bik.runtime import cpu_ext

    wanted = flag("BIK_VLLM_PACK_WEIGHTS", True)
    return wanted and (weight.dtype != torch.bfloat16 or cpu_ext.bf16_dot())


def _dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Replaces dispatch_cpu_unquantized_gemm: every 2-D weight on bik, the weight kept as
    loaded (vLLM's layers pass it to cpu_linear) and packed once for bik's CPU kernel where
    :func:`_pack_weights` says (fp32 panels: 4 bytes per weight element more memory; bf16
    pair panels: 2)."""
    from bik.integrations.vllm import spec_draft

    if spec_draft.loading_stock_draft():  # the fast-path draft model keeps vLLM's GEMMs
        return _STOCK_DISPATCH[0](layer, remove_weight)
    del remove_weight  # the weight stays: the embedding, and the unpacked path, read it
    if layer.weight.is_meta or layer.weight.ndim != 2:
        raise NotImplementedError(f"bik.integrations.vllm: a linear layer with a "
                                  f"{layer.weight.ndim}-D or meta weight "
                                  f"({type(layer).__name__}) is not served")
    _refuse_parallelism()
    layer.cpu_linear = _packed_linear(layer.weight) if _pack_weights(layer.weight) \
        else _bik_linear


def _cuda_gemm(layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    if not _CHECKED[0]:  # vLLM's parallel groups exist once the model runs, not at install
        _refuse_parallelism()
        _CHECKED[0] = True
    return _bik_linear(x, weight, bias)


_CHECKED = [False]
_STOCK_DISPATCH: list = [None]  # vLLM's dispatch_cpu_unquantized_gemm, for a stock draft


def _gemm_on_cuda(dispatch):
    """Wraps dispatch_unquantized_gemm: bik's GEMM on CUDA, vLLM's choice elsewhere (on the
    CPU that is layer.cpu_linear, set by _dispatch)."""

    def dispatch_gemm(linear_backend: str = "auto"):
        from vllm.platforms import current_platform

        return _cuda_gemm if current_platform.is_cuda() else dispatch(linear_backend)

    dispatch_gemm.bik_wrapped = True
    return dispatch_gemm


def install() -> None:
    from vllm.model_executor.layers import linear, utils, vocab_parallel_embedding
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if utils.dispatch_cpu_unquantized_gemm is not _dispatch:
        _STOCK_DISPATCH[0] = utils.dispatch_cpu_unquantized_gemm
    utils.dispatch_cpu_unquantized_gemm = _dispatch
    if not getattr(linear.RowParallelLinear.forward, "bik_wrapped", False):
        linear.RowParallelLinear.forward = _row_parallel(linear.RowParallelLinear.forward)
    if not getattr(GPUModelRunner.reload_weights, "bik_wrapped", False):
        GPUModelRunner.reload_weights = _after_reload(GPUModelRunner.reload_weights)
    for runner in (GPUModelRunner, CPUModelRunner):  # the CPU runner has its own load_model
        if not getattr(runner.load_model, "bik_wrapped", False):
            runner.load_model = _after_load_model(runner.load_model)
    for module in (linear, vocab_parallel_embedding):
        if not getattr(module.dispatch_unquantized_gemm, "bik_wrapped", False):
            module.dispatch_unquantized_gemm = _gemm_on_cuda(module.dispatch_unquantized_gemm)

"""vLLM-CPU's linear layers and LM head on ``bik.linear``.

At weight-load time vLLM-CPU picks a GEMM per layer in
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` (oneDNN, a packed-weight
kernel or zentorch) and stores it as ``layer.cpu_linear``; those kernels never reach aten, so
no dispatcher override sees them, and their reduction order follows the batch. That function
is private, so it is replaced only on the vLLM version the plugin pins (checked by
``register``); the replacement keeps the weight as loaded and computes with bik.
"""

from __future__ import annotations

import torch

__all__ = ["CALLS", "install"]

CALLS = [0]  # bik.linear calls from vLLM layers in this process


def _refuse_parallelism() -> None:
    from vllm.distributed import parallel_state as ps

    sizes = {"tensor": ps.get_tensor_model_parallel_world_size,
             "pipeline": lambda: ps.get_pp_group().world_size}
    for name, size in sizes.items():
        if (degree := size()) > 1:
            raise NotImplementedError(
                f"bik.integrations.vllm: {name} parallel size {degree} is not served yet (a "
                f"rank's partial sums would depend on the degree); run with size 1 or unset "
                f"BIK_VLLM")


def _bik_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    import bik

    CALLS[0] += 1
    return bik.linear(x, weight, bias)


def _dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Replaces dispatch_cpu_unquantized_gemm: every 2-D weight on bik, kept as loaded."""
    del remove_weight  # bik computes from the loaded weight, so it stays
    if layer.weight.is_meta or layer.weight.ndim != 2:
        raise NotImplementedError(f"bik.integrations.vllm: a linear layer with a "
                                  f"{layer.weight.ndim}-D or meta weight "
                                  f"({type(layer).__name__}) is not served")
    _refuse_parallelism()
    layer.cpu_linear = _bik_linear


def install() -> None:
    from vllm.model_executor.layers import utils

    utils.dispatch_cpu_unquantized_gemm = _dispatch

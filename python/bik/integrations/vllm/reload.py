"""A weight update lands whole or not at all (issue 50): vLLM's ``reload_weights`` loads a
checkpoint-format update layer by layer, each layer's tensors on the meta device until all its
weights arrive; a load that fails mid-way (a tensor of the wrong shape, a name the model
lacks) leaves the layers already loaded with the new values and the others on meta, and the
engine then fails every step ("Cannot copy out of meta tensor"), even after the right weights
are pushed again. Here every parameter and buffer is copied before the load; if it raises, the
layers caught mid-load get their own tensors back (vLLM keeps them aside), the copies are
written back, the packed weights follow, and the error goes on to the caller: the engine
serves its previous weights. The copy costs the model's size in memory during an update."""

from __future__ import annotations

import itertools

import torch

__all__ = ["whole_or_nothing"]


def whole_or_nothing(model: torch.nn.Module, load, restored) -> None:
    """``load()`` (a reload of ``model``'s weights); on any exception the model is put back as
    it was before, ``restored()`` runs (the caller's repacking), then the exception is raised
    again."""
    before = [(t, t.detach().clone()) for t in itertools.chain(model.parameters(),
                                                               model.buffers())
              if not t.is_meta]
    try:
        load()
    except BaseException:
        _restore(model, before)
        restored()
        raise


def _restore(model: torch.nn.Module, before) -> None:
    from vllm.model_executor.model_loader.reload import layerwise

    for layer in model.modules():  # the layers the failed load left on meta
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    with torch.no_grad():
        for tensor, saved in before:
            tensor.copy_(saved)

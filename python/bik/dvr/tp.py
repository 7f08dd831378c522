"""The DVR Llama sharded over a torch.distributed group (tensor parallelism, Megatron layout).

Per rank: its q heads and KV heads (qkv column parallel, the fused projection cut head-wise),
attention over those heads only, o_proj row parallel over the same heads; gate/up column
parallel over its intermediate columns, down_proj row parallel over them; the LM head column
parallel over the vocabulary with the logits gathered, so every rank sees the whole row;
embedding and norms replicated. With bik's kernels the column-parallel layers are the full
product's columns and the row-parallel ones are bik.distributed.row_parallel_linear, so a
token's logits are the single-device model's bits at every degree the model supports; the fast
kernels use the stock layers (F.linear on the shard, all_reduce), whose bits follow the degree.

Attention needs nothing: a rank holds whole KV heads with all of their q heads, so each head's
GQA ratio, tile and KV splits are the unsharded model's (bik's attention configs are keyed by
that ratio, never by the number of heads). Supported degrees: TP dividing the KV heads, the
intermediate size and the vocabulary, with q-head width (heads x head_dim) and intermediate
size multiples of 512 and TP dividing bik.configs.MATMUL_TP_MAX (the row-parallel K-split
rule). SmolLM2-135M (9 q / 3 KV heads of 64: o_proj K = 576) runs at TP = 1 only.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from bik.configs import MATMUL_TP_MAX, matmul_split
from bik.distributed import column_parallel_linear, row_parallel_linear
from bik.dvr.kernels import BikKernels, Kernels
from bik.dvr.model import LayerWeights, LlamaModel

__all__ = ["TensorParallelLlama", "supported_degrees"]


def _problems(config, dtype: torch.dtype, size: int) -> list[str]:
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    inter, vocab, hidden = config.intermediate_size, config.vocab_size, config.hidden_size
    out = [f"{name} = {value} does not divide by TP = {size}"
           for name, value in (("num_key_value_heads", hkv), ("intermediate_size", inter),
                               ("vocab_size", vocab)) if value % size]
    if size > 1:
        for name, k in (("o_proj (q heads x head_dim)", hq * d), ("down_proj", inter)):
            groups = matmul_split(dtype, hidden, k).groups
            if groups == 1 or groups % size:
                out.append(f"{name} K = {k} has {groups} K group(s): row parallel needs a "
                           f"multiple of 512 and TP dividing {MATMUL_TP_MAX}")
    return out


def supported_degrees(config, dtype: torch.dtype = torch.float32) -> list[int]:
    """The TP degrees (1 .. MATMUL_TP_MAX) a model of ``config`` can be sharded over."""
    return [tp for tp in range(1, MATMUL_TP_MAX + 1) if not _problems(config, dtype, tp)]


def _is_bik(kernels: Kernels) -> bool:
    return isinstance(kernels, BikKernels)


class TensorParallelLlama(LlamaModel):
    """This rank's shard of ``full`` (a LlamaModel every rank built identically), for the
    ranks of ``group``. ``config`` is the rank's: its share of the heads (what the KV cache is
    allocated with); ``full_config`` the model's. Same forward, same engine."""

    def __init__(self, full: LlamaModel, *, group=None):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        cfg = full.config
        bad = _problems(cfg, full.dtype, size)
        if bad:
            raise ValueError(f"TensorParallelLlama: cannot shard this model over {size} ranks: "
                             + "; ".join(bad) + f" (supported: {supported_degrees(cfg)})")
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        inter = cfg.intermediate_size
        self.group, self.size, self.rank = group, size, rank
        self.full_config = cfg
        self.config = dataclasses.replace(cfg, num_attention_heads=hq // size,
                                          num_key_value_heads=hkv // size)
        self.embed, self.dtype, self.device = full.embed, full.dtype, full.device
        self.rope, self.scale, self.final_norm = full.rope, full.scale, full.final_norm

        def mine(t: torch.Tensor, width: int, dim: int = 0) -> torch.Tensor:
            return t.narrow(dim, rank * width, width)

        qw, kw, iw = hq // size * d, hkv // size * d, inter // size
        self.layers = []
        for layer in full.layers:
            q, k, v = layer.qkv.split([hq * d, hkv * d, hkv * d])
            gate, up = layer.gate_up.split([inter, inter])
            self.layers.append(LayerWeights(
                input_norm=layer.input_norm,
                qkv=torch.cat([mine(q, qw), mine(k, kw), mine(v, kw)]),
                o=mine(layer.o, qw, 1).contiguous(),
                post_norm=layer.post_norm,
                gate_up=torch.cat([mine(gate, iw), mine(up, iw)]),
                down=mine(layer.down, iw, 1).contiguous()))
        self.lm_head = mine(full.lm_head, cfg.vocab_size // size).contiguous()

    def columns(self, kernels, x, w):
        if _is_bik(kernels):
            return column_parallel_linear(x, w, group=self.group, backend=kernels.backend)
        return kernels.linear(x, w)

    def rows(self, kernels, x, w):
        if _is_bik(kernels):
            return row_parallel_linear(x, w, group=self.group, backend=kernels.backend)
        part = kernels.linear(x, w)
        dist.all_reduce(part, group=self.group)
        return part

    def head(self, kernels, h):
        if _is_bik(kernels):
            return column_parallel_linear(h, self.lm_head, gather_output=True, group=self.group,
                                          backend=kernels.backend)
        local = kernels.linear(h, self.lm_head)
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

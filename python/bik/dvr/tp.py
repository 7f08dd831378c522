"""The DVR Llama sharded over a torch.distributed group (tensor parallelism, Megatron layout).

Per rank: its q heads and the KV heads they read (qkv column parallel, the fused projection cut
head-wise), attention over those heads only, o_proj row parallel over the same q heads; gate/up
column parallel over its intermediate columns, down_proj row parallel over them; the LM head
column parallel over the vocabulary, and the tokens drawn from the rank's vocabulary shard by
bik.distributed's vocab-parallel sampler (no logits gather); embedding and norms replicated.
With bik's kernels the column-parallel layers are the full product's columns, the row-parallel
ones are bik.distributed.row_parallel_linear and the sampler is bik.sample's bits, so a token's
logits, tokens and logprobs are the single-device model's at every degree the model supports;
the fast kernels use the stock layers (F.linear on the shard, all_reduce), whose bits follow
the degree.

KV heads: at TP dividing the KV heads a rank holds whole KV heads with all of their q heads.
At TP above the KV heads (TP a multiple of them) each KV head is replicated on TP / Hkv ranks,
each holding Hq / TP of its q heads: the per-rank GQA ratio shrinks, and the bits do not move,
because bik's attention computes every (token, q head) row alone -- its configs are keyed by
(dtype, head_dim), never by a head count, and the KV splits by absolute positions
(tests/attention: a head subset's rows are the full call's bits). The replicated qkv rows are
looked up with the whole layer's N (column_parallel_linear's layer_n).

Supported degrees: TP dividing the q heads, the intermediate size, and dividing or a multiple
of the KV heads; the vocabulary a multiple of bik.configs.MATMUL_TP_MAX (the sampler's
normaliser groups); q-head width (heads x head_dim) and intermediate size multiples of 512 and
TP dividing MATMUL_TP_MAX (the row-parallel K-split rule). SmolLM2-135M (9 q / 3 KV heads of
64: o_proj K = 576) runs at TP = 1 only.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from bik.configs import MATMUL_TP_MAX, matmul_split, sampler_chunks
from bik.distributed import (
    column_parallel_linear,
    row_parallel_linear,
    vocab_parallel_sample,
    vocab_parallel_verify_draft,
)
from bik.dvr.kernels import BikKernels, Kernels
from bik.dvr.model import LayerWeights, LlamaModel

__all__ = ["TensorParallelLlama", "supported_degrees"]


def _problems(config, dtype: torch.dtype, size: int) -> list[str]:
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    inter, vocab, hidden = config.intermediate_size, config.vocab_size, config.hidden_size
    out = [f"{name} = {value} does not divide by TP = {size}"
           for name, value in (("num_attention_heads", hq), ("intermediate_size", inter))
           if value % size]
    if hkv % size and size % hkv:
        out.append(f"num_key_value_heads = {hkv} neither divides by TP = {size} nor divides it "
                   f"(replicated KV heads)")
    if size > 1:
        for name, k in (("o_proj (q heads x head_dim)", hq * d), ("down_proj", inter)):
            groups = matmul_split(dtype, hidden, k).groups
            if groups == 1 or groups % size:
                out.append(f"{name} K = {k} has {groups} K group(s): row parallel needs a "
                           f"multiple of 512 and TP dividing {MATMUL_TP_MAX}")
        groups = sampler_chunks(vocab).groups
        if groups == 1 or groups % size:
            out.append(f"vocab_size = {vocab} has {groups} normaliser group(s): the "
                       f"vocab-parallel sampler needs a multiple of {MATMUL_TP_MAX} and TP "
                       f"dividing {MATMUL_TP_MAX}")
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
        q_heads = hq // size
        kv_heads = max(hkv // size, 1)  # 1: a replica of the KV head of this rank's q heads
        kv_first = rank * kv_heads if hkv >= size else rank * q_heads // (hq // hkv)
        self.group, self.size, self.rank = group, size, rank
        self.full_config = cfg
        self.config = dataclasses.replace(cfg, num_attention_heads=q_heads,
                                          num_key_value_heads=kv_heads)
        self.embed, self.dtype, self.device = full.embed, full.dtype, full.device
        self.rope, self.scale, self.final_norm = full.rope, full.scale, full.final_norm
        # The whole layers' N: the tables of a rank's columns are looked up with them.
        self.layer_n = {"qkv": (hq + 2 * hkv) * d, "gate_up": 2 * inter}

        def mine(t: torch.Tensor, first: int, width: int, dim: int = 0) -> torch.Tensor:
            return t.narrow(dim, first * width, width)

        iw = inter // size
        self.layers = []
        for layer in full.layers:
            q, k, v = layer.qkv.split([hq * d, hkv * d, hkv * d])
            gate, up = layer.gate_up.split([inter, inter])
            self.layers.append(LayerWeights(
                input_norm=layer.input_norm,
                qkv=torch.cat([mine(q, rank, q_heads * d),
                               k.narrow(0, kv_first * d, kv_heads * d),
                               v.narrow(0, kv_first * d, kv_heads * d)]),
                o=mine(layer.o, rank, q_heads * d, 1).contiguous(),
                post_norm=layer.post_norm,
                gate_up=torch.cat([mine(gate, rank, iw), mine(up, rank, iw)]),
                down=mine(layer.down, rank, iw, 1).contiguous()))
        self.lm_head = mine(full.lm_head, rank, cfg.vocab_size // size).contiguous()

    def columns(self, kernels, x, w, name):
        if _is_bik(kernels):
            return column_parallel_linear(x, w, group=self.group, backend=kernels.backend,
                                          layer_n=self.layer_n[name])
        return kernels.linear(x, w)

    def rows(self, kernels, x, w):
        if _is_bik(kernels):
            return row_parallel_linear(x, w, group=self.group, backend=kernels.backend)
        part = kernels.linear(x, w)
        dist.all_reduce(part, group=self.group)
        return part

    def head(self, kernels, h):
        """This rank's vocabulary shard of the logits [T, V / TP] (columns rank*V/TP onwards)."""
        if _is_bik(kernels):
            return column_parallel_linear(h, self.lm_head, group=self.group,
                                          backend=kernels.backend)
        return kernels.linear(h, self.lm_head)

    def sample(self, logits, **params):
        return vocab_parallel_sample(logits, group=self.group, **params)

    def verify_draft(self, draft_tokens, num_drafts, logits, **params):
        return vocab_parallel_verify_draft(draft_tokens, num_drafts, logits, group=self.group,
                                           **params)

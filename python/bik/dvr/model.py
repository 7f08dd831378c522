"""A Llama-architecture decoder whose every reduction runs on a swappable kernel set.

``LlamaModel.forward`` takes a packed batch (any mix of prefill chunks, decode tokens and verify
windows of several sequences, described by a :class:`~bik.dvr.step.Step`) and writes the new
tokens' K/V into a paged :class:`~bik.dvr.step.KVCache`. Reductions (matmuls, RMSNorm,
attention) go through ``kernels``; everything else is elementwise or a gather, chosen so that a
token's bits never depend on its batch: the embedding is a gather, RoPE reads a position-indexed
table (bik.dvr.rope), and SwiGLU's silu is bik's (ops/_pointwise.py) instead of torch's
(whose scalar tail rounds differently from its vector body on the CPU). With
:class:`~bik.dvr.kernels.BikKernels` a token's logits are therefore bitwise independent of the
batch, the chunking and the cache layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

import bik
from bik.dvr.checkpoint import expected_shapes, read_checkpoint
from bik.dvr.config import LlamaConfig, llama_1b_config
from bik.dvr.kernels import Kernels
from bik.dvr.rope import RopeTable, apply_rope
from bik.dvr.step import KVCache, Step
from bik.ops._pointwise import silu_f32

__all__ = [
    "LlamaConfig",
    "LlamaModel",
    "embedded_config",
    "embedded_model",
    "embedded_tp_config",
    "llama_1b_config",
    "load_checkpoint",
    "random_model",
    "swiglu",
]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, H]: q, k, v projections fused into one linear
    o: torch.Tensor  # [H, Hq * D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]: gate rows then up rows
    down: torch.Tensor  # [H, I]


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] = [gate | up], computed in fp32, returned in the
    input dtype; each element's bits a pure function of its gate and up values."""
    i = gate_up.shape[-1] // 2
    g = gate_up[:, :i].float().contiguous()
    u = gate_up[:, i:].float()
    return (silu_f32(g) * u).to(gate_up.dtype)


class LlamaModel:
    """Llama weights plus a kernel-agnostic forward. Build it with :func:`load_checkpoint`,
    :func:`random_model` or :func:`embedded_model`, or from HF-named tensors directly."""

    def __init__(self, config: LlamaConfig, tensors: dict[str, torch.Tensor]):
        expected = expected_shapes(config)
        missing = [n for n in expected if n not in tensors]
        unexpected = [n for n in tensors if n not in expected]
        if missing or unexpected:
            raise ValueError(f"LlamaModel: missing tensors {missing[:5]}, unexpected tensors "
                             f"{unexpected[:5]}")
        for name, shape in expected.items():
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"LlamaModel: {name} has shape {list(tensors[name].shape)}, "
                                 f"expected {list(shape)}")
        self.config = config
        self.embed = tensors["model.embed_tokens.weight"]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.layers: list[LayerWeights] = []
        for n in range(config.num_hidden_layers):
            t = {k.removeprefix(f"model.layers.{n}."): v for k, v in tensors.items()
                 if k.startswith(f"model.layers.{n}.")}
            self.layers.append(LayerWeights(
                input_norm=t["input_layernorm.weight"],
                qkv=torch.cat([t["self_attn.q_proj.weight"], t["self_attn.k_proj.weight"],
                               t["self_attn.v_proj.weight"]]),
                o=t["self_attn.o_proj.weight"].contiguous(),
                post_norm=t["post_attention_layernorm.weight"],
                gate_up=torch.cat([t["mlp.gate_proj.weight"], t["mlp.up_proj.weight"]]),
                down=t["mlp.down_proj.weight"].contiguous(),
            ))
        self.final_norm = tensors["model.norm.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else tensors["lm_head.weight"]
        self.rope = RopeTable(config, self.device)
        self.scale = config.head_dim ** -0.5  # as transformers (1/sqrt may differ in the last bit)

    def _check_inputs(self, tokens, positions, step: Step, cache: KVCache) -> None:
        if tokens.dim() != 1 or tokens.dtype != torch.int64:
            raise ValueError(f"LlamaModel.forward: tokens must be int64 [T], got "
                             f"{tokens.dtype} {list(tokens.shape)}")
        if positions.shape != tokens.shape or positions.dtype != torch.int64:
            raise ValueError(f"LlamaModel.forward: positions must be int64 {list(tokens.shape)}, "
                             f"got {positions.dtype} {list(positions.shape)}")
        if tokens.shape[0] != step.num_tokens:
            raise ValueError(f"LlamaModel.forward: {tokens.shape[0]} tokens but the step packs "
                             f"{step.num_tokens} (q_lens {step.q_lens})")
        if positions.device.type == "cpu":  # free to check on the host; on a GPU it would sync
            want = torch.cat([torch.arange(kv - q, kv) for q, kv in zip(step.q_lens, step.kv_lens)]
                             or [torch.empty(0, dtype=torch.int64)])
            if not torch.equal(positions, want):
                raise ValueError(f"LlamaModel.forward: positions {positions.tolist()[:16]} are "
                                 f"not the step's kv_len - q_len .. kv_len - 1 per sequence")
        if len(cache.k) != self.config.num_hidden_layers:
            raise ValueError(f"LlamaModel.forward: the cache has {len(cache.k)} layers, the "
                             f"model {self.config.num_hidden_layers}")
        if step.max_block >= cache.k[0].shape[0]:  # the one slot check, on the host
            raise ValueError(f"LlamaModel.forward: the step uses block {step.max_block} but the "
                             f"cache has {cache.k[0].shape[0]} blocks")
        if cache.k[0].dtype != self.dtype:
            raise TypeError(f"LlamaModel.forward: cache dtype {cache.k[0].dtype} differs from "
                            f"the model's {self.dtype}")

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, step: Step, cache: KVCache,
                kernels: Kernels, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run the packed tokens of ``step`` and return fp32 logits.

        Args:
            tokens: int64 [T], the new tokens in the step's packing order.
            positions: int64 [T], their absolute positions (for sequence b:
                kv_len_b - q_len_b ... kv_len_b - 1; they select the RoPE angles). Checked
                against the step when on the CPU (on a GPU the check would cost a sync).
            step: the layout; its slot_mapping says where each token's K/V is written.
            cache: the paged cache (its K/V for this step's slots is overwritten).
            kernels: BikKernels (batch-invariant) or FastKernels (stock torch).
            logits_rows: int64 row indices into [T] to compute logits for (None = all rows).

        Returns:
            fp32 [T or len(logits_rows), vocab_size].
        """
        self._check_inputs(tokens, positions, step, cache)
        cfg = self.config
        t = tokens.shape[0]
        # The heads this model computes (all of them; a tensor-parallel rank's share in
        # bik.dvr.tp), and the three kinds of linear layer a sharded model splits differently.
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = self.rope.lookup(positions, max(step.kv_lens, default=0))
        x = self.embed[tokens]
        residual = None
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            if residual is None:
                h, residual = kernels.rms_norm(x, layer.input_norm, cfg.rms_norm_eps), x
            else:
                h, residual = kernels.add_rms_norm(x, residual, layer.input_norm,
                                                   cfg.rms_norm_eps)
            qkv = self.columns(kernels, h, layer.qkv, "qkv")
            q = apply_rope(qkv[:, : hq * d].reshape(t, hq, d), cos, sin)
            k = apply_rope(qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d), cos, sin)
            v = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d).contiguous()
            # Checked on the host above (and by build_step): no sync per layer.
            bik.write_kv_cache(k_cache, v_cache, k, v, step.slot_mapping, validate=False)
            attn = kernels.attention(q, k_cache, v_cache, step, self.scale)
            x = self.rows(kernels, attn.reshape(t, hq * d), layer.o)
            h, residual = kernels.add_rms_norm(x, residual, layer.post_norm, cfg.rms_norm_eps)
            up = self.columns(kernels, h, layer.gate_up, "gate_up")
            x = self.rows(kernels, swiglu(up), layer.down)
        h, _ = kernels.add_rms_norm(x, residual, self.final_norm, cfg.rms_norm_eps)
        if logits_rows is not None:
            h = h[logits_rows]
        return self.head(kernels, h).float()

    __call__ = forward

    # One device: every linear is the kernel set's. bik.dvr.tp.TensorParallelLlama overrides
    # these three with its column-parallel, row-parallel and vocab-parallel layers.
    def columns(self, kernels: Kernels, x: torch.Tensor, w: torch.Tensor,
                name: str) -> torch.Tensor:
        del name  # "qkv" or "gate_up": a sharded model looks up the whole layer's shape
        return kernels.linear(x, w)

    def rows(self, kernels: Kernels, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, w)

    def head(self, kernels: Kernels, h: torch.Tensor) -> torch.Tensor:
        return kernels.linear(h, self.lm_head)

    # The sampler of the logits ``forward`` returns (bik.dvr.tp.TensorParallelLlama draws from
    # its vocabulary shard with bik.distributed's vocab-parallel sampler instead).
    def sample(self, logits: torch.Tensor, **params) -> bik.SampleOutput:
        return bik.sample(logits, **params)

    def verify_draft(self, draft_tokens: torch.Tensor, num_drafts, logits: torch.Tensor,
                     **params) -> bik.VerifyOutput:
        return bik.verify_draft(draft_tokens, num_drafts, logits, **params)


def load_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> LlamaModel:
    """Load a Hugging Face Llama checkpoint directory (config.json + model.safetensors, or
    shards listed in model.safetensors.index.json), cast to ``dtype`` on ``device``.

    Raises FileNotFoundError for a missing directory or file and
    :class:`~bik.dvr.checkpoint.CheckpointError` (a ValueError) for another architecture,
    missing or unexpected tensors (named) and shape mismatches.
    """
    config, tensors = read_checkpoint(path, dtype=dtype, device=device)
    return LlamaModel(config, tensors)


def random_model(config: LlamaConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> LlamaModel:
    """Seeded random weights for ``config`` (drawn on ``device``: same seed and device, same
    weights). Scales are chosen so that greedy decoding does not collapse: linear weights have
    std 1/sqrt(fan_in) (activations keep unit scale through the layers), norms are 1, the
    embedding has std 1 and the LM head std 2/sqrt(hidden), so logits have std ~2 whatever the
    width. A tied head uses the head's std for the shared matrix (a tied random model tends to
    repeat its input token: the residual stream still holds that token's embedding).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    head_std = 2.0 / config.hidden_size ** 0.5
    tensors = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:  # norm weights
            tensors[name] = torch.ones(shape, dtype=dtype, device=device)
            continue
        if name == "lm_head.weight" or (config.tie_word_embeddings and "embed" in name):
            std = head_std
        elif "embed" in name:
            std = 1.0
        else:
            std = shape[1] ** -0.5
        w = torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * std
        tensors[name] = w.to(dtype)
    return LlamaModel(config, tensors)


def embedded_config() -> LlamaConfig:
    """The tiny Llama shape of the embedded demo model. intermediate_size 176 (not a multiple of
    32) makes SwiGLU rows straddle vector boundaries, so the batch-invariance tests exercise the
    elementwise tails too. Untied embeddings: with random weights a tied head keeps predicting
    the input token (see :func:`random_model`)."""
    return LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, rope_scaling=None,
    )


def embedded_model(*, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> LlamaModel:
    """A tiny Llama (embedded_config()) with seeded random weights; needs no files."""
    return random_model(embedded_config(), seed=seed, dtype=dtype, device=device)


def embedded_tp_config() -> LlamaConfig:
    """A small Llama that tensor parallelism can shard over 1, 2 and 4 ranks (bik.dvr.tp):
    8 q / 4 KV heads of 64 (o_proj K = 512), intermediate 1024, vocabulary 512 -- the row
    parallel K's are multiples of 512, as bik's K-split contract needs. The embedded demo model
    (4 / 2 heads of 16) is too narrow for that."""
    return LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, rope_scaling=None,
    )

"""Read a Hugging Face Llama checkpoint directory: config.json + safetensors (single or sharded).

Only files are read; nothing is downloaded. Every tensor name and shape is checked against the
config before the model is built, and errors name the offending file or tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bik.dvr.config import LlamaConfig

__all__ = ["CheckpointError", "expected_shapes", "read_checkpoint", "read_config"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the model recomputes or does not use.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded (missing file, wrong tensors, shapes)."""


def read_config(path: Path) -> LlamaConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
    with config_file.open() as f:
        raw = json.load(f)
    try:
        return LlamaConfig.from_hf_dict(raw)
    except KeyError as exc:
        raise CheckpointError(f"{config_file}: missing key {exc}") from None
    except ValueError as exc:
        raise CheckpointError(f"{config_file}: {exc}") from None


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a LlamaForCausalLM checkpoint holds for this config, in HF naming."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _shard_files(path: Path) -> dict[str, list[str] | None]:
    """{file name: tensor names it should hold (None = whatever it holds)}."""
    index = path / INDEX_FILE
    if index.is_file():
        with index.open() as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files: dict[str, list[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        for file in files:
            if not (path / file).is_file():
                raise FileNotFoundError(f"{index} names shard {file}, which is not in {path}")
        return files
    if (path / SINGLE_FILE).is_file():
        return {SINGLE_FILE: None}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {path}")


def read_checkpoint(path: str | Path, *, dtype: torch.dtype, device: torch.device | str
                    ) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """(config, {HF tensor name: tensor in ``dtype`` on ``device``}), checked against the config.

    Raises FileNotFoundError for a missing directory or file, CheckpointError for another
    architecture, missing or unexpected tensors (named) and shape mismatches.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    config = read_config(path)
    expected = expected_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file, names in _shard_files(path).items():
        with safe_open(str(path / file), framework="pt", device="cpu") as f:
            stored = set(f.keys())
            missing_here = sorted(set(names or ()) - stored)
            if missing_here:
                raise CheckpointError(f"{file} lacks tensors its index assigns to it: "
                                      f"{missing_here[:5]}")
            for name in sorted(stored if names is None else names):
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: the head is the embedding, whatever the file stores
                if name not in expected:
                    unexpected.append(name)
                    continue
                t = f.get_tensor(name)
                if tuple(t.shape) != expected[name]:
                    raise CheckpointError(f"{file}: tensor {name} has shape {list(t.shape)}, "
                                          f"the config needs {list(expected[name])}")
                tensors[name] = t.to(device=device, dtype=dtype)
    if unexpected:
        raise CheckpointError(f"unexpected tensors in {path} (not part of a Llama model with "
                              f"this config): {unexpected[:8]}"
                              + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8
                                 else ""))
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise CheckpointError(f"missing tensors in {path}: {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return config, tensors

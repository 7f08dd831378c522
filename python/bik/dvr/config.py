"""The shape and hyper-parameters of a Llama-architecture decoder, read from a HF config.json."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LLAMA3_ROPE_KEYS", "LlamaConfig", "llama_1b_config"]

# The keys of a "llama3" rope scaling dict (Llama 3.1 / 3.2 checkpoints).
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | tuple[int, ...] | None
    # None (plain RoPE) or {"rope_type": "llama3", factor, low/high_freq_factor,
    # original_max_position_embeddings}. A dict is unhashable, so it is left out of the hash.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig: {name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"LlamaConfig: num_attention_heads ({self.num_attention_heads}) "
                             f"must be a multiple of num_key_value_heads "
                             f"({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: RoPE needs an even head_dim, got {self.head_dim}")
        if self.rope_scaling is not None:
            _check_llama3_scaling(self.rope_scaling)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id (a checkpoint may name one or several)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> LlamaConfig:
        """Read a Hugging Face Llama config.json (as a dict).

        Accepts both spellings of RoPE settings: ``rope_theta`` + ``rope_scaling`` (checkpoints
        on the Hub) and ``rope_parameters`` (transformers 5 saves). Raises ValueError for another
        architecture, for biases (attention_bias / mlp_bias), an activation other than SiLU, or
        a rope type other than default / llama3.
        """
        archs = d.get("architectures") or []
        if d.get("model_type") != "llama" or (archs and "LlamaForCausalLM" not in archs):
            raise ValueError(f"not a Llama checkpoint: model_type {d.get('model_type')!r}, "
                             f"architectures {archs!r} (bik.dvr loads LlamaForCausalLM only)")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ValueError(f"unsupported Llama variant: {flag} = true")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {d['hidden_act']!r} (Llama uses silu)")
        rope = dict(d.get("rope_parameters") or {})
        if d.get("rope_scaling"):
            rope.update(d["rope_scaling"])
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            scaling = None
        elif rope_type == "llama3":
            scaling = {"rope_type": "llama3", **{k: rope.get(k) for k in LLAMA3_ROPE_KEYS}}
        else:
            raise ValueError(f"unsupported rope type {rope_type!r}: bik.dvr implements "
                             f"'default' and 'llama3'")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            rope_scaling=scaling,
        )


def _check_llama3_scaling(s: Mapping[str, Any]) -> None:
    if s.get("rope_type") != "llama3":
        raise ValueError(f"LlamaConfig: rope_scaling must be None or a llama3 dict, got {s!r}")
    missing = [k for k in LLAMA3_ROPE_KEYS if s.get(k) is None]
    if missing:
        raise ValueError(f"LlamaConfig: llama3 rope_scaling lacks {missing}")
    if s["high_freq_factor"] <= s["low_freq_factor"]:
        raise ValueError("LlamaConfig: llama3 rope_scaling needs high_freq_factor > "
                         "low_freq_factor")


def llama_1b_config() -> LlamaConfig:
    """The shapes of Llama-3.2-1B (for benchmarks with random weights; no download)."""
    return LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=(128001, 128008, 128009),
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )

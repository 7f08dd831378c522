"""Tiny random mixture-of-experts models saved as Hugging Face directories (SmolLM2's
tokenizer), for the plugin's MoE tests: invariance needs no trained weights.

    python tests/vllm_plugin/moe_models.py FAMILY DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe")
_COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=64,
               max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6)


def _config(family: str, vocab: int):
    import transformers

    if family == "qwen3_moe":  # softmax top-2 of 8, renormalised
        return transformers.Qwen3MoeConfig(**_COMMON, vocab_size=vocab, moe_intermediate_size=64,
                                           num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=True, decoder_sparse_step=1)
    if family == "mixtral":  # softmax top-2 of 8, fp32 weights
        return transformers.MixtralConfig(**_COMMON, vocab_size=vocab, num_local_experts=8,
                                          num_experts_per_tok=2)
    if family == "glm4_moe":  # sigmoid + correction bias, groups, a shared expert, scaled
        return transformers.Glm4MoeConfig(**_COMMON, vocab_size=vocab, moe_intermediate_size=64,
                                          n_routed_experts=8, num_experts_per_tok=3, n_group=2,
                                          topk_group=1, n_shared_experts=1,
                                          routed_scaling_factor=2.5, first_k_dense_replace=0,
                                          norm_topk_prob=True, num_nextn_predict_layers=0)
    raise ValueError(f"moe_models: unknown family {family!r} ({', '.join(FAMILIES)})")


def make(family: str, where: Path) -> Path:
    """The model saved at ``where`` with SmolLM2's tokenizer: fp32 weights, seeded, each a
    bf16 value, so one directory loads to the same weights in fp32 and bf16 (vLLM keeps a
    GLM router's weight in fp32 whatever the model's dtype, transformers rounds it to bf16:
    from an fp32 checkpoint of other values the two would route with other weights)."""
    import torch
    import transformers
    from bik.models import smollm2

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2.cache_dir()))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, len(tokenizer)),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn_like(p).mul_(0.1).bfloat16())
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b).mul_(0.05).bfloat16())
    model.save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


if __name__ == "__main__":
    make(sys.argv[1], Path(sys.argv[2]))

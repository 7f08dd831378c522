"""bik::attention, bik::attention_varlen, bik::write_kv_cache (op.py) and the varlen backward
(backward.py), their plan_* checks; the GPU KV writer kv_cache_triton.py; backends triton.py, cuda.py, cpu.py; the CPU spec in torch: reference.py."""

from bik.ops.attention import backward as _backward  # noqa: F401  (registers the backward op)
from bik.ops.attention.op import (
    AttentionOutput,
    AttentionPlan,
    attention,
    attention_varlen,
    plan_attention,
    plan_attention_varlen,
    write_kv_cache,
)

__all__ = ["AttentionOutput", "AttentionPlan", "attention", "attention_varlen", "plan_attention",
           "plan_attention_varlen", "write_kv_cache"]

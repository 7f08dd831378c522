"""bik::attention and bik::attention_varlen (op.py) with the varlen backward (backward.py),
bik::write_kv_cache (kv_cache.py; its GPU writer kv_cache_triton.py), their checks and plan_*
(checks.py); backends triton.py, cuda.py, cpu.py; the CPU spec in torch: reference.py."""

from bik.ops.attention.kv_cache import write_kv_cache
from bik.ops.attention.op import (
    AttentionOutput,
    AttentionPlan,
    attention,
    attention_varlen,
    plan_attention,
    plan_attention_varlen,
)

__all__ = ["AttentionOutput", "AttentionPlan", "attention", "attention_varlen", "plan_attention",
           "plan_attention_varlen", "write_kv_cache"]

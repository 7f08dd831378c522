"""bik: batch-invariant kernels. The bits of a row never depend on what else is in the batch.

Public API (see docs/api.md):
    bik.matmul, bik.linear, bik.bmm, bik.rms_norm  -- the ops (also torch.ops.bik.*)
    bik.softmax, bik.log_softmax, bik.mean           -- row reductions (also torch.ops.bik.*)
    bik.attention, bik.attention_varlen              -- fixed-split attention (paged KV, GQA)
    bik.plan_attention, bik.plan_attention_varlen    -- one step's checks, once (host metadata)
    bik.sample, bik.verify_draft                     -- Gumbel-max sampler keyed by (seed, position)
    bik.fingerprint                                  -- what decides the bits, as one digest
    bik.batch_invariant_mode                         -- stock torch code on bik (this thread,
                                                        eager and torch.compile)
    bik.enable / bik.disable / bik.enabled           -- the same at the dispatcher, every thread
    bik.testing                                      -- the invariance harness
"""

from bik.fingerprint import Fingerprint, fingerprint
from bik.mode import (
    BatchInvarianceWarning,
    ModeStats,
    batch_invariant_mode,
    disable,
    enable,
    enabled,
    is_batch_invariant_mode_enabled,
    is_enabled,
    mode_stats,
    reset_mode_stats,
    set_batch_invariant_mode,
)
from bik.ops._registry import BACKENDS, BackendUnavailableError
from bik.ops.attention import (
    AttentionOutput,
    AttentionPlan,
    attention,
    attention_varlen,
    plan_attention,
    plan_attention_varlen,
    write_kv_cache,
)
from bik.ops.matmul import PackedWeight, bmm, linear, matmul
from bik.ops.reductions import log_softmax, mean, softmax
from bik.ops.rms_norm import rms_norm
from bik.ops.sampling import SampleOutput, VerifyOutput, sample, verify_draft

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "AttentionOutput",
    "AttentionPlan",
    "BackendUnavailableError",
    "BatchInvarianceWarning",
    "Fingerprint",
    "ModeStats",
    "PackedWeight",
    "SampleOutput",
    "VerifyOutput",
    "attention",
    "attention_varlen",
    "batch_invariant_mode",
    "bmm",
    "disable",
    "enable",
    "enabled",
    "fingerprint",
    "is_batch_invariant_mode_enabled",
    "is_enabled",
    "linear",
    "log_softmax",
    "matmul",
    "mean",
    "mode_stats",
    "plan_attention",
    "plan_attention_varlen",
    "reset_mode_stats",
    "rms_norm",
    "sample",
    "set_batch_invariant_mode",
    "softmax",
    "verify_draft",
    "write_kv_cache",
]

"""bik: batch-invariant kernels. The bits of a row never depend on what else is in the batch.

Public API (see docs/api.md):
    bik.matmul, bik.linear, bik.bmm, bik.rms_norm  -- the ops (also torch.ops.bik.*)
    bik.grouped_matmul                               -- a mixture of experts' grouped product
    bik.softmax, bik.log_softmax, bik.mean           -- row reductions (also torch.ops.bik.*)
    bik.attention, bik.attention_varlen              -- fixed-split attention (paged KV, GQA)
    bik.plan_attention, bik.plan_attention_varlen    -- one step's checks, once (host metadata)
    bik.sample, bik.verify_draft                     -- Gumbel-max sampler keyed by (seed, position)
    bik.fingerprint                                  -- what decides the bits, as one digest
    bik.batch_invariant_mode                         -- stock torch code on bik (this thread,
                                                        eager and torch.compile)
    bik.enable / bik.disable / bik.enabled           -- the same at the dispatcher, every thread
    bik.testing                                      -- the invariance harness
    bik.moe (import it)                              -- MoE layers as transformers computes them
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
from bik.ops import attention as _attention
from bik.ops import matmul as _matmul
from bik.ops import reductions as _reductions
from bik.ops import rms_norm as _rms_norm
from bik.ops import sampling as _sampling
from bik.ops.attention import *  # noqa: F403  (each op package's __all__ is its public surface)
from bik.ops.matmul import *  # noqa: F403
from bik.ops.reductions import *  # noqa: F403
from bik.ops.rms_norm import *  # noqa: F403
from bik.ops.sampling import *  # noqa: F403
from bik.ops._registry import BACKENDS, BackendUnavailableError

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "BatchInvarianceWarning",
    "Fingerprint",
    "ModeStats",
    "batch_invariant_mode",
    "disable",
    "enable",
    "enabled",
    "fingerprint",
    "is_batch_invariant_mode_enabled",
    "is_enabled",
    "mode_stats",
    "reset_mode_stats",
    "set_batch_invariant_mode",
]
__all__ += _attention.__all__
__all__ += _matmul.__all__
__all__ += _reductions.__all__
__all__ += _rms_norm.__all__
__all__ += _sampling.__all__

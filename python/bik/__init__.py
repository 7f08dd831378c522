"""bik: batch-invariant kernels. The bits of a row never depend on what else is in the batch.

Public API (see docs/api.md):
    bik.matmul, bik.linear, bik.bmm, bik.rms_norm  -- the ops (also torch.ops.bik.*)
    bik.softmax, bik.log_softmax, bik.mean           -- row reductions (also torch.ops.bik.*)
    bik.attention, bik.attention_varlen              -- fixed-split attention (paged KV, GQA)
    bik.fingerprint                                  -- what decides the bits, as one digest
    bik.testing                                      -- the invariance harness
"""

from bik._backend import BACKENDS, BackendUnavailableError
from bik.fingerprint import Fingerprint, fingerprint
from bik.ops.attention import AttentionOutput, attention, attention_varlen, write_kv_cache
from bik.ops.matmul import bmm, linear, matmul
from bik.ops.reductions import log_softmax, mean, softmax
from bik.ops.rms_norm import rms_norm

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "AttentionOutput",
    "BackendUnavailableError",
    "Fingerprint",
    "attention",
    "attention_varlen",
    "bmm",
    "fingerprint",
    "linear",
    "log_softmax",
    "matmul",
    "mean",
    "rms_norm",
    "softmax",
    "write_kv_cache",
]

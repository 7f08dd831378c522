"""A reference decode-verify-rollback loop on bik kernels (after LLM-42).

A fast path decodes with ordinary kernels; a verifier on bik's batch-invariant kernels replays
windows of unverified tokens, keeps them up to the first mismatch, appends its own token and
overwrites the KV cache, so every deterministic request's output is that request decoded alone
(:func:`reference_decode`). Gumbel coupling (bik.verify_draft) extends this to sampled decoding
and drafter tokens. Model: :mod:`bik.dvr.model`, :mod:`bik.dvr.kernels`, :mod:`bik.dvr.step`;
engine: :mod:`bik.dvr.engine` (with :mod:`bik.dvr.scheduler`, :mod:`bik.dvr.verifier`,
:mod:`bik.dvr.sequence`), :mod:`bik.dvr.drafter`; CLI: ``bik dvr``, ``bik bench dvr``.
"""

from bik.dvr.config import LlamaConfig, llama_1b_config
from bik.dvr.drafter import NgramDrafter
from bik.dvr.engine import DVREngine, EngineConfig, StreamEvent
from bik.dvr.kernels import BikKernels, FastKernels, Kernels
from bik.dvr.metrics import EngineMetrics
from bik.dvr.model import LlamaModel, embedded_model, load_checkpoint, random_model
from bik.dvr.reference import reference_decode
from bik.dvr.requests import Request, RequestOutput, SamplingParams, Status
from bik.dvr.step import KVCache, Step, build_step

__all__ = [
    "BikKernels",
    "DVREngine",
    "EngineConfig",
    "EngineMetrics",
    "FastKernels",
    "KVCache",
    "Kernels",
    "LlamaConfig",
    "LlamaModel",
    "NgramDrafter",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "Status",
    "Step",
    "StreamEvent",
    "build_step",
    "embedded_model",
    "llama_1b_config",
    "load_checkpoint",
    "random_model",
    "reference_decode",
]

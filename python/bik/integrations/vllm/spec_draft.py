"""The drafter side of speculative decoding under the plugin: keyed proposals, and the fast path.

A draft model's proposal for a sampled row is ``bik.sample`` on the draft's logits with the
noise the target's verify will use, keyed by (request seed, absolute position) (vLLM's draft
model proposes the argmax). Coupling accepts a draft token iff it equals the target's draw
(:mod:`.spec_verify`), so a draft whose logits are the target's is accepted at every
position, and one whose logits are close is accepted wherever the noise decides the same.

Whatever the drafter does, the output is the run without speculation's (issue 50): a draft row
with nothing to draw (NaN or inf in the draft's logits) proposes token 0, a proposal outside
the vocabulary becomes 0 (it would index the target's embedding), and a drafter that raises
proposes 0 for every request that step (warned once, counted in ``DRAFTER``), as vLLM's own
fallback does when the input does not fit the drafter: the verifier then takes the target's
own tokens. An exception left to reach the in-process engine would wedge it.

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
import logging
import os

import torch

__all__ = ["DRAFTER", "KERNELS", "drafting_on_stock", "install", "loading_stock_draft"]

# drafter failures survived in this process: steps whose drafter raised, proposals that were
# outside the vocabulary
DRAFTER = {"raised": 0, "out_of_vocabulary": 0}
_log = logging.getLogger("bik.vllm")

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
    failed = sampler.failed_rows  # the target's, this step: a draft's rows are not requests'
    sampler.failed_rows = []
    try:
        with keyed(sampler, (self.bik_draft_seeds[:rows], position.cpu())):
            # a draft row with nothing to draw proposes token 0: the verifier takes the
            # target's own token there (coupling), so the output is the run without drafts'
            tokens, _ = sampler.sample(logits, sampling_metadata,
                                       logprobs_mode_override="raw_logprobs")
    finally:
        sampler.failed_rows = failed
    return tokens, None


def _in_vocabulary(drafts, vocab: int):
    """The proposals with every id outside [0, vocab) replaced by 0."""
    if torch.is_tensor(drafts):
        outside = (drafts < 0) | (drafts >= vocab)
        if bool(outside.any()):
            DRAFTER["out_of_vocabulary"] += int(outside.sum())
            drafts = drafts.masked_fill(outside, 0)
        return drafts
    outside = sum(not 0 <= t < vocab for row in drafts for t in row)
    if not outside:
        return drafts
    DRAFTER["out_of_vocabulary"] += outside
    return [[t if 0 <= t < vocab else 0 for t in row] for row in drafts]


def _any_drafter(propose_draft_token_ids):
    """The model runner's proposals whatever the drafter does (the module's docstring)."""
    @functools.wraps(propose_draft_token_ids)
    def propose(self, *args, **kwargs):
        try:
            drafts = propose_draft_token_ids(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any drafter failure: the step goes on
            DRAFTER["raised"] += 1
            if DRAFTER["raised"] == 1:
                _log.warning("bik: the drafter raised %s: %s; proposing token 0 for every "
                             "request of such a step (the target's tokens are the output)",
                             type(exc).__name__, exc)
            return torch.zeros(1, dtype=torch.int32).expand(len(self.input_batch.req_ids),
                                                            self.num_spec_tokens)
        return _in_vocabulary(drafts, self.model_config.get_vocab_size())

    propose.bik_wrapped = True
    return propose


def _keeping_runner(init):
    @functools.wraps(init)
    def wrapped(self, vllm_config, device, runner=None):
        init(self, vllm_config, device, runner)
        self.bik_runner = runner  # its sampler and its requests' seeds

    return wrapped


def install() -> None:
    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not getattr(GPUModelRunner.propose_draft_token_ids, "bik_wrapped", False):
        GPUModelRunner.propose_draft_token_ids = _any_drafter(
            GPUModelRunner.propose_draft_token_ids)
    cls = DraftModelProposer
    if getattr(cls.propose, "bik_wrapped", False):
        return
    cls.__init__ = _keeping_runner(cls.__init__)
    cls._get_model = _while(_LOADING, cls._get_model)
    cls.propose = _while(_ACTIVE, cls.propose)
    cls.dummy_run = _while(_ACTIVE, cls.dummy_run)
    cls.set_inputs_first_pass = _recording_positions(cls.set_inputs_first_pass)
    cls._sample_draft_tokens = _keyed_draft

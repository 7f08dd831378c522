"""The verifier side of speculative decoding under the plugin: vLLM's rejection sampler
replaced by Gumbel coupling, so the output is plain sampling's whatever the drafter proposed.

A verify step gives request r its k_r drafted tokens' k_r + 1 rows of target logits; row i
is the target's distribution for position ``num_tokens_no_spec + i``. Each row is drawn by
vLLM's sampler on bik.sample (:mod:`.sampler`), keyed by (request seed, that position): the
token plain decoding draws there. Draft i is accepted iff it equals row i's token; at the
first mismatch that row's token is emitted (not a fresh draw), and after k_r acceptances row
k_r's is (the bonus token). Greedy rows are the temperature-0 case of the same rule. The
rows' logits are the non-speculative run's bits (bik's linears, norms and attention give a
row the same bits whatever else is in the forward, verify rows included), so every token
and every logprob, in each logprobs mode the plugin serves, is the run without speculation's.

Served: vLLM's ``ngram`` and ``draft_model`` methods with the ``standard`` rejection-sample
method. Refused, each naming itself: every other method, other rejection-sample methods,
parallel drafting, heterogeneous vocabularies, adaptive verification, and per-request
processing the verify rows cannot reproduce here (penalties, bad words, allowed token ids,
logit bias, min-p, min-tokens, custom logits processors, per-token logprob ids): a request
asking for one is refused when vLLM admits it (the others go on), and the verifier refuses a
step that still has one (a custom processor, a thinking budget).
``BIK_VLLM_STOCK_REJECTION=1`` keeps vLLM's rejection sampler over bik's target: a negative
control for tests and benchmarks, not a serving mode.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from vllm import SamplingParams
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler

from bik._env import flag
from bik.integrations.vllm.sampler import keyed

__all__ = ["METHODS", "SPEC", "BikRejectionSampler", "install"]

METHODS = ("ngram", "draft_model")
SPEC = {"verify_steps": 0, "drafted": 0, "accepted": 0}  # counts in this process


def refuse_config(spec) -> None:
    """What a speculative config may ask for that coupling does not serve."""
    refused = {
        f"speculative method {spec.method!r} (served: {', '.join(METHODS)})":
            spec.method not in METHODS,
        f"rejection_sample_method={spec.rejection_sample_method!r}":
            spec.rejection_sample_method != "standard",
        "parallel drafting": spec.parallel_drafting,
        "a draft model with another vocabulary": spec.use_heterogeneous_vocab,
        "adaptive verification": spec.enable_adaptive_verification,
    }
    for what, present in refused.items():
        if present:
            raise NotImplementedError(f"bik.integrations.vllm: speculative decoding with "
                                      f"{what} is not served; unset BIK_VLLM or drop it")


def _active_processors(md) -> list[str]:
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                         MinPLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    active = []
    for proc in md.logitsprocs.all:
        if isinstance(proc, MinPLogitsProcessor):
            on, name = proc.min_p_count, "min_p"
        elif isinstance(proc, LogitBiasLogitsProcessor):
            on, name = proc.biases, "logit_bias"
        elif isinstance(proc, MinTokensLogitsProcessor):
            on, name = proc.min_toks, "min_tokens"
        else:
            on, name = True, f"logits processor {type(proc).__name__}"
        if on:
            active.append(name)
    return active


def refuse_params(params) -> None:
    """A request's SamplingParams the verifier cannot serve, refused when vLLM admits the
    request (a ValueError vLLM returns to that request alone): the names and values."""
    asked = {"presence_penalty": params.presence_penalty != 0,
             "frequency_penalty": params.frequency_penalty != 0,
             "repetition_penalty": params.repetition_penalty != 1,
             "bad_words": bool(params.bad_words), "allowed_token_ids":
             params.allowed_token_ids is not None, "logit_bias": bool(params.logit_bias),
             "min_p": params.min_p > 0, "min_tokens": params.min_tokens > 0}
    refused = [f"{name}={getattr(params, name)!r}" for name, on in asked.items() if on]
    if refused:
        raise ValueError(f"bik.integrations.vllm: speculative decoding with "
                         f"{', '.join(refused)} is not served (the verify rows would need "
                         f"per-request state); drop it, or serve it from an engine without "
                         f"speculation")


def _validating(validate):
    @functools.wraps(validate)
    def checked(self, params, *args, **kwargs):
        out = validate(self, params, *args, **kwargs)
        if self.speculative_config is not None and isinstance(params, SamplingParams):
            refuse_params(params)
        return out

    checked.bik_wrapped = True
    return checked


def refuse_requests(md) -> None:
    """Per-request processing the verify rows would need per request state for."""
    holder = md.thinking_budget_state_holder
    refused = [name for name, on in (
        ("penalties", not md.no_penalties), ("bad_words", bool(md.bad_words_token_ids)),
        ("allowed_token_ids", md.allowed_token_ids_mask is not None),
        ("logprob_token_ids", bool(md.logprob_token_ids)),
        ("a thinking budget", holder is not None and holder.has_tracked_requests())) if on]
    refused += _active_processors(md)
    if refused:
        raise NotImplementedError(f"bik.integrations.vllm: speculative decoding with "
                                  f"{', '.join(refused)} in a request is not served; turn "
                                  f"speculation off for such requests or unset BIK_VLLM")


def accepted_counts(draft: torch.Tensor, target: torch.Tensor, num_drafts: torch.Tensor,
                    req: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Each request's accepted drafts: the length of the run of drafts equal to the target's
    tokens at their rows (``draft`` [sum k_r], ``target`` the drawn token of every row)."""
    rows, width = num_drafts.shape[0], int(num_drafts.max()) if num_drafts.numel() else 0
    match = torch.zeros(rows, max(width, 1), dtype=torch.int64)
    is_draft = offset < num_drafts[req]
    match[req[is_draft], offset[is_draft]] = (target[is_draft] == draft).to(torch.int64)
    return match.cumprod(dim=1).sum(dim=1)


def _rows_metadata(md, req: torch.Tensor):
    """The request-level sampling metadata spread over the verify rows (request of each)."""
    def per_row(t):
        return None if t is None else t[req.to(t.device)]

    return dataclasses.replace(md, temperature=per_row(md.temperature), top_p=per_row(md.top_p),
                               top_k=per_row(md.top_k), generators={})


class BikRejectionSampler(RejectionSampler):
    """vLLM's rejection sampler with Gumbel coupling in place of the ratio rule."""

    def __init__(self, sampler, spec_config=None, device=None):
        if spec_config is not None:
            refuse_config(spec_config)
        super().__init__(sampler, spec_config, device)

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        del draft_probs  # coupling never reads the draft's distribution
        refuse_requests(sampling_metadata)
        num_drafts = torch.tensor(metadata.num_draft_tokens, dtype=torch.int64)
        counts = num_drafts + 1
        req = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
        first = torch.cumsum(counts, 0) - counts  # each request's first row
        offset = torch.arange(req.shape[0]) - first[req]
        seed, position = self.sampler.keys
        with keyed(self.sampler, (seed[req], position[req] + offset)):
            out = self.sampler(logits, _rows_metadata(sampling_metadata, req))
        # a verify row with nothing to draw fails its request (request_errors.py)
        self.sampler.failed_rows = sorted({int(req[r]) for r in self.sampler.failed_rows})
        target = out.sampled_token_ids[:, 0].cpu()
        draft = metadata.draft_token_ids.cpu().to(target.dtype)
        accepted = accepted_counts(draft, target, num_drafts, req, offset)
        width = metadata.max_spec_len + 1
        tokens = torch.full((counts.shape[0], width), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
        kept = offset <= accepted[req]
        tokens[req[kept], offset[kept]] = target[kept].to(torch.int32)
        SPEC["verify_steps"] += 1
        SPEC["drafted"] += int(num_drafts.sum())
        SPEC["accepted"] += int(accepted.sum())
        device = out.sampled_token_ids.device
        return SamplerOutput(sampled_token_ids=tokens.to(device),
                             logprobs_tensors=_by_slot(out.logprobs_tensors, first, width,
                                                       req.shape[0]))


def _by_slot(lp: LogprobsTensors | None, first: torch.Tensor, width: int, rows: int):
    """The verify rows' logprobs laid out as vLLM's rejection sampler lays them out: [request,
    slot] flattened, slot j of request r is row first[r] + j (clamped; slots past the emitted
    tokens are dropped by vLLM's parse_output)."""
    if lp is None:
        return None
    at = (first[:, None] + torch.arange(width)[None, :]).flatten().clamp_(max=rows - 1)
    at = at.to(lp.logprobs.device)
    return LogprobsTensors(lp.logprob_token_ids[at], lp.logprobs[at],
                           lp.selected_token_ranks[at])


def _stock_control() -> bool:
    return flag("BIK_VLLM_STOCK_REJECTION")


def install() -> None:
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker import gpu_model_runner as runner

    if _stock_control():
        return
    if runner.RejectionSampler is not BikRejectionSampler:
        runner.RejectionSampler = BikRejectionSampler  # the model runner builds it by name
    if not getattr(InputProcessor._validate_params, "bik_wrapped", False):
        InputProcessor._validate_params = _validating(InputProcessor._validate_params)

"""vLLM's token draw on ``bik.sample``, keyed by (request seed, position).

vLLM-CPU draws a random row's token with noise seeded from the request's generator once per
step (one draw per step, whatever the position), and an unseeded row's noise from the global
generator, so a token depends on how many steps its request went through and, unseeded, on
the other rows. Here every row's Gumbel noise is keyed by its request's seed and the absolute
position of the token drawn: a request's tokens are the same alone, in any batch, after a
preemption, and when its generated text is fed back as a prompt.

Everything before the draw stays vLLM's (raw logprobs, allowed / bad words, penalties,
logit bias, temperature, min-p and other argmax-invariant processors); the draw itself
(top-k, top-p, Gumbel-max; argmax for greedy rows) is bik.sample on the processed logits.

Every logprobs mode is served. Raw modes are vLLM's (its log_softmax runs on bik under
bik.enable()). Processed modes return the logits the draw saw (tempered, min-p's -inf
applied, top-k / top-p's dropped tokens at -inf: the sampler's own set, ops/sampling/kept.py;
greedy rows untempered, as vLLM's) or their bik.log_softmax, whose entry at the drawn token is
bik.sample's logprob bit for bit (one normaliser), so a trainer's
``log_softmax(logits.float() / T)`` under bik.enable() is the engine's (with a filter, of the
filtered logits).
Per step, the model runner's ``_sample`` hands the sampler each row's seed and position
(``input_batch.num_tokens_no_spec``: the tokens before the one drawn).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from vllm.v1.sample.sampler import _SAMPLING_EPS, Sampler

import bik
from bik.ops.sampling.kept import kept_tokens
from bik.ops.sampling.noise import seed_int64

__all__ = ["CALLS", "BikSampler", "install", "keyed", "request_seeds"]

CALLS = [0]  # bik.sample calls from vLLM's sampler in this process
_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class BikSampler(Sampler):
    """vLLM's Sampler with the draw on bik.sample. ``keys`` is (seed, position) int64 [rows],
    set by the model runner around each call (:func:`keyed`)."""

    def __init__(self, logprobs_mode="raw_logprobs", use_fp64_gumbel=False):
        if logprobs_mode not in _MODES:
            raise NotImplementedError(f"bik.integrations.vllm: logprobs_mode={logprobs_mode!r} "
                                      f"is not served; use one of {_MODES}")
        super().__init__(logprobs_mode, use_fp64_gumbel)
        self.keys: tuple[torch.Tensor, torch.Tensor] | None = None
        # rows of the calls since the caller reset it that had nothing to draw (token -1),
        # given token 0: request_errors.py ends their requests
        self.failed_rows: list[int] = []

    def sample(self, logits, sampling_metadata, logprobs_mode_override=None):
        md = sampling_metadata
        if self.keys is None:
            raise RuntimeError("bik.integrations.vllm: the sampler ran outside the model "
                               "runner's _sample, so it has no (seed, position) per row")
        seed, position = (t[:logits.shape[0]] for t in self.keys)
        if md.all_greedy:
            temperature = torch.zeros(logits.shape[0], dtype=torch.float32)
        else:
            logits = self.apply_temperature(logits, md.temperature, md.all_random)
            for processor in md.logitsprocs.argmax_invariant:
                logits = processor.apply(logits)
            # Tempered already: 1 draws from them, 0 takes their argmax (a greedy row's).
            temperature = (md.temperature >= _SAMPLING_EPS).to(torch.float32)
        device = logits.device
        # vLLM keeps top-k as int32 and "off" as the vocabulary size (bik: off too).
        top_k = None if md.top_k is None or md.all_greedy else md.top_k.to(device, torch.int64)
        top_p = None if md.top_p is None or md.all_greedy else md.top_p.to(device, torch.float32)
        out = bik.sample(logits, seed=seed.to(device), position=position.to(device),
                         temperature=temperature.to(device), top_k=top_k, top_p=top_p,
                         max_top_k=_max_top_k(top_k, logits.shape[-1]),
                         any_top_p=None if top_p is not None else False)
        CALLS[0] += 1
        if logits.device.type == "cpu" and bool((bad := out.tokens < 0).any()):
            self.failed_rows += bad.nonzero().flatten().tolist()
            out = out._replace(tokens=out.tokens.masked_fill(bad, 0))
        mode = logprobs_mode_override or self.logprobs_mode
        if not mode.startswith("processed") or (md.max_num_logprobs is None
                                                and not md.logprob_token_ids):
            return out.tokens, None
        # The draw's filters as -inf, as vLLM's processed rows have them (min-p's are in the
        # logits already); the set is bik.sample's own (ops/sampling/kept.py).
        if top_k is not None or top_p is not None:
            logits = logits.masked_fill(~kept_tokens(logits, top_k, top_p), float("-inf"))
        return out.tokens, logits if mode == "processed_logits" else bik.log_softmax(logits, -1)


def _max_top_k(top_k: torch.Tensor | None, vocab: int) -> int | None:
    """bik.sample's host bound on the top-k in use (vLLM stores "off" as the vocabulary size).
    On a GPU it is left to bik (one read-back) rather than read here."""
    if top_k is None:
        return 0
    if top_k.device.type != "cpu":
        return None
    on = top_k[(top_k > 0) & (top_k < vocab)]
    return int(on.max()) if on.numel() else 0


def request_seeds(runner) -> torch.Tensor:
    """Each row's request seed, int64 [rows]. An unseeded request gets a seed from torch's
    global generator once, when the sampler first sees it: its tokens are then its own,
    whatever else shares the batch, as a seeded request's are."""
    batch = runner.input_batch
    seeds = []
    for row, req_id in enumerate(batch.req_ids[:batch.num_reqs]):
        state = runner.requests[req_id]
        if getattr(state, "bik_seed", None) is None:
            generator = batch.generators.get(row)
            state.bik_seed = seed_int64(generator.initial_seed() if generator is not None
                                        else int(torch.randint(0, 2**62, ()).item()),
                                        "bik.integrations.vllm")
            # Its seed is all bik reads. vLLM-CPU rewinds a seeded row's generator when it
            # discards a partial prefill's token, which a CPU generator refuses ("does not
            # use offset": stock vLLM-CPU fails on seeded requests with chunked prefill).
            batch.generators.pop(row, None)
        seeds.append(state.bik_seed)
    return torch.tensor(seeds, dtype=torch.int64)


def _keys(runner) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (request seed, position of the token drawn: the tokens before it, drafts
    not counted; a verify step's row i is i past it)."""
    batch = runner.input_batch
    position = torch.from_numpy(batch.num_tokens_no_spec[:batch.num_reqs].astype("int64"))
    return request_seeds(runner), position


@contextlib.contextmanager
def keyed(sampler: BikSampler, keys):
    before, sampler.keys = sampler.keys, keys
    try:
        yield
    finally:
        sampler.keys = before


def _sample(original):
    @functools.wraps(original)
    def sample(self, logits, spec_decode_metadata):
        from bik.integrations.vllm import request_errors

        # With speculation, the verifier (spec_verify.py) spreads these keys over its rows
        # (and gives back its failed rows as the requests' indices).
        self.sampler.failed_rows = []
        with keyed(self.sampler, _keys(self)):
            out = original(self, logits, spec_decode_metadata)
        if self.sampler.failed_rows:
            ids = self.input_batch.req_ids
            request_errors.fail(self, [ids[r] for r in sorted(set(self.sampler.failed_rows))])
        return out

    return sample


def _dummy_sampler_run(original):
    @functools.wraps(original)
    def run(self, hidden_states):
        # vLLM's warm-up samples rows that belong to no request: seed 0, position 0.
        rows = hidden_states.shape[0]
        zeros = torch.zeros(rows, dtype=torch.int64)
        with keyed(self.sampler, (zeros, zeros)):
            return original(self, hidden_states)

    return run


# bik's keys take every 64-bit seed (ops/sampling/noise.seed_int64), but vLLM seeds a torch
# generator with a request's seed in its step, which takes a signed 64-bit one: 2**63 and up
# failed inside the step ("Overflow when unpacking long long", measured by tools/soak.py)
SEED_LIMIT = 2**63


def check_request_seed(seed) -> None:
    """ValueError unless a request's seed is None or an int in [0, 2**63) (vLLM turns -1
    into None first). Checked when the SamplingParams are made, in the caller's thread: a seed
    outside reaching the engine fails inside its step (stock vLLM-CPU wedges on 2**64)."""
    if seed is not None and (type(seed) is not int or not 0 <= seed < SEED_LIMIT):
        raise ValueError(f"bik.integrations.vllm: a request's seed must be an int in "
                         f"[0, 2**63), or None (-1) for none; got {seed!r}")


def _checked_seed(verify):
    @functools.wraps(verify)
    def _verify_args(self):
        check_request_seed(self.seed)
        verify(self)

    _verify_args.bik_wrapped = True
    return _verify_args


def install() -> None:
    from vllm import SamplingParams
    from vllm.v1.worker import gpu_model_runner as runner

    if not getattr(SamplingParams._verify_args, "bik_wrapped", False):
        SamplingParams._verify_args = _checked_seed(SamplingParams._verify_args)

    if runner.Sampler is not BikSampler:
        runner.Sampler = BikSampler  # the model runner builds its sampler from this name
        cls = runner.GPUModelRunner
        cls._sample = _sample(cls._sample)
        cls._dummy_sampler_run = _dummy_sampler_run(cls._dummy_sampler_run)

"""The decode-verify-rollback engine: every deterministic request's committed output equals the
request decoded alone on bik kernels, token for token and logprob for logprob, whatever the
window K, group N, verifier shape, drafter, forced mismatches, arrival order and neighbours."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from bik.dvr import (
    DVREngine,
    EngineConfig,
    NgramDrafter,
    Request,
    SamplingParams,
    Status,
    reference_decode,
)
from bik.dvr.kernels import BikKernels, FastKernels
from bik.dvr.model import embedded_model
from bik.dvr.sampling import sample_rows
from bik.dvr.step import KVCache, build_step
from bik.dvr.workload import Arrival, make_workload, run_workload
from covering_array import CASES, case_id

BIK = BikKernels()


@functools.cache
def model():
    return embedded_model(seed=0)


@functools.cache
def _reference(req: Request):
    return reference_decode(model(), req, BIK)


def reference(req: Request):
    return _reference(req)


def engine(**cfg) -> DVREngine:
    cfg.setdefault("num_blocks", 256)
    cfg.setdefault("block_size", 8)
    return DVREngine(model(), EngineConfig(**cfg), fast_kernels=FastKernels(),
                     verify_kernels=BIK)


def workload(seed: int, temperature: float, *, num_requests: int = 6, det_fraction=0.75,
             repetitive=False):
    return make_workload(vocab_size=model().config.vocab_size, num_requests=num_requests,
                         seed=seed, det_fraction=det_fraction, prompt_len=(1, 20),
                         max_new_tokens=(6, 20), temperature=temperature, top_k=0,
                         arrival_spread=5, repetitive=repetitive)


def assert_matches_reference(arrivals, outputs, *, allow_unfinished=False):
    assert sorted(outputs) == sorted(a.request.request_id for a in arrivals)  # none lost
    for a in arrivals:
        req, out = a.request, outputs[a.request.request_id]
        if not allow_unfinished:
            assert out.status is Status.FINISHED, req.request_id
        if req.deterministic:
            ref = reference(req)
            assert out.tokens == ref.tokens, req.request_id
            assert out.logprobs == ref.logprobs, req.request_id
            assert out.finish_reason == ref.finish_reason, req.request_id
        else:
            assert 1 <= len(out.tokens) <= req.max_new_tokens


def test_pairwise_cases_cover_every_pair():
    import itertools

    from covering_array import FACTORS
    for a, b in itertools.combinations(FACTORS, 2):
        seen = {(c[a], c[b]) for c in CASES}
        assert seen == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_outputs_equal_solo_reference(case):
    arrivals = workload(case["arrival_seed"], case["temperature"],
                        repetitive=case["drafter"] > 0)
    random.Random(case["arrival_seed"]).shuffle(arrivals)  # arrival order within a step
    eng = engine(window=case["window"], group=case["group"], verifier=case["verifier"],
                 drafter=NgramDrafter(num_tokens=case["drafter"]) if case["drafter"] else None,
                 mismatch_rate=case["mismatch_rate"], mismatch_seed=case["arrival_seed"])
    streamed: dict[str, list[int]] = {}

    def on_step(events):
        for e in events:
            streamed.setdefault(e.request_id, []).extend(e.tokens)

    outputs = run_workload(eng, arrivals, on_step)
    assert_matches_reference(arrivals, outputs)
    # Only committed tokens are streamed, each once, in order.
    assert streamed == {rid: out.tokens for rid, out in outputs.items()}
    assert eng.pool.num_free == eng.pool.num_blocks  # every KV block freed
    m = eng.metrics
    if case["mismatch_rate"] == 1.0:  # every window's first fast token is wrong
        assert m.windows > 0 and m.rollbacks == m.windows


def test_negative_control_fast_path_alone_is_not_the_reference():
    """Without the verifier the fast path's outputs are not the solo reference: its kernels'
    bits move with the batch (CPU fp32 torch.mm at M = 1 vs M >= 4), and logprobs show it."""
    arrivals = workload(3, 0.9, det_fraction=1.0)
    outputs = run_workload(engine(verify=False), arrivals)
    differing = [a.request.request_id for a in arrivals
                 if outputs[a.request.request_id].logprobs != reference(a.request).logprobs]
    assert differing  # measured: every request's logprobs differ in some bit


def test_negative_control_batch_dependent_verifier_is_caught():
    """A verifier whose kernels are the fast ones (batch-dependent) fails the same check."""
    arrivals = workload(4, 0.9, det_fraction=1.0)
    eng = DVREngine(model(), EngineConfig(window=4, group=2, block_size=8, num_blocks=256),
                    fast_kernels=FastKernels(), verify_kernels=FastKernels())
    outputs = run_workload(eng, arrivals)
    with pytest.raises(AssertionError):
        assert_matches_reference(arrivals, outputs)


class OracleDrafter:
    """Proposes the solo reference's continuation (``wrong_every`` > 0: every n-th drafted
    token replaced by another): drafts the verifier must accept, and some it must reject."""

    def __init__(self, arrivals, num_tokens=4, wrong_every=0):
        self.num_tokens, self.wrong_every = num_tokens, wrong_every
        self.refs = {a.request.prompt: reference(a.request).tokens for a in arrivals}
        self.count = 0

    def propose(self, tokens, limit=None):
        for prompt, ref in self.refs.items():
            gen = list(tokens[len(prompt):])
            if tuple(tokens[:len(prompt)]) == prompt and ref[:len(gen)] == gen:
                out = ref[len(gen):len(gen) + min(limit or self.num_tokens, self.num_tokens)]
                if self.wrong_every:
                    out = [(t + 1) % 7 if (self.count + i) % self.wrong_every == 0 else t
                           for i, t in enumerate(out)]
                    self.count += len(out)
                return out
        return []


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_drafter_changes_nothing_but_passes(wrong_every):
    """Drafts enter the verify pass and are accepted iff equal to the verifier's Gumbel choice:
    the output equals the run without a drafter; good drafts cut verifier passes."""
    arrivals = workload(5, 0.9, det_fraction=1.0)
    plain = engine(window=2, group=2)
    drafted = engine(window=2, group=2,
                     drafter=OracleDrafter(arrivals, num_tokens=4, wrong_every=wrong_every))
    out_plain = run_workload(plain, arrivals)
    out_drafted = run_workload(drafted, arrivals)
    for rid in out_plain:
        assert out_plain[rid].tokens == out_drafted[rid].tokens
        assert out_plain[rid].logprobs == out_drafted[rid].logprobs
    m = drafted.metrics
    assert m.drafted > 0 and m.drafts_accepted > 0
    if wrong_every == 0:
        assert m.drafts_accepted == m.drafted or m.rollbacks > 0
        assert m.verify_passes < plain.metrics.verify_passes
    else:
        assert m.drafts_accepted < m.drafted


class FaultyDrafter(OracleDrafter):
    """The oracle, except that it raises for one request and proposes tokens outside the
    vocabulary for another."""

    def __init__(self, arrivals, vocab):
        super().__init__(arrivals)
        self.raises_for, self.garbage_for = arrivals[0].request.prompt, arrivals[1].request.prompt
        self.vocab = vocab

    def propose(self, tokens, limit=None):
        if tuple(tokens[:len(self.raises_for)]) == self.raises_for:
            raise KeyError("the drafter's own bug")
        if tuple(tokens[:len(self.garbage_for)]) == self.garbage_for:
            return [self.vocab + 5, -1]
        return super().propose(tokens, limit)


def test_a_failing_drafter_costs_its_drafts_not_the_step():
    """Before: the drafter's exception escaped step() and every request stopped; a draft
    outside the vocabulary reached the embedding."""
    arrivals = workload(5, 0.9, det_fraction=1.0)
    eng = engine(window=2, group=2, drafter=FaultyDrafter(arrivals, model().config.vocab_size))
    with pytest.warns(RuntimeWarning, match="the drafter raised for request 'r0'"):
        outputs = run_workload(eng, arrivals)
    assert_matches_reference(arrivals, outputs)
    assert eng.metrics.drafter_errors > 0 and eng.metrics.drafts_accepted > 0


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    d = NgramDrafter(num_tokens=3, max_ngram=2)
    assert d.propose([5, 6, 7, 8, 5, 6]) == [7, 8, 5]
    assert d.propose([1, 2, 9, 1, 2, 3, 4, 2]) == [3, 4, 2]  # latest match of [2] wins
    assert d.propose([1, 2, 3]) == []
    assert d.propose([4, 4, 4], limit=1) == [4]
    with pytest.raises(ValueError):
        NgramDrafter(num_tokens=0)


def test_fixed_shape_verifier_same_output_more_rows():
    arrivals = workload(6, 0.0, det_fraction=1.0)
    exact, fixed = engine(window=4, group=4), engine(window=4, group=4, verifier="fixed")
    out_e, out_f = run_workload(exact, arrivals), run_workload(fixed, arrivals)
    assert {k: v.tokens for k, v in out_e.items()} == {k: v.tokens for k, v in out_f.items()}
    assert fixed.metrics.verify_rows > exact.metrics.verify_rows


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(model().config.vocab_size) for _ in range(n))


def test_eos_and_max_tokens_inside_a_window():
    base = Request("base", _prompt(7, 1), 16, SamplingParams(0.9, seed=3))
    ref = reference(base)
    eos = ref.tokens[5]
    with_eos = Request("eos", base.prompt, 16, base.sampling, eos_token_ids=(eos,))
    short = Request("short", base.prompt, 6, base.sampling)
    eng = engine(window=16, group=2, mismatch_rate=0.3)
    arrivals = [Arrival(0, with_eos), Arrival(0, short)]
    outputs = run_workload(eng, arrivals)
    assert outputs["eos"].finish_reason == "eos"
    assert outputs["eos"].tokens == ref.tokens[:ref.tokens.index(eos) + 1]
    assert outputs["short"].finish_reason == "length"
    assert outputs["short"].tokens == ref.tokens[:6]
    assert_matches_reference(arrivals, outputs)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_cancel_mid_window_frees_blocks_and_spares_the_others():
    arrivals = workload(7, 0.9, det_fraction=1.0)
    eng = engine(window=8, group=4)
    for a in arrivals:
        eng.add_request(a.request)
    victim = arrivals[0].request.request_id
    for _ in range(6):  # into the victim's first window: unverified tokens pending
        eng.step()
    assert eng.outputs[victim].status is Status.RUNNING
    eng.cancel(victim)
    with pytest.raises(KeyError):
        eng.cancel(victim)
    outputs = eng.run()
    cancelled = outputs[victim]
    assert cancelled.status is Status.CANCELLED and cancelled.finish_reason == "cancelled"
    ref = reference(arrivals[0].request)
    assert cancelled.tokens == ref.tokens[:len(cancelled.tokens)]
    assert_matches_reference(arrivals[1:], {k: v for k, v in outputs.items() if k != victim})
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 8, 13, 21, 34, 50])
def test_same_prompt_any_batch_size_one_output(batch):
    """SGLang-style: the same prompt at batch sizes 1..50 gives one unique output."""
    req = Request("x", _prompt(9, 2), 8, SamplingParams(0.9, seed=11))
    arrivals = [Arrival(i % 3, Request(f"x{i}", req.prompt, req.max_new_tokens, req.sampling))
                for i in range(batch)]
    outputs = run_workload(engine(window=4, group=8, mismatch_rate=0.2), arrivals)
    unique = {(tuple(o.tokens), tuple(o.logprobs)) for o in outputs.values()}
    assert unique == {(tuple(reference(req).tokens), tuple(reference(req).logprobs))}


def test_shared_prefixes_of_several_lengths():
    base = _prompt(40, 5)
    reqs = [Request(f"p{n}", base[:n] + _prompt(3, n), 10, SamplingParams(0.9, seed=n))
            for n in (1, 7, 8, 9, 17, 33)]
    arrivals = [Arrival(0, r) for r in reqs]
    assert_matches_reference(arrivals, run_workload(engine(window=4, group=2,
                                                           mismatch_rate=0.3), arrivals))


def test_reprefill_reproduces_decode_logprobs():
    """Prefill prompt + output in one pass on bik kernels: the logprobs of the generated tokens
    equal those the engine streamed while decoding."""
    req = Request("re", _prompt(6, 9), 14, SamplingParams(0.9, seed=4))
    outputs = run_workload(engine(window=4, group=1, mismatch_rate=0.3), [Arrival(0, req)])
    out = outputs["re"]
    seq = list(req.prompt) + out.tokens[:-1]
    cache = KVCache.allocate(model().config, 8, 8, torch.float32, "cpu")
    step = build_step([len(seq)], [len(seq)], [list(range(8))], 8)
    logits = model().forward(torch.tensor(seq), torch.arange(len(seq)), step, cache, BIK)
    p = len(req.prompt)
    toks, lps = sample_rows(logits[p - 1:], [req.sampling] * len(out.tokens),
                            list(range(p, p + len(out.tokens))))
    assert toks == out.tokens
    assert lps == out.logprobs


def test_non_deterministic_requests_skip_verification():
    arrivals = workload(8, 0.9, det_fraction=0.0)
    eng = engine(window=4, group=2, mismatch_rate=1.0)
    outputs = run_workload(eng, arrivals)
    assert eng.metrics.verify_passes == 0 and eng.metrics.forced_mismatches == 0
    assert all(o.status is Status.FINISHED for o in outputs.values())


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="window"):
        EngineConfig(window=0)
    with pytest.raises(ValueError, match="verifier"):
        EngineConfig(verifier="padded")
    with pytest.raises(ValueError, match="mismatch_rate"):
        EngineConfig(mismatch_rate=1.5)
    with pytest.raises(ValueError, match="empty prompt"):
        Request("e", (), 4)
    eng = engine()
    eng.add_request(Request("a", (1, 2), 4))
    with pytest.raises(ValueError, match="already submitted"):
        eng.add_request(Request("a", (1, 2), 4))
    with pytest.raises(ValueError, match="outside"):
        eng.add_request(Request("b", (1, 10**6), 4))


@pytest.mark.parametrize("field, value", [
    ("temperature", float("inf")), ("seed", 2**64), ("seed", -1), ("top_k", 2**63),
    ("top_k", 1.5), ("seed", True),
])
def test_sampling_params_that_a_step_could_not_run_are_rejected(field, value):
    """Each of these passed add_request and then made every step raise (one bad request
    stalled all the others)."""
    with pytest.raises(ValueError, match=f"SamplingParams: {field} must be"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("prompt, exc, what", [
    ((1, 3.7), TypeError, "holds 3.7, not a token id"),
    ("123", TypeError, "must be token ids, got a string"),
    ((1, True), TypeError, "holds True"), ((1, -2), ValueError, "negative token id"),
])
def test_requests_keep_their_tokens_or_are_refused(prompt, exc, what):
    """int() used to turn 3.7 into 3 and "123" into (1, 2, 3) silently."""
    with pytest.raises(exc, match=what):
        Request("r", prompt, 4)
    assert Request("r", (torch.tensor(5), 7), 4).prompt == (5, 7)


@pytest.mark.parametrize("field", ["max_running", "num_blocks", "block_size"])
def test_an_engine_that_could_never_progress_is_refused(field):
    """EngineConfig(max_running=0) was accepted and run() never returned."""
    with pytest.raises(ValueError, match=f"EngineConfig: {field} must be >= 1, got 0"):
        EngineConfig(**{field: 0})


@pytest.mark.parametrize("deterministic", [True, False])
def test_an_invalid_row_ends_its_request_and_no_other(deterministic):
    """NaN logits (here: a NaN embedding row that only the bad request's prompt uses) make
    bik.sample mark the row invalid (token -1). The engine used to commit -1, feed it back (the
    embedding wrapped it to the last row) and finish with "length". Now the request ends with
    reason "invalid_logits" and no -1 in its output (on the fast path of a deterministic
    request -1 becomes a placeholder the verifier rejects), and the good request beside it
    equals its solo reference."""
    good = Request("good", (4, 5, 6, 7), 6, SamplingParams(temperature=0.8, seed=3))
    want = _reference(good)
    poisoned = next(t for t in range(1, 100) if t not in (*good.prompt, *want.tokens))
    broken = embedded_model(seed=0)
    broken.embed = broken.embed.clone()  # the LM head keeps its own (tied) tensor
    broken.embed[poisoned] = float("nan")
    bad = Request("bad", (1, poisoned, 3), 6, SamplingParams(temperature=0.7, seed=1),
                  deterministic)
    eng = DVREngine(broken, EngineConfig(num_blocks=256, block_size=8, window=2),
                    fast_kernels=FastKernels(), verify_kernels=BIK)
    for req in (bad, good):
        eng.add_request(req)
    while eng.has_work:
        eng.step()
    out = eng.outputs
    assert out["bad"].status == Status.FINISHED and out["bad"].finish_reason == "invalid_logits"
    assert all(t >= 0 for t in out["bad"].tokens)
    assert out["good"].tokens == want.tokens and out["good"].logprobs == want.logprobs


def test_a_64_bit_seed_is_sampled_with_its_bits():
    """A seed >= 2**63 runs (as the int64 of its bits, as bik.sample takes an int)."""
    eng = engine()
    eng.add_request(Request("s", (1, 2, 3), 4, SamplingParams(temperature=0.8, seed=2**64 - 1)))
    while eng.has_work:
        eng.step()
    out = eng.outputs["s"]
    assert out.status == Status.FINISHED and len(out.tokens) == 4


def test_metrics_summary_has_the_rates():
    eng = engine(window=4, group=2, mismatch_rate=0.5, drafter=NgramDrafter(num_tokens=2))
    run_workload(eng, workload(9, 0.9, repetitive=True, det_fraction=1.0))
    s = eng.metrics.summary()
    for key in ("committed_tokens_per_s", "fast_tokens_per_s", "recompute_fraction",
                "verify_passes", "verify_rows_per_committed", "rollback_rate",
                "draft_acceptance"):
        assert key in s
    assert s["committed_tokens"] == sum(len(o.tokens) for o in eng.outputs.values())
    assert 0 < s["rollback_rate"] <= 1

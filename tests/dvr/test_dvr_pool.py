"""The engine under a KV pool too small for its load: a request that can never fit is refused at
admission, the others are preempted and recomputed instead of raising from step(), and a
seeded soak (arrivals, cancellations, bad requests, exhaustion, forced mismatches) checks after
every step that no request is lost, duplicated or wedged, every block is accounted for, and
every deterministic request's output is its solo reference's."""

from __future__ import annotations

import random

import pytest
from bik.dvr import DVREngine, EngineConfig, NgramDrafter, Request, SamplingParams, Status
from bik.dvr.blocks import OutOfBlocksError
from bik.dvr.kernels import FastKernels
from bik.dvr.workload import make_workload, run_workload
from test_dvr_engine import BIK, assert_matches_reference, model, reference


def _engine(**cfg) -> DVREngine:
    return DVREngine(model(), EngineConfig(**cfg), fast_kernels=FastKernels(),
                     verify_kernels=BIK)


def test_a_request_that_can_never_fit_is_refused_and_the_others_run():
    eng = _engine(num_blocks=4, block_size=4)
    big = Request("big", prompt=tuple(range(1, 11)), max_new_tokens=10)  # 20 rows: 5 blocks
    with pytest.raises(ValueError, match=r"'big' can never fit.*needs? 5 KV blocks.*has 4"):
        eng.add_request(big)
    small = Request("small", prompt=(3, 4, 5), max_new_tokens=6)
    eng.add_request(small)
    out = eng.run()
    assert list(out) == ["small"] and out["small"].status is Status.FINISHED
    assert out["small"].tokens == reference(small).tokens


def test_a_request_past_the_models_context_is_refused():
    eng = _engine()
    context = model().config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"past the model's context of {context}"):
        eng.add_request(Request("long", prompt=(1,) * 8, max_new_tokens=context - 7))
    eng.add_request(Request("fits", prompt=(1,) * 8, max_new_tokens=4))
    assert list(eng.run()) == ["fits"]


def _tight_workload(seed: int, temperature: float):
    return make_workload(vocab_size=model().config.vocab_size, num_requests=6, seed=seed,
                         det_fraction=0.75, prompt_len=(4, 14), max_new_tokens=(8, 16),
                         temperature=temperature, arrival_spread=3)


@pytest.mark.parametrize("cfg", [
    {},
    {"prefill_chunk": 3, "window": 2},
    {"verifier": "fixed", "group": 2, "mismatch_rate": 0.5},
    {"drafter": NgramDrafter(num_tokens=3), "mismatch_rate": 0.3},
], ids=["plain", "chunked", "fixed+mismatch", "drafter"])
def test_an_exhausted_pool_preempts_and_the_outputs_stay_the_references(cfg):
    """6 requests of up to 30 rows on 12 blocks of 4 rows: they cannot all hold their KV."""
    arrivals = _tight_workload(5, 0.8)
    eng = _engine(num_blocks=12, block_size=4, **cfg)
    outputs = run_workload(eng, arrivals)
    assert eng.metrics.preemptions > 0  # the pool did run out
    assert_matches_reference(arrivals, outputs)
    assert eng.pool.num_free == eng.pool.num_blocks


class _Overeager:
    """Declares 1 draft token and proposes as many as it is allowed (from a review)."""

    num_tokens = 1

    def propose(self, tokens, limit=None):
        return [tokens[-1]] * (limit or 1)


@pytest.mark.parametrize("verifier, num_blocks", [("fixed", 256), ("exact", 14), ("exact", 12)])
def test_a_drafter_past_its_num_tokens_is_cut_to_it(verifier, num_blocks):
    """Before: the fixed verifier's rows spilled into the next request's (a wrong output),
    and the exact one outgrew the reserved blocks (OutOfBlocksError from step())."""
    reqs = [Request("a", prompt=(5, 6, 7, 8), max_new_tokens=12),
            Request("b", prompt=(9, 10, 11), max_new_tokens=12)]
    eng = _engine(window=2, group=2, verifier=verifier, drafter=_Overeager(),
                  num_blocks=num_blocks, block_size=2)
    for req in reqs:
        eng.add_request(req)
    out = eng.run()
    for req in reqs:
        assert out[req.request_id].tokens == reference(req).tokens


def test_a_drafter_must_say_how_many_tokens_it_proposes():
    class Unbounded:
        def propose(self, tokens, limit=None):
            return []

    with pytest.raises(ValueError, match="the drafter must have an int num_tokens"):
        EngineConfig(drafter=Unbounded())


def test_without_the_reservation_the_same_load_runs_out_of_blocks(monkeypatch):
    """The control: with admission and preemption off (every request admitted at once, as
    before), the same workload raises OutOfBlocksError from step()."""
    def admit_all(self):
        while self._waiting:
            seq = self._waiting.pop(0)
            seq.order, seq.out.status = self._admitted, Status.RUNNING
            self._admitted += 1
            self._running.append(seq)

    monkeypatch.setattr(DVREngine, "_admit", admit_all)
    with pytest.raises(OutOfBlocksError):
        run_workload(_engine(num_blocks=12, block_size=4), _tight_workload(5, 0.8))


def _bad_request(rng: random.Random, i: int, vocab: int):
    """A request the engine must refuse, and what it raises."""
    kind = rng.randrange(4)
    if kind == 0:
        return lambda: Request(f"bad{i}", prompt=(1, 2), max_new_tokens=4,
                               sampling=SamplingParams(temperature=float("inf"))), ValueError
    if kind == 1:
        return lambda: Request(f"bad{i}", prompt=(1.5, 2), max_new_tokens=4), TypeError
    if kind == 2:
        return lambda: Request(f"bad{i}", prompt=(vocab, 1), max_new_tokens=4), ValueError
    return lambda: Request(f"bad{i}", prompt=tuple(range(40)), max_new_tokens=40), ValueError


def _check_invariants(eng: DVREngine, submitted: set[str]) -> None:
    waiting = [s.req.request_id for s in eng._waiting]
    running = [s.req.request_id for s in eng._running]
    assert len(set(waiting + running)) == len(waiting) + len(running)  # none duplicated
    assert set(eng.outputs) == submitted  # none lost, none invented
    for rid, out in eng.outputs.items():
        live = rid in waiting or rid in running
        assert live == (out.status in (Status.WAITING, Status.RUNNING)), rid
    held = [b for s in eng._running + eng._waiting for b in s.blocks]
    assert len(held) == len(set(held))  # no block in two sequences
    assert len(held) + eng.pool.num_free == eng.pool.num_blocks  # every block accounted for
    assert all(not s.blocks for s in eng._waiting)


@pytest.mark.parametrize("seed", range(8))
def test_soak(seed):
    rng = random.Random(seed)
    vocab = model().config.vocab_size
    eng = _engine(num_blocks=14, block_size=4, window=rng.choice([2, 4]), group=2,
                  mismatch_rate=rng.choice([0.0, 0.3]),
                  prefill_chunk=rng.choice([None, 4]))
    good: dict[str, Request] = {}
    cancelled: set[str] = set()
    for step in range(400):
        if step < 12 and rng.random() < 0.6:  # arrivals, bad ones mixed in
            i = len(good)
            if rng.random() < 0.25:
                make, error = _bad_request(rng, i, vocab)
                with pytest.raises(error):
                    eng.add_request(make())
            else:
                req = Request(f"r{i}", prompt=tuple(rng.randrange(vocab)
                                                    for _ in range(rng.randint(1, 12))),
                              max_new_tokens=rng.randint(1, 14),
                              sampling=SamplingParams(temperature=rng.choice([0.0, 0.9]),
                                                      seed=rng.getrandbits(64)),
                              deterministic=rng.random() < 0.8)
                eng.add_request(req)
                good[req.request_id] = req
        live = [s.req.request_id for s in eng._waiting + eng._running]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            eng.cancel(victim)
            cancelled.add(victim)
        if not eng.has_work and step >= 12:
            break
        eng.step()
        _check_invariants(eng, set(good))
    assert not eng.has_work, "wedged: work left after 400 steps"
    assert eng.pool.num_free == eng.pool.num_blocks
    for rid, req in good.items():
        out = eng.outputs[rid]
        if not req.deterministic:
            continue
        ref = reference(req)
        if rid in cancelled:  # what it committed before the cancel is the reference's prefix
            assert out.tokens == ref.tokens[:len(out.tokens)], rid
        else:
            assert out.status is Status.FINISHED, rid
            assert (out.tokens, out.logprobs) == (ref.tokens, ref.logprobs), rid

